"""The analytic estimate's critical-path walk over a pipeline schedule, and its steady-state jump.

The walk evaluates one replica's schedule as a max-plus recurrence: an op starts when the
previous op of its stage ended and its input arrived. A transfer is a rendezvous, as NCCL's and
gloo's point-to-point operations are: it starts when its op has ended on the sending stage and
the receiving stage has posted the receive (reached the op that consumes it, i.e. ended its
previous op), and takes its idle-path time. A stage posts one receive at a time, so transfers
to one stage never overlap. An op may also have a floor: it starts no earlier than that, once its
input arrived (the first forward of a chunk waiting for its parameter all-gathers; its later
forwards start after the first ended, so their floor never binds). `walk_plain` does that op
by op.

`walk` gives the same stage end times without walking every micro-batch. In the steady part of
1F1B and interleaved schedules (one forward, one backward) the op rows repeat: round r + 1 of
stage s is round r with every micro-batch shifted by M (1, or p for interleaved), so the map from
the state at one round boundary (each stage's clock, the messages in flight) to the next is the
same max-plus map F for every round. F is homogeneous (F(x + a) = F(x) + a) in the rounds
after every floor that can bind (`_settled`), so once the state after round r equals the
state after round r - c plus one constant a (c: the cyclicity of the recurrence; Baccelli et
al., "Synchronization and Linearity", 1992, ch. 3),
every later c rounds add a again: the walk adds it (R - r) / c times at once (R: the run's last
round) and walks on from there. Cycles c up to 2p are tried (1F1B on 16 stages: c = 4 seen).
Which rounds repeat is checked from the op rows themselves, not assumed (`steady_run.py`;
the schedule's ops as a table: `op_table.py`).

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

from holmes_sim.estimate.op_table import OpTable, full_op_table
from holmes_sim.estimate.steady_run import SteadyRun
from holmes_sim.version import extension

WALK_KERNEL_ABI = 1
"""The interface version of `_walk_kernel.c` (its `ABI`) that `_State` calls: bump both when
`advance`'s arguments or results change."""
# the walk in C (`_walk_kernel.c`, an optional extension): the same sums bit for bit; None
# where it was not built or was built with another interface: the walk in Python
_walk_kernel = extension("holmes_sim.estimate._walk_kernel", WALK_KERNEL_ABI)

_MAX_CYCLE = 2
"""Cyclicities tried per pipeline stage: the state after round r is compared with the states
after rounds r - 1 ... r - 2p."""
_NOISE_ULPS = 64
"""The state's components' increments may differ from the first one's by this many units in the
last place of the largest time (rounding in a round's chain of additions) and still count as
one constant."""


Floors = list[list[float]] | None
"""Per stage, per kind index: the time (s) before which an op of that kind may not start (-inf:
none), or None for no floors."""


def walk_plain(table: OpTable, durs: list[list[float]], sends: list[float],
               start: list[float], floors: Floors = None) -> list[float]:
    """Stage end times (s) of one replica, op by op: every op as early as its stage, input and
    floor allow (`durs[s][kind index]`, `sends[send index]` in seconds; `start[s]`: stage s's
    clock before its first op). Walks the full table of `table`'s schedule, in Python."""
    return plain_walked(table, durs, sends, start, floors).clock


def plain_walked(table: OpTable, durs: list[list[float]], sends: list[float],
                 start: list[float], floors: Floors = None) -> _State:
    """`walk_plain`'s final state (the full table, its clocks and message times)."""
    table = full_op_table(*table.shape, table.released)
    state = _State(table, durs, sends, start, compiled=False, floors=floors)
    state.advance_checked(table.lengths)
    return state


def released_ends(table: OpTable, clock, ready) -> list[tuple[float, ...]]:
    """End (s) of each stage's releasing backwards (`OpTable.released_outputs`), chunk by chunk,
    from a walk's clocks and message times: the message each sends, or the stage's clock for
    the one that sends none (the stage's last op)."""
    return [tuple(clock[s] if out < 0 else ready[out] for out in outs)
            for s, outs in enumerate(table.released_outputs)]


def walk_early_receive(table: OpTable, durs: list[list[float]], sends: list[float],
                       start: list[float], floors: Floors = None) -> list[float]:
    """`walk_plain` with each receive posted when the stage's previous op of the same kind (F or
    B) ends, as Megatron-Core's interleaved schedule does with `overlap_p2p_comm`: after a
    forward it starts sending its output and receiving the next forward's input, after a
    backward the same for backwards (`send_forward_recv_forward`, `send_backward_recv_backward`
    in `forward_backward_pipelining_with_interleaving`, megatron/core/pipeline_parallel/
    schedules.py). Where forwards and backwards alternate (the steady phase) that is two ops
    ahead; in the warm-up and cool-down, and for a stage's first op of a kind, it is the
    rendezvous of `walk_plain` (the previous op's end). The transfer of op k's input starts at
    max(sent, post); op k starts at max(end of op k - 1, that + send, its floor). Op by op over
    the full table, in Python (no steady-state jump)."""
    return early_receive_walk(table, durs, sends, start, floors)[0]


