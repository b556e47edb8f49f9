"""The gradient buckets Megatron-Core cuts one model chunk's parameters into, and when each is
ready in the chunk's backward.

Sources (Megatron-LM main, commit 001199898c, 2026; the same rules since Megatron-Core 0.6):
- [BUF] megatron/core/distributed/param_and_grad_buffer.py, `_ParamAndGradBuffer.__init__`:
  parameters are taken in reverse order of registration (`params[::-1]`, "to roughly follow
  backprop order"); a bucket closes at the first parameter whose end reaches `bucket_size`
  elements from the bucket's start; with the distributed optimizer every parameter starts at a
  multiple of 64 elements (`_pad_start_of_param_if_needed`, counted in that test) and every
  bucket's end is padded to lcm(dp, 128) (`_pad_end_of_bucket_if_needed`, no effect on the cut);
  a shared (tied) embedding weight gets a bucket of its own under the distributed optimizer
  (`_does_param_require_new_bucket`).
- [DDP] megatron/core/distributed/distributed_data_parallel.py: the routed experts' parameters
  (`allreduce = False`) go to a buffer of their own (`expert_parallel_buffers`), cut the same way;
  `bucket_size` is None (one bucket) without `overlap_grad_reduce`, on pipeline ranks > 0 and
  for model chunks after the first; its default grows with dp (`Plan.bucket_numel`).
- Registration order: `GPTModel` (embedding: word, position; decoder layers; final norm;
  output layer), `TransformerLayer` (input norm, self-attention, pre-MLP norm, MLP),
  `Attention.__init__` builds `linear_proj` before `SelfAttention.__init__` builds `linear_qkv`,
  `MLP` (fc1, fc2), `MoELayer` (router, experts, shared experts), `SequentialMLP` (expert by
  expert, each fc1 then fc2); a linear registers its weight before its bias, a norm likewise
  (megatron/core/models/gpt/gpt_model.py, transformer/transformer_layer.py,
  transformer/attention.py, transformer/mlp.py, transformer/moe/moe_layer.py, experts.py).

Sizes are one GPU's of a TP group of t (column- and row-parallel weights, column-parallel biases,
word embedding and output layer over t, the experts' over their TP degree; norms, row-parallel
biases, the position embedding and the router replicated). A parameter's gradient is ready when
the backward has done its op: the chunk's backward FLOPs run the output layer (2 b s h V x 2, its
weight-gradient half left out under `defer_embedding_wgrad`), then the layers last to first, each
(after the recomputed forward under full recomputation) in reverse forward order at twice their
forward FLOPs (`Workload.layer_forward_flop`'s terms; the routed experts' split evenly over the
GPU's experts; the attention core's recomputed forward too under selective recomputation), then
the embedding (no FLOPs). A bucket is ready at the latest point of its parameters.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate, count

import numpy as np

from holmes_sim.model.moe import moe_mlp_forward_flop, shared_gate_params
from holmes_sim.model.workload import Workload

BUCKET_ELEMENT_BYTES = 4
"""`bucket_size_mb` counts fp32 elements: Megatron-Core's `bucket_size` (elements) x 4 bytes
whatever the gradient dtype (160 MB: 40,000,000 elements)."""
PARAM_ALIGN = 64
"""Elements a parameter's start is aligned to under the distributed optimizer [BUF]."""


@dataclass(frozen=True, slots=True)
class BucketRun:
    """One buffer's buckets of a chunk in release order: each bucket's share of the buffer's
    gradient elements and the point of the chunk's backward (0..1) at which it is ready
    (nondecreasing; the last bucket of the chunk's last buffer ends at 1)."""

    shares: tuple[float, ...]
    ready: tuple[float, ...]
    numels: tuple[int, ...]
    """Each bucket's elements on one GPU, without padding."""


_Param = tuple[int, float, bool, bool]
"""(elements on one GPU, ready point of the chunk's backward, routed expert's, own bucket)."""
_Piece = tuple[float, tuple[tuple[int, bool, bool, float], ...]]
"""A piece of the backward (the head, a layer, the embedding): its FLOP and its parameters in
reverse registration order, each (elements, routed expert's, own bucket, FLOP of the piece done
when its gradient is ready)."""


