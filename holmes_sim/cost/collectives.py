"""Closed-form alpha-beta costs of point-to-point transfers and ring collectives.

Hockney's alpha-beta model: moving N bytes costs alpha + N / B (alpha: per-message latency in
seconds, B: bandwidth in bytes/s). Ring collectives over p members (Thakur, Rabenseifner and
Gropp, "Optimization of Collective Communication Operations in MPICH", IJHPCA 2005; Patarasuk
and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009):

- all-reduce = reduce-scatter + all-gather: 2(p-1) steps, 2(p-1)/p * N bytes sent per member,
  time 2(p-1) * alpha + 2(p-1)/p * N / B;
- reduce-scatter and all-gather: p-1 steps, (p-1)/p * N bytes per member,
  time (p-1) * alpha + (p-1)/p * N / B.

N is the full buffer size per member in bytes (for all-gather: the gathered output size).
Pure module: no SimPy. The network simulator reproduces these numbers exactly on an idle ring
with equal hop bandwidths (see `holmes_sim.sim.collectives`).
"""

from __future__ import annotations

RING_KINDS: tuple[str, ...] = ("all-reduce", "reduce-scatter", "all-gather")


def _check(kind: str, num_members: int) -> None:
    if kind not in RING_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {RING_KINDS}")
    if num_members < 1:
        raise ValueError(f"a ring needs at least 1 member, got {num_members}")


def ring_latency_steps(kind: str, num_members: int) -> int:
    """Sequential message steps of a ring collective: 2(p-1) for all-reduce, else p-1."""
    _check(kind, num_members)
    steps = num_members - 1
    return 2 * steps if kind == "all-reduce" else steps


def ring_traffic_factor(kind: str, num_members: int) -> float:
    """Bytes each member sends, as a multiple of N: 2(p-1)/p for all-reduce, else (p-1)/p."""
    return ring_latency_steps(kind, num_members) / num_members


def p2p_time_s(size_bytes: float, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Seconds to send `size_bytes` over one link: latency_s + size_bytes / bandwidth."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
    return latency_s + size_bytes / bandwidth_bytes_per_s


def ring_collective_time_s(
    kind: str,
    num_members: int,
    size_bytes: float,
    bandwidth_bytes_per_s: float,
    latency_s: float,
) -> float:
    """Seconds for a ring collective of `num_members` members on N = `size_bytes` per member.

    `bandwidth_bytes_per_s` is each hop's bandwidth, `latency_s` the per-step latency alpha.
    Returns 0.0 for a single member.
    """
    steps = ring_latency_steps(kind, num_members)
    if steps == 0:
        return 0.0
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
    traffic = ring_traffic_factor(kind, num_members) * size_bytes
    return steps * latency_s + traffic / bandwidth_bytes_per_s
