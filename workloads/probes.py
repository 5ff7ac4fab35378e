"""Models and trials drawn at random from a seed: the probes `sweeper calibrate` measures a
host with, and the unseen models the blind validation benchmark predicts
(docs/host-calibration.md).

One distribution for both, so a calibration is fitted on the kind of work it will be asked
about, and one rule for keeping them apart: the calibration draws from its own fixed seed
(`CALIBRATION_SEED`), the blind benchmark from a seed given at run time, and a blind draw
never repeats a calibration probe's model (`draw_models(..., avoid=...)`).

The distribution (issue 35): d_model 128-1024, 2-6 layers, multihead / grouped-query /
multiquery attention, gelu or SwiGLU MLP, serial or parallel blocks, tied or separate
embeddings, and vocabularies that are not a multiple of the chips (so the engine pads them,
paper §4). A trial: 1, 2 or 4 chips, batch 1-16, prompts of 16-128 tokens, bf16 or int8
weights, and any valid layout of each phase (workloads/layouts.py).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from workloads.config import ConfigError, ModelConfig
from workloads.layouts import ATTN_LAYOUTS, FFN_LAYOUTS
from workloads.trial import TrialConfig

CALIBRATION_SEED = 20261205      # the probes' own seed: never a blind benchmark's seed

D_MODELS = (128, 192, 256, 384, 512, 640, 768, 1024)
HEADS = (2, 4, 6, 8, 12, 16)
MIN_HEAD_DIM = 16
FFN_MULTIPLIERS = (2.0, 8 / 3, 3.0, 4.0)
LAYERS = (2, 6)
VOCAB = (500, 8000)
BATCHES = (1, 2, 4, 8, 16)
INPUT_LENS = (16, 32, 64, 128)
DECODE_STEPS = 16
# prefill tokens per trial (batch x prompt) at most this: a 1024-wide, 6-layer model's prefill of
# 2048 tokens takes seconds per run on one core, and a probe or a blind trial must take ~seconds
MAX_PREFILL_TOKENS = 512
CHIPS = (1, 2, 4)


def random_model(rng: random.Random, name: str) -> ModelConfig:
    """One model of the distribution above."""
    d_model = rng.choice(D_MODELS)
    n_heads = rng.choice([h for h in HEADS if d_model // h >= MIN_HEAD_DIM])
    d_head = max(MIN_HEAD_DIM, (d_model // n_heads) // 8 * 8)
    kind = rng.choice(("multihead", "grouped-query", "multiquery"))
    divisors = [k for k in range(2, n_heads) if n_heads % k == 0]
    if kind == "multihead":
        n_kv = n_heads
    elif kind == "grouped-query" and divisors:
        n_kv = rng.choice(divisors)
    else:
        n_kv = 1
    d_ff = max(64, int(round(d_model * rng.choice(FFN_MULTIPLIERS) / 64)) * 64)
    return ModelConfig(name=name, d_model=d_model, d_ff=d_ff, n_layers=rng.randint(*LAYERS),
                       n_heads=n_heads, n_kv_heads=n_kv, d_head=d_head,
                       vocab=rng.randint(*VOCAB), block=rng.choice(("serial", "parallel")),
                       mlp=rng.choice(("gelu", "swiglu")), tie_embeddings=rng.random() < 0.5)


def random_trial(rng: random.Random, model: ModelConfig, chips: int, tries: int = 200,
                 **fixed) -> TrialConfig | None:
    """A valid trial of `model` on `chips` chips (layouts, batch, length, weights drawn), or
    None when no draw of `tries` is valid. `fixed`: TrialConfig fields to set as given."""
    for _ in range(tries):
        batch = rng.choice(BATCHES)
        input_len = rng.choice([n for n in INPUT_LENS if batch * n <= MAX_PREFILL_TOKENS])
        data = dict(model=model.to_dict(), chips=chips, batch=batch, input_len=input_len,
                    decode_steps=DECODE_STEPS,
                    weights=rng.choice(("bf16", "bf16", "int8")),
                    prefill=dict(ffn=rng.choice(FFN_LAYOUTS), attn=rng.choice(ATTN_LAYOUTS)),
                    decode=dict(ffn=rng.choice(FFN_LAYOUTS), attn=rng.choice(ATTN_LAYOUTS)))
        data.update(fixed)
        try:
            return TrialConfig.from_dict(data).resolved().validate()
        except ConfigError:
            continue
    return None


@dataclass(frozen=True)
class Draw:
    """The models and trials of one seed."""

    seed: int
    models: tuple[ModelConfig, ...]
    trials: tuple[TrialConfig, ...]


def ladder(seed: int, chips: tuple[int, ...] = CHIPS, prefix: str = "probe", **fixed) -> Draw:
    """The distribution's cheapest corner, which a dozen random models seldom reach: one
    narrowest model (d_model 128, the rest drawn) at the fewest and the most layers, each with
    one trial per chip count of batch 1, the shortest prompt and bf16 weights (layouts drawn).
    Its one-chip prefills take under a millisecond, and its calls are mostly the engine's
    per-call and per-layer dispatch, which the two depths tell apart
    (docs/host-calibration.md "What it measures").
    `fixed`: other TrialConfig fields, as `draw`'s."""
    rng = random.Random(seed + 2)       # its own stream: the random probes stay as they were
    model = random_model(rng, "")
    while model.d_model != D_MODELS[0]:
        model = random_model(rng, "")
    models, trials = [], []
    for layers in LAYERS:
        rung = dataclasses.replace(model, name=f"{prefix}{seed}-ladder{layers}", n_layers=layers)
        models.append(rung)
        for n in chips:
            trial = random_trial(rng, rung, n, **{**fixed, "batch": 1, "input_len": INPUT_LENS[0],
                                                  "weights": "bf16"})
            if trial is not None:
                trials.append(trial)
    return Draw(seed, tuple(models), tuple(trials))


def model_key(model: ModelConfig) -> tuple:
    """A model's shape without its name: two draws of the same shape are the same model."""
    d = model.to_dict()
    d.pop("name")
    return tuple(sorted(d.items()))


def draw_models(seed: int, count: int, prefix: str, avoid: set | None = None) -> list[ModelConfig]:
    """`count` distinct models from `seed`, none whose shape is in `avoid` (model_key)."""
    rng = random.Random(seed)
    seen = set(avoid or ())
    out: list[ModelConfig] = []
    while len(out) < count:
        model = random_model(rng, f"{prefix}{seed}-{len(out)}")
        key = model_key(model)
        if key not in seen:
            seen.add(key)
            out.append(model)
    return out


def draw(seed: int, models: int, trials_per_chip: int, chips: tuple[int, ...] = CHIPS,
         prefix: str = "m", avoid: set | None = None, **fixed) -> Draw:
    """`models` random models and, for each, `trials_per_chip` random trials per chip count."""
    rng = random.Random(seed + 1)       # trials from their own stream: adding a model keeps the others'
    chosen = draw_models(seed, models, prefix, avoid)
    trials = []
    for model in chosen:
        for n in chips:
            for _ in range(trials_per_chip):
                trial = random_trial(rng, model, n, **fixed)
                if trial is not None:
                    trials.append(trial)
    return Draw(seed, tuple(chosen), tuple(trials))
