"""The SimPy engine: one training iteration of a Plan on a Cluster.

One simulated entity per (pipeline stage, DP replica): the TP group's GPUs run in lock-step, so
their traffic is one flow spread over their NICs (see `cost/paths.py`), and a 1,024-GPU job with TP 8
has 128 entities rather than 1,024 processes. Replicas that form a class of identical ones
(`symmetry.py`) run as one representative whose flows stand for the class; a flag forces every
replica (`EngineOptions.full_simulation`).

Timing assumptions (each entity):
- its compute stream runs the schedule's ops in order; an op starts when the previous op ended and
  its input (activation, or gradient from the next stage) has arrived; a forward or backward is
  followed by its TP all-reduces on the same stream (exposed, as in Megatron without overlap);
- with context parallelism each op also runs its CP exchange (`cost.context_parallel`) as flows
  from the entity to the next replica of its CP ring over the CP group's links: each ring step's
  transfer beside one step of attention compute (the step ends when both have), then any
  exchange that nothing overlaps (a2a, allgather); the wait beyond compute is `cp-comm`;
- with expert parallelism each op first runs its MoE layers' all-to-alls as flows to every EP
  peer, not overlapped (`sim.expert_exchange`, `ep-comm`);
- a finished op's output is sent asynchronously (a flow); sending does not block compute; a stage
  posts the receive of an op's input when it reaches the op, or with `overlap_p2p_comm` on the
  interleaved schedule when its previous op of the same kind (F or B) ends;
- data-parallel collectives run on one comm stream per stage (routed experts' on one per expert-
  data-parallel group, `sim.gradient_buckets`); when gradients are reduced during
  the backward (the overlapped distributed optimizer, or DDP-style `overlap_grad_reduce`) the last
  micro-batch's backward of each chunk releases gradient buckets as it goes (the reduction runs
  while computing, its GEMMs after the first release on the SMs NCCL leaves: `cost.ops`'s
  `released_share_s`); with the overlapped optimizer the first forward of each chunk also consumes
  parameter buckets as their all-gather completes (the all-gather of the previous step's update);
- with `defer_embedding_wgrad_compute` the last stage runs every micro-batch's output-layer
  weight gradient after its last backward, before its gradient sync;
- the iteration ends when every entity has finished its optimizer step (and, for the distributed
  and ZeRO-1 optimizers, its parameter all-gather).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import simpy

from holmes_sim.hardware.cluster import Cluster, Node
from holmes_sim.cost.compute import ComputeModel
from holmes_sim.collector import quiet_collector
from holmes_sim.cost.ops import OpCosts, released_share_s
from holmes_sim.cost.nccl_algorithms import gradient_op, leaves_node, with_nvls
from holmes_sim.cost.paths import Path, group_path, link_capacities, ring_paths
from holmes_sim.plan import Group, GroupKind, Plan
from holmes_sim.schedule import Op, ScheduleKind
from holmes_sim.sim import entity_steps, symmetry
from holmes_sim.sim.context_exchange import cp_exchange
from holmes_sim.sim.expert_exchange import ep_exchange
from holmes_sim.sim.gradient_buckets import Bucket, chunk_buckets, expert_data_streams, reduction_transports
from holmes_sim.sim.environment import (DETACHED, CountingEnvironment, Jitter, LeanProcess,
                                        fired_event, start_direct, via_process)
from holmes_sim.sim.flow_records import EVENT_TYPE
from holmes_sim.sim.network import FlowNetwork
from holmes_sim.sim.pipeline_messages import POSTED, PipelineMessages
from holmes_sim.sim.sync import Collectives, RingSpec, Stream
from holmes_sim.sim.trace import KIND_CODE, Entity, OpKind, Trace, append_row, append_rows
from holmes_sim.model.workload import Workload

_BUBBLE, _WAIT_PP, _TP_COMM = (KIND_CODE[k] for k in (OpKind.WAIT_BUBBLE, OpKind.WAIT_PP,
                                                      OpKind.TP_COMM))


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Engine switches.

    Attributes:
        step_by_step: ring collectives as 2(p-1) rounds instead of p steady-state flows.
        shared_cpu_cores: None for real accelerators (each entity computes independently). On an
            emulated testbed, where every rank is a process on one host, the number of cores the
            ranks share: compute ops then run as flows on a host "CPU" link of that capacity, each
            op at most one core (processor sharing: k busy ranks on C cores each progress at
            min(1, C/k) of their solo speed).
    """

    step_by_step: bool = False
    shared_cpu_cores: float | None = None
    compute_cv: float = 0.0
    """Coefficient of variation of compute op durations (0: deterministic). Each op's time is
    multiplied by a mean-1 log-normal factor drawn from the entity's own stream of `seed`."""
    seed: int = 0
    full_simulation: bool = False
    """Simulate every replica even where replicas form classes of identical ones (`symmetry.py`)."""


