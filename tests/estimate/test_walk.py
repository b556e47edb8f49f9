"""The estimate's walk with its steady-state jump against the plain op-by-op walk."""

from __future__ import annotations

import math
import random

import pytest

from holmes_sim.estimate import analytic, bucket_streams
from holmes_sim.search import planner
from holmes_sim.estimate import op_table as op_table_module
from holmes_sim.estimate import walk as walk_module
from holmes_sim.bundled import bundled_scenario
from holmes_sim.errors import HolmesError
from holmes_sim.prepare import prepare
from holmes_sim.estimate.op_table import full_op_table, op_table
from holmes_sim.estimate.walk import walk, walk_plain

REL = 1e-12


@pytest.fixture(params=["compiled", "python"])
def kernel(request, monkeypatch):
    """`walk` with its ops in C (`_walk_kernel`), and in Python."""
    if request.param == "python":
        monkeypatch.setattr(walk_module, "_walk_kernel", None)
    elif walk_module._walk_kernel is None:
        pytest.skip("the C walk was not built")
    return request.param


def _close(a: list[float], b: list[float]) -> bool:
    scale = max(max(a), 1e-30)
    return all(abs(x - y) <= REL * scale for x, y in zip(a, b, strict=True))


def _random_case(rng: random.Random, released: bool = False):
    kind = rng.choice(["gpipe", "1f1b", "1f1b", "interleaved", "interleaved"])
    p = rng.choice([1, 2, 3, 4, 6, 8, 16])
    v = rng.choice([2, 3, 4]) if kind == "interleaved" and p > 1 else 1
    kind = "1f1b" if kind == "interleaved" and p == 1 else kind
    m = rng.choice([1, 2, 3, 5, 8, 16, 32, 64, 128, 192, 512])
    if kind == "interleaved":
        m = max(1, m // p) * p
    table = op_table(kind, p, m, v, released)
    base = [rng.uniform(1e-3, 5e-2) for _ in range(4)]
    spread = rng.choice([0.0, 0.0, 1e-9, 0.05, 0.5])  # equal stages, nearly equal, uneven
    durs = [[base[2 * (j // p % 2) + b] * (1 + spread * rng.random()) for j, b in kinds]
            for kinds in table.kinds]
    sends = [rng.choice([0.0, rng.uniform(1e-6, 3e-2)]) for _ in table.sends]
    start = [rng.uniform(0.0, 2e-2) if rng.random() < 0.3 else 0.0 for _ in range(p)]
    return table, durs, sends, start


def test_walk_equals_plain_walk_on_random_schedules(kernel):
    rng = random.Random(11)
    jumped = 0
    for _ in range(400):
        table, durs, sends, start = _random_case(rng)
        first, plain = walk(table, durs, sends, start), walk_plain(table, durs, sends, start)
        fast = walk(table, durs, sends, start)  # replays the segments the first walk recorded
        assert first == fast
        assert _close(plain, fast), (table.rows and len(table.rows), plain, fast)
        jumped += fast != plain
    assert jumped >= 50  # the jump was taken (it changes the last bits) in many cases


def test_released_tables_walk_like_the_plain_walk(kernel):
    """Tables whose last backward of each chunk is a kind of its own (`full_op_table`'s
    released kinds, their steady run the plain table's first rounds) walk as op by op, those
    backwards longer."""
    rng = random.Random(5)
    for _ in range(200):
        table, durs, sends, start = _random_case(rng, released=True)
        nc = table.shape[3]
        durs = [[t * (1.5 if k >= 2 * nc else 1.0) for k, t in enumerate(row)] for row in durs]
        assert table.released and all(len(kinds) == 3 * nc for kinds in table.kinds)
        assert _close(walk_plain(table, durs, sends, start), walk(table, durs, sends, start))


def test_walk_without_jumps_equals_the_checked_walk_bit_for_bit(monkeypatch, kernel):
    """Without jumps, `walk` runs every op, in C or from its recorded segments in Python (no
    readiness checks, sentinel slots): the very same additions and maxima as `walk_plain`'s
    checked walk."""
    monkeypatch.setattr(walk_module, "_NOISE_ULPS", -1)  # no two states count as repeating
    rng = random.Random(12)
    for _ in range(150):
        table, durs, sends, start = _random_case(rng)
        plain = walk_plain(table, durs, sends, start)
        assert walk(table, durs, sends, start) == plain  # records the segments' runs
        assert walk(table, durs, sends, start) == plain  # replays them


def test_compiled_and_python_walks_are_identical_with_jumps(monkeypatch):
    """The C walk and the Python walk take the same jumps from the same states: equal bit for
    bit on random schedules (1F1B, interleaved, GPipe; equal and uneven stages)."""
    if walk_module._walk_kernel is None:
        pytest.skip("the C walk was not built")
    rng = random.Random(14)
    for _ in range(300):
        table, durs, sends, start = _random_case(rng)
        compiled = walk(table, durs, sends, start)
        with monkeypatch.context() as m:
            m.setattr(walk_module, "_walk_kernel", None)
            assert walk(table, durs, sends, start) == compiled  # records, then replays
            assert walk(table, durs, sends, start) == compiled


def test_compiled_walk_refuses_bad_arrays():
    from array import array

    k = walk_module._walk_kernel
    if k is None:
        pytest.skip("the C walk was not built")
    table = full_op_table("1f1b", 2, 4, 1)
    rows, firsts = table.flat
    durs, sends = array("d", [1.0, 2.0] * 2), array("d", [0.5] * len(table.sends))

    def state():
        return array("q", [0, 0]), array("d", [0.0, 0.0]), \
            array("d", [-1.0]) * table.slots + array("d", [-math.inf, 0.0])

    pos, clock, ready = state()
    k.advance(rows, firsts, durs, 2, sends, pos, array("q", [8, 8]), clock, ready)
    assert list(pos) == [8, 8] and list(clock) == walk_plain(table, [[1.0, 2.0]] * 2,
                                                             list(sends), [0.0, 0.0])
    with pytest.raises(TypeError):  # limits as doubles
        k.advance(rows, firsts, durs, 2, sends, *state()[:1], array("d", [8, 8]), *state()[1:])
    with pytest.raises(ValueError):  # past the end of a stage
        k.advance(rows, firsts, durs, 2, sends, *state()[:1], array("q", [9, 8]), *state()[1:])
    with pytest.raises(ValueError):  # fewer op times than kinds
        k.advance(rows, firsts, array("d", [1.0]), 2, sends, *state()[:1], array("q", [8, 8]),
                  *state()[1:])
    with pytest.raises(ValueError, match="floors and durations differ"):  # a floor short
        k.advance(rows, firsts, durs, 2, sends, *state()[:1], array("q", [8, 8]), *state()[1:],
                  array("d", [0.0] * 3))
    with pytest.raises(TypeError, match="floors"):  # floors as integers
        k.advance(rows, firsts, durs, 2, sends, *state()[:1], array("q", [8, 8]), *state()[1:],
                  array("q", [0] * 4))
    with pytest.raises(RuntimeError, match="deadlock"):  # stage 1 waits for a message never sent
        pos, clock, ready = state()
        k.advance(rows, firsts, durs, 2, sends, pos, array("q", [0, 8]), clock, ready)


def test_steady_runs_cover_the_one_forward_one_backward_phase():
    run = op_table("1f1b", 4, 32, 1).run
    assert run.starts == (3, 2, 1, 0) and run.period == 2 and run.rounds == 29 and run.extra == 0
    run = op_table("interleaved", 4, 32, 2).run
    assert run.period == 16 and run.rounds >= 6
    assert op_table("gpipe", 4, 32, 1).run is None
    assert op_table("1f1b", 4, 3, 1).run is None  # no steady phase


def test_long_schedules_keep_a_short_table(kernel):
    """A 1F1B table of 2,048 micro-batches keeps 6p + 24 steady rounds and leaves the rest to
    the jump; its walk equals the full table's."""
    table = op_table("1f1b", 4, 2048, 1)
    assert table.run.extra == 2048 - (4 + 6 * 4 + 24) and len(table.rows[0]) < 2 * 60
    rng = random.Random(5)
    durs = [[rng.uniform(1e-3, 1e-2) for _ in kinds] for kinds in table.kinds]
    sends = [rng.uniform(0.0, 1e-3) for _ in table.sends]
    start = [0.0] * 4
    assert _close(walk_plain(table, durs, sends, start), walk(table, durs, sends, start))


def test_a_short_table_whose_state_never_repeats_walks_the_full_table(monkeypatch, kernel):
    monkeypatch.setattr(walk_module, "_NOISE_ULPS", -1)  # no two states count as repeating
    table = op_table("1f1b", 3, 500, 1)
    assert table.run.extra > 0
    durs = [[0.01 * (s + 1), 0.02] for s in range(3)]
    sends = [1e-3] * len(table.sends)
    assert walk(table, durs, sends, [0.0] * 3) == walk_plain(table, durs, sends, [0.0] * 3)


def _sample(name: str, count: int):
    prepared = prepare(bundled_scenario(name))
    grid = list(planner.layouts(prepared, prepared.scenario.search))
    return prepared, grid[::max(1, len(grid) // count)]


@pytest.mark.parametrize("name", ["mixed_ib_roce", "mixed_ib_eth", "two_clusters_39b",
                                  "pure_ethernet", "large_175b_1024"])
def test_estimate_with_jump_equals_plain_walk_on_searched_plans(name, monkeypatch, kernel):
    """Every sampled layout x policy of the search: the estimate with the jump equals the one
    that walks every op."""
    prepared, sample = _sample(name, 12 if name == "large_175b_1024" else 40)
    compared = 0
    for layout in sample:
        p = planner.prepared_for(prepared, layout)
        for policy in ("holmes", "megatron"):
            try:
                plan, cluster = planner._plan(p, policy, layout)
            except HolmesError:
                continue
            analytic._WALKS.clear()
            analytic._ESTIMATES.clear()
            fast = analytic.estimate_iteration(plan, cluster, p.workload, p.compute)
            analytic._WALKS.clear()
            analytic._ESTIMATES.clear()
            with monkeypatch.context() as m:
                m.setattr(analytic, "walked", walk_module.plain_walked)  # the full table
                plain = analytic.estimate_iteration(plan, cluster, p.workload, p.compute)
            assert _close([plain.iteration_s, *plain.stage_end_s],
                          [fast.iteration_s, *fast.stage_end_s]), (layout, policy)
            compared += 1
    analytic._WALKS.clear()
    analytic._ESTIMATES.clear()
    assert compared >= 10


def _buckets(rng: random.Random) -> tuple[tuple[float, float], ...]:
    """(time s, ready point) buckets in release order, the points nondecreasing, the last 1."""
    n = rng.choice([1, 2, 3, 7, 36])
    points = sorted(rng.choice([rng.random(), 0.5]) for _ in range(n - 1)) + [1.0]
    return tuple((rng.choice([rng.uniform(1e-5, 5e-2), 1e-3]), p) for p in points)


def test_bucket_delays_equal_the_step_by_step_timelines():
    """The start delay equals the forward run piece by piece in forward order (the buckets'
    reverse; bucket i's piece spans 1 - p_i to 1 - p_(i-1) of it), each piece starting once its
    own all-gather (back to back, in that order) has ended; the released-reduction tail equals
    one stream reducing each bucket from its release at its point of the backward."""
    rng = random.Random(13)
    for _ in range(2000):
        buckets = _buckets(rng)
        total = sum(r for r, _ in buckets)
        forward = rng.choice([0.0, rng.uniform(1e-4, 1.0), total])
        gathered, now, done = 0.0, 0.0, 0.0
        for i in range(len(buckets) - 1, -1, -1):
            gathered += buckets[i][0]
            upto = 1.0 - (buckets[i - 1][1] if i > 0 else 0.0)
            now = max(now, gathered) + forward * (upto - done)
            done = upto
        assert bucket_streams.gather_delay_s(buckets, forward) == pytest.approx(
            now - forward, rel=1e-9, abs=1e-12)
        window = rng.choice([rng.uniform(1e-4, 1.0), total, 0.5 * total])
        t = 0.0
        for r, point in buckets:
            t = max(t, window * point) + r
        tail = max(0.0, t - window)
        assert bucket_streams.released_reduction_tail_s(buckets, window) == pytest.approx(
            tail, rel=1e-9, abs=1e-12 * window)


def test_gather_floors_equal_the_step_by_step_timelines():
    """Each chunk's first forward run piece by piece (`gather_delay_s`'s timeline) with every
    chunk's all-gathers back to back on one stream, chunk 0's first: it ends at its floor plus
    its forward; one chunk's floor is `gather_delay_s`, and with an empty expert buffer the
    two-stream floors are the one-stream ones."""
    rng = random.Random(17)
    for _ in range(500):
        chunks = [_buckets(rng) for _ in range(rng.choice([1, 2, 3, 5]))]
        forwards = [rng.uniform(1e-4, 0.2) for _ in chunks]
        floors = bucket_streams.gather_floors(chunks, forwards)
        gathered = 0.0
        for buckets, forward, floor in zip(chunks, forwards, floors, strict=True):
            now, done = 0.0, 0.0
            for i in range(len(buckets) - 1, -1, -1):
                gathered += buckets[i][0]
                upto = 1.0 - (buckets[i - 1][1] if i > 0 else 0.0)
                now = max(now, gathered) + forward * (upto - done)
                done = upto
            assert floor + forward == pytest.approx(now, rel=1e-9)
        assert floors[0] == bucket_streams.gather_delay_s(chunks[0], forwards[0])
        merged = bucket_streams.merged_gather_floors(chunks, [()] * len(chunks), forwards)
        assert merged == pytest.approx(floors, rel=1e-9, abs=1e-12)


def _floors(rng: random.Random, table) -> list[list[float]] | None:
    """Floors on each chunk's forwards (the walk's gathers before a chunk's first forward),
    rising with the chunk, on some stages; None for some cases."""
    if rng.random() < 0.2:
        return None
    p = table.shape[1]
    return [[rng.uniform(0.0, 0.3) * (1 + j // p) if not b and rng.random() < 0.8 else -math.inf
             for j, b in kinds] for kinds in table.kinds]


def test_floored_walks_equal_the_plain_walk(kernel):
    """With floors (a chunk's forwards start no earlier than its first may), the walk with its
    jump equals the op-by-op walk, and the releasing backwards' ends it reads
    (`walk.released_ends`) equal the op-by-op walk's."""
    rng = random.Random(19)
    floored = 0
    for _ in range(300):
        table, durs, sends, start = _random_case(rng, released=rng.random() < 0.5)
        floors = _floors(rng, table)
        plain = walk_module.plain_walked(table, durs, sends, start, floors)
        fast = walk_module.walked(table, durs, sends, start, floors)
        assert _close(plain.clock, list(fast.clock))
        assert walk(table, durs, sends, start, floors) == list(fast.clock)  # replays
        if table.released:
            ends = walk_module.released_ends(fast.table, fast.clock, fast.ready)
            reference = walk_module.released_ends(plain.table, plain.clock, plain.ready)
            assert all(_close(list(a), list(b)) for a, b in zip(ends, reference, strict=True))
        if floors is not None:
            unfloored = walk_plain(table, durs, sends, start)
            floored += any(a > b for a, b in zip(plain.clock, unfloored))
    assert floored >= 50  # the floors bound in many cases


def test_compiled_and_python_walks_are_identical_with_floors(monkeypatch):
    """The C walk and the Python walk with floors: equal bit for bit."""
    if walk_module._walk_kernel is None:
        pytest.skip("the C walk was not built")
    rng = random.Random(23)
    for _ in range(200):
        table, durs, sends, start = _random_case(rng)
        floors = _floors(rng, table)
        compiled = walk(table, durs, sends, start, floors)
        with monkeypatch.context() as m:
            m.setattr(walk_module, "_walk_kernel", None)
            assert walk(table, durs, sends, start, floors) == compiled
            assert walk(table, durs, sends, start, floors) == compiled


def test_op_columns_are_the_built_schedules():
    """`op_table._op_columns` (the schedules' closed form) gives every op's chunk, kind and
    micro-batch, stage after stage, as `schedule.build_schedule`'s ops: every kind, p up to 16,
    m up to 40 (interleaved: multiples of p), v up to 4."""
    import numpy as np

    from holmes_sim.schedule import ScheduleKind, build_schedule

    shapes = [(k, p, m, 1) for k in ("gpipe", "1f1b") for p in (1, 2, 3, 4, 7, 16)
              for m in (1, 2, 3, 5, 8, 17, 40)]
    shapes += [("interleaved", p, m, v) for p in (1, 2, 3, 4, 8) for v in (1, 2, 3, 4)
               for m in range(p, 41, p)]
    for kind, p, m, v in shapes:
        ops = [op for stage in build_schedule(kind, p, m, v).stage_ops for op in stage]
        chunk, backward, mb, lengths = op_table_module._op_columns(ScheduleKind(kind), p, m, v)
        assert lengths == [len(stage) for stage in build_schedule(kind, p, m, v).stage_ops]
        assert chunk.tolist() == [op.chunk for op in ops], (kind, p, m, v)
        assert backward.tolist() == [int(op.kind == "B") for op in ops], (kind, p, m, v)
        assert mb.tolist() == [op.microbatch for op in ops], (kind, p, m, v)
        assert chunk.dtype == backward.dtype == mb.dtype == np.int64
