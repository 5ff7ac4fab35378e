"""Model and hardware descriptions: validated dataclasses, presets, YAML loading.

Everything here is plain Python (no JAX), so the cost model, the CLI and the
orchestration can import it cheaply. Bad input raises `ConfigError`, whose
message is one line naming the file, the field, the value and what is accepted;
the CLI prints it and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from workloads import hf_config
from workloads.serving.costs import OLD_NAMES, HostCosts
# ConfigError and check_keys are used from here by most modules (workloads/validate.py)
from workloads.validate import (ConfigError, boolean, bounded, check_keys,  # noqa: F401
                                integer, number, one_of, positive_int)


# --------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `4.0e10`, `1e9` and `275e12` as floats, and refuses documents
    nested deeper than MAX_DEPTH or that expand (aliases counted as copies) to more than
    MAX_NODES nodes: a deep document would end in RecursionError and an alias bomb in
    MemoryError, both long after the file was read.

    YAML 1.1 (what PyYAML implements) requires a dot and a signed exponent, so
    plain PyYAML reads `4.0e10` as the *string* '4.0e10'.
    """

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._sizes: dict[int, int] = {}     # id(node) -> nodes it expands to
        self._nodes: list = []               # keeps sized nodes alive (ids stay unique)

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            anchor = self.peek_event().anchor
            if anchor in self.anchors and id(self.anchors[anchor]) not in self._sizes:
                raise _LimitError(f"alias *{bounded(anchor, 40)} used inside its own anchor")
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _LimitError(f"nesting deeper than {MAX_DEPTH} levels")
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        size = self._sizes.get(id(node))
        if size is None:
            size = 1
            if isinstance(node, yaml.SequenceNode):
                size += sum(self._sizes[id(child)] for child in node.value)
            elif isinstance(node, yaml.MappingNode):
                size += sum(self._sizes[id(k)] + self._sizes[id(v)] for k, v in node.value)
            self._sizes[id(node)] = size
            self._nodes.append(node)
        if size > MAX_NODES:
            raise _LimitError(f"more than {MAX_NODES} values once aliases are expanded")
        return node


MAX_DEPTH = 100          # a space or model file nests 3-4 levels
MAX_NODES = 100_000      # a space file has tens of values; a billion-laughs bomb has 10^9


class _LimitError(Exception):
    """A YAML document past the loader's limits (MAX_DEPTH, MAX_NODES)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def read_yaml(path: str | Path) -> Any:
    """Read a YAML file; a missing file, bytes that are not UTF-8 text, a syntax error or a
    document past the loader's limits become a ConfigError."""
    return parse_yaml(read_text(path), str(path))


# Checked before parsing: PyYAML composes roughly 10^4-10^5 values a second, so a 5 MB file
# took ~90 s and 1.9 GB to refuse (issue 23). The largest shipped space file is 2.5 KB.
MAX_FILE_BYTES = 256 * 2**10


