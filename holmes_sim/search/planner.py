"""`holmes-sim plan`: search parallel layouts, schedules and placements for a cluster.

For every layout (TP inside a node, PP, CP, DP, micro-batch, schedule and virtual stages, recompute,
sequence parallelism) allowed by the scenario's `search:` block, every policy of the search builds
its plan (placement, groups, partition, optimizer). Plans that do not fit in GPU memory are kept
with the reason and ranked apart; the rest are ranked by the contention-free analytic estimate
(`analytic.estimate_iteration`), and the best `top_k` are confirmed by the discrete-event
simulation, whose time then replaces the estimate. The baseline is the best Megatron-LM default
layout (policy `megatron`), so a speed-up compares the best each placement can do.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from holmes_sim.collector import quiet_collector
from holmes_sim.errors import FieldError, HolmesError
from holmes_sim.memo import IdentityMemo
from holmes_sim.plan import OptimizerMode
from holmes_sim.policies import searched_schedules
from holmes_sim.prepare import (Prepared, check_context_in, check_expert, check_expert_tensor,
                                check_micro_batch, check_pipeline, check_search_values,
                                check_tensor)
from holmes_sim.search.rejections import (Reject, Rejections, check_chunks, passes,
                                          sequence_parallel_values)
from holmes_sim.search.workers import collect_in_order, fork_pool
from holmes_sim.schedule import ScheduleKind
from holmes_sim.spec.load import located
from holmes_sim.spec.scenario import SearchSpec
from holmes_sim.model.workload import Workload, build_workload

BASELINE_POLICY = "megatron"
SCENARIO_OPTIMIZER_POLICIES = ("megatron",)
"""Policies whose optimizer comes from the scenario (the others fix their framework's)."""
_MAX_TP, _MAX_PP, _MICRO_BATCHES = 8, 64, (1, 2, 4, 8, 16)
MAX_CANDIDATES = 50_000
"""Most candidates (layout x policy x optimizer) a search evaluates unless raised with
`--max-candidates`: each takes a few milliseconds on one core, so the default stays within
minutes (a bundled scenario has about 10,000)."""
_COUNT_CAP = 100
"""A search space is counted up to this many times the limit, then reported as 'more than'."""


@dataclass(frozen=True, slots=True)
class Layout:
    """One point of the search space (the policy-independent part of a plan)."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    schedule: str
    virtual_stages: int
    recompute: str
    sequence_parallel: bool
    optimizer: str = "distributed"
    """For policies that take the scenario's optimizer: replicated | distributed |
    distributed-overlap | distributed-overlap-gather."""
    cp: int = 1
    """Context-parallel degree (`dp` is the data-parallel degree; GPUs = tp pp cp dp)."""
    ep: int = 1
    """Expert-parallel degree: each `ep` consecutive of the dp x cp replicas an EP group."""
    etp: int | None = None
    """The experts' TP degree (MoE models; None for a dense model)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A policy's plan for a layout and its figures (seconds, TFLOP/s, GiB)."""

    policy: str
    layout: Layout
    optimizer: str
    layers_per_stage: tuple[int, ...]
    predicted_iteration_s: float
    tflops_per_gpu: float
    peak_memory_gib: float
    fits_memory: bool
    simulated: bool = False
    reason: str = ""
    breakdown_s: tuple[tuple[str, float], ...] = ()
    """Where the simulated iteration goes (only for simulated candidates)."""
    overlap_grad_reduce: bool = False
    """The plan's own `--overlap-grad-reduce` flag, on top of `optimizer`; `to_json` says whether
    the reduction overlaps the backward at all (this flag, or an optimizer that reduces there)."""
    excess_gib: float = 0.0
    """For a plan that does not fit: how far its fullest stage is over its GPUs' memory."""

    def to_json(self) -> dict:
        lay, mode = self.layout, OptimizerMode(self.optimizer) if self.optimizer else None
        return {"policy": self.policy, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "cp": lay.cp,
                "ep": lay.ep, **({"etp": lay.etp} if lay.etp is not None else {}),
                "micro_batch_size": lay.micro_batch_size, "schedule": lay.schedule,
                "virtual_stages": lay.virtual_stages, "recompute": lay.recompute,
                "sequence_parallel": lay.sequence_parallel, "optimizer": self.optimizer,
                "overlap_grad_reduce": self.overlap_grad_reduce or (  # Plan.releases_gradients_in_backward
                    mode is not None and (mode.overlapped or mode.reduces_every_microbatch)),
                "layers_per_stage": list(self.layers_per_stage),
                "predicted_iteration_s": self.predicted_iteration_s,
                "tflops_per_gpu": self.tflops_per_gpu, "peak_memory_gib": self.peak_memory_gib,
                "fits_memory": self.fits_memory, "simulated": self.simulated,
                **({"reason": self.reason} if self.reason else {}),
                **({"breakdown_s": dict(self.breakdown_s)} if self.breakdown_s else {})}


@dataclass(frozen=True, slots=True)
class PlanSearch:
    """The ranked outcome: best first, the baseline, what did not fit, and the cost of the search."""

    scenario: str
    candidates: tuple[Candidate, ...]
    baseline: Candidate | None
    infeasible: tuple[Candidate, ...]
    evaluated: int
    elapsed_s: float

    def speedup(self, c: Candidate) -> float | None:
        """Speed-up over the best Megatron-LM default layout."""
        if self.baseline is None:
            return None
        return self.baseline.predicted_iteration_s / c.predicted_iteration_s

    def to_json(self) -> dict:
        return {"scenario": self.scenario, "evaluated": self.evaluated, "elapsed_s": self.elapsed_s,
                "baseline": None if self.baseline is None else self.baseline.to_json(),
                "candidates": [c.to_json() for c in self.candidates],
                "infeasible": [c.to_json() for c in self.infeasible]}


def layouts(prepared: Prepared, search: SearchSpec, reject: Reject | None = None) -> Iterator[Layout]:
    """Every valid layout the search block allows, in a deterministic order. Each check is
    `prepare`'s (`check_search_values` refuses a value no layout can take); `reject`, when given,
    hears each partial layout a check drops and why (`rejections.Rejections`)."""
    s, n = prepared.scenario, prepared.cluster.num_gpus
    nodes = tuple({node.num_gpus for node in prepared.cluster.nodes})
    tps = _allowed(search.tensor, "search.tensor",
                   [t for t in range(1, _MAX_TP + 1) if min(nodes) % t == 0])
    pps = _allowed(search.pipeline, "search.pipeline", list(range(1, _MAX_PP + 1)))
    mbs = _allowed(search.micro_batch_size, "search.micro_batch_size", list(_MICRO_BATCHES))
    for tp in tps:
        if not passes(reject, (("tensor", tp),), check_tensor, s, tp, nodes):
            continue
        for pp in pps:
            if not passes(reject, (("tensor", tp), ("pipeline", pp)), check_pipeline, s, pp, n, tp):
                continue
            for cp in _contexts(prepared, search, tp, pp, reject):
                dp = n // (tp * pp * cp)
                for mb, ep in ((mb, ep) for mb in mbs for ep in _experts(prepared, search)):
                    where = (("tensor", tp), ("pipeline", pp), ("context", cp), ("data", dp),
                             ("micro_batch_size", mb))
                    if not passes(reject, where, check_micro_batch, s, mb, dp):
                        continue
                    m = s.training.global_batch_size // (mb * dp)
                    for etp in _expert_tps(prepared, search, tp, dp * cp, ep, reject, where):
                        yield from _variants(prepared, search, tp, pp, dp, mb, m, cp, ep, etp,
                                             reject)


def _contexts(prepared: Prepared, search: SearchSpec, tp: int, pp: int,
              reject: Reject | None = None) -> Iterator[int]:
    """The CP degrees of `search.context` (default: the scenario's) that divide the GPUs left
    by tensor x pipeline and that Megatron-Core runs with this model and training
    (`prepare.check_context_in`)."""
    s, n = prepared.scenario, prepared.cluster.num_gpus
    for cp in _allowed(search.context, "search.context", [s.parallel.context]):
        if passes(reject, (("tensor", tp), ("pipeline", pp), ("context", cp)), check_context_in,
                   s, cp, tp, pp, n):
            yield cp


def _experts(prepared: Prepared, search: SearchSpec) -> list[int]:
    """The EP degrees of `search.expert` (default: the scenario's); `_expert_tps` keeps those
    that Megatron-Core runs with this model and layout."""
    return _allowed(search.expert, "search.expert", [prepared.scenario.parallel.expert])


def _expert_tps(prepared: Prepared, search: SearchSpec, tp: int, replicas: int, ep: int,
                reject: Reject | None = None, where: tuple = ()) -> Iterator[int | None]:
    """The experts' TP degrees of `search.expert_tensor` (default: tp and 1) with which EP `ep`
    runs at TP `tp` on `replicas` (data x context) replicas (`prepare.check_expert_tensor`);
    for a dense model None, when `prepare.check_expert` takes ep. `where`: the partial layout."""
    s = prepared.scenario
    if s.model.num_experts is None:
        if passes(reject, (*where, ("expert", ep)), check_expert, s, ep, replicas):
            yield None
        return
    for etp in _allowed(search.expert_tensor, "search.expert_tensor", sorted({tp, 1}, reverse=True)):
        if passes(reject, (*where, ("expert", ep), ("expert_tensor", etp)), check_expert_tensor,
                   s, ep, replicas, tp, etp):
            yield etp


def _variants(prepared, search, tp, pp, dp, mb, m, cp=1, ep=1, etp=None,
              reject: Reject | None = None) -> Iterator[Layout]:
    """The layouts of these degrees and micro-batches: each schedule, chunk count, recompute
    mode and sequence parallelism the search lists that Megatron-LM runs with them."""
    scenario = prepared.scenario
    layers = scenario.model.num_layers
    for schedule in grid_schedules(search):
        chunks = search.virtual_stages if schedule == "interleaved" else (1,)
        for v in chunks:
            where = (("tensor", tp), ("pipeline", pp), ("context", cp), ("data", dp),
                     ("micro_batch_size", mb), ("expert", ep), ("expert_tensor", etp),
                     ("schedule", schedule), ("virtual_stages", v))
            if not passes(reject, where, check_chunks, layers, schedule, pp, m, v):
                continue
            sps = sequence_parallel_values(scenario, search, tp, cp, mb, where, reject)
            for rc in search.recompute:
                for sp in sps:
                    yield Layout(tp, pp, dp, mb, schedule, v, rc, sp, cp=cp, ep=ep, etp=etp)


def grid_schedules(search: SearchSpec) -> tuple[str, ...]:
    """The schedules of the search's layouts: `search.schedule` as listed, else in
    `ScheduleKind`'s order those of its policies' frameworks (`policies.searched_schedules`)."""
    if search.schedule is not None:
        return search.schedule
    wanted = {k for p in search.policies for k in searched_schedules(search.schedule, p)}
    return tuple(k.value for k in ScheduleKind if k.value in wanted)


def _allowed(values: tuple[int, ...] | None, path: str, default: list[int]) -> list[int]:
    if values is None:
        return default
    bad = [v for v in values if not 1 <= v <= 1024]
    if bad:
        raise FieldError(path, f"values must be whole numbers from 1 to 1024, got {bad[0]}")
    return sorted(set(values))


_PREPARED: dict[tuple, tuple[Prepared, Prepared]] = {}
"""`prepared_for`'s results by (id of the prepared scenario, layout), with that scenario."""
_WORKLOADS: dict[tuple, tuple[Prepared, Workload]] = {}
"""Workloads by (id of the prepared scenario, what `build_workload` reads of a layout), with
that scenario: a layout's optimizers share one, and so the caches kept by workload identity
(`cost.ops.chunk_times`, the partition search's)."""


def prepared_for(prepared: Prepared, layout: Layout) -> Prepared:
    """The prepared scenario with `layout` in place of its own parallel and training settings
    (kept: a layout's policies ask for it in turn)."""
    got = _PREPARED.get((id(prepared), layout))
    if got is None or got[0] is not prepared:
        if len(_PREPARED) >= 64:
            _PREPARED.clear()
        got = _PREPARED[(id(prepared), layout)] = (prepared, _prepared_for(prepared, layout))
    return got[1]


def _workload_for(prepared: Prepared, training, layout: Layout) -> Workload:
    """`build_workload` of the layout's training settings. It reads no optimizer setting
    (tests/search/test_planner.py holds it to a fresh build), and of the schedule and pipeline
    only what `_prepared_for` sets in the training settings from them (the p2p overlap with the
    interleaved schedule, and at pipeline 2, the deferred weight gradient with a pipeline), so the
    key leaves the rest out: layouts of other pipeline degrees and of GPipe and 1F1B share a
    workload."""
    key = (id(prepared), layout.tp, layout.micro_batch_size, layout.schedule == "interleaved",
           layout.pp > 1, layout.pp == 2, layout.recompute, layout.sequence_parallel, layout.cp,
           layout.ep, layout.etp)
    got = _WORKLOADS.get(key)
    if got is None or got[0] is not prepared:
        if len(_WORKLOADS) >= 64:
            _WORKLOADS.clear()
        s = prepared.scenario
        got = _WORKLOADS[key] = (prepared, build_workload(
            s.model, training, layout.tp, layout.cp, s.parallel.cp_comm_type, layout.ep,
            layout.etp))
    return got[1]


def _prepared_for(prepared: Prepared, layout: Layout) -> Prepared:
    """`prepared_for`, made: the layout's training and parallel settings are kept apart by what
    each reads of it (a layout's settings share them with its neighbours)."""
    s = prepared.scenario
    training = _TRAININGS.get(
        (prepared,), (layout.micro_batch_size, layout.recompute, layout.sequence_parallel,
                      layout.optimizer, layout.tp > 1, layout.schedule == "interleaved",
                      layout.pp > 1, layout.pp == 2),
        lambda: _copy(s.training, micro_batch_size=layout.micro_batch_size,
                        recompute=layout.recompute, sequence_parallel=layout.sequence_parallel,
                        distributed_optimizer=layout.optimizer != "replicated",
                        overlap_grad_reduce=layout.optimizer.startswith("distributed-overlap"),
                        overlap_param_gather=layout.optimizer == "distributed-overlap-gather",
                        **_overlaps_for(s.training, layout)))
    parallel = _PARALLELS.get(
        (prepared,), (layout.tp, layout.pp, layout.dp, layout.schedule, layout.virtual_stages,
                      layout.cp, layout.ep, layout.etp),
        lambda: _copy(s.parallel, tensor=layout.tp, pipeline=layout.pp, data=layout.dp,
                        schedule=layout.schedule, virtual_stages=layout.virtual_stages,
                        context=layout.cp, expert=layout.ep, expert_tensor=layout.etp))
    m = s.training.global_batch_size // (layout.micro_batch_size * layout.dp)
    workload = _workload_for(prepared, training, layout)
    return _copy(prepared, scenario=_copy(s, training=training, parallel=parallel),
                   workload=workload, tp=layout.tp, pp=layout.pp, dp=layout.dp,
                   num_microbatches=m, cp=layout.cp)


def _copy(obj, **changes):
    """`dataclasses.replace(obj, **changes)` for the frozen dataclasses `_prepared_for` and
    `evaluate_chunk` copy (every field set by `__init__`, no `__post_init__`; the planner's
    tests hold them so), each field set as `__init__` sets it: half `replace`'s cost, which
    checks and gathers the fields and calls `__init__` with them by keyword."""
    new = object.__new__(type(obj))
    for name in type(obj).__dataclass_fields__:
        _set(new, name, changes[name] if name in changes else getattr(obj, name))
    return new


_set = object.__setattr__
_TRAININGS: IdentityMemo = IdentityMemo(256)
"""`_prepared_for`'s training settings by the prepared scenario and what they read of a
layout: its micro-batch, recompute, sequence parallelism, optimizer and `_overlaps_for`'s
tests."""
_PARALLELS: IdentityMemo = IdentityMemo(256)
"""`_prepared_for`'s parallel settings by the prepared scenario and the layout's degrees,
schedule and virtual stages."""


def _overlaps_for(training, layout: Layout) -> dict[str, bool]:
    """The scenario's TP, p2p and output-layer overlaps where the layout allows them (Megatron-LM
    ignores or refuses them elsewhere): TP overlap needs TP > 1 and sequence parallelism, p2p
    overlap the interleaved schedule, the deferred weight gradient a pipeline. Interleaving at
    pipeline 2 always overlaps p2p: Megatron-LM starts it only so
    (`schedule.check_megatron_interleaving`)."""
    interleaved = layout.schedule == "interleaved"
    return {"tp_comm_overlap": training.tp_comm_overlap and layout.tp > 1
            and layout.sequence_parallel,
            "overlap_p2p_comm": interleaved and (training.overlap_p2p_comm or layout.pp == 2),
            "defer_embedding_wgrad_compute": training.defer_embedding_wgrad_compute
            and layout.pp > 1}


def evaluate(prepared: Prepared, layout: Layout, policy: str) -> Candidate:
    """Plan `policy` on `layout`; memory check, then the analytic estimate."""
    return _evaluate(prepared, layout, policy, prepared_for(prepared, layout))


def _evaluate(prepared: Prepared, layout: Layout, policy: str, p: Prepared) -> Candidate:
    """`evaluate` with `p`, the prepared scenario of `layout` with any optimizer: its cluster,
    workload, compute model and micro-batch count are those of every optimizer of the layout
    (`_workload_for` reads no optimizer setting), so only a plan that is not kept needs the
    layout's own (`_plan`)."""
    from holmes_sim.estimate.analytic import estimate_iteration
    from holmes_sim.cost.ops import op_costs
    from holmes_sim.metrics import memory_report
    from holmes_sim.runner import naming_policy

    try:
        plan, cluster = _plan(p, policy, layout, prepared)
        mem = memory_report(plan, cluster, p.workload,
                            op_costs(cluster, p.workload, p.compute, plan.tp))
        if mem.fits:  # the estimate chooses each group's transport
            with naming_policy(policy, p.source):
                t = estimate_iteration(plan, cluster, p.workload, p.compute).iteration_s
    except HolmesError as exc:
        return Candidate(policy, layout, "", (), float("inf"), 0.0, 0.0, False, reason=str(exc))
    if not mem.fits:
        return Candidate(policy, layout, plan.optimizer.value, plan.layers_per_stage, float("inf"),
                         0.0, mem.peak_gib, False, overlap_grad_reduce=plan.overlap_grad_reduce,
                         reason=mem.shortfall(), excess_gib=mem.excess_gib)
    return Candidate(policy, layout, plan.optimizer.value, plan.layers_per_stage, t,
                     p.workload.megatron_tflops_per_gpu(t, cluster.num_gpus), mem.peak_gib, True,
                     overlap_grad_reduce=plan.overlap_grad_reduce)


_PLANS: dict[tuple, tuple] = {}
"""Megatron-family plans by what they depend on (see `_plan`)."""


def _plan(p: Prepared, policy: str, layout: Layout, prepared: Prepared | None = None):
    """`runner.plan_policy`, reusing Megatron-family plans: their placement, groups and equal
    partition depend on the degrees, schedule, micro-batch count and optimizer, not on the
    recompute mode, sequence parallelism or micro-batch size (the same plan, built once). With
    `prepared`, `p` is the layout's prepared scenario with any optimizer (the key's cluster and
    micro-batch count) and a plan is made on `prepared_for(prepared, layout)`."""
    from holmes_sim.policies import get_policy
    from holmes_sim.policies.megatron import MegatronPolicy
    from holmes_sim.runner import plan_policy

    if not isinstance(get_policy(policy), MegatronPolicy):
        return plan_policy(p if prepared is None else prepared_for(prepared, layout), policy)
    key = (policy, id(p.cluster), layout.tp, layout.pp, layout.dp, layout.schedule,
           layout.virtual_stages, p.num_microbatches, layout.optimizer, layout.cp, layout.ep,
           layout.etp)
    got = _PLANS.get(key)
    if got is None or got[0] is not p.cluster:
        if len(_PLANS) >= 256:
            _PLANS.clear()
        own = p if prepared is None else prepared_for(prepared, layout)
        got = _PLANS[key] = (p.cluster, plan_policy(own, policy))
    return got[1]


def confirm(prepared: Prepared, c: Candidate) -> Candidate:
    """Replace the estimate by the discrete-event simulation's iteration time."""
    from holmes_sim.runner import run_policy

    p = prepared_for(prepared, c.layout)
    r = run_policy(p, c.policy).result
    return replace(c, predicted_iteration_s=r.iteration_time_s, tflops_per_gpu=r.tflops_per_gpu,
                   simulated=True, breakdown_s=tuple(r.breakdown_s.items()))


def search(prepared: Prepared, spec: SearchSpec | None = None,
           progress: Callable[[int, int], None] | None = None, jobs: int | None = None,
           ray: str | None = None, max_candidates: int = MAX_CANDIDATES,
           confirming: Callable[[int, int], None] | None = None) -> PlanSearch:
    """Evaluate every layout x policy (x optimizer), rank, confirm the top K (and the baseline)
    by simulation. `progress(done, total)` counts layouts. The analytic part runs in `jobs`
    local worker processes (default: the CPU count; 1: in this process) or, with `ray` ("auto"
    or a cluster address), as Ray tasks; the layouts are cut into contiguous chunks and the
    results put back in grid order, so every way gives the same ranking. A search space of
    more than `max_candidates` candidates is refused before anything is evaluated.
    `confirming(done, total)` counts the simulations that confirm the top K."""
    from holmes_sim.search.scaleout import check_address

    check_address(ray)
    given = spec or prepared.scenario.search
    spec = distinct(given)
    start = time.perf_counter()
    try:
        check_search_values(replace(prepared.scenario, search=given))  # indices as written
        grid = bounded_grid(prepared, spec, max_candidates)
        if not grid:
            raise FieldError("search", _why_no_layout(prepared, spec))
    except FieldError as exc:
        raise located(prepared.source, exc) from None
    if ray is not None:
        from holmes_sim.search.scaleout import ray_map
        parts = ray_map(evaluate_chunk, prepared, spec, _chunks(grid, 64), ray, progress, len(grid))
    else:
        parts = _local_map(prepared, spec, grid, _jobs(jobs, len(grid)), progress)
    results = [c for part in parts for c in part]
    return _rank(prepared, spec, results, start, confirming)


def _why_no_layout(prepared: Prepared, spec: SearchSpec) -> str:
    """The search's checks run again, each rejection kept (`rejections.Rejections`)."""
    why = Rejections(spec)
    for _ in layouts(prepared, spec, why):
        pass
    return why.summary()


def distinct(spec: SearchSpec) -> SearchSpec:
    """`spec` with every list's repeated values removed (first occurrence kept)."""
    lists = {f: getattr(spec, f) for f in spec.__dataclass_fields__}
    return replace(spec, **{f: tuple(dict.fromkeys(v)) for f, v in lists.items()
                            if isinstance(v, tuple)})


def settings_per_layout(spec: SearchSpec, schedule: str | None = None) -> int:
    """Candidates each layout (of `schedule`; None: any) gives: one per policy that searches
    its schedule (`policies.searched_schedules`), times the optimizers for the policies that
    take the scenario's."""
    return sum(len(spec.optimizer) if p in SCENARIO_OPTIMIZER_POLICIES else 1
               for p in spec.policies
               if schedule is None or schedule in searched_schedules(spec.schedule, p))


def bounded_grid(prepared: Prepared, spec: SearchSpec, max_candidates: int) -> list[Layout]:
    """Every layout of the search, or FieldError with the candidate count when there are more
    than `max_candidates` candidates (counted before any is evaluated)."""
    pers = {k: max(1, settings_per_layout(spec, k)) for k in grid_schedules(spec)}
    per = max(pers.values(), default=1)
    grid: list[Layout] = []
    count = 0
    for lay in layouts(prepared, spec):
        count += pers[lay.schedule]
        if count <= max_candidates:
            grid.append(lay)
        elif count > _COUNT_CAP * max_candidates:
            break
    if count > max_candidates:
        more = "more than " if count > _COUNT_CAP * max_candidates else ""
        raise FieldError("search", f"{more}{count:,} candidates to evaluate ({per} policy and "
                         f"optimizer settings per layout), above the limit of {max_candidates:,}; "
                         "narrow the search: block (fewer tensor, pipeline, micro_batch_size, "
                         "schedule, virtual_stages, recompute or optimizer values) or raise "
                         "--max-candidates")
    return grid


def evaluate_chunk(prepared: Prepared, spec: SearchSpec, chunk: list[Layout]) -> list[Candidate]:
    """Every policy (and optimizer) of every layout of `chunk`, in order. The objects alive
    before it (the scenario, the cluster and its facts, earlier chunks' caches) are kept out of
    garbage collection meanwhile, no collection runs by itself, and the caches it makes join
    them as it ends (`collector.quiet_collector` with threshold 0 and `freeze_made`): those
    objects are not garbage, a chunk of the benchmark's sample leaves no cyclic garbage
    (`gc.collect()` after it finds none), and collections cost 5-7% of a chunk's time (full
    ones over the objects before it; at the default young threshold of 700, about 50 young ones
    over the caches a 64-GPU chunk builds)."""
    with quiet_collector(threshold=0, freeze_made=True):
        out: list[Candidate] = []
        for layout in chunk:
            p = prepared_for(prepared, layout)
            for policy in spec.policies:
                if layout.schedule not in searched_schedules(spec.schedule, policy):
                    continue
                for opt in (spec.optimizer if policy in SCENARIO_OPTIMIZER_POLICIES
                            else ("distributed",)):
                    out.append(_evaluate(prepared, layout if layout.optimizer == opt
                                         else _copy(layout, optimizer=opt), policy, p))
        return out


def _jobs(jobs: int | None, n: int) -> int:
    if jobs is not None and jobs < 1:
        raise FieldError("--jobs", f"must be at least 1, got {jobs}")
    return max(1, min(jobs or os.cpu_count() or 1, 1 + n // 200, usable_cores()))


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _chunks(grid: list[Layout], count: int) -> list[list[Layout]]:
    """`grid` in about `count` contiguous pieces, cut where the placement (TP, PP) changes once a
    piece has its share (neighbours share schedule shapes, and a placement's groups, paths and
    rings are then built in one worker), or inside a placement past four shares."""
    size = max(1, -(-len(grid) // count))
    out: list[list[Layout]] = []
    for lay in grid:
        if not out or len(out[-1]) >= 4 * size or (
                len(out[-1]) >= size and (lay.tp, lay.pp) != (out[-1][-1].tp, out[-1][-1].pp)):
            out.append([])
        out[-1].append(lay)
    return out


_WORKER: tuple[Prepared, SearchSpec] | None = None
"""The search a forked worker evaluates (set before the fork: nothing is pickled)."""


def _worker_chunk(chunk: list[Layout]) -> list[Candidate]:
    assert _WORKER is not None
    return evaluate_chunk(*_WORKER, chunk)


def _local_map(prepared: Prepared, spec: SearchSpec, grid: list[Layout], jobs: int,
               progress: Callable[[int, int], None] | None) -> list[list[Candidate]]:
    chunks = _chunks(grid, 1 if jobs == 1 else jobs * 16)
    if jobs == 1 or "fork" not in multiprocessing.get_all_start_methods():
        parts = (evaluate_chunk(prepared, spec, chunk) for chunk in chunks)
        return collect_in_order(chunks, parts, len(grid), progress)
    global _WORKER
    _WORKER = (prepared, spec)
    try:
        with fork_pool(jobs) as pool:
            return collect_in_order(chunks, pool.imap(_worker_chunk, chunks), len(grid), progress)
    finally:
        _WORKER = None


def _key(c: Candidate) -> tuple:
    lay = c.layout
    return (c.predicted_iteration_s, c.policy, lay.tp, lay.pp, lay.micro_batch_size, lay.schedule,
            lay.virtual_stages, lay.recompute, lay.sequence_parallel, lay.optimizer)


def _feasible(c: Candidate) -> bool:
    return c.fits_memory and c.predicted_iteration_s < float("inf")


def _rank(prepared: Prepared, spec: SearchSpec, results: list[Candidate], start: float,
          confirming: Callable[[int, int], None] | None = None) -> PlanSearch:
    ok = sorted((c for c in results if _feasible(c)), key=_key)
    bad = tuple(c for c in results if not _feasible(c))
    top: list[Candidate] = []
    for c in ok[:spec.top_k]:
        if confirming:
            confirming(len(top), len(ok[:spec.top_k]))
        top.append(confirm(prepared, c))
    if confirming:
        confirming(len(top), len(top))
    top.sort(key=_key)
    estimated = next((c for c in ok if c.policy == BASELINE_POLICY), None)
    baseline = None
    if estimated is not None:
        baseline = next((c for c in top if c.policy == BASELINE_POLICY
                         and (c.layout, c.optimizer) == (estimated.layout, estimated.optimizer)),
                        None) or confirm(prepared, estimated)
    return PlanSearch(prepared.scenario.name, tuple(top + ok[spec.top_k:]), baseline, bad,
                      len(results), time.perf_counter() - start)
