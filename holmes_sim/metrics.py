"""From a Trace and its Plan: iteration time, throughput, MFU, bubble, time breakdown, memory.

Throughput figures follow Megatron-LM's log so they compare with the Holmes paper's tables:
TFLOP/s per GPU = F / (t_iter x n_gpus), F from `Workload.megatron_tflops_per_gpu`
[Narayanan et al. SC'21, section 5.1]. MFU = model FLOP (72 form) / (t_iter x sum of GPU peaks)
[Chowdhery et al. 2022, PaLM, appendix B].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from holmes_sim.hardware.cluster import Cluster
from holmes_sim.cost.ops import OpCosts
from holmes_sim.estimate.memory import MemoryReport, memory_report
from holmes_sim.plan import GroupKind, Plan
from holmes_sim.prepare import Prepared, passes_checks
from holmes_sim.sim.trace import OpKind, Trace
from holmes_sim.units import GIB
from holmes_sim.model.workload import Workload

LONG_SEQUENCE = 8192
"""From this sequence length on, `memory_fix` offers context parallelism (activations grow with
the sequence, and `parallel.context` splits them)."""


def memory_fix(prepared: Prepared) -> str:
    """What to change when a plan of `prepared` does not fit in GPU memory: only the changes
    still open to its scenario (a lower micro-batch, or a higher tensor, pipeline, expert or
    context degree, only where one passes every check of `prepare`, the data degree giving up
    the GPUs; no full recomputation twice; the distributed optimizer only where megatron, the
    policy that takes the scenario's, runs), e.g. "lower training.micro_batch_size or raise
    parallel.pipeline"."""
    w, t = prepared.workload, prepared.scenario.training
    fixes = [f for f, open_ in (
        ("lower training.micro_batch_size", lambda: any(
            passes_checks(prepared, {"micro_batch_size": m}) for m in range(1, w.micro_batch))),
        ("set training.recompute: full", lambda: w.recompute != "full"),
        ("set training.distributed_optimizer: true",  # megatron's alone: the others fix theirs
         lambda: not t.distributed_optimizer and prepared.dp * prepared.cp > 1
         and "megatron" in prepared.scenario.policies),
        ("raise parallel.tensor", lambda: _higher_passes(prepared, "tensor", prepared.tp)),
        ("raise parallel.pipeline", lambda: _higher_passes(prepared, "pipeline", prepared.pp)),
        ("raise parallel.expert", lambda: w.moe is not None
         and _higher_passes(prepared, "expert", w.ep)),
        ("raise parallel.context", lambda: w.seq >= LONG_SEQUENCE
         and _higher_passes(prepared, "context", prepared.cp)),
    ) if open_()]
    if not fixes:
        return ("every setting that lowers the memory per GPU is at its limit already; use GPUs "
                "with more memory or more GPUs")
    if prepared.scenario.parallel.data is not None:  # a degree raised gives up data parallelism
        fixes = [f"{f} (removing parallel.data)" if f.startswith("raise parallel.") else f
                 for f in fixes]
    return ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1]


