"""Which layout to run one phase with: every candidate evaluated or rejected with its reason.

    rec = recommend(model, hw, chips=64, batch=64, phase="decode", context=2048)
    rec.best.prediction.latency_s, rec.candidates, rec.rejected

A question is answered as long as one layout can run it: a layout whose heads, batch or
dimensions do not divide over its axes is *rejected* with that reason (and so is one that
does not fit in HBM, after being predicted), never an error. ConfigError only when no
layout is valid at all.

Two rules make the candidates the paper's:
- head padding (paper §4: PaLM 540B's 48 heads padded to 64 "to partition more effectively
  on 64+ chips"): `pad_heads="auto"` pads each candidate's query heads to the smallest
  count its sharded axes divide (layouts.padded_head_count); the extra parameters, FLOPs
  and memory are in its prediction, MFU counts the unpadded model (costmodel.predict_phase);
- degenerate layouts: a gather over mesh axes of total size 1 is the weight-stationary
  program (layouts.canonical_layout). Such a layout is predicted once, under its canonical
  name, and the requested names it stands for are listed as `aliases`.

Pure Python (no JAX); plain dataclasses cross the module boundary.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from workloads import costmodel
from workloads.config import ConfigError, HardwareProfile, ModelConfig
from workloads.layouts import (ATTN_LAYOUTS, EXPERT_LAYOUTS, FFN_LAYOUTS, PHASES, WEIGHT_FORMATS,
                               PhaseLayout, canonical_layout, resolve_padding)
from workloads.validate import one_of, positive_int

# Why a layout was not recommended (Rejected.kind).
HEADS, BATCH, DIMENSIONS, MEMORY = ("heads do not divide", "batch does not divide",
                                    "dimensions do not divide", "does not fit memory")


@dataclass
class Candidate:
    """One evaluated (ffn, attn, topology) with its analytical prediction."""

    ffn: str
    attn: str
    topology: tuple[int, int, int]
    heads: int                                  # query heads as run (padded)
    prediction: costmodel.PhasePrediction
    aliases: list[str] = field(default_factory=list)   # requested ffn names that are this program
    experts: str = "tp"                         # a mixture-of-experts model's (layouts.py)

    @property
    def fits(self) -> bool:
        return self.prediction.fits

    def summary(self) -> dict:
        p = self.prediction
        return {"ffn": self.ffn, "attn": self.attn, "topology": list(self.topology),
                "experts": self.experts,
                "heads": self.heads, "same_program_as": list(self.aliases),
                "latency_s": p.latency_s, "compute_s": p.compute_s, "memory_s": p.memory_s,
                "comm_s": p.comm_s, "mfu": p.mfu, "peak_bytes_per_chip": p.peak_bytes_per_chip,
                "fits": p.fits, "bound": p.bound}


@dataclass
class Rejected:
    """A layout that is not recommended, and why (one line)."""

    ffn: str
    attn: str
    topology: tuple[int, int, int]
    kind: str        # HEADS, BATCH, DIMENSIONS or MEMORY
    reason: str

    def to_dict(self) -> dict:
        return {"ffn": self.ffn, "attn": self.attn, "topology": list(self.topology),
                "kind": self.kind, "reason": self.reason}


@dataclass
class Recommendation:
    """The answer for one phase: the best candidate, every candidate, every rejection."""

    phase: str
    pad_heads: str | int
    best: Candidate
    candidates: list[Candidate]           # ranked: fits first, then latency
    rejected: list[Rejected]
    gather_degree_continuous: float       # App. A.2.2 N* = sqrt(BL n / F)
    ws2d_crossover_chips: float           # App. A.2.1, from the formulas

    def alternatives(self) -> list[Candidate]:
        """The best candidate per (ffn, attn), in rank order."""
        seen: dict[tuple[str, str], Candidate] = {}
        for c in self.candidates:
            seen.setdefault((c.ffn, c.attn), c)
        return list(seen.values())

    def to_dict(self) -> dict:
        """The best prediction's fields at the top level (as `predict`), then the lists."""
        out = self.best.prediction.to_dict()
        out.update({
            "source": costmodel.SOURCE,
            "pad_heads": self.pad_heads,
            "same_program_as": list(self.best.aliases),
            "alternatives": [c.summary() for c in self.alternatives()],
            "candidates": len(self.candidates),
            "rejected": [r.to_dict() for r in self.rejected],
            "gather_degree_continuous": self.gather_degree_continuous,
            "ws2d_crossover_chips": self.ws2d_crossover_chips,
        })
        return out


def rejection_kind(err: ConfigError) -> str:
    """The constraint a layout validation error names, as a Rejected.kind."""
    if err.field in ("model.n_heads", "model.n_kv_heads", "pad_heads"):
        return HEADS
    if err.field == "batch":
        return BATCH
    return DIMENSIONS


def split_axes_count(topology: tuple[int, int, int]) -> int:
    """How many mesh axes a topology splits (axes of size > 1)."""
    return sum(1 for d in topology if d > 1)


def torus_topologies(model: ModelConfig, chips: int, torus_dims: int = 3) -> list[tuple[int, int, int]]:
    """The factorisations of `chips` the interconnect has axes for (at most `torus_dims` axes
    of size > 1: a TPU v5e is a 2-D torus, so never 4x4x4; issue 24), best first: the cost
    model's best_topology when allowed, else the allowed split with the least ws2d traffic
    per token (App. A.2.1), storing the weights cleanly first, then the smaller X."""
    allowed = [t for t in costmodel.topology_candidates(model, chips)
               if split_axes_count(t) <= torus_dims]
    if not allowed or allowed[0] == costmodel.best_topology(model, chips):
        return allowed

    def key(t):
        x, y, z = t
        clean = model.d_model % x == 0 and model.d_ff % (y * z) == 0 and model.n_heads % (y * z) == 0
        return (not clean, y < z, round(costmodel.ws2d_comm_per_token(model, x, y * z), 9), x, y - z)

    return sorted(allowed, key=key)


