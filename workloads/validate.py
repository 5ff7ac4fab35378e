"""Input checks shared by every reader of user input (YAML files, CLI flags, search spaces).

A user error is a `ConfigError`: one line naming the file, the field, the value and what is
accepted; the CLI prints it and exits with code 2 (docs/architecture.md, "Conventions").
Plain Python, imported by everything, importing nothing of the project.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable, Mapping


class ConfigError(ValueError):
    """A user-input error: one line, names file, field, value and what is accepted."""

    def __init__(self, field: str, value: Any, accepted: str, source: str | None = None):
        self.field, self.value, self.accepted, self.source = field, value, accepted, source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field}: got {value!r}; expected {accepted}")


def did_you_mean(value: Any, choices: Iterable[Any]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or ''."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_keys(mapping: Mapping, allowed: Iterable[str], where: str | None, prefix: str = "") -> None:
    """Unknown keys are errors, with a 'did you mean' suggestion."""
    allowed = list(allowed)
    for key in mapping:
        if key not in allowed:
            raise ConfigError(f"{prefix}{key}", mapping[key], f"one of the known fields "
                              f"{sorted(allowed)}{did_you_mean(key, allowed)}", where)


def positive_int(field: str, value: Any, source: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(field, value, "a positive integer", source)
    return value


def one_of(field: str, value: Any, choices: Iterable[Any], source: str | None = None,
           what: str = "one of", suggest: bool = False) -> Any:
    """`value` if it is one of `choices`; else a ConfigError (with a suggestion if `suggest`)."""
    choices = list(choices)
    if value in choices:
        return value
    hint = did_you_mean(value, choices) if suggest else ""
    raise ConfigError(field, value, f"{what} {choices}{hint}", source)