def read_text(path: str | Path) -> str:
    """A file's text (UTF-8, a BOM allowed, at most MAX_FILE_BYTES); anything else is a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("file", str(path), "an existing YAML file")
    try:
        size = path.stat().st_size
        with path.open("rb") as stream:      # bounded: the file may grow after stat
            raw = stream.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise ConfigError("file", str(path), f"a readable file ({err.strerror or err})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError("file", str(path), f"a file of at most {MAX_FILE_BYTES // 2**10} KiB "
                          f"(this one is {max(size, len(raw)):,} bytes)")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError("file", str(path), f"UTF-8 text (byte 0x{raw[err.start]:02x} at offset "
                          f"{err.start} is not UTF-8)") from None


def parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "document"
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(where, bounded(problem), "valid YAML", source=source) from None
    except _LimitError as err:
        raise ConfigError("document", str(err), f"a YAML document nested at most {MAX_DEPTH} "
                          f"levels with at most {MAX_NODES} values", source=source) from None
    except RecursionError:   # (the limits above come first; kept for Python's own stack)
        raise ConfigError("document", "too deeply nested", "a YAML document nested at most "
                          f"{MAX_DEPTH} levels", source=source) from None


_UNIT_PREFIX = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
                "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_QUANTITY = re.compile(
    r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*"
    r"(K|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?\s*(B|FLOP|FLOPS|FLOPs)?\s*(/s)?\s*$"
)


def parse_quantity(value: Any, field: str, source: str | None = None) -> float:
    """`4.0e10`, `32GiB`, `1.2 TB/s`, `275 TFLOP/s` -> float (bytes, bytes/s or FLOP/s)."""
    if isinstance(value, bool):
        raise ConfigError(field, value, "a number such as 4.0e10 or 32GiB", source)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        match = _QUANTITY.match(value)
        if match:
            return float(match.group(1)) * _UNIT_PREFIX[match.group(2) or ""]
    raise ConfigError(field, value, "a number such as 4.0e10, 32GiB or 1.2TB/s", source)


def _check_fields(cls, data: Any, kind: str, source: str | None, prefix: str) -> None:
    """`data` is a mapping whose keys are fields of the dataclass `cls`."""
    if not isinstance(data, Mapping):
        raise ConfigError(prefix.rstrip(".") or kind, data, f"a mapping of {kind} fields", source)
    check_keys(data, [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")],
               source, prefix)


# --------------------------------------------------------------------------- model

BLOCKS = ("parallel", "serial")
# gelu: W_in, W_out (the paper's); swiglu: silu(W_gate x) * W_up x (Llama, Mistral, Qwen,
# Mixtral); geglu: gelu(W_gate x) * W_up x (Gemma). Both gated MLPs have three matrices.
MLPS = ("gelu", "swiglu", "geglu")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Transformer (paper §2 notation: E = d_model, F = d_ff, H, K = n_kv_heads).

    Mixture-of-experts (docs/models.md): `n_experts` > 0 replaces every layer's MLP by that
    many experts, each an MLP of width `d_ff`, of which the router picks `experts_per_token`
    per token (top-k, GShard/Switch/Mixtral)."""

    name: str
    d_model: int
    d_ff: int                    # the MLP's width; of each expert in a mixture-of-experts model
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    vocab: int
    block: str = "parallel"      # paper §3.4: attention and MLP read the same normed input
    mlp: str = "gelu"            # gelu: W_in, W_out; swiglu / geglu: W_gate, W_up, W_out
    tie_embeddings: bool = True
    # The context window (prompt + generated tokens) the model was trained for; None: not
    # stated (HF `max_position_embeddings`). Longer requests are refused (docs/models.md).
    max_context: int | None = None
    n_experts: int = 0           # 0: a dense MLP in every layer
    experts_per_token: int = 0   # top-k: experts each token is routed to (MoE only)
    # Set on a head- or vocabulary-padded model (layouts.resolve_padding, paper §4): the model
    # before padding. Padded heads and tokens are zero; MFU counts the unpadded model's FLOPs.
    padded_from: "ModelConfig | None" = dataclasses.field(default=None, metadata={"internal": True})
    # What a Hugging Face config.json said that this model approximates (workloads/hf_config.py),
    # one line each; not part of the model's identity.
    approximations: tuple[str, ...] = dataclasses.field(default=(), compare=False,
                                                        metadata={"internal": True})

    @property
    def unpadded(self) -> "ModelConfig":
        """The model before head padding (itself when not padded)."""
        return self.padded_from if self.padded_from is not None else self

    @property
    def attention_kind(self) -> str:
        if self.n_kv_heads == self.n_heads:
            return "multihead"
        return "multiquery" if self.n_kv_heads == 1 else "grouped-query"

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp in GATED_MLPS else 2

    @property
    def moe(self) -> bool:
        """A mixture-of-experts model (n_experts > 0)."""
        return self.n_experts > 0

    @property
    def experts(self) -> int:
        """MLPs per layer: n_experts, or 1 for a dense model."""
        return self.n_experts if self.moe else 1

    @property
    def active_experts(self) -> int:
        """MLPs each token runs through per layer: experts_per_token, or 1 for a dense model."""
        return self.experts_per_token if self.moe else 1

    def to_dict(self) -> dict:
        """The unpadded model's fields (padding is a trial knob, `pad_heads`). Fields left at
        their defaults since this file's first format (max_context, the MoE fields) are left
        out, so a dense model's mapping, and what was recorded from it, stays as it was."""
        base = self.unpadded
        out = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)
               if not f.metadata.get("internal")}
        for key in OPTIONAL_MODEL_FIELDS:
            if out[key] == MODEL_FIELD_DEFAULTS[key]:
                out.pop(key)
        return out

    @classmethod
    def from_dict(cls, data: Mapping, source: str | None = None, prefix: str = "") -> "ModelConfig":
        _check_fields(cls, data, "model", source, prefix)
        required = ["d_model", "d_ff", "n_layers", "n_heads", "d_head", "vocab"]
        for key in required:
            if key not in data:
                raise ConfigError(f"{prefix}{key}", None, "a positive integer (required)", source)
        values = {key: positive_int(f"{prefix}{key}", data[key], source) for key in required}
        values["n_kv_heads"] = (positive_int(f"{prefix}n_kv_heads", data["n_kv_heads"], source)
                                if "n_kv_heads" in data else values["n_heads"])
        if values["n_heads"] % values["n_kv_heads"]:
            raise ConfigError(f"{prefix}n_kv_heads", values["n_kv_heads"],
                              f"a divisor of n_heads={values['n_heads']}", source)
        values["block"] = one_of(f"{prefix}block", data.get("block", "parallel"), BLOCKS, source)
        values["mlp"] = one_of(f"{prefix}mlp", data.get("mlp", "gelu"), MLPS, source)
        values["tie_embeddings"] = boolean(f"{prefix}tie_embeddings", data.get("tie_embeddings", True),
                                           source)
        if data.get("max_context") is not None:
            values["max_context"] = positive_int(f"{prefix}max_context", data["max_context"], source)
        values.update(_expert_fields(data, source, prefix))
        name = data.get("name", Path(source).stem if source else "custom")
        return cls(name=str(name), **values)


def check_stages(model: ModelConfig, stages, source: str | None = None) -> None:
    """Stages a model's layers split into evenly: 1 to n_layers, a divisor of n_layers (the
    emulated engine's pipeline stages, workloads/serving/pipeline.py, each hold n_layers/stages
    layers)."""
    layers = model.n_layers
    integer("stages", stages, source, what="a positive integer (pipeline stages)")
    if stages > layers:
        raise ConfigError("stages", stages, f"at most the model's n_layers={layers} "
                          "(each stage holds at least one layer)", source)
    if layers % stages:
        raise ConfigError("stages", stages, f"a divisor of the model's n_layers={layers} "
                          "(each stage holds n_layers/stages layers)", source)


def check_context(model: ModelConfig, tokens: float, field: str, value: Any = None,
                  source: str | None = None, what: str = "") -> None:
    """ConfigError when `tokens` (prompt and answer together) exceed the model's context
    window (`max_context`); `value` is what the user gave for `field` (default `tokens`),
    `what` says how `tokens` was counted from it."""
    window = model.unpadded.max_context
    if window is not None and tokens > window:
        counted = f" ({what})" if what else ""
        raise ConfigError(field, tokens if value is None else value,
                          f"prompt and answer within {model.unpadded.name}'s context window of "
                          f"{window} tokens{counted}", source)


GATED_MLPS = ("swiglu", "geglu")
# ModelConfig fields a mapping may leave out (their defaults), and left out by to_dict when
# at their defaults.
OPTIONAL_MODEL_FIELDS = ("max_context", "n_experts", "experts_per_token")
MODEL_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                        if f.name in OPTIONAL_MODEL_FIELDS}


