"""Collectives executed as flows on a `FlowNetwork`.

Ring collectives follow the ring algorithms of Thakur, Rabenseifner and Gropp (IJHPCA 2005) and
Patarasuk and Yuan (JPDC 2009): member i sends to member (i + 1) % p, 2(p-1) steps for
all-reduce and p-1 for reduce-scatter or all-gather, each step moving N / p bytes per member.
On an idle network whose hops all have bandwidth B, both execution modes below take exactly
`holmes_sim.cost.collectives.ring_collective_time_s`; when hops share links or differ in speed, the
ring runs at the pace of its slowest hop.

`nccl_collective` runs the algorithm and protocol NCCL picks (`cost.nccl_algorithms.choose`):
its latency, then each hop carries the algorithm's bytes for that hop (intra-node or node exit,
over the protocol's efficiency) concurrently, so on an idle network it takes the choice's
`time_s` and under load it shares links like any flow.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import simpy

from holmes_sim.cost.collectives import ring_latency_steps, ring_traffic_factor
from holmes_sim.cost.nccl_algorithms import Choice
from holmes_sim.sim.network import FlowNetwork, PathUse


def p2p(net: FlowNetwork, path: PathUse, size_bytes: float, latency_s: float) -> simpy.Event:
    """Point-to-point send of `size_bytes` bytes: latency_s seconds, then the bytes move."""
    return net.transfer(path, size_bytes, latency_s)


def ring_collective(
    env: simpy.Environment,
    net: FlowNetwork,
    kind: str,
    hops: Sequence[PathUse],
    size_bytes: float,
    latency_s: float,
    step_by_step: bool = False,
    members: int | None = None,
) -> Generator[simpy.Event, Any, None]:
    """SimPy process body of a ring collective; use as `env.process(ring_collective(...))`.

    `hops[i]` is the path from member i to member (i + 1) % p; `size_bytes` is N, the full
    buffer per member (for all-gather the gathered output); `latency_s` is the per-step
    latency alpha in seconds. Arguments are checked when called, before the process starts.

    Timing assumption, steady state (default): the 2(p-1) or p-1 step latencies are paid up
    front, then the p hops stream their whole share (2(p-1)/p or (p-1)/p of N bytes)
    concurrently, and the collective ends when the slowest hop finishes (pipelined ring).
    Step by step: each step pays latency_s, then the p hops send N / p bytes concurrently, and
    the next step starts when the slowest hop of this step finishes (synchronous steps).
    A single member returns at once. `members` is the ring's size p when `hops` are a symmetric
    simulation's representative hops (each standing for its class's hops), else len(hops).
    """
    p = len(hops) if members is None else members
    steps = ring_latency_steps(kind, p)
    if size_bytes < 0 or latency_s < 0:
        raise ValueError(f"size and latency must be >= 0, got {size_bytes}, {latency_s}")
    if step_by_step:
        return _ring_steps(env, net, hops, steps, size_bytes / p, latency_s)
    share = ring_traffic_factor(kind, p) * size_bytes
    return _ring_steady(env, net, hops, steps, share, latency_s)


def _ring_steady(
    env: simpy.Environment, net: FlowNetwork, hops: Sequence[PathUse], steps: int,
    share_bytes: float, latency_s: float,
) -> Generator[simpy.Event, Any, None]:
    """Pays steps * latency_s seconds, then sends `share_bytes` on every hop at once."""
    if steps == 0:
        return
    yield env.timeout(steps * latency_s)
    yield env.all_of([net.transfer(hop, share_bytes) for hop in hops])


def _ring_steps(
    env: simpy.Environment, net: FlowNetwork, hops: Sequence[PathUse], steps: int,
    chunk_bytes: float, latency_s: float,
) -> Generator[simpy.Event, Any, None]:
    """`steps` synchronous rounds: latency_s seconds, then `chunk_bytes` on every hop."""
    for _ in range(steps):
        yield env.timeout(latency_s)
        yield env.all_of([net.transfer(hop, chunk_bytes) for hop in hops])


def nccl_collective(
    env: simpy.Environment, net: FlowNetwork, choice: Choice, hops: Sequence[PathUse],
    exits: Sequence[bool], size_bytes: float,
) -> Generator[simpy.Event, Any, None]:
    """SimPy process body of a collective run as `choice` (`cost.nccl_algorithms`): pays its
    latency (s), then hop k sends `size_bytes` x its share (`exit_share` where `exits[k]`, the
    hop leaving a node, else `intra_share`) concurrently; ends when the slowest hop does."""
    if size_bytes < 0:
        raise ValueError(f"size must be >= 0, got {size_bytes}")
    if choice.time_s == 0.0:
        return
    yield env.timeout(choice.latency_s)
    yield env.all_of([net.transfer(hop, size_bytes * (choice.exit_share if out else
                                                      choice.intra_share))
                      for hop, out in zip(hops, exits, strict=True)])
