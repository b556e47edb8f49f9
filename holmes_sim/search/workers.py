"""Worker processes of a search and a sweep: pools whose workers leave Ctrl-C to their parent,
and results gathered in order with progress."""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing.pool import Pool
from typing import TypeVar

from holmes_sim.spec.limits import interrupts_held

T = TypeVar("T")


def fork_pool(jobs: int) -> Pool:
    """A fork pool of `jobs` workers forked with SIGINT ignored (and blocked until then): Ctrl-C
    reaches the parent alone, which stops them (leaving the pool's `with` terminates it),
    without a traceback from each worker."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return multiprocessing.get_context("fork").Pool(
            jobs, initializer=_start_worker, initargs=(mask,))
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def collect_in_order(chunks: Sequence[Sequence], parts: Iterable[T], total: int,
                     progress: Callable[[int, int], None] | None) -> list[T]:
    """Each of `chunks`' results from `parts` (in the same order), calling `progress(done,
    total)` with the items done after each."""
    out, done = [], 0
    for chunk, part in zip(chunks, parts, strict=True):
        out.append(part)
        done += len(chunk)
        if progress:
            progress(done, total)
    return out


def run_in_pool(work: Callable[[T], object], items: Sequence[T], jobs: int,
                progress: Callable[[int, int], None] | None) -> list:
    """`work(item)` for each of `items` in `jobs` worker processes that ignore SIGINT, results
    in the items' order, `progress(done, total)` after each. A Ctrl-C or a failure cancels the
    items still queued and stops the workers at once, so the command ends in seconds, not after
    every queued item has run (one arriving while the items are queued, when they are)."""
    results: list = [None] * len(items)
    pool = ProcessPoolExecutor(max_workers=jobs, initializer=_start_worker,
                               initargs=(signal.pthread_sigmask(signal.SIG_BLOCK, ()),))
    finished = False
    try:
        with interrupts_held():  # its manager thread is started whole, so it can be joined
            futures = {pool.submit(work, item): k for k, item in enumerate(items)}
        for done, future in enumerate(as_completed(futures), 1):
            results[futures[future]] = future.result()
            if progress:
                progress(done, len(items))
        finished = True
    finally:
        with interrupts_held():
            _stop_pool(pool, finished)
    return results


def _start_worker(mask: set) -> None:
    """A pool worker ignores SIGINT (its parent stops it), dies of SIGTERM and SIGHUP at once,
    and takes back `mask`, its parent's signal mask before the parent held signals to fork it.
    The command's SIGTERM handler (`report.files.terminate_unwinds`), inherited by fork, runs
    only between bytecodes: a worker stuck in C (a lock held at the fork) would outlive the
    pool's terminate."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _stop_pool(pool: ProcessPoolExecutor, finished: bool) -> None:
    """Shut `pool` down and wait for its manager thread; unless `finished`, cancel its queued
    items and terminate the workers still running first. A manager thread left running at exit
    closes its wake-up pipe while the interpreter's exit hook writes to it, which prints an
    ignored OSError traceback (`concurrent.futures.process._python_exit`)."""
    if finished:
        pool.shutdown()
        return
    running = list((pool._processes or {}).values())  # shutdown forgets them
    manager = pool._executor_manager_thread
    pool.shutdown(wait=False, cancel_futures=True)
    for process in running:  # their items too
        process.terminate()
    if manager is not None and manager.is_alive():
        manager.join()  # ends once it has reaped the terminated workers