def chunk_bucket_runs(w: Workload, tp: int, first_layer: int, layers: int, first: bool,
                      last: bool, sharded: bool, numel: int | None
                      ) -> tuple[BucketRun, BucketRun | None]:
    """(dense, routed experts') buckets of the chunk holding layers [first_layer, first_layer +
    layers) (with the embedding when `first`, the output layer when `last`) on one GPU of a TP
    group of `tp`; `sharded`: the distributed optimizer's padding and tied-embedding bucket;
    `numel`: elements per bucket (`Plan.bucket_numel`; None: one bucket per buffer, [DDP]).
    The experts' run is None where they share the dense buffer (no expert parallelism).
    Cached by the workload's shape (`shape_token`) and the other arguments."""
    key = (shape_token(w), tp, first_layer if w.moe is not None else 0, layers, first, last, sharded,
           numel)
    got = _RUNS.get(key)
    if got is None:
        if len(_RUNS) >= 4096:
            _RUNS.clear()
        pieces = _chunk_pieces(w, tp, first_layer, layers, first, last)
        if numel is None and not (sharded and w.tie_embeddings):  # nothing cuts a buffer
            _RUNS[key] = got = _whole_buffers(pieces)
            return got
        # The cut reads the elements only: workloads that differ in their FLOPs alone (the
        # recompute mode) share it, and only the ready points are their own.
        cut_key = (param_token(w),) + key[1:]
        cuts = _CUTS.get(cut_key)
        if cuts is None:
            n, expert, own = _chunk_columns(pieces)
            cuts = _shared_cuts(cut_key, n, expert, own, numel, sharded)
        masks, shapes = cuts
        if masks is None:  # one buffer: the ready points of its buckets' last parameters only
            numels, lasts, shares = shapes[0]
            got = (BucketRun(shares, _last_points(pieces, lasts), numels), None)
        else:
            at = _chunk_points(pieces)
            got = (_ready_run(at[masks[0]], shapes[0]), _ready_run(at[masks[1]], shapes[1]))
        _RUNS[key] = got
    return got


def _shared_cuts(key: tuple, n: np.ndarray, expert: np.ndarray, own: np.ndarray,
                 numel: int | None, sharded: bool) -> tuple:
    """(the dense and the routed experts' parameters' masks, None without routed experts; each
    buffer's `_cut_shape`), kept in `_CUTS` by `key`."""
    if len(_CUTS) >= 4096:
        _CUTS.clear()
    if expert.any():
        dense = ~expert
        got = ((dense, expert), (_cut_shape(n[dense], own[dense], numel, sharded),
                                 _cut_shape(n[expert], own[expert], numel, sharded)))
    else:
        got = (None, (_cut_shape(n, own, numel, sharded),))
    _CUTS[key] = got
    return got


_RUNS: dict[tuple, tuple[BucketRun, BucketRun | None]] = {}
_CUTS: dict[tuple, tuple] = {}
"""`chunk_bucket_runs`' cuts without their ready points (`_cut_shape` per buffer, with the dense
parameters' mask, None without routed experts), by `param_token` and the other arguments."""
_PIECES: dict[tuple, _Piece] = {}


def shape_key(w: Workload) -> tuple:
    """What of `w` the cut and the ready points depend on: `param_key` and what changes the
    FLOPs only, the recompute mode and the deferred output-layer weight gradient (the
    micro-batch's tokens scale every FLOP alike, so they do not)."""
    return param_key(w) + (w.recompute, w.defer_embedding_wgrad)


def param_key(w: Workload) -> tuple:
    """What of `w` the parameters' elements and order depend on."""
    return (w.hidden, w.kv_width, w.ffn, w.fc1_width, w.vocab, w.seq, w.bias, w.qkv_bias,
            w.rmsnorm, w.swiglu, w.position_embedding, w.tie_embeddings, w.moe, w.ep,
            w.tp_per_etp, w.mla)


def shape_token(w: Workload) -> int:
    """A number for `shape_key(w)`: equal for workloads of equal shape, kept per workload object
    (the candidates of a search share a few), so a cache key holds one int instead of the
    shape's fields. Numbers are never reused, also after the tables are emptied."""
    return _token(w, shape_key, _TOKENS, _SHAPE_TOKENS)


def param_token(w: Workload) -> int:
    """`shape_token` of `param_key`."""
    return _token(w, param_key, _PARAM_TOKENS, _PARAM_SHAPES)


def _token(w: Workload, key, tokens: dict, shapes: dict) -> int:
    """The number of `key(w)` in `shapes`, kept in `tokens` by the workload's id."""
    got = tokens.get(id(w))
    if got is not None and got[0] is w:
        return got[1]
    shape = key(w)
    token = shapes.get(shape)
    if token is None:
        if len(shapes) >= 1024:
            shapes.clear()
        token = shapes[shape] = next(_NEXT_TOKEN)
    if len(tokens) >= 1024:
        tokens.clear()
    tokens[id(w)] = (w, token)
    return token


