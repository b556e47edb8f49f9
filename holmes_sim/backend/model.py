"""A small nanoGPT-style GPT, cut into pipeline-stage pieces with deterministic weights.

The input embedding and the output head are untied (separate weights): a tied model would need
an extra embedding all-reduce between the first and last pipeline stage, which the real backend
does not run. The simulator's validation scenario therefore sets `tie_embeddings: false`.

Every piece is initialised from its own seed (`config.seed` and the piece's index), so a stage
built alone holds exactly the weights of the same layers in the full model, whatever the split.

Tensor parallelism (`TensorParallel`, Megatron-LM's layout [Shoeybi et al. 2019, "Megatron-LM",
section 3; Narayanan et al. SC'21, section 2.3]): in each layer the attention's QKV projection and
the MLP's first linear are split by output rows (column-parallel: heads, or a slice of the 4h),
the two output projections by input columns (row-parallel); the column-parallel input is
Megatron's f (identity forward, all-reduce of the gradient backward), the row-parallel output
its g (all-reduce forward, identity backward), the row-parallel bias is added after the
all-reduce. The token embedding and the output head are split by vocabulary rows, with
Megatron's vocabulary-parallel cross entropy (the logits never leave their rank: a max, the
target's logit and the sum of exponentials are combined over the group). LayerNorms and the
position embedding are replicated: their inputs are the same on every rank of the group, so
their gradients are too. A TP piece is cut from the full piece's deterministic weights, so a TP
stage trains exactly as the full model does.

With `GPTConfig.num_experts` every layer's MLP is a mixture of experts (`moe.py`); a stage built
with an `ExpertParallel` keeps its EP rank's E / ep experts of each layer, cut from the full
layer's deterministic weights, and swaps tokens with the group's other ranks by all-to-all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from holmes_sim.backend.moe import ExpertParallel, MoeMLP

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
    num_experts: int = 0
    """Routed experts of every layer's MLP (`moe.MoeMLP`); 0: dense 4h MLPs."""
    moe_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn: int = 0
    """One expert's FFN width; 0: 4 n_embd."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.num_experts and not 1 <= self.moe_topk <= self.num_experts:
            raise ValueError(f"moe_topk ({self.moe_topk}) must be in [1, num_experts "
                             f"({self.num_experts})]")

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
    """One pre-LayerNorm transformer layer: attention and a 4x GELU MLP (or, with
    `config.num_experts`, a mixture of experts: `moe.MoeMLP`), no dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        if config.num_experts:
            self.mlp = MoeMLP(config.n_embd, config.num_experts, config.moe_topk,
                              config.moe_ffn or 4 * config.n_embd)
        else:
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


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its TP group: group size, rank, the group's sum of a tensor
    (`all_reduce(x)`, a new tensor) and every member's copy of one (`all_gather(x)`: shape
    (size, *x.shape), in group-rank order); x is left alone."""

    size: int
    rank: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    all_gather: Callable[[torch.Tensor], torch.Tensor]
    reduce_input_grads: bool = True
    """False only in tests, to show they catch a missing all-reduce in f's backward."""

    def split(self, n: int, what: str) -> torch.Tensor:
        """This rank's indices of `n` items split into equal consecutive parts."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) must be a multiple of the TP size ({self.size})")
        k = n // self.size
        return torch.arange(self.rank * k, (self.rank + 1) * k)


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (ctx.tp.all_reduce(grad) if ctx.tp.reduce_input_grads else grad), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return tp.all_reduce(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ColumnParallelLinear(nn.Module):
    """The rows `rows` of a full linear layer (output features), its input through f."""

    def __init__(self, full: nn.Linear, rows: torch.Tensor, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.rows = tp, rows
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[rows].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToTensorParallel.apply(x, self.tp), self.weight, self.bias)

    def place(self, name: str, shard: torch.Tensor, full_shape: torch.Size) -> torch.Tensor | None:
        """`shard` (this rank's `name`) in a zero tensor of the full parameter's shape; None
        for a replicated parameter (every rank holds all of it)."""
        full = shard.new_zeros(full_shape)
        full[self.rows] = shard
        return full


class RowParallelLinear(nn.Module):
    """The columns `cols` of a full linear layer (input features); the partial outputs are
    summed over the group (g), then the full bias is added."""

    def __init__(self, full: nn.Linear, cols: torch.Tensor, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.cols = tp, cols
        self.weight = nn.Parameter(full.weight.detach()[:, cols].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTensorParallel.apply(F.linear(x, self.weight), self.tp) + self.bias

    def place(self, name: str, shard: torch.Tensor, full_shape: torch.Size) -> torch.Tensor | None:
        if name == "bias":
            return None
        full = shard.new_zeros(full_shape)
        full[:, self.cols] = shard
        return full


class VocabParallelEmbedding(nn.Module):
    """The vocabulary rows `rows` of a token embedding; tokens outside them look up zeros and
    the group's sum (g) completes every lookup [Megatron-LM, VocabParallelEmbedding]."""

    def __init__(self, full: nn.Embedding, rows: torch.Tensor, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.rows = tp, rows
        self.start, self.count = int(rows[0]), len(rows)
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mine = (tokens >= self.start) & (tokens < self.start + self.count)
        local = F.embedding((tokens - self.start).clamp(0, self.count - 1), self.weight)
        return _ReduceFromTensorParallel.apply(local * mine.unsqueeze(-1), self.tp)

    def place(self, name: str, shard: torch.Tensor, full_shape: torch.Size) -> torch.Tensor | None:
        full = shard.new_zeros(full_shape)
        full[self.rows] = shard
        return full


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of logits split by vocabulary (N, V / tp) [Megatron-LM,
    vocab_parallel_cross_entropy]: the group's max, the target's logit and the sum of
    exponentials are combined over the group; the backward is local (softmax - one-hot)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int,
                tp: TensorParallel) -> torch.Tensor:
        count = logits.shape[-1]
        shifted = logits - tp.all_gather(logits.max(dim=-1).values).max(dim=0).values[:, None]
        mine = (targets >= start) & (targets < start + count)
        index = (targets - start).clamp(0, count - 1)
        target_logit = tp.all_reduce(shifted.gather(1, index[:, None]).squeeze(1) * mine)
        exp = shifted.exp()
        total = tp.all_reduce(exp.sum(dim=-1))
        ctx.save_for_backward(exp / total[:, None], index, mine)
        return total.log() - target_logit

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, mine = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits[torch.arange(len(index)), index] -= mine.to(softmax.dtype)
        return grad_logits * grad[:, None], None, None, None


class ParallelEmbedding(nn.Module):
    """An `Embedding` whose token table is split by vocabulary; the position table is
    replicated (same parameter names)."""

    def __init__(self, full: Embedding, config: GPTConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(full.wte, tp.split(config.vocab_size, "vocab_size"), tp)
        self.wpe = full.wpe

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(pos)


class ParallelHead(nn.Module):
    """A `Head` whose output projection is split by vocabulary, with the vocabulary-parallel
    cross entropy (same parameter names)."""

    def __init__(self, full: Head, config: GPTConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.ln_f = full.ln_f
        rows = tp.split(config.vocab_size, "vocab_size")
        self.start = int(rows[0])
        self.lm_head = ColumnParallelLinear(full.lm_head, rows, tp)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))
        losses = _VocabParallelCrossEntropy.apply(logits.view(-1, logits.shape[-1]),
                                                  targets.view(-1), self.start, self.tp)
        return losses.mean()


class ParallelSelfAttention(nn.Module):
    """This rank's heads of a `CausalSelfAttention`: n_head / tp of them."""

    def __init__(self, full: CausalSelfAttention, config: GPTConfig, tp: TensorParallel) -> None:
        super().__init__()
        h, n = config.n_embd, config.n_embd // tp.size
        self.n_head, self.width = config.n_head // tp.size, n
        mine = tp.split(h, "n_embd")
        self.c_attn = ColumnParallelLinear(full.c_attn, torch.cat([mine, mine + h, mine + 2 * h]),
                                           tp)
        self.c_proj = RowParallelLinear(full.c_proj, mine, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        n = self.width
        q, k, v = self.c_attn(x).split(n, dim=2)
        q, k, v = (z.view(b, t, self.n_head, n // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, n))


class ParallelBlock(nn.Module):
    """A `Block` split over a TP group (module docstring); same parameter names and order."""

    def __init__(self, full: Block, config: GPTConfig, tp: TensorParallel) -> None:
        super().__init__()
        if config.num_experts:
            raise ValueError("the backend runs mixture-of-experts layers with tensor: 1 only")
        tp.split(config.n_head, "n_head")
        mine = tp.split(4 * config.n_embd, "the MLP width")
        self.ln_1 = full.ln_1
        self.attn = ParallelSelfAttention(full.attn, config, tp)
        self.ln_2 = full.ln_2
        self.mlp = nn.Sequential(ColumnParallelLinear(full.mlp[0], mine, tp), nn.GELU(),
                                 RowParallelLinear(full.mlp[2], mine, tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


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
                 has_embedding: bool, has_head: bool, tp: TensorParallel | None = None,
                 ep: ExpertParallel | None = None) -> None:
        super().__init__()
        if first_layer < 0 or num_layers < 0 or first_layer + num_layers > config.n_layer:
            raise ValueError(f"layers [{first_layer}, {first_layer + num_layers}) outside "
                             f"a {config.n_layer}-layer model")
        self.first_layer = first_layer
        self.num_layers = num_layers
        split = tp is not None and tp.size > 1
        self.embedding = make_embedding(config) if has_embedding else None
        blocks = [make_block(config, first_layer + i) for i in range(num_layers)]
        head = make_head(config) if has_head else None
        if split:
            if self.embedding is not None:
                self.embedding = ParallelEmbedding(self.embedding, config, tp)
            blocks = [ParallelBlock(b, config, tp) for b in blocks]
            if head is not None:
                head = ParallelHead(head, config, tp)
        if ep is not None and ep.size > 1:
            if not config.num_experts:
                raise ValueError("expert parallelism needs a model with num_experts")
            if split:
                raise ValueError("the backend runs expert parallelism with tensor: 1 only")
            for b in blocks:
                b.mlp.keep_local(ep)
        # Registered after the layers, as Megatron-Core's `GPTModel` registers its output layer:
        # the DP buckets take parameters in reverse registration order (`data_parallel.py`).
        self.blocks = nn.ModuleList(blocks)
        self.head = head

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
                has_head: bool, tp: TensorParallel | None = None,
                ep: ExpertParallel | None = None) -> Stage:
    """One pipeline (virtual) stage holding layers [first_layer, first_layer + num_layers), its
    layers split over `tp`'s group when given, its experts over `ep`'s (E / ep on this rank)."""
    return Stage(config, first_layer, num_layers, has_embedding, has_head, tp, ep)


_SHARDED = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def shard_placements(stage: Stage, config: GPTConfig) -> dict[str, torch.Tensor | None]:
    """Per stage-local parameter name: this rank's TP shard placed in zeros of the full-model
    shape (the group's sum of them is the full parameter), or None where the rank holds the
    whole parameter (no TP, or replicated)."""
    full_shapes = {name: p.shape for name, p in
                   build_stage(config, stage.first_layer, stage.num_layers, stage.has_embedding,
                               stage.has_head).named_parameters()}
    out: dict[str, torch.Tensor | None] = {}
    for name, p in stage.named_parameters():
        owner = _owner(stage, name)
        out[name] = owner.place(name.rsplit(".", 1)[1], p.detach(), full_shapes[name]) \
            if isinstance(owner, _SHARDED) else None
    return out


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
