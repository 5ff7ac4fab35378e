"""Interfaces written down as types: both worker pools implement `WorkerPool`, and the
controller uses a pool only through it."""

import ast
import inspect
from pathlib import Path

import pytest

from sweeper.sweep.pool import LocalPool, WorkerPool
from sweeper.sweep.workers import RayPool

CONTROLLER = Path(__file__).resolve().parents[1] / "sweeper" / "sweep" / "controller.py"


def protocol_members(proto) -> dict[str, object]:
    return {name: member for name, member in vars(proto).items()
            if not name.startswith("_") and inspect.isfunction(member)}


@pytest.mark.parametrize("pool", [LocalPool, RayPool])
def test_each_pool_has_every_method_of_the_protocol_with_its_parameters(pool):
    for name, member in protocol_members(WorkerPool).items():
        implemented = getattr(pool, name, None)
        assert implemented is not None, f"{pool.__name__}.{name} is missing"
        assert list(inspect.signature(implemented).parameters) == \
            list(inspect.signature(member).parameters), f"{pool.__name__}.{name}"


def test_a_local_pool_has_the_protocol_attributes():
    pool = LocalPool(parallel=2)
    for name in WorkerPool.__annotations__:
        assert hasattr(pool, name), name
    assert pool.local and len(pool.slot_cores) == 2


def test_the_controller_calls_only_what_the_protocol_declares():
    """Every `self.pool.<name>` in the controller is a member of `WorkerPool` (no getattr
    probing for methods only one pool has)."""
    declared = set(protocol_members(WorkerPool)) | set(WorkerPool.__annotations__)
    used = {node.attr for node in ast.walk(ast.parse(CONTROLLER.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "pool" and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"}
    assert used and used <= declared, sorted(used - declared)
    assert "getattr(self.pool" not in CONTROLLER.read_text()


def test_attributes_of_the_controller_are_set_in_its_constructor():
    """A newcomer reads one place for a Controller's state: `__init__`."""
    tree = ast.parse(CONTROLLER.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Controller")
    assigned: dict[str, set[str]] = {}
    for method in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(method):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                            and t.value.id == "self":
                        assigned.setdefault(method.name, set()).add(t.attr)
    outside = set().union(*(v for k, v in assigned.items() if k != "__init__"))
    assert outside <= assigned["__init__"], sorted(outside - assigned["__init__"])
