"""Measure a fabric's achieved point-to-point throughput (bytes/s) and latency (s) with gloo, the
same library and interface the real run uses, between two emulated nodes.

Run as two processes (`python -m holmes_sim.backend.calibrate_links ...`), one per node:
- latency: half the median round trip of a 4-byte ping-pong;
- throughput: rank 0 sends `size_bytes` to rank 1, which answers with a 4-byte ack; the bytes
  over (elapsed - one latency), median of several sends.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from holmes_sim.backend.groups import gloo_group

_PINGS = 30
_SENDS = 3


def probe(rank: int, store_path: str, interface: str, size_bytes: int, timeout_s: float) -> dict:
    """One side of the probe; rank 0 returns the figures."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    pg, _ = gloo_group(store, "probe", rank, 2, interface, timeout_s)
    peer = 1 - rank
    small = torch.zeros(1)
    rtts = []
    for i in range(_PINGS + 3):
        t = time.perf_counter()
        if rank == 0:
            pg.send([small], peer, i).wait()
            pg.recv([small], peer, i).wait()
        else:
            pg.recv([small], peer, i).wait()
            pg.send([small], peer, i).wait()
        if i >= 3:  # the first exchanges set up connections
            rtts.append(time.perf_counter() - t)
    latency = statistics.median(rtts) / 2
    big = torch.zeros(size_bytes // 4)
    rates = []
    for i in range(_SENDS):
        tag = 1000 + i
        t = time.perf_counter()
        if rank == 0:
            pg.send([big], peer, tag).wait()
            pg.recv([small], peer, tag).wait()
            rates.append(big.numel() * 4 / max(time.perf_counter() - t - latency, 1e-9))
        else:
            pg.recv([big], peer, tag).wait()
            pg.send([small], peer, tag).wait()
    return {"latency_s": latency, "bandwidth_bytes_per_s": statistics.median(rates) if rates else 0.0,
            "rtt_samples": len(rtts), "size_bytes": size_bytes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--interface", required=True)
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = probe(args.rank, args.store, args.interface, args.bytes, args.timeout)
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
