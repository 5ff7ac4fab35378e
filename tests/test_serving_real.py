"""Real serving (issue 19, deliverables 5 and 7): the slot server's tokens and logits match
the unsharded reference when requests enter slots at different steps; `sweeper serve` runs
a real stream on Ray mesh workers (aggregated, and disaggregated with the KV cache handed
over through Ray), logs to a real MLflow store, and its `--json` has the documented shape;
bad input is one line and exit 2 before Ray or JAX start.

The real runs start Ray and compile on two meshes (~1-3 min on 2 loaded cores): marked
slow + ci_slow (CI's second stage runs them).
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from sweeper.cli import main
from workloads.config import MODEL_PRESETS
from workloads.serving.costs import HostCosts

MODEL = "tiny-serial"      # untied embeddings: varied greedy tokens (model.init_params)
ATOL = 0.1                 # as tests/test_engine_equivalence.py: bf16 rounding ~0.03, a bug O(1)
# A fixed profile so no test measures this host: the host-fitted profile shipped with the
# benchmarks (any valid profile would do; the prediction is not what these tests check).
HARDWARE = {"name": "test-host", "peak_flops": 9e10, "hbm_bandwidth": 6e9, "hbm_bytes": 2.5e10,
            "ici_bandwidth": 1e9, "measured": True}


def plan_file(tmp_path: Path, mode: str, prefill=("ws2d", "head", 1), decode=("ws2d", "batch", 2),
              chips=2, replicas=1, decode_replicas: int | None = None) -> Path:
    def part(ffn, attn, batch, copies=replicas):
        return {"chips": chips, "replicas": copies, "ffn": ffn, "attn": attn, "batch": batch,
                "weights": "bf16"}

    plan = {"deployment": {"model": MODEL, "hardware": HARDWARE, "mode": mode,
                           "prefill": part(*prefill),
                           "decode": part(*decode, copies=decode_replicas or replicas)},
            "profile": {"rate": 2.0, "input_len": 8, "output_len": 5, "ttft": 1.0, "tpot": 0.2}}
    path = tmp_path / f"plan-{mode}.json"
    path.write_text(json.dumps(plan))
    return path


# --------------------------------------------------------------------------- the slot server


@pytest.mark.parametrize("prefill,decode,topology,prefill_batch", [
    (("ws2d", "head"), ("ws2d", "batch"), (1, 2, 2), 1),
    (("wg_xyz", "batch"), ("ws1d", "head"), (1, 2, 2), 4),
])
def test_slots_match_reference(prefill, decode, topology, prefill_batch):
    """Three requests enter slots 2, 0 and 3 at steps 0, 2 and 3 (so their positions differ
    at every step) and leave when done: each one's logits and tokens are the reference's."""
    from workloads.layouts import PhaseLayout
    from workloads.model import prompt_tokens
    from workloads.serving.slots import SlotServer, SlotSpec, reference_generation

    model = MODEL_PRESETS[MODEL]
    steps = 5
    server = SlotServer(SlotSpec(model, topology, PhaseLayout(*prefill), PhaseLayout(*decode),
                                 slots=4, prefill_batch=prefill_batch, context_len=16))
    prompts = prompt_tokens(model, 3, 8, seed=3)
    enters = {0: (0, 2), 2: (1, 0), 3: (2, 3)}          # step -> (request, slot)
    logits = {r: [] for r in range(3)}
    tokens = {r: [] for r in range(3)}
    slot_of = {}
    for t in range(10):
        if t in enters:
            r, slot = enters[t]
            done = server.prefill(prompts[r:r + 1])
            server.insert(slot, done, 0, int(done.first_tokens[0]))
            logits[r].append(np.asarray(done.logits)[0])
            tokens[r].append(int(done.first_tokens[0]))
            slot_of[r] = slot
        out = server.step()
        for r, slot in list(slot_of.items()):
            logits[r].append(np.asarray(server.last_logits)[slot])
            tokens[r].append(int(out[slot]))
            if len(tokens[r]) == steps + 1:
                server.release(slot)
                del slot_of[r]
    for r in range(3):
        ref_logits, ref_tokens = reference_generation(model, 0, prompts[r], steps)
        assert tokens[r] == [int(t) for t in ref_tokens], f"request {r}"
        err = max(float(np.abs(a - b).max()) for a, b in zip(logits[r], ref_logits))
        assert err < ATOL, f"request {r}: max |logit error| {err}"
    assert len(set(tuple(t) for t in tokens.values())) == 3      # the requests differ


def test_decode_kv_from_another_mesh_matches_reference():
    """Disaggregated handover without Ray: the prefill server's logical KV export, inserted
    on a decode server of another topology and layout, decodes the reference's tokens."""
    from workloads.layouts import PhaseLayout
    from workloads.model import prompt_tokens
    from workloads.serving.slots import SlotServer, SlotSpec, reference_generation

    model = MODEL_PRESETS[MODEL]
    pre = SlotServer(SlotSpec(model, (1, 1, 2), PhaseLayout("ws2d", "head"), None, slots=1,
                              prefill_batch=1, context_len=16))
    dec = SlotServer(SlotSpec(model, (1, 2, 2), None, PhaseLayout("ws2d", "batch"), slots=4,
                              context_len=16))
    prompt = prompt_tokens(model, 1, 8, seed=4)
    done = pre.prefill(prompt)
    dec.insert(1, pre.export_kv(done, 0), 0, int(done.first_tokens[0]))
    tokens = [int(done.first_tokens[0])] + [int(dec.step()[1]) for _ in range(4)]
    _, ref = reference_generation(model, 0, prompt[0], 4)
    assert tokens == [int(t) for t in ref]


