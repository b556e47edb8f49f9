"""Measure a fabric's achieved point-to-point throughput (bytes/s) and latency (s) with gloo, the
same library and interface the real run uses, between two emulated nodes.

Run as two processes (`python -m holmes_sim.backend.calibrate_links ...`), one per node:
- latency: half the median round trip of a 4-byte ping-pong;
- throughput: rank 0 sends `size_bytes` to rank 1, which answers with a 4-byte ack; the bytes
  over (elapsed - one latency), median of several sends.

With `--all-reduce BYTES` (an unshaped link: a node's loopback, which the CPU paces), the
bandwidth and step cost are instead fitted to the worker's own ring all-reduce as the ranks run
it: one tiny and one of BYTES (a TP all-reduce), each after an idle gap of a compute piece. The
alpha-beta model t(n) = 2 (p-1) alpha + 2 (p-1)/p n / beta [Hockney 1994; Thakur et al. 2005]
through both points, p = 2: alpha = t(tiny) / 2, beta = n / (t(n) - t(tiny)), at most the
streaming rate (when noise leaves the two medians closer than the bytes can move). (The
streaming rate of 4 MB messages, 2.4 GB/s on loopback, priced a 256 KiB all-reduce at half its
0.5-0.7 ms.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from holmes_sim.backend.groups import PointToPoint, gloo_connections

_PINGS = 30
_SENDS = 3


def probe(rank: int, store_path: str, interface: str, size_bytes: int, timeout_s: float,
          all_reduce_bytes: int = 0) -> dict:
    """One side of the probe; rank 0 returns the figures (`all_reduce_bytes`: module doc)."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    pg, pg_rev, _ = gloo_connections(store, "probe", rank, 2, interface, timeout_s)
    link = PointToPoint(pg, pg_rev, rank, 2)  # each direction on its own connection, as the ranks
    peer = 1 - rank
    small = torch.zeros(1)
    rtts = []
    for i in range(_PINGS + 3):
        t = time.perf_counter()
        if rank == 0:
            link.send(small, peer, i).wait()
            link.recv(small, peer, i).wait()
        else:
            link.recv(small, peer, i).wait()
            link.send(small, peer, i).wait()
        if i >= 3:  # the first exchanges set up connections
            rtts.append(time.perf_counter() - t)
    latency = statistics.median(rtts) / 2
    big = torch.zeros(size_bytes // 4)
    rates = []
    cpu0 = time.process_time()
    for i in range(_SENDS):
        tag = 1000 + i
        t = time.perf_counter()
        if rank == 0:
            link.send(big, peer, tag).wait()
            link.recv(small, peer, tag).wait()
            rates.append(big.numel() * 4 / max(time.perf_counter() - t - latency, 1e-9))
        else:
            link.recv(big, peer, tag).wait()
            link.send(small, peer, tag).wait()
    # CPU this side spent moving the bulk bytes (user + system, gloo's threads included).
    cpu_s_per_byte = (time.process_time() - cpu0) / (_SENDS * big.numel() * 4)
    result = {"latency_s": latency,
              "bandwidth_bytes_per_s": statistics.median(rates) if rates else 0.0,
              "cpu_s_per_byte": cpu_s_per_byte, "rtt_samples": len(rtts),
              "size_bytes": size_bytes, "collective_step_s": _collective_step_s(link)}
    if all_reduce_bytes:
        result["streaming_bytes_per_s"] = result["bandwidth_bytes_per_s"]
        result.update(fit_all_reduce(link, all_reduce_bytes, result["streaming_bytes_per_s"]),
                      all_reduce_bytes=all_reduce_bytes)
    return result


_FIT_REPEATS = 30
_FIT_GAP_S = 0.01  # idle between collectives, as between a rank's compute pieces


def fit_all_reduce(group: PointToPoint, size_bytes: int, streaming_bytes_per_s: float) -> dict:
    """{"collective_step_s": alpha, "bandwidth_bytes_per_s": beta} of the module docstring."""
    from holmes_sim.backend.collectives import all_gather, ring_reduce_scatter
    from holmes_sim.backend.emulation import PreciseWait

    def median_s(numel: int, tag: int) -> float:
        clock, times = PreciseWait(), []
        for i in range(_FIT_REPEATS + 3):
            clock.start()
            clock.wait(_FIT_GAP_S)
            flat = torch.zeros(numel)
            t = time.perf_counter()
            ring_reduce_scatter(group, flat, tag + 4 * i)
            all_gather(group, flat, tag + 4 * i + 2)
            times.append(time.perf_counter() - t)
        return statistics.median(times[3:])

    return alpha_beta(median_s(256, 20_000), median_s(max(256, size_bytes // 4), 40_000),
                      size_bytes, streaming_bytes_per_s)


def alpha_beta(tiny_s: float, sized_s: float, size_bytes: int,
               streaming_bytes_per_s: float) -> dict:
    """The p = 2 ring all-reduce's step cost (s) and rate (bytes/s) through a tiny one taking
    `tiny_s` and one of `size_bytes` taking `sized_s` (module docstring)."""
    floor = size_bytes / streaming_bytes_per_s if streaming_bytes_per_s > 0 else 1e-9
    return {"collective_step_s": tiny_s / 2,
            "bandwidth_bytes_per_s": size_bytes / max(sized_s - tiny_s, floor)}


def _collective_step_s(group: PointToPoint) -> float:
    """Seconds one ring step of the worker's own reduce-scatter and all-gather costs beyond its
    bytes: the alpha of the alpha-beta model, fitted on a tiny buffer (p = 2: one step each)."""
    from holmes_sim.backend.collectives import all_gather, ring_reduce_scatter

    flat = torch.zeros(256)
    times = []
    for i in range(_PINGS):
        t = time.perf_counter()
        ring_reduce_scatter(group, flat, 5000 + i)
        all_gather(group, flat, 9000 + i)
        times.append(time.perf_counter() - t)
    return statistics.median(times[3:]) / 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--interface", required=True)
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--realtime-priority", type=int, default=0,
                    help="SCHED_FIFO priority (0: default scheduler), as the ranks it stands for")
    ap.add_argument("--all-reduce", type=int, default=0, metavar="BYTES",
                    help="fit bandwidth and step cost to ring all-reduces of BYTES (module doc)")
    args = ap.parse_args(argv)
    from holmes_sim.backend.worker import set_realtime

    set_realtime(args.realtime_priority)
    result = probe(args.rank, args.store, args.interface, args.bytes, args.timeout,
                   args.all_reduce)
    Path(f"{args.out}.{args.rank}").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
