"""Command-line overrides of a space file: `sweeper run SPACE --set params.batch=[4,8] --set trials=10`.

Each `--set KEY=VALUE` writes VALUE (parsed as YAML, so `[4,8]`, `true`, `2GiB` and
`{choices: [ws1d]}` mean what they mean in the file) at KEY, a dotted path into the
space document (`objectives.0.metric` indexes a list). The overrides are applied to the
document as read, BEFORE validation, so the space loader checks them exactly like the
file; an error about an overridden field names the override as well as the file.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from sweeper.spec.space import SearchSpace, load_space
from workloads.config import ConfigError, read_yaml

SYNTAX = "KEY=VALUE with KEY a dotted path into the space file, e.g. params.batch=[4,8] or trials=10"


@dataclasses.dataclass(frozen=True)
class Override:
    text: str              # as typed, for error messages
    path: tuple[str, ...]  # keys (list indices as digit strings)
    value: Any


def parse_override(text: str) -> Override:
    key, sep, raw = text.partition("=")
    path = tuple(key.strip().split(".")) if key.strip() else ()
    if not sep or not path or any(not part for part in path):
        raise ConfigError("--set", text, SYNTAX)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        first = str(err).splitlines()[0]
        raise ConfigError(f"--set {key}", raw, f"a YAML value ({first})") from None
    return Override(text, path, value)


def apply_overrides(data: Mapping, overrides: Iterable[Override]) -> dict:
    """A copy of the space document with every override written into it (in order)."""
    doc = yaml.safe_load(yaml.safe_dump(dict(data)))    # deep copy of plain YAML data
    for override in overrides:
        node: Any = doc
        for depth, part in enumerate(override.path):
            last = depth == len(override.path) - 1
            where = ".".join(override.path[:depth]) or "the space file"
            if isinstance(node, dict):
                if last:
                    node[part] = override.value
                else:
                    node = node.setdefault(part, {})
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                if last:
                    node[int(part)] = override.value
                else:
                    node = node[int(part)]
            else:
                accepted = (f"an index below {len(node)} into the list at {where}"
                            if isinstance(node, list) else
                            f"a path through mappings ({where} is {node!r}, not a mapping)")
                raise ConfigError(f"--set {'.'.join(override.path)}", override.text, accepted)
    return doc


def _tokens(field: str) -> list[str]:
    """`objectives[0].metric` and `objectives.0.metric` -> ['objectives', '0', 'metric']."""
    return [t for t in re.split(r"[.\[\]]+", field) if t]


def _touches(field: str, override: Override) -> bool:
    """Whether an error about `field` concerns what `override` wrote (one path contains the other)."""
    a, b = _tokens(field), list(override.path)
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]


def _file_is_valid(source: str) -> bool:
    try:
        load_space(source)
        return True
    except ConfigError:
        return False


def load_space_with_overrides(path: str | Path, overrides: Iterable[str] = ()) -> SearchSpace:
    """`load_space(path)` with `--set` overrides applied to the document before validation."""
    parsed = [parse_override(text) for text in overrides]
    if not parsed:
        return load_space(str(path))
    source = str(path)
    data = read_yaml(path)
    if not isinstance(data, Mapping):
        return load_space(source)            # the loader's own error for a non-mapping file
    doc = apply_overrides(data, parsed)
    try:
        space = load_space(doc, source)
    except ConfigError as err:
        mine = [o.text for o in parsed if _touches(err.field, o)]
        if not mine and _file_is_valid(source):
            # e.g. "no point of this space can run" after --set params.chips=[3]: the file
            # alone is fine, so together the overrides caused it
            mine = [o.text for o in parsed]
        if not mine:
            raise
        where = f"{source} with " + ", ".join(f"--set {t}" for t in mine)
        raise ConfigError(err.field, err.value, err.accepted, where) from None
    # The parent MLflow run logs the space's text: log what actually ran.
    header = "".join(f"# --set {o.text}\n" for o in parsed)
    text = f"# {source} with command-line overrides:\n{header}" + yaml.safe_dump(doc, sort_keys=False)
    return dataclasses.replace(space, text=text)