def _expert_fields(data: Mapping, source: str | None, prefix: str) -> dict:
    """n_experts and experts_per_token: both or neither, 1 <= top-k <= experts."""
    experts = data.get("n_experts", 0) or 0
    top_k = data.get("experts_per_token", 0) or 0
    if not experts and not top_k:
        return {}
    experts = positive_int(f"{prefix}n_experts", experts, source)
    if experts < 2:
        raise ConfigError(f"{prefix}n_experts", experts, "0 (a dense MLP) or at least 2 experts",
                          source)
    if not top_k:
        raise ConfigError(f"{prefix}experts_per_token", None, "the experts each token is routed "
                          f"to (top-k, 1..n_experts={experts}) for a model with n_experts", source)
    top_k = positive_int(f"{prefix}experts_per_token", top_k, source)
    if top_k > experts:
        raise ConfigError(f"{prefix}experts_per_token", top_k, f"at most n_experts={experts}", source)
    return {"n_experts": experts, "experts_per_token": top_k}


def _palm(name, e, layers, heads, kv=1, d_head=256):
    # PaLM (Chowdhery et al. 2022, Table 1): SwiGLU MLP with F = 4E, multiquery, parallel
    # block, d_head 256, 256k vocabulary, shared input/output embeddings. No context window:
    # the paper (Table 1) studies contexts past PaLM's training length.
    return ModelConfig(name, e, 4 * e, layers, heads, kv, d_head, 256_000, "parallel", "swiglu", True)


def _hf(name, e, f, layers, heads, kv, vocab, context, d_head=128, experts=0, top_k=0):
    # A model released with a Hugging Face config.json (Llama, Mixtral, Qwen): serial block,
    # SwiGLU MLP (hidden_act silu), untied embeddings; `context` = max_position_embeddings.
    return ModelConfig(name, e, f, layers, heads, kv, d_head, vocab, "serial", "swiglu", False,
                       max_context=context, n_experts=experts, experts_per_token=top_k)


MODEL_PRESETS: dict[str, ModelConfig] = {m.name: m for m in [
    _palm("palm-8b", 4096, 32, 16),
    _palm("palm-62b", 8192, 64, 32),
    _palm("palm-540b", 18432, 118, 48),
    # Paper §4: "we padded the number of attention heads up from 48 to 64".
    _palm("palm-540b-padded", 18432, 118, 64),
    # Paper Table 1's multihead comparison: 64 heads x d_head 128, one KV head per query head.
    _palm("palm-540b-multihead", 18432, 118, 64, kv=64, d_head=128),
    # MT-NLG 530B (Smith et al. 2022): E 20480, 105 layers, 128 heads, GPT-style serial block.
    ModelConfig("mt-nlg-530b", 20480, 81920, 105, 128, 128, 160, 51_200, "serial", "gelu", True),
    # Llama 2 (Touvron et al. 2023, Table 1 and the released configs): context 4096.
    _hf("llama2-13b", 5120, 13824, 40, 40, 40, 32_000, 4096),
    _hf("llama2-70b", 8192, 28672, 80, 64, 8, 32_000, 4096),
    # Llama 3.1 (the released config.json of meta-llama/Llama-3.1-8B, -70B, -405B; Grattafiori
    # et al. 2024, "The Llama 3 Herd of Models", Table 3): 128k context, 128256 tokens.
    _hf("llama3.1-8b", 4096, 14336, 32, 32, 8, 128_256, 131_072),
    _hf("llama3.1-70b", 8192, 28672, 80, 64, 8, 128_256, 131_072),
    _hf("llama3.1-405b", 16384, 53248, 126, 128, 8, 128_256, 131_072),
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", Table 1; config.json of
    # mistralai/Mixtral-8x7B-v0.1): 8 experts of F 14336, top-2, 32k context.
    _hf("mixtral-8x7b", 4096, 14336, 32, 32, 8, 32_000, 32_768, experts=8, top_k=2),
    # Qwen3 MoE (config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B; Qwen3 Technical
    # Report 2025, Table 2): fine-grained experts, 128 of them, top-8, no shared expert.
    _hf("qwen3-30b-a3b", 2048, 768, 48, 32, 4, 151_936, 40_960, experts=128, top_k=8),
    _hf("qwen3-235b-a22b", 4096, 1536, 94, 64, 4, 151_936, 40_960, experts=128, top_k=8),
    # Tiny models for tests and the quickstart (E <= 256; 8 heads so 8-way head sharding works).
    ModelConfig("tiny", 128, 512, 2, 8, 1, 16, 256, "parallel", "gelu", True),
    ModelConfig("tiny-mha", 128, 512, 2, 8, 8, 16, 256, "parallel", "gelu", True),
    ModelConfig("tiny-gqa", 128, 512, 2, 8, 2, 16, 256, "parallel", "gelu", True),
    ModelConfig("tiny-serial", 128, 512, 2, 8, 2, 16, 256, "serial", "swiglu", False),
    # A tiny Mixtral: 4 experts of F 256, top-2 (tests; search_spaces/moe.yaml reads the same
    # shape from its Mixtral-style config.json).
    ModelConfig("tiny-moe", 128, 256, 2, 8, 2, 16, 256, "serial", "swiglu", False,
                max_context=512, n_experts=4, experts_per_token=2),
    ModelConfig("small", 256, 1024, 4, 8, 1, 32, 512, "parallel", "gelu", True),
    # The calibration sweep's model (search_spaces/calibration.yaml): big enough that on a
    # 2-core host one chip's prefill of 8 x 64 tokens takes >= 50 ms and a decode step
    # >= 1 ms, so the costs the paper models outweigh per-step dispatch and timer jitter;
    # small enough that its 192 trials on 1-8 emulated chips finish in under 20 minutes.
    ModelConfig("calib", 768, 3072, 2, 8, 1, 96, 1024, "parallel", "gelu", True),
]}


