"""The paper's communication pattern, checked on the compiled programs (XLA's optimized HLO).

- batch-sharded attention contains all-to-alls (paper Fig. 4c/5b); ws1d with head-sharded
  attention contains none (Fig. 2a);
- weight-gathered layouts all-gather the stored weights (Fig. A.2); weight-stationary ones
  never move a weight;
- per collective kind, the elements moved per device agree with
  `layouts.forward_collectives` within 10%. Elements, not bytes: the XLA CPU backend runs
  bf16 collectives in f32 (`f32[...] all-gather(convert(...))`); the dtype seen is reported.
  The ops `layouts.LEFT_OUT` lists (norm statistics, an argmax gather) are skipped by size
  (`hlo_check.left_out`, the tests' compiled-program check).

The first tests pin the HLO parser itself on hand-written shard_map programs whose
collectives are known exactly.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import hlo_check
from workloads import hlo
from workloads.layouts import GATHER_AXES, forward_collectives
from workloads.measure import analyse, compile_trial
from workloads.trial import TrialConfig

TOLERANCE = 0.10

# Small trials covering every FFN family, both attention layouts, MQA/MHA/GQA, both blocks,
# int8 and three mesh shapes. test_kv_placement.py and test_measure.py reuse some shapes.
BASE = dict(batch=4, input_len=8, decode_steps=2, repeats=1)
CASES = {
    "mqa-wgxy-ws2d-batch": dict(BASE, model="tiny", chips=4, topology="2x2x1",
                                prefill={"ffn": "wg_xy", "attn": "head"},
                                decode={"ffn": "ws2d", "attn": "batch"}),
    "mqa-ws1d-head": dict(BASE, model="tiny", chips=4, topology="2x2x1",
                          prefill={"ffn": "ws1d", "attn": "head"},
                          decode={"ffn": "ws1d", "attn": "head"}),
    "mha-wgx-batch-ws2d-head": dict(BASE, model="tiny-mha", chips=4, topology="2x2x1",
                                    prefill={"ffn": "wg_x", "attn": "batch"},
                                    decode={"ffn": "ws2d", "attn": "head"}),
    "serial-int8-wgxyz-ws2d-batch": dict(BASE, model="tiny-serial", chips=4, topology="2x1x2",
                                         weights="int8",
                                         prefill={"ffn": "wg_xyz", "attn": "head"},
                                         decode={"ffn": "ws2d", "attn": "batch"}),
    # Figure 5b in 1D weight-stationary (multiquery: K/V projected per batch shard, no K/V
    # communication), and a model whose 6 heads are padded to 8 (paper §4).
    "mqa-ws1d-batch": dict(BASE, model="tiny", chips=4, topology="1x2x2",
                           prefill={"ffn": "ws1d", "attn": "batch"},
                           decode={"ffn": "ws1d", "attn": "batch"}),
    "padded6-ws2d-batch": dict(BASE, model=dict(name="six-heads", d_model=64, d_ff=256, n_layers=2,
                                                n_heads=6, n_kv_heads=1, d_head=16, vocab=64),
                               chips=4, topology="2x2x1", pad_heads="auto",
                               prefill={"ffn": "ws2d", "attn": "head"},
                               decode={"ffn": "ws2d", "attn": "batch"}),
    # Mixture of experts (tiny-moe: 4 experts, top-2): tp runs the experts in the dense
    # layout (ws2d: the router's logits all-reduced over x); ep dispatches tokens by
    # all-to-all over R, from 1D weight-stationary and from wg_x (experts gathered over x).
    "moe-tp-ws2d-batch": dict(BASE, model="tiny-moe", chips=4, topology="2x2x1", experts="tp",
                              prefill={"ffn": "ws2d", "attn": "head"},
                              decode={"ffn": "ws2d", "attn": "batch"}),
    "moe-ep-ws1d": dict(BASE, model="tiny-moe", chips=4, topology="1x2x2", experts="ep",
                        prefill={"ffn": "ws1d", "attn": "head"},
                        decode={"ffn": "ws1d", "attn": "batch"}),
    "moe-ep-wgx-int8": dict(BASE, model="tiny-moe", chips=4, topology="2x2x1", experts="ep",
                            weights="int8", prefill={"ffn": "wg_x", "attn": "head"},
                            decode={"ffn": "wg_x", "attn": "head"}),
}
PHASES = ("prefill", "decode")


# --------------------------------------------------------------------------- the parser


@pytest.fixture(scope="module")
def mesh4():
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2, 1), ("x", "y", "z"))


def compiled_ops(fn, mesh, in_specs, out_specs, *args):
    program = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    return hlo.collective_ops(program.lower(*args).compile().as_text(), (2, 2, 1))


def test_parser_sizes_each_kind_by_the_layouts_convention(mesh4):
    """AG: output; RS: input; A2A: the tensor; AR: the tensor — per device."""
    def fn(a, w):
        g = jax.lax.all_gather(a, ("x", "y"), axis=0, tiled=True)       # [16, 8] per device
        s = jax.lax.psum_scatter(g @ w, ("x", "y"), scatter_dimension=0, tiled=True)  # in [16, 8]
        t = jax.lax.all_to_all(s, "x", 1, 1, tiled=True)                 # [4, 8]
        return jax.lax.psum(t, "y")                                      # [4, 8]

    a, w = jnp.ones((16, 8), jnp.bfloat16), jnp.ones((8, 8), jnp.bfloat16)
    ops = compiled_ops(fn, mesh4, (P(("x", "y")), P()), P(("x", "y")), a, w)
    by_kind = {op.kind: op for op in ops}
    assert set(by_kind) == {"all-gather", "reduce-scatter", "all-to-all", "all-reduce"}, hlo_check.describe(ops)
    assert (by_kind["all-gather"].elements, by_kind["all-gather"].axes) == (16 * 8, ("x", "y"))
    assert (by_kind["reduce-scatter"].elements, by_kind["reduce-scatter"].axes) == (16 * 8, ("x", "y"))
    assert (by_kind["all-to-all"].elements, by_kind["all-to-all"].axes) == (4 * 8, ("x",))
    assert (by_kind["all-reduce"].elements, by_kind["all-reduce"].axes) == (4 * 8, ("y",))
    assert all(op.multiplicity == 1 for op in ops)
    for op in ops:   # bf16 data; the CPU backend may run it in f32, and then says so
        assert op.dtype == "bf16" or (op.dtype == "f32" and op.upcast_from == "bf16"), op


def test_parser_multiplies_collectives_inside_a_loop(mesh4):
    """A collective in a scanned body runs once per iteration (while known_trip_count)."""
    def fn(c):
        def body(carry, _):
            full = jax.lax.all_gather(carry, "x", axis=1, tiled=True)
            return full[:, :carry.shape[1]] * 2, None
        return jax.lax.scan(body, c, None, length=3)[0]

    ops = compiled_ops(fn, mesh4, P("x"), P("x"), jnp.ones((8, 8), jnp.float32))
    gathers = [op for op in ops if op.kind == "all-gather"]
    assert sum(op.multiplicity for op in gathers) == 3, hlo_check.describe(ops)
    assert hlo.summarize(ops)[0].elements_per_chip == 3 * 4 * 16


def test_parser_counts_async_pairs_once_and_reads_iota_groups():
    """GPU/TPU-style text: -start/-done pairs, async-wrapped reduce-scatter, iota groups."""
    text = """HloModule m, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped_rs (p: f32[8,4]) -> f32[2,4] {
  %p = f32[8,4]{1,0} parameter(0)
  ROOT %rs = f32[2,4]{1,0} reduce-scatter(%p), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
}

