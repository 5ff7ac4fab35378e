"""Collectives of a compiled program, read from its optimized HLO text (`compiled.as_text()`).

What the engine *claims* to communicate lives in `workloads/layouts.py`; what XLA actually
runs is in the compiled module. This module parses that text (no JAX import) into one
`CollectiveOp` per collective instruction, with:

- `elements`: per device, per execution, in layouts.py's convention (paper §3.1, Fig. A.1):
  an all-gather's *output*, a reduce-scatter's *input* (= output x group size), an
  all-reduce's tensor, an all-to-all's whole tensor (the sum of its tuple pieces);
- `multiplicity`: how often it runs per program execution (a collective inside a `while`
  body with a known trip count, e.g. a `lax.scan` over layers, runs that many times);
- `dtype`: the element type as run. The XLA CPU backend runs bf16 collectives in f32
  (`f32[...] all-gather(convert(...))`), so `dtype` is often f32 where the program
  moves bf16; `upcast_from` names the narrower type when the operand is visibly a
  convert from it. Element counts are unaffected, which is why layout checks compare them.

Async pairs (`all-gather-start` / `all-gather-done`, GPU and TPU) count once, at the
`-done` (whose shape is the result); ops wrapped in `async-start(..., calls=%comp)` are
found inside the called computation.
"""

from __future__ import annotations

import functools
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

from workloads.metrics import CollectiveStat

# Canonical kinds, as in layouts.COLLECTIVE_KINDS, plus the ones layouts never issues.
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute",
         "ragged-all-to-all", "collective-broadcast")

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1,
}

