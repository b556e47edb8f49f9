"""The reference the real runs are checked against: the full model trained in one process on
the same global batch, and a stage's parameters under the full model's names."""

from __future__ import annotations

import torch

from holmes_sim.backend.data_parallel import make_bucket
from holmes_sim.backend.model import GPTConfig, Stage, build_full_model, synthetic_batch
from holmes_sim.backend.optimizer import FlatOptimizer


def canonical_params(stage: Stage, values: dict[str, torch.Tensor] | None = None
                     ) -> dict[str, torch.Tensor]:
    """A stage's parameters (or `values` by stage-local name) under the names the full model
    (`build_full_model`) gives them: layers by their model index, a rank's routed experts (E / ep
    of them under expert parallelism) by theirs."""
    out = {}
    for name, p in stage.named_parameters():
        if values is not None:
            p = values[name]
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            if rest.startswith("mlp.experts."):
                _, _, e, tail = rest.split(".", 3)
                first = getattr(stage.blocks[int(i)].mlp, "first_expert", 0)
                rest = f"mlp.experts.{first + int(e)}.{tail}"
            name = f"blocks.{stage.first_layer + int(i)}.{rest}"
        out[name] = p.detach().cpu()
    return out


def train_reference(config: GPTConfig, micro_batch_size: int, num_microbatches: int, dp: int,
                    iterations: int, lr: float, optimizer: str) -> list[float]:
    """Single-process training on the same global batch; mean micro-batch loss per iteration."""
    return train_reference_model(config, micro_batch_size, num_microbatches, dp, iterations,
                                 lr, optimizer)[0]


def train_reference_model(config: GPTConfig, micro_batch_size: int, num_microbatches: int,
                          dp: int, iterations: int, lr: float,
                          optimizer: str) -> tuple[list[float], Stage]:
    """`train_reference`'s losses and the trained full model."""
    model = build_full_model(config)
    params = list(model.parameters())
    opt = FlatOptimizer(optimizer, lr)
    losses = []
    for it in range(iterations):
        for p in params:
            p.grad = None
        vals = []
        for d in range(dp):
            for mb in range(num_microbatches):
                tokens, targets = synthetic_batch(config, it, mb, micro_batch_size, d, dp)
                loss = model(tokens, targets)
                vals.append(loss.item())
                (loss / (num_microbatches * dp)).backward()
        bucket = make_bucket(params, 0, 1)
        flat = bucket.flat_param()
        opt.step(0, flat, bucket.flat_grad())
        bucket.write_params(flat)
        losses.append(sum(vals) / len(vals))
    return losses, model