def _higher_passes(prepared: Prepared, degree: str, now: int) -> bool:
    """Whether some `parallel.<degree>` above `now` passes every check of the scenario
    (`passes_checks`), of those that divide the GPU count and stay within the degree's own
    bound (a node's GPUs, the layers, the experts, half the sequence)."""
    w, gpus = prepared.workload, prepared.cluster.num_gpus
    bound = {"tensor": max(n.num_gpus for n in prepared.cluster.nodes), "pipeline": w.num_layers,
             "expert": w.moe.experts if w.moe is not None else 1, "context": w.seq // 2}[degree]
    return any(passes_checks(prepared, **{degree: d}) for d in range(now + 1, min(gpus, bound) + 1)
               if gpus % d == 0)


def memory_warning(prepared: Prepared, results: list[Result]) -> str | None:
    """`run`'s warning when some plans do not fit in GPU memory (None when all fit)."""
    bad = [r for r in results if not r.memory.fits]
    if not bad:
        return None
    why = "; ".join(f"{r.policy} {r.memory.shortfall()}" for r in bad)
    return (f"warning: plans that do not fit in GPU memory ({why}) are ranked last with no "
            f"speed-up; {memory_fix(prepared)}")


BREAKDOWN_KEYS = ("compute", "tp_comm", "cp_comm", "ep_comm", "pp_exposed", "dp_exposed",
                  "optimizer", "bubble")
_CATEGORY = {
    OpKind.FORWARD: "compute", OpKind.BACKWARD: "compute", OpKind.TP_COMM: "tp_comm",
    OpKind.CP_COMM: "cp_comm", OpKind.EP_COMM: "ep_comm",
    OpKind.WAIT_PP: "pp_exposed", OpKind.WAIT_DP: "dp_exposed", OpKind.OPTIMIZER: "optimizer",
}


@dataclass(frozen=True, slots=True)
class Result:
    """Everything reported about one policy's simulated iteration."""

    policy: str
    iteration_time_s: float
    tflops_per_gpu: float
    samples_per_s: float
    tokens_per_s: float
    mfu: float
    bubble_fraction: float
    breakdown_s: dict[str, float]
    stage_busy_s: tuple[float, ...]
    layers_per_stage: tuple[int, ...]
    memory: MemoryReport
    transports: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        """The `--json` record of this policy."""
        return {
            "policy": self.policy,
            "iteration_time_s": self.iteration_time_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "breakdown_s": dict(self.breakdown_s),
            "stage_busy_s": list(self.stage_busy_s),
            "layers_per_stage": list(self.layers_per_stage),
            "peak_memory_gib": self.memory.peak_gib,
            "memory_per_stage_gib": [b / GIB for b in self.memory.per_stage_bytes],
            "memory_capacity_gib": [c / GIB for c in self.memory.capacity_bytes],
            "fits_memory": self.memory.fits,
            "transports": dict(self.transports),
            "notes": list(self.notes),
        }


def summarize(plan: Plan, trace: Trace, cluster: Cluster, workload: Workload,
              costs: OpCosts) -> Result:
    """Compute every reported figure of one simulated iteration."""
    t = trace.iteration_s
    n_gpus = plan.world_size
    breakdown = time_breakdown(trace)
    peak = sum(cluster.node(g.node).gpu.peak_flop_per_s for g in plan.rank_to_gpu)
    return Result(
        policy=plan.policy,
        iteration_time_s=t,
        tflops_per_gpu=workload.megatron_tflops_per_gpu(t, n_gpus),
        samples_per_s=workload.global_batch / t,
        tokens_per_s=workload.global_batch * workload.seq / t,
        mfu=workload.model_flop_per_iteration() / (t * peak),
        bubble_fraction=breakdown["bubble"] / t if t > 0 else 0.0,
        breakdown_s=breakdown,
        stage_busy_s=stage_busy(trace, plan.pp),
        layers_per_stage=plan.layers_per_stage,
        memory=memory_report(plan, cluster, workload, costs),
        transports=transport_summary(plan),
        notes=plan.notes,
    )


def time_breakdown(trace: Trace) -> dict[str, float]:
    """Mean over entities of the time spent per category (seconds); they sum to the iteration.

    bubble = everything the compute stream did not spend on the other categories: waiting for a
    producer that had not run yet, and idling at the end while others finish."""
    totals = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    cols = trace.columns()
    if "compute" in cols.streams:  # the ops' columns, each category summed in recording order
        kind = np.asarray(cols.kind)
        on_compute = np.asarray(cols.stream) == cols.streams.index("compute")
        weight = np.array([trace.weight(name) for name in cols.names], dtype=np.float64)
        seconds = _durations(cols) * weight[np.asarray(cols.entity)]
        for cat in dict.fromkeys(_CATEGORY.values()):
            codes = [i for i, k in enumerate(OpKind) if _CATEGORY.get(k) == cat]
            totals[cat] = _sum_in_order(seconds[on_compute & np.isin(kind, codes)])
    n = max(1, len(trace.entities))
    out = {k: v / n for k, v in totals.items()}
    out["bubble"] = max(0.0, trace.iteration_s - sum(out[k] for k in BREAKDOWN_KEYS if k != "bubble"))
    return out


def stage_busy(trace: Trace, pp: int) -> tuple[float, ...]:
    """Per pipeline stage, the largest compute-stream busy time (F, B, TP) over its replicas (s)."""
    stage_of = {e.name: e.stage for e in trace.entities}
    cols = trace.columns()
    busy_kinds = [i for i, kind in enumerate(OpKind) if kind in (
        OpKind.FORWARD, OpKind.BACKWARD, OpKind.TP_COMM, OpKind.CP_COMM, OpKind.EP_COMM)]
    busy = np.isin(np.asarray(cols.kind), busy_kinds)
    entity = np.asarray(cols.entity)[busy]  # members are as busy as
    seconds = _durations(cols)[busy]  # their representative
    order = np.argsort(entity, kind="stable")  # each entity's ops, in recording order
    entity, seconds = entity[order], seconds[order]
    bounds = np.flatnonzero(np.diff(entity)) + 1
    firsts = entity[np.r_[0, bounds]] if entity.size else entity
    per_stage = [0.0] * pp
    for e, run in zip(firsts, np.split(seconds, bounds) if entity.size else [], strict=True):
        stage = stage_of[cols.names[e]]
        per_stage[stage] = max(per_stage[stage], _sum_in_order(run))
    return tuple(per_stage)


def _durations(cols) -> np.ndarray:
    """Each recorded op's end - start (s)."""
    return np.asarray(cols.end) - np.asarray(cols.start)


def _sum_in_order(values: np.ndarray) -> float:
    """0.0 + values[0] + values[1] + ..., added one by one in order (as a Python loop would)."""
    return float(np.cumsum(values)[-1]) if values.size else 0.0


def transport_summary(plan: Plan) -> dict[str, str]:
    """For each group kind, the transports its groups use and how many: 'rdma:ib-a x4, tcp x2'."""
    out: dict[str, str] = {}
    for kind in GroupKind:
        counts: dict[str, int] = {}
        for g in plan.groups_of(kind):
            counts[str(g.transport)] = counts.get(str(g.transport), 0) + 1
        if counts:
            out[kind.value] = ", ".join(f"{k} x{v}" for k, v in counts.items())
    return out
