"""Chunked prefill and prefix caching in the engine's real serving loop (issue 38 item 4):
the slot server's aggregated loop with prefill chunks mixed into its decode steps, and with
a shared prefix whose KV it computed at set-up, completes every request with the unsharded
reference's tokens (`reference_generation`, no chunks, no cache); the disaggregated prefill
slice uses the prefix cache too; `sweeper serve` serves a plan with `prefill.chunk` and a
profile with `--prefix-len` on Ray mesh workers (slow + ci_slow).
"""

import json
import queue

import numpy as np
import pytest

from sweeper.cli import main
from workloads.config import MODEL_PRESETS, ConfigError
from workloads.layouts import PhaseLayout
from workloads.serving.profile import Request

MODEL = MODEL_PRESETS["tiny-serial"]     # untied embeddings: varied greedy tokens
SEED = 3                                 # the prompts'


def stream(cached: int) -> list[Request]:
    """A burst of five requests of mixed lengths; the second and fourth start with the
    shared prefix (`cached` tokens of it), one answer of a single token."""
    lengths = [(9, 4), (11, 3), (7, 1), (10, 5), (9, 3)]
    return [Request(0.0, i, o, cached_len=cached if k in (1, 3) else 0)
            for k, (i, o) in enumerate(lengths)]


def prompts_of(reqs: list[Request], prefix_len: int) -> list[np.ndarray]:
    from sweeper.serving.server import request_prompt

    return [request_prompt(MODEL, i, r.input_len, SEED, r.cached_len, prefix_len)
            for i, r in enumerate(reqs)]


def assert_reference_tokens(reqs, prompts, served) -> None:
    from workloads.serving.slots import reference_generation

    for i, (r, prompt, record) in enumerate(zip(reqs, prompts, served)):
        _, ref = reference_generation(MODEL, 0, prompt, r.output_len - 1)
        assert record["tokens"] == [int(t) for t in ref], f"request {i}"
        assert record["finish_s"] >= record["first_token_s"]


def server_for(chunk: int, prefix_len: int, prefill=("ws2d", "head"), decode=("ws2d", "batch"),
               slots: int = 2, topology=(1, 1, 2), prefill_batch: int = 1):
    from workloads.serving.slots import SlotServer, SlotSpec

    return SlotServer(SlotSpec(MODEL, topology, PhaseLayout(*prefill), PhaseLayout(*decode),
                               slots=slots, prefill_batch=prefill_batch, context_len=18,
                               chunk=chunk, prefix_len=prefix_len))