@pytest.mark.parametrize("mode,prefill_batch", [("aggregated", 1), ("aggregated", 2),
                                                ("disaggregated", 1)])
def test_host_costs_measured_in_blocks_on_a_real_worker(tmp_path, mode, prefill_batch):
    """sweeper/serving/server.py `measure_host_costs` on a real slot server of the tiny model
    (in this process, no Ray): the closed loop in blocks, the robust mean the median of the
    blocks' means, every time positive, and host costs (overheads.host_costs) that are
    finite and not negative (docs/serving.md "Serving host costs"); aggregated, the prefill
    calls paired one by one with the engine's, their prompts cycling 1..prefill_batch, are
    what the prefill's costs come from. No timing asserted."""
    import math

    from sweeper.serving.overheads import first_token_overhead, host_costs
    from workloads.serving.hostcosts import PREFILL_PAIRS, WAKE_DECODE_STEPS, combine
    from sweeper.serving.serve import slot_specs
    from sweeper.serving.server import ServingWorker
    from workloads.deployment import load_plan

    deployment = load_plan(plan_file(tmp_path, mode, prefill=("ws2d", "head", prefill_batch),
                                     chips=1))
    specs = slot_specs(deployment, context_len=16, seed=1)
    results = {}
    for name, spec in specs.items():
        worker = ServingWorker(None)
        worker.setup(spec, [8])
        results[name] = worker.measure_host_costs(8, 5, rounds=1, blocks=3,
                                                     min_block_s=0.05, wake_requests=3,
                                                     idle_gap_s=0.05)
    for name, out in results.items():
        assert out["blocks"] == 3 and out["measured_s"] >= 3 * 0.05
        phases = [p for p in ("step", "prefill") if f"loop_{p}_samples_s" in out]
        assert phases, name
        for phase in phases:
            means = out[f"loop_{phase}_block_means_s"]
            assert len(means) == 3 and min(means) > 0, (name, phase)
            assert out[f"loop_{phase}_mean_s"] == pytest.approx(float(np.median(means)))
            assert min(out[f"loop_{phase}_samples_s"]) > 0
            engine = "engine_step_s" if phase == "step" else "engine_prefill_s"
            assert out[engine] > 0
        if "engine_step_s" in out:   # and its steps run back to back, as a trial runs them
            assert out["engine_step_pipelined_s"] > 0, name
        if "loop_step_samples_s" in out:   # every loop that steps is paired, one per block
            assert len(out["loop_step_paired_block_extra_s"]) == 3, name
            assert out["loop_step_paired_extra_s"] == pytest.approx(
                float(np.median(out["loop_step_paired_block_extra_s"])))
        # a prefill on an idle loop (the worker's own serving loop on spaced one-token
        # requests): a positive TTFT, a wake not below zero; none without a prefill phase
        if "engine_prefill_s" in out:
            assert out["prefill_after_idle_s"] > 0 and out["prefill_wake_s"] >= 0, name
            # and about 0.01 s idle (IDLE_SHORT_GAP_S): each wake with how long the loop idled
            assert out["prefill_wake_short_s"] >= 0, name
            assert 0 < out["prefill_wake_short_idle_s"] < out["prefill_wake_idle_s"] <= 0.05, name
            # an aggregated loop's requests decode a few steps after their first tokens:
            # each set's decoding, and the decode wake `combine` makes of it (>= 0)
            if name == "aggregated":
                assert out["wake_decode_steps"] == WAKE_DECODE_STEPS
                for key in ("wake_decoding_s", "wake_short_decoding_s"):
                    assert len(out[key]) == 3 and min(out[key]) > 0, key
                costs = combine(out, out)
                assert costs["decode_after_wake_s"] >= 0 and costs["decode_after_wake_short_s"] >= 0
            else:
                assert "wake_decode_steps" not in out and "wake_decoding_s" not in out
        else:
            assert "prefill_wake_s" not in out
    pre = results.get("aggregated", results.get("prefill"))
    dec = results.get("aggregated", results.get("decode"))
    costs = host_costs(pre, dec)
    assert all(math.isfinite(v) and v >= 0 for v in costs.values()), costs
    assert costs["step_overhead_s"] == pytest.approx(
        max(dec["loop_step_paired_extra_s"], 0.0)
        + max(dec["engine_step_s"] - dec["engine_step_pipelined_s"], 0.0))
    if mode == "aggregated":
        # every block pairs PREFILL_PAIRS prefill calls with the engine's, 1, 2, 1, 2, ...
        # prompts (up to the prefill batch); the costs are the median over blocks of them
        prompts = pre["prefill_pair_prompts"]
        assert prompts == [n % prefill_batch + 1 for n in range(3 * PREFILL_PAIRS)]
        assert len(pre["prefill_pair_first_extra_s"]) == len(pre["prefill_pair_extra_s"]) == len(prompts)
        firsts = pre["prefill_pair_first_extra_s"]
        blocks = np.median(np.reshape(firsts, (3, PREFILL_PAIRS)), axis=1)
        assert pre["loop_prefill_first_paired_block_extra_s"] == pytest.approx(list(blocks))
        assert pre["loop_prefill_first_paired_extra_s"] == pytest.approx(float(np.median(firsts)))
        # per prompt: each count's median call - engine, summed, over 1 + ... + prefill_batch
        whole = np.asarray(pre["prefill_pair_extra_s"])
        counts = range(1, prefill_batch + 1)
        per_prompt = sum(float(np.median(whole[np.asarray(prompts) == n])) for n in counts) / sum(counts)
        assert costs["prefill_overhead_per_prompt_s"] == pytest.approx(max(per_prompt, 0.0))
        assert 0 <= first_token_overhead(pre) <= max(float(np.mean(pre["prefill_pair_extra_s"])), 0.0)
    else:      # a prefill slice: its closed loop's calls, paired by block (no call pairs)
        assert "prefill_pair_prompts" not in pre
        blocks = pre["loop_prefill_paired_block_extra_s"]
        assert len(blocks) == 3 and pre["loop_prefill_paired_extra_s"] == pytest.approx(float(np.median(blocks)))
        assert costs["prefill_overhead_per_prompt_s"] == pytest.approx(
            max(pre["loop_prefill_paired_extra_s"], 0.0) / pre["loop_prefill_prompts"])


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args,needle", [
    (["--plan", "{missing}", "--rate", "2"], "--plan"),
    (["--plan", "{plan}", "--rate", "0"], "--rate"),
    (["--plan", "{plan}", "--rate", "fast"], "--rate"),
    (["--plan", "{plan}", "--rate", "2", "--requests", "0"], "--requests"),
    (["--plan", "{bad_batch}", "--rate", "2"], "batch"),
    (["--plan", "{replicas}", "--rate", "2"], "replicas"),
    (["--plan", "{plan}"], "--rate"),
    (["--plan", "{plan}", "--measure-overheads", "{tmp}/nowhere/x.yaml"], "--measure-overheads"),
    (["--plan", "{replicas}", "--measure-overheads", "{tmp}/x.yaml"], "replicas"),
])
def test_bad_input_one_line_exit_2(tmp_path, capsys, args, needle):
    import sys

    plan = plan_file(tmp_path, "aggregated")
    bad = json.loads(plan.read_text())
    bad["deployment"]["decode"]["batch"] = 3         # batch-sharded attention over 2 chips
    bad_batch = tmp_path / "bad-batch.json"
    bad_batch.write_text(json.dumps(bad))
    two = json.loads(plan_file(tmp_path, "disaggregated").read_text())
    for phase in ("prefill", "decode"):
        two["deployment"][phase]["replicas"] = 0
    replicas = tmp_path / "replicas.json"
    replicas.write_text(json.dumps(two))
    values = {"missing": str(tmp_path / "none.json"), "plan": str(plan),
              "bad_batch": str(bad_batch), "replicas": str(replicas), "tmp": str(tmp_path)}
    before = {m for m in ("ray", "jax") if m in sys.modules}
    code = main(["serve", *[a.format(**values) for a in args]])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and needle in err, err
    for module in ("ray", "jax"):      # rejected before Ray or JAX started
        assert module in before or module not in sys.modules, module


