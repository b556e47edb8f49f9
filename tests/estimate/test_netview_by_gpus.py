"""`netview._BY_GPUS`: the views of Holmes' tied class orders (each a placement of its own) find
a stage's CP sends, a stage pair's pipeline send rates and a ring's figures by the GPUs and
transports they run on, and each view gets exactly what it computes alone."""

from __future__ import annotations

import pytest

from holmes_sim.bundled import bundled_scenario
from holmes_sim.estimate import netview as nv
from holmes_sim.memo import clear_identity_memos
from holmes_sim.plan import GpuRef, GroupKind
from holmes_sim.prepare import prepare
from tests.estimate.test_siblings import _plans, _request


def _view(request, plan):
    return nv.netview(request.cluster, plan.rank_to_gpu, plan.groups, plan.tp, plan.pp, plan.dp,
                      plan.num_chunks, plan.cp, request.workload.ep_replicas)


def _figures(net, plan) -> tuple:
    """Every stage's CP sends, every stage pair's send figures both ways, every stage's DP and
    pipeline rings with the DP topology, and the replica classes built on them."""
    pp, dp = plan.pp, plan.dp
    forward = {(j % pp, (j + 1) % pp) for j in range(pp * plan.num_chunks - 1)}
    return ([[net.cp_send(s, d) for d in range(dp)] for s in range(pp)],
            [net.p2p(a, b, d) for a, b in sorted(forward | {(b, a) for a, b in forward})
             for d in range(dp)],
            [(net.dp_ring(s), net.dp_topology(s), net.idle_ring(GroupKind.PIPELINE, s))
             for s in range(pp)],
            net.replica_classes())


@pytest.mark.parametrize("parallel", [
    "{tensor: 2, pipeline: 4, context: 2}", "{tensor: 4, pipeline: 4, context: 2}",
    "{tensor: 2, pipeline: 4, context: 2, schedule: interleaved, virtual_stages: 2}"])
def test_views_of_tied_orders_share_facts_and_get_their_own(write_scenario, parallel,
                                                            monkeypatch):
    request = _request(write_scenario, parallel)
    made: list[str] = []
    for name in ("_new_cp_sends", "_new_send_rates"):
        real = getattr(nv.NetView, name)
        monkeypatch.setattr(nv.NetView, name, lambda self, *a, real=real, name=name:
                            made.append(name) or real(self, *a))
    ring = nv._idle_ring
    monkeypatch.setattr(nv, "_idle_ring", lambda *a: made.append("ring") or ring(*a))
    clear_identity_memos()
    plans = _plans(request)
    together = [_figures(_view(request, plan), plan) for plan in plans]
    shared, made[:] = sorted(made), []
    alone = []
    for plan in plans:
        clear_identity_memos()  # nothing another order's view made is found
        alone.append(_figures(_view(request, plan), plan))
    assert together == alone
    for kind in ("_new_cp_sends", "_new_send_rates", "ring"):
        assert shared.count(kind) < made.count(kind), kind  # found for another order
    # The orders put other nodes on a stage: an entry found for the wrong stage's GPUs, pair
    # or ring would give another order's figures.
    assert len({repr(figures[:3]) for figures in alone}) > 1


def test_gpus_key_tells_tp_groups_across_nodes_apart():
    """A TP group on one node is keyed by its place; one across nodes by its GPUs, as its place
    (its nodes in order of first appearance, its GPUs' local indices) does not say which GPU
    is on which node."""
    cluster = prepare(bundled_scenario("mixed_ib_roce")).cluster
    a, b = cluster.nodes[0].name, cluster.nodes[1].name
    one = tuple(GpuRef(a, g) for g in range(8)) + tuple(GpuRef(b, g) for g in range(8))
    across = tuple(GpuRef(a, 4 + g) for g in range(4)) + tuple(GpuRef(b, g) for g in range(4))
    swapped = (across[0], GpuRef(b, 5)) + across[2:5] + (GpuRef(a, 1),) + across[6:]
    views = [nv.NetView(cluster, gpus, (), 8, 1, len(gpus) // 8, 1) for gpus in (one, across,
                                                                                  swapped)]
    assert views[0].gpus_key([0, 8]) == (((a,), tuple(range(8))), ((b,), tuple(range(8))))
    assert views[1]._places == views[2]._places
    assert views[1].gpus_key([0]) == across != views[2].gpus_key([0]) == swapped
