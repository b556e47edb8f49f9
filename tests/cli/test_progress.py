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
                     "plan: 400/400 layouts, 45 s in all"]


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


def test_a_next_stage_gets_its_own_count_and_estimate():
    buf, clock = io.StringIO(), Clock()
    with WorkProgress(Console(file=buf, width=200), "plan", "layouts", first_s=5, every_s=15,
                      clock=clock) as p:
        confirming = p.stage("plan, simulating the best", "plans")
        clock.now += 2
        p.update(100, 100)
        clock.now += 8
        confirming(0, 4)  # the stage starts here
        clock.now += 6
        confirming(1, 4)  # 6 s for the first of four
        clock.now += 6
        confirming(2, 4)  # within every_s of the last line
        clock.now += 12
        confirming(4, 4)
    assert buf.getvalue().splitlines() == [
        "plan, simulating the best: 1/4 plans, 6 s so far, about 18 s left",
        "plan, simulating the best: 4/4 plans, 34 s in all"]


def test_a_terminal_gets_a_bar_that_leaves_no_line_behind():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100)
    with WorkProgress(console, "sweep", "points") as p:
        p.update(1, 3)
        confirm = p.stage("plan, simulating the best", "plans")
        confirm(0, 2)
        confirm(2, 2)
        assert p.bar is not None and p.bar.columns[0].text_format == "plan, simulating the best"
    assert p.bar.finished and "in all" not in buf.getvalue()