# --------------------------------------------------------------------------- hardware

# The collectives of paper §3.1 (workloads/layouts.py schedules them); a calibrated profile
# may carry a fixed latency per kind.
COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


@dataclass(frozen=True)
class HardwareProfile:
    """One chip's peak numbers (paper §2/§4). Calibrated profiles carry fitted constants too."""

    name: str
    peak_flops: float          # bf16 matmul FLOP/s per chip
    hbm_bandwidth: float       # bytes/s per chip
    hbm_bytes: float           # bytes per chip
    ici_bandwidth: float       # interconnect bytes/s per chip
    # Calibration constants (sweeper/analysis/calibrate.py fits them; defaults = the paper's ideal model).
    collective_latency_s: float = 0.0   # fixed cost per collective op
    op_overhead_s: float = 0.0          # fixed cost per layer-phase (dispatch, small ops)
    overlap: float = 0.0                # 0 = additive times, 1 = max(compute, memory, comm)
    measured: bool = False              # True for the `host` profile: numbers measured on this host
    # Fitted fixed cost per collective op of one kind (all-gather, ...); a kind not listed
    # costs `collective_latency_s`. Not hashed: a dict (frozen dataclass stays hashable).
    collective_latency_s_by_kind: dict = dataclasses.field(default_factory=dict, hash=False)
    # Fitted terms the measurements demand (issue 10; sweeper/analysis/fit.py), 0 = the paper's model:
    collective_latency_s_per_device: float = 0.0   # + per collective op x (group size - 1)
    launch_overhead_s: float = 0.0                 # + once per program launch (a phase call)
    device_overhead_s: float = 0.0                 # + per layer x chips: per-device dispatch (issue 20)
    # + per collective op x g x (g - 1): on an emulated mesh a collective's g device threads
    # share cores, each waiting through the other g - 1 threads' turns (issue 20)
    collective_rendezvous_s: float = 0.0
    # Rows (M dimension) of a chip's matmul at which it runs at half the peak rate: a matmul
    # of r rows runs at peak x r / (r + matmul_half_rows) (costmodel.matmul_rows; issue 20:
    # small per-chip shapes run far below peak, large ones near it). 0 = always at peak.
    matmul_half_rows: float = 0.0
    # The same for the narrower side of a chip's weight tile (costmodel.weight_tile_dim): a
    # weight matmul's time grows by FLOPs x matmul_half_dim / dim / peak; 0 = the paper's model.
    matmul_half_dim: float = 0.0
    # The same for attention alone, by its rows (the queries sharing a KV head, paper §3.3):
    # each (sequence, KV head) pair's attention is its own small matmul pass
    # (costmodel.ATTENTION_HALF_ROWS; issue 20). 0 = the paper's model.
    attention_half_rows: float = 0.0
    # Measured per kind and group size by `sweeper profile` (workloads/opprofile.py): one
    # collective over g chips takes latency + bytes_per_chip / bandwidth, bytes per chip as
    # the HLO counts them (all-gather: output; reduce-scatter: input; others: the tensor).
    # {kind: {g: seconds}} and {kind: {g: bytes/s}}; empty unless profiled.
    collective_latency_s_by_group: dict = dataclasses.field(default_factory=dict, hash=False)
    collective_bandwidth_by_group: dict = dataclasses.field(default_factory=dict, hash=False)
    # Serving (issue 19, docs/serving.md). The fast-interconnect domain: chips that reach each
    # other at `ici_bandwidth` (an NVLink node of 8 GPUs; a TPU slice, whose ICI spans its
    # hosts); 0 = unbounded. Between domains (InfiniBand/Ethernet between GPU nodes, DCN
    # between TPU slices) each chip moves `inter_domain_bandwidth` bytes/s; 0 = unknown, the
    # serving model then prices a transfer at `ici_bandwidth` and says so.
    domain_chips: int = 0
    inter_domain_bandwidth: float = 0.0
    price_per_chip_hour: float | None = None   # on-demand list price, dollars; None = unknown
    # Mesh axes the interconnect has (TPU v4: a 3-D torus; v5e: 2-D): a topology that splits
    # more axes than this is never proposed (workloads/recommend.py, issue 24).
    torus_dims: int = 3
    # Signed relative residuals (predicted / measured - 1) of held-out points per phase
    # ({"prefill": [...], "decode": [...]}), written by `sweeper fit` into a fitted profile;
    # the serving planner's error bands are their split-conformal quantiles. Empty = unknown.
    heldout_residuals: dict = dataclasses.field(default_factory=dict, hash=False)
    # Serving host costs (workloads/serving/costs.py, docs/serving.md "Serving host costs"):
    # what a serving loop adds on the host to the engine's calls, measured outside the
    # serving runs they predict (sweeper/serving/overheads.py); 0 = none (an accelerator's).
    # A profile YAML holds them as a `host_costs:` mapping (older files' flat
    # `serving_*_s` keys load too).
    host_costs: HostCosts = dataclasses.field(default_factory=HostCosts)
    # Precision and memory (docs/models.md). FP8 matmul FLOP/s per chip (dense, W8A8 on FP8
    # tensor cores); 0 = no FP8 units: FP8 weights are then stored in 8 bits and computed in
    # bf16 (weight-only, as int8).
    fp8_flops: float = 0.0
    # Fraction of each chip's HBM held back for the runtime (CUDA context, library
    # workspaces, compiled graphs) and fragmentation: a plan fills at most
    # `usable_hbm_bytes` with weights, KV cache and working set (issue 39).
    memory_reserve: float = 0.0
    # Where a measured profile came from (`sweeper calibrate`, docs/host-calibration.md): the
    # host it describes (`host_key`), when, how long it took, the probes' held-out error.
    # Plain data, never used to predict; empty for presets and hand-written profiles.
    calibration: dict = dataclasses.field(default_factory=dict, hash=False)
    # A calibrated host's cost model (workloads/hostmodel.py HostModel.to_dict(): fitted costs
    # per phase, the worker share they were measured at, the cache): when present,
    # costmodel.predict_phase takes each call's latency from it. Empty = the paper's model.
    host_model: dict = dataclasses.field(default_factory=dict, hash=False)
    # The share of the whole profile this one is (HardwareProfile.scaled multiplies it): a
    # host model's counts need the worker's share of the host, share x chips.
    host_share: float = 1.0
    # Measured on an emulated mesh, when known (0 / 1 = none): the longest a per-op collective
    # latency may be fitted to (one whole small collective on that host: a start-up latency
    # above a whole collective is not physical; sweeper/analysis/fit.py), and what a weight
    # all-gather of more than one replica group costs per byte against one group's
    # (costmodel.multigroup_gather_scale). `sweeper calibrate` measures the bound on the host
    # it writes the profile of (sweeper/calibrate/fitting.py); the price is measured only by
    # benchmarks/collectives.py inside the engine's prefill, so no written profile carries it.
    # A value measured on one host never applies to another (issue 35).
    collective_latency_max_s: float = 0.0
    multigroup_gather_scale: float = 1.0

    @property
    def usable_hbm_bytes(self) -> float:
        """HBM per chip a model may fill: hbm_bytes less the memory_reserve."""
        return self.hbm_bytes * (1.0 - self.memory_reserve)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def scaled(self, fraction: float, memory: bool = False) -> "HardwareProfile":
        """A share of this profile: peak FLOP/s and bandwidths times `fraction`.

        `memory=True` splits the HBM capacity too (one of n virtual chips on a host);
        a worker's share of the host's cores keeps the whole memory (docs/architecture.md,
        "Hardware profiles and shares")."""
        if fraction == 1.0:
            return self
        return dataclasses.replace(
            self, host_share=self.host_share * fraction,
            peak_flops=self.peak_flops * fraction, hbm_bandwidth=self.hbm_bandwidth * fraction,
            ici_bandwidth=self.ici_bandwidth * fraction,
            hbm_bytes=self.hbm_bytes * fraction if memory else self.hbm_bytes,
            collective_bandwidth_by_group={kind: {g: bw * fraction for g, bw in groups.items()}
                                           for kind, groups in self.collective_bandwidth_by_group.items()})

    @classmethod
    def from_dict(cls, data: Mapping, source: str | None = None, prefix: str = "") -> "HardwareProfile":
        _check_fields(cls, _without_flat_host_costs(data), "hardware", source, prefix)
        values: dict[str, Any] = {}
        for key in ("peak_flops", "hbm_bandwidth", "hbm_bytes", "ici_bandwidth"):
            if key not in data:
                raise ConfigError(f"{prefix}{key}", None, "a positive number (required)", source)
            values[key] = number(f"{prefix}{key}", parse_quantity(data[key], f"{prefix}{key}", source),
                                 source, positive=True)
        for key in ("collective_latency_s", "op_overhead_s", "overlap",
                    "collective_latency_s_per_device", "launch_overhead_s", "device_overhead_s",
                    "collective_rendezvous_s",
                    "matmul_half_rows", "matmul_half_dim", "attention_half_rows",
                    "fp8_flops", "memory_reserve"):
            if key in data:
                values[key] = parse_quantity(data[key], f"{prefix}{key}", source)
                if values[key] < 0 or (key == "overlap" and values[key] > 1) \
                        or (key == "memory_reserve" and values[key] >= 1):
                    accepted = {"overlap": "a number in [0, 1]",
                                "memory_reserve": "a fraction in [0, 1) of each chip's HBM"
                                }.get(key, "a number >= 0")
                    raise ConfigError(f"{prefix}{key}", data[key], accepted, source)
        values["measured"] = bool(data.get("measured", False))
        by_kind = data.get("collective_latency_s_by_kind") or {}
        if not isinstance(by_kind, Mapping):
            raise ConfigError(f"{prefix}collective_latency_s_by_kind", by_kind,
                              "a mapping {all-gather: seconds, ...}", source)
        values["collective_latency_s_by_kind"] = {}
        for kind, seconds in by_kind.items():
            where = f"{prefix}collective_latency_s_by_kind.{kind}"
            one_of(where, kind, COLLECTIVE_KINDS, source)
            value = number(where, parse_quantity(seconds, where, source), source)
            values["collective_latency_s_by_kind"][kind] = value
        for key, what in (("collective_latency_s_by_group", "seconds"),
                          ("collective_bandwidth_by_group", "bytes/s")):
            values[key] = _by_group(data.get(key) or {}, f"{prefix}{key}", what,
                                    positive=key.startswith("collective_bandwidth"), source=source)
        values.update(_serving_fields(data, source, prefix))
        values["host_costs"] = _host_costs(data, source, prefix)
        calibration = data.get("calibration") or {}
        if not isinstance(calibration, Mapping):
            raise ConfigError(f"{prefix}calibration", calibration,
                              "a mapping (written by `sweeper calibrate`)", source)
        values["calibration"] = dict(calibration)
        host_model = data.get("host_model") or {}
        if not isinstance(host_model, Mapping) or (host_model and not isinstance(
                host_model.get("costs"), Mapping)):
            raise ConfigError(f"{prefix}host_model", host_model,
                              "a mapping {share, cache_bytes, costs: {prefill: {...}, decode: {...}}} "
                              "(written by `sweeper calibrate`)", source)
        values["host_model"] = dict(host_model)
        for key in ("collective_latency_max_s", "multigroup_gather_scale"):
            if key in data:
                values[key] = number(f"{prefix}{key}", parse_quantity(data[key], f"{prefix}{key}",
                                                                       source), source)
        if "host_share" in data:
            values["host_share"] = parse_quantity(data["host_share"], f"{prefix}host_share", source)
        name = data.get("name", Path(source).stem if source else "custom")
        return cls(name=str(name), **values)


