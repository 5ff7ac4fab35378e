"""Launch lines: a plan as the serving engines people run would start it (docs/world.md).

    launch_lines(plan_dict, model, hardware, profile)   # [{engine, command, lacks}, ...]

GPUs: vLLM (`vllm serve`) and SGLang (`sglang.launch_server`); TPUs: JetStream with MaxText
(`maxengine_server`). Each line carries the plan's tensor-parallel degree (the chips of one
pipeline stage: the slice's chips without stages), its pipeline stages (vLLM
--pipeline-parallel-size, SGLang --pp-size), its decode slots (vLLM --max-num-seqs, SGLang
--max-running-requests, MaxText per_device_batch_size = slots / chips) and the longest
request (prompt + answer). Prefill as the plan runs it (workloads/serving/model.py): a plan
without chunks inserts whole prefill calls between decode steps, so chunked prefill is
switched off where the engine has it on; a plan with `prefill.chunk` mixes one chunk of that
many prompt tokens into each decode step (vLLM --enable-chunked-prefill with a token budget
of the chunk plus one token per decoding slot, as vLLM counts them; SGLang
--chunked-prefill-size with --enable-mixed-chunk). A profile with a shared prefix turns
prefix caching on (vLLM --enable-prefix-caching; SGLang's radix cache, its default), one
without turns SGLang's radix cache off (--disable-radix-cache) as the model reuses nothing.

`lacks` names what the plan uses that the engine has no flag for, so the line alone does not
run the plan: these engines shard every weight the 1-D Megatron way with head-sharded
attention (ws1d/head, paper §3.2.1), so a ws2d or weight-gathered layout, batch-sharded
attention or different layouts per phase are flagged; so are int8 weights (the engine takes
them from a quantized checkpoint, not a flag), replicas (one line per replica behind a
router) and disaggregated plans (the engine's prefill/decode disaggregation, a launch per
pool). An empty `lacks`: the engine runs the plan as is. FP8 weights, an FP8 KV cache, expert
parallelism and vLLM's share of HBM (all but the hardware's memory reserve) are flags
(docs/models.md); an int8 KV cache is flagged (these engines' 8-bit cache is FP8).
"""

from __future__ import annotations

import math

from workloads.config import HardwareProfile, ModelConfig
from workloads.serving.profile import AppProfile, length_stats

# Hugging Face checkpoints of the model presets with one; others are named by a placeholder.
CHECKPOINTS = {"llama2-13b": "meta-llama/Llama-2-13b-hf", "llama2-70b": "meta-llama/Llama-2-70b-hf",
               "llama3.1-8b": "meta-llama/Llama-3.1-8B", "llama3.1-70b": "meta-llama/Llama-3.1-70B",
               "llama3.1-405b": "meta-llama/Llama-3.1-405B",
               "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1", "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
               "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B"}
GPU_ENGINES = ("vllm", "sglang")
TPU_ENGINES = ("jetstream",)


def engines_for(hardware: HardwareProfile) -> tuple[str, ...]:
    """The engines whose lines a plan on this hardware gets."""
    return TPU_ENGINES if hardware.name.startswith("tpu") else GPU_ENGINES


def _lacks(plan: dict, engine: str) -> list[str]:
    pre, dec = plan["prefill"], plan["decode"]
    out = []
    for phase, part in (("prefill", pre), ("decode", dec)):
        if part["ffn"] != "ws1d":
            out.append(f"{phase} {part['ffn']} weights (the engine shards weights 1-D: ws1d)")
        if part["attn"] != "head":
            out.append(f"{phase} batch-sharded attention (the engine shards attention by head)")
    if plan["mode"] == "disaggregated":
        stages = pre.get("stages", 1)
        out.append("disaggregated prefill/decode pools: launch each pool with the engine's "
                   "disaggregation setup (one line per pool, KV transfer between them; this "
                   f"line is the decode pool's, the prefill pool's is {pre['chips'] // stages} "
                   "chips tensor parallel" + (f" in {stages} pipeline stages" if stages > 1 else "")
                   + ")")
    if dec["weights"] == "int8":
        out.append("int8 weights: serve an int8 weight-only checkpoint (no flag quantizes them"
                   + (")" if engine != "jetstream" else "; MaxText: quantization=int8)"))
    if dec.get("kv_cache") == "int8" and engine != "jetstream":
        out.append("int8 KV cache: the engine's 8-bit KV cache is FP8 (--kv-cache-dtype fp8)")
    if dec.get("kv_cache", "bf16") != "bf16" and engine == "jetstream":
        out.append(f"{dec['kv_cache']} KV cache (MaxText: quantize_kvcache=true, int8)")
    if dec["weights"] == "fp8" and engine == "jetstream":
        out.append("fp8 weights (the chip has no FP8 units)")
    if dec["replicas"] > 1 or pre["replicas"] > 1:
        out.append(f"{dec['replicas']} replicas: one line per replica behind a request router")
    if engine == "jetstream":     # JetStream serves one tensor/data-parallel slice per engine
        if dec.get("stages", 1) > 1 or pre.get("stages", 1) > 1:
            out.append(f"{dec.get('stages', 1)} pipeline stages (JetStream has no pipeline-"
                       "parallel serving)")
        if pre.get("chunk"):
            out.append(f"chunked prefill of {pre['chunk']} tokens mixed into decode steps (no "
                       "flag in this line)")
    return out


