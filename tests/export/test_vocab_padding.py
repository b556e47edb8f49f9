"""The launched model's vocabulary is the simulated one: Megatron-LM pads the tokenizer's
vocabulary up to a multiple of `--make-vocab-size-divisible-by` x TP, so the export writes the
divisor that pads it to the simulated rows (GPT-2's 50,257 tokens to 51,200: 1024 / TP); and a
Llama 3.1 RoPE scaling factor `pretrain_gpt.py` does not pass on is named in the README."""

from __future__ import annotations

import math
import shlex
from types import SimpleNamespace

import pytest

from holmes_sim.export.launch import launch_files
from holmes_sim.export.model_args import tokenizer_vocab, vocab_divisor
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from tests.conftest import SCENARIOS, small_scenario
from tests.export.test_launch_targets import FORK, UPSTREAM, parse


def vocab_size_with_padding(orig_vocab_size: int, args) -> int:
    """Megatron-LM's padding, as megatron/core/tokenizers/utils/build_tokenizer.py has it at
    d98e8a6 (2026-08; megatron/training/tokenizer/tokenizer.py's `_vocab_size_with_padding`
    before), without its log line."""
    after = orig_vocab_size
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    after = int(math.ceil(after / multiple) * multiple)
    return after


def _launched_rows(args_text: str, flags: dict, tp: int, tokens: int) -> int:
    """The padded vocabulary Megatron-LM builds from `tokens` with these arguments."""
    parsed = parse(shlex.split(args_text), flags)
    assert parsed["--tensor-model-parallel-size"] == [str(tp)]
    divisor = int(parsed.get("--make-vocab-size-divisible-by", ["128"])[0])
    return vocab_size_with_padding(tokens, SimpleNamespace(
        make_vocab_size_divisible_by=divisor, tensor_model_parallel_size=tp))


def _files(write_scenario, text: str, policy: str = "megatron"):
    prepared = prepare(write_scenario(text))
    plan, cluster = plan_policy(prepared, policy)
    return prepared.workload, plan, launch_files(plan, cluster, prepared.workload, "bf16").files


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gpt2s_tokenizer_is_padded_to_the_simulated_51200_rows(write_scenario, tp):
    """Before, nothing was written: Megatron-LM's default 128 x TP padded GPT-2's 50,257 tokens
    to 50,304 / 50,432 / 50,688 at TP 1 / 2 / 4, not the 51,200 rows simulated."""
    w, _, files = _files(write_scenario, small_scenario(nodes_ib=2, tp=tp, pp=2,
                                                        policies="[megatron, holmes]"))
    assert (w.vocab, tokenizer_vocab(w)) == (51200, 50257)
    assert _launched_rows(files["megatron_args.txt"], UPSTREAM, tp, 50257) == 51200
    assert _launched_rows(files["holmes_args.txt"], FORK, tp, 50257) == 51200
    text = " ".join(files["README.md"].split())
    flag = f"with `--make-vocab-size-divisible-by {1024 // tp}`, " if tp < 8 else \
        "with Megatron-LM's default make_vocab_size_divisible_by 128, "
    assert (f"from the tokenizer's vocabulary, 50,257 tokens, padded up to a multiple of "
            f"make_vocab_size_divisible_by x TP (`vocab_size_with_padding`); {flag}"
            f"{1024 // tp} x TP {tp} = 1024 gives the 51,200 rows simulated.") in text
    assert "as Megatron-LM pads it" not in text


@pytest.mark.parametrize("name", sorted(p.stem for p in SCENARIOS.glob("*.yaml")))
def test_every_bundled_scenarios_launch_builds_the_simulated_vocabulary(name):
    prepared = prepare(SCENARIOS / f"{name}.yaml")
    plan, cluster = plan_policy(prepared, "megatron")
    w = prepared.workload
    args = launch_files(plan, cluster, w, prepared.scenario.training.precision).files
    assert _launched_rows(args["megatron_args.txt"], UPSTREAM, plan.tp, tokenizer_vocab(w)) == w.vocab


@pytest.mark.parametrize(("model", "tp", "divisor"), [
    ("{preset: llama2-7b, make_vocab_size_divisible_by: 64}", 2, 64),  # the scenario's own
    ("{preset: llama3.1-8b}", 2, 128),  # 128,256 tokens: Megatron-LM's default pads to 128,512
    ("{num_layers: 8, hidden_size: 1024, num_attention_heads: 16, seq_length: 1024, "
     "vocab_size: 50257}", 2, 128),
    ("{num_layers: 8, hidden_size: 1024, num_attention_heads: 16, seq_length: 1024, "
     "vocab_size: 51200, "
     "make_vocab_size_divisible_by: 256}", 4, 256),  # 256 x TP 4 pads 50,257 to 51,200
])
def test_the_divisor_is_the_scenarios_wherever_it_already_pads_right(write_scenario, model, tp,
                                                                      divisor):
    text = small_scenario(nodes_ib=2, tp=tp, pp=2).replace(
        "model: {num_layers: 8, hidden_size: 1024, num_attention_heads: 16,\n"
        "        seq_length: 1024, vocab_size: 51200, tie_embeddings: true}", f"model: {model}")
    w = prepare(write_scenario(text)).workload
    assert vocab_divisor(w, tp) == divisor
    assert vocab_size_with_padding(tokenizer_vocab(w), SimpleNamespace(
        make_vocab_size_divisible_by=divisor, tensor_model_parallel_size=tp)) == w.vocab


_LLAMA31 = "model: {preset: llama3.1-8b, num_layers: 8, seq_length: 1024%s}"


def _readme(write_scenario, extra: str) -> str:
    text = small_scenario(nodes_ib=2, tp=8, pp=2).replace(
        "model: {num_layers: 8, hidden_size: 1024, num_attention_heads: 16,\n"
        "        seq_length: 1024, vocab_size: 51200, tie_embeddings: true}", _LLAMA31 % extra)
    _, _, files = _files(write_scenario, text)
    return files["megatron_args.txt"], " ".join(files["README.md"].split())


def test_a_rope_scaling_factor_pretrain_gpt_drops_is_named_in_the_readme(write_scenario):
    """gpt_builders.py passes GPTModel `rope_scaling=args.use_rope_scaling` and not the factor,
    so GPTModel keeps its 8.0: before, the README did not say the launch trains factor 8."""
    args, readme = _readme(write_scenario, ", rope_scaling_factor: 32.0")
    assert "--use-rope-scaling --rope-scaling-factor 32.0" in args
    assert ("`--rope-scaling-factor 32.0` is written as simulated, but `pretrain_gpt.py` does "
            "not pass it on: its `gpt_builder` (gpt_builders.py) gives GPTModel "
            "`rope_scaling=args.use_rope_scaling` alone, so the launch trains RoPE scaling "
            "factor 8, not 32.") in readme


def test_factor_8_has_no_note(write_scenario):
    args, readme = _readme(write_scenario, "")
    assert "--use-rope-scaling" in args and "--rope-scaling-factor" not in args
    assert "rope-scaling-factor" not in readme