def _is_flat_host_cost(key: str) -> bool:
    """A host cost written as a flat profile field (files written before HostCosts)."""
    return key in OLD_NAMES or key in HostCosts.names()


def _without_flat_host_costs(data: Any) -> Any:
    if not isinstance(data, Mapping):
        return data
    return {k: v for k, v in data.items() if not _is_flat_host_cost(k)}


def _host_costs(data: Mapping, source: str | None, prefix: str) -> HostCosts:
    """The `host_costs:` mapping, or an older profile's flat `serving_*_s` keys (not both)."""
    flat = {k: v for k, v in data.items() if _is_flat_host_cost(k)}
    written, where = data.get("host_costs"), f"{prefix}host_costs."
    if written is None:
        written, where = flat, prefix
    elif flat:
        key = sorted(flat)[0]
        raise ConfigError(f"{prefix}{key}", flat[key],
                          "no flat host cost beside a `host_costs:` mapping", source)
    else:
        _check_fields(HostCosts, written, "host_costs", source, where)
    values = {}
    for key, value in written.items():
        values[OLD_NAMES.get(key, key)] = number = parse_quantity(value, f"{where}{key}", source)
        if not number >= 0:
            raise ConfigError(f"{where}{key}", value, "a number >= 0 (seconds; bytes for "
                              "prefill_wake_weight_bytes)", source)
    return HostCosts(**values)


