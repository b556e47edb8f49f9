"""The model an export trains is the preset's: its RoPE and norm settings reach Megatron-LM's
arguments (and the Holmes fork's where its parser has them), and the README names the tokenizer
of the vocabulary simulated."""

from __future__ import annotations

import re
import shlex

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.cost.transformer import layer_kernels
from holmes_sim.export.launch import launch_files
from holmes_sim.export.model_args import FORK_LACKS, architecture_args, without_flags
from holmes_sim.model.workload import build_workload
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from holmes_sim.spec.job import ModelSpec, TrainingSpec
from holmes_sim.spec.presets import PRESETS, preset_fields
from tests.conftest import small_scenario
from tests.export.test_launch_targets import FORK, UPSTREAM, parse

_TRAINING = TrainingSpec(global_batch_size=8, micro_batch_size=1)
_NEW_FLAGS = ("--rotary-base", "--rotary-percent", "--use-rope-scaling", "--rope-scaling-factor",
              "--norm-epsilon", "--apply-layernorm-1p")

# Each preset's settings as its Hugging Face config.json gives them (rope_theta, rms_norm_eps or
# norm_eps, partial_rotary_factor, rope_scaling) and NeMo's config (nemo/collections/llm/gpt/
# model/*.py) agrees, written as the Megatron-LM flags that leave its defaults (base 10000,
# percent 1.0, no scaling, epsilon 1e-5, no zero-centered gamma).
EXPECTED = {
    "gpt3-175b": {},
    "llama2-7b": {},
    "llama2-70b": {},
    "llama3-8b": {"--rotary-base": ["500000"]},
    "llama3-70b": {"--rotary-base": ["500000"]},
    "llama3.1-8b": {"--rotary-base": ["500000"], "--use-rope-scaling": []},
    "llama3.1-405b": {"--rotary-base": ["500000"], "--use-rope-scaling": []},
    "nemotron4-15b": {"--rotary-percent": ["0.5"], "--apply-layernorm-1p": []},
    "nemotron4-340b": {"--rotary-percent": ["0.5"], "--apply-layernorm-1p": []},
    "qwen2.5-7b": {"--rotary-base": ["1000000"], "--norm-epsilon": ["1e-06"]},
    "qwen2.5-72b": {"--rotary-base": ["1000000"]},  # its rms_norm_eps is 1e-5
    "mixtral-8x7b": {"--rotary-base": ["1000000"]},
    "mixtral-8x22b": {"--rotary-base": ["1000000"]},
    "qwen1.5-moe-a2.7b": {"--rotary-base": ["1000000"], "--norm-epsilon": ["1e-06"]},
    "qwen2-57b-a14b": {"--rotary-base": ["1000000"], "--norm-epsilon": ["1e-06"]},
    "deepseek-v2-lite": {"--norm-epsilon": ["1e-06"]},
    "deepseek-v3": {"--norm-epsilon": ["1e-06"]},
}


def _args(**fields) -> list[str]:
    return architecture_args(build_workload(ModelSpec(**fields), _TRAINING))


@pytest.mark.parametrize("preset", EXPECTED)
def test_each_preset_exports_its_rope_and_norm_settings(preset):
    """Before, no preset wrote any of these: a Llama 3.1 launch trained RoPE at base 10000
    unscaled, Qwen2.5-7B with epsilon 1e-5, Nemotron-4 rotating every dimension."""
    parsed = parse(_args(**preset_fields(preset)), UPSTREAM)
    assert {f: v for f, v in parsed.items() if f in _NEW_FLAGS} == EXPECTED[preset]


def test_every_preset_is_checked_and_keeps_its_cost():
    """The table above covers the presets that differ; the settings change no cost."""
    assert set(PRESETS) - set(EXPECTED) <= {"llama2-13b", "llama3.1-70b"}
    base = build_workload(ModelSpec(**preset_fields("llama3.1-8b")), _TRAINING)
    plain = build_workload(ModelSpec(**dict(preset_fields("llama3.1-8b"), rotary_base=10000,
                                            rope_scaling=False, norm_epsilon=1e-6,
                                            rotary_percent=0.5)), _TRAINING)
    assert base != plain and base.total_params == plain.total_params
    assert repr(layer_kernels(base, 8)) == repr(layer_kernels(plain, 8))


def test_fields_beside_a_preset_override_its_settings():
    fields = dict(preset_fields("llama3.1-8b"), rope_scaling_factor=32.0, norm_epsilon=1e-6)
    parsed = parse(_args(**fields), UPSTREAM)
    assert parsed["--rope-scaling-factor"] == ["32.0"] and parsed["--norm-epsilon"] == ["1e-06"]
    unscaled = parse(_args(**dict(fields, rope_scaling=False)), UPSTREAM)
    assert "--use-rope-scaling" not in unscaled and "--rope-scaling-factor" not in unscaled


