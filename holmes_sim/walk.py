"""The analytic estimate's critical-path walk over a pipeline schedule, and its steady-state jump.

The walk evaluates one replica's schedule as a max-plus recurrence: an op starts when the
previous op of its stage ended and its input arrived; a send starts when its op ended and the
previous send on the same (physical) stage pair arrived. `walk_plain` does that op by op.

`walk` gives the same stage end times without walking every micro-batch. In the steady part of
1F1B and interleaved schedules (one forward, one backward) the op rows repeat: round r + 1 of
stage s is round r with every micro-batch shifted by M (1, or p for interleaved), so the map from
the state at one round boundary (each stage's clock, each send queue, the messages in flight) to
the next is the same max-plus map F for every round. F is homogeneous (F(x + a) = F(x) + a), so
once the state after round r equals the state after round r - c plus one constant a (c: the
cyclicity of the recurrence; Baccelli et al., "Synchronization and Linearity", 1992, ch. 3),
every later c rounds add a again: the walk adds it (R - r) / c times at once (R: the run's last
round) and walks on from there. Cycles c up to 2p are tried (1F1B on 16 stages: c = 4 seen).
Which rounds repeat is checked from the op rows themselves (`SteadyRun`), not assumed.

The constant is measured in floating point, so a jump differs from the op-by-op walk by
rounding only (tests hold it to 1e-12 relative).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from holmes_sim.schedule import ScheduleKind, build_schedule

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
    `starts[s] + r * period`, for r = 0..rounds; round r + 1 is round r with micro-batches + M.
    `outstanding[r]` lists the message slots written before cut r and read after it, in the
    order of their readers (stage, then position after the cut), so entry i of cut r and
    entry i of cut r + 1 are the same message one round later."""

    starts: tuple[int, ...]
    period: int
    rounds: int
    outstanding: tuple[tuple[int, ...], ...]

    def cut(self, r: int) -> list[int]:
        return [a + r * self.period for a in self.starts]


@dataclass(frozen=True, slots=True)
class OpTable:
    """A schedule as the walk reads it. `rows[s]` holds stage s's ops in order as
    (kind index, input slot, send index, queue slot, output slot), -1 for none; `kinds[s]` lists
    the distinct (virtual stage, backward) ops of stage s, `sends` the distinct (from, to)
    virtual-stage sends; a queue slot holds the last arrival on a physical stage pair."""

    rows: tuple[tuple[tuple, ...], ...]
    kinds: tuple[tuple[tuple[int, bool], ...], ...]
    sends: tuple[tuple[int, int], ...]
    slots: int
    """Size of the walk's arrival list (messages, then queues, by first use)."""
    queues: tuple[int, ...]
    """Slots that are send queues (start free at 0 s)."""
    runs: tuple[SteadyRun, ...] = ()
    """Steady runs in op order (none: the walk goes op by op)."""


@lru_cache(maxsize=256)
def op_table(kind: str, pp: int, m: int, v: int) -> OpTable:
    """The dependency structure of schedule (kind, p, m, v), with its steady runs."""
    schedule = build_schedule(kind, pp, m, v)
    nv = schedule.num_virtual_stages
    send_index: dict[tuple[int, int], int] = {}
    slots: dict[tuple, int] = {}  # message and queue keys -> slot in the walk's arrival list
    rows, kinds = [], []
    for s, ops in enumerate(schedule.stage_ops):
        kind_index: dict[tuple[int, bool], int] = {}
        row = []
        for op in ops:
            j = schedule.virtual_stage(s, op.chunk)
            backward = op.kind == "B"
            first_input = (op.kind == "F" and j == 0) or (backward and j == nv - 1)
            need = -1 if first_input else slots.setdefault((op.kind, j, op.microbatch), len(slots))
            to = (j - 1 if j > 0 else None) if backward else (j + 1 if j < nv - 1 else None)
            if to is None:
                sk = queue = out = -1
            else:
                sk = send_index.setdefault((j, to), len(send_index))
                queue = slots.setdefault(("queue", j % pp, to % pp), len(slots))
                out = slots.setdefault((op.kind, to, op.microbatch), len(slots))
            dk = kind_index.setdefault((j, backward), len(kind_index))
            row.append((dk, need, sk, queue, out))
        rows.append(tuple(row))
        kinds.append(tuple(kind_index))
    queues = tuple(i for key, i in slots.items() if key[0] == "queue")
    runs = tuple(r for r in (_steady_run(schedule.stage_ops, rows, slots, a, period, shift)
                             for a, period, shift in _steady_shapes(kind, pp, m, v)) if r is not None)
    return OpTable(tuple(rows), tuple(kinds), tuple(send_index), len(slots), queues, runs)


