"""Plans built by hand for the backend tests (no policy needed), and tiny run configs.

Group conventions assumed (the real policies must produce the same structure):
- DATA: one group per (pp_rank, tp_rank) with ranks in dp_rank order (omitted when dp == 1).
- PIPELINE: for each dp_rank and each adjacent virtual-stage pair j -> j+1 that crosses ranks,
  one 2-rank group ranks=(src, dst) in the forward direction; the gradient goes back over it.
  A (src, dst) pair that several chunks share appears once; for p == 2 interleaved there are
  two groups, (r0, r1) and (r1, r0).
- TENSOR: one LOCAL group per (pp_rank, dp_rank) with nic "" (size 1 unless tp > 1); with
  tp > 1, DATA and PIPELINE groups exist per tp_rank.
- EXPERT (ep > 1, tp 1): per stage, replicas k ep .. k ep + ep - 1; EXPERT_DATA (dp > ep):
  per stage and EP rank e, replicas e, e + ep, ... (Megatron-Core's order, `policies/groups.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from holmes_sim.backend.model import GPTConfig
from holmes_sim.backend.run_config import RunConfig
from holmes_sim.plan import GpuRef, Group, GroupKind, OptimizerMode, Plan, Transport, TransportKind
from holmes_sim.schedule import ScheduleKind

TINY = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=128, seed=7)
# TINY with every MLP a mixture of 4 experts, top-2 (M k = 2 x 32 x 2 copies, a multiple of 4).
TINY_MOE = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=128, seed=7,
                     num_experts=4, moe_topk=2, moe_ffn=96)
TCP = Transport(TransportKind.TCP, "eth")


def make_plan(pp: int = 1, dp: int = 1, schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B,
              num_microbatches: int = 2, num_chunks: int = 1,
              optimizer: OptimizerMode = OptimizerMode.REPLICATED,
              layers: tuple[int, ...] | None = None,
              nic_of: Callable[[int, GroupKind], str] = lambda rank, kind: "lo",
              tp: int = 1, ep: int = 1) -> Plan:
    """A plan on one node "n0"; `nic_of(rank, kind)` picks each member's NIC name; `ep` > 1
    adds the EXPERT and EXPERT_DATA groups (tp 1)."""
    virtual = pp * num_chunks
    layers = layers or tuple([TINY.n_layer // virtual] * virtual)
    plan = Plan("hand", tp, pp, dp, tuple(GpuRef("n0", r) for r in range(pp * dp * tp)), layers,
                schedule, num_microbatches, num_chunks, optimizer, ())
    groups: list[Group] = []
    for s in range(pp):
        for d in range(dp):
            ranks = tuple(plan.rank(s, d, i) for i in range(tp))
            groups.append(Group(GroupKind.TENSOR, ranks, Transport(TransportKind.LOCAL),
                                ("",) * tp))
    if dp > 1:
        for s in range(pp):
            for i in range(tp):
                ranks = tuple(plan.rank(s, d, i) for d in range(dp))
                groups.append(Group(GroupKind.DATA, ranks, TCP,
                                    tuple(nic_of(r, GroupKind.DATA) for r in ranks)))
    groups += _expert_groups(plan, ep, nic_of)
    for d in range(dp):
        seen = set()
        for j in range(virtual - 1):
            for i in range(tp):
                src, dst = plan.rank(j % pp, d, i), plan.rank((j + 1) % pp, d, i)
                if src == dst or (src, dst) in seen:
                    continue
                seen.add((src, dst))
                groups.append(Group(GroupKind.PIPELINE, (src, dst), TCP,
                                    (nic_of(src, GroupKind.PIPELINE),
                                     nic_of(dst, GroupKind.PIPELINE))))
    return Plan("hand", tp, pp, dp, plan.rank_to_gpu, layers, schedule, num_microbatches,
                num_chunks, optimizer, tuple(groups))


def _expert_groups(plan: Plan, ep: int, nic_of: Callable[[int, GroupKind], str]) -> list[Group]:
    """EXPERT groups of ep consecutive replicas and EXPERT_DATA groups of every ep-th replica
    (none for ep 1; EXPERT_DATA none for dp = ep)."""
    if ep == 1:
        return []
    assert plan.tp == 1 and plan.dp % ep == 0
    member_lists = [(GroupKind.EXPERT, [plan.rank(s, k * ep + e, 0) for e in range(ep)])
                    for s in range(plan.pp) for k in range(plan.dp // ep)]
    if plan.dp > ep:
        member_lists += [(GroupKind.EXPERT_DATA, [plan.rank(s, d, 0)
                                                  for d in range(e, plan.dp, ep)])
                         for s in range(plan.pp) for e in range(ep)]
    return [Group(kind, tuple(ranks), TCP, tuple(nic_of(r, kind) for r in ranks))
            for kind, ranks in member_lists]


def make_run_config(**kw) -> RunConfig:
    """Tiny, fast defaults; every NIC maps to loopback (the only interface on the host)."""
    base = dict(model=TINY, micro_batch_size=2, iterations=3, warmup=1, lr=3e-3,
                optimizer="adam", interface_map={"*": "lo"}, timeout_s=30.0)
    base.update(kw)
    return RunConfig(**base)


@pytest.fixture
def plan_factory() -> Callable[..., Plan]:
    return make_plan


@pytest.fixture
def run_config_factory() -> Callable[..., RunConfig]:
    return make_run_config


@pytest.fixture
def tiny_config() -> GPTConfig:
    return TINY
