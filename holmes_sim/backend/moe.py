"""The mixture-of-experts MLP of the backend's GPT: a top-k router, the token dispatch to the
experts' ranks by all-to-all over the expert-parallel (EP) group, the expert FFNs and the combine
all-to-all back, as Megatron-Core's `MoELayer` with the all-to-all token dispatcher runs it
(megatron/core/transformer/moe/moe_layer.py, token_dispatcher.py `MoEAlltoAllTokenDispatcher`).

Routing is balanced and deterministic: the j-th copy of token t (t counts the micro-batch's
M = b s tokens, j < k) goes to expert (t k + j) mod E, so every expert receives exactly M k / E
rows of every rank (M k divisible by E) and every rank sends M k / ep rows to each EP peer, the
dropless balanced routing `cost/expert_parallel.py` prices (B = M k h d bytes per GPU and MoE
layer, B / ep to each peer). The router still learns: a token's k gates are the softmax of the
router's logits of its k experts (Mixtral's top-k then softmax, Jiang et al. 2024, section 2.1),
so the loss depends on the router weights. Megatron-Core's own balanced benchmark mode,
`--moe-router-force-load-balancing`, draws random logits instead: balanced in expectation only.

Dispatch: the copies are sorted by expert (E blocks of M k / E rows); the block of expert e goes
to EP rank e // (E / ep), which runs its E / ep experts over the rows every peer sent it and sends
them back in the same layout (combine); the backward moves the gradients the same way. The
all-to-all is the pairwise exchange NCCL runs for `all_to_all_single` (a send and a receive per
peer, all posted at once; torch/csrc/cuda/nccl.cpp `all2all_single_equal_split`), here over
the EP group's point-to-point connections (`collectives.ExpertParallelComm`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's place in its EP group: size, rank, and the group's all-to-all
    (`all_to_all(x)`: x of shape (size, ...), chunk j to group rank j; returns the chunks
    received, chunk j from group rank j)."""

    size: int
    rank: int
    all_to_all: Callable[[torch.Tensor], torch.Tensor]


class Expert(nn.Module):
    """One expert FFN: h -> f (GELU) -> h, with biases (the dense MLP's shape at width f)."""

    def __init__(self, n_embd: int, ffn: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, ffn)
        self.c_proj = nn.Linear(ffn, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class _AllToAll(torch.autograd.Function):
    """The EP group's all-to-all; its backward is the same exchange of the gradients (equal
    splits: what came from peer j goes back to peer j)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
        ctx.ep = ep
        return ep.all_to_all(x.contiguous())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.ep.all_to_all(grad.contiguous()), None


def expert_of_copies(tokens: int, topk: int, experts: int) -> torch.Tensor:
    """The expert of every routed copy, shape (tokens, topk): copy j of token t goes to expert
    (t topk + j) mod experts (module docstring)."""
    return torch.arange(tokens * topk).view(tokens, topk) % experts


class MoeMLP(nn.Module):
    """A MoE MLP holding the experts `first_expert` .. + len(experts) - 1 of `num_experts`; with
    `ep` (size > 1) the others live on the EP group's other ranks, E / ep each in rank order."""

    def __init__(self, n_embd: int, num_experts: int, topk: int, ffn: int) -> None:
        super().__init__()
        if topk > num_experts:
            raise ValueError(f"topk ({topk}) must be at most num_experts ({num_experts})")
        self.num_experts, self.topk = num_experts, topk
        self.router = nn.Linear(n_embd, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(n_embd, ffn) for _ in range(num_experts))
        self.ep: ExpertParallel | None = None

    def keep_local(self, ep: ExpertParallel) -> MoeMLP:
        """Keep only EP rank `ep.rank`'s experts (E / ep consecutive ones); returns self."""
        if self.num_experts % ep.size:
            raise ValueError(f"num_experts ({self.num_experts}) must be a multiple of the EP "
                             f"size ({ep.size})")
        per = self.num_experts // ep.size
        self.experts = nn.ModuleList(list(self.experts)[ep.rank * per:(ep.rank + 1) * per])
        self.ep = ep
        return self

    @property
    def ep_size(self) -> int:
        return 1 if self.ep is None else self.ep.size

    @property
    def first_expert(self) -> int:
        """The whole model's index of this rank's first expert (`experts[0]`)."""
        return 0 if self.ep is None else self.ep.rank * len(self.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        tokens, k, n = b * t, self.topk, self.num_experts
        if tokens * k % n:
            raise ValueError(f"balanced routing needs micro-batch tokens x topk ({tokens} x {k}) "
                             f"divisible by num_experts ({n})")
        flat = x.reshape(tokens, h)
        chosen = expert_of_copies(tokens, k, n)
        gates = torch.softmax(self.router(flat).gather(1, chosen), dim=-1)  # (tokens, k)
        order = torch.argsort(chosen.reshape(-1), stable=True)  # copies grouped by expert
        rows = flat.repeat_interleave(k, dim=0)[order]  # (tokens k, h), E blocks of equal size
        out = self._experts(rows.view(self.ep_size, -1, h))
        back = torch.empty_like(out).index_copy(0, order, out)  # unpermute
        return (back.view(tokens, k, h) * gates.unsqueeze(-1)).sum(dim=1).view(b, t, h)

    def _experts(self, chunks: torch.Tensor) -> torch.Tensor:
        """Dispatch (size, rows, h) to the EP ranks, run the local experts, combine back;
        returns (size rows, h) in the dispatched order."""
        ep, h = self.ep_size, chunks.shape[-1]
        received = chunks if ep == 1 else _AllToAll.apply(chunks, self.ep)
        local = len(self.experts)
        per_expert = received.view(ep, local, -1, h)  # from each peer, its rows of each expert
        done = torch.stack([expert(per_expert[:, e].reshape(-1, h)).view(ep, -1, h)
                            for e, expert in enumerate(self.experts)], dim=1)
        done = done.reshape(ep, -1, h)
        combined = done if ep == 1 else _AllToAll.apply(done, self.ep)
        return combined.reshape(-1, h)


def dispatch_shape(micro_batch_size: int, block_size: int, n_embd: int, topk: int,
                   ep: int) -> tuple[int, int, int]:
    """Shape of one all-to-all's buffer of a rank: (ep, M k / ep rows, h), M = b s."""
    return ep, micro_batch_size * block_size * topk // ep, n_embd