def _steady_shapes(kind: str, p: int, m: int, v: int) -> list[tuple[tuple[int, ...], int, int]]:
    """Where each steady phase starts per stage, ops per round, and micro-batches per round
    (the schedules' definitions in `schedule.py`; `_steady_run` checks them)."""
    kind = ScheduleKind(kind)
    if kind is ScheduleKind.GPIPE:
        # Its phases feed one way (no backward between forwards), so stages of different speeds
        # drift apart at their own rates and the state never repeats up to one constant.
        return []
    if kind is ScheduleKind.ONE_F_ONE_B:
        return [(tuple(min(p - s - 1, m) for s in range(p)), 2, 1)]
    return [(tuple(min((p - s - 1) * 2 + (v - 1) * p, m * v) for s in range(p)), 2 * p * v, p)]


def _steady_run(stage_ops, rows, slots: dict, starts: tuple[int, ...], period: int,
                shift: int) -> SteadyRun | None:
    """The verified steady run from `starts`: as many rounds as every stage's ops repeat with
    micro-batches + `shift`, every cut is closed under dependencies, and the messages in flight
    at each cut are those at the previous cut one round later (None: fewer than 3 rounds)."""
    rounds = min(_repeating_rounds(ops, a, period, shift) for ops, a in zip(stage_ops, starts, strict=True))
    if rounds < 3:
        return None
    writer, reader = _slot_positions(rows)
    key_of = {i: key for key, i in slots.items()}
    # A slot is inside cut r from the first round whose cut passes its writer (reader).
    def first_cut(pos):
        s, k = pos
        return max(0, (k - starts[s]) // period + 1)
    outstanding: list[list[tuple[int, int, int]]] = [[] for _ in range(rounds + 1)]
    for i, w in writer.items():
        if i not in reader:
            continue
        rw, rr = first_cut(w), first_cut(reader[i])
        if rr < rw:  # cuts rr..rw-1 hold the reader but not the writer: not closed
            rounds = min(rounds, rr - 1)
        s, k = reader[i]
        for r in range(rw, min(rr, rounds + 1)):
            outstanding[r].append((s, k - starts[s] - r * period, i))
    lists = [tuple(i for *_, i in sorted(o)) for o in outstanding[:rounds + 1]]
    for r in range(rounds):
        if not _shifted(lists[r], lists[r + 1], key_of, slots, shift):
            rounds = r
            break
    if rounds < 3:
        return None
    return SteadyRun(starts, period, rounds, tuple(lists[:rounds + 1]))


def _repeating_rounds(ops, start: int, period: int, shift: int) -> int:
    """Rounds from `start` in which each op is the op one round earlier, micro-batch + shift."""
    r = 0
    while start + (r + 1) * period <= len(ops):
        if r > 0:
            for k in range(start + r * period, start + (r + 1) * period):
                a, b = ops[k - period], ops[k]
                if (a.kind, a.chunk, a.microbatch + shift) != (b.kind, b.chunk, b.microbatch):
                    return r
        r += 1
    return r


def _slot_positions(rows) -> tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
    """(stage, op index) that writes and that reads each message slot."""
    writer: dict[int, tuple[int, int]] = {}
    reader: dict[int, tuple[int, int]] = {}
    for s, row in enumerate(rows):
        for k, (_, need, _, _, out) in enumerate(row):
            if need >= 0:
                reader[need] = (s, k)
            if out >= 0:
                writer[out] = (s, k)
    return writer, reader


def _shifted(before: tuple[int, ...], after: tuple[int, ...], key_of: dict, slots: dict,
             shift: int) -> bool:
    """Whether `after` is `before` with each message's micro-batch + shift."""
    if len(before) != len(after):
        return False
    for a, b in zip(before, after, strict=True):
        kind, j, mb = key_of[a]
        if slots.get((kind, j, mb + shift)) != b:
            return False
    return True


def walk_plain(table: OpTable, durs: list[list[float]], sends: list[float],
               start: list[float]) -> list[float]:
    """Stage end times (s) of one replica, op by op: every op as early as its stage and input
    allow (`durs[s][kind index]`, `sends[send index]` in seconds; `start[s]`: stage s's first
    op may not start before)."""
    state = _State(table, start)
    state.advance(table, durs, sends, [len(row) for row in table.rows])
    return state.clock


def walk(table: OpTable, durs: list[list[float]], sends: list[float],
         start: list[float]) -> list[float]:
    """`walk_plain`'s result, jumping over the repeating rounds of each steady run."""
    state = _State(table, start)
    for run in table.runs:
        state.advance(table, durs, sends, run.cut(0))
        _through_run(state, table, durs, sends, run)
    state.advance(table, durs, sends, [len(row) for row in table.rows])
    return state.clock


class _State:
    """Where a walk is: each stage's next op and clock (s), and the arrival list (s; -1: not
    yet sent)."""

    def __init__(self, table: OpTable, start: list[float]):
        self.pos = [0] * len(table.rows)
        self.clock = list(start)
        self.ready = [-1.0] * table.slots
        for q in table.queues:
            self.ready[q] = 0.0

    def advance(self, table: OpTable, durs, sends, limits: list[int]) -> None:
        """Run every stage s up to op index `limits[s]` (the ops before the limits must depend
        only on each other)."""
        rows, pos, clock, ready = table.rows, self.pos, self.clock, self.ready
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
                    dk, need, sk, queue, out = row[k]
                    if need >= 0:
                        arrived = ready[need]
                        if arrived < 0.0:
                            break
                        if arrived > t:
                            t = arrived
                    t += dur[dk]
                    if sk >= 0:
                        free = ready[queue]
                        arrival = (t if t > free else free) + sends[sk]
                        ready[queue] = ready[out] = arrival
                    k += 1
                if k != pos[s]:
                    todo -= k - pos[s]
                    pos[s], clock[s] = k, t
                    progressed = True
            assert progressed, "schedule deadlock"

    def vector(self, table: OpTable, outstanding: tuple[int, ...]) -> list[float]:
        """The state at a cut: clocks, send queues, messages in flight (s)."""
        ready = self.ready
        return self.clock + [ready[q] for q in table.queues] + [ready[i] for i in outstanding]


def _through_run(state: _State, table: OpTable, durs, sends, run: SteadyRun) -> None:
    """Walk the run's rounds from cut 0 until the state repeats up to a constant, then move the
    state to the run's last cut at once (see module docstring)."""
    history = [state.vector(table, run.outstanding[0])]
    cycles = _MAX_CYCLE * len(table.rows)
    for r in range(1, run.rounds + 1):
        state.advance(table, durs, sends, run.cut(r))
        now = state.vector(table, run.outstanding[r])
        history.append(now)
        first, last = now[0], now[-1]
        for c in range(1, min(r, cycles, run.rounds - r) + 1):
            before = history[r - c]
            # Cheap rejection on two components before comparing them all.
            if abs((first - before[0]) - (last - before[-1])) > _NOISE_ULPS * math.ulp(first):
                continue
            step = _constant_step(before, now)
            if step is not None:
                steps = (run.rounds - r) // c
                _jump(state, table, run, r, r + steps * c, steps * step)
                return


def _constant_step(before: list[float], now: list[float]) -> float | None:
    """The one increment (s) from `before` to `now`, or None when they differ by more than
    rounding."""
    tol = _NOISE_ULPS * math.ulp(max(now))
    first = now[0] - before[0]
    total = 0.0
    for a, b in zip(before, now, strict=True):
        d = b - a
        if abs(d - first) > tol:
            return None
        total += d
    return total / len(now)


def _jump(state: _State, table: OpTable, run: SteadyRun, r: int, to: int, add: float) -> None:
    """Move the state from cut r to cut `to`: every clock, queue and message in flight + `add`."""
    ready = state.ready
    state.clock = [t + add for t in state.clock]
    for q in table.queues:
        ready[q] += add
    moved = [ready[a] + add for a in run.outstanding[r]]
    for b, t in zip(run.outstanding[to], moved, strict=True):
        ready[b] = t
    state.pos = run.cut(to)
