"""The GPT pieces: deterministic per-layer weights, stage splits, synthetic data, optimizer."""

from __future__ import annotations

import torch

from holmes_sim.backend.model import GPTConfig, build_full_model, build_stage, synthetic_batch
from holmes_sim.backend.optimizer import FlatOptimizer


def test_two_stage_split_holds_the_full_models_weights(tiny_config: GPTConfig) -> None:
    full = build_full_model(tiny_config).state_dict()
    first = build_stage(tiny_config, 0, 2, has_embedding=True, has_head=False).state_dict()
    second = build_stage(tiny_config, 2, 2, has_embedding=False, has_head=True).state_dict()
    assert not any(k.startswith("head.") for k in first)
    assert not any(k.startswith("embedding.") for k in second)
    for key, value in first.items():
        assert torch.equal(value, full[key]), key
    for key, value in second.items():
        # Stage-local block i is model layer 2 + i.
        if key.startswith("blocks."):
            _, i, rest = key.split(".", 2)
            key = f"blocks.{int(i) + 2}.{rest}"
        assert torch.equal(value, full[key]), key
    assert len(first) + len(second) == len(full)


def test_layers_get_distinct_weights(tiny_config: GPTConfig) -> None:
    # Seeding per layer index must not give every layer the same weights.
    a = build_stage(tiny_config, 0, 1, False, False).blocks[0].attn.c_attn.weight
    b = build_stage(tiny_config, 1, 1, False, False).blocks[0].attn.c_attn.weight
    assert not torch.equal(a, b)


def test_chained_stages_compute_the_full_forward(tiny_config: GPTConfig) -> None:
    tokens, targets = synthetic_batch(tiny_config, 0, 0, 2, 0, 1)
    first = build_stage(tiny_config, 0, 1, True, False)
    second = build_stage(tiny_config, 1, 3, False, True)
    loss = second(first(tokens), targets)
    assert torch.equal(loss, build_full_model(tiny_config)(tokens, targets))
    # Untrained: near the uniform-prediction loss ln(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(128.0)).item()) < 0.5


def test_synthetic_batch_is_deterministic_and_distinct(tiny_config: GPTConfig) -> None:
    t1, y1 = synthetic_batch(tiny_config, 3, 1, 2, 1, 2)
    t2, y2 = synthetic_batch(tiny_config, 3, 1, 2, 1, 2)
    assert torch.equal(t1, t2) and torch.equal(y1, y2)
    assert t1.shape == (2, tiny_config.block_size) and t1.dtype == torch.int64
    assert torch.equal(t1[:, 1:], y1[:, :-1])  # targets are the next tokens
    other, _ = synthetic_batch(tiny_config, 3, 1, 2, 0, 2)
    assert not torch.equal(t1, other)


def test_adam_on_a_shard_equals_adam_on_the_whole() -> None:
    gen = torch.Generator().manual_seed(0)
    param, grads = torch.randn(8, generator=gen), [torch.randn(8, generator=gen) for _ in range(3)]
    full, halves = param.clone(), [param[:4].clone(), param[4:].clone()]
    opt_full, opt_half = FlatOptimizer("adam", 0.01), FlatOptimizer("adam", 0.01)
    for g in grads:
        opt_full.step(0, full, g)
        opt_half.step(0, halves[0], g[:4])
        opt_half.step(1, halves[1], g[4:])
    assert torch.equal(full, torch.cat(halves))
    assert not torch.equal(full, param)