def _topologies(model: ModelConfig, chips: int, topology, search_topology: bool, torus_dims: int = 3):
    if topology is not None:
        checked = costmodel.check_topology(topology, chips)
        if split_axes_count(checked) > torus_dims:
            raise ConfigError("topology", "x".join(map(str, checked)),
                              f"a split of at most {torus_dims} mesh axes (the hardware's "
                              f"interconnect is a {torus_dims}-D torus)")
        return [checked]
    candidates = torus_topologies(model, chips, torus_dims)
    return candidates if search_topology else candidates[:1]


def recommend(model: ModelConfig, hw: HardwareProfile, chips: int, batch: int, phase: str,
              input_len: int = 1, context: float | None = None, weights: str = "bf16",
              topology: tuple[int, int, int] | None = None, ffn: str | None = None,
              attn: str | None = None, search_topology: bool = False,
              pad_heads: str | int = "auto", pad_vocab: str = "auto",
              experts: str | None = None, kv_cache: str = "bf16") -> Recommendation:
    """The fastest valid (ffn, attn, topology) for one phase; see the module docstring.

    Every candidate is predicted as both phases' layout (the stored weights serve it).
    Ranking: those that fit in HBM first, then latency, then the topology order (the
    paper's best 2D split first). `ffn`, `attn` restrict the search; `topology` fixes the
    mesh, `search_topology=True` tries every factorisation of `chips` the hardware has axes
    for (`hw.torus_dims`). A mixture-of-experts model's `experts` layout (tp | ep) is
    searched too unless given."""
    positive_int("chips", chips)
    positive_int("batch", batch)
    one_of("phase", phase, PHASES)
    one_of("weights", weights, WEIGHT_FORMATS)
    ffns = FFN_LAYOUTS if ffn is None else (one_of("ffn", ffn, FFN_LAYOUTS),)
    attns = ATTN_LAYOUTS if attn is None else (one_of("attn", attn, ATTN_LAYOUTS),)
    topologies = _topologies(model.unpadded, chips, topology, search_topology, hw.torus_dims)

    expert_layouts = ((experts,) if experts is not None     # on one chip ep is tp
                      else EXPERT_LAYOUTS if model.moe and chips > 1 else ("tp",))
    evaluated: dict[tuple, Candidate] = {}
    rejected: list[Rejected] = []
    for t, f, a, e in itertools.product(topologies, ffns, attns, expert_layouts):
        layout = canonical_layout(PhaseLayout(f, a), t)
        key = (layout.ffn, layout.attn, t, e)
        if key in evaluated:        # a degenerate name for a program already predicted
            evaluated[key].aliases.append(f)
            continue
        try:
            run_model = resolve_padding(model, pad_heads, t, layout, layout, pad_vocab=pad_vocab)
            prediction = costmodel.predict_phase(run_model, hw, chips, batch, phase, input_len,
                                                 context, layout, weights, t, experts=e,
                                                 kv_cache=kv_cache)
        except ConfigError as err:
            rejected.append(Rejected(f, a, t, rejection_kind(err), str(err)))
            continue
        evaluated[key] = Candidate(layout.ffn, layout.attn, t, run_model.n_heads, prediction,
                                   [f] if f != layout.ffn else [], e)
        if not prediction.fits:
            rejected.append(Rejected(layout.ffn, a, t, MEMORY, _memory_reason(prediction, hw)))
    if not evaluated:   # nothing can run: say why for each layout
        reasons = "; ".join(f"{r.ffn}/{r.attn} on {'x'.join(map(str, r.topology))}: {r.reason}"
                            for r in rejected)
        raise ConfigError("layout", f"{phase} of batch {batch} on {chips} chips",
                          f"at least one valid layout (every one is rejected: {reasons})")
    order = {t: i for i, t in enumerate(topologies)}
    ranked = sorted(evaluated.values(), key=lambda c: (
        not c.fits, costmodel.significant(c.prediction.latency_s), order[c.topology]))
    best = ranked[0]
    seq_len = input_len if phase == "prefill" else 1
    gather = costmodel.best_gather_degree(model.unpadded, chips, batch, seq_len,
                                          best.topology, weights)
    return Recommendation(phase=phase, pad_heads=pad_heads, best=best, candidates=ranked,
                          rejected=rejected, gather_degree_continuous=gather["continuous"],
                          ws2d_crossover_chips=costmodel.ws2d_crossover_chips(model.unpadded))


def _memory_reason(p: costmodel.PhasePrediction, hw: HardwareProfile) -> str:
    reserve = (f" less its {hw.memory_reserve:.0%} reserve ({costmodel.bytes_text(hw.usable_hbm_bytes)})"
               if hw.memory_reserve else "")
    return (f"peak {costmodel.bytes_text(p.peak_bytes_per_chip)} per chip (weights "
            f"{costmodel.bytes_text(p.weight_bytes_per_chip)}, KV cache "
            f"{costmodel.bytes_text(p.kv_bytes_per_chip)}) exceeds HBM "
            f"{costmodel.bytes_text(p.hbm_bytes)}{reserve}")
