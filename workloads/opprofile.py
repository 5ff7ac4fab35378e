"""Op-level profile of a mesh: collectives, matmuls and memory bandwidth, timed one op at a
time and fitted, written as a hardware profile (docs/architecture.md, "Hardware profiles and shares").

As AIConfigurator and Vidur profile operators instead of whole models, this times the
pieces the cost model adds up, on the mesh the trials run on:

- every collective kind the engine's layouts use (all-gather, reduce-scatter, all-to-all,
  all-reduce), for every group size a layout can produce on n devices (each divisor
  g > 1 of n: the n devices form n/g groups of g, all communicating at once, as a
  collective over mesh axis y of a 1 x g x n/g mesh does), over message sizes
  1 KiB .. 64 MiB (`SIZES`; `QUICK_SIZES` for `--quick`);
- bf16 matmuls (f32 accumulation, as `partitioning.matmul`) at the engine's per-chip
  shapes for a model, run on every device at once (so each gets its share of the host);
- memory read bandwidth per device, all devices reading at once.

A collective's time is measured inside one compiled loop (`lax.fori_loop` over r copies,
each feeding the next), at two trip counts: the difference / the extra trips is one op's
time without the program's dispatch. Bytes per chip follow the HLO convention of
`CollectiveStat.bytes_per_chip` (all-gather: output; reduce-scatter: input; all-reduce
and all-to-all: the tensor), in f32, the dtype XLA CPU runs bf16 collectives in.
Per (kind, group size) the points are fitted with `time = latency + bytes / bandwidth`
(`scipy.optimize.least_squares` on relative error, so small messages weigh as much as
large ones), and the profile YAML carries the fits (`HardwareProfile.
collective_latency_s_by_group` and `collective_bandwidth_by_group`).

JAX, numpy and scipy are imported inside the functions: `sweeper profile` imports this
module before it has set the device count JAX reads once at start-up, and every other
`sweeper` command would otherwise pay for scipy.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from workloads.config import ConfigError, HardwareProfile, ModelConfig, load_model
from workloads.measure import ci_rel, repeat_until_precise

KINDS = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce")
KiB, MiB = 1024, 1024 * 1024
SIZES = tuple(KiB * 4**i for i in range(9))            # 1 KiB, 4 KiB, ..., 64 MiB
QUICK_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 8 * MiB)
ELEMENT_BYTES = 4                                      # f32: XLA CPU runs bf16 collectives in f32
MEMORY_BYTES = 256 * MiB                               # read by all devices together
LOOP_TARGET_S = 20e-3       # extra trips: ~this much more than one call, so the difference
MAX_EXTRA_TRIPS = 256       # stands out of dispatch jitter (~0.1-1 ms on a loaded host)
MIN_LATENCY_S = 1e-9        # fit bounds: a latency below 1 ns reads as "none measurable"


@dataclass
class Settings:
    """How precisely each point is timed (the measurement protocol's settings, per point)."""

    ci_target: float = 0.05
    time_budget_s: float = 0.5
    min_repeats: int = 6
    loop_target_s: float = LOOP_TARGET_S


@dataclass
class CollectivePoint:
    kind: str
    group: int                 # devices per group
    bytes_per_chip: int        # HLO convention (module docstring)
    seconds: float             # median time of one op
    ci_rel: float              # 95% CI half-width of that median / the median
    repeats: int


@dataclass
class CollectiveFit:
    kind: str
    group: int
    latency_s: float           # time = latency_s + bytes_per_chip / bandwidth
    bandwidth: float           # bytes per chip per second
    max_rel_err: float         # worst |fit / measured - 1| over the fitted points
    points: int


@dataclass
class MatmulPoint:
    what: str                  # e.g. "prefill ffn_in"
    m: int
    k: int
    n: int
    seconds: float
    flops_per_s: float         # per device, every device running its own at once
    ci_rel: float


@dataclass
class OpProfile:
    """The whole profile of one mesh; plain data (`to_dict`) and a HardwareProfile."""

    devices: int
    platform: str
    model: str
    collectives: list[CollectivePoint] = field(default_factory=list)
    fits: list[CollectiveFit] = field(default_factory=list)
    matmuls: list[MatmulPoint] = field(default_factory=list)
    memory_bandwidth: float = math.nan     # bytes read per second per device
    hbm_bytes: float = math.nan            # memory per device
    elapsed_s: float = math.nan

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def peak_flops(self) -> float:
        return max((p.flops_per_s for p in self.matmuls), default=math.nan)

    def fit(self, kind: str, group: int) -> CollectiveFit | None:
        return next((f for f in self.fits if f.kind == kind and f.group == group), None)


QUICK_SETTINGS = Settings(ci_target=0.1, time_budget_s=0.2, loop_target_s=5e-3)


# --------------------------------------------------------------------------- meshes


def group_sizes(n: int) -> list[int]:
    """Every group size > 1 a collective over some mesh axes can have on n devices: the
    divisors of n (a topology X x Y x Z has X·Y·Z = n, and any product of its axes divides n)."""
    return [g for g in range(2, n + 1) if n % g == 0]


def group_mesh(n: int, group: int):
    """n devices as (n / group) x group, axes ('rest', 'group'); collectives run over 'group'."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()
    if len(devices) < n:
        raise ConfigError("chips", n, f"at most the {len(devices)} devices this process has")
    return Mesh(np.array(devices[:n]).reshape(n // group, group), ("rest", "group"))


# --------------------------------------------------------------------------- collectives


def local_elements(kind: str, group: int, nbytes: int) -> int:
    """Elements of each device's loop-carried array for a message of about `nbytes` per chip."""
    elements = max(1, nbytes // ELEMENT_BYTES)
    if kind == "all-gather":                  # the carried input is 1/group of the output
        return max(1, elements // group)
    return max(group, elements // group * group)   # reduce-scatter / all-to-all split by group


def message_bytes(kind: str, group: int, elements: int) -> int:
    """Bytes per chip (HLO convention) of the op run on `elements` carried elements."""
    per = elements * ELEMENT_BYTES
    return per * group if kind == "all-gather" else per


def collective_loop(mesh, kind: str, elements: int):
    """jit(f)(x, trips): `trips` of the collective in one compiled loop, each feeding the
    next; x is the global array, `elements` per device."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    group = mesh.shape["group"]

    def step(x):
        if kind == "all-gather":
            return lax.all_gather(x, "group", tiled=True)[-elements:]
        if kind == "reduce-scatter":
            part = lax.psum_scatter(x, "group", tiled=True)
            return lax.dynamic_update_slice(x, part, (0,))
        if kind == "all-to-all":
            return lax.all_to_all(x, "group", 0, 0, tiled=True)
        return lax.psum(x, "group") * (1.0 / group)      # all-reduce, kept at scale 1

    def body(x, trips):
        return lax.fori_loop(0, trips, lambda _, v: step(v), x)

    spec = P(("rest", "group"))
    # check_vma off: psum's result is the same on every chip of a group, and the loop
    # carries it as the per-chip value it was (the next trip reduces it again).
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec,
                               check_vma=False))
    x = jax.device_put(jnp.ones((elements * mesh.size,), jnp.float32),
                       jax.sharding.NamedSharding(mesh, spec))
    return fn, x


def _seconds(fn, *args) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def time_collective(mesh, kind: str, nbytes: int, settings: Settings) -> CollectivePoint:
    """One op's time: (loop of 1 + r trips - loop of 1 trip) / r, median over pairs; for an
    op that alone takes longer than `settings.loop_target_s`, the loop of one trip."""
    import jax.numpy as jnp

    group = mesh.shape["group"]
    elements = local_elements(kind, group, nbytes)
    fn, x = collective_loop(mesh, kind, elements)
    one = jnp.int32(1)
    _seconds(fn, x, one)                                   # compile and warm up
    base = statistics.median(_seconds(fn, x, one) for _ in range(3))
    extra = int(min(MAX_EXTRA_TRIPS, max(1, math.ceil(settings.loop_target_s / max(base, 1e-6)))))
    more = jnp.int32(1 + extra)
    _seconds(fn, x, more)

    def sample() -> float:
        if base >= settings.loop_target_s:   # one op dwarfs the dispatch: time it directly, since
            return _seconds(fn, x, one)   # a difference of two long timings doubles the noise
        return (_seconds(fn, x, more) - _seconds(fn, x, one)) / extra

    samples = repeat_until_precise(sample, lambda s: _ci_rel(s) <= settings.ci_target,
                                   settings.min_repeats, settings.time_budget_s)
    return CollectivePoint(kind, group, message_bytes(kind, group, elements),
                           statistics.median(samples), _ci_rel(samples), len(samples))


def _ci_rel(samples) -> float:
    """`measure.ci_rel`, NaN where undefined (too few samples, or a median <= 0: a
    difference of two timings lost in noise)."""
    if statistics.median(samples) <= 0:
        return math.nan
    rel = ci_rel(samples)
    return rel if math.isfinite(rel) else math.nan


def fit_collective(points: list[CollectivePoint]) -> CollectiveFit | None:
    """time = latency + bytes / bandwidth, least squares on relative error over
    log-parameters (both stay positive); started from the two-point line through the
    smallest and largest message. None with fewer than two positive timings."""
    import numpy as np
    from scipy.optimize import least_squares

    pts = sorted((p for p in points if p.seconds > 0), key=lambda p: p.bytes_per_chip)
    if len(pts) < 2:
        return None
    b = np.array([p.bytes_per_chip for p in pts], float)
    t = np.array([p.seconds for p in pts], float)
    slope = max((t[-1] - t[0]) / (b[-1] - b[0]), t[-1] / b[-1] * 1e-3)
    latency = max(t[0] - slope * b[0], t[0] * 1e-3, 2 * MIN_LATENCY_S)

    def residuals(theta):
        return (np.exp(theta[0]) + b * np.exp(theta[1])) / t - 1.0

    lower = [math.log(MIN_LATENCY_S), -np.inf]
    result = least_squares(residuals, np.log([latency, slope]), bounds=(lower, np.inf))
    lat, inv_bw = np.exp(result.x)
    return CollectiveFit(pts[0].kind, pts[0].group, float(lat), float(1.0 / inv_bw),
                         float(np.max(np.abs(residuals(result.x)))), len(pts))


# --------------------------------------------------------------------------- matmuls, memory


def engine_matmul_shapes(model: ModelConfig, n: int, batch: int, input_len: int) -> list[tuple[str, int, int, int]]:
    """(what, M, K, N) per device for the FFN and attention projections, weights split n
    ways (as a weight-stationary layout splits them), for prefill (B·L tokens) and decode
    (B tokens)."""
    e, f = model.d_model, model.d_ff
    hd = model.n_heads * model.d_head
    shapes = []
    for phase, tokens in (("prefill", batch * input_len), ("decode", batch)):
        shapes += [(f"{phase} ffn_in", tokens, e, max(1, f // n)),
                   (f"{phase} ffn_out", tokens, max(1, f // n), e),
                   (f"{phase} attn_q", tokens, e, max(1, hd // n))]
    return shapes


def time_matmul(n: int, what: str, m: int, k: int, nn: int, settings: Settings) -> MatmulPoint:
    """Every one of n devices multiplies its own [m, k] x [k, nn] (bf16, f32 accumulation)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    spec = P("d")
    fn = jax.jit(jax.shard_map(
        lambda a, b: jnp.einsum("xij,xjk->xik", a, b, preferred_element_type=jnp.float32),
        mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    a = jax.device_put(jnp.ones((n, m, k), jnp.bfloat16), NamedSharding(mesh, spec))
    b = jax.device_put(jnp.ones((n, k, nn), jnp.bfloat16), NamedSharding(mesh, spec))
    _seconds(fn, a, b)
    samples = repeat_until_precise(lambda: _seconds(fn, a, b), lambda s: _ci_rel(s) <= settings.ci_target,
                                   settings.min_repeats, settings.time_budget_s)
    seconds = statistics.median(samples)
    return MatmulPoint(what, m, k, nn, seconds, 2.0 * m * k * nn / seconds, _ci_rel(samples))


def time_memory_bandwidth(n: int, settings: Settings, nbytes: int = MEMORY_BYTES) -> float:
    """Bytes read per second per device, every device summing its share of `nbytes` at once."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
    per_device = nbytes // ELEMENT_BYTES // n
    fn = jax.jit(jax.shard_map(lambda x: jnp.sum(x, keepdims=True), mesh=mesh,
                               in_specs=P("d"), out_specs=P("d")))
    x = jax.device_put(jnp.ones((n * per_device,), jnp.float32), NamedSharding(mesh, P("d")))
    _seconds(fn, x)
    samples = repeat_until_precise(lambda: _seconds(fn, x), lambda s: _ci_rel(s) <= settings.ci_target,
                                   settings.min_repeats, settings.time_budget_s)
    return per_device * ELEMENT_BYTES / statistics.median(samples)


# --------------------------------------------------------------------------- the profile


def profile(n: int, quick: bool = False, model: str | ModelConfig = "calib", batch: int = 8,
            input_len: int = 64, kinds: tuple[str, ...] = KINDS, sizes: tuple[int, ...] | None = None,
            settings: Settings | None = None, progress=None) -> OpProfile:
    """Time and fit everything on the first n devices of this process."""
    import jax

    from workloads.hostprofile import physical_memory_bytes

    start = time.perf_counter()
    settings = settings or (QUICK_SETTINGS if quick else Settings())
    sizes = sizes or (QUICK_SIZES if quick else SIZES)
    model = load_model(model)
    out = OpProfile(n, jax.default_backend(), model.name)
    for group in group_sizes(n):
        mesh = group_mesh(n, group)
        for kind in kinds:
            points = [time_collective(mesh, kind, size, settings) for size in sizes]
            out.collectives += points
            fit = fit_collective(points)
            if fit is not None:
                out.fits.append(fit)
            if progress:
                progress(f"{kind:>14} x{group}: " + (
                    f"latency {fit.latency_s * 1e6:.1f} us, {fit.bandwidth / 1e9:.2f} GB/s "
                    f"(worst point {fit.max_rel_err:.0%} off)" if fit else "no fit (timings lost in noise)"))
    shapes = engine_matmul_shapes(model, n, batch, input_len)
    out.matmuls = [time_matmul(n, *shape, settings) for shape in shapes]
    out.memory_bandwidth = time_memory_bandwidth(n, settings)
    out.hbm_bytes = physical_memory_bytes() / n
    out.elapsed_s = time.perf_counter() - start
    return out


def to_hardware(op: OpProfile, name: str | None = None) -> HardwareProfile:
    """The profile as one chip's HardwareProfile: peak = the best matmul rate per device,
    memory bandwidth per device, ici = all-gather's fitted bandwidth over all n devices
    (the widest group), collective latency per kind = its mean over group sizes, and every
    fit by kind and group size."""
    latency_by_group: dict[str, dict[int, float]] = {}
    bandwidth_by_group: dict[str, dict[int, float]] = {}
    for f in op.fits:
        latency_by_group.setdefault(f.kind, {})[f.group] = f.latency_s
        bandwidth_by_group.setdefault(f.kind, {})[f.group] = f.bandwidth
    by_kind = {kind: statistics.mean(groups.values()) for kind, groups in latency_by_group.items()}
    widest = op.fit("all-gather", max(group_sizes(op.devices), default=1))
    if widest:
        ici = widest.bandwidth
    elif op.fits:
        ici = statistics.median(f.bandwidth for f in op.fits)
    else:                      # one device: nothing to communicate with; a local copy's rate
        ici = op.memory_bandwidth
    per_device = HardwareProfile(
        name=name or f"opprofile-{op.platform}-{op.devices}",
        peak_flops=op.peak_flops, hbm_bandwidth=op.memory_bandwidth, hbm_bytes=op.hbm_bytes,
        ici_bandwidth=ici, collective_latency_s=statistics.median(by_kind.values()) if by_kind else 0.0,
        measured=True, collective_latency_s_by_kind=by_kind,
        collective_latency_s_by_group=latency_by_group,
        collective_bandwidth_by_group=bandwidth_by_group)
    if op.platform != "cpu":
        return dataclasses.replace(per_device, measured=False)   # a real chip's own numbers
    # An emulated mesh's devices share this host: store the whole host (measured: true), so
    # the one resolver (workloads/hardware.py per_chip) gives each of a trial's chips its share,
    # whatever the trial's chip count (docs/architecture.md "Hardware profiles and shares").
    return per_device.scaled(op.devices, memory=True)


def write_profile(op: OpProfile, path: str | Path, name: str | None = None) -> Path:
    """The HardwareProfile YAML (loadable by `load_hardware(path)`), with the raw points
    in a `profile:` comment-free side file next to it (`<path stem>.points.json`)."""
    import json

    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    hardware = to_hardware(op, name or path.stem)
    header = (f"# sweeper profile --chips {op.devices}: op-level profile of {op.devices} "
              f"{op.platform} devices, model {op.model}, {op.elapsed_s:.0f} s.\n"
              "# Whole host on an emulated mesh (measured: true; per_chip splits it over a trial's chips),\n"
              "# one device on an accelerator. collective_*_by_group: time = latency + bytes/bandwidth per kind and\n"
              "# group size, bytes per chip as in the HLO (all-gather: output; reduce-scatter: input).\n")
    path.write_text(header + yaml.safe_dump(hardware.to_dict(), sort_keys=False))
    path.with_suffix(".points.json").write_text(json.dumps(op.to_dict(), indent=1))
    return path
