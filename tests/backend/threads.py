"""Run one body per rank in threads of this process (loopback gloo groups, probes)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any


def in_threads(ranks: Iterable[int], body: Callable[[int], Any], timeout_s: float) -> dict:
    """body(rank) in one thread per rank, each joined for up to `timeout_s` seconds; their
    results by rank (the first error re-raised)."""
    results, errors = {}, []

    def one(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    return results
