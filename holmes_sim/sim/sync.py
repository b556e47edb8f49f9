"""Collective rendezvous on simulated comm streams.

A collective starts when every member has submitted it and the previous collective on the same
stream has finished (one NCCL stream per group serialises its collectives); then it runs on the
flow network. Each member gets an event that fires when the collective ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import simpy

from holmes_sim.cost.collectives import ring_latency_steps
from holmes_sim.cost.nccl_algorithms import CollectiveTopology, choose
from holmes_sim.cost.paths import PathUse
from holmes_sim.sim.collectives import nccl_collective, ring_collective
from holmes_sim.sim.network import FlowNetwork
from holmes_sim.sim.trace import KIND_CODE, OpKind, Trace, append_row

_KIND_NAME = {
    OpKind.DP_ALL_REDUCE: "all-reduce", OpKind.DP_REDUCE_SCATTER: "reduce-scatter",
    OpKind.DP_ALL_GATHER: "all-gather", OpKind.EMBEDDING_ALL_REDUCE: "all-reduce",
}


@dataclass(slots=True)
class RingSpec:
    """A ring group: member entity names, hop paths member i -> i+1, per-step latency (s).

    In a symmetric simulation `members` are the representatives that take part, each hop
    stands for its class's hops, and `size` is the ring's full member count."""

    members: tuple[str, ...]
    hops: tuple[PathUse, ...]
    latency_s: float
    size: int = 0
    topology: CollectiveTopology | None = None
    """Set: NCCL picks the algorithm (`cost.nccl_algorithms`); None: always the ring."""
    exits: tuple[bool, ...] = ()
    """Per hop, whether it leaves a node (with `topology`)."""
    trace_stream: str = "dp"
    """The members' trace stream its collectives are recorded on."""
    reduce_op: str = "sum"
    """The reduction op of its reductions (`cost.nccl_algorithms.OPS`; a DP ring's
    `nccl_algorithms.gradient_op`); its all-gathers reduce nothing."""

    @property
    def p(self) -> int:
        """Members of the whole ring."""
        return self.size or len(self.members)


@dataclass(slots=True)
class _Pending:
    arrived: int
    done: simpy.Event


@dataclass(slots=True)
class Stream:
    """One comm stream of one ring group: collectives run one after another, in submit order."""

    ring: RingSpec
    tail: simpy.Event | None = None
    pending: dict[int, _Pending] = field(default_factory=dict)
    submitted: dict[str, int] = field(default_factory=dict)


class Collectives:
    """Rendezvous and execution of ring collectives for all streams of a simulation."""

    def __init__(self, env: simpy.Environment, net: FlowNetwork, trace: Trace, step_by_step: bool):
        self.env, self.net, self.trace, self.step_by_step = env, net, trace, step_by_step
        self._member_ids: dict[tuple[tuple[str, ...], str], list[tuple[int, int]]] = {}

    def submit(self, stream: Stream, member: str, kind: OpKind, size_bytes: float) -> simpy.Event:
        """Member `member` enqueues its next collective on `stream`; returns its completion event.

        Members must submit the same sequence of collectives (as NCCL requires).
        """
        index = stream.submitted.get(member, 0)
        stream.submitted[member] = index + 1
        p = stream.pending.get(index)
        if p is None:
            p = stream.pending[index] = _Pending(0, self.env.event())
        p.arrived += 1
        if p.arrived == len(stream.ring.members):
            del stream.pending[index]
            previous, stream.tail = stream.tail, p.done
            self.env.process(self._run(stream, previous, kind, size_bytes, p.done))
        return p.done

    def _run(self, stream: Stream, previous: simpy.Event | None, kind: OpKind, size_bytes: float,
             done: simpy.Event):
        """Waits for the stream's previous collective, then runs the ring; no compute overlap
        assumption is made here (the caller decides whether to wait on `done`)."""
        if previous is not None and not previous.processed:
            yield previous
        start = self.env.now
        ring = stream.ring
        choice = None if ring.topology is None else choose(ring.topology, _KIND_NAME[kind],
                                                           size_bytes, ring.reduce_op)
        if choice is None or self.step_by_step and \
                (choice.algorithm, choice.protocol) == ("ring", "Simple"):
            # Synchronous steps; a picked ring's steps share its hierarchical latency.
            latency = ring.latency_s if choice is None else \
                choice.latency_s / ring_latency_steps(_KIND_NAME[kind], ring.p)
            yield self.env.process(ring_collective(self.env, self.net, _KIND_NAME[kind],
                                                   ring.hops, size_bytes, latency,
                                                   self.step_by_step, ring.p))
        else:
            yield self.env.process(nccl_collective(self.env, self.net, choice, ring.hops,
                                                   ring.exits, size_bytes))
        per_member, now, code = _traffic(kind, ring.p, size_bytes), self.env.now, KIND_CODE[kind]
        rows = self.trace.rows
        for e, st in self._ids(ring.members, ring.trace_stream):  # `Trace.op` of each member, ids looked up once
            append_row(rows, start, now, per_member, e, -1, 0, st, code)
        done.succeed()

    def _ids(self, members: tuple[str, ...], stream: str) -> list[tuple[int, int]]:
        """Each member's (entity, `stream`) indices in the trace, cached."""
        got = self._member_ids.get((members, stream))
        if got is None:
            got = self._member_ids[(members, stream)] = [self.trace.ids(m, stream) for m in members]
        return got


def _traffic(kind: OpKind, p: int, size_bytes: float) -> float:
    factor = 2 * (p - 1) / p if _KIND_NAME[kind] == "all-reduce" else (p - 1) / p
    return factor * size_bytes