def test_rope_settings_are_written_with_rope_only():
    """Megatron reads them only with `--position-embedding-type rope`: a preset's own go
    unused beside a written `position_embedding: learned`."""
    gpt = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16)
    llama = dict(preset_fields("llama3.1-8b"), preset="llama3.1-8b", num_layers=2,
                 position_embedding="learned")
    assert set(_args(**llama)).isdisjoint(
        {"--rotary-base", "--use-rope-scaling", "--rope-scaling-factor", "--rotary-percent"})
    assert _args(**gpt, norm_epsilon=1e-6) == ["--norm-epsilon", "1e-06"]


@pytest.mark.parametrize("preset", [p for p in PRESETS if "num_experts" not in PRESETS[p].fields])
def test_the_forks_model_flags_parse_with_its_parser(preset):
    """The fork has `--rotary-percent`, `--norm-epsilon` and `--apply-layernorm-1p`, not the
    flags of `FORK_LACKS`, which its export leaves out."""
    args = _args(**preset_fields(preset))
    kept = parse(without_flags(args, FORK_LACKS), FORK)
    assert not set(kept) & set(FORK_LACKS)
    assert all(flag not in FORK for flag in FORK_LACKS)
    assert all(flag in FORK for flag in set(_NEW_FLAGS) - set(FORK_LACKS))


def test_without_flags_drops_only_the_named_flags_and_their_values():
    args = ["--micro-batch-size", "4", "--decoder-first-pipeline-num-layers", "4", "--bf16"]
    assert without_flags(args, ["--decoder-first-pipeline-num-layers"]) == \
        ["--micro-batch-size", "4", "--bf16"]


_LLAMA_MODEL = "model: {preset: llama3.1-8b, num_layers: 8, seq_length: 1024}\n"


def _small(model: str | None = None) -> str:
    text = small_scenario(nodes_ib=1, nodes_roce=1, pp=2, policies="[holmes]")
    if model is None:
        return text
    return re.sub(r"model: \{[^}]*\}\n", model, text, count=1)


def _export(write_scenario, text: str) -> dict[str, str]:
    prepared = prepare(write_scenario(text))
    plan, cluster = plan_policy(prepared, "holmes")
    return launch_files(plan, cluster, prepared.workload, "bf16").files


def test_a_llama_3_1_export_trains_its_rope_and_the_fork_says_what_it_lacks(write_scenario):
    files = _export(write_scenario, _small(_LLAMA_MODEL))
    upstream = parse(shlex.split(files["megatron_args.txt"]), UPSTREAM)
    assert upstream["--rotary-base"] == ["500000"] and upstream["--use-rope-scaling"] == []
    fork = parse(shlex.split(files["holmes_args.txt"]), FORK)  # before: --rotary-base refused
    assert "--hetero-mode" in fork and "--rotary-base" not in fork
    readme = " ".join(files["README.md"].split())
    assert ("`megatron_args.txt` sets `--rotary-base 500000 --use-rope-scaling`, which "
            "`holmes_args.txt` leaves out") in readme
    assert "trains RoPE at base 10000 without scaling" in readme


def _example(readme: str) -> list[str]:
    text = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(text.replace("\\\n", " "))[1:]


def test_a_llama_readme_names_its_tokenizer_and_the_vocabulary_simulated(write_scenario):
    """Before, every README's example used GPT-2's BPE (50,257 tokens) for this 128,256-token
    model."""
    readme = _export(write_scenario, _small(_LLAMA_MODEL))["README.md"]
    example = parse(_example(readme), UPSTREAM)
    assert example["--tokenizer-type"] == ["HuggingFaceTokenizer"]
    assert example["--tokenizer-model"] == ["meta-llama/Llama-3.1-8B"]
    assert "GPT2BPETokenizer" not in readme.split("## Tokenizer", 1)[0]
    text = " ".join(readme.split())
    assert "simulated at a vocabulary of 128,256 tokens (`model.vocab_size`), padded to 129,024" \
        in text  # TP 8: a multiple of 1,024
    assert "preset llama3.1-8b's own tokenizer" in text
    assert "A tokenizer of another vocabulary (GPT-2's 50,257 tokens, say) trains a different " \
           "model from the one simulated" in text


