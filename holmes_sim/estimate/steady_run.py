"""Which rounds of a pipeline schedule's op table repeat (`SteadyRun`): the rounds the estimate's
walk may jump over (`walk.py`).

In the steady part of 1F1B and interleaved schedules (one forward, one backward) the op rows
repeat: round r + 1 of stage s is round r with every micro-batch shifted by M (1, or p for
interleaved). Which rounds repeat is checked from the op rows themselves (`steady_run`), not
assumed: every stage's ops repeat with micro-batches + M, every cut (round boundary) is closed
under dependencies, and the messages in flight at each cut are those at the previous cut one
round later.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class SteadyRun:
    """Rounds that repeat: the boundary (cut) before round r of stage s is op index
    `starts[s] + r * period`, for r = 0..rounds; round r + 1 is round r with micro-batches +
    `shift`. `outstanding[r]` lists the message slots written before cut r and read after it,
    in the order of their readers (stage, then position after the cut), so entry i of cut r and
    entry i of cut r + 1 are the same message one round later. `extra`: rounds of the full
    schedule left out of this table (see `op_table`)."""

    starts: tuple[int, ...]
    period: int
    shift: int
    rounds: int
    outstanding: tuple[tuple[int, ...], ...]
    extra: int = 0

    def cut(self, r: int) -> list[int]:
        return [a + r * self.period for a in self.starts]


@dataclass(frozen=True)
class OpColumns:
    """Every op of a schedule, stage after stage, as numpy columns: its stage, its index on the
    stage, its (chunk, kind) as one int, its micro-batch, the slot it reads and the slot it
    writes (-1: none); and the ops per stage."""

    stage: np.ndarray
    index: np.ndarray
    unit: np.ndarray
    microbatch: np.ndarray
    need: np.ndarray
    out: np.ndarray
    lengths: list[int]


def steady_run(ops: OpColumns, m: int, starts: tuple[int, ...], period: int,
               shift: int) -> SteadyRun | None:
    """The verified steady run from `starts`: as many rounds as every stage's ops repeat with
    micro-batches + `shift`, every cut is closed under dependencies, and the messages in flight
    at each cut are those at the previous cut one round later (None: fewer than 3 rounds)."""
    firsts = [0]
    for n in ops.lengths:
        firsts.append(firsts[-1] + n)
    rounds = min(repeating_rounds(ops, firsts[s], firsts[s + 1], a, period, shift)
                 for s, a in enumerate(starts))
    if rounds < 3:
        return None
    # Each message's writer and reader (stage, op index); every message written is read.
    written, read = ops.out >= 0, ops.need >= 0
    slots = ops.out[written]
    order = np.argsort(slots)
    slots, ws, wk = slots[order], ops.stage[written][order], ops.index[written][order]
    where = np.full(max(ops.out.max(initial=-1), ops.need.max(initial=-1)) + 1, -1, dtype=np.int64)
    where[ops.need[read]] = np.flatnonzero(read)
    readers = where[slots]
    assert (readers >= 0).all(), "a message is written but never read"
    rs, kr = ops.stage[readers], ops.index[readers]
    # A slot is inside cut r from the first round whose cut passes its writer (reader).
    begin = np.array(starts)
    rw = np.maximum((wk - begin[ws]) // period + 1, 0)
    base = kr - begin[rs]
    rr = np.maximum(base // period + 1, 0)
    unclosed = rr < rw  # cuts rr..rw-1 hold the reader but not the writer
    if unclosed.any():
        rounds = min(rounds, int(rr[unclosed].min()) - 1)
    if rounds < 3:
        return None
    slot, bounds = _outstanding(slots, rs, base, rw, np.minimum(rr, rounds + 1), rounds)
    rounds = _shifted_rounds(slot, bounds, rounds, m, shift)
    if rounds < 3:
        return None
    slot = slot.tolist()
    return SteadyRun(starts, period, shift, rounds,
                     tuple(tuple(slot[a:b]) for a, b in zip(bounds[:rounds + 1],
                                                            bounds[1:rounds + 2])))


def _outstanding(slots, stage, base, first, end, rounds: int) -> tuple[np.ndarray, np.ndarray]:
    """The slots in flight at cuts r = 0..rounds (those with first <= r < end), cut after cut,
    and where each cut's begin (rounds + 2 bounds): in a cut ordered by their reader's (stage,
    position after the cut), i.e. by (stage, `base`), then slot."""
    order = np.lexsort((slots, base, stage))
    count = np.maximum(end - first, 0)[order]
    slot = np.repeat(slots[order], count)
    offset = np.arange(slot.size) - np.repeat(np.cumsum(count) - count, count)
    cut = np.repeat(first[order], count) + offset
    by_cut = np.argsort(cut, kind="stable")
    return slot[by_cut], np.searchsorted(cut[by_cut], np.arange(rounds + 2))


def _shifted_rounds(slot: np.ndarray, bounds: np.ndarray, rounds: int, m: int, shift: int) -> int:
    """The first r < rounds whose cut r + 1 does not hold cut r's messages with each one's
    micro-batch + shift, in order (a message's slot is its (direction, virtual stage) block
    times m plus its micro-batch), else `rounds` (`_outstanding`'s slots and bounds)."""
    sizes = np.diff(bounds)
    differ = np.flatnonzero(sizes[1:] != sizes[:-1])
    limit = int(differ[0]) if differ.size else rounds  # cuts 0..limit hold n messages each
    n = int(sizes[0])
    cuts = slot[:(limit + 1) * n].reshape(limit + 1, n)
    before, after = cuts[:-1], cuts[1:]
    bad = np.flatnonzero(~((after == before + shift) & (before % m + shift < m)).all(axis=1))
    return int(bad[0]) if bad.size else limit


def repeating_rounds(ops: OpColumns, lo: int, hi: int, start: int, period: int,
                     shift: int) -> int:
    """Rounds from `start` of the stage whose ops are `lo:hi` in which each op is the op one
    round earlier, micro-batch + shift."""
    full = max(0, (hi - lo - start) // period)
    a, b = lo + start, lo + start + full * period
    unit, mb = ops.unit[a:b], ops.microbatch[a:b]
    bad = np.flatnonzero((unit[period:] != unit[:b - a - period]) |
                         (mb[period:] != mb[:b - a - period] + shift))
    return full if bad.size == 0 else int(bad[0]) // period + 1