@pytest.mark.parametrize("chunk,prefix_len", [(3, 5), (4, 0)])
def test_chunked_aggregated_loop_gives_the_reference_tokens(chunk, prefix_len):
    """Chunks of 3 or 4 tokens (ragged last chunks) interleaved with decode steps on two
    slots, with and without a cached prefix: every request completes with the reference's
    tokens; the call log has one chunk per ceil((input_len - cached_len) / chunk), each
    after a decode step while any slot was busy; the chunks compiled one program."""
    from workloads.serving.slots import serve_aggregated

    from workloads.engine import _extend_program

    server = server_for(chunk, prefix_len)
    reqs = stream(prefix_len)
    prompts = prompts_of(reqs, prefix_len)
    calls: list = []
    extend = _extend_program(server.mesh, server.engine.prefill_plan, False)
    compiled = extend._cache_size()         # the prefix's extend: compiled at set-up
    served = serve_aggregated(server, reqs, lambda i: prompts[i], calls=calls)
    assert_reference_tokens(reqs, prompts, served)
    # ragged last chunks of 1 to chunk - 1 tokens, padded: one program for every chunk
    assert extend._cache_size() - compiled <= 1
    chunks = [c for c in calls if c[0] == "chunk"]
    for i, r in enumerate(reqs):
        mine = [c for c in chunks if c[3] == i]
        assert len(mine) == -(-(r.input_len - r.cached_len) // chunk), f"request {i}"
        assert sum(c[4] for c in mine) == r.input_len - r.cached_len
        assert mine[-1][5] == served[i]["first_token_s"]
    assert not [c for c in calls if c[0] == "prefill"]       # no whole-prompt calls
    # chunks mixed into decode: some chunk came right after a decode step
    kinds = [c[0] for c in calls]
    assert any(a == "step" and b == "chunk" for a, b in zip(kinds, kinds[1:]))


def test_prefix_cached_whole_prompt_calls_give_the_reference_tokens():
    """Without chunks, the prompts that hit the prefix are prefilled as one extend of their
    rest from the prefix's KV (two prompts per call: the two hits share a call, padded
    rows start with the prefix too); every token the reference's."""
    from workloads.serving.slots import serve_aggregated

    server = server_for(0, 6, prefill=("ws2d", "head"), decode=("ws2d", "head"),
                        slots=4, prefill_batch=2)
    reqs = stream(6)
    reqs[3] = Request(0.0, 11, 4, cached_len=6)           # the same shape as request 1
    prompts = prompts_of(reqs, 6)
    calls: list = []
    served = serve_aggregated(server, reqs, lambda i: prompts[i], calls=calls)
    assert_reference_tokens(reqs, prompts, served)
    assert [1, 3] in [c[3] for c in calls if c[0] == "prefill"]


def test_disaggregated_prefill_slice_uses_the_prefix_cache():
    """A prefill-only server with the prefix cached hands over the whole prompt's KV
    (prefix and rest) to a decode server of another layout: the reference's tokens."""
    from workloads.serving.slots import (SlotServer, SlotSpec, serve_decode_slice,
                                         serve_prefill_slice)

    pre = SlotServer(SlotSpec(MODEL, (1, 1, 2), PhaseLayout("ws2d", "head"), None, slots=1,
                              prefill_batch=1, context_len=18, prefix_len=5))
    dec = SlotServer(SlotSpec(MODEL, (1, 1, 2), None, PhaseLayout("ws1d", "batch"), slots=2,
                              context_len=18))
    reqs = stream(5)
    prompts = prompts_of(reqs, 5)
    inbox: queue.Queue = queue.Queue()
    plain = [{"arrival_s": r.arrival_s, "input_len": r.input_len, "output_len": r.output_len,
              "cached_len": r.cached_len} for r in reqs]
    served, _ = serve_prefill_slice(pre, plain, lambda i: prompts[i], 0.0,
                                    lambda items: [inbox.put(x) for x in items])
    decoded = serve_decode_slice(dec, inbox, sum(r.output_len > 1 for r in reqs), 0.0)
    for i, part in decoded.items():
        served[i].update(part, tokens=served[i]["tokens"] + part["tokens"])
    assert_reference_tokens(reqs, prompts, served)


def test_bad_chunk_and_prefix_are_one_line():
    """A chunk on a prefill-only server, a prefix as long as a slot and a prompt that does
    not start with the prefix: ConfigError naming the field."""
    from workloads.serving.slots import SlotServer, SlotSpec

    with pytest.raises(ConfigError, match="chunk"):
        SlotServer(SlotSpec(MODEL, (1, 1, 1), PhaseLayout("ws2d", "head"), None, chunk=4))
    with pytest.raises(ConfigError, match="prefix_len"):
        SlotServer(SlotSpec(MODEL, (1, 1, 1), PhaseLayout("ws2d", "head"), None,
                            context_len=8, prefix_len=8))
    server = server_for(0, 4, topology=(1, 1, 1), decode=("ws2d", "head"))
    with pytest.raises(ConfigError, match="prompts"):
        server.prefill(np.zeros((1, 9), np.int32) + 1, cached_len=4)


# --------------------------------------------------------------------------- sweeper serve

HARDWARE = {"name": "test-host", "peak_flops": 9e10, "hbm_bandwidth": 6e9, "hbm_bytes": 2.5e10,
            "ici_bandwidth": 1e9, "measured": True}


def plan_file(tmp_path, chunk: int, prefix_len: int, stages: int = 1):
    def part(ffn, attn, batch, chunk=0):
        out = {"chips": 2, "replicas": 1, "ffn": ffn, "attn": attn, "batch": batch,
               "weights": "bf16", "stages": stages}
        return {**out, "chunk": chunk} if chunk else out

    profile = {"rate": 4.0, "input_len": 9, "output_len": 4, "ttft": 1.0, "tpot": 0.2}
    if prefix_len:
        profile.update(prefix_len=prefix_len, prefix_hit=0.6)
    plan = {"deployment": {"model": "tiny-serial", "hardware": HARDWARE, "mode": "aggregated",
                           "prefill": part("ws2d", "head", 1, chunk),
                           "decode": part("ws2d", "batch", 2)},
            "profile": profile}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


@pytest.mark.parametrize("chunk,stages,needle", [(4, 2, "extend"), (0, 3, "divisor")])
def test_serve_rejects_stages_it_cannot_run_before_ray_starts(tmp_path, capsys, chunk, stages,
                                                               needle):
    """Pipeline stages with chunked prefill (the staged server has no extend program), or a
    stage count that does not divide the layers: one line naming stages, before Ray."""
    import sys

    plan = json.loads(plan_file(tmp_path, chunk, 0).read_text())
    for phase in ("prefill", "decode"):
        plan["deployment"][phase].update(stages=stages, chips=stages)
    plan["deployment"]["model"] = {**MODEL.to_dict(), "n_layers": 4, "name": "tiny-4"}
    path = tmp_path / "staged.json"
    path.write_text(json.dumps(plan))
    before = "ray" in sys.modules
    assert main(["serve", "--plan", str(path), "--rate", "2", "--no-mlflow"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "stages" in err and needle in err, err
    assert before or "ray" not in sys.modules


@pytest.mark.parametrize("flags,needle", [
    (["--prefix-len", "9"], "--prefix-len"),          # the whole prompt: none of its own
    (["--prefix-len", "x"], "--prefix-len"),
    (["--prefix-len", "4", "--prefix-hit", "1.5"], "--prefix-hit"),
])
def test_bad_prefix_flags_are_one_line_before_ray_starts(tmp_path, capsys, flags, needle):
    """`sweeper serve --prefix-len/--prefix-hit` are checked as `sweeper plan`'s profile
    flags: a bad one is one line naming it, exit 2, before Ray starts."""
    import sys

    before = "ray" in sys.modules
    plan = plan_file(tmp_path, 4, 0)
    assert main(["serve", "--plan", str(plan), "--rate", "2", "--no-mlflow", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert before or "ray" not in sys.modules


@pytest.mark.slow
@pytest.mark.ci_slow
@pytest.mark.parametrize("chunk,prefix_len,stages", [(4, 0, 1), (3, 5, 1), (0, 0, 2)])
def test_sweeper_serve_chunked_and_prefix_cached_real(tmp_path, capsys, sweeper_home, chunk,
                                                      prefix_len, stages):
    """`sweeper serve --json` of a 2-chip aggregated plan with prefill.chunk (and a profile
    with a shared prefix hit by 60% of prompts) on a real Ray worker, logged to a real
    MLflow store: every request served, each one's tokens the unsharded reference's for its
    prompt (the prefix's tokens at its start when it hit it), the measured latencies beside
    the prediction."""
    from pathlib import Path

    import mlflow

    from sweeper.paths import default_tracking_uri
    from sweeper.serving.serve import KEYS, prefix_len_of
    from sweeper.serving.server import request_prompt
    from workloads.serving.slots import reference_generation
    from workloads.serving.profile import AppProfile, Length, requests

    plan = plan_file(tmp_path, chunk, prefix_len, stages)     # stages: 2 of 1 chip each
    assert main(["serve", "--plan", str(plan), "--rate", "4", "--requests", "6", "--seed", "1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "finished" and out["completed"] == 6
    assert out["deployment"]["prefill"].get("chunk", 0) == chunk
    assert out["deployment"]["decode"].get("stages", 1) == stages
    for key in KEYS[:4]:
        assert out["measured"][key] > 0
    client = mlflow.tracking.MlflowClient(default_tracking_uri())
    local = client.download_artifacts(out["mlflow_run_id"], "serve.json", str(tmp_path))
    per_request = json.loads(Path(local).read_text())["per_request"]
    reqs = requests(AppProfile(rate=4.0, input_len=Length("fixed", 9, 9, 9),
                               output_len=Length("fixed", 4, 4, 4), prefix_len=prefix_len,
                               prefix_hit=0.6), 6, 1)
    assert (prefix_len == 0) == all(r.cached_len == 0 for r in reqs)
    assert prefix_len == 0 or 0 < sum(r.cached_len > 0 for r in reqs) < 6
    for i, (r, record) in enumerate(zip(reqs, per_request)):
        prompt = request_prompt(MODEL, i, r.input_len, 1, r.cached_len, prefix_len_of(reqs))
        _, ref = reference_generation(MODEL, 1, prompt, r.output_len - 1)   # weights: seed 1
        assert record["tokens"] == [int(t) for t in ref], f"request {i}"
        assert record["finish_s"] >= record["first_token_s"] >= r.arrival_s


def test_a_serving_trial_with_a_prefix_serves_the_references_tokens():
    """A serving trial whose `serving:` block has prefix_len / prefix_hit (docs/space-files.md
    "Serving trials"): its server caches the shared prefix and every request, hit or not,
    gets the unsharded reference's tokens for its prompt."""
    from sweeper.spec.space import load_space
    from workloads.config import HARDWARE_PRESETS
    from workloads.model import prompt_tokens
    from workloads.serving.slots import reference_generation, shared_prefix
    from workloads.serving.trial import run_serving_trial, trial_requests

    space = load_space({"name": "s", "model": "tiny-serial", "hardware": "host", "chips": 2,
                        "batch": 2, "serving": {"rate": 40, "requests": 5, "input_len": 10,
                                                "output_len": 4, "prefix_len": 6,
                                                "prefix_hit": 0.6}})
    trial = space.trial_config({})
    measurement = run_serving_trial(trial, HARDWARE_PRESETS["tpu-v4"])
    reqs = trial_requests(trial)
    assert 0 < sum(r.cached_len > 0 for r in reqs) < len(reqs)
    assert measurement.completed == len(reqs)
    served = measurement.extra["serving"]["per_request"]
    for i, (r, record) in enumerate(zip(reqs, served)):
        prompt = prompt_tokens(trial.model, 1, r.input_len, trial.seed * 1_000_003 + i)[0]
        prompt[:r.cached_len] = shared_prefix(trial.model, 6)[:r.cached_len]
        _, ref = reference_generation(trial.model, trial.seed, prompt, r.output_len - 1)
        assert record["tokens"] == [int(t) for t in ref], f"request {i}"
        assert record["cached_len"] == r.cached_len