def launch_lines(plan: dict, model: ModelConfig, hardware: HardwareProfile,
                 profile: AppProfile) -> list[dict]:
    """[{engine, command, lacks}] for a plan dict (Plan.to_dict) on `hardware`."""
    lengths = length_stats(profile)
    prompt = int(math.ceil(lengths["input_max"]))
    longest = int(math.ceil(lengths["input_max"] + lengths["output_max"]))
    dec, pre = plan["decode"], plan["prefill"]
    stages, chunk = dec.get("stages", 1), pre.get("chunk", 0)
    chips, slots = dec["chips"] // stages, dec["batch"]   # tensor parallel inside one stage
    prefix = profile.prefix_len > 0
    checkpoint = CHECKPOINTS.get(model.name, f"<{model.name} checkpoint>")
    # precision and expert parallelism (docs/models.md): FP8 weights quantised at load, an
    # FP8 KV cache, experts spread over the tensor-parallel chips
    fp8 = " --quantization fp8" if dec["weights"] == "fp8" else ""
    kv_fp8 = dec.get("kv_cache") == "fp8"
    ep = dec.get("experts") == "ep"
    commands = {
        "vllm": (f"vllm serve {checkpoint} --tensor-parallel-size {chips}"
                 + (f" --pipeline-parallel-size {stages}" if stages > 1 else "")
                 + f" --max-num-seqs {slots} --max-model-len {longest} "
                 + (f"--enable-chunked-prefill --max-num-batched-tokens {chunk + slots} "
                    if chunk else f"--max-num-batched-tokens {max(longest, pre['batch'] * prompt)} "
                    "--no-enable-chunked-prefill ")
                 + ("--enable-prefix-caching " if prefix else "")
                 + "--dtype bfloat16" + fp8 + (" --kv-cache-dtype fp8" if kv_fp8 else "")
                 # the HBM the plan fills: all but the hardware's reserve (docs/models.md)
                 + f" --gpu-memory-utilization {1 - hardware.memory_reserve:.2g}"
                 + (" --enable-expert-parallel" if ep else "")),
        "sglang": (f"python -m sglang.launch_server --model-path {checkpoint} --tp {chips} "
                   + (f"--pp-size {stages} " if stages > 1 else "")
                   + f"--max-running-requests {slots} --context-length {longest} "
                   + (f"--chunked-prefill-size {chunk} --enable-mixed-chunk " if chunk
                      else "--chunked-prefill-size -1 ")
                   + ("" if prefix else "--disable-radix-cache ")
                   + "--dtype bfloat16" + fp8
                   + (" --kv-cache-dtype fp8_e4m3" if kv_fp8 else "")
                   + (f" --ep-size {chips}" if ep else "")),
        "jetstream": (f"python -m MaxText.maxengine_server MaxText/configs/base.yml "
                      f"model_name={model.name} ici_tensor_parallelism={chips} "
                      f"per_device_batch_size={slots / chips:g} max_prefill_predict_length={prompt} "
                      f"max_target_length={longest} weight_dtype=bfloat16"
                      + (" quantization=int8" if dec["weights"] == "int8" else "")),
    }
    return [{"engine": engine, "command": commands[engine], "lacks": _lacks(plan, engine)}
            for engine in engines_for(hardware)]