def _serving_fields(data: Mapping, source: str | None, prefix: str) -> dict:
    """domain_chips, inter_domain_bandwidth, price_per_chip_hour, torus_dims, heldout_residuals."""
    out: dict[str, Any] = {}
    if data.get("domain_chips") not in (None, 0):
        out["domain_chips"] = positive_int(f"{prefix}domain_chips", data["domain_chips"], source)
    for key in ("inter_domain_bandwidth", "price_per_chip_hour"):
        if data.get(key) is not None:
            out[key] = number(f"{prefix}{key}", parse_quantity(data[key], f"{prefix}{key}", source),
                              source)
    if "torus_dims" in data:
        out["torus_dims"] = one_of(f"{prefix}torus_dims", data["torus_dims"], (1, 2, 3), source)
    residuals = data.get("heldout_residuals") or {}
    if not isinstance(residuals, Mapping):
        raise ConfigError(f"{prefix}heldout_residuals", residuals,
                          "a mapping {prefill: [residuals], decode: [residuals]}", source)
    out["heldout_residuals"] = {}
    for phase, values in residuals.items():
        where = f"{prefix}heldout_residuals.{phase}"
        if phase not in ("prefill", "decode"):
            raise ConfigError(where, phase, "prefill or decode", source)
        if not isinstance(values, (list, tuple)):
            raise ConfigError(where, values, "a list of relative residuals (predicted/measured - 1)",
                              source)
        numbers = [parse_quantity(v, where, source) for v in values]
        if any(not math.isfinite(v) or v <= -1 for v in numbers):
            raise ConfigError(where, values, "finite residuals > -1 (predicted/measured - 1)", source)
        out["heldout_residuals"][phase] = numbers
    return out


def _by_group(data: Any, where: str, what: str, positive: bool, source: str | None) -> dict:
    """{kind: {group size: number}} from a profile YAML (group sizes may be written as strings)."""
    if not isinstance(data, Mapping):
        raise ConfigError(where, data, f"a mapping {{all-gather: {{2: {what}, ...}}, ...}}", source)
    out: dict[str, dict[int, float]] = {}
    for kind, groups in data.items():
        one_of(f"{where}.{kind}", kind, COLLECTIVE_KINDS, source)
        if not isinstance(groups, Mapping):
            raise ConfigError(f"{where}.{kind}", groups, f"a mapping {{group size: {what}}}", source)
        out[kind] = {}
        for group, number in groups.items():
            field_name = f"{where}.{kind}.{group}"
            try:
                size = int(group)
            except (TypeError, ValueError):
                size = 0
            if size < 2:
                raise ConfigError(field_name, group, "a group size, an integer >= 2", source)
            value = parse_quantity(number, field_name, source)
            if value < 0 or (positive and not value > 0):
                raise ConfigError(field_name, number, "a positive number" if positive else
                                  "a number >= 0", source)
            out[kind][size] = value
    return out


