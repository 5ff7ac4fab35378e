"""Hugging Face config.json files as models (workloads/hf_config.py, docs/models.md).

The fixtures under tests/data/hf/ are the released config.json files of real models (the
DeepSeek-V3 one an excerpt of its fields), so each test checks the numbers the model card
publishes: Llama 3.1 8B 32 layers of E 4096, F 14336, 32 heads over 8 KV heads; Mixtral
8x7B 8 experts top-2; Qwen3-30B-A3B 128 experts of F 768, top-8; Gemma 7B GeGLU, head
dimension 256 with 16 heads over E 3072, tied embeddings.
"""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from workloads import costmodel
from workloads.config import MODEL_PRESETS, ConfigError, load_model
from workloads.hf_config import ModelApproximation

HF = Path(__file__).parent / "data" / "hf"


def load(name: str):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_model(str(HF / name / "config.json"))
    return model, [str(w.message) for w in caught if issubclass(w.category, ModelApproximation)]


@pytest.mark.parametrize("name,want", [
    ("Llama-3.1-8B", dict(d_model=4096, d_ff=14336, n_layers=32, n_heads=32, n_kv_heads=8,
                          d_head=128, vocab=128_256, block="serial", mlp="swiglu",
                          tie_embeddings=False, max_context=131_072, n_experts=0)),
    ("Mixtral-8x7B-v0.1", dict(d_model=4096, d_ff=14336, n_layers=32, n_heads=32, n_kv_heads=8,
                               d_head=128, vocab=32_000, mlp="swiglu", tie_embeddings=False,
                               max_context=32_768, n_experts=8, experts_per_token=2)),
    ("Qwen2.5-7B", dict(d_model=3584, d_ff=18944, n_layers=28, n_heads=28, n_kv_heads=4,
                        d_head=128, vocab=152_064, max_context=131_072)),
    ("Qwen3-8B", dict(d_model=4096, d_ff=12288, n_layers=36, n_heads=32, n_kv_heads=8,
                      d_head=128, vocab=151_936, max_context=40_960)),
    ("Qwen3-30B-A3B", dict(d_model=2048, d_ff=768, n_layers=48, n_heads=32, n_kv_heads=4,
                           d_head=128, n_experts=128, experts_per_token=8, max_context=40_960)),
    ("Mistral-7B-v0.1", dict(d_model=4096, d_ff=14336, n_layers=32, n_heads=32, n_kv_heads=8,
                             d_head=128, vocab=32_000, mlp="swiglu", tie_embeddings=False,
                             max_context=32_768, n_experts=0)),
    ("gemma-2-9b", dict(d_model=3584, d_ff=14336, n_layers=42, n_heads=16, n_kv_heads=8,
                        d_head=256, vocab=256_000, mlp="geglu", max_context=8192)),
    ("gemma-7b", dict(d_model=3072, d_ff=24576, n_layers=28, n_heads=16, n_kv_heads=16,
                      d_head=256, vocab=256_000, mlp="geglu", tie_embeddings=True,
                      max_context=8192)),
])
def test_released_configs_read_as_published(name, want):
    model, _ = load(name)
    assert model.name == name
    assert {k: getattr(model, k) for k in want} == want


def test_a_directory_holding_config_json_is_the_same_model():
    assert load_model(str(HF / "Qwen3-8B")) == load(name="Qwen3-8B")[0]


def test_parameter_counts_match_the_model_cards():
    """The cards' sizes: Llama 3.1 8B 8.0B, Mixtral 8x7B 46.7B total / 12.9B active,
    Qwen3-30B-A3B 30.5B / 3.3B, Gemma 7B 8.5B (tied embedding counted once)."""
    def billions(name, **kw):
        return costmodel.param_count(load(name)[0], **kw) / 1e9

    assert billions("Llama-3.1-8B") == pytest.approx(8.03, abs=0.01)
    assert billions("Mixtral-8x7B-v0.1") == pytest.approx(46.7, abs=0.05)
    assert billions("Mixtral-8x7B-v0.1", active=True) == pytest.approx(12.9, abs=0.05)
    assert billions("Qwen3-30B-A3B") == pytest.approx(30.5, abs=0.1)
    assert billions("Qwen3-30B-A3B", active=True) == pytest.approx(3.3, abs=0.1)
    assert billions("gemma-7b") == pytest.approx(8.54, abs=0.01)


def test_the_presets_are_the_released_configs():
    for preset, name in (("llama3.1-8b", "Llama-3.1-8B"), ("mixtral-8x7b", "Mixtral-8x7B-v0.1"),
                         ("qwen3-30b-a3b", "Qwen3-30B-A3B")):
        fields = {k: v for k, v in load(name)[0].to_dict().items() if k != "name"}
        assert {k: v for k, v in MODEL_PRESETS[preset].to_dict().items() if k != "name"} == fields


