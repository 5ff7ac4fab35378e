"""The application profile of a serving workload: request stream, lengths, latency SLOs.

It lives in `workloads` (docs/architecture.md, "Layers") because a space's `serving:`
block is read by the sweep's space loader and a serving trial's requests are drawn on its
mesh worker, both below `sweeper.serving`; the planner, the serving model and `sweeper
serve` import it from here too: one definition.

`AppProfile` is declared once; its CLI flags (sweeper/cli/appprofile.py, read back by
`profile_from_flags`), the `serving:` block of a space file (`profile_from_dict`) and the
validation of both come from its fields' metadata, so a new field is one line here.
docs/serving.md "The application profile".

    serving:
      rate: 2.0                 # requests/s, Poisson arrivals (or trace: requests.csv)
      input_len: 2048           # or {dist: uniform, low: 1024, high: 2048}
      output_len: 64            #    or {dist: lognormal, mean: 64, sigma: 0.5, low: 1, high: 512}
      ttft: 2.0                 # seconds
      tpot: 0.05                # seconds
      slo_stat: p99             # or p50/p90/p95/mean (ttft_stat/tpot_stat override per SLO)
      attainment: 0.99          # the share of requests that must meet both SLOs

A trace CSV has a header `arrival_s,input_len,output_len` (seconds from the start, tokens).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from workloads.validate import (ConfigError, bounded, check_keys, from_text, integer, number,
                                one_of, positive_int)

DISTS = ("fixed", "uniform", "lognormal")
STAT = re.compile(r"^(mean|p(\d{1,2}(?:\.\d+)?))$")


@dataclass
class Request:
    """One request of the stream: when it arrives (s), prompt tokens, answer tokens."""

    arrival_s: float
    input_len: int
    output_len: int
    # leading prompt tokens whose KV a replica already holds (the profile's shared prefix,
    # prefix caching): only input_len - cached_len tokens are prefilled
    cached_len: int = 0


@dataclass(frozen=True)
class Length:
    """A token count: fixed, uniform on [low, high], or lognormal with the given mean (clipped)."""

    dist: str = "fixed"
    mean: float = 1.0          # fixed: the value
    low: int = 1
    high: int = 1 << 20
    sigma: float = 0.0         # lognormal: sd of log(length)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.dist == "fixed":
            return np.full(n, int(self.mean), dtype=np.int64)
        if self.dist == "uniform":
            return rng.integers(self.low, self.high + 1, size=n)
        mu = math.log(self.mean) - self.sigma ** 2 / 2      # E[exp(N(mu, s))] = mean
        values = np.rint(rng.lognormal(mu, self.sigma, size=n)).astype(np.int64)
        return np.clip(values, self.low, self.high)

    @property
    def expected(self) -> float:
        """The mean length (the planner's bounds use it)."""
        return (self.low + self.high) / 2 if self.dist == "uniform" else float(self.mean)

    @property
    def largest(self) -> int:
        """The longest length a request can have (memory is sized for it)."""
        return int(self.mean) if self.dist == "fixed" else int(self.high)

    def to_value(self) -> Any:
        if self.dist == "fixed":
            return int(self.mean)
        if self.dist == "uniform":
            return {"dist": "uniform", "low": self.low, "high": self.high}
        return {"dist": "lognormal", "mean": self.mean, "sigma": self.sigma, "low": self.low,
                "high": self.high}

    def __str__(self) -> str:
        if self.dist == "fixed":
            return str(int(self.mean))
        if self.dist == "uniform":
            return f"uniform:{self.low}:{self.high}"
        return f"lognormal:{self.mean:g}:{self.sigma:g}"


def parse_length(value: Any, name: str, source: str | None) -> Length:
    """`64`, `"uniform:16:128"`, `"lognormal:64:0.5"` or a mapping {dist, ...} -> Length."""
    accepted = ("a positive integer, 'uniform:LOW:HIGH', 'lognormal:MEAN:SIGMA' or a mapping "
                "{dist: fixed|uniform|lognormal, ...}")
    if isinstance(value, str):
        parts = value.split(":")
        try:
            if len(parts) == 1:
                value = int(parts[0])
            elif parts[0] == "uniform" and len(parts) == 3:
                value = {"dist": "uniform", "low": int(parts[1]), "high": int(parts[2])}
            elif parts[0] == "lognormal" and len(parts) == 3:
                value = {"dist": "lognormal", "mean": float(parts[1]), "sigma": float(parts[2])}
            else:
                raise ValueError
        except ValueError:
            raise ConfigError(name, value, accepted, source) from None
    if isinstance(value, bool):
        raise ConfigError(name, value, accepted, source)
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(name, value, accepted, source)
        return Length("fixed", float(value), value, value)
    if not isinstance(value, Mapping):
        raise ConfigError(name, value, accepted, source)
    check_keys(value, ["dist", "mean", "low", "high", "sigma", "value"], source, f"{name}.")
    dist = one_of(f"{name}.dist", value.get("dist", "fixed"), DISTS, source)

    def tokens(key, default):
        return positive_int(f"{name}.{key}", value.get(key, default), source)

    if dist == "fixed":
        n = tokens("value", value.get("mean"))
        return Length("fixed", float(n), n, n)
    if dist == "uniform":
        low, high = tokens("low", None), tokens("high", None)
        if high < low:
            raise ConfigError(f"{name}.high", high, f"an integer >= low={low}", source)
        return Length("uniform", (low + high) / 2, low, high)
    mean = number(f"{name}.mean", value.get("mean"), source, positive=True)
    sigma = number(f"{name}.sigma", value.get("sigma"), source)
    low, high = tokens("low", 1), tokens("high", max(1, int(mean * 16)))
    if high < low:
        raise ConfigError(f"{name}.high", high, f"an integer >= low={low}", source)
    return Length("lognormal", float(mean), low, high, float(sigma))


def parse_stat(value: Any, name: str, source: str | None) -> str:
    """'p99', 'p50', 'p99.9' or 'mean'."""
    text = str(value).strip().lower()
    match = STAT.match(text)
    if isinstance(value, bool) or not match or (match.group(2) and not 0 < float(match.group(2)) < 100):
        raise ConfigError(name, value, "a percentile such as p99, p90, p50, or mean", source)
    return text


def _seconds(value: Any, name: str, source: str | None) -> float:
    return number(name, from_text(value, float), source, positive=True,
                  what="a positive number of seconds")


def _rate(value: Any, name: str, source: str | None) -> float | None:
    if value is None:
        return None
    return number(name, from_text(value, float), source, positive=True,
                  what="a positive number of requests per second")


def _share(value: Any, name: str, source: str | None) -> float:
    return number(name, from_text(value, float), source, positive=True, maximum=1,
                  what="a share in (0, 1], such as 0.99")


def _tokens(value: Any, name: str, source: str | None) -> int:
    return integer(name, from_text(value), source, minimum=0, maximum=1 << 20,
                   what=f"a whole number of tokens from 0 to {1 << 20:,}")


def _hit_rate(value: Any, name: str, source: str | None) -> float:
    return number(name, from_text(value, float), source, maximum=1,
                  what="a share in [0, 1], such as 0.9")


def _trace(value: Any, name: str, source: str | None) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not Path(value).is_file():
        raise ConfigError(name, value, "an existing CSV file with columns arrival_s,input_len,"
                          "output_len", source)
    read_trace(value, name)      # validated now, before any expensive work
    return value


def _stat_or_none(value: Any, name: str, source: str | None) -> str | None:
    return None if value is None else parse_stat(value, name, source)


def _spec(parse: Callable, flag: str, help: str, metavar: str | None = None) -> dict:
    return {"parse": parse, "flag": flag, "help": help, "metavar": metavar}


@dataclass(frozen=True)
class AppProfile:
    """What the application needs (issue 19, deliverable 1); every field is a flag and a key."""

    rate: float | None = field(default=None, metadata=_spec(
        _rate, "--rate", "requests per second, Poisson arrivals", "RPS"))
    trace: str | None = field(default=None, metadata=_spec(
        _trace, "--trace", "CSV of requests (arrival_s,input_len,output_len) instead of --rate",
        "FILE.csv"))
    input_len: Length = field(default=Length("fixed", 2048.0, 2048, 2048), metadata=_spec(
        parse_length, "--input-len", "prompt tokens: N, uniform:LOW:HIGH or lognormal:MEAN:SIGMA "
        "(default 2048)", "N"))
    output_len: Length = field(default=Length("fixed", 64.0, 64, 64), metadata=_spec(
        parse_length, "--output-len", "answer tokens: N, uniform:LOW:HIGH or lognormal:MEAN:SIGMA "
        "(default 64)", "K"))
    ttft: float = field(default=2.0, metadata=_spec(
        _seconds, "--ttft", "time-to-first-token SLO in seconds (default 2.0)", "SECONDS"))
    tpot: float = field(default=0.05, metadata=_spec(
        _seconds, "--tpot", "time-per-output-token SLO in seconds (default 0.05)", "SECONDS"))
    slo_stat: str = field(default="p99", metadata=_spec(
        parse_stat, "--slo-stat", "statistic both SLOs bound: pNN or mean (default p99)", "STAT"))
    ttft_stat: str | None = field(default=None, metadata=_spec(
        _stat_or_none, "--ttft-stat", "statistic of the TTFT SLO (default --slo-stat)", "STAT"))
    tpot_stat: str | None = field(default=None, metadata=_spec(
        _stat_or_none, "--tpot-stat", "statistic of the TPOT SLO (default --slo-stat)", "STAT"))
    attainment: float = field(default=0.99, metadata=_spec(
        _share, "--attainment", "share of requests that must meet both SLOs (default 0.99)",
        "SHARE"))
    # prefix caching (docs/serving.md "The application profile"): the first prefix_len tokens
    # of a prompt (a system prompt) are the same for the share prefix_hit of requests; a
    # replica keeps their KV cache and prefills only the rest of such a prompt
    prefix_len: int = field(default=0, metadata=_spec(
        _tokens, "--prefix-len", "leading prompt tokens shared across requests, their KV cached "
        "and reused (default 0: no prefix caching)", "N"))
    prefix_hit: float = field(default=1.0, metadata=_spec(
        _hit_rate, "--prefix-hit", "share of requests that start with the shared prefix "
        "(default 1.0)", "SHARE"))

    @property
    def ttft_statistic(self) -> str:
        return self.ttft_stat or self.slo_stat

    @property
    def tpot_statistic(self) -> str:
        return self.tpot_stat or self.slo_stat

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_value() if isinstance(value, Length) else value
        if not self.prefix_len:      # without prefix caching a profile is written as before
            del out["prefix_len"], out["prefix_hit"]
        return out

    def describe(self) -> str:
        if self.trace is None:
            stream = (f"{self.rate:g} req/s Poisson, input {self.input_len}, output "
                      f"{self.output_len} tokens")
        else:
            stats = length_stats(self)
            stream = (f"trace {self.trace} ({mean_rate(self):.3g} req/s, input mean "
                      f"{stats['input_mean']:.0f}, output mean {stats['output_mean']:.0f} tokens)")
        if self.prefix_len:
            stream += (f", a shared prefix of {self.prefix_len} tokens in {self.prefix_hit:.0%} "
                       "of prompts")
        return (f"{stream}; "
                f"TTFT {self.ttft_statistic} <= {self.ttft:g} s, TPOT {self.tpot_statistic} <= "
                f"{self.tpot:g} s, attainment >= {self.attainment:.0%}")


FIELDS = {f.name: f for f in dataclasses.fields(AppProfile)}


def _build(values: Mapping[str, Any], source: str | None, name_of: Callable[[str], str]) -> AppProfile:
    parsed = {}
    for key, value in values.items():
        if value is None:
            continue
        parsed[key] = FIELDS[key].metadata["parse"](value, name_of(key), source)
    if ("rate" in parsed) == ("trace" in parsed):
        raise ConfigError(name_of("rate"), values.get("rate"),
                          f"exactly one of {name_of('rate')} (Poisson) or {name_of('trace')} (a "
                          "CSV of requests)", source)
    profile = AppProfile(**parsed)
    if profile.prefix_len and profile.trace is None and profile.prefix_len >= _shortest(
            profile.input_len):
        raise ConfigError(name_of("prefix_len"), profile.prefix_len, f"fewer tokens than the "
                          f"shortest prompt ({_shortest(profile.input_len)}, input_len "
                          f"{profile.input_len}): a prompt keeps at least one token of its own",
                          source)
    return profile


def _shortest(length: Length) -> int:
    return int(length.mean) if length.dist == "fixed" else int(length.low)


def block_profile(block: Mapping, source: str | None = None, prefix: str = "serving.") -> AppProfile:
    """The profile of a space file's `serving:` block, which may also size a serving trial's
    stream (`requests`, docs/space-files.md "Serving trials"): every other key is a profile
    field, parsed by `profile_from_dict`."""
    return profile_from_dict({k: v for k, v in block.items() if k != "requests"}, source,
                             prefix=prefix)


def profile_from_dict(data: Any, source: str | None = None, prefix: str = "serving.") -> AppProfile:
    """The `serving:` block of a space file (a mapping of AppProfile fields)."""
    if not isinstance(data, Mapping):
        raise ConfigError(prefix.rstrip("."), data, "a mapping of serving fields "
                          f"{sorted(FIELDS)}", source)
    check_keys(data, FIELDS, source, prefix)
    return _build(data, source, lambda key: f"{prefix}{key}")


def profile_from_flags(values: Mapping[str, Any]) -> AppProfile:
    """The AppProfile of the command-line flags' values (field name -> the flag's text, None
    where not given; sweeper/cli/appprofile.py declares the flags): ConfigError names the
    flag."""
    values = dict(values)
    for key in ("ttft", "tpot", "rate", "attainment", "prefix_hit"):     # numbers arrive as text
        if isinstance(values.get(key), str):
            try:
                values[key] = float(values[key])
            except ValueError:
                pass    # the field's parser names the flag and what it accepts
    return _build(values, None, lambda key: FIELDS[key].metadata["flag"])


def read_trace(path: str, name: str = "trace") -> list[Request]:
    """Requests of a trace CSV (header arrival_s,input_len,output_len), sorted by arrival."""
    out: list[Request] = []
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            columns = {"arrival_s", "input_len", "output_len"}
            if reader.fieldnames is None or not columns <= set(reader.fieldnames):
                raise ConfigError(name, path, "a CSV whose header has arrival_s,input_len,"
                                  f"output_len (got {bounded(reader.fieldnames, 80)})")
            for row_number, row in enumerate(reader, start=2):
                try:
                    request = Request(float(row["arrival_s"]), int(row["input_len"]),
                                      int(row["output_len"]))
                except (TypeError, ValueError):
                    request = None
                if (request is None or not math.isfinite(request.arrival_s)
                        or request.arrival_s < 0 or request.input_len <= 0
                        or request.output_len <= 0):
                    raise ConfigError(f"{name} line {row_number}", dict(row), "arrival_s >= 0 "
                                      "seconds, input_len and output_len positive integers", path)
                out.append(request)
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(name, path, f"a readable UTF-8 CSV ({err})") from None
    if not out:
        raise ConfigError(name, path, "a CSV with at least one request row")
    return sorted(out, key=lambda r: r.arrival_s)


def requests(profile: AppProfile, n: int, seed: int = 0) -> list[Request]:
    """`n` requests: Poisson arrivals at `profile.rate` with sampled lengths, or the first
    `n` rows of the trace (all of them when `n` is larger)."""
    if profile.trace is not None:
        stream = read_trace(profile.trace)[:n]
    else:
        rng = np.random.default_rng(seed)
        arrivals = np.cumsum(rng.exponential(1.0 / profile.rate, size=n))
        inputs = profile.input_len.sample(rng, n)
        outputs = profile.output_len.sample(rng, n)
        stream = [Request(float(a), int(i), int(o)) for a, i, o in zip(arrivals, inputs, outputs)]
    return with_prefix_hits(stream, profile, seed)


def with_prefix_hits(stream: list[Request], profile: AppProfile, seed: int = 0) -> list[Request]:
    """The stream with `cached_len` set on the share `profile.prefix_hit` of requests that
    start with the shared prefix (drawn from their own generator, so a profile without a
    prefix draws the same stream as before); a prompt keeps at least one token of its own."""
    if not profile.prefix_len:
        return stream
    hits = np.random.default_rng([seed, 1]).random(len(stream)) < profile.prefix_hit
    return [dataclasses.replace(r, cached_len=min(profile.prefix_len, r.input_len - 1))
            if hit else r for r, hit in zip(stream, hits)]


def offered_rps(reqs: list[Request]) -> float | None:
    """A stream's rate: (n - 1) / arrival span (None for a burst at one instant)."""
    arrivals = [r.arrival_s for r in reqs]
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    return (len(arrivals) - 1) / span if span > 0 else None


def context_len(reqs: list[Request]) -> int:
    """KV positions a slot needs for the longest request (prompt + answer)."""
    return max(r.input_len + r.output_len for r in reqs) + 1


def mean_rate(profile: AppProfile) -> float:
    """Requests per second: the Poisson rate or the trace's (`offered_rps`, as
    SimResult.summary's)."""
    if profile.trace is None:
        return float(profile.rate)
    rows = read_trace(profile.trace)
    rate = offered_rps(rows)
    return rate if rate is not None else float(len(rows))


def length_stats(profile: AppProfile) -> dict:
    """Mean and largest prompt and answer lengths: the trace's, or the distributions'."""
    if profile.trace is not None:
        rows = read_trace(profile.trace)
        inputs = [r.input_len for r in rows]
        outputs = [r.output_len for r in rows]
        return {"input_mean": sum(inputs) / len(inputs), "input_max": max(inputs),
                "output_mean": sum(outputs) / len(outputs), "output_max": max(outputs)}
    return {"input_mean": profile.input_len.expected, "input_max": profile.input_len.largest,
            "output_mean": profile.output_len.expected, "output_max": profile.output_len.largest}


def merge_decoded(served: list[dict], decoded: dict[int, dict]) -> list[dict]:
    """A disaggregated stream's per-request records: each request's decode-slice record
    (`serve_decode_slice`: its tokens after the first, `finish_s`, its KV's times) merged
    into its prefill-slice record (`serve_prefill_slice`: its first token); `served`, updated."""
    for i, part in decoded.items():
        served[i].update(part, tokens=served[i]["tokens"] + part["tokens"])
    return served
