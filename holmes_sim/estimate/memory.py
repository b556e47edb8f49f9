"""Peak memory per GPU of each pipeline stage of a plan, against its GPUs' memory: what the
report shows, the planner's memory filter and Holmes' partition search use."""

from __future__ import annotations

from dataclasses import dataclass

from holmes_sim.hardware.cluster import Cluster
from holmes_sim.cost.ops import OpCosts, stage_param_counts
from holmes_sim.estimate.netview import netview
from holmes_sim.memo import IdentityMemo
from holmes_sim.plan import Plan
from holmes_sim.schedule import peaks_in_flight
from holmes_sim.units import GIB
from holmes_sim.model import cp_buffers
from holmes_sim.model.workload import Workload


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Peak bytes per GPU of each pipeline stage, against the smallest GPU memory of the stage."""

    per_stage_bytes: tuple[float, ...]
    capacity_bytes: tuple[float, ...]

    @property
    def peak_gib(self) -> float:
        return max(self.per_stage_bytes) / GIB

    @property
    def fits(self) -> bool:
        return all(b <= c for b, c in zip(self.per_stage_bytes, self.capacity_bytes, strict=True))

    @property
    def excess_gib(self) -> float:
        """How far the stage furthest over its capacity is over it (GiB; <= 0 when it fits)."""
        return max(b - c for b, c in zip(self.per_stage_bytes, self.capacity_bytes,
                                         strict=True)) / GIB

    def shortfall(self) -> str:
        """'needs P GiB per GPU, the GPUs have C' for the stage furthest over its capacity, P
        with the fewest decimals (1 to 3) that show it above C."""
        need, have = max(zip(self.per_stage_bytes, self.capacity_bytes, strict=True),
                         key=lambda s: s[0] - s[1])
        need, have = need / GIB, have / GIB
        shown = next((f"{need:.{d}f}" for d in (1, 2, 3) if float(f"{need:.{d}f}") > have),
                     f"just over {have:g}")
        return f"needs {shown} GiB per GPU, the GPUs have {have:g}"


def memory_report(plan: Plan, cluster: Cluster, workload: Workload, costs: OpCosts) -> MemoryReport:
    """Peak memory per GPU of each stage: model state plus the larger of the activations the
    schedule holds and what the optimizer step adds once they are freed.

    state = params/t x `Workload.state_bytes_per_param` (bf16 with fp32 gradients: 18 bytes, or
    6 + 12/dp sharded; Megatron-LM's distributed-optimizer guide), the routed experts' share
    sharded over their expert-data-parallel group, dp x t / (ep etp) GPUs
    (`Workload.expert_layer_params`);
    activations = (in-flight chunk-micro-batches) x (layers of the stage's largest chunk) x
    per-layer activation bytes [Korthikanti et al. 2022, Table 2], plus the larger of, on the
    last stage, one micro-batch's output layer and loss (`Workload.output_activation_bytes`)
    and, with context parallelism, what one layer's attention buffers add
    (`model.cp_buffers.peak_bytes`): the last layer's attention forward runs before the output
    layer's, the first backward's after the loss's backward.

    Kept by what it reads of the plan: Holmes' partition search checks the split its plan then
    gets, which the planner's memory filter checks again."""
    return _REPORTS.get((cluster, plan.rank_to_gpu, plan.groups, workload, costs),
                        (plan.tp, plan.pp, plan.dp, plan.num_chunks, plan.schedule_kind,
                         plan.num_microbatches, plan.optimizer, plan.layers_per_stage),
                        lambda: _memory_report(plan, cluster, workload, costs))


_REPORTS: IdentityMemo[MemoryReport] = IdentityMemo()


def _memory_report(plan: Plan, cluster: Cluster, workload: Workload, costs: OpCosts
                   ) -> MemoryReport:
    """`memory_report` computed."""
    net = netview(cluster, plan.rank_to_gpu, plan.groups, plan.tp, plan.pp, plan.dp, plan.num_chunks)
    act_per_layer = workload.activation_bytes_per_layer(plan.tp)
    peaks = peaks_in_flight(plan.schedule_kind, plan.pp, plan.num_microbatches, plan.num_chunks)
    per_stage = []
    output = workload.output_activation_bytes(plan.tp)
    buffers = cp_buffers.peak_bytes(workload, plan.tp)
    placed, states = _layers_as_placed(plan, workload), {}
    for s, (params, expert, most) in enumerate(
            stage_param_counts(costs, plan.layers_per_stage, plan.pp)):
        key = placed(s, params, expert)  # most stages of a pipeline hold alike
        if key not in states:
            states[key] = _stage_state_bytes(plan, workload, *key)
        state, step = states[key]
        transient = max(output if s == plan.pp - 1 else 0.0, buffers if most else 0.0)
        acts = peaks[s] * most * act_per_layer + transient
        per_stage.append(state + max(acts, step))
    return MemoryReport(tuple(per_stage), net.stage_memory_bytes())


def _layers_as_placed(plan: Plan, workload: Workload):
    """A function of (stage, parameters of its whole TP group, routed experts' of them) giving
    those with its layers counted as the ones it holds, and how many each TP rank holds whole
    (its layers' and `_ends_held_whole`): `stage_param_counts` prices every layer at the mean
    over an MoE layer pattern, which charges a stage of DeepSeek's leading dense layers for
    experts it does not hold."""
    layers, pp = plan.layers_per_stage, plan.pp
    if workload.moe is None:  # every layer is the mean
        whole = workload.layer_kind_params(False)[2]
        return lambda stage, params, expert: (
            params, expert,
            sum(layers[stage::pp]) * whole + _ends_held_whole(workload, stage, pp))
    kinds = list(zip(workload.layer_kind_params(False), workload.layer_kind_params(True)))
    mean = (workload.layer_params, workload.expert_layer_params)
    starts = [0]
    for n in layers:
        starts.append(starts[-1] + n)

    def placed(stage: int, params: float, expert: float) -> tuple[float, float, float]:
        moe = total = 0
        for j in range(stage, len(layers), pp):
            total += layers[j]
            moe += sum(workload.moe.pattern[starts[j]:starts[j + 1]])
        held, own, whole = ((total - moe) * dense + moe * routed for dense, routed in kinds)
        return (params - total * mean[0] + held, expert - total * mean[1] + own,
                whole + _ends_held_whole(workload, stage, pp))

    return placed


def _ends_held_whole(workload: Workload, stage: int, pp: int) -> float:
    """Parameters outside the layers that every TP rank of pipeline rank `stage` holds whole:
    the learned position table, s h, beside the embedding on rank 0 (a `torch.nn.Embedding` in
    Megatron-Core's `LanguageModelEmbedding`, megatron/core/models/common/embeddings/
    language_model_embedding.py), and the final norm beside the head on rank pp - 1 (not a
    parallel layer, `TransformerBlock.final_layernorm`)."""
    held = 0.0
    if stage == 0 and workload.position_embedding == "learned":
        held += workload.seq * workload.hidden
    if stage == pp - 1:
        held += workload.norm_params
    return held


def _stage_state_bytes(plan: Plan, workload: Workload, params: float, expert: float,
                       replicated: float) -> tuple[float, float]:
    """(model state held through the iteration, bytes the optimizer step adds) per GPU of a
    stage with `params` parameters of a whole TP group, `expert` of them routed experts' and
    `replicated` of them held whole by each TP rank (bytes)."""
    sharded = plan.optimizer.sharded
    edp = plan.dp // workload.ep_replicas if expert else plan.dp
    dense = (params - expert - replicated) / plan.tp + replicated
    state = (dense * workload.state_bytes_per_param(plan.dp, sharded)
             + expert / plan.tp * workload.state_bytes_per_param(edp, sharded))
    step = (dense * workload.step_bytes_per_param(plan.dp, sharded)
            + expert / plan.tp * workload.step_bytes_per_param(edp, sharded))
    return state, step