_TOKENS: dict[int, tuple[Workload, int]] = {}
"""`shape_token` by the workload's id, with the workload (held, so its id stays its own)."""
_SHAPE_TOKENS: dict[tuple, int] = {}
_PARAM_TOKENS: dict[int, tuple[Workload, int]] = {}
_PARAM_SHAPES: dict[tuple, int] = {}
_NEXT_TOKEN = count()


def _cut(n: np.ndarray, at: np.ndarray, own: np.ndarray, limit: int | None,
         sharded: bool) -> BucketRun:
    """Megatron-Core's cut [BUF] of the parameters (reverse registration order) of `n`
    elements, ready at `at`, `own` a bucket of their own (under `sharded` only), at `limit`
    elements (`_cut_shape`). A bucket is ready at the latest point of every parameter up to its
    last (the running maximum from 0)."""
    return _ready_run(at, _cut_shape(n, own, limit, sharded))


def _ready_run(at: np.ndarray, cut: tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]]
               ) -> BucketRun:
    """The `BucketRun` of a `_cut_shape` with its parameters ready at `at`."""
    numels, lasts, shares = cut
    points = np.maximum.accumulate(np.maximum(at, 0.0)).tolist() if at.size else []
    return BucketRun(shares, tuple([points[k] for k in lasts]), numels)


