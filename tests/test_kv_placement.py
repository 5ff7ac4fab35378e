"""KV-cache bytes per device, read from the compiled decode program, agree with the cost model.

The number comes from the compiled program: the KV-cache argument's shard shape under the
decode program's input sharding (`measure.arg_bytes_per_device`). Paper §3.3 / Fig. 4:
batch-sharded multiquery attention holds 1/n of the cache on each chip; head-sharded
multiquery holds all of it (the single KV head is replicated); grouped-query attention
replicates each KV head over n/K chips (reference/tensor-parallelism-gqa.txt).
"""

import pytest

from workloads import costmodel
from workloads.measure import analyse, compile_trial
from workloads.trial import TrialConfig

BASE = dict(batch=4, input_len=8, decode_steps=2, repeats=1, chips=4)
# (trial, fraction of the whole cache one chip holds)
CASES = {
    # shapes shared with test_comm_pattern.py (compiled once per session)
    "mqa-batch": (dict(BASE, model="tiny", topology="2x2x1", prefill={"ffn": "wg_xy", "attn": "head"},
                       decode={"ffn": "ws2d", "attn": "batch"}), 1 / 4),
    "mqa-head-ws1d": (dict(BASE, model="tiny", topology="2x2x1", prefill={"ffn": "ws1d", "attn": "head"},
                           decode={"ffn": "ws1d", "attn": "head"}), 1),
    "mha-head": (dict(BASE, model="tiny-mha", topology="2x2x1", prefill={"ffn": "wg_x", "attn": "batch"},
                      decode={"ffn": "ws2d", "attn": "head"}), 1 / 4),
    "gqa2-batch": (dict(BASE, model="tiny-serial", topology="2x1x2", weights="int8",
                        prefill={"ffn": "wg_xyz", "attn": "head"},
                        decode={"ffn": "ws2d", "attn": "batch"}), 1 / 4),
    # head-sharded multiquery in the 2D layout, and GQA with K=2 < 4 head shards
    "mqa-head-ws2d": (dict(BASE, model="tiny", topology="2x2x1", prefill={"ffn": "ws2d", "attn": "batch"},
                           decode={"ffn": "ws2d", "attn": "head"}), 1),
    "gqa2-head": (dict(BASE, model="tiny-gqa", topology="2x2x1", prefill={"ffn": "ws2d", "attn": "head"},
                       decode={"ffn": "ws2d", "attn": "head"}), 1 / 2),
}


def whole_cache_bytes(trial: TrialConfig) -> int:
    m = trial.model
    return 2 * m.n_layers * trial.batch * trial.context_len * m.n_kv_heads * m.d_head * 2   # K and V, bf16


@pytest.mark.parametrize("name", list(CASES))
def test_kv_bytes_per_chip_from_the_compiled_program(name, engine_cache):
    spec, fraction = CASES[name]
    trial = TrialConfig.from_dict(spec).resolved()
    entry, _ = compile_trial(trial, engine_cache)
    compiled_kv = analyse(entry, trial.mesh_shape)["kv_bytes_per_chip"]
    model_kv = costmodel.kv_bytes_per_chip(trial.model, trial.chips, trial.batch, trial.context_len,
                                           trial.decode.attn, trial.mesh_shape, trial.decode.ffn)
    assert compiled_kv == pytest.approx(model_kv, rel=1e-6), \
        f"{name}: compiled program holds {compiled_kv:.0f} B of KV cache per chip, costmodel says {model_kv:.0f}"
    assert compiled_kv == pytest.approx(fraction * whole_cache_bytes(trial), rel=1e-6), \
        f"{name}: expected {fraction} of the whole cache per chip"


def test_batch_sharding_divides_the_multiquery_cache_by_the_chip_count(engine_cache):
    """The paper's point (§3.3): same model and shape, head- vs batch-sharded decode."""
    per_chip = {}
    for name in ("mqa-batch", "mqa-head-ws2d"):
        trial = TrialConfig.from_dict(CASES[name][0]).resolved()
        entry, _ = compile_trial(trial, engine_cache)
        per_chip[trial.decode.attn] = analyse(entry, trial.mesh_shape)["kv_bytes_per_chip"]
    assert per_chip["head"] == 4 * per_chip["batch"]
