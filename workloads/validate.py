"""Input checks shared by every reader of user input (YAML files, CLI flags, search spaces).

A user error is a `ConfigError`: one line naming the file, the field, the value and what is
accepted; the CLI prints it and exits with code 2 (docs/architecture.md, "Conventions").
Plain Python, imported by everything, importing nothing of the project.

The one home of the generic value checks (integer, positive_int, number, boolean, one_of,
check_keys; from_text for a flag's text): other modules call them and keep only their
domain checks, and tests/test_imports.py fails on a module that defines its own.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Iterable, Mapping


class ConfigError(ValueError):
    """A user-input error: one line, names file, field, value and what is accepted."""

    def __init__(self, field: str, value: Any, accepted: str, source: str | None = None):
        self.field, self.value, self.accepted, self.source = field, value, accepted, source
        where = f"{bounded(source)}: " if source else ""
        # user input is echoed bounded: a 50 MB value must not become a 50 MB error line
        super().__init__(f"{where}{bounded(field)}: got {bounded(repr(value))}; expected {accepted}")


ECHO_CHARS = 200    # how much of a user value an error line repeats (a long path fits)


def bounded(text: Any, limit: int = ECHO_CHARS) -> str:
    """`text` cut to `limit` characters plus '…(N chars)', on one line."""
    text = str(text)
    if len(text) <= limit:
        return " ".join(text.split()) if "\n" in text else text
    return " ".join(text[:limit].split()) + f"…({len(text)} chars)"


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


def is_int(value: Any) -> bool:
    """An int and not a bool (YAML's `true` is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float and not a bool (NaN and infinities included)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def from_text(value: Any, kind: type = int) -> Any:
    """A flag's or a cell's text as an int or (`kind=float`) a number, whole text as an int
    ("0" echoes as 0, not 0.0); anything else, or text that is not one, unchanged, so the
    check it is passed to refuses it echoing what was written
    (`integer("--seed", from_text(args.seed), minimum=0)`)."""
    if not isinstance(value, str):
        return value
    for parse in (int, float) if kind is float else (kind,):
        try:
            return parse(value.strip())
        except ValueError:
            pass
    return value


def _check(ok: bool, field: str, value: Any, accepted: str, source: str | None) -> None:
    if not ok:
        raise ConfigError(field, value, accepted, source)


def integer(field: str, value: Any, source: str | None = None, minimum: int = 1,
            maximum: int | None = None, what: str | None = None) -> int:
    """An integer >= `minimum` (and <= `maximum`): the trial fields' `minimum` metadata is 0
    for seed, warmup and decode_steps, 1 for the rest (workloads/trial.py). `what`: the
    accepted values in other words ("a positive integer")."""
    accepted = what or (f"an integer >= {minimum}" if maximum is None
                        else f"an integer from {minimum} to {maximum:,}")
    _check(is_int(value) and value >= minimum and (maximum is None or value <= maximum),
           field, value, accepted, source)
    return value


def positive_int(field: str, value: Any, source: str | None = None) -> int:
    """`integer(minimum=1)`, worded for model fields and command-line flags."""
    return integer(field, value, source, 1, what="a positive integer")


def number(field: str, value: Any, source: str | None = None, minimum: float = 0.0,
           positive: bool = False, maximum: float | None = None, what: str | None = None) -> float:
    """A finite int or float >= `minimum` (> 0 when `positive`; <= `maximum`), as a float.
    `what`: the accepted values in other words ("a positive number of seconds")."""
    if what is None:
        what = "a positive number" if positive else f"a number >= {minimum:g}"
        if maximum is not None:
            what = (f"a number in (0, {maximum:g}]" if positive
                    else f"a number in [{minimum:g}, {maximum:g}]")
    ok = (is_number(value) and math.isfinite(value)
          and (value > 0 if positive else value >= minimum) and (maximum is None or value <= maximum))
    _check(ok, field, value, what, source)
    return float(value)


def boolean(field: str, value: Any, source: str | None = None) -> bool:
    _check(isinstance(value, bool), field, value, "true or false", source)
    return value


def one_of(field: str, value: Any, choices: Iterable[Any], source: str | None = None,
           what: str = "one of", suggest: bool = False) -> Any:
    """`value` if it is one of `choices`; else a ConfigError (with a suggestion if `suggest`)."""
    choices = list(choices)
    if value in choices:
        return value
    hint = did_you_mean(value, choices) if suggest else ""
    raise ConfigError(field, value, f"{what} {choices}{hint}", source)
