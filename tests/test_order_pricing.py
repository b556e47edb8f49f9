"""What Holmes prices to choose among its tied NIC-class orders: each plan once, and only what
the choice reads (`HolmesPolicy._leading`, `HolmesPolicy._plan`)."""

from __future__ import annotations

from collections import Counter

import pytest

from holmes_sim.estimate import analytic
from holmes_sim.policies.holmes import _PARTITIONED, HolmesPolicy
from holmes_sim.prepare import prepare
from tests.test_nic_order import _scenario

_NODES = [("i0", "a100-80gb", ("ib-a",)), ("r0", "a100-80gb", ("roce-a",)),
          ("e0", "a100-80gb", ()), ("e1", "a100-80gb", ())]
"""An IB, a RoCE and two Ethernet-only nodes: at TP 8 PP 2 six class orders tie."""


@pytest.fixture
def request_(write_scenario):
    return prepare(write_scenario(_scenario(_NODES, tp=8, pp=2, batch=48))).request()


@pytest.fixture
def estimated(monkeypatch) -> Counter:
    """Each estimate computed (not found in a cache), by the plan's rank order and split."""
    seen: Counter = Counter()
    run = analytic._Estimator.run

    def counted(self):
        seen[(tuple(self.plan.rank_to_gpu), self.plan.layers_per_stage)] += 1
        return run(self)
    monkeypatch.setattr(analytic._Estimator, "run", counted)
    return seen


def test_each_plan_of_the_tied_orders_is_estimated_once(request_, estimated):
    """The equal split of every tied order is priced to rank them; the leading ones' partition
    search then compares its split with that estimate instead of pricing the equal split again."""
    policy = HolmesPolicy()
    orders = policy.orders(request_)
    assert len(orders) > _PARTITIONED
    policy.plan(request_)
    assert estimated and max(estimated.values()) == 1, estimated
    assert len({ranks for ranks, _ in estimated}) == len(orders)


def test_orders_that_do_not_fit_are_not_estimated_when_enough_fit(request_, estimated):
    """With `_PARTITIONED` orders fitting, those lead whatever the others' estimates, and none
    is priced; with one fitting, it leads unpriced and only the others are ranked."""
    policy = HolmesPolicy()
    orders = policy.orders(request_)
    assert not estimated
    gpus = {orders[1][1], orders[3][1]}
    kept, firsts = policy._leading(request_, orders, lambda plan: plan.rank_to_gpu in gpus, {})
    assert kept == [orders[1], orders[3]]
    assert not estimated and [s for _, s in firsts] == [None, None]
    kept, firsts = policy._leading(request_, orders, lambda plan: plan.rank_to_gpu is orders[4][1],
                                    {})
    assert orders[4] in kept and len(kept) == _PARTITIONED
    assert {ranks for ranks, _ in estimated} == {o[1] for o in orders if o is not orders[4]}
    assert [s is None for _, s in firsts] == [o is orders[4] for o in kept]
