"""workloads/validate.py is the one home of the generic value checks (integer, positive_int,
number, boolean, one_of, check_keys, from_text): a module elsewhere that defines its own fails
here, so the copies cannot come back (docs/architecture.md, "Conventions").

Read with `ast`, not by importing. Two signs of a copy: a module-level or nested function named
like a generic check, and a `ConfigError` whose accepted text is one of validate.py's own
messages typed again ("a positive integer", f"one of {list(CHOICES)}"). Domain checks
(check_topology, check_stages, validate_phase, ...) have names of their own and stay where they
are; a class's method (the measurements CSV reader's `integer`) adapts a check to its
input and is not counted.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sweeper", "workloads")
HOME = "workloads/validate.py"

GENERIC_NAME = re.compile(
    r"^_?(positive|positive_int|positive_integer|positive_number|positive_float|non_negative|"
    r"integer|int_flag|number|number_in|float_flag|one_of|choice|boolean|is_int|is_number|"
    r"from_text|as_float|check_keys)$")
GENERIC_MESSAGES = {"a positive integer", "a positive number", "a number >= 0", "true or false"}
GENERIC_FORMATS = ("one of {", "an integer >= {")
# Messages typed again in modules another change is rewriting, at most this many each: lower
# the count as they move to validate.py's checks, never raise it (none left).
PENDING: dict[str, int] = {}


def _functions(tree: ast.AST):
    """(name, line) of every function that is not a class's method."""
    methods = {id(node) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
               for node in cls.body}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(node) not in methods:
            yield node.name, node.lineno


def _retyped_messages(tree: ast.AST):
    """Lines of `ConfigError(field, value, accepted...)` whose `accepted` is a generic message."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ConfigError"
                and len(node.args) >= 3):
            continue
        accepted = node.args[2]
        if isinstance(accepted, ast.Constant) and accepted.value in GENERIC_MESSAGES:
            yield node.lineno
        elif isinstance(accepted, ast.JoinedStr) and len(accepted.values) == 2 and \
                isinstance(accepted.values[0], ast.Constant) and \
                f"{accepted.values[0].value}{{" in GENERIC_FORMATS and \
                _plain(accepted.values[1].value):
            yield node.lineno


def _plain(node: ast.AST) -> bool:
    """A name, or list() of one: the whole of what a generic message formats."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "list" and node.args:
        node = node.args[0]
    return isinstance(node, (ast.Name, ast.Attribute))


def copies(source: str, path: str) -> list[str]:
    tree = ast.parse(source, path)
    found = [f"{path}:{line}: def {name}" for name, line in _functions(tree)
             if GENERIC_NAME.match(name)]
    return found + [f"{path}:{line}: ConfigError with a generic message"
                    for line in _retyped_messages(tree)]


def project_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
            if p.relative_to(ROOT).as_posix() != HOME]


def test_the_checker_finds_a_copied_validator():
    planted = ('def _positive(value, flag):\n'
               '    if value < 1:\n'
               '        raise ConfigError(flag, value, "a positive integer")\n'
               'def outer():\n'
               '    def number(key):\n'
               '        return key\n'
               'def check(x):\n'
               '    raise ConfigError("ffn", x, f"one of {list(FFN_LAYOUTS)}")\n')
    assert [c.split(": ", 1)[1] for c in copies(planted, "m.py")] == [
        "def _positive", "def number", "ConfigError with a generic message",
        "ConfigError with a generic message"]


def test_the_checker_leaves_methods_and_domain_checks_alone():
    source = ('class Row:\n'
              '    def integer(self, column):\n'
              '        return validate.integer(column, 1)\n'
              'def check_topology(t, chips):\n'
              '    raise ConfigError("topology", t, f"one of {list(T)} (with chips={chips})")\n'
              'def accepted():\n'
              '    raise ConfigError("x", 1, "a positive integer (required)")\n')
    assert copies(source, "m.py") == []


def test_the_validators_module_defines_the_generic_checks():
    names = {name for name, _ in _functions(ast.parse((ROOT / HOME).read_text()))}
    assert {"integer", "positive_int", "number", "boolean", "one_of", "check_keys",
            "from_text", "is_int", "is_number"} <= names


@pytest.mark.parametrize("path", project_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_module_reimplements_a_generic_validator(path):
    rel = path.relative_to(ROOT).as_posix()
    found = copies(path.read_text(), rel)
    retyped = [c for c in found if c.endswith("generic message")]
    allowed = PENDING.get(rel, 0)
    assert len(retyped) <= allowed and len(found) == len(retyped), (
        f"{rel} re-implements a check of {HOME}: call it instead "
        f"(integer, positive_int, number, boolean, one_of, from_text): {found}")


# ----------------------------------------------------------------------------- the checks


def test_the_checks_word_their_bounds_in_one_line():
    from workloads.validate import ConfigError, integer, number, positive_int

    cases = [(lambda: integer("--seed", -1, minimum=0, maximum=2**31 - 1),
              "--seed: got -1; expected an integer from 0 to 2,147,483,647"),
             (lambda: positive_int("chips", True, "m.yaml"),
              "m.yaml: chips: got True; expected a positive integer"),
             (lambda: number("kv_fraction", 1.5, positive=True, maximum=1),
              "kv_fraction: got 1.5; expected a number in (0, 1]"),
             (lambda: number("overlap", float("nan"), maximum=1),
              "overlap: got nan; expected a number in [0, 1]"),
             (lambda: number("--ttft", 0, positive=True, what="a positive number of seconds"),
              "--ttft: got 0; expected a positive number of seconds")]
    for call, line in cases:
        with pytest.raises(ConfigError) as err:
            call()
        assert str(err.value) == line


def test_from_text_parses_a_flag_and_leaves_anything_else_for_the_check_to_echo():
    from workloads.validate import from_text

    assert from_text(" 12 ") == 12 and from_text("0", float) == 0 and from_text("0.5", float) == 0.5
    assert from_text("1.5") == "1.5" and from_text("fast", float) == "fast"
    assert from_text(True) is True and from_text(None) is None and from_text([1]) == [1]