def _cut_shape(n: np.ndarray, own: np.ndarray, limit: int | None, sharded: bool
               ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...]]:
    """`_cut` without the ready points: each bucket's elements, its last parameter's index and
    its share of the elements. A bucket from parameter b starts at 0 and each parameter at a
    multiple of `PARAM_ALIGN` (`sharded`), so parameter k ends at S[k] - S[b] + n[k], S the
    prefix sums of the aligned sizes: the bucket closes at the first k where that reaches
    `limit` (a search in the nondecreasing S[k] + n[k]), or before an own parameter, which
    closes its own; a last bucket without elements is dropped."""
    size = n.size
    padded = -(-n // PARAM_ALIGN) * PARAM_ALIGN if sharded else n
    starts = np.zeros(size + 1, dtype=np.int64)
    np.cumsum(padded, out=starts[1:])
    ends = (starts[:-1] + n).tolist()
    counts = np.zeros(size + 1, dtype=np.int64)
    np.cumsum(n, out=counts[1:])
    starts, counts = starts.tolist(), counts.tolist()
    owns = np.flatnonzero(own).tolist() + [size] if sharded else [size]
    numels: list[int] = []
    lasts: list[int] = []
    b, o = 0, 0  # the open bucket's first parameter, the next own parameter's index in owns
    while b < size:
        while owns[o] < b:
            o += 1
        stop = owns[o]
        k = stop if limit is None else bisect_left(ends, limit + starts[b], b, stop)
        if k < stop:  # the limit closes the bucket at k
            numels.append(counts[k + 1] - counts[b])
            lasts.append(k)
            b = k + 1
            continue
        if counts[stop] > counts[b]:  # what precedes the own parameter (or the end)
            numels.append(counts[stop] - counts[b])
            lasts.append(stop - 1)
        if stop < size:
            numels.append(counts[stop + 1] - counts[stop])
            lasts.append(stop)
        b = stop + 1
    total = sum(numels)
    return tuple(numels), tuple(lasts), tuple(x / total for x in numels)


def _chunk_pieces(w: Workload, tp: int, first_layer: int, layers: int, first: bool, last: bool
                  ) -> list[_Columns]:
    """The chunk's pieces (`_piece_columns`) in backward order, as `chunk_params` takes them."""
    token = shape_token(w)
    pieces = [_piece_columns(w, token, tp, "head", first)] if last else []
    if w.moe is None:
        pieces += [_piece_columns(w, token, tp, "layer", False)] * layers
    else:
        kinds = tuple(_piece_columns(w, token, tp, "layer", moe) for moe in (False, True))
        pattern = w.moe.pattern
        pieces += [kinds[pattern[i] == 1] for i in reversed(range(first_layer, first_layer + layers))]
    if first:
        pieces.append(_piece_columns(w, token, tp, "embedding", last))
    return pieces


def _whole_buffers(pieces: list[_Columns]) -> tuple[BucketRun, BucketRun | None]:
    """`_cut` of each buffer of `pieces` into one bucket (no limit, no own bucket): all its
    elements, ready at the latest point of its parameters; no experts' run without routed
    experts' parameters. A piece's latest point is (FLOP before it + its latest FLOP) / the
    chunk's FLOP, rounding being monotonic."""
    total = sum(p[0] for p in pieces)
    dones = list(accumulate([p[0] for p in pieces[:-1]], initial=0.0)) if pieces else []
    runs = []
    for buffer in (0, 1):
        held = [(done, p[5][buffer]) for done, p in zip(dones, pieces) if p[5][buffer] is not None]
        if buffer == 1 and not held:
            runs.append(None)
            continue
        count = sum(elements for _, (elements, _) in held)
        point = max([0.0] + [(done + latest) / total if total > 0 else 1.0
                             for done, (_, latest) in held])
        runs.append(BucketRun((count / count,), (point,), (count,)) if count else
                    BucketRun((), (), ()))
    return runs[0], runs[1]


def _chunk_columns(pieces: list[_Columns]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`chunk_params` of the chunk's `pieces` as columns: elements, routed expert's, own
    bucket."""
    if not pieces:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=bool), np.empty(0, dtype=bool)
    return np.concatenate([p[1] for p in pieces]), np.concatenate([p[3] for p in pieces]), \
        np.concatenate([p[4] for p in pieces])


def _last_points(pieces: list[_Columns], lasts: tuple[int, ...]) -> tuple[float, ...]:
    """`_ready_run`'s points of `_chunk_points(pieces)` at the parameter indices `lasts`
    (ascending): the running maximum from 0 at each. Within a piece the points are (FLOP
    before it + each parameter's FLOP) / the chunk's FLOP, which rounding keeps monotonic in
    the parameter's FLOP, so their running maximum is that of the piece's running maximum of
    FLOPs (`_piece_columns`), and before the piece the largest point of the pieces before:
    the same floats without a point per parameter."""
    if not lasts:
        return ()
    total = sum(p[0] for p in pieces)
    if not total > 0:
        return (1.0,) * len(lasts)
    out: list[float] = []
    carry, start, done, i, k = 0.0, 0, 0.0, 0, lasts[0]
    for piece in pieces:
        peaks = piece[6]
        end = start + len(peaks)
        while k < end:
            point = (done + peaks[k - start]) / total
            out.append(point if point > carry else carry)  # `max(carry, point)`
            i += 1
            if i == len(lasts):
                return tuple(out)
            k = lasts[i]
        if peaks:
            point = (done + peaks[-1]) / total
            if point > carry:
                carry = point
        start = end
        done += piece[0]
    raise AssertionError("a bucket's last parameter is past the chunk's")


def _chunk_points(pieces: list[_Columns]) -> np.ndarray:
    """Each parameter's ready point of the chunk's backward (0..1): its piece's point after the
    FLOP of the pieces before it, over the chunk's FLOP (1 without FLOPs)."""
    if not pieces:
        return np.empty(0)
    total = sum(p[0] for p in pieces)
    if total > 0:
        dones = list(accumulate([p[0] for p in pieces[:-1]], initial=0.0))
        return (np.repeat(dones, [p[1].size for p in pieces])
                + np.concatenate([p[2] for p in pieces])) / total
    return np.ones(sum(p[1].size for p in pieces))


def _piece_columns(w: Workload, token: int, tp: int, kind: str, flag: bool) -> _Columns:
    """`_piece` (`token`: `shape_token(w)`) as its FLOP, columns of its parameters (elements,
    FLOP done when ready, routed expert's, own bucket), per buffer (dense, routed experts')
    its elements and latest FLOP (None: no parameters in it), and the running maximum of the
    FLOP done column (`_last_points`), cached."""
    key = (token, tp, kind, flag)
    got = _COLUMNS.get(key)
    if got is None:
        if len(_COLUMNS) >= 1024:
            _COLUMNS.clear()
        flop, params = _piece(w, tp, kind, flag)
        buffers = tuple([p for p in params if bool(p[1]) is expert] for expert in (False, True))
        done = np.array([p[3] for p in params], dtype=np.float64)
        got = _COLUMNS[key] = (flop, np.array([p[0] for p in params], dtype=np.int64), done,
                               np.array([p[1] for p in params], dtype=bool),
                               np.array([p[2] for p in params], dtype=bool),
                               tuple((sum(p[0] for p in b), max(p[3] for p in b)) if b else None
                                     for b in buffers),
                               np.maximum.accumulate(done).tolist() if params else [])
    return got


_Columns = tuple[float, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                 tuple[tuple[int, float] | None, ...], list[float]]
_COLUMNS: dict[tuple, _Columns] = {}


def chunk_params(w: Workload, tp: int, first_layer: int, layers: int, first: bool,
                 last: bool) -> list[_Param]:
    """The chunk's parameters on one GPU in reverse registration order, each with the point of
    the chunk's backward FLOPs at which its gradient is ready (module docstring)."""
    pieces = [_piece(w, tp, "head", first)] if last else []
    pieces += [_piece(w, tp, "layer", w.moe is not None and w.moe.pattern[i] == 1)
               for i in reversed(range(first_layer, first_layer + layers))]
    if first:
        pieces.append(_piece(w, tp, "embedding", last))
    total = sum(flop for flop, _ in pieces)
    out: list[_Param] = []
    done = 0.0
    for flop, params in pieces:
        out += [(n, (done + at) / total if total > 0 else 1.0, e, own) for n, e, own, at in params]
        done += flop
    return out


def _piece(w: Workload, tp: int, kind: str, flag: bool) -> _Piece:
    """The head (`flag`: the chunk also holds the embedding), a layer (`flag`: MoE) or the
    embedding (`flag`: the chunk also holds the head), cached."""
    key = (shape_token(w), tp, kind, flag)
    got = _PIECES.get(key)
    if got is None:
        if len(_PIECES) >= 1024:
            _PIECES.clear()
        h, b_s = w.hidden, 1  # FLOP per token: every term scales with the tokens alike
        if kind == "head":  # output layer (a tied copy: its own bucket), final norm
            head = 2 * 2 * h * w.vocab * (0.5 if w.defer_embedding_wgrad else 1.0)
            output = [] if (w.tie_embeddings and flag) else \
                [(w.vocab * h // tp, False, w.tie_embeddings)]
            ops = [(head, output, 0), (0.0, _norm(w), 1)]
        elif kind == "layer":
            ops = [(_layer_flop(w, b_s, flag), [], 0)] if w.full_recompute else []
            ops += _layer_ops(w, tp, b_s, flag)
        else:  # position, then word embedding (a tied one: its own bucket); no FLOPs
            position = [(w.seq * h, False, False)] if w.position_embedding == "learned" else []
            ops = [(0.0, position + [(w.vocab * h // tp, False, w.tie_embeddings and not flag)], 0)]
        placed, done = [], 0.0
        for k, (flop, params, slot) in enumerate(ops):
            done += flop
            placed += [((slot, k, j), (n, e, own, done)) for j, (n, e, own) in enumerate(params)]
        got = _PIECES[key] = (done, tuple(p for _, p in sorted(placed, key=lambda x: x[0])))
    return got


def _norm(w: Workload) -> list[tuple[int, bool, bool]]:
    """A norm's parameters, reversed: bias then weight (LayerNorm), weight (RMSNorm)."""
    return [(w.hidden, False, False)] if w.rmsnorm else [(w.hidden, False, False)] * 2


def _linear(rows: int, cols: int, split: int, bias_split: int, bias: bool,
            expert: bool = False) -> list[tuple[int, bool, bool]]:
    """A linear's parameters on one GPU, reversed: bias (`rows` / `bias_split`), weight."""
    out = [(rows // bias_split, expert, False)] if bias else []
    return out + [(rows * cols // split, expert, False)]


def _layer_flop(w: Workload, b_s: int, moe: bool) -> float:
    """One layer's forward FLOP for a micro-batch (`Workload.layer_forward_flop`'s terms, the
    MLP dense or MoE as the layer is)."""
    h = w.hidden
    mlp = moe_mlp_forward_flop(w.moe, b_s, h, w.swiglu) if moe else \
        2 * b_s * h * (w.fc1_width + w.ffn)
    if w.mla is not None:
        return w.mla.projection_forward_flop(b_s, h) + w.mla.core_forward_flop(b_s, w.seq) + mlp
    return 2 * b_s * h * (h + 2 * w.kv_width) + 4 * b_s * w.seq * h + 2 * b_s * h * h + mlp


def _layer_ops(w: Workload, tp: int, b_s: int, moe: bool
               ) -> list[tuple[float, list[tuple[int, bool, bool]], int]]:
    """One layer's backward ops (FLOP, parameters produced, slot) in backward order: the MLP,
    the pre-MLP norm, the projection, the attention core, QKV, the input norm. Slots give
    reverse registration order: MLP, pre-MLP norm, QKV, projection, input norm."""
    h, bias = w.hidden, w.bias
    qkv = h + 2 * w.kv_width
    core = 2 * 4 * b_s * w.seq * h + (4 * b_s * w.seq * h if w.recompute == "selective" else 0)
    mlp = _moe_ops(w, tp, b_s) if moe else \
        [(4 * b_s * w.ffn * h, _linear(h, w.ffn, tp, 1, bias)),
         (4 * b_s * h * w.fc1_width, _linear(w.fc1_width, h, tp, tp, bias))]
    if w.mla is not None:
        return [(f, p, 1) for f, p in mlp] + [(0.0, _norm(w), 2)] + _mla_ops(w, tp, b_s) + \
            [(0.0, _norm(w), 5)]
    return [(f, p, 1) for f, p in mlp] + [
        (0.0, _norm(w), 2), (4 * b_s * h * h, _linear(h, h, tp, 1, bias), 4), (core, [], 4),
        (4 * b_s * h * qkv, _linear(qkv, h, tp, tp, w.qkv_bias), 3), (0.0, _norm(w), 5)]


def _mla_ops(w: Workload, tp: int, b_s: int
             ) -> list[tuple[float, list[tuple[int, bool, bool]], int]]:
    """Latent attention's backward ops (`model.mla`), in backward order: the output projection
    (slot 4: `linear_proj`, registered first), the core, the up projections, the latent norms,
    the down projections (slot 3, Megatron-Core `MLASelfAttention` registers them after
    `linear_proj`). Down projections and norms are replicated over TP, the up projections
    column-parallel, the output projection row-parallel."""
    m, h = w.mla, w.hidden
    norm = 1 if w.rmsnorm else 2
    core = 2 * m.core_forward_flop(b_s, w.seq) * (1.5 if w.recompute == "selective" else 1.0)
    ups = [(4 * b_s * m.kv_rank * m.kv_up_width, _linear(m.kv_up_width, m.kv_rank, tp, tp, False))]
    downs = [(4 * b_s * h * (m.kv_rank + m.rope_dim),
              _linear(m.kv_rank + m.rope_dim, h, 1, 1, False))]
    norms = [(m.kv_rank * norm, False, False)]
    if m.q_rank:
        ups.append((4 * b_s * m.q_rank * m.q_width, _linear(m.q_width, m.q_rank, tp, tp, False)))
        downs.append((4 * b_s * h * m.q_rank, _linear(m.q_rank, h, 1, 1, False)))
        norms.append((m.q_rank * norm, False, False))
    else:
        downs.append((4 * b_s * h * m.q_width, _linear(m.q_width, h, tp, tp, False)))
    return [(4 * b_s * h * m.v_width, _linear(h, m.v_width, tp, 1, w.bias), 4), (core, [], 4)] + \
        [(f, p, 3) for f, p in ups] + [(0.0, norms, 3)] + [(f, p, 3) for f, p in downs]


def _moe_ops(w: Workload, tp: int, b_s: int) -> list[tuple[float, list[tuple[int, bool, bool]]]]:
    """An MoE MLP's backward ops in reverse registration order: the shared expert (its gate,
    1 x h replicated, registered after fc1 and fc2 and run after them, with no FLOPs counted;
    fc2, fc1), the GPU's routed experts last to first (fc2, fc1 each; in the expert buffer
    under expert parallelism), the router (E x h, replicated)."""
    m, h, bias = w.moe, w.hidden, w.bias
    f1 = 2 * m.ffn if w.swiglu else m.ffn
    gate = shared_gate_params(m, h)
    ops = [(0.0, [(gate, False, False)])] if gate else []
    if m.shared_ffn:
        s1 = 2 * m.shared_ffn if w.swiglu else m.shared_ffn
        ops += [(4 * b_s * m.shared_ffn * h, _linear(h, m.shared_ffn, tp, 1, bias)),
                (4 * b_s * h * s1, _linear(s1, h, tp, tp, bias))]
    local, etp, expert = m.experts // w.ep, w.expert_tp(tp), w.ep > 1
    rows = b_s * m.topk / local if expert else b_s * m.topk / m.experts  # per local expert
    for _ in range(local if expert else m.experts):
        ops += [(4 * rows * m.ffn * h, _linear(h, m.ffn, etp, 1, bias, expert)),
                (4 * rows * h * f1, _linear(f1, h, etp, etp, bias, expert))]
    return ops + [(4 * b_s * h * m.experts, [(m.experts * h, False, False)])]