GiB = 2**30
# Serving fields of the presets (issue 19; docs/serving.md "Hardware"):
# - TPU: a v4 pod is 4096 chips on a 3-D ICI torus (Jouppi et al. 2023, "TPU v4", ISCA), a
#   v5e pod 256 chips on a 2-D torus (Google Cloud TPU v5e docs); slices talk over the data-
#   center network: 2.5e10 B/s egress per host of 4 chips (scaling book part 2, "TPU
#   networking") -> 6.25e9 B/s per chip.
# - GPU: an HGX/DGX node of 8 GPUs on NVSwitch; between nodes one 400 Gb/s InfiniBand NDR
#   port per H100/H200 (DGX H100 datasheet: 8x ConnectX-7) = 5e10 B/s, 200 Gb/s HDR per
#   A100 (DGX A100 datasheet) = 2.5e10 B/s. NVSwitch is all-to-all: any logical 3-D mesh.
# - Prices: on-demand list prices per chip-hour, US regions, as published in 2024 (Google
#   Cloud TPU pricing: v4 $3.22, v5e $1.20; Google Cloud GPU VM pricing: a3-highgpu-8g
#   ~$88.49/h / 8 = $11.06 per H100, a2-ultragpu-1g ~$5.07/h per A100 80GB). H200: no
#   hyperscaler list price at the time; E2E Networks' on-demand H200 (INR 300/h, $3.37, 2025).
#   PRICE_SOURCES says where each default comes from; `sweeper plan --price chip=DOLLARS`
#   overrides it.
_TPU_V4 = dict(domain_chips=4096, inter_domain_bandwidth=6.25e9, torus_dims=3)
_TPU_V5E = dict(domain_chips=256, inter_domain_bandwidth=6.25e9, torus_dims=2)
HARDWARE_PRESETS: dict[str, HardwareProfile] = {h.name: h for h in [
    # Paper §4: TPU v4, 275 TFLOP/s bf16, 32 GiB HBM at 1200 GB/s, 270 GB/s interconnect per chip.
    HardwareProfile("tpu-v4", 275e12, 1.2e12, 32 * GiB, 270e9, price_per_chip_hour=3.22, **_TPU_V4),
    # TPU v4 fitted to the paper's published measurements (benchmarks/data/paper-tpu-v4.csv):
    # an earlier fit on every row (issue 20), every constant within the sheet, int8 decode
    # 1.31x faster than bf16 at batch 64 (paper 1.29x). Kept: the benchmark's current headline
    # fit (`python -m benchmarks.paper_fit`, benchmarks/results/paper_fit.md: soft_l1 loss,
    # launch_overhead_s and the matmul terms chosen by nested cross-validation) is refused by
    # `sweeper fit` (Figure 7's weight-gathered point at 125k tokens blows up) and holds int8 at
    # 1.24x, further from the paper (docs/calibration.md).
    # Effective constants, so MFU against it is not the paper's MFU (that uses 275 TFLOP/s).
    HardwareProfile("tpu-v4-fitted", 1.284e14, 1.2e12, 32 * GiB, 2.696e11,
                    collective_latency_s=1.156e-06, op_overhead_s=0.0, overlap=0.99999,
                    collective_latency_s_by_kind={"all-gather": 0.0,
                                                  "reduce-scatter": 0.0,
                                                  "all-reduce": 2.311e-06,
                                                  "all-to-all": 4.898e-05},
                    price_per_chip_hour=3.22, **_TPU_V4),
    # Scaling book part 7 (and Google Cloud TPU v5e docs): 1.97e14 bf16 FLOP/s, 8.2e11 B/s HBM,
    # 16 GiB; ICI 4.5e10 B/s one way per link, 4 links on a 2D torus -> ~1.8e11 B/s per chip.
    HardwareProfile("tpu-v5e", 1.97e14, 8.2e11, 16 * GiB, 1.8e11, price_per_chip_hour=1.20,
                    **_TPU_V5E),
    # NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s dense bf16, 2.039 TB/s, NVLink 600 GB/s
    # bidirectional = 300 GB/s each way.
    HardwareProfile("a100-80g", 312e12, 2.039e12, 80e9, 300e9, domain_chips=8,
                    inter_domain_bandwidth=2.5e10, price_per_chip_hour=5.07),
    # NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB, NVLink 4
    # 900 GB/s bidirectional = 450 GB/s each way.
    HardwareProfile("h100", 989e12, 3.35e12, 80e9, 450e9, domain_chips=8,
                    inter_domain_bandwidth=5e10, price_per_chip_hour=11.06),
    # NVIDIA H200 SXM datasheet: same compute as H100, 141 GB HBM3e at 4.8 TB/s, NVLink 4.
    HardwareProfile("h200", 989e12, 4.8e12, 141e9, 450e9, domain_chips=8,
                    inter_domain_bandwidth=5e10, price_per_chip_hour=3.37),
]}
PRICE_SOURCES = {
    "tpu-v4": "Google Cloud TPU pricing, on-demand v4, US regions (2024)",
    "tpu-v4-fitted": "as tpu-v4",
    "tpu-v5e": "Google Cloud TPU pricing, on-demand v5e, US regions (2024)",
    "a100-80g": "Google Cloud a2-ultragpu-1g on-demand, US regions (2024)",
    "h100": "Google Cloud a3-highgpu-8g on-demand / 8, US regions (2024)",
    "h200": "E2E Networks on-demand H200, INR 300/h (2025)",
    "b200": "none published (2025): give one with --price b200=DOLLARS",
}

# Precision and memory of the presets (issue 39, docs/models.md), kept apart from the
# preset lines above:
# - FP8: NVIDIA H100 SXM and H200 SXM datasheets, 1979 TFLOP/s dense FP8 (3958 with
#   sparsity); B200 below. A100, TPU v4 and v5e have no FP8 units (0).
# - Memory reserve: vLLM keeps its weights, activations and KV cache within
#   gpu_memory_utilization = 0.9 of a GPU by default (vLLM engine arguments), leaving 10% to
#   the CUDA context, library workspaces, CUDA graphs and fragmentation. No TPU serving
#   engine publishes such a default; the same 10% is used for the TPU presets.
# - B200: NVIDIA DGX B200 datasheet: 8 GPUs with 1,440 GB HBM3e in total (180 GB each) at
#   64 TB/s (8 TB/s each), 72 PFLOP/s FP8 and 36 PFLOP/s FP16/BF16 with sparsity for the 8
#   (dense: half, 4.5e15 FP8 and 2.25e15 BF16 per GPU), NVLink 5 at 1.8 TB/s bidirectional
#   (900 GB/s each way), one 400 Gb/s ConnectX-7 port per GPU (5e10 B/s) between nodes. No
#   on-demand price published at the time: None.
# Presets fitted to published measurements (below) take these from their datasheet.
HARDWARE_PRESETS["b200"] = HardwareProfile("b200", 2.25e15, 8e12, 180e9, 900e9, domain_chips=8,
                                           inter_domain_bandwidth=5e10)
_FP8_FLOPS = {"h100": 1979e12, "h200": 1979e12, "b200": 4.5e15}
MEMORY_RESERVE = 0.1
MEMORY_RESERVE_SOURCES = {
    name: ("vLLM's default gpu_memory_utilization 0.9 (vLLM engine arguments)"
           if not name.startswith("tpu") else
           "as the GPU presets (vLLM's 0.9 utilization): no TPU serving engine publishes one")
    for name in HARDWARE_PRESETS}
