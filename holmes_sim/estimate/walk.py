"""The analytic estimate's critical-path walk over a pipeline schedule, and its steady-state jump.

The walk evaluates one replica's schedule as a max-plus recurrence: an op starts when the
previous op of its stage ended and its input arrived. A transfer is a rendezvous, as NCCL's and
gloo's point-to-point operations are: it starts when its op has ended on the sending stage and
the receiving stage has posted the receive (reached the op that consumes it, i.e. ended its
previous op), and takes its idle-path time. A stage posts one receive at a time, so transfers
to one stage never overlap. `walk_plain` does that op by op.

`walk` gives the same stage end times without walking every micro-batch. In the steady part of
1F1B and interleaved schedules (one forward, one backward) the op rows repeat: round r + 1 of
stage s is round r with every micro-batch shifted by M (1, or p for interleaved), so the map from
the state at one round boundary (each stage's clock, the messages in flight) to the next is the
same max-plus map F for every round. F is homogeneous (F(x + a) = F(x) + a), so
once the state after round r equals the state after round r - c plus one constant a (c: the
cyclicity of the recurrence; Baccelli et al., "Synchronization and Linearity", 1992, ch. 3),
every later c rounds add a again: the walk adds it (R - r) / c times at once (R: the run's last
round) and walks on from there. Cycles c up to 2p are tried (1F1B on 16 stages: c = 4 seen).
Which rounds repeat is checked from the op rows themselves (`SteadyRun`), not assumed.

The constant is measured in floating point, so a jump differs from the op-by-op walk by
rounding only (tests hold it to 1e-12 relative).

Which ops a walk can run in a row (a stage's ops up to the next input not yet sent) depends on
the table only, not on the times: a table's first walk through a segment (between two cuts)
checks every input and records its runs; later walks replay them without checks, with sentinel
slots for ops that have no input or send nothing: the same additions and maxima, bit for bit.

With the optional C extension built (`_walk_kernel.c`, `setup.py`) the ops run in C instead: the
checked walk, the same additions and maxima in the same order on IEEE doubles, so the same
result bit for bit (tests run both). The ops a walk visits are few per micro-batch but not
few: about 7,000 for an interleaved schedule of 16 stages (warm-up, the rounds until the state
repeats, cool-down), at 0.07-0.1 us each in CPython.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from holmes_sim.schedule import ScheduleKind, check_schedule, steady_phase

try:  # the walk in C (`_walk_kernel.c`, an optional extension): the same sums bit for bit
    from holmes_sim.estimate import _walk_kernel
except ImportError:  # not built (no C compiler): the walk in Python
    _walk_kernel = None

_MAX_CYCLE = 2
"""Cyclicities tried per pipeline stage: the state after round r is compared with the states
after rounds r - 1 ... r - 2p."""
_NOISE_ULPS = 64
"""The state's components' increments may differ from the first one's by this many units in the
last place of the largest time (rounding in a round's chain of additions) and still count as
one constant."""


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
    """`walk`'s recorded segments by (first op index, limit) of every stage (`_program`)."""
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
    def fast(self) -> tuple[tuple[tuple, ...], ...]:
        """`rows` in the form `walk` replays them (`_program`): -2 reads the "no input" slot at
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
    ops = None if shape is None else _OpColumns(
        stage, np.arange(n) - firsts[stage], chunk * 2 + backward + 2 * nc * last, mb,
        table[:, 1], table[:, 3], lengths)
    if ops is not None and not released:
        run = _steady_run(ops, m, *shape)
    elif ops is not None and (plain := full_op_table(kind, pp, m, v, False).run) is not None:
        # `_steady_run`'s later checks see cuts 0..r alike whatever its rounds: the plain run's.
        rounds = min(plain.rounds, *(int(_repeating_rounds(ops, firsts[s], firsts[s + 1], a,
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


@dataclass(frozen=True)
class _OpColumns:
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


def _steady_run(ops: _OpColumns, m: int, starts: tuple[int, ...], period: int,
                shift: int) -> SteadyRun | None:
    """The verified steady run from `starts`: as many rounds as every stage's ops repeat with
    micro-batches + `shift`, every cut is closed under dependencies, and the messages in flight
    at each cut are those at the previous cut one round later (None: fewer than 3 rounds)."""
    firsts = [0]
    for n in ops.lengths:
        firsts.append(firsts[-1] + n)
    rounds = min(_repeating_rounds(ops, firsts[s], firsts[s + 1], a, period, shift)
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


def _repeating_rounds(ops: _OpColumns, lo: int, hi: int, start: int, period: int,
                      shift: int) -> int:
    """Rounds from `start` of the stage whose ops are `lo:hi` in which each op is the op one
    round earlier, micro-batch + shift."""
    full = max(0, (hi - lo - start) // period)
    a, b = lo + start, lo + start + full * period
    unit, mb = ops.unit[a:b], ops.microbatch[a:b]
    bad = np.flatnonzero((unit[period:] != unit[:b - a - period]) |
                         (mb[period:] != mb[:b - a - period] + shift))
    return full if bad.size == 0 else int(bad[0]) // period + 1


def walk_plain(table: OpTable, durs: list[list[float]], sends: list[float],
               start: list[float]) -> list[float]:
    """Stage end times (s) of one replica, op by op: every op as early as its stage and input
    allow (`durs[s][kind index]`, `sends[send index]` in seconds; `start[s]`: stage s's first
    op may not start before). Walks the full table of `table`'s schedule, in Python."""
    table = full_op_table(*table.shape, table.released)
    state = _State(table, durs, sends, start, compiled=False)
    state.advance_checked(table.lengths)
    return state.clock


def walk_early_receive(table: OpTable, durs: list[list[float]], sends: list[float],
                       start: list[float]) -> list[float]:
    """`walk_plain` with each receive posted when the stage's previous op of the same kind (F or
    B) ends, as Megatron-Core's interleaved schedule does with `overlap_p2p_comm`: after a
    forward it starts sending its output and receiving the next forward's input, after a
    backward the same for backwards (`send_forward_recv_forward`, `send_backward_recv_backward`
    in `forward_backward_pipelining_with_interleaving`, megatron/core/pipeline_parallel/
    schedules.py). Where forwards and backwards alternate (the steady phase) that is two ops
    ahead; in the warm-up and cool-down, and for a stage's first op of a kind, it is the
    rendezvous of `walk_plain` (the previous op's end). The transfer of op k's input starts at
    max(sent, post); op k starts at max(end of op k - 1, that + send). Op by op over the full
    table, in Python (no steady-state jump)."""
    table = full_op_table(*table.shape, table.released)
    rows, ready = table.rows, [-1.0] * table.slots
    pos, clock = [0] * len(rows), list(start)
    posted = [[None, None] for _ in rows]  # end of each stage's last forward and backward (s)
    todo = sum(len(row) for row in rows)
    while todo:
        progressed = False
        for s, row in enumerate(rows):
            k, t, dur, kinds, last = pos[s], clock[s], durs[s], table.kinds[s], posted[s]
            while k < len(row):
                dk, need, sk, out = row[k]
                backward = kinds[dk][1]
                if need >= 0:
                    sent = ready[need]
                    if sent < 0.0:
                        break
                    post = t if last[backward] is None else last[backward]
                    t = max(t, max(sent, post) + sends[sk])
                t += dur[dk]
                if out >= 0:
                    ready[out] = t
                last[backward] = t
                k += 1
            if k != pos[s]:
                todo -= k - pos[s]
                pos[s], clock[s] = k, t
                progressed = True
        assert progressed, "schedule deadlock"
    return clock


def walk(table: OpTable, durs: list[list[float]], sends: list[float],
         start: list[float]) -> list[float]:
    """`walk_plain`'s result, jumping over the repeating rounds of the steady run (and the
    rounds a shortened table left out; when its state never repeats, the full table is walked).
    Its ops run in C when the extension was built (`_walk_kernel`), else in Python: the same
    sums and maxima in the same order, so the same result bit for bit."""
    state = _State(table, durs, sends, start, compiled=_walk_kernel is not None)
    run = table.run
    if run is not None:
        state.advance(run.cut(0))
        if not _through_run(state, table, run) and run.extra:
            return walk(full_op_table(*table.shape, table.released), durs, sends, start)
    state.advance(table.lengths)
    return list(state.clock)


class _State:
    """Where a walk of `table` with op times `durs` and send times `sends` (s) is: each stage's
    next op and clock (s), and when each message was sent (s; -1: not yet). `compiled`: the
    ops run in C (`_walk_kernel`; positions, clocks and messages are then arrays)."""

    def __init__(self, table: OpTable, durs, sends, start: list[float], compiled: bool):
        self.table, self.durs, self.sends, self.compiled = table, durs, sends, compiled
        # Two sentinel slots after the table's: "no input" (-2: never later than a clock) and
        # the output of ops that send nothing (-1: written, never read by a real op).
        if compiled:
            kinds = {len(k) for k in table.kinds}
            assert len(kinds) == 1, "every stage has the same kinds of op"
            self.kinds = kinds.pop()
            self.pos, self.clock = array("q", bytes(8 * len(start))), array("d", start)
            self.ready = array("d", [-1.0]) * table.slots + array("d", [-math.inf, 0.0])
            self.cdurs, self.csends = array("d", [t for row in durs for t in row]), array("d", sends)
        else:
            self.pos, self.clock = [0] * len(start), list(start)
            self.ready = [-1.0] * table.slots + [-math.inf, 0.0]

    def advance(self, limits: list[int]) -> None:
        """`advance_checked`'s result. Compiled: the same walk in C. In Python, a table's first
        walk through a segment records the runs its checked walk takes (each stage's ops between
        two waits for an input), later ones replay them (`_program`): no readiness checks, and
        ops without an input or a send read and write sentinel slots."""
        table = self.table
        if self.compiled:
            rows, firsts = table.flat
            _walk_kernel.advance(rows, firsts, self.cdurs, self.kinds, self.csends, self.pos,
                                 array("q", limits), self.clock, self.ready)
            return
        key = (tuple(self.pos), tuple(limits))
        runs = _program(table, key)
        if runs is None:
            record: list[tuple[int, int, int]] = []
            self.advance_checked(limits, record)
            if len(table.programs) >= 256:  # a table's walks take a few dozen segments
                table.programs.clear()
            table.programs[key] = record  # kept once the segment was walked through
            return
        clock, ready, durs = self.clock, self.ready, self.durs
        sends = [*self.sends, 0.0]  # the sentinel send (-1)
        for s, ops in runs:
            t, dur = clock[s], durs[s]
            for dk, need, sk, out in ops:
                sent = ready[need]
                # Rendezvous: the transfer starts once sent and the receive is posted.
                t = (sent if sent > t else t) + sends[sk] + dur[dk]
                ready[out] = t
            clock[s] = t
        self.pos = list(limits)

    def advance_checked(self, limits: list[int], record: list | None = None) -> None:
        """Run every stage s up to op index `limits[s]` (the ops before the limits must depend
        only on each other), op by op, checking each input has arrived (`walk_plain`); appends
        each run (stage, first op, end) to `record`."""
        rows, pos, clock, ready = self.table.rows, self.pos, self.clock, self.ready
        durs, sends = self.durs, self.sends
        todo = sum(n - k for n, k in zip(limits, pos, strict=True))
        stages = range(len(rows))
        while todo:
            progressed = False
            for s in stages:
                k, n = pos[s], limits[s]
                if k == n:
                    continue
                row, t, dur = rows[s], clock[s], durs[s]
                while k < n:
                    dk, need, sk, out = row[k]
                    if need >= 0:
                        sent = ready[need]
                        if sent < 0.0:
                            break
                        # Rendezvous: the transfer starts once sent and the receive is posted.
                        t = (sent if sent > t else t) + sends[sk]
                    t += dur[dk]
                    if out >= 0:
                        ready[out] = t
                    k += 1
                if k != pos[s]:
                    if record is not None:
                        record.append((s, pos[s], k))
                    todo -= k - pos[s]
                    pos[s], clock[s] = k, t
                    progressed = True
            assert progressed, "schedule deadlock"

    def vector(self, outstanding: tuple[int, ...]) -> list[float]:
        """The state at a cut: clocks, messages in flight (s)."""
        ready = self.ready
        return [*self.clock, *[ready[i] for i in outstanding]]


def _through_run(state: _State, table: OpTable, run: SteadyRun) -> bool:
    """Walk the run's rounds from cut 0 until the state repeats up to a constant, then move the
    state to the schedule's last steady cut at once (see module docstring). False: it never
    repeated (the state is then at the run's last cut)."""
    history = [state.vector(run.outstanding[0])]
    cycles = _MAX_CYCLE * len(table.kinds)
    rounds = run.rounds + run.extra  # of the full schedule
    for r in range(1, run.rounds + 1):
        state.advance(run.cut(r))
        now = state.vector(run.outstanding[r])
        history.append(now)
        first, last = now[0], now[-1]
        for c in range(1, min(r, cycles, run.rounds - r) + 1):
            before = history[r - c]
            # Cheap rejection on two components before comparing them all.
            if abs((first - before[0]) - (last - before[-1])) > _NOISE_ULPS * math.ulp(first):
                continue
            step = _constant_step(before, now)
            if step is not None:
                steps = (rounds - r) // c
                # The full schedule's cut r + steps c is this table's cut r + steps c - extra.
                _jump(state, run, r, r + steps * c - run.extra, steps * step)
                return True
    return False


def _constant_step(before: list[float], now: list[float]) -> float | None:
    """The one increment (s) from `before` to `now`, or None when they differ by more than
    rounding."""
    tol = _NOISE_ULPS * math.ulp(max(now))
    steps = [b - a for a, b in zip(before, now, strict=True)]
    first = steps[0]
    if max(steps) - first > tol or first - min(steps) > tol:
        return None
    total = 0.0
    for d in steps:
        total += d
    return total / len(now)


def _jump(state: _State, run: SteadyRun, r: int, to: int, add: float) -> None:
    """Move the state from cut r to cut `to`: every clock and message in flight + `add`."""
    ready, clock, pos = state.ready, state.clock, state.pos
    for s, t in enumerate(clock):
        clock[s] = t + add
    moved = [ready[a] + add for a in run.outstanding[r]]
    for b, t in zip(run.outstanding[to], moved, strict=True):
        ready[b] = t
    for s, k in enumerate(run.cut(to)):
        pos[s] = k


def _program(table: OpTable, key: tuple):
    """The runs (stage, ops) a segment's checked walk took (`_State.advance`), each op as
    (kind index, input slot, the input's send index, output slot) with `_State`'s sentinel
    slots (-2: no input, -1: no send) and sentinel send (-1); None before the segment was
    walked once. The order depends on the table only: each run's inputs were written by
    earlier runs."""
    got = table.programs.get(key)
    if got is None or isinstance(got, tuple):
        return got
    fast = table.fast
    got = table.programs[key] = tuple((s, fast[s][a:b]) for s, a, b in got)
    return got
