"""The small-row matmul formulations that benchmarks/engine_efficiency.py times against
`partitioning.matmul` (docs/performance.md, "Why decode is above its memory bound"): each
computes the engine's product, and the results section renders every one it timed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import engine_efficiency as ee
from benchmarks.render import engine_efficiency as render
from workloads import partitioning


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_each_formulation_computes_the_engines_product(rows):
    e, f = 64, 256
    x = jax.random.normal(jax.random.key(1), (rows, e), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (e, f), jnp.bfloat16)
    engine = np.asarray(partitioning.matmul(x, w), np.float32)
    scale = np.abs(engine).max()
    checked = 0
    for name, (_, fn, transposed, options, applies) in ee._small_row_formulations().items():
        if rows not in applies:
            continue
        out = jax.jit(fn).lower(x, w.T if transposed else w).compile(compiler_options=options or None)(
            x, w.T if transposed else w)
        assert out.shape == (rows, f) and out.dtype == jnp.bfloat16, name
        # f32 accumulation in another order: at most a bf16 rounding step (2^-7 of a value)
        np.testing.assert_allclose(np.asarray(out, np.float32), engine, rtol=0, atol=scale / 64,
                                   err_msg=name)
        checked += 1
    assert checked >= 4


def test_small_row_section_renders_every_timed_formulation(monkeypatch):
    monkeypatch.setattr(ee, "SMALL_ROW_SHAPES", ((64, 128), (128, 64)))
    monkeypatch.setattr(ee, "SMALL_ROWS", (1, 2))
    monkeypatch.setattr(ee, "PREFILL_ROWS", (4,))
    monkeypatch.setattr(ee, "SMALL_ROW_COPIES", 1)
    run = ee.small_row_matmul(rounds=1)
    assert {r["weight"] for r in run["rows"]} == {"w_in", "w_out"}
    today = [r for r in run["rows"] if r["form"] in ("dot", "dot_pad2")]
    assert {r["rows"] for r in today} == {1, 2, 4} and all(r["max_rel_diff"] == 0 for r in today)
    text = "\n".join(render._small_row_lines({"one_core": run}))
    for r in run["rows"]:
        assert r["formulation"] in text
    assert "| formulation | 1 row | 2 rows | 4 rows | max diff |" in text
