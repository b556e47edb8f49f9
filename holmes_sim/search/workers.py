"""Worker processes of a search: a fork pool that leaves Ctrl-C to its parent, and results
gathered in order with progress."""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.pool import Pool
from typing import TypeVar

T = TypeVar("T")


def fork_pool(jobs: int) -> Pool:
    """A fork pool of `jobs` workers forked with SIGINT ignored (and blocked until then): Ctrl-C
    reaches the parent alone, which stops them (leaving the pool's `with` terminates it),
    without a traceback from each worker."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return multiprocessing.get_context("fork").Pool(
            jobs, initializer=signal.pthread_sigmask, initargs=(signal.SIG_SETMASK, mask))
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
