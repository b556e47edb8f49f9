"""A small nanoGPT-style GPT, cut into pipeline-stage pieces with deterministic weights.

The input embedding and the output head are untied (separate weights): a tied model would need
an extra embedding all-reduce between the first and last pipeline stage, which the real backend
does not run. The simulator's validation scenario therefore sets `tie_embeddings: false`.

Every piece is initialised from its own seed (`config.seed` and the piece's index), so a stage
built alone holds exactly the weights of the same layers in the full model, whatever the split.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Piece ids for seeding: the embedding, layer i (1 + i) and the head (a fixed large id).
_EMBEDDING_ID = 0
_HEAD_ID = 1_000_003


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """Model shape: layers, heads, hidden size, sequence length (tokens), vocabulary, seed."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 32
    vocab_size: int = 128
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")

    def to_dict(self) -> dict:
        return asdict(self)


class Embedding(nn.Module):
    """Token plus learned position embedding: (batch, seq) int64 -> (batch, seq, n_embd)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(pos)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    """One pre-LayerNorm transformer layer: attention and a 4x GELU MLP, no dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Final LayerNorm, output projection and mean cross-entropy over all tokens."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def _init_piece(module: nn.Module, config: GPTConfig, piece_id: int) -> nn.Module:
    """Initialise `module` from a generator seeded by (config.seed, piece_id), nanoGPT style."""
    gen = torch.Generator().manual_seed(config.seed * 1_000_033 + piece_id)
    # nanoGPT scales residual output projections by 1/sqrt(2 * n_layer).
    proj_std = 0.02 / math.sqrt(2 * config.n_layer)
    with torch.no_grad():
        for name, p in module.named_parameters():  # registration order: deterministic
            if isinstance(_owner(module, name), nn.LayerNorm):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                residual = name.endswith(("c_proj.weight", "mlp.2.weight"))
                std = proj_std if residual else 0.02
                p.normal_(0.0, std, generator=gen)
    return module


def _owner(module: nn.Module, param_name: str) -> nn.Module:
    return module.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else module


def make_embedding(config: GPTConfig) -> Embedding:
    return _init_piece(Embedding(config), config, _EMBEDDING_ID)


def make_block(config: GPTConfig, layer: int) -> Block:
    """Transformer layer `layer` (0-based, model order) with its deterministic weights."""
    return _init_piece(Block(config), config, 1 + layer)


def make_head(config: GPTConfig) -> Head:
    return _init_piece(Head(config), config, _HEAD_ID)


class Stage(nn.Module):
    """A contiguous slice of the model: optional embedding, some blocks, optional head.

    forward(x, targets): `x` is token ids when the stage has the embedding, else the activation
    (batch, seq, n_embd). Returns the scalar loss when the stage has the head, else the activation.
    """

    def __init__(self, config: GPTConfig, first_layer: int, num_layers: int,
                 has_embedding: bool, has_head: bool) -> None:
        super().__init__()
        if first_layer < 0 or num_layers < 0 or first_layer + num_layers > config.n_layer:
            raise ValueError(f"layers [{first_layer}, {first_layer + num_layers}) outside "
                             f"a {config.n_layer}-layer model")
        self.first_layer = first_layer
        self.num_layers = num_layers
        self.embedding = make_embedding(config) if has_embedding else None
        self.blocks = nn.ModuleList(make_block(config, first_layer + i) for i in range(num_layers))
        self.head = make_head(config) if has_head else None

    @property
    def has_embedding(self) -> bool:
        return self.embedding is not None

    @property
    def has_head(self) -> bool:
        return self.head is not None

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            if targets is None:
                raise ValueError("the stage with the head needs targets")
            return self.head(x, targets)
        return x


def build_stage(config: GPTConfig, first_layer: int, num_layers: int, has_embedding: bool,
                has_head: bool) -> Stage:
    """One pipeline (virtual) stage holding layers [first_layer, first_layer + num_layers)."""
    return Stage(config, first_layer, num_layers, has_embedding, has_head)


def build_full_model(config: GPTConfig) -> Stage:
    """The whole model as one stage (the single-process reference)."""
    return Stage(config, 0, config.n_layer, True, True)


def synthetic_batch(config: GPTConfig, iteration: int, microbatch: int, micro_batch_size: int,
                    dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (tokens, targets), each (micro_batch_size, block_size) int64.

    Depends only on (seed, iteration, dp_rank, microbatch), so every pipeline stage of a DP
    replica and the single-process reference draw the same data. Each sequence follows
    x[t+1] = (a * x[t] + b) mod vocab with per-sequence (a, b): learnable, so the loss falls.
    """
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank {dp_rank} outside [0, {dp})")
    gen = torch.Generator().manual_seed(
        ((config.seed * 7919 + iteration) * 104_729 + dp_rank) * 1_299_709 + microbatch)
    v = config.vocab_size
    start = torch.randint(0, v, (micro_batch_size, 1), generator=gen)
    a = torch.randint(1, 4, (micro_batch_size, 1), generator=gen)
    b = torch.randint(0, v, (micro_batch_size, 1), generator=gen)
    seq = [start]
    for _ in range(config.block_size):
        seq.append((a * seq[-1] + b) % v)
    full = torch.cat(seq, dim=1)
    return full[:, :-1].contiguous(), full[:, 1:].contiguous()