# --------------------------------------------------------------------------- real runs


def _served(tmp_path, capsys, mode: str, **plan) -> dict:
    """`sweeper serve --json` on a real Ray worker pool; the JSON and the MLflow artifact."""
    import mlflow

    from sweeper.paths import default_tracking_uri

    plan = plan_file(tmp_path, mode, **plan)
    assert main(["serve", "--plan", str(plan), "--rate", "4", "--requests", "5", "--seed", "1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    client = mlflow.tracking.MlflowClient(default_tracking_uri())
    run = client.get_run(out["mlflow_run_id"])
    assert run.data.params["mode"] == mode
    assert run.data.metrics["completed"] == 5
    assert "pred_ttft_p50_s" in run.data.metrics
    for key in ("ttft_p50_s", "tpot_p50_s", "completed"):    # the replay, beside the prediction
        assert run.data.metrics[f"replay_{key}"] == pytest.approx(out["replayed"][key]), key
    local = client.download_artifacts(run.info.run_id, "serve.json", str(tmp_path))
    return out, json.loads(Path(local).read_text())


def _check(out: dict, artifact: dict) -> None:
    from sweeper.serving.serve import KEYS
    from workloads.serving.profile import AppProfile, Length, requests
    from workloads.serving.slots import reference_generation
    from sweeper.serving.server import prompt_for

    for side in ("measured", "predicted"):
        assert set(KEYS) <= set(out[side]), side
        assert out[side]["completed"] == 5
    for key in KEYS[:4]:
        assert out["measured"][key] > 0 and out["predicted"][key] > 0
    # the model replayed on the stream's own call log (docs/serving.md "Checking the model
    # against the server") gives back what was measured: the medians within 20% or 2 ms (at
    # 4 req/s every request finds the loop asleep: the replay charges the stream's mean
    # wake-up, read from its log and arrivals; a lost prefill call would be more off)
    assert out["replayed"]["completed"] == 5
    for key in ("ttft_p50_s", "tpot_p50_s"):
        assert out["replayed"][key] == pytest.approx(out["measured"][key], rel=0.2, abs=0.002), key
    model = MODEL_PRESETS[MODEL]
    reqs = requests(AppProfile(rate=4.0, input_len=Length("fixed", 8, 8, 8),
                               output_len=Length("fixed", 5, 5, 5)), 5, 1)
    for i, (r, served) in enumerate(zip(reqs, artifact["per_request"])):
        prompt = prompt_for(model, i, r.input_len, 1)
        _, ref = reference_generation(model, 1, prompt, r.output_len - 1)
        assert served["tokens"] == [int(t) for t in ref], f"request {i}"
        assert served["finish_s"] >= served["first_token_s"] >= r.arrival_s


@pytest.mark.slow
@pytest.mark.ci_slow
def test_serve_aggregated_real(tmp_path, capsys, sweeper_home):
    _check(*_served(tmp_path, capsys, "aggregated"))


def test_serve_aggregated_replicas_real(tmp_path, capsys, sweeper_home):
    """An aggregated plan of 2 replicas of 1 chip: two Ray mesh workers, requests routed
    round-robin in arrival order as the serving model routes them (serve.py `route`), every
    request's tokens the unsharded reference's (each replica makes its requests' prompts
    from their index in the whole stream), one comparison of the whole stream."""
    from sweeper.serving.serve import route
    from workloads.serving.profile import Request

    out, artifact = _served(tmp_path, capsys, "aggregated", chips=1, replicas=2)
    assert set(out["warmup"]) == {"aggregated", "aggregated-1"}      # two workers served
    # each on one core of its own: at most one per emulated chip (meshworker.device_cores)
    cores = [w["cores"] for w in out["workers"].values()]
    assert len(cores) == 2 and all(len(c) == 1 for c in cores), cores
    assert cores[0] != cores[1] or len(os.sched_getaffinity(0)) < 2, cores
    assert out["deployment"]["decode"]["replicas"] == 2
    _check(out, artifact)
    arrivals = [Request(t, 8, 5) for t in (0.3, 0.1, 0.2, 0.0, 0.4)]
    assert route(arrivals, 2) == [[3, 2, 4], [1, 0]]


@pytest.mark.slow
@pytest.mark.ci_slow
def test_serve_disaggregated_real(tmp_path, capsys, sweeper_home):
    _check(*_served(tmp_path, capsys, "disaggregated"))


@pytest.mark.slow
@pytest.mark.ci_slow
def test_serve_disaggregated_replicas_real(tmp_path, capsys, sweeper_home):
    """A disaggregated plan of 2 prefill and 2 decode slices of 1 chip: four Ray mesh
    workers; requests go to the prefill slices round-robin in arrival order (serve.py
    `route`), each sends a request's KV cache to the decode slice the serving model routes
    it to (workloads/serving/model.py `decode_route`, round-robin in arrival order), every slice
    serves, and every request's tokens are the unsharded reference's."""
    out, artifact = _served(tmp_path, capsys, "disaggregated", chips=1, replicas=2)
    assert set(out["warmup"]) == {"prefill", "prefill-1", "decode", "decode-1"}
    assert out["deployment"]["prefill"]["replicas"] == 2
    _check(out, artifact)
    prefilled = {name: [i for call in artifact["calls"][name] if call[0] == "prefill"
                        for i in call[3]] for name in ("prefill", "prefill-1")}
    assert prefilled == {"prefill": [0, 1, 2], "prefill-1": [0, 1]}   # each its own share
    decoded_by = {}       # which decode slice inserted each request (its call log)
    for name in ("decode", "decode-1"):
        for call in artifact["calls"][name]:
            if call[0] == "insert":
                decoded_by[call[3]] = name
    assert decoded_by == {0: "decode", 1: "decode-1", 2: "decode", 3: "decode-1", 4: "decode"}


def test_decode_slices_take_the_longer_answers_round_robin_in_arrival_order():
    from workloads.serving.model import decode_route
    from workloads.serving.profile import Request

    arrivals = [Request(0.3, 8, 5), Request(0.1, 8, 1), Request(0.2, 8, 5),
                Request(0.0, 8, 5), Request(0.4, 8, 5)]
    # request 1 answers in one token (done at its prefill: no decode slice)
    assert decode_route(arrivals, 2) == [[3, 0], [2, 4]]
    assert decode_route(arrivals, 1) == [[3, 2, 0, 4]]


@pytest.mark.slow
@pytest.mark.ci_slow
def test_measure_overheads_real(tmp_path, capsys, sweeper_home):
    """`sweeper serve --measure-overheads` on real Ray workers (disaggregated: both workers
    and a real KV handover): sane costs, and a profile YAML that loads with them."""
    from workloads.config import load_hardware

    plan = plan_file(tmp_path, "disaggregated")
    out = tmp_path / "profile.yaml"
    assert main(["serve", "--plan", str(plan), "--measure-overheads", str(out), "--json"]) == 0
    costs = json.loads(capsys.readouterr().out)
    for side in ("prefill", "decode"):
        detail = dict(costs["detail"][side])
        assert detail.pop("blocks") == 5 and detail.pop("measured_s") > 0
        if side == "prefill":     # a prefill on an idle loop: its wake may be 0 (noise)
            assert 0 <= detail.pop("prefill_wake_s") < 5.0
            # before the first tokens, paired with the engine's calls: noise may make one < 0
            extras = detail.pop("loop_prefill_first_paired_block_extra_s")
            assert len(extras) == 5 and all(abs(x) < 5.0 for x in extras)
            assert detail.pop("loop_prefill_first_paired_extra_s") == pytest.approx(float(np.median(extras)))
            # its whole host work per call, paired by block as well (noise: one may be < 0)
            extras = detail.pop("loop_prefill_paired_block_extra_s")
            assert len(extras) == 5 and all(abs(x) < 5.0 for x in extras)
            assert detail.pop("loop_prefill_paired_extra_s") == pytest.approx(float(np.median(extras)))
            # measured as a stream runs it: the decode slice stepping beside (a count)
            assert detail.pop("decode_beside_steps") > 0
        else:                     # paired with the engine's calls: noise may make one < 0
            extras = detail.pop("loop_step_paired_block_extra_s")
            assert len(extras) == 5 and all(abs(x) < 5.0 for x in extras)
            assert detail.pop("loop_step_paired_extra_s") == pytest.approx(float(np.median(extras)))
            # and the wait for each step's tokens (the call alone - the steps back to back)
            assert costs["step_overhead_s"] == pytest.approx(
                max(float(np.median(extras)), 0.0)
                + max(detail["engine_step_s"] - detail["engine_step_pipelined_s"], 0.0))
        for key, value in detail.items():   # seconds, a count, samples, block means
            for one in value if isinstance(value, list) else [value]:
                assert 0 < one < 5.0, (side, key, one)
    assert costs["step_overhead_s"] >= 0 and costs["prefill_overhead_per_prompt_s"] >= 0
    assert 0 < costs["handover_overhead_s"] < 5.0       # a Ray call and an insert: never free
    # the weights the wake was measured with (the serving model moves it to other weights)
    from workloads.deployment import load_plan
    from workloads.serving.model import prefill_weight_bytes
    assert costs["prefill_wake_weight_bytes"] == pytest.approx(prefill_weight_bytes(load_plan(plan)))
    assert costs["detail"]["handover"]["samples"] >= 8
    # the decode loop stepping with the prefill worker's handovers at a stream's rate: its
    # figure (at least its inserts) or the decode process's CPU per handover, the larger
    # (docs/serving.md "What a handover costs a stepping decode loop")
    stepping = costs["detail"]["stepping_handovers"]
    assert stepping["rate_rps"] > 0 and sum(stepping["sent_per_window"]) > 0
    assert any(kind == "insert" for kind, _, _ in stepping["calls"])
    if stepping["handovers"]:
        assert costs["handover_overhead_s"] == pytest.approx(
            max(stepping["handover_overhead_s"], stepping["insert_s"],
                costs["detail"]["handover"]["decode_cpu_s"], 0.0))
    assert 0 <= costs["prefill_wake_s"] == costs["detail"]["prefill"]["prefill_wake_s"]
    # measured on a prefill slice's loop: the slice's own wake too (HostCosts `for_mode`)
    assert costs["slice_wake_s"] == costs["prefill_wake_s"]
    assert costs["slice_wake_short_idle_s"] == costs["prefill_wake_short_idle_s"]
    # of a prefill call's host work, the part before its first tokens: at most all of it
    pre = costs["detail"]["prefill"]
    assert 0 <= costs["prefill_first_overhead_s"] <= pre["loop_prefill_mean_s"] - pre["engine_prefill_s"] + 1e-12
    assert pre["loop_prefill_first_s"] <= pre["loop_prefill_s"]
    hardware = load_hardware(str(out))
    for key in ("step_overhead_s", "prefill_overhead_per_prompt_s", "handover_overhead_s",
                "prefill_wake_s", "prefill_first_overhead_s"):
        assert getattr(hardware.host_costs, key) == pytest.approx(costs[key])
    assert hardware.peak_flops == HARDWARE["peak_flops"]


def test_serve_says_when_a_host_profiles_prediction_lacks_serving_host_costs(tmp_path):
    """A measured (host) profile without serving host costs: `sweeper serve` prints how to
    measure them; a profile with them, or an accelerator preset, gets no such line."""
    import dataclasses

    from sweeper.cli.serve import host_costs_hint
    from workloads.config import HARDWARE_PRESETS
    from workloads.deployment import load_plan

    deployment = load_plan(plan_file(tmp_path, "aggregated"))
    host = dataclasses.replace(HARDWARE_PRESETS["tpu-v4"], name="host", measured=True)
    bare = dataclasses.replace(deployment, hardware=host)
    hint = host_costs_hint(bare, "plan.json")
    assert hint and "--measure-overheads" in hint and "plan.json" in hint and "`host`" in hint
    measured = dataclasses.replace(host, host_costs=HostCosts(step_overhead_s=0.0004))
    assert host_costs_hint(dataclasses.replace(deployment, hardware=measured), "plan.json") is None
    preset = dataclasses.replace(deployment, hardware=HARDWARE_PRESETS["tpu-v4"])
    assert host_costs_hint(preset, "plan.json") is None


def test_decode_beside_steps_until_told_to_stop(tmp_path):
    """server.py `decode_beside`: the decode slice's loop stepping beside the prefill slice's
    closed loop (overheads.py `measure_session`, docs/serving.md "Serving host costs") runs
    real decode steps until `stop_decode_beside` with its token, on another thread, and a
    stop that comes first ends it before any step. No timing asserted (the bound only
    catches a loop that ignores the stop)."""
    import threading

    from sweeper.serving.serve import slot_specs
    from sweeper.serving.server import ServingWorker
    from workloads.deployment import load_plan

    deployment = load_plan(plan_file(tmp_path, "disaggregated", chips=1))
    worker = ServingWorker(None)
    worker.setup(slot_specs(deployment, context_len=16, seed=1)["decode"], [8])
    cache = worker.server.cache
    steps: list[int] = []
    runner = threading.Thread(target=lambda: steps.append(worker.decode_beside(7, max_s=600.0)))
    runner.start()
    while worker.server.cache is cache and runner.is_alive():   # a step replaces the cache
        runner.join(0.01)
    worker.stop_decode_beside(7)
    runner.join(120.0)
    assert not runner.is_alive() and steps and steps[0] >= 1
    worker.stop_decode_beside(8)               # told before it starts: no step
    assert worker.decode_beside(8, max_s=30.0) == 0
    assert not worker.server.active.any()      # no slot taken: the next stream's are free


def test_stepping_decode_loop_inserts_real_handovers_in_their_windows(tmp_path):
    """workloads/serving/hostcosts.py `stepping_send` -> server.py `deliver` -> `stepping_decode_loop`
    on real slot servers of the tiny model (two threads, no Ray; overheads.py
    `measure_stepping_handovers` runs the same across two workers): every handover sent is
    inserted, only in the windows with handovers (`stepping_with`, plus the KV's way to the
    next step), the loop steps in every window, its slots are freed after, and
    `stepping_handover_costs` reads the log (docs/serving.md "What a handover costs a
    stepping decode loop"). No timing asserted."""
    import math
    import threading
    import time

    from sweeper.serving.serve import slot_specs
    from sweeper.serving.server import ServingWorker
    from workloads.serving import hostcosts
    from workloads.deployment import load_plan

    deployment = load_plan(plan_file(tmp_path, "disaggregated", chips=1))
    specs = slot_specs(deployment, context_len=16, seed=1)
    prefill, decode = ServingWorker(None), ServingWorker(None)
    prefill.setup(specs["prefill"], [8])
    decode.setup(specs["decode"], [8])
    windows, window_s = 8, 0.3
    start_at = time.time() + 0.5
    log: list = []
    loop = threading.Thread(target=lambda: log.extend(
        decode.stepping_decode(start_at, windows, window_s)))
    loop.start()
    per_window, _ = hostcosts.stepping_send(prefill.server, 8, 4, start_at, 20.0, decode.deliver,
                                            windows, window_s)
    loop.join(120.0)
    assert not loop.is_alive()
    assert sum(per_window) > 0
    assert all(n == 0 for k, n in enumerate(per_window) if not hostcosts.stepping_with(k))
    inserts = [c for c in log if c[0] == "insert"]
    steps = [c for c in log if c[0] == "step"]
    assert len(inserts) <= sum(per_window) and inserts     # the last ones may come too late
    for _, began, _ in inserts:        # a window with handovers, or just after one
        k = int((began - start_at) // window_s)
        assert hostcosts.stepping_with(k) or hostcosts.stepping_with(k - 1), k
    assert {int((c[1] - start_at) // window_s) for c in steps} >= set(range(windows))
    assert not decode.server.active.any() and decode.inbox.empty()
    out = hostcosts.stepping_handover_costs(log, start_at, windows, window_s)
    if out["handovers"]:
        assert all(math.isfinite(out[k]) for k in ("handover_overhead_s", "insert_s",
                                                     "step_after_s", "window_paired_s"))
        assert out["insert_s"] > 0
