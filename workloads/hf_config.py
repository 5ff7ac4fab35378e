"""A Hugging Face `config.json` read as a model: `--model path/to/config.json` (or a directory
holding one) anywhere a model preset or YAML is accepted (docs/models.md).

    fields, approximations = model_fields(json_text, "Mixtral-8x7B-v0.1/config.json")

Families read (by `model_type`): Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE,
Gemma, Gemma 2. What each config field becomes (paper §2 notation):

    hidden_size -> d_model (E)         intermediate_size -> d_ff (F; Mixtral: each expert's)
    num_hidden_layers -> n_layers      moe_intermediate_size -> d_ff (Qwen MoE: each expert's)
    num_attention_heads -> n_heads     num_key_value_heads -> n_kv_heads (default: n_heads)
    head_dim -> d_head (default E / H) vocab_size -> vocab
    tie_word_embeddings -> tie_embeddings (the family's default when absent)
    hidden_act / hidden_activation: silu -> swiglu (SiLU-gated), gelu* -> geglu (Gemma)
    max_position_embeddings -> max_context
    num_local_experts / num_experts -> n_experts, num_experts_per_tok -> experts_per_token
    block: serial (every family here applies attention, then the MLP)

What the model cannot express is refused in one line naming the field (multi-head latent
attention, shared experts, layers mixing dense and MoE MLPs, an activation it does not know),
or approximated with a warning saying how (sliding windows, logit soft-capping, biases, the
router's normalisation, a checkpoint's quantization). Fields that change neither the cost
nor the partitioning (rope_theta and rope_scaling, norm epsilons, token ids, dtypes) are
not read.

Plain Python (no JAX): it returns ModelConfig fields as a mapping, and workloads/config.py
builds the model (`load_model`), so this module imports nothing of the project but its
validators.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Mapping

from workloads.validate import ConfigError, boolean, positive_int

CONFIG_FILE = "config.json"

# model_type -> tie_word_embeddings when the file leaves it out (the transformers config
# classes' defaults: LlamaConfig, MistralConfig, ... False; GemmaConfig, Gemma2Config True).
FAMILIES: dict[str, bool] = {
    "llama": False, "mistral": False, "mixtral": False,
    "qwen2": False, "qwen3": False, "qwen2_moe": False, "qwen3_moe": False,
    "gemma": True, "gemma2": True,
}
GATED = {"silu": "swiglu", "swish": "swiglu",
         "gelu": "geglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
# Qwen2's attention has q, k and v biases in the transformers implementation, with no
# config field saying so.
IMPLICIT_QKV_BIAS = ("qwen2", "qwen2_moe")


class ModelApproximation(UserWarning):
    """A config.json field the model approximates; the message says how (one line)."""


def is_hf_config(spec: str) -> bool:
    """A path that names a config.json, or a directory holding one."""
    path = Path(spec)
    return spec.endswith(".json") or (path.is_dir() and (path / CONFIG_FILE).is_file())


def config_path(spec: str) -> Path:
    """The config.json a `--model` value names (the file, or `config.json` in the directory)."""
    path = Path(spec)
    return path / CONFIG_FILE if path.is_dir() else path


def model_name(path: Path) -> str:
    """The model's name: the directory of a `config.json` (how the Hub and a download name
    it: Mixtral-8x7B-v0.1/config.json), else the file's stem."""
    return path.parent.name if path.name == CONFIG_FILE and path.parent.name else path.stem


