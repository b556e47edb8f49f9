"""Progress of long work on standard error, with the time left.

On a terminal, a transient bar: the count done, the time so far and the estimate of the time
left. Elsewhere (a log file, a pipe, CI) a line once the work has run `first_s` seconds and then
every `every_s` seconds (`plan: 412/1,446 layouts, 20 s so far, about 50 s left`) and a last
line with the total, so short commands print nothing extra. Never on standard output: `--json -`
stays valid JSON, and results do not depend on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)


def duration(seconds: float) -> str:
    """'45 s', '3.2 min' or '1.5 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def time_left(elapsed_s: float, done: int, total: int) -> float | None:
    """Seconds left at the rate so far (elapsed / done per item), None before the first item."""
    if done <= 0 or total <= done:
        return None if done <= 0 else 0.0
    return elapsed_s / done * (total - done)


class WorkProgress:
    """`with WorkProgress(console, "plan", "layouts") as p: ... p.update(done, total)`."""

    def __init__(self, console: Console, label: str, unit: str, first_s: float = 5.0,
                 every_s: float = 15.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.console, self.label, self.unit = console, label, unit
        self.first_s, self.every_s, self.clock = first_s, every_s, clock
        self.bar: Progress | None = None
        self.began = self.start = self.next_line = 0.0
        self.done = self.total = 0
        self.printed = False

    def __enter__(self) -> WorkProgress:
        self.began = self.start = self.clock()
        self.next_line = self.start + self.first_s
        if self.console.is_terminal:
            self.bar = Progress(TextColumn(self.label), BarColumn(), MofNCompleteColumn(),
                                TextColumn(self.unit), TimeElapsedColumn(), TextColumn("left"),
                                TimeRemainingColumn(), console=self.console, transient=True)
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=None)
        return self

    def stage(self, label: str, unit: str) -> Callable[[int, int], None]:
        """An `update` for a next stage of the work, which gets its own label, count and
        estimate from its first call on."""
        started = False

        def update(done: int, total: int) -> None:
            nonlocal started
            if not started:
                started = True
                self._restart(label, unit)
            self.update(done, total)
        return update

    def _restart(self, label: str, unit: str) -> None:
        self.label, self.unit = label, unit
        self.start = self.clock()
        self.next_line = min(self.next_line, self.start + self.first_s)
        self.done = self.total = 0
        if self.bar is not None:
            self.bar.remove_task(self.task)
            self.bar.columns[0].text_format = label
            self.bar.columns[3].text_format = unit
            self.task = self.bar.add_task(label, total=None)

    def update(self, done: int, total: int) -> None:
        """`done` of `total` items finished."""
        self.done, self.total = done, total
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total)
            return
        now = self.clock()
        if now >= self.next_line and 0 < done < total:
            self.next_line = now + self.every_s
            self._line(now)

    def _line(self, now: float) -> None:
        elapsed = now - self.start
        left = time_left(elapsed, self.done, self.total) or 0.0  # done > 0 here
        self.console.print(f"{self.label}: {self.done:,}/{self.total:,} {self.unit}, "
                           f"{duration(elapsed)} so far, about {duration(left)} left",
                           highlight=False, markup=False, soft_wrap=True)
        self.printed = True

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
        elif self.printed and exc[0] is None:
            self.console.print(f"{self.label}: {self.done:,}/{self.total:,} {self.unit}, "
                               f"{duration(self.clock() - self.began)} in all", highlight=False,
                               markup=False, soft_wrap=True)