HARDWARE_PRESETS.update({name: dataclasses.replace(profile, fp8_flops=_FP8_FLOPS.get(name, 0.0),
                                                   memory_reserve=MEMORY_RESERVE)
                         for name, profile in HARDWARE_PRESETS.items()})


# Presets fitted to published measurements of real engines (`python -m benchmarks.world`
# writes workloads/presets/world.yaml; docs/world.md): `<chip>-world`, each with its
# datasheet named and the held-out residuals its error bands come from. WORLD_CALIBRATION
# says what each was fitted to: {name: {datasheet, sources, points, points_on_chip, heldout}}.
WORLD_PRESETS_FILE = Path(__file__).resolve().parent / "presets" / "world.yaml"
WORLD_CALIBRATION: dict[str, dict] = {}


def _load_world_presets(path: Path = WORLD_PRESETS_FILE) -> None:
    if not path.is_file():
        return
    for name, entry in (parse_yaml(read_text(path), str(path)) or {}).items():
        profile = HardwareProfile.from_dict(entry["profile"], source=str(path),
                                            prefix=f"{name}.profile.")
        HARDWARE_PRESETS[name] = _with_datasheet_precision(profile, entry["profile"],
                                                           HARDWARE_PRESETS[entry["datasheet"]])
        WORLD_CALIBRATION[name] = {k: v for k, v in entry.items() if k != "profile"}
        PRICE_SOURCES.setdefault(name, f"as {entry['datasheet']}")
        MEMORY_RESERVE_SOURCES.setdefault(name, f"as {entry['datasheet']}")


def _with_datasheet_precision(fitted: HardwareProfile, given: dict,
                              sheet: HardwareProfile) -> HardwareProfile:
    """A fitted preset takes its datasheet's memory reserve, and FP8 units at the datasheet's
    FP8/bf16 ratio of its fitted bf16 rate, unless its file names them (docs/models.md)."""
    changes = {}
    if "memory_reserve" not in given:
        changes["memory_reserve"] = sheet.memory_reserve
    if "fp8_flops" not in given and sheet.fp8_flops:
        changes["fp8_flops"] = fitted.peak_flops * sheet.fp8_flops / sheet.peak_flops
    return dataclasses.replace(fitted, **changes)


_load_world_presets()


# --------------------------------------------------------------------------- loading


def _load(spec: Any, presets: Mapping, cls, kind: str, source: str | None, field: str):
    if isinstance(spec, (ModelConfig, HardwareProfile)):
        return spec
    if isinstance(spec, Mapping):
        return cls.from_dict(spec, source=source, prefix=f"{field}.")
    if isinstance(spec, str):
        if spec in presets:
            return presets[spec]
        spec = _beside(spec, source)
        if cls is ModelConfig and hf_config.is_hf_config(spec):
            return _load_hf_model(spec)
        if spec.endswith((".yaml", ".yml")) or Path(spec).is_file():
            data = read_yaml(spec)
            return cls.from_dict(data, source=spec)
        close = difflib.get_close_matches(spec, list(presets), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        files = "a Hugging Face config.json (or its directory) or a YAML file" if cls is ModelConfig \
            else "or a YAML file"
        raise ConfigError(field, spec, f"a {kind} preset {sorted(presets)}, {files}{hint}", source)
    raise ConfigError(field, spec, f"a {kind} preset name, a YAML path or a mapping", source)


def _beside(spec: str, source: str | None) -> str:
    """A relative path that is not there is looked up beside the file that names it (a
    space file's `model: tiny-moe/config.json`)."""
    path = Path(spec)
    if path.is_absolute() or path.exists() or not source:
        return spec
    beside = Path(source).parent / path
    return str(beside) if beside.exists() else spec


def _load_hf_model(spec: str) -> ModelConfig:
    """A Hugging Face config.json (workloads/hf_config.py); its approximations are warned."""
    path = hf_config.config_path(spec)
    source = str(path)
    fields, approximations = hf_config.model_fields(read_text(path), source)
    model = ModelConfig.from_dict({"name": hf_config.model_name(path), **fields}, source=source)
    hf_config.warn(approximations, source)
    return dataclasses.replace(model, approximations=approximations)


def load_model(spec: Any, source: str | None = None, field: str = "model") -> ModelConfig:
    """Preset name, path to a model YAML, a Hugging Face config.json (or the directory holding
    one), or an inline mapping of model fields. A relative path is also looked up beside
    `source` (the file that names it)."""
    return _load(spec, MODEL_PRESETS, ModelConfig, "model", source, field)


def load_hardware(spec: Any, source: str | None = None, field: str = "hardware") -> HardwareProfile:
    """Preset name, path to a hardware YAML, or a mapping. `host` (this machine, measured)
    is resolved by workloads.hardware.load_hardware, which the callers use."""
    if spec == "host":
        raise ConfigError(field, spec, "a preset or YAML here; `host` is measured: use "
                          "workloads.hardware.load_hardware", source)
    return _load(spec, HARDWARE_PRESETS, HardwareProfile, "hardware", source, field)


def parse_topology(value: Any, chips: int | None, field: str = "topology",
                   source: str | None = None) -> tuple[int, int, int]:
    """'4x4x4', [4, 4, 4] or (4, 4, 4) -> (X, Y, Z); the product must be the chip count."""
    parts: list[Any]
    if isinstance(value, str):
        parts = value.lower().replace("×", "x").split("x")
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise ConfigError(field, value, "XxYxZ such as 2x2x1", source)
    try:
        dims = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise ConfigError(field, value, "XxYxZ with positive integers, such as 2x2x1", source) from None
    if len(dims) != 3 or min(dims) <= 0:
        raise ConfigError(field, value, "three positive integers XxYxZ, such as 2x2x1", source)
    if chips is not None and math.prod(dims) != chips:
        raise ConfigError(field, value, f"X*Y*Z equal to chips={chips}", source)
    return dims  # type: ignore[return-value]
