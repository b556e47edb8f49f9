"""The optimizer of real runs and of the reference training: SGD or Adam on flat tensors."""

from __future__ import annotations

import torch

from holmes_sim.errors import TestbedError


class FlatOptimizer:
    """SGD or Adam (no weight decay) on flat fp32 tensors; state keyed by a caller's id.

    Elementwise, so a shard of a flat parameter gets exactly the update the full tensor would.
    """

    def __init__(self, kind: str, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8) -> None:
        if kind not in ("adam", "sgd"):
            raise TestbedError(f"optimizer must be 'adam' or 'sgd', got {kind!r}")
        self.kind, self.lr, self.betas, self.eps = kind, lr, betas, eps
        self.state: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    @torch.no_grad()
    def step(self, key: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        if self.kind == "sgd":
            param.add_(grad, alpha=-self.lr)
            return
        m, v, t = self.state.get(key) or (torch.zeros_like(param), torch.zeros_like(param), 0)
        b1, b2 = self.betas
        t += 1
        m.mul_(b1).add_(grad, alpha=1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (v / (1 - b2**t)).sqrt_().add_(self.eps)
        param.addcdiv_(m, denom, value=-self.lr / (1 - b1**t))
        self.state[key] = (m, v, t)
