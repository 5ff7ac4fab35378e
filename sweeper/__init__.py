"""sweeper: sweeps of Transformer inference partitioning layouts (see docs/architecture.md)."""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "inference-sweeper"   # the name on PyPI (`sweeper` there is another project)


def installed_version() -> str:
    """The installed distribution's version (an editable install has one too), or 'unknown'
    when the code runs from a folder that was never installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"