def early_receive_walk(table: OpTable, durs: list[list[float]], sends: list[float],
                       start: list[float], floors: Floors = None
                       ) -> tuple[list[float], list[float], OpTable]:
    """`walk_early_receive`'s clocks, its message times and the full table it walked."""
    table = full_op_table(*table.shape, table.released)
    rows, ready = table.rows, [-1.0] * table.slots
    pos, clock = [0] * len(rows), list(start)
    posted = [[None, None] for _ in rows]  # end of each stage's last forward and backward (s)
    todo = sum(len(row) for row in rows)
    while todo:
        progressed = False
        for s, row in enumerate(rows):
            k, t, dur, kinds, last = pos[s], clock[s], durs[s], table.kinds[s], posted[s]
            floor = floors[s] if floors is not None else None
            while k < len(row):
                dk, need, sk, out = row[k]
                backward = kinds[dk][1]
                if need >= 0:
                    sent = ready[need]
                    if sent < 0.0:
                        break
                    post = t if last[backward] is None else last[backward]
                    t = max(t, max(sent, post) + sends[sk])
                if floor is not None and floor[dk] > t:
                    t = floor[dk]
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
    return clock, ready, table


def walk(table: OpTable, durs: list[list[float]], sends: list[float],
         start: list[float], floors: Floors = None) -> list[float]:
    """`walk_plain`'s result, jumping over the repeating rounds of the steady run (and the
    rounds a shortened table left out; when its state never repeats, the full table is walked).
    Its ops run in C when the extension was built (`_walk_kernel`), else in Python: the same
    sums and maxima in the same order, so the same result bit for bit."""
    return list(walked(table, durs, sends, start, floors).clock)


def walked(table: OpTable, durs: list[list[float]], sends: list[float],
           start: list[float], floors: Floors = None) -> _State:
    """`walk`'s final state (its `table`, clocks and message times)."""
    state = _State(table, durs, sends, start, compiled=_walk_kernel is not None, floors=floors)
    run = table.run
    if run is not None:
        state.advance(run.cut(0))
        if not _through_run(state, table, run) and run.extra:
            return walked(full_op_table(*table.shape, table.released), durs, sends, start, floors)
    state.advance(table.lengths)
    return state


class _State:
    """Where a walk of `table` with op times `durs` and send times `sends` (s) is: each stage's
    next op and clock (s), and when each message was sent (s; -1: not yet). `compiled`: the
    ops run in C (`_walk_kernel`; positions, clocks and messages are then arrays). `floors`:
    see `Floors`."""

    def __init__(self, table: OpTable, durs, sends, start: list[float], compiled: bool,
                 floors: Floors = None):
        self.table, self.durs, self.sends, self.compiled = table, durs, sends, compiled
        self.floors = floors
        # Two sentinel slots after the table's: "no input" (-2: never later than a clock) and
        # the output of ops that send nothing (-1: written, never read by a real op).
        if compiled:
            kinds = {len(k) for k in table.kinds}
            assert len(kinds) == 1, "every stage has the same kinds of op"
            self.kinds = kinds.pop()
            self.pos, self.clock = array("q", bytes(8 * len(start))), array("d", start)
            self.ready = array("d", [-1.0]) * table.slots + array("d", [-math.inf, 0.0])
            self.cdurs, self.csends = array("d", [t for row in durs for t in row]), array("d", sends)
            self.cfloors = None if floors is None else array("d", [t for row in floors for t in row])
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
                                 array("q", limits), self.clock, self.ready, self.cfloors)
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
        if self.floors is not None:
            self._replay_floored(runs)
            self.pos = list(limits)
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

    def _replay_floored(self, runs) -> None:
        """`advance`'s replay of recorded runs, each op no earlier than its floor."""
        clock, ready, durs, floors = self.clock, self.ready, self.durs, self.floors
        sends = [*self.sends, 0.0]  # the sentinel send (-1)
        for s, ops in runs:
            t, dur, floor = clock[s], durs[s], floors[s]
            for dk, need, sk, out in ops:
                sent = ready[need]
                t = (sent if sent > t else t) + sends[sk]
                if floor[dk] > t:
                    t = floor[dk]
                t += dur[dk]
                ready[out] = t
            clock[s] = t

    def advance_checked(self, limits: list[int], record: list | None = None) -> None:
        """Run every stage s up to op index `limits[s]` (the ops before the limits must depend
        only on each other), op by op, checking each input has arrived (`walk_plain`); appends
        each run (stage, first op, end) to `record`."""
        rows, pos, clock, ready = self.table.rows, self.pos, self.clock, self.ready
        durs, sends, floors = self.durs, self.sends, self.floors
        todo = sum(n - k for n, k in zip(limits, pos, strict=True))
        stages = range(len(rows))
        while todo:
            progressed = False
            for s in stages:
                k, n = pos[s], limits[s]
                if k == n:
                    continue
                row, t, dur = rows[s], clock[s], durs[s]
                floor = None if floors is None else floors[s]
                while k < n:
                    dk, need, sk, out = row[k]
                    if need >= 0:
                        sent = ready[need]
                        if sent < 0.0:
                            break
                        # Rendezvous: the transfer starts once sent and the receive is posted.
                        t = (sent if sent > t else t) + sends[sk]
                    if floor is not None and floor[dk] > t:
                        t = floor[dk]
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
    settled = 0 if state.floors is None else _settled(table, run, state.floors)
    for r in range(1, run.rounds + 1):
        state.advance(run.cut(r))
        now = state.vector(run.outstanding[r])
        history.append(now)
        first, last = now[0], now[-1]
        for c in range(1, min(r - settled, cycles, run.rounds - r) + 1):
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


def _settled(table: OpTable, run: SteadyRun, floors: list[list[float]]) -> int:
    """The first cut of `run` after every stage's first op of each kind with a floor: later
    ops of those kinds start after the first ended, past the floor, so the rounds from this
    cut on are the homogeneous map (module docstring)."""
    firsts = table.first_of_kind
    return max((max(0, (firsts[s][k] - a) // run.period + 1)
                for s, a in enumerate(run.starts) for k, f in enumerate(floors[s])
                if f > -math.inf and firsts[s][k] >= 0), default=0)


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
