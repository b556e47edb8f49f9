"""Measure the compute time of the model's pieces on this host, under honest contention.

A real run on a small host puts several ranks on few cores; a layer timed alone would be faster
than it is during the run. So `concurrency` processes (as many as the run has ranks) time the
same pieces at once, each with the run's thread count. A process that has its samples keeps
computing (unrecorded) until all have theirs, so every recorded sample ran under full load.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import statistics
import threading
import time

import torch

from holmes_sim.backend.model import (
    GPTConfig,
    make_block,
    make_embedding,
    make_head,
    synthetic_batch,
)
from holmes_sim.backend.optimizer import FlatOptimizer
from holmes_sim.errors import TestbedError

_WARMUP = 2
_KEYS = ("embedding_forward_s", "embedding_backward_s", "block_forward_s", "block_backward_s",
         "head_forward_s", "head_backward_s", "optimizer_per_param_s")
_OPTIMIZER_PARAMS = 1 << 18  # elements of the flat tensor the Adam step is timed on


class CalibrationTooSlow(TestbedError):
    """The timed repeats did not, or cannot, finish within the calibration's time limit:
    `repeats` need about `need_s` seconds (from the warm-up's pace; None: the limit passed
    first) of the `left_s` left then; `fits` repeats would fit (0: none, or unknown)."""

    def __init__(self, message: str, repeats: int, need_s: float | None = None,
                 left_s: float = 0.0, fits: int = 0) -> None:
        super().__init__(message)
        self.repeats, self.need_s, self.left_s, self.fits = repeats, need_s, left_s, fits


def measure_layer_times(config: GPTConfig, micro_batch_size: int, concurrency: int = 1,
                        repeats: int = 10, torch_threads: int = 1,
                        timeout_s: float = 300.0, realtime_priority: int = 0) -> dict:
    """Median forward and backward seconds of one micro-batch through each piece
    (`realtime_priority` > 0: the measuring processes run under SCHED_FIFO, so other processes
    on the host do not preempt them), all within `timeout_s` seconds.

    Returns keys embedding_forward_s, embedding_backward_s, block_forward_s, block_backward_s,
    head_forward_s, head_backward_s (median seconds per micro-batch), the same with _mean_s
    (means), plus concurrency and samples (measurements per key, over all processes) and
    scheduler (what the processes ran under, `worker.set_realtime`'s words, distinct ones
    joined by ", ").

    Raises:
        TestbedError: a process died or failed (the first one, with how it ended), or the
            limit passed.
        CalibrationTooSlow: the warm-up rounds show the repeats cannot finish in time (raised
            then, not at the limit).
    """
    if concurrency < 1 or repeats < 1:
        raise ValueError(f"concurrency and repeats must be >= 1, got {concurrency}, {repeats}")
    ctx = mp.get_context("spawn")  # a fresh interpreter, like a rank; no forked torch state
    barrier, done, results = ctx.Barrier(concurrency), ctx.Value("i", 0), ctx.Queue()
    procs = [ctx.Process(target=_measure_one, args=(config, micro_batch_size, repeats,
                                                    torch_threads, barrier, done, results,
                                                    os.getpid(), realtime_priority, i, timeout_s))
             for i in range(concurrency)]
    try:
        _start_without_sigint(procs)
        samples = _collect(procs, results, repeats, timeout_s)
    except BaseException:  # Ctrl-C, say: the workers stop now, not after their repeats
        for p in procs:
            if p.is_alive():
                p.kill()
        raise
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return _summarise(samples, concurrency, repeats)


def _summarise(samples: list[dict], concurrency: int, repeats: int) -> dict:
    """`measure_layer_times`' result from every process's samples."""
    out = {k: statistics.median(v for s in samples for v in s[k]) for k in _KEYS}
    # Means too: with more processes than cores a few samples absorb whole scheduler slices.
    out.update({k.replace("_s", "_mean_s"): statistics.fmean(v for s in samples for v in s[k])
                for k in _KEYS})
    # Spread of one block's forward + backward across rounds and processes (coefficient of
    # variation): how unevenly a shared host serves ranks that do the same work.
    block = [f + b for smp in samples
             for f, b in zip(smp["block_forward_s"], smp["block_backward_s"], strict=True)]
    out["block_cv"] = statistics.pstdev(block) / statistics.fmean(block)
    out["concurrency"] = float(concurrency)
    out["samples"] = float(concurrency * repeats)
    out["scheduler"] = ", ".join(sorted({s["scheduler"] for s in samples}))
    return out


_POLL_S = 0.1
_EXIT_GRACE_S = 2.0
"""How long a process that exited 0 may take to deliver its samples (its queue flushes first)."""


def _collect(procs: list, results, repeats: int, timeout_s: float) -> list[dict]:
    """Every process's samples, in order. Watches the processes while waiting: the first that
    ended without its samples, or reported an error, fails the calibration at once."""
    from holmes_sim.backend.launch import how_it_ended

    start = time.monotonic()
    got: dict[int, dict] = {}
    exited_at: dict[int, float] = {}
    while len(got) < len(procs):
        try:
            kind, i, value = results.get(timeout=_POLL_S)
        except queue.Empty:
            now = time.monotonic()
            for i, p in enumerate(procs):
                code = p.exitcode
                if i in got or code is None:
                    continue
                if code != 0 or now - exited_at.setdefault(i, now) > _EXIT_GRACE_S:
                    raise TestbedError(f"calibration process {i} of {len(procs)} "
                                       f"{how_it_ended(code)} before reporting its samples")
            if now - start > timeout_s:
                raise CalibrationTooSlow(f"{repeats} repeats did not finish within {timeout_s:g} s "
                                         f"({len(got)} of {len(procs)} processes done)", repeats)
            continue
        if kind == "error":
            raise TestbedError(f"calibration process {i} of {len(procs)} failed: {value}")
        if kind == "warmup":
            _check_pace(value, repeats, len(procs), timeout_s - (time.monotonic() - start))
        else:
            got[i] = value
    return [got[i] for i in range(len(procs))]


def _check_pace(round_s: float, repeats: int, concurrency: int, left_s: float) -> None:
    """CalibrationTooSlow when `repeats` rounds of `round_s` (a process's faster warm-up round;
    `concurrency` processes share the cores) cannot finish in the `left_s` seconds left."""
    share = max(1.0, concurrency / len(os.sched_getaffinity(0)))
    need = repeats * round_s * share
    if need > left_s:
        fits = int(max(0.0, left_s) / (round_s * share))
        raise CalibrationTooSlow(f"{repeats} repeats of about {1e3 * round_s * share:.1f} ms each "
                                 f"need about {need:.0f} s, more than the {max(0.0, left_s):.0f} s "
                                 "left", repeats, need, left_s, fits)


def _start_without_sigint(procs: list) -> None:
    """Start `procs` ignoring SIGINT, which they keep across exec (Python installs no
    KeyboardInterrupt handler where SIGINT is ignored at start): a terminal's Ctrl-C, sent to
    the whole process group, interrupts this process alone (which then stops them), not each
    worker wherever it is, imports included. This thread blocks SIGINT meanwhile, so a Ctrl-C
    in those milliseconds stays pending for the handler restored after (unless another of this
    process's threads takes it while it is ignored). Off the main thread, where no handler can
    be set, they start as they are."""
    if threading.current_thread() is not threading.main_thread():
        for p in procs:
            p.start()
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for p in procs:
            p.start()
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _measure_one(config: GPTConfig, micro_batch_size: int, repeats: int, torch_threads: int,
                 barrier, done, results, parent: int, realtime_priority: int = 0, index: int = 0,
                 timeout_s: float = 300.0) -> None:
    """One measuring process: its warm-up rounds' pace, then its samples (or its error) on
    `results` as (kind, index, value)."""
    from holmes_sim.backend.netns import die_with_parent
    from holmes_sim.backend.worker import set_realtime

    die_with_parent()  # however the calibrating process ends, this one does not outlive it
    if os.getppid() != parent:
        return
    scheduler = set_realtime(realtime_priority)
    try:
        torch.set_num_threads(torch_threads)
        emb, block, head = make_embedding(config), make_block(config, 0), make_head(config)
        tokens, targets = synthetic_batch(config, 0, 0, micro_batch_size, 0, 1)
        x = torch.randn(micro_batch_size, config.block_size, config.n_embd)
        samples: dict[str, list[float]] = {k: [] for k in _KEYS}
        paces = []
        for _ in range(_WARMUP):
            t = time.perf_counter()
            _one_round(emb, block, head, tokens, targets, x)
            paces.append(time.perf_counter() - t)
        results.put(("warmup", index, min(paces)))
        barrier.wait(timeout=timeout_s)  # every process measures at the same time from here on
        for _ in range(repeats):
            for k, t in zip(_KEYS, _one_round(emb, block, head, tokens, targets, x), strict=True):
                samples[k].append(t)
        with done.get_lock():
            done.value += 1
        while done.value < barrier.parties:
            _one_round(emb, block, head, tokens, targets, x)  # keep the load on for the others
        results.put(("samples", index, {**samples, "scheduler": scheduler}))
    except BaseException as e:  # reported by the parent
        results.put(("error", index, f"{type(e).__name__}: {e}"))


def _one_round(emb, block, head, tokens, targets, x) -> tuple[float, ...]:
    """Forward and backward seconds of embedding, block and head for one micro-batch."""
    out = []
    flat = torch.zeros(_OPTIMIZER_PARAMS)
    for piece in ("embedding", "block", "head"):
        t0 = time.perf_counter()
        if piece == "embedding":
            y = emb(tokens)
        else:
            inp = x.clone().requires_grad_(True)
            y = block(inp) if piece == "block" else head(inp, targets)
        t1 = time.perf_counter()
        grad = None if piece == "head" else torch.ones_like(y)
        torch.autograd.backward(y, grad)
        t2 = time.perf_counter()
        out += [t1 - t0, t2 - t1]
    for m in (emb, block, head):
        m.zero_grad(set_to_none=True)
    # The worker's optimizer (elementwise Adam on flat fp32 shards): seconds per parameter.
    opt = FlatOptimizer("adam", 1e-3)
    t0 = time.perf_counter()
    opt.step(0, flat, torch.ones_like(flat))
    out.append((time.perf_counter() - t0) / _OPTIMIZER_PARAMS)
    return tuple(out)
