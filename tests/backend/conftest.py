"""Plans built by hand for the backend tests (no policy needed), and tiny run configs.

Group conventions assumed (the real policies must produce the same structure):
- DATA: one group per (pp_rank, tp_rank) with ranks in dp_rank order (omitted when dp == 1).
- PIPELINE: for each dp_rank and each adjacent virtual-stage pair j -> j+1 that crosses ranks,
  one 2-rank group ranks=(src, dst) in the forward direction; the gradient goes back over it.
  A (src, dst) pair that several chunks share appears once; for p == 2 interleaved there are
  two groups, (r0, r1) and (r1, r0).
- TENSOR: one LOCAL group per (pp_rank, dp_rank) with nic "" (size 1 unless tp > 1); with
  tp > 1, DATA and PIPELINE groups exist per tp_rank.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from holmes_sim.backend.model import GPTConfig
from holmes_sim.backend.run_config import RunConfig
from holmes_sim.plan import GpuRef, Group, GroupKind, OptimizerMode, Plan, Transport, TransportKind
from holmes_sim.schedule import ScheduleKind

TINY = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=128, seed=7)
TCP = Transport(TransportKind.TCP, "eth")


def make_plan(pp: int = 1, dp: int = 1, schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B,
              num_microbatches: int = 2, num_chunks: int = 1,
              optimizer: OptimizerMode = OptimizerMode.REPLICATED,
              layers: tuple[int, ...] | None = None,
              nic_of: Callable[[int, GroupKind], str] = lambda rank, kind: "lo",
              tp: int = 1) -> Plan:
    """A plan on one node "n0"; `nic_of(rank, kind)` picks each member's NIC name."""
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