def simulate(plan: Plan, cluster: Cluster, workload: Workload, compute: ComputeModel,
             options: EngineOptions = EngineOptions()) -> Trace:
    """Simulate one iteration of `plan`; returns its trace (iteration time in `trace.iteration_s`).
    The set-up (per-replica signatures, paths, rings) makes many long-lived objects and no
    garbage: it runs without automatic collections and ends with its objects frozen too, so no
    collection traverses them (a young one would, once collections resume); the run, which
    makes many short-lived objects and few cycles, with every object alive before it frozen."""
    with quiet_collector(threshold=0, freeze_made=True):  # 0: no automatic collection
        sim = _Simulation(plan, cluster, workload, compute, options)
    with quiet_collector():
        return sim.run()


class _Simulation:
    def __init__(self, plan: Plan, cluster: Cluster, workload: Workload, compute: ComputeModel,
                 options: EngineOptions):
        self.plan, self.cluster, self.workload = plan, cluster, workload
        self.env = CountingEnvironment()
        # A copy of the capacities kept with the cluster (the estimate made them already).
        self.caps = dict(cluster.derived(("link capacities",), lambda: link_capacities(cluster)))
        self.cpu = options.shared_cpu_cores
        if self.cpu is not None:  # compute durations become core-seconds on a shared host
            self.caps[("cpu",)] = self.cpu
            self.caps.update({("core", s, d): 1.0 for s in range(plan.pp) for d in range(plan.dp)})
        self.net = FlowNetwork(self.env, self.caps)
        self.jitter = Jitter(options.compute_cv, options.seed, plan.pp, plan.dp)
        self.trace = Trace()
        self.coll = Collectives(self.env, self.net, self.trace, options.step_by_step)
        self.costs = OpCosts(cluster, workload, compute, plan.tp)
        self.schedule = plan.schedule()
        self.nv = self.schedule.num_virtual_stages
        self._paths: dict[tuple, Path] = {}
        self._dur_cache: dict[tuple, tuple[float, float]] = {}
        self._route_cache: dict[tuple, tuple[tuple, float, tuple]] = {}
        self._stage_cache: dict[int, tuple[list[tuple], list, list]] = {}
        self._node_cache: dict[tuple[int, int], frozenset[str]] = {}
        self.pp_bytes = workload.pp_message_bytes(plan.tp) * plan.tp
        self.early_receive = workload.overlap_p2p_comm and \
            ScheduleKind(plan.schedule_kind) is ScheduleKind.INTERLEAVED
        self._index_groups()
        self._build_entities()
        self._dp_rings = self._build_dp_rings()
        self._set_classes(options)
        self.messages = PipelineMessages(self.env, self.net, self.trace.rows, self.pp_bytes, self.nv,
                                         self.schedule.num_microbatches, self.classes.reps)
        self._build_streams()
        self.edp_stream = expert_data_streams(self)
        self.buckets = {(s, c): self._buckets(s, c) for s in range(plan.pp)
                        for c in range(plan.num_chunks)}

    # ---- set-up ------------------------------------------------------------------------------
    def _index_groups(self) -> None:
        self.group_by_first: dict[tuple[GroupKind, int], object] = {}
        self.pp_group: dict[tuple[int, int], object] = {}
        for g in self.plan.groups:
            self.group_by_first.setdefault((g.kind, g.ranks[0]), g)
            if g.kind is GroupKind.PIPELINE:
                self.pp_group[g.ranks] = g

    def _build_entities(self) -> None:
        p = self.plan
        self.entity: dict[tuple[int, int], Entity] = {}
        self._cpu_path: dict[str, tuple] = {}
        for s in range(p.pp):
            for d in range(p.dp):
                gpus = p.entity_gpus(s, d)
                node = self.cluster.node(gpus[0].node)
                e = Entity(f"s{s}.d{d}", s, d, node.name, node.cluster, tuple(map(str, gpus)))
                self.entity[(s, d)] = e
                self._cpu_path[e.name] = ((("cpu",), 1.0), (("core", s, d), 1.0))
                self.trace.entities.append(e)

    def _entity_path(self, group, a: tuple[int, int], b: tuple[int, int]) -> Path:
        key = (group.transport, a, b)
        path = self._paths.get(key)
        if path is None:
            path = self._paths[key] = group_path(self.cluster, group.transport,
                                                 self.plan.entity_gpus(*a),
                                                 self.plan.entity_gpus(*b), self.caps)
        return path

    def _build_dp_rings(self) -> dict[int, tuple[object, object]]:
        """Per stage with a DP group: (group, its NCCL ring over every replica)."""
        p = self.plan
        out = {}
        for s in range(p.pp):
            g = self.group_by_first.get((GroupKind.DATA, p.rank(s, 0, 0)))
            if g is not None:
                out[s] = (g, ring_paths(self.cluster, g.transport,
                                        [p.entity_gpus(s, d) for d in range(p.dp)], self.caps))
        return out

    def _build_streams(self) -> None:
        p, w = self.plan, self.costs.workload
        self.dp_stream: dict[int, Stream] = {}
        for s, (_, ring) in self._dp_rings.items():
            quotient = symmetry.quotient_hops(
                ring, self.classes.reps, self.classes.rep_of, lambda d, s=s: self._nodes(s, d),
                self.classes.weight)
            hops = tuple(self.net.resolve(h) for h in quotient)
            names = tuple(self.entity[(s, d)].name for d in self.classes.reps)
            self.dp_stream[s] = Stream(RingSpec(
                names, hops, ring.step_latency_s, p.dp, with_nvls(ring.topology, w.nvls_enable),
                tuple(map(leaves_node, quotient)), reduce_op=gradient_op(w.average_in_collective)))
        self.emb_stream: dict[int, Stream] = {}
        for d in self.classes.reps:
            g = self._embedding_group(d)
            if g is not None:
                self.emb_stream[d] = Stream(self._ring([(0, d), (p.pp - 1, d)], g,
                                                       self.classes.weight(d)))

    def _ring(self, members: list[tuple[int, int]], group, k: int = 1) -> RingSpec:
        """The group's NCCL ring (members node by node; see `cost.paths.ring_paths`), standing
        for `k` identical rings."""
        ring = ring_paths(self.cluster, group.transport,
                          [self.plan.entity_gpus(*m) for m in members], self.caps)
        return RingSpec(tuple(self.entity[m].name for m in members),
                        tuple(self.net.resolve(symmetry.scale_shared(h.links, k)) for h in ring.hops),
                        ring.step_latency_s)

    # ---- symmetry ------------------------------------------------------------------------------
    def _set_classes(self, options: EngineOptions) -> None:
        """Classes of identical replicas (`symmetry.py`); each simulated by its first member."""
        p = self.plan
        # CP rings and EP all-to-alls tie replicas to their peers, which the classes do not follow.
        if options.full_simulation or self.cpu is not None or self.jitter.rng or p.dp == 1 \
                or p.cp > 1 or self.costs.workload.ep > 1:
            members = symmetry.singletons(p.dp)
        else:
            members = symmetry.ReplicaSignatures(
                p, self.cluster, self.caps, nodes_of=self._nodes,
                dp_rings={s: ring for s, (_, ring) in self._dp_rings.items()},
                send_group=self._send_group, embedding_group=self._embedding_group,
                stage_costs=self._stage_costs_by_hardware()).classes()
        self.classes = symmetry.ReplicaClasses(members)
        for c in members:
            if len(c) > 1:
                for s in range(p.pp):
                    self.trace.members[self.entity[(s, c[0])].name] = tuple(
                        self.entity[(s, d)].name for d in c)

    def _stage_costs_by_hardware(self) -> Callable[[Node, int], tuple]:
        """`_stage_costs`, priced once per (GPU model, intra-node link, speed, stage): what
        `OpCosts` prices a node by (as `cost.ops.ChunkTimes` remembers it)."""
        memo: dict[tuple, tuple] = {}

        def costs(node: Node, s: int) -> tuple:
            key = (id(node.gpu), id(node.intra_link), node.speed, s)
            got = memo.get(key)
            if got is None:
                got = memo[key] = self._stage_costs(node, s)
            return got

        return costs

    def _nodes(self, s: int, d: int) -> frozenset[str]:
        """Nodes of entity (s, d), cached."""
        got = self._node_cache.get((s, d))
        if got is None:
            got = self._node_cache[(s, d)] = frozenset(g.node for g in self.plan.entity_gpus(s, d))
        return got

    def _send_group(self, kind: str, j_from: int, j_to: int, d: int) -> Group:
        """The pipeline group of replica d's send between virtual stages (keyed by forward pairs)."""
        p = self.plan
        s_from, s_to = j_from % p.pp, j_to % p.pp
        fwd = (s_from, s_to) if kind == "F" else (s_to, s_from)
        return self.pp_group[(p.rank(fwd[0], d, 0), p.rank(fwd[1], d, 0))]

    def _embedding_group(self, d: int) -> Group | None:
        """Replica d's embedding group (first and last stage), or None."""
        return self.group_by_first.get((GroupKind.EMBEDDING, self.plan.rank(0, d, 0)))

    def _stage_costs(self, node, s: int) -> tuple:
        """What prices stage s's work on `node`: each chunk's forward and backward (compute, TP)
        seconds, and the optimizer step's seconds."""
        chunks = tuple(self._durations(node, self.schedule.virtual_stage(s, c), b)
                       for c in range(self.plan.num_chunks) for b in (False, True))
        return chunks, self._optimizer_s(node, s)

    def _optimizer_s(self, node, s: int) -> float:
        """The step over the GPU's state shard (the experts' over their EDP group, `gradient_buckets`)
        and the passes over its whole gradient buffer (`OpCosts.gradient_buffer_s`)."""
        p, expert = self.plan, self.costs.stage_expert_params(self.plan.layers_per_stage, self.plan.pp, s)
        params = self.costs.stage_params(p.layers_per_stage, p.pp, s)
        shard = p.dp if p.optimizer.sharded else 1
        buffer = self.costs.gradient_buffer_s(node, params / p.tp)
        if expert == 0:
            return self.costs.optimizer_s(node, params / p.tp / shard) + buffer
        edp = p.dp // self.workload.ep_replicas if p.optimizer.sharded else 1
        return self.costs.optimizer_s(node, (params - expert) / p.tp / shard
                                      + expert / p.tp / edp) + buffer

    def _buckets(self, s: int, c: int) -> list[Bucket]:
        """Gradient buckets of chunk c of stage s in release order (`sim.gradient_buckets`)."""
        p = self.plan
        j = self.schedule.virtual_stage(s, c)
        return chunk_buckets(self.costs, p.layers_per_stage, j, (s, 0) in self.edp_stream,
                             p.optimizer.sharded,
                             p.bucket_numel(j, self.workload.given_bucket_numel))

    def _stream_of(self, s: int, d: int, b: Bucket):
        """The comm stream of entity (s, d) that reduces and gathers bucket `b`."""
        return self.edp_stream[(s, d % self.workload.ep_replicas)] if b.expert else self.dp_stream[s]

    # ---- run -----------------------------------------------------------------------------------
    def run(self) -> Trace:
        entity = self._entity if entity_steps.Steps is None else \
            lambda s, d, me: entity_steps.stepped(self, s, d, me)  # the common ops in C
        done = [start_direct(self.env, lambda me, s=s, d=d: entity(s, d, me))
                for s in range(self.plan.pp) for d in self.classes.reps]
        self.env.run_until(self.env.all_of(done))
        self.trace.iteration_s = self.env.now
        self.trace.flows = self.net.flows_started
        self.trace.events = self.env.events_processed
        return self.trace

    def _entity(self, s: int, d: int, me: list[LeanProcess]):
        """Process of one (stage, replica), `me[0]` (`environment.start_direct`): its schedule,
        then its gradient sync and step. The common op runs inline (receive, input wait, one
        timeout, rows, send), resumed by its events (one reused for compute, one for an unsent
        input), the others via `_special_op`, the last waits via the process; events in order."""
        name, node, gathers, steps, durations, (eid, cst), routes = self._entity_setup(s, d)
        reductions: list[simpy.Event] = []
        env, calendar, msgs = self.env, self.env.normal, self.messages
        base, state, arrival, sent_at = msgs.base(d), msgs.state, msgs.arrival, msgs.sent_at
        rows, append = self.trace.rows, append_row
        process = me[0]
        resume_me = [process._send]  # the callbacks of every event it waits for inline
        timeout, waiter = fired_event(EVENT_TYPE), fired_event(EVENT_TYPE)  # compute, an input
        for k, jb, mb, chunk, kcode, special, out, r, post in steps:
            if k is not None:  # the input: post its receive, then wait for its arrival
                k += base
                if state[k] is None:
                    state[k] = POSTED
                else:
                    msgs.post(k)  # its send waiting, or posted early
                ev = arrival[k]
                if ev is not None and ev.callbacks is None:  # arrived; each is consumed once
                    arrival[k] = sent_at[k] = None
                else:  # idle time split into bubble (producer not done) and exposed PP
                    if ev is None:  # not sent yet: its arrival event
                        ev = arrival[k] = waiter
                    ev.callbacks = resume_me  # its only waiter
                    t0 = env._now
                    yield DETACHED
                    now = env._now
                    sent, arrival[k], sent_at[k] = sent_at[k], None, None
                    split = t0 if sent is None or t0 > sent else sent  # max(sent, t0), min(., now)
                    split = now if now < split else split
                    if split > t0:
                        append(rows, t0, split, 0.0, eid, mb, chunk, cst, _BUBBLE)
                    if now > split:
                        append(rows, split, now, 0.0, eid, mb, chunk, cst, _WAIT_PP)
            dur, tp = durations[jb]
            if special is None:  # one timeout of the op's compute and TP seconds
                start = env._now
                timeout.callbacks = resume_me
                at = start + (dur + tp)
                bucket = calendar.get(at)
                if bucket is None:
                    bucket = env.new_bucket(at)
                bucket.append(timeout)
                yield DETACHED
                if tp > 0:  # the op's row and its TP row, packed together
                    append_rows(rows, start, start + dur, 0.0, eid, mb, chunk, cst, kcode,
                                start + dur, env._now, 0.0, eid, mb, chunk, cst, _TP_COMM)
                else:
                    append(rows, start, start + dur, 0.0, eid, mb, chunk, cst, kcode)
            else:
                reductions += (yield from via_process(
                    self._special_op(name, node, s, d, special, dur, tp, gathers), process))
            if out is not None:
                msgs.send(out + base, routes[r], mb, chunk)
            if post is not None:
                msgs.post(post + base)
        yield from via_process(self._finish(name, node, s, d, reductions), process)

    def _entity_setup(self, s: int, d: int) -> tuple:
        """Entity (s, d)'s name, node, submitted parameter gathers (by chunk), its stage's steps
        (`_stage_steps`), their durations on its node, its compute rows' (entity, stream)
        indices and its sends' routes (the first entity's register the trace's "pp" stream
        right after "compute", as its first op's send would)."""
        name = self.entity[(s, d)].name
        node = self.cluster.node(self.entity[(s, d)].node)
        overlapped = self.plan.optimizer.gathers_before_forward and s in self.dp_stream
        gathers = self._submit_gathers(s, d, name) if overlapped else {}
        steps, durations, route_keys = self._stage_steps(s)
        ids = self.trace.ids(name, "compute")
        return name, node, gathers, steps, [self._durations(node, j, backward)
                                            for j, backward in durations], \
            ids, [self._pp_route(*key, d) for key in route_keys]

    def _stage_steps(self, s: int) -> tuple[list[tuple], list[tuple[int, bool]], list[tuple]]:
        """Stage s's ops, cached, as (steps, the (virtual stage, backward) pairs whose durations
        the steps index, the (kind, virtual stage, virtual stage sent to) the sends' routes
        are indexed by). A step is (input message's `PipelineMessages.local_id` or None,
        durations index, micro-batch, chunk, kind code, (op, kind, virtual stage, whether its
        compute waits for gathers, whether it releases gradients) where `_special_op` runs it
        else None, its output message's local id or None, routes index, local id of the message
        whose receive it posts early or None)."""
        got = self._stage_cache.get(s)
        if got is not None:
            return got
        overlapped = self.plan.optimizer.gathers_before_forward and s in self.dp_stream
        release = self.plan.releases_gradients_in_backward and s in self.dp_stream
        every_microbatch = self.plan.optimizer.reduces_every_microbatch
        last_b = self._last_backward_per_chunk(s)
        first_f = self._first_forward_per_chunk(s)
        general = self.cpu is not None or bool(self.jitter.rng) or self.plan.cp > 1 \
            or self.costs.workload.ep > 1
        ops = self.schedule.stage_ops[s]
        next_alike = _next_of_same_kind(ops) if self.early_receive else [None] * len(ops)
        last, local = self.nv - 1, self.messages.local_id
        steps, durations, routes = [], {}, {}
        for op, after in zip(ops, next_alike, strict=True):
            if not 0 <= op.microbatch < self.schedule.num_microbatches:
                raise ValueError(f"op {op} of stage {s}: micro-batch out of range")
            j = self.schedule.virtual_stage(s, op.chunk)
            backward = op.kind == "B"
            kind = OpKind.BACKWARD if backward else OpKind.FORWARD
            gated = overlapped and not backward and first_f[op.chunk] == op
            releasing = release and backward and (last_b[op.chunk] == op or every_microbatch)
            first, end = (0, last) if not backward else (last, 0)
            to = None if j == end else (j - 1 if backward else j + 1)
            post = None if after is None else ops[after]
            post_j = None if post is None else self.schedule.virtual_stage(s, post.chunk)
            steps.append((
                local(op.kind, j, op.microbatch) if j != first else None,
                durations.setdefault((j, backward), len(durations)), op.microbatch, op.chunk,
                KIND_CODE[kind],
                (op, kind, j, gated, releasing) if general or gated or releasing else None,
                None if to is None else local(op.kind, to, op.microbatch),
                None if to is None else routes.setdefault((op.kind, j, to), len(routes)),
                None if post is None or post_j == (0 if post.kind == "F" else last)
                else local(post.kind, post_j, post.microbatch)))
        got = self._stage_cache[s] = (steps, list(durations), list(routes))
        return got

    def _special_op(self, name: str, node, s: int, d: int, special: tuple, dur: float,
                    tp: float, gathers: dict):
        """An op with EP all-to-alls, CP exchanges, parameter gathers, gradient releases, jitter
        or a shared host; returns the gradient reductions it submitted."""
        op, kind, j, gated, releasing = special
        if self.costs.workload.ep > 1:
            yield from ep_exchange(self, name, s, d, node, op, self.plan.layers_per_stage[j])
        if self.plan.cp > 1:
            ran = yield from cp_exchange(self, name, s, d, node, op, kind,
                                         self.plan.layers_per_stage[j])
            dur = max(0.0, dur - ran)
        if gated:
            yield from self._gated_compute(name, op, kind, dur, tp, gathers[op.chunk])
        elif releasing:
            loss = self.costs.held_sm_loss_s(node, reduction_transports(self, s, d),
                                             self.plan.layers_per_stage[j], j == self.nv - 1)
            return (yield from self._releasing_compute(name, s, d, op, kind, dur, tp, loss))
        else:
            yield from self._compute(name, op, kind, dur, tp)
        return []

    def _durations(self, node, j: int, backward: bool) -> tuple[float, float]:
        """(compute, TP all-reduce) seconds of virtual stage j's op on `node`, cached by what
        `OpCosts` prices a node by (as `cost.ops.ChunkTimes` remembers it)."""
        key = (id(node.gpu), id(node.intra_link), node.speed, j, backward)
        got = self._dur_cache.get(key)
        if got is None:
            layers = self.plan.layers_per_stage[j]
            got = self._dur_cache[key] = (
                self.costs.chunk_compute_s(node, layers, j == 0, j == self.nv - 1, backward),
                self.costs.tp_comm_s(node, layers, backward))
        return got

    def _compute(self, name: str, op: Op, kind: OpKind, dur: float, tp: float = 0.0):
        """Compute for `dur` seconds, then the op's TP all-reduces for `tp` seconds (one wait).
        On a shared-CPU testbed the op is `dur + tp` core-seconds of work on the host's cores."""
        start = self.env.now
        yield self._work(name, dur + tp)
        if self.cpu is not None and dur + tp > 0:  # stretched by sharing: split in proportion
            dur = (self.env.now - start) * dur / (dur + tp)
        self.trace.op(start, start + dur, name, "compute", kind, 0, op.microbatch, op.chunk)
        if tp > 0:
            self.trace.op(start + dur, self.env.now, name, "compute", OpKind.TP_COMM,
                          0, op.microbatch, op.chunk)

    def _work(self, name: str, seconds: float) -> simpy.Event:
        """An event after `seconds` of compute: a timeout, or core-seconds on a shared host."""
        if self.jitter.rng:
            seconds *= self.jitter.factor(name)
        if self.cpu is None:
            return self.env.timeout(seconds)
        return self.net.transfer(self._cpu_path[name], seconds)

    def _gated_compute(self, name: str, op: Op, kind: OpKind, dur: float, tp: float,
                       gathers: list[tuple[simpy.Event, float]]):
        """First forward of a chunk: each bucket's share of compute waits for its all-gather."""
        for ev, fraction in gathers:
            if not ev.processed:
                t0 = self.env.now
                yield ev
                self.trace.op(t0, self.env.now, name, "compute", OpKind.WAIT_DP, 0,
                              op.microbatch, op.chunk)
            yield from self._compute(name, op, kind, dur * fraction, tp * fraction)

    def _releasing_compute(self, name: str, s: int, d: int, op: Op, kind: OpKind, dur: float,
                           tp: float, loss: float):
        """A backward that releases gradients (a chunk's last, or every one with a per-micro-batch
        optimizer): each bucket is reduced once its share is done (buckets become ready in
        reverse layer order, Megatron's DDP bucketing); the shares after the first run their
        GEMMs beside the reductions' NCCL kernels (`cost.ops.released_share_s`, of the op's
        `loss` s)."""
        events = []
        for k, b in enumerate(self.buckets[(s, op.chunk)]):
            yield from self._compute(name, op, kind, dur * b.fraction +
                                     released_share_s(loss, b.fraction, k == 0), tp * b.fraction)
            events.append(self.coll.submit(self._stream_of(s, d, b), name, self._grad_kind,
                                           b.grad_bytes))
        return events

    def _submit_gathers(self, s: int, d: int, name: str
                        ) -> dict[int, list[tuple[simpy.Event, float]]]:
        """Gathers before the forward: the previous step's parameter all-gathers, in forward
        order (the buckets' reverse, Megatron-Core's `next_param_gather_bucket_group`)."""
        return {c: [(self.coll.submit(self._stream_of(s, d, b), name, OpKind.DP_ALL_GATHER,
                                      b.param_bytes), b.fraction)
                    for b in reversed(self.buckets[(s, c)])] for c in range(self.plan.num_chunks)}

    def _pp_route(self, kind: str, j_from: int, j_to: int, d: int) -> tuple[tuple, float, tuple]:
        """(links, latency s, the sender's (entity, stream) indices in the trace) of a transfer,
        cached; the links stand for the transfers of replica d's whole class."""
        key = (kind, j_from, j_to, d)
        got = self._route_cache.get(key)
        if got is None:
            path = self._pp_path(kind, j_from, j_to, d)
            links = symmetry.scale_shared(path.links, self.classes.weight(d))
            sender = self.trace.ids(self.entity[(j_from % self.plan.pp, d)].name, "pp")
            got = self._route_cache[key] = (self.net.resolve(links), path.latency_s, sender)
        return got

    def _pp_path(self, kind: str, j_from: int, j_to: int, d: int) -> Path:
        """Path of one replica's transfer between virtual stages."""
        group = self._send_group(kind, j_from, j_to, d)
        return self._entity_path(group, (j_from % self.plan.pp, d), (j_to % self.plan.pp, d))

    def _last_backward_per_chunk(self, s: int) -> dict[int, Op]:
        return {op.chunk: op for op in self.schedule.stage_ops[s] if op.kind == "B"}

    def _first_forward_per_chunk(self, s: int) -> dict[int, Op]:
        out: dict[int, Op] = {}
        for op in self.schedule.stage_ops[s]:
            if op.kind == "F":
                out.setdefault(op.chunk, op)
        return out

    # ---- end of iteration ------------------------------------------------------------------------
    def _finish(self, name: str, node, s: int, d: int, reductions: list[simpy.Event]):
        """Gradient sync, embedding all-reduce, optimizer step, and (no overlap) all-gather."""
        mode = self.plan.optimizer
        stream = self.dp_stream.get(s)
        yield from self._deferred_wgrad(name, node, s)
        if stream is not None and mode.reduces_gradients and \
                not self.plan.releases_gradients_in_backward:
            reductions = [self.coll.submit(self._stream_of(s, d, b), name, self._grad_kind,
                                           b.grad_bytes)
                          for c in range(self.plan.num_chunks) for b in self.buckets[(s, c)]]
        yield from self._wait_all(name, reductions)
        emb = self.emb_stream.get(d)
        if emb is not None and s in (0, self.plan.pp - 1):
            size = self.workload.grad_bytes_of(self.workload.vocab * self.workload.hidden)
            yield from self._wait_all(name, [self.coll.submit(emb, name, OpKind.EMBEDDING_ALL_REDUCE, size)])
        start = self.env.now
        yield self._work(name, self._optimizer_s(node, s))
        self.trace.op(start, self.env.now, name, "compute", OpKind.OPTIMIZER)
        if stream is not None and mode.gathers_after_step:
            gathers = [self.coll.submit(self._stream_of(s, d, b), name, OpKind.DP_ALL_GATHER,
                                        b.param_bytes)
                       for c in range(self.plan.num_chunks) for b in self.buckets[(s, c)]]
            yield from self._wait_all(name, gathers)

    def _deferred_wgrad(self, name: str, node, s: int):
        """The last stage's deferred output-layer weight gradients, every micro-batch's, after
        its last backward and before its gradient sync (`OpCosts.deferred_wgrad_s`)."""
        seconds = self.plan.num_microbatches * self.costs.deferred_wgrad_s(node) \
            if s == self.plan.pp - 1 else 0.0
        if seconds > 0:
            start = self.env.now
            yield self._work(name, seconds)
            self.trace.op(start, self.env.now, name, "compute", OpKind.BACKWARD)

    @property
    def _grad_kind(self) -> OpKind:
        return OpKind.DP_ALL_REDUCE if self.plan.optimizer.gradient_collective == "all-reduce" \
            else OpKind.DP_REDUCE_SCATTER

    def _wait_all(self, name: str, events: list[simpy.Event]):
        pending = [e for e in events if not e.processed]
        if pending:
            t0 = self.env.now
            yield self.env.all_of(pending)
            self.trace.op(t0, self.env.now, name, "compute", OpKind.WAIT_DP)


def _next_of_same_kind(ops: tuple[Op, ...]) -> list[int | None]:
    """For each op of a stage, the index of the stage's next op of the same kind (F or B)."""
    out: list[int | None] = [None] * len(ops)
    following: dict[str, int] = {}
    for i in range(len(ops) - 1, -1, -1):
        out[i] = following.get(ops[i].kind)
        following[ops[i].kind] = i
    return out