def model_fields(text: str, source: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """ModelConfig fields from a config.json's text, and the approximations (one line each).
    ConfigError (naming `source` and the field) for what the model cannot express."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError("document", f"line {err.lineno}: {err.msg}", "a JSON config.json",
                          source) from None
    if not isinstance(data, Mapping):
        raise ConfigError("document", data, "a JSON object (a Hugging Face config.json)", source)
    _refuse_unexpressible(data, source)
    family = data.get("model_type")
    if family not in FAMILIES:
        raise ConfigError("model_type", family, f"one of {sorted(FAMILIES)} (the families whose "
                          "config.json this reads; docs/models.md)", source)
    fields: dict[str, Any] = {
        "d_model": _count(data, "hidden_size", source),
        "n_layers": _count(data, "num_hidden_layers", source),
        "n_heads": _count(data, "num_attention_heads", source),
        "vocab": _count(data, "vocab_size", source),
        "block": "serial",
        "mlp": _mlp(data, family, source),
        "tie_embeddings": _flag(data, "tie_word_embeddings", FAMILIES[family], source),
    }
    kv = data.get("num_key_value_heads")
    fields["n_kv_heads"] = fields["n_heads"] if kv is None else _count(data, "num_key_value_heads",
                                                                        source)
    if data.get("head_dim") is not None:
        fields["d_head"] = _count(data, "head_dim", source)
    elif fields["d_model"] % fields["n_heads"]:
        raise ConfigError("head_dim", None, f"a head dimension (hidden_size={fields['d_model']} "
                          f"does not divide by num_attention_heads={fields['n_heads']})", source)
    else:
        fields["d_head"] = fields["d_model"] // fields["n_heads"]
    if data.get("max_position_embeddings") is not None:
        fields["max_context"] = _count(data, "max_position_embeddings", source)
    fields.update(_experts(data, family, source))
    return fields, tuple(_approximations(data, family))


def _refuse_unexpressible(data: Mapping, source: str) -> None:
    """Fields whose architecture the model has no term for: one line naming the first."""
    for key in ("kv_lora_rank", "q_lora_rank"):
        if data.get(key) is not None:
            raise ConfigError(key, data[key], "absent: multi-head latent attention (MLA, "
                              "DeepSeek-V2/V3) is not modelled, only multihead, multiquery and "
                              "grouped-query attention", source)
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if data.get(key):
            raise ConfigError(key, data[key], "0 or absent: shared experts (an always-on MLP "
                              "beside the routed ones, Qwen2-MoE/DeepSeek-MoE) are not modelled",
                              source)
    step = data.get("decoder_sparse_step", 1)
    if step not in (None, 1):
        raise ConfigError("decoder_sparse_step", step, "1: every layer a mixture-of-experts "
                          "layer (layers mixing dense and MoE MLPs are not modelled)", source)
    for key in ("mlp_only_layers", "first_k_dense_replace"):
        if data.get(key):
            raise ConfigError(key, data[key], "empty or 0: every layer a mixture-of-experts layer "
                              "(layers mixing dense and MoE MLPs are not modelled)", source)


def _count(data: Mapping, key: str, source: str) -> int:
    value = data.get(key)
    if value is None:
        raise ConfigError(key, None, "a positive integer (required)", source)
    return positive_int(key, value, source)


def _flag(data: Mapping, key: str, default: bool, source: str) -> bool:
    value = data.get(key, default)
    return default if value is None else boolean(key, value, source)


def _mlp(data: Mapping, family: str, source: str) -> str:
    """Every family here has a gated MLP (three matrices); the activation names which."""
    key = "hidden_activation" if data.get("hidden_activation") else "hidden_act"
    act = data.get(key, "gelu_pytorch_tanh" if family.startswith("gemma") else "silu")
    if act not in GATED:
        raise ConfigError(key, act, f"one of {sorted(GATED)} (a SiLU- or GELU-gated MLP)", source)
    return GATED[act]


def _experts(data: Mapping, family: str, source: str) -> dict[str, Any]:
    """d_ff, and the MoE fields of a Mixtral or Qwen-MoE config."""
    if family in ("qwen2_moe", "qwen3_moe"):
        experts = _count(data, "num_experts", source)
        return {"d_ff": _count(data, "moe_intermediate_size", source), "n_experts": experts,
                "experts_per_token": _top_k(data, experts, source)}
    out = {"d_ff": _count(data, "intermediate_size", source)}
    experts = data.get("num_local_experts")
    if family == "mixtral" or experts not in (None, 0, 1):
        experts = _count(data, "num_local_experts", source)
        out.update(n_experts=experts, experts_per_token=_top_k(data, experts, source))
    return out


def _top_k(data: Mapping, experts: int, source: str) -> int:
    top_k = _count(data, "num_experts_per_tok", source)
    if top_k > experts:
        raise ConfigError("num_experts_per_tok", top_k, f"at most the {experts} experts", source)
    return top_k


def _approximations(data: Mapping, family: str) -> list[str]:
    """One line per field the model approximates, saying how."""
    notes = []
    window = data.get("sliding_window")
    in_effect = data.get("use_sliding_window", True) if family.startswith("qwen") else True
    if window and in_effect:
        layers = "every other layer's" if family == "gemma2" else "the"
        notes.append(f"sliding_window {window}: {layers} attention is modelled over the whole "
                     f"context (past {window} tokens its KV cache and attention reads are "
                     "over-counted: an upper bound)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if data.get(key):
            notes.append(f"{key} {data[key]}: left out (an elementwise tanh, no memory or "
                         "communication)")
    for key in ("attention_bias", "mlp_bias"):
        if data.get(key):
            notes.append(f"{key} true: the biases are left out (vectors of E or F values per "
                         "layer, nothing the partitioning moves)")
    if family in IMPLICIT_QKV_BIAS:
        notes.append(f"{family}: the q/k/v projection biases are left out (vectors, nothing the "
                     "partitioning moves)")
    if data.get("norm_topk_prob") is False:
        notes.append("norm_topk_prob false: the router's top-k weights are renormalised, as "
                     "Mixtral's are (the costs do not change)")
    quant = data.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else quant
        notes.append(f"quantization_config ({method}): not read; the weight format is its own "
                     "choice (weights: bf16, int8 or fp8)")
    return notes


def warn(approximations: tuple[str, ...], source: str) -> None:
    """Each approximation as a ModelApproximation warning (shown once per message)."""
    for note in approximations:
        warnings.warn(ModelApproximation(f"{source}: {note}"), stacklevel=3)