ENTRY %main (x: bf16[2,4]) -> f32[2,4] {
  %x = bf16[2,4]{1,0} parameter(0)
  %ags = (bf16[2,4]{1,0}, bf16[4,4]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}
  %agd = bf16[4,4]{1,0} all-gather-done(%ags)
  %c = f32[8,4]{1,0} convert(%agd)
  %rss = ((f32[8,4]{1,0}), f32[2,4]{1,0}) async-start(%c), calls=%wrapped_rs
  %rsd = f32[2,4]{1,0} async-done(%rss), calls=%wrapped_rs
  %ars = f32[2,4]{1,0} all-reduce-start(%rsd), channel_id=3, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %ard = f32[2,4]{1,0} all-reduce-done(%ars)
}
"""
    ops = hlo.collective_ops(text, (2, 2, 1))
    assert [op.kind for op in sorted(ops, key=lambda o: o.kind)] == \
        ["all-gather", "all-reduce", "reduce-scatter"], hlo_check.describe(ops)
    by_kind = {op.kind: op for op in ops}
    assert by_kind["all-gather"].groups == [[0, 2], [1, 3]]
    assert by_kind["all-gather"].axes == ("x",)
    assert by_kind["all-gather"].elements == 16 and by_kind["all-gather"].dtype == "bf16"
    assert by_kind["all-gather"].from_parameter == 0
    assert by_kind["reduce-scatter"].elements == 32 and by_kind["reduce-scatter"].group_size == 4
    assert by_kind["all-reduce"].axes == ("y",) and by_kind["all-reduce"].elements == 8


# --------------------------------------------------------------------------- the engine


def trial_of(name: str) -> TrialConfig:
    return TrialConfig.from_dict(CASES[name]).resolved()


@pytest.fixture(scope="module")
def programs(engine_cache):
    """name -> (trial, analysis, number of weight leaves), compiled once per session."""
    out = {}
    for name in CASES:
        trial = trial_of(name)
        entry, _ = compile_trial(trial, engine_cache)
        out[name] = (trial, analyse(entry, trial.mesh_shape), len(jax.tree.leaves(entry.engine.params)))
    return out


def phase_ops(programs, name, phase):
    trial, analysis, _ = programs[name]
    return analysis["collective_ops"][phase]


def expected(trial: TrialConfig, phase: str):
    layout = getattr(trial, phase)
    seq = trial.input_len if phase == "prefill" else 1
    return forward_collectives(trial.run_model, trial.mesh_shape, layout, trial.batch, seq, trial.weights,
                               trial.experts)


PAIRS = [(name, phase) for name in CASES for phase in PHASES]


@pytest.mark.parametrize("name,phase", PAIRS)
def test_all_to_all_exactly_when_attention_is_batch_sharded(programs, name, phase):
    """...or when expert parallelism dispatches tokens (GShard: one all-to-all out, one back)."""
    trial = programs[name][0]
    ops = phase_ops(programs, name, phase)
    a2a = [op for op in ops if op.kind == "all-to-all"]
    dispatch = trial.experts == "ep" and trial.model.moe
    if getattr(trial, phase).attn == "batch" or dispatch:
        assert a2a, f"batch-sharded attention or ep without an all-to-all:\n{hlo_check.describe(ops)}"
    else:
        assert not a2a, f"head-sharded attention with all-to-alls:\n{hlo_check.describe(ops)}"
    if dispatch and getattr(trial, phase).attn == "head":
        layers = trial.model.n_layers
        assert sum(op.multiplicity for op in a2a) == 2 * layers, hlo_check.describe(ops)


@pytest.mark.parametrize("phase", PHASES)
def test_ws1d_moves_no_heads(programs, phase):
    ops = phase_ops(programs, "mqa-ws1d-head", phase)
    assert not [op for op in ops if op.kind == "all-to-all"], hlo_check.describe(ops)


@pytest.mark.parametrize("name,phase", PAIRS)
def test_weights_move_only_in_weight_gathered_layouts(programs, name, phase):
    """An all-gather whose operand is a weight parameter (directly, or through the CPU
    backend's f32 convert) is a weight gather; count and sizes must match layouts.py."""
    trial, _, n_weight_leaves = programs[name]
    ops = phase_ops(programs, name, phase)
    weight_gathers = [op for op in ops if op.kind == "all-gather" and op.from_parameter is not None
                      and op.from_parameter < n_weight_leaves]
    ffn = getattr(trial, phase).ffn
    if not GATHER_AXES[ffn]:
        assert not weight_gathers, f"{ffn} all-gathers a weight:\n{hlo_check.describe(weight_gathers)}"
        return
    want = [c for c in expected(trial, phase) if c.what.startswith("weights.")]
    assert sum(op.multiplicity for op in weight_gathers) == sum(c.count for c in want), \
        hlo_check.describe(weight_gathers, want)
    assert sorted(op.elements for op in weight_gathers) == \
        sorted(c.elements for c in want for _ in range(c.count)), hlo_check.describe(weight_gathers, want)
    if trial.weights == "int8":   # int8 weights travel as int8 (paper §3.6)
        assert {op.dtype for op in weight_gathers} == {"s8"}, hlo_check.describe(weight_gathers)


@pytest.mark.parametrize("name,phase", PAIRS)
def test_elements_per_kind_agree_with_layouts(programs, name, phase, record_property):
    trial = programs[name][0]
    ops = phase_ops(programs, name, phase)
    want = expected(trial, phase)
    tokens = trial.batch * (trial.input_len if phase == "prefill" else 1)
    comparison = hlo_check.compare_with_layouts(ops, want, tokens, trial.batch, trial.chips)
    record_property("dtype_seen", {k: c.dtype_seen for k, c in comparison.items()})
    bad = {k: c for k, c in comparison.items() if c.relative_error > TOLERANCE}
    report = "; ".join(f"{k}: compiled {c.compiled_elements} elements in {c.compiled_count} ops vs "
                       f"layouts.py {c.expected_elements} in {c.expected_count} "
                       f"({100 * c.relative_error:.1f}% off)" for k, c in bad.items())
    assert not bad, f"{name} {phase}: {report}\n{hlo_check.describe(ops, want)}"
    # What was skipped is only what layouts.LEFT_OUT names: small norm-statistic all-reduces.
    for c in comparison.values():
        skipped = [op for op in ops if op.name in c.skipped]
        assert all(op.kind == "all-reduce" and op.elements <= tokens for op in skipped), \
            hlo_check.describe(skipped)


@pytest.mark.parametrize("name,phase", PAIRS)
def test_each_collective_runs_over_the_axes_layouts_names(programs, name, phase):
    """Finer than per kind: elements per (kind, mesh axes) agree too (size-1 axes dropped)."""
    trial = programs[name][0]
    sizes = dict(zip("xyz", trial.mesh_shape))
    tokens = trial.batch * (trial.input_len if phase == "prefill" else 1)
    ops = [op for op in phase_ops(programs, name, phase)
           if not hlo_check.left_out(op, tokens, trial.batch, trial.chips)]
    compiled, want = {}, {}
    for op in ops:
        key = (op.kind, op.axes)
        compiled[key] = compiled.get(key, 0) + op.total_elements
    for c in expected(trial, phase):
        key = (c.kind, tuple(a for a in c.axes if sizes[a] > 1))
        want[key] = want.get(key, 0) + c.elements * c.count
    assert set(compiled) == set(want), hlo_check.describe(phase_ops(programs, name, phase), expected(trial, phase))
    for key in want:
        assert math.isclose(compiled[key], want[key], rel_tol=TOLERANCE), (key, compiled[key], want[key])


def test_figure_5b_batch_sharded_multiquery_moves_no_whole_batch_kv(programs):
    """Paper Fig. 5b: with batch-sharded attention no chip computes K/V for sequences it
    does not hold. 2D weight-stationary: the yz-group's partial K/V is reduce-scattered over
    x along the batch (2·T·K·D/YZ per chip) — no all-reduce of the whole batch's K/V
    (2·T·K·D, head-sharded attention's). 1D: no K/V communication at all."""
    trial = programs["mqa-wgxy-ws2d-batch"][0]
    t, (_, y, z) = trial.batch, trial.mesh_shape
    kv = 2 * t * trial.model.n_kv_heads * trial.model.d_head
    decode = expected(trial, "decode")
    assert [(c.kind, c.axes, c.elements) for c in decode if c.what.startswith("attn.kv")] == \
        [("reduce-scatter", ("x",), kv // (y * z))]
    ops = phase_ops(programs, "mqa-wgxy-ws2d-batch", "decode")
    big_all_reduces = [op for op in ops if op.kind == "all-reduce"
                       and not hlo_check.left_out(op, t, trial.batch, trial.chips)]
    assert not big_all_reduces, hlo_check.describe(ops, decode)
    head = forward_collectives(trial.model, trial.mesh_shape, dataclasses.replace(trial.decode, attn="head"),
                               trial.batch, 1)
    assert [(c.kind, c.elements) for c in head if c.what == "attn.kv"] == [("all-reduce", kv)]

    one_d = programs["mqa-ws1d-batch"][0]
    for phase in PHASES:
        want = expected(one_d, phase)
        assert not [c for c in want if c.what.startswith("attn.kv")], want
        kinds = {op.kind for op in phase_ops(programs, "mqa-ws1d-batch", phase)
                 if not hlo_check.left_out(op, t * (one_d.input_len if phase == "prefill" else 1),
                                           one_d.batch, one_d.chips)}
        assert kinds == {"all-gather", "reduce-scatter", "all-to-all"}, kinds


def test_padded_heads_are_in_the_communication(programs):
    """6 heads on 4 chips run as 8 (auto): Q and the attention output move 8 heads' worth."""
    trial = programs["padded6-ws2d-batch"][0]
    assert trial.model.n_heads == 6 and trial.run_model.n_heads == 8
    q = [c for c in expected(trial, "decode") if c.what == "attn.q_to_batch"]
    assert q and q[0].elements == trial.batch * 8 * trial.model.d_head // trial.chips


def test_a_decomposed_all_reduce_is_credited_not_flagged():
    """Some backends run an all-reduce of N elements as RS (input N) + AG (output N)."""
    from workloads.layouts import Collective

    want = [Collective("all-reduce", ("x",), 256, 2, 2, "attn.kv"),
            Collective("all-gather", ("x",), 1024, 2, 2, "ffn.out")]
    ops = [hlo.CollectiveOp("all-gather", "ag", "main", "f32", 1024, 4096, 2, multiplicity=2),
           hlo.CollectiveOp("reduce-scatter", "rs", "main", "f32", 256, 1024, 2, multiplicity=2),
           hlo.CollectiveOp("all-gather", "ag2", "main", "f32", 256, 1024, 2, multiplicity=2)]
    comparison = hlo_check.compare_with_layouts(ops, want, tokens=4, batch=4, n_chips=4)
    assert all(c.relative_error == 0 for c in comparison.values()), comparison
    assert comparison["all-reduce"].decomposed_all_reduce == 512
    # without the matching pair it stays a mismatch
    comparison = hlo_check.compare_with_layouts(ops[:1], want, tokens=4, batch=4, n_chips=4)
    assert comparison["all-reduce"].relative_error == 1.0
