"""Interfaces written down as types: both worker pools implement `WorkerPool`."""

import inspect

import pytest

from sweeper.sweep.workers import LocalPool, RayPool, WorkerPool


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
