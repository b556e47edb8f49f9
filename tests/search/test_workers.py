"""The planner's worker pool leaves Ctrl-C to its parent: a terminal's SIGINT, sent to the whole
process group, stops the search with one exit and no traceback from each worker."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures.process import _ExecutorManagerThread

import pytest

from holmes_sim.search.workers import collect_in_order, fork_pool, run_in_pool
from holmes_sim.spec.limits import GUARD_SIGNAL, interrupts_held

_CTRL_C_DURING_MAP = textwrap.dedent("""
    import os, signal, sys, time
    from holmes_sim.search.workers import fork_pool

    def nap(_):
        time.sleep(0.2)
        return os.getpid()

    try:
        with fork_pool(2) as pool:
            pending = pool.map_async(nap, range(100))
            time.sleep(0.5)
            os.killpg(0, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
            pending.get()
    except KeyboardInterrupt:
        sys.exit(130)
""")


def test_ctrl_c_stops_the_pool_without_worker_tracebacks():
    done = subprocess.run([sys.executable, "-c", _CTRL_C_DURING_MAP], capture_output=True,
                          text=True, timeout=60, start_new_session=True)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr


def test_workers_ignore_sigint_and_the_parent_keeps_its_handler():
    before = signal.getsignal(signal.SIGINT)
    with fork_pool(2) as pool:
        assert pool.apply(signal.getsignal, (signal.SIGINT,)) == signal.SIG_IGN
        assert signal.SIGINT not in pool.apply(signal.pthread_sigmask, (signal.SIG_BLOCK, []))
    assert signal.getsignal(signal.SIGINT) is before


def test_results_come_in_chunk_order_with_progress():
    seen = []
    got = collect_in_order([[1, 2], [3]], iter(["a", "b"]), 3, lambda d, n: seen.append((d, n)))
    assert got == ["a", "b"] and seen == [(2, 3), (3, 3)]


_CTRL_C_DURING_SWEEP_POOL = textwrap.dedent("""
    import os, signal, sys, threading, time
    from holmes_sim.search.workers import run_in_pool

    def nap(_):
        time.sleep(0.5)
        return os.getpid()

    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        run_in_pool(nap, range(100), 2, None)  # 25 s of queued work
    except KeyboardInterrupt:
        print(f"{time.monotonic() - start:.1f}")
        sys.exit(130)
""")


def test_ctrl_c_cancels_the_queued_items_and_stops_the_workers():
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _CTRL_C_DURING_SWEEP_POOL], capture_output=True,
                          text=True, timeout=60, start_new_session=True)
    assert done.returncode == 130, done.stderr
    assert time.monotonic() - start < 10.0  # the process ends, not after the 25 s queued
    assert "Traceback" not in done.stderr


def test_run_in_pool_keeps_the_items_order():
    seen = []
    got = run_in_pool(abs, [-3, 1, -2], 2, lambda d, n: seen.append((d, n)))
    assert got == [3, 1, 2] and seen[-1] == (3, 3)


def _fail_on_two(item: int) -> int:
    if item == 2:
        raise ValueError("item 2")
    time.sleep(0.2)
    return item


def _manager_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if isinstance(t, _ExecutorManagerThread)]


def test_a_failed_item_leaves_no_pool_thread_behind():
    # A manager thread still running at exit races the interpreter's exit hook on its wake-up
    # pipe, which prints an OSError traceback after the command's own error.
    with pytest.raises(ValueError, match="item 2"):
        run_in_pool(_fail_on_two, list(range(20)), 2, None)
    assert _manager_threads() == []


def test_interrupts_held_deliver_the_signal_after_the_block():
    steps = []

    def alarm(signum, frame):
        steps.append("alarm")
        raise RuntimeError("alarm")

    old = signal.signal(GUARD_SIGNAL, alarm)
    try:
        with pytest.raises(RuntimeError, match="alarm"):
            with interrupts_held():
                signal.pthread_kill(threading.main_thread().ident, GUARD_SIGNAL)
                time.sleep(0.05)
                steps.append("cleanup done")
        assert steps == ["cleanup done", "alarm"]
    finally:
        signal.signal(GUARD_SIGNAL, old)


def _blocked_signals(_: int) -> set[int]:
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, []))


def test_sweep_workers_take_sigterm_so_a_stop_is_at_once():
    # Forked while the parent holds its signals; a worker blocking SIGTERM ignores
    # `_stop_pool`'s terminate and runs its queued items to the end.
    for blocked in run_in_pool(_blocked_signals, [0, 1], 2, None):
        assert not blocked & {signal.SIGTERM, signal.SIGHUP, GUARD_SIGNAL}


def _termination_is_fatal(_: int) -> bool:
    return all(signal.getsignal(s) == signal.SIG_DFL for s in (signal.SIGTERM, signal.SIGHUP))


def test_workers_die_of_sigterm_even_under_the_commands_handler():
    # The command's SIGTERM handler runs only between bytecodes: a worker that inherited it and
    # hangs in C (a lock held at the fork) would outlive the pool's terminate.
    from holmes_sim.report.files import terminate_unwinds

    with terminate_unwinds():
        assert all(run_in_pool(_termination_is_fatal, [0, 1], 2, None))
        with fork_pool(2) as pool:
            assert all(pool.map(_termination_is_fatal, [0, 1]))
