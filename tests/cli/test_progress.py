"""Long work shows progress and the time left on standard error (a line now and then when
standard error is not a terminal), never on standard output."""

from __future__ import annotations

import io

from rich.console import Console

from holmes_sim.report.progress import WorkProgress, duration, time_left


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_with_the_time_left_once_the_work_is_long():
    buf, clock = io.StringIO(), Clock()
    with WorkProgress(Console(file=buf, width=200), "plan", "layouts", first_s=5, every_s=15,
                      clock=clock) as p:
        p.update(0, 400)
        clock.now += 4
        p.update(40, 400)  # under first_s: nothing yet
        assert buf.getvalue() == ""
        clock.now += 6
        p.update(100, 400)  # 10 s for 100 of 400
        clock.now += 5
        p.update(150, 400)  # within every_s of the last line: nothing new
        clock.now += 20
        p.update(300, 400)
        clock.now += 10
        p.update(400, 400)
    lines = buf.getvalue().splitlines()
    assert lines == ["plan: 100/400 layouts, 10 s so far, about 30 s left",
                     "plan: 300/400 layouts, 35 s so far, about 12 s left",
                     "plan: 400/400 layouts in 45 s"]


def test_short_work_prints_nothing():
    buf, clock = io.StringIO(), Clock()
    with WorkProgress(Console(file=buf), "sweep", "points", clock=clock) as p:
        for k in range(1, 11):
            clock.now += 0.1
            p.update(k, 10)
    assert buf.getvalue() == ""


def test_estimates_and_durations():
    assert time_left(10.0, 0, 5) is None and time_left(10.0, 5, 5) == 0.0
    assert time_left(10.0, 2, 6) == 20.0
    assert [duration(s) for s in (44.6, 150, 9000)] == ["45 s", "2.5 min", "2.5 h"]
