"""A pipeline schedule's ops as the estimate's walk reads them (`OpTable`): each op's kind, the
message slot it reads, the send it waits for and the slot it writes, worked out for all ops at
once from the schedule's closed form without building the schedule, with the steady run the
walk jumps over (`steady_run.py`). A long schedule's table keeps a few steady rounds and records
the rest as rounds left out (`op_table`), so neither the table nor the walk grows with the
micro-batch count.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from holmes_sim.estimate.steady_run import OpColumns, SteadyRun, repeating_rounds, steady_run
from holmes_sim.schedule import ScheduleKind, check_schedule, steady_phase


@dataclass(frozen=True, slots=True)
class OpTable:
    """A schedule as the walk reads it. `rows[s]` holds stage s's ops in order as
    (kind index, input slot, the input's send index, output slot), -1 for none; `kinds[s]` lists
    the distinct (virtual stage, backward) ops of stage s and `sends` the distinct (from, to)
    virtual-stage sends, both sorted; a message slot holds the time its send was issued."""

    shape: tuple[str, int, int, int]
    """(kind, p, m, v) of the schedule this table stands for."""
    kinds: tuple[tuple[tuple[int, bool], ...], ...]
    sends: tuple[tuple[int, int], ...]
    slots: int
    """Size of the walk's message list (by direction, virtual stage, micro-batch)."""
    flat: tuple
    """The ops as the compiled walk reads them: (every op's four ints, stage after stage, as
    array('i'); each stage's first op index and the total, as array('q')). `rows` and `fast`
    are made from it when first asked for (only the walk in Python reads them)."""
    run: SteadyRun | None = None
    """The steady run (None: the walk goes op by op)."""
    released: bool = False  # each stage's last backward of each chunk a kind of its own
    programs: dict = field(default_factory=dict, compare=False, repr=False)
    """`walk`'s recorded segments by (first op index, limit) of every stage (`walk._program`)."""
    tuples: dict = field(default_factory=dict, compare=False, repr=False)
    """`rows` and `fast`, once made (shared by the tables of one schedule's ops)."""

    @property
    def lengths(self) -> list[int]:
        """Ops per stage."""
        firsts = self.flat[1]
        return [b - a for a, b in zip(firsts, firsts[1:])]

    @property
    def rows(self) -> tuple[tuple[tuple, ...], ...]:
        """Each stage's ops as (kind index, input slot, send index, output slot) tuples."""
        got = self.tuples.get("rows")
        if got is None:
            ops = list(zip(*[iter(self.flat[0].tolist())] * 4))
            firsts = self.flat[1]
            got = self.tuples["rows"] = tuple(tuple(ops[a:b]) for a, b in zip(firsts, firsts[1:]))
        return got

    @property
    def first_of_kind(self) -> tuple[tuple[int, ...], ...]:
        """Each stage's index of its first op of each kind (-1: none)."""
        got = self.tuples.get("first_of_kind")
        if got is None:
            got = self.tuples["first_of_kind"] = tuple(
                tuple(next((k for k, op in enumerate(row) if op[0] == dk), -1)
                      for dk in range(len(kinds)))
                for row, kinds in zip(self.rows, self.kinds, strict=True))
        return got

    @property
    def released_outputs(self) -> tuple[tuple[int, ...], ...]:
        """Of a released table, each stage's output slot of its releasing backward of each
        chunk (-1 for the one that sends nothing: virtual stage 0's, stage 0's last op)."""
        got = self.tuples.get("released_outputs")
        if got is None:
            assert self.released, "only a released table has releasing backwards"
            nc = self.shape[3]
            got = self.tuples["released_outputs"] = tuple(
                tuple(next(op[3] for op in row if op[0] == 2 * nc + c) for c in range(nc))
                for row in self.rows)
        return got

    @property
    def fast(self) -> tuple[tuple[tuple, ...], ...]:
        """`rows` in the form `walk` replays them (`walk._program`): -2 reads the "no input" slot at
        the end of the message list, -1 the sentinel send (0 s) and the slot of ops that send
        nothing."""
        got = self.tuples.get("fast")
        if got is None:
            got = self.tuples["fast"] = tuple(
                tuple((dk, -2 if need < 0 else need, sk, out) for dk, need, sk, out in row)
                for row in self.rows)
        return got


_TARGET_ROUNDS = {ScheduleKind.ONE_F_ONE_B: (6, 24), ScheduleKind.INTERLEAVED: (1, 8)}
"""A table keeps a p + b steady rounds (p stages; an interleaved round is p micro-batches);
the jump needs fewer (a transient and two cycles), else the walk falls back to the full table."""


@lru_cache(maxsize=512)
def op_table(kind: str, pp: int, m: int, v: int, released: bool = False) -> OpTable:
    """The walk's table of schedule (kind, p, m, v). With many steady rounds, the table of the
    same schedule with fewer micro-batches, whose run records the rounds left out: a 1F1B or
    interleaved schedule with M more micro-batches is the same op rows with one more steady
    round (forward and backward units are numbered independently of m, `schedule.py`), so the
    walk jumps over those rounds too (`_TARGET_ROUNDS`). `full_op_table` is the table of every
    op."""
    small = _fewer_microbatches(ScheduleKind(kind), pp, m, v)
    if small is None:
        return full_op_table(kind, pp, m, v, released)
    m_small, extra = small
    table = full_op_table(kind, pp, m_small, v, released)
    if table.run is None:
        return full_op_table(kind, pp, m, v, released)
    return OpTable((kind, pp, m, v), table.kinds, table.sends, table.slots, table.flat,
                   SteadyRun(table.run.starts, table.run.period, table.run.shift,
                             table.run.rounds, table.run.outstanding, extra),
                   released, tuples=table.tuples)


def _fewer_microbatches(kind: ScheduleKind, p: int, m: int, v: int) -> tuple[int, int] | None:
    """(micro-batches of the kept table, steady rounds left out), or None to keep all."""
    if kind not in _TARGET_ROUNDS:
        return None
    a, b = _TARGET_ROUNDS[kind]
    target = a * p + b
    if kind is ScheduleKind.ONE_F_ONE_B:
        keep = p + target  # p - 1 warm-up forwards, then one micro-batch per round
        return (keep, m - keep) if m > keep else None
    if kind is ScheduleKind.INTERLEAVED and p > 1:
        warmup_groups = -(-((p - 1) * 2 + (v - 1) * p) // (p * v)) + 1
        keep = p * (warmup_groups + target)  # then p micro-batches per round
        return (keep, (m - keep) // p) if m > keep else None
    return None


@lru_cache(maxsize=256)
def full_op_table(kind: str, pp: int, m: int, v: int, released: bool = False) -> OpTable:
    """The dependency structure of every op of schedule (kind, p, m, v), with its steady run.
    An op's four ints are its (chunk, kind)'s for micro-batch 0 on its stage (`_op_bases`)
    with the micro-batch added to its slots, worked out for all ops at once (numpy) from the
    schedule's closed form (`_op_columns`). `released`: each stage's last backward of each
    chunk (micro-batch m - 1's; it releases gradient buckets, `cost.ops.released_extra_s`) is a
    kind of its own, (virtual stage, True) after the stage's kinds; the steady run ends before:
    the plain table's first rounds, as far as every stage's rounds repeat with them."""
    check_schedule(kind, pp, m, v)
    nv, nc = pp * v, v
    sends = sorted({(j, j + 1) for j in range(nv - 1)} | {(j + 1, j) for j in range(nv - 1)})
    send_index = {pair: i for i, pair in enumerate(sends)}
    # Message (direction, to, micro-batch): forward inputs of j = 1..nv-1, then backward inputs
    # of j = 0..nv-2, m slots each.
    messages = 2 * (nv - 1) * m
    kinds, bases = [], np.empty((pp, nc, 2, 4), dtype=np.int64)
    for s in range(pp):
        # (virtual stage, backward) of the stage's chunks: `Schedule.virtual_stage` c p + s
        stage_kinds = sorted({(c * pp + s, b) for c in range(nc) for b in (False, True)})
        kind_index = {k: i for i, k in enumerate(stage_kinds)}
        for c in range(nc):
            for b, name in enumerate("FB"):
                bases[s, c, b] = _op_bases(s + c * pp, name, nv, m, send_index, kind_index)
        kinds.append(tuple(stage_kinds) + tuple((c * pp + s, True) for c in range(nc) if released))
    chunk, backward, mb, lengths = _op_columns(ScheduleKind(kind), pp, m, v)
    n = len(mb)
    stage = np.repeat(np.arange(pp), lengths)
    table = bases[stage, chunk, backward]
    last = (backward == 1) & (mb == m - 1) & released
    table[last, 0] = 2 * nc + chunk[last]
    for col in (1, 3):  # the input and output slots of micro-batch mb: mb further
        table[:, col] = np.where(table[:, col] < 0, -1, table[:, col] + mb)
    firsts = np.concatenate(([0], np.cumsum(lengths)))
    flat = (array("i", table.astype(np.intc).tobytes()), array("q", firsts.tolist()))
    shape, run = steady_phase(kind, pp, m, v), None
    ops = None if shape is None else OpColumns(
        stage, np.arange(n) - firsts[stage], chunk * 2 + backward + 2 * nc * last, mb,
        table[:, 1], table[:, 3], lengths)
    if ops is not None and not released:
        run = steady_run(ops, m, *shape)
    elif ops is not None and (plain := full_op_table(kind, pp, m, v, False).run) is not None:
        # `steady_run`'s later checks see cuts 0..r alike whatever its rounds: the plain run's.
        rounds = min(plain.rounds, *(int(repeating_rounds(ops, firsts[s], firsts[s + 1], a,
                                                          *shape[1:])) for s, a in enumerate(shape[0])))
        run = SteadyRun(*shape, rounds, plain.outstanding[:rounds + 1]) if rounds >= 3 else None
    return OpTable((kind, pp, m, v), tuple(kinds), tuple(sends), messages, flat, run, released)


def _op_columns(kind: ScheduleKind, p: int, m: int, v: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Every op's chunk, backward (1) or forward (0) and micro-batch, stage after stage, and the
    ops per stage, of `schedule.build_schedule`'s schedule without building it: of T = m v units
    of each kind, stage s runs w warm-up forwards (units 0..w-1), then forward unit f and
    backward unit f - w for f = w..T-1, then backward units T-w..T-1 (`schedule.py`: GPipe
    w = T; 1F1B min(p - s - 1, m); interleaved min(2 (p - s - 1) + (v - 1) p, T)); units in
    `_interleaved_units`' order (one chunk: unit k is micro-batch k)."""
    total = m * v
    k = np.arange(total, dtype=np.int64)
    if kind is ScheduleKind.INTERLEAVED:
        pv = p * v
        micro, forward_chunk = (k // pv) * p + k % p, (k % pv) // p
        units = (forward_chunk, micro, v - 1 - forward_chunk, micro)
    else:
        zero = np.zeros(total, dtype=np.int64)
        units = (zero, k, zero, k)
    unit = np.empty((p, 2 * total), dtype=np.int64)
    back = np.zeros((p, 2 * total), dtype=np.int64)
    for s in range(p):
        w = total if kind is ScheduleKind.GPIPE else min(p - s - 1, m) \
            if kind is ScheduleKind.ONE_F_ONE_B else min((p - s - 1) * 2 + (v - 1) * p, total)
        pairs, row = total - w, unit[s]
        row[:w] = k[:w]
        row[w:w + 2 * pairs:2] = k[w:]
        row[w + 1:w + 2 * pairs:2] = k[:pairs]
        row[w + 2 * pairs:] = k[pairs:]
        back[s, w + 1:w + 2 * pairs:2] = 1
        back[s, w + 2 * pairs:] = 1
    unit, back = unit.ravel(), back.ravel()
    backward = back.astype(bool)
    return (np.where(backward, units[2][unit], units[0][unit]), back,
            np.where(backward, units[3][unit], units[1][unit]), [2 * total] * p)


def _op_bases(j: int, kind: str, nv: int, m: int, send_index: dict, kind_index: dict
              ) -> tuple[int, int, int, int]:
    """An op of virtual stage j ('F' or 'B') as (its kind's index, the slot it reads, the send
    it waits for, the slot it writes) for micro-batch 0: the slots of micro-batch mb are mb
    further (m slots a message); -1 for no input, no send or no output."""
    if kind == "B":
        src, to = j + 1, (j - 1 if j > 0 else -1)
        need = -1 if j == nv - 1 else ((nv - 1) + j) * m
        out = ((nv - 1) + to) * m
    else:
        src, to = j - 1, (j + 1 if j < nv - 1 else -1)
        need = -1 if j == 0 else (j - 1) * m
        out = (to - 1) * m
    sk = send_index[(src, j)] if need >= 0 else -1
    return kind_index[(j, kind == "B")], need, sk, out if to >= 0 else -1