def test_a_gpt_readme_keeps_gpt2s_tokenizer(write_scenario):
    readme = _export(write_scenario, _small())["README.md"]
    example = parse(_example(readme), UPSTREAM)
    assert example["--tokenizer-type"] == ["GPT2BPETokenizer"]
    assert example["--vocab-file"] == ["gpt2-vocab.json"]
    text = " ".join(readme.split())
    assert "simulated at a vocabulary of 51,200 tokens" in text and "GPT-2's BPE" in text
    assert "(Llama 3's 128,256 tokens, say) trains a different model" in text


def test_a_vocabulary_no_tokenizer_is_known_for_gets_a_placeholder(write_scenario):
    """A preset whose vocabulary is overridden is no longer its tokenizer's."""
    model = "model: {preset: llama3.1-8b, num_layers: 8, seq_length: 1024, vocab_size: 64000}\n"
    readme = _export(write_scenario, _small(model))["README.md"]
    assert parse(_example(readme), UPSTREAM)["--tokenizer-model"] == ["NAME"]
    assert "meta-llama" not in readme and "GPT2BPETokenizer" not in _example(readme)
    assert "no tokenizer is known for this vocabulary: give one of 64,000 tokens" in \
        " ".join(readme.split())


def test_plan_export_writes_the_presets_flags(write_scenario, tmp_path):
    path = write_scenario(_small(_LLAMA_MODEL))
    result = CliRunner().invoke(app, ["plan", str(path), "--export", str(tmp_path / "ex")])
    assert result.exit_code == 0, result.output
    exports = sorted((tmp_path / "ex").glob("*/megatron_args.txt"))
    assert exports
    for args in exports:
        assert "--rotary-base 500000 --use-rope-scaling" in args.read_text()
        assert "meta-llama/Llama-3.1-8B" in (args.parent / "README.md").read_text()


def _llama3_inv_freq(dim: int, theta: float, factor: float, low: float, high: float,
                     original: int):
    """Hugging Face transformers' `_compute_llama3_parameters` (modeling_rope_utils.py) for a
    config.json's `rope_theta` and `rope_scaling` {factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}."""
    import math

    import torch
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def test_megatron_core_builds_llama_3_1s_rope_from_the_exported_flags():
    """Megatron-Core's RotaryEmbedding under the exported flags has the inverse frequencies of
    meta-llama/Llama-3.1-8B's config.json (rope_theta 500000; rope_scaling llama3, factor 8,
    low 1, high 4, original 8192); under Megatron's defaults, what the export wrote before,
    it does not."""
    torch = pytest.importorskip("torch")
    rope = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    w = build_workload(ModelSpec(**preset_fields("llama3.1-8b")), _TRAINING)
    parsed = parse(architecture_args(w), UPSTREAM)

    def built(base: int, scaling: bool):
        return rope.RotaryEmbedding(w.hidden // w.heads, 1.0, rotary_base=base,
                                    rope_scaling=scaling, use_cpu_initialization=True).inv_freq

    card = _llama3_inv_freq(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    exported = built(int(parsed["--rotary-base"][0]), "--use-rope-scaling" in parsed)
    assert torch.allclose(exported, card, rtol=1e-5)
    assert not torch.allclose(built(10000, False), card, rtol=1e-2)


@pytest.mark.parametrize("preset", ["nemotron4-15b", "qwen2.5-7b"])
def test_megatron_core_takes_the_exported_norm_and_rotary_share(preset):
    """`--norm-epsilon` and `--apply-layernorm-1p` set Megatron-Core's `layernorm_epsilon` and
    `layernorm_zero_centered_gamma`; `--rotary-percent` rotates that share of each head."""
    config = pytest.importorskip("megatron.core.transformer.transformer_config")
    rope = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    w = build_workload(ModelSpec(**preset_fields(preset)), _TRAINING)
    parsed = parse(architecture_args(w), UPSTREAM)
    made = config.TransformerConfig(
        num_layers=2, hidden_size=w.hidden, num_attention_heads=w.heads,
        layernorm_epsilon=float(parsed.get("--norm-epsilon", ["1e-5"])[0]),
        layernorm_zero_centered_gamma="--apply-layernorm-1p" in parsed)
    card = {"nemotron4-15b": (1e-5, True, 0.5), "qwen2.5-7b": (1e-6, False, 1.0)}[preset]
    percent = float(parsed.get("--rotary-percent", ["1.0"])[0])
    assert (made.layernorm_epsilon, made.layernorm_zero_centered_gamma, percent) == card
    head = w.hidden // w.heads
    inv_freq = rope.RotaryEmbedding(head, percent, use_cpu_initialization=True).inv_freq
    assert 2 * len(inv_freq) == int(head * card[2])
