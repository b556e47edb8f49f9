"""A rank's timing records: one per op it ran (seconds, time.perf_counter)."""

from __future__ import annotations


class Recorder:
    """Per-op timing records (seconds, perf_counter)."""

    def __init__(self) -> None:
        self.ops: list[dict] = []
        self.iteration = 0

    def record(self, kind: str, start: float, end: float, microbatch: int = -1, chunk: int = -1,
               detail: str = "") -> None:
        self.ops.append({"iteration": self.iteration, "kind": kind, "microbatch": microbatch,
                         "chunk": chunk, "start": start, "end": end, "detail": detail})