def test_the_larger_presets_have_their_cards_sizes():
    """Presets without a fixture here: Llama 3.1 70B and 405B (the released safetensors hold
    70.55B and 405.85B, norms included, which this count leaves out: under 0.01B), Qwen3
    235B-A22B (235B total, 22B activated per token)."""
    def billions(name, **kw):
        return costmodel.param_count(MODEL_PRESETS[name], **kw) / 1e9

    assert billions("llama3.1-70b") == pytest.approx(70.55, abs=0.01)
    assert billions("llama3.1-405b") == pytest.approx(405.85, abs=0.01)
    assert billions("qwen3-235b-a22b") == pytest.approx(235.1, abs=0.1)
    assert billions("qwen3-235b-a22b", active=True) == pytest.approx(22.2, abs=0.1)
    for name in ("llama3.1-70b", "llama3.1-405b"):
        assert MODEL_PRESETS[name].max_context == 131_072


@pytest.mark.parametrize("name,field,says", [
    ("DeepSeek-V3", "kv_lora_rank", "multi-head latent attention"),
    ("Qwen1.5-MoE-A2.7B", "shared_expert_intermediate_size", "shared experts"),
])
def test_what_the_model_cannot_express_is_refused_naming_the_field(name, field, says):
    with pytest.raises(ConfigError) as err:
        load_model(str(HF / name / "config.json"))
    message = str(err.value)
    assert "\n" not in message and f"{field}:" in message and says in message
    assert "config.json" in message


def test_a_refused_config_is_one_line_exit_2_before_anything_starts(tmp_path):
    """`sweeper plan --model <DeepSeek-V3 config.json>` (MLA): the CLI's one line, exit 2,
    naming the field, before JAX, Ray or MLflow is imported (tests/test_bad_input.py)."""
    from test_bad_input import check_rejected, run_cli

    proc = run_cli(["plan", "--model", str(HF / "DeepSeek-V3"), "--hardware", "h100",
                    "--rate", "4", "--input-len", "1024", "--output-len", "128", "--no-mlflow"],
                   tmp_path / "home", tmp_path / "imports.json")
    check_rejected(proc, tmp_path / "home", tmp_path / "imports.json",
                   ["kv_lora_rank:", "multi-head latent attention", "config.json"], None)


def test_approximations_are_warned_saying_how():
    _, mistral = load("Mistral-7B-v0.1")
    assert len(mistral) == 1 and "sliding_window 4096" in mistral[0] and "upper bound" in mistral[0]
    _, gemma2 = load("gemma-2-9b")
    assert {line.split(": ")[1].split(" ")[0] for line in gemma2} == {
        "sliding_window", "attn_logit_softcapping", "final_logit_softcapping"}
    _, qwen25 = load("Qwen2.5-7B")           # use_sliding_window false: no window warning
    assert not any("sliding_window" in line for line in qwen25)
    assert any("q/k/v projection biases" in line for line in qwen25)
    _, llama = load("Llama-3.1-8B")
    assert llama == []


@pytest.mark.parametrize("edit,field,accepted", [
    ({"model_type": "falcon"}, "model_type", "one of"),
    ({"hidden_act": "relu"}, "hidden_act", "SiLU- or GELU-gated"),
    ({"hidden_size": -4}, "hidden_size", "a positive integer"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok", "at most the 8 experts"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step", "mixing dense and MoE"),
])
def test_bad_fields_are_one_line(tmp_path, edit, field, accepted):
    data = json.loads((HF / "Mixtral-8x7B-v0.1" / "config.json").read_text())
    data.update(edit)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        load_model(str(path))
    assert f"{field}:" in str(err.value) and accepted in str(err.value)


def test_not_json_is_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="a JSON config.json"):
        load_model(str(path))


def test_a_space_file_names_a_config_beside_it(tmp_path):
    model_dir = tmp_path / "models" / "tiny"
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text((HF / "Qwen3-8B" / "config.json").read_text())
    model = load_model("models/tiny/config.json", source=str(tmp_path / "space.yaml"))
    assert model.d_model == 4096 and model.name == "tiny"


def test_cli_takes_a_config_and_warns_on_one_line():
    """`sweeper predict --model config.json`: the approximation is one stderr line."""
    proc = subprocess.run([sys.executable, "-m", "sweeper.cli", "predict", "--model",
                           str(HF / "Mistral-7B-v0.1"), "--hardware", "h100", "--chips", "8",
                           "--batch", "8", "--phase", "decode", "--context", "2048", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    warning_lines = [line for line in proc.stderr.splitlines() if "sliding_window" in line]
    assert len(warning_lines) == 1 and warning_lines[0].startswith("warning: ")
    assert json.loads(proc.stdout)["latency_s"] > 0
