"""Print the project's requirements, with the named extras, one a line, from pyproject.toml alone.

    python requirements.py postgres        (or cuda,postgres; tpu,postgres)

deploy/Dockerfile installs these before it copies the code, so the layer that holds the
dependencies is rebuilt only when pyproject.toml changes. An unknown extra is one line on
stderr and exit code 2.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"requirements.py: EXTRAS: got {','.join(unknown)!r}; expected extras "
                         f"of {project['name']}: {', '.join(optional)}")
    return [*project["dependencies"], *(r for e in extras for r in optional[e])]


def main(argv: list[str]) -> int:
    extras = [e.strip() for e in (argv[1] if len(argv) > 1 else "").split(",") if e.strip()]
    here = Path(__file__).resolve().parent
    pyproject = next(p for p in (here / "pyproject.toml", here.parent / "pyproject.toml")
                     if p.is_file())
    try:
        print("\n".join(requirements(pyproject, extras)))
    except SystemExit as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
