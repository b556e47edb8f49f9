"""Megatron-LM's default placement, as the Holmes paper's baseline (arXiv 2312.03549, section 5),
and the two other frameworks of the paper's Figure 6 that share that placement.

Ranks in the order the scenario lists nodes (TP fastest, then DP, then PP: Megatron's
`RankGenerator` order "tp-dp-pp"), equal layers per stage, and one NCCL network setting for the
whole job: RDMA only where one fabric reaches every node, otherwise TCP for every inter-node group.
What differs is the optimizer:
- `megatron`: Megatron-LM's distributed optimizer without overlap (`training.distributed_optimizer`,
  `training.overlap_grad_reduce` as the scenario sets them);
- `megatron-llama`: Megatron-LLaMA (Alibaba, github.com/alibaba/Megatron-LLaMA) as its schedules
  call its OverlappedDistributedOptimizer since commits e48bbb3 (2023-10-07) and 25306de
  (2023-10-09), which answered its issues #29 and #37: each bucket reduce-scattered in every
  micro-batch's backward, the parameters all-gathered ahead of the next forward
  (`OptimizerMode.PER_MICROBATCH_OVERLAPPED`). Its interleaved schedule still calls neither the
  reduction epilogue nor the gather (issue #37: "virtual PP" unsupported), so the policy refuses it;
- `megatron-llama-2023-08`: the same optimizer as first released (d2e05b8, 2023-08-03; the file
  ships byte-identical in CodexDive/Holmes' first commit d8d2ac5). Only its no-pipeline schedule
  calls `backward_epilogue()`; under PP > 1 each bucket is reduce-scattered once, in the run's
  first micro-batch, and a steady-state iteration's only DP traffic is the parameter all-gather
  in `step()` (`OptimizerMode.REDUCE_SCATTER_ONCE`; the model then does not train correctly);
- `megatron-deepspeed`: Megatron-DeepSpeed with ZeRO stage 1 (github.com/microsoft/
  Megatron-DeepSpeed): its pipeline engine all-reduces gradients after the pipeline flush, steps
  each rank's optimizer shard and all-gathers the parameters, none of it overlapped.
"""

from __future__ import annotations

from dataclasses import dataclass

from holmes_sim.errors import PlanError
from holmes_sim.hardware.cluster import Cluster
from holmes_sim.cost.transport import job_wide_transport
from holmes_sim.model.pipeline_split import megatron_layers_per_stage
from holmes_sim.plan import OptimizerMode, Plan
from holmes_sim.policies.base import (
    MEGATRON_SCHEDULES,
    PlanRequest,
    build_groups,
    check_tp_within_nodes,
    job_fabric,
    default_optimizer,
    equal_partition,
    rank_order,
)
from holmes_sim.schedule import ScheduleKind

LLAMA_FIXED = "2023-10"
"""Megatron-LLaMA e48bbb3 + 25306de: the 1F1B schedule reduces every micro-batch."""
LLAMA_RELEASED = "2023-08"
"""Megatron-LLaMA d2e05b8: under PP > 1 each bucket is reduced once per run."""


def megatron_llama_optimizer(release: str, request: PlanRequest) -> OptimizerMode:
    """Megatron-LLaMA's OverlappedDistributedOptimizer as `release` runs the request's schedule.

    Raises:
        PlanError: the fixed release with the interleaved schedule (never adapted upstream).
    """
    if request.pp == 1:  # forward_backward_no_pipelining calls backward_epilogue() in both
        return OptimizerMode.PER_MICROBATCH_OVERLAPPED if release == LLAMA_FIXED \
            else OptimizerMode.PER_MICROBATCH_GATHER_IN_STEP
    if release == LLAMA_RELEASED:
        return OptimizerMode.REDUCE_SCATTER_ONCE
    if request.schedule_kind is ScheduleKind.INTERLEAVED:
        raise PlanError("Megatron-LLaMA's overlapped distributed optimizer does not run the "
                        "interleaved schedule (alibaba/Megatron-LLaMA issue #37); use 1f1b")
    return OptimizerMode.PER_MICROBATCH_OVERLAPPED


@dataclass(frozen=True)
class MegatronPolicy:
    name: str = "megatron"
    description: str = "Megatron-LM default: listing order, equal partition, job-wide transport"
    optimizer: OptimizerMode | None = None
    """None: as the scenario's `training` says; else this framework's fixed optimizer."""
    llama_release: str | None = None
    """Megatron-LLaMA's release (`LLAMA_FIXED`, `LLAMA_RELEASED`): its optimizer for the request."""
    schedules: tuple[str, ...] = MEGATRON_SCHEDULES
    """The pipeline schedules the framework runs (`Policy.schedules`)."""

    def cluster_view(self, cluster: Cluster) -> Cluster:
        return cluster

    def refusal(self, cp: int, moe: bool) -> PlanError | None:
        """Why this framework cannot run a job of context degree `cp`, or with mixture-of-experts
        layers (`moe`), naming the scenario field; None where it can. Megatron-LLaMA (2023) and
        Megatron-DeepSpeed predate Megatron-Core's context parallelism, and the MoE layers
        simulated are Megatron-Core's (Megatron-DeepSpeed's are DeepSpeed-MoE's)."""
        if self.name == "megatron":
            return None
        if cp > 1:
            return PlanError("this framework has no context parallelism (--context-parallel-size "
                             "is Megatron-Core's); use policy megatron or holmes, or context: 1",
                             "parallel.context")
        if moe:
            return PlanError("this framework has no Megatron-Core mixture-of-experts layers "
                             "(--num-experts with --moe-router-topk); use policy megatron or "
                             "holmes, or a dense model", "model")
        return None

    def plan(self, request: PlanRequest) -> Plan:
        refused = self.refusal(request.cp, request.workload.moe is not None)
        if refused is not None:
            raise refused
        _, rank_to_gpu = rank_order(request.cluster, "listing", list)
        check_tp_within_nodes(rank_to_gpu, request.tp)
        fabric = job_fabric(request.cluster, rank_to_gpu)
        groups = build_groups(request.cluster, rank_to_gpu, request.tp, request.pp, request.dp,
                              request.num_chunks, request.workload.tie_embeddings,
                              lambda gpus: job_wide_transport(request.cluster, gpus, fabric),
                              chooser_key=("job-wide", fabric), cp=request.cp,
                              ep=request.workload.ep,
                              etp=request.workload.expert_tp(request.tp))
        split = request.workload.pipeline_split
        own = self.optimizer is None and self.llama_release is None  # the forks lack the flags
        layers = megatron_layers_per_stage(request.workload.num_layers, request.pp,
                                           request.num_chunks, split) if split.is_set and own else \
            equal_partition(request.workload.num_layers, request.pp * request.num_chunks)
        return Plan(self.name, request.tp, request.pp, request.dp, rank_to_gpu, layers,
                    request.schedule_kind, request.num_microbatches, request.num_chunks,
                    self._optimizer(request), groups,
                    overlap_grad_reduce=self.optimizer is None and self.llama_release is None
                    and request.overlap_grad_reduce, cp=request.cp)

    def _optimizer(self, request: PlanRequest) -> OptimizerMode:
        if self.llama_release is not None:
            return megatron_llama_optimizer(self.llama_release, request)
        return self.optimizer or default_optimizer(request)