_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$")
_CALLED = re.compile(r"\b(calls|body|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_OPCODE = re.compile(r"([\w\-]+)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")
_BRACKET = re.compile(r"[(){}\[\]]")
_CLOSING = {"(": ")", "{": "}", "[": "]"}
_OPENING = re.compile(r"[({\[]")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_NAMES = re.compile(r"%?([\w.\-]+)")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_IOTA_GROUPS = re.compile(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")
_LIST_GROUPS = re.compile(r"replica_groups=\{")
_GROUP = re.compile(r"\{([\d,\s]*)\}")
# Any collective opcode (a `-done` too) anywhere in the text: a module without one has no
# collectives, and collective_ops answers without parsing it (most one-chip programs).
_ANY_COLLECTIVE = re.compile("(?:" + "|".join(re.escape(k) for k in KINDS) + r")(?:-done)?\(")


@dataclass
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> float:
        return self.elements * DTYPE_BYTES.get(self.dtype, 4)


@dataclass
class Instruction:
    name: str
    opcode: str
    shape: list[Array]          # result arrays (a tuple result gives several)
    operands: list[str]
    attrs: str
    computation: str
    param_number: int | None = None   # for `parameter(N)`


@dataclass
class CollectiveOp:
    kind: str                           # canonical, e.g. "all-gather" for all-gather-done too
    name: str
    computation: str
    dtype: str                          # as run; "f32,s8" if a combined op mixes types
    elements: int                       # per device per execution (layouts.py's convention)
    nbytes: float                       # per device per execution, as run
    group_size: int
    groups: list[list[int]] = field(default_factory=list)
    axes: tuple[str, ...] | None = None  # mesh axes the groups span (when a mesh is given)
    multiplicity: int = 1                # executions per program run (while trip counts)
    upcast_from: str | None = None       # e.g. "bf16" when a convert from bf16 feeds it
    from_parameter: int | None = None    # entry parameter it moves (e.g. a weight), if direct

    @property
    def total_elements(self) -> int:
        return self.elements * self.multiplicity

    @property
    def total_bytes(self) -> float:
        return self.nbytes * self.multiplicity


# --------------------------------------------------------------------------- parsing


def _matching(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at text[start] (other characters are
    skipped by the regex, not visited one by one in Python)."""
    close = _CLOSING[text[start]]
    end = text.find(close, start + 1)
    if end >= 0 and not _OPENING.search(text, start + 1, end):
        return end + 1          # nothing nested (an operand list): the first closer closes it
    stack = []
    for match in _BRACKET.finditer(text, start):
        ch = match.group()
        if ch in _CLOSING:
            stack.append(_CLOSING[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return match.end()
    return len(text)


def _arrays(shape_text: str) -> list[Array]:
    return list(_shape_arrays(shape_text))


@functools.lru_cache(maxsize=4096)
def _shape_arrays(shape_text: str) -> tuple[Array, ...]:
    """The arrays of a result shape; a module repeats the same few shapes many times."""
    return tuple(Array(dtype, tuple(int(d) for d in dims.split(",") if d))
                 for dtype, dims in _ARRAY.findall(shape_text) if dtype in DTYPE_BYTES)


def _parse_instruction(line: str, computation: str) -> Instruction | None:
    match = _INSTR.match(line)
    if not match:
        return None
    name, rest = match.group(1), match.group(2).strip()
    if rest.startswith("("):                      # tuple-shaped result
        end = _matching(rest, 0)
    else:
        end = rest.find(" ")
        if end < 0:
            return None
    shape_text, rest = rest[:end], rest[end:].strip()
    op = _OPCODE.match(rest)
    if not op:
        return None
    opcode = op.group(1)
    close = _matching(rest, op.end() - 1)
    operand_text, attrs = rest[op.end():close - 1], rest[close:]
    operands = _OPERAND.findall(operand_text)
    number = int(operand_text) if opcode == "parameter" and operand_text.strip().isdigit() else None
    return Instruction(name, opcode, _arrays(shape_text), operands, attrs, computation, number)


def parse_module(hlo_text: str) -> tuple[dict[str, list[Instruction]], str | None]:
    """Computations of an HLO module (name -> instructions) and the entry's name."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if current is None:
            match = _COMP.match(line)
            if match and "=" not in stripped.split("(")[0]:
                current = match.group(2)
                computations[current] = []
                if match.group(1):
                    entry = current
            continue
        if stripped == "}":
            current = None
            continue
        instr = _parse_instruction(line, current)
        if instr is not None:
            computations[current].append(instr)
    return computations, entry


def _multiplicities(computations: dict[str, list[Instruction]], entry: str | None) -> dict[str, int]:
    """How many times each computation runs per execution of the entry.

    While bodies run `known_trip_count` times; a body without one counts once (a lower bound).
    """
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for comp, instrs in computations.items():
        for ins in instrs:
            if ins.opcode in ("async-done", "async-update"):
                continue
            factor = 1
            if ins.opcode == "while":
                trip = _TRIP.search(ins.attrs)
                factor = int(trip.group(1)) if trip else 1
            for key, callee in _CALLED.findall(ins.attrs):
                edges[comp].append((callee, factor if key == "body" else 1))
            branches = _BRANCHES.search(ins.attrs)
            if branches:
                for callee in _NAMES.findall(branches.group(1)):
                    edges[comp].append((callee, 1))
    counts: dict[str, int] = defaultdict(int)
    roots = [entry] if entry else list(computations)

    # The call graph is a DAG: propagate in topological order from the entry.
    order: list[str] = []
    seen: set[str] = set()

    def visit(node: str) -> None:
        if node in seen:
            return
        seen.add(node)
        for callee, _ in edges.get(node, []):
            visit(callee)
        order.append(node)

    for root in roots:
        visit(root)
        counts[root] = 1
    for node in reversed(order):
        for callee, factor in edges.get(node, []):
            counts[callee] += counts[node] * factor
    return dict(counts)


def parse_replica_groups(attrs: str) -> list[list[int]]:
    """`{{0,1},{2,3}}` or the iota form `[2,2]<=[4]` / `[2,2]<=[2,2]T(1,0)` -> groups."""
    match = _IOTA_GROUPS.search(attrs)
    if match:
        spec = match.group(1)
        shape = [int(v) for v in re.match(r"\[([\d,]+)\]", spec).group(1).split(",")]
        source = [int(v) for v in re.search(r"<=\[([\d,]+)\]", spec).group(1).split(",")]
        perm = re.search(r"T\(([\d,]+)\)", spec)
        ids = _iota(source, [int(v) for v in perm.group(1).split(",")] if perm else None)
        size = shape[-1]
        return [ids[i:i + size] for i in range(0, len(ids), size)]
    match = _LIST_GROUPS.search(attrs)
    if not match:
        return []
    body = attrs[match.end() - 1:_matching(attrs, match.end() - 1)]
    return [[int(v) for v in grp.split(",") if v.strip()]
            for grp in _GROUP.findall(body[1:-1])]


def _iota(dims: list[int], perm: list[int] | None) -> list[int]:
    """Row-major ids of iota(dims) transposed by perm, flattened (XLA's IotaReplicaGroupList)."""
    total = math.prod(dims)
    if not perm:
        return list(range(total))
    strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
    new_dims = [dims[p] for p in perm]
    out = []
    for flat in range(total):
        idx, rem = [], flat
        for d in reversed(new_dims):
            idx.append(rem % d)
            rem //= d
        idx.reverse()
        out.append(sum(idx[k] * strides[perm[k]] for k in range(len(perm))))
    return out


def group_axes(groups: list[list[int]], mesh_shape: tuple[int, ...],
               axis_names: tuple[str, ...] = ("x", "y", "z")) -> tuple[str, ...]:
    """Mesh axes along which the devices of a replica group differ (device id = flat mesh index)."""
    if not groups or len(groups[0]) <= 1:
        return ()
    varying = set()
    coords = [_unravel(d, mesh_shape) for d in groups[0]]
    for axis in range(len(mesh_shape)):
        if len({c[axis] for c in coords}) > 1:
            varying.add(axis)
    return tuple(axis_names[a] for a in sorted(varying))


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return tuple(reversed(out))


def _kind(opcode: str) -> str | None:
    base = opcode[:-5] if opcode.endswith("-done") else opcode
    if opcode.endswith("-start"):
        return None          # counted at its -done
    return base if base in KINDS else None


def collective_ops(hlo_text: str, mesh_shape: tuple[int, ...] | None = None,
                   n_devices: int | None = None) -> list[CollectiveOp]:
    """Every collective instruction of a compiled HLO module, with sizes per device."""
    if not _ANY_COLLECTIVE.search(hlo_text):
        return []
    computations, entry = parse_module(hlo_text)
    counts = _multiplicities(computations, entry)
    if n_devices is None:
        match = _PARTITIONS.search(hlo_text)
        n_devices = int(match.group(1)) if match else None
        if mesh_shape is not None:
            n_devices = math.prod(mesh_shape)
    ops: list[CollectiveOp] = []
    for comp, instrs in computations.items():
        by_name = {ins.name: ins for ins in instrs}
        for ins in instrs:
            kind = _kind(ins.opcode)
            if kind is None:
                continue
            source = ins
            if ins.opcode.endswith("-done") and ins.operands:
                source = by_name.get(ins.operands[0], ins)   # the -start carries the attributes
            groups = parse_replica_groups(source.attrs)
            if kind == "collective-permute":
                group_size = 2
            elif groups:
                group_size = len(groups[0])
            else:
                group_size = n_devices or 1     # empty replica_groups: all devices
            arrays = ins.shape
            elements = sum(a.elements for a in arrays)
            nbytes = sum(a.nbytes for a in arrays)
            if kind == "reduce-scatter":      # layouts.py sizes a reduce-scatter by its input
                elements *= group_size
                nbytes *= group_size
            dtypes = sorted({a.dtype for a in arrays})
            op = CollectiveOp(
                kind=kind, name=ins.name, computation=comp, dtype=",".join(dtypes),
                elements=int(elements), nbytes=nbytes, group_size=group_size, groups=groups,
                multiplicity=counts.get(comp, 0),
                upcast_from=(_upcast_source(source, by_name, computations)
                             or _downcast_consumer(ins, instrs, computations)),
                from_parameter=_parameter_source(source, by_name, comp == entry))
            if mesh_shape is not None:
                op.axes = group_axes(groups, mesh_shape) if groups else ("x", "y", "z")[:len(mesh_shape)]
            ops.append(op)
    return [op for op in ops if op.multiplicity > 0]


def _upcast_source(ins: Instruction, by_name: dict[str, Instruction],
                   computations: dict[str, list[Instruction]]) -> str | None:
    """The narrower float type a collective's f32 operand was converted from, if visible.

    The CPU backend wraps a bf16 collective as convert(bf16->f32) -> op -> convert back;
    the convert is often fused, so look inside the producing fusion for its parameters.
    """
    if not ins.shape or ins.shape[0].dtype != "f32":
        return None
    narrow = ("bf16", "f16")
    for name in ins.operands:
        producer = by_name.get(name)
        if producer is None:
            continue
        called = _CALLS.search(producer.attrs)
        inner = computations.get(called.group(1), []) if called else []
        params = [a.dtype for i in inner if i.opcode == "parameter" for a in i.shape]
        if inner and params and all(p in narrow for p in params):
            return params[0]
        if producer.opcode == "convert":
            source = by_name.get(producer.operands[0]) if producer.operands else None
            if source and source.shape and source.shape[0].dtype in narrow:
                return source.shape[0].dtype
        # a convert round trip inside the fusion (f32 -> bf16 -> f32) also marks bf16 data
        rounded = [i.shape[0].dtype for i in inner
                   if i.opcode == "convert" and i.shape and i.shape[0].dtype in narrow]
        if rounded:
            return rounded[0]
    return None


# Ops that only re-type or re-arrange one array: a collective fed through them still moves it.
_PASS_THROUGH = ("convert", "copy", "bitcast", "reshape", "transpose", "fusion", "bitcast-convert",
                 "slice", "get-tuple-element")


def _parameter_source(ins: Instruction, by_name: dict[str, Instruction], in_entry: bool) -> int | None:
    """The entry-computation parameter number a collective's (first) operand is, directly or
    through single-input re-typing ops (the XLA CPU f32 convert, a layout copy). A weight
    all-gathered by a weight-gathered layout comes straight from its parameter; an
    activation collective does not."""
    if not in_entry or not ins.operands:
        return None
    node = by_name.get(ins.operands[0])
    for _ in range(16):
        if node is None:
            return None
        if node.opcode == "parameter":
            return node.param_number
        inputs = [by_name.get(o) for o in node.operands]
        inputs = [i for i in inputs if i is not None and i.opcode != "constant"]
        if node.opcode not in _PASS_THROUGH or len(inputs) != 1:
            return None
        node = inputs[0]
    return None


def _downcast_consumer(ins: Instruction, instrs: list[Instruction],
                       computations: dict[str, list[Instruction]]) -> str | None:
    """The narrower float type an f32 collective's result is converted straight back to."""
    if not ins.shape or ins.shape[0].dtype != "f32":
        return None
    for user in instrs:
        if ins.name not in user.operands or not user.shape:
            continue
        dtype = user.shape[0].dtype
        if dtype not in ("bf16", "f16"):
            continue
        called = _CALLS.search(user.attrs)
        inner = computations.get(called.group(1), []) if called else []
        if user.opcode == "convert" or any(i.opcode == "convert" for i in inner):
            return dtype
    return None


# --------------------------------------------------------------------------- summaries


def summarize(ops: list[CollectiveOp]) -> list[CollectiveStat]:
    """One CollectiveStat per kind: totals per device over one program execution.

    `count` counts executions (a collective in a 2-layer scan counts 2); `elements_per_chip`
    and `bytes_per_chip` are summed over them, so they compare with
    `sum(c.elements * c.count)` over `layouts.forward_collectives`.
    """
    stats = []
    for kind in KINDS:
        mine = [op for op in ops if op.kind == kind]
        if not mine:
            continue
        dtypes = sorted({d for op in mine for d in op.dtype.split(",")})
        upcast = sorted({op.upcast_from for op in mine if op.upcast_from})
        dtype = ",".join(dtypes) + (f" (from {','.join(upcast)})" if upcast else "")
        stats.append(CollectiveStat(
            kind=kind,
            count=sum(op.multiplicity for op in mine),
            bytes_per_chip=int(sum(op.total_bytes for op in mine)),
            elements_per_chip=int(sum(op.total_elements for op in mine)),
            dtype=dtype))
    return stats


def comm_bytes(ops: list[CollectiveOp]) -> float:
    """All collective bytes per device per program execution, as run."""
    return float(sum(op.total_bytes for op in ops))
