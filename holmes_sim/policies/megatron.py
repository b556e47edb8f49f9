"""Megatron-LM's default placement, as the Holmes paper's baseline (arXiv 2312.03549, section 5),
and the two other frameworks of the paper's Figure 6 that share that placement.

Ranks in the order the scenario lists nodes (TP fastest, then DP, then PP: Megatron's
`RankGenerator` order "tp-dp-pp"), equal layers per stage, and one NCCL network setting for the
whole job: RDMA only where one fabric reaches every node, otherwise TCP for every inter-node group.
What differs is the optimizer:
- `megatron`: Megatron-LM's distributed optimizer without overlap (`training.distributed_optimizer`,
  `training.overlap_grad_reduce` as the scenario sets them);
- `megatron-llama`: Megatron-LLaMA (Alibaba, github.com/alibaba/Megatron-LLaMA): the same placement
  with its OverlappedDistributedOptimizer: bucketed reduce-scatter during the backward and the
  parameter all-gather overlapped with the next forward;
- `megatron-deepspeed`: Megatron-DeepSpeed with ZeRO stage 1 (github.com/microsoft/
  Megatron-DeepSpeed): its pipeline engine all-reduces gradients after the pipeline flush, steps
  each rank's optimizer shard and all-gathers the parameters, none of it overlapped.
"""

from __future__ import annotations

from dataclasses import dataclass

from holmes_sim.hardware.cluster import Cluster
from holmes_sim.cost.transport import job_wide_fabric, job_wide_transport
from holmes_sim.plan import OptimizerMode, Plan
from holmes_sim.policies.base import (
    PlanRequest,
    build_groups,
    check_tp_within_nodes,
    default_optimizer,
    equal_partition,
    rank_order,
)


@dataclass(frozen=True)
class MegatronPolicy:
    name: str = "megatron"
    description: str = "Megatron-LM default: listing order, equal partition, job-wide transport"
    optimizer: OptimizerMode | None = None
    """None: as the scenario's `training` says; else this framework's fixed optimizer."""

    def cluster_view(self, cluster: Cluster) -> Cluster:
        return cluster

    def plan(self, request: PlanRequest) -> Plan:
        _, rank_to_gpu = rank_order(request.cluster, "listing", list)
        check_tp_within_nodes(rank_to_gpu, request.tp)
        fabric = job_wide_fabric(request.cluster, rank_to_gpu)
        groups = build_groups(request.cluster, rank_to_gpu, request.tp, request.pp, request.dp,
                              request.num_chunks, request.workload.tie_embeddings,
                              lambda gpus: job_wide_transport(request.cluster, gpus, fabric),
                              chooser_key=("job-wide", fabric))
        layers = equal_partition(request.workload.num_layers, request.pp * request.num_chunks)
        return Plan(self.name, request.tp, request.pp, request.dp, rank_to_gpu, layers,
                    request.schedule_kind, request.num_microbatches, request.num_chunks,
                    self.optimizer or default_optimizer(request), groups,
                    overlap_grad_reduce=self.optimizer is None and request.overlap_grad_reduce)
