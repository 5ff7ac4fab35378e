"""The compiled-program check of the tests: HLO collectives (workloads.hlo) against
layouts.forward_collectives. Test-only, so it lives with the tests, not in the library.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from workloads.hlo import CollectiveOp


# --------------------------------------------------------------------------- vs layouts.py


def left_out(op: CollectiveOp, tokens: int, batch: int, n_chips: int) -> bool:
    """Ops layouts.LEFT_OUT omits on purpose, recognised by size: the norm statistics (an
    all-reduce of one value per token the chip holds) and a greedy argmax's (max, index)
    all-gather (at most 2 values per sequence per chip)."""
    if op.kind == "all-reduce" and op.elements <= tokens:
        return True
    return op.kind == "all-gather" and op.elements <= 2 * batch * n_chips


@dataclass
class KindComparison:
    """One collective kind of one program: compiled vs layouts.forward_collectives."""

    kind: str
    compiled_elements: int          # per device, summed over executions
    expected_elements: int
    compiled_count: int
    expected_count: int
    dtype_seen: str
    skipped: list[str] = field(default_factory=list)   # left-out ops, by name
    decomposed_all_reduce: int = 0   # all-reduce elements found as reduce-scatter + all-gather

    @property
    def relative_error(self) -> float:
        if self.expected_elements == 0:
            return 0.0 if self.compiled_elements == 0 else math.inf
        return abs(self.compiled_elements - self.expected_elements) / self.expected_elements


def compare_with_layouts(ops: list[CollectiveOp], expected, tokens: int, batch: int,
                         n_chips: int) -> dict[str, KindComparison]:
    """Per kind: element counts of the compiled program against `expected` (a list of
    `layouts.Collective`), skipping the left-out ops. Element counts, not bytes: the CPU
    backend runs bf16 collectives in f32, which changes bytes but not elements.

    A backend may decompose an all-reduce of N elements into a reduce-scatter (input N)
    and an all-gather (output N). When the compiled all-reduces fall short of layouts.py
    by D and both the reduce-scatters and all-gathers exceed it by D (within 10%), the D
    elements are credited to those two kinds (`decomposed_all_reduce` says so).
    """
    out: dict[str, KindComparison] = {}
    kinds = {op.kind for op in ops} | {c.kind for c in expected}
    for kind in sorted(kinds):
        mine = [op for op in ops if op.kind == kind]
        skipped = [op for op in mine if left_out(op, tokens, batch, n_chips)]
        kept = [op for op in mine if op not in skipped]
        theirs = [c for c in expected if c.kind == kind]
        out[kind] = KindComparison(
            kind=kind,
            compiled_elements=sum(op.total_elements for op in kept),
            expected_elements=sum(c.elements * c.count for c in theirs),
            compiled_count=sum(op.multiplicity for op in kept),
            expected_count=sum(c.count for c in theirs),
            dtype_seen=",".join(sorted({op.dtype for op in kept})),
            skipped=[op.name for op in skipped])
    _credit_decomposed_all_reduce(out)
    return out


def _credit_decomposed_all_reduce(out: dict[str, KindComparison], tol: float = 0.10) -> None:
    ar, rs, ag = (out.get(k) for k in ("all-reduce", "reduce-scatter", "all-gather"))
    if ar is None or rs is None or ag is None:
        return
    deficit = ar.expected_elements - ar.compiled_elements
    if deficit <= 0:
        return
    extra_rs = rs.compiled_elements - rs.expected_elements
    extra_ag = ag.compiled_elements - ag.expected_elements
    if abs(extra_rs - deficit) <= tol * deficit and abs(extra_ag - deficit) <= tol * deficit:
        ar.expected_elements -= deficit
        rs.expected_elements += deficit
        ag.expected_elements += deficit
        for c in (ar, rs, ag):
            c.decomposed_all_reduce = deficit


def describe(ops: list[CollectiveOp], expected=()) -> str:
    """A readable listing of compiled ops and expected collectives (for failure messages)."""
    lines = ["compiled:"]
    for op in ops:
        up = f" (from {op.upcast_from})" if op.upcast_from else ""
        lines.append(f"  {op.kind:15s} axes={','.join(op.axes or ()) or '-':6s} elements={op.elements:>9d}"
                     f" x{op.multiplicity} {op.dtype}{up} {op.name}")
    if expected:
        lines.append("layouts.py:")
        for c in expected:
            lines.append(f"  {c.kind:15s} axes={','.join(c.axes):6s} elements={c.elements:>9d}"
                         f" x{c.count} {c.what}")
    return "\n".join(lines)
