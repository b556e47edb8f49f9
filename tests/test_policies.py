"""Plan invariants of every policy, and the mechanisms Holmes adds."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.hardware.cluster import ETHERNET
from holmes_sim.plan import GroupKind, Plan, TransportKind
from holmes_sim.policies import POLICIES, base
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy, run_policy
from tests.conftest import SCENARIOS, small_scenario


def _fabric_of(cluster, gpu, fabric):
    return cluster.node(gpu.node).nic_of_gpu(gpu.local_index, fabric)


@pytest.mark.parametrize("scenario", ["mixed_ib_eth", "mixed_ib_roce", "two_clusters_39b"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_gpu_used_once_and_groups_complete(scenario, policy):
    prepared = prepare(SCENARIOS / f"{scenario}.yaml")
    plan, cluster = plan_policy(prepared, policy)
    assert len(plan.rank_to_gpu) == cluster.num_gpus == len(set(plan.rank_to_gpu))
    assert sum(plan.layers_per_stage) == prepared.workload.num_layers
    assert min(plan.layers_per_stage) >= 1
    dp_members = sorted(r for g in plan.groups_of(GroupKind.DATA) for r in g.ranks)
    assert dp_members == list(range(plan.world_size))
    for g in plan.groups:
        gpus = [plan.rank_to_gpu[r] for r in g.ranks]
        if g.transport.kind is TransportKind.LOCAL:
            assert len({x.node for x in gpus}) == 1
        else:  # every member has a NIC on the group's fabric, and the plan names it
            for gpu, nic in zip(gpus, g.nics, strict=True):
                assert _fabric_of(cluster, gpu, g.transport.fabric).name == nic
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("scenario", ["mixed_ib_eth", "mixed_ib_roce", "two_clusters_39b"])
def test_holmes_keeps_every_dp_group_on_one_rdma_fabric_or_node(scenario):
    prepared = prepare(SCENARIOS / f"{scenario}.yaml")
    plan, cluster = plan_policy(prepared, "holmes")
    for g in plan.groups_of(GroupKind.DATA):
        nodes = [cluster.node(plan.rank_to_gpu[r].node) for r in g.ranks]
        rdma_everywhere = all(n.rdma_fabrics for n in nodes)
        if rdma_everywhere:  # members that have RDMA share one fabric and use it
            assert g.transport.kind in (TransportKind.RDMA, TransportKind.LOCAL)
        else:  # Ethernet-only nodes: TCP, but never mixed with RDMA nodes
            assert not any(n.rdma_fabrics for n in nodes)


def test_megatron_uses_tcp_for_groups_spanning_ib_and_roce():
    prepared = prepare(SCENARIOS / "mixed_ib_roce.yaml")
    plan, cluster = plan_policy(prepared, "megatron")
    spanning = 0
    for g in plan.groups:
        fabrics = {cluster.node(plan.rank_to_gpu[r].node).rdma_fabrics[0] for r in g.ranks}
        if len(fabrics) > 1:
            spanning += 1
            assert g.transport.kind is TransportKind.TCP and g.transport.fabric == ETHERNET
    assert spanning > 0  # racked alternately: listing order mixes IB and RoCE in DP groups


def test_nic_aware_order_groups_nodes_by_fabric():
    prepared = prepare(SCENARIOS / "mixed_ib_roce.yaml")
    holmes, _ = plan_policy(prepared, "holmes")
    listing, _ = plan_policy(prepared, "holmes-no-nic-aware-order")
    stage0 = {g.node.split("-")[0] for g in holmes.rank_to_gpu[:32]}
    assert stage0 in ({"ib"}, {"roce"})
    assert {g.node.split("-")[0] for g in listing.rank_to_gpu[:32]} == {"ib", "roce"}
    # Listing order mixes IB and RoCE in stage 0's DP group, which then runs on TCP.
    assert run_policy(prepared, "holmes").result.iteration_time_s < \
        0.95 * run_policy(prepared, "holmes-no-nic-aware-order").result.iteration_time_s


def test_adaptive_partition_gives_the_faster_stage_more_layers(write_scenario):
    """Stage 0 on IB, stage 1 on Ethernet-only nodes: Ethernet DP sync is slow, so the IB stage
    takes more layers, and the slowest stage gets faster than with an equal split."""
    text = small_scenario(nodes_ib=2, nodes_eth=2, tp=8, pp=2, layers=24, global_batch=16,
                          eth_gbit=10, policies="[holmes, holmes-no-adaptive-partition]")
    prepared = prepare(write_scenario(text))
    adaptive = run_policy(prepared, "holmes")
    equal = run_policy(prepared, "holmes-no-adaptive-partition")
    assert equal.plan.layers_per_stage == (12, 12)
    assert adaptive.plan.layers_per_stage[0] > adaptive.plan.layers_per_stage[1]
    assert adaptive.result.iteration_time_s < equal.result.iteration_time_s


@pytest.mark.parametrize("name", ["mixed_ib_roce", "mixed_ib_eth", "large_175b_1024"])
def test_partition_search_equals_the_plain_greedy(name):
    """The search prices alike stages once and keeps its trials in a heap: the same layers
    as adding each layer to the stage of smallest trial time over every stage, uncached."""
    from holmes_sim.search import planner
    from holmes_sim.plan import OptimizerMode
    from holmes_sim.policies.holmes import nic_aware_ranks
    from holmes_sim.policies.partition import StageTimer, _even, _greedy

    prepared = prepare(SCENARIOS / f"{name}.yaml")
    grid = list(planner.layouts(prepared, prepared.scenario.search))
    policy = POLICIES["holmes"]
    for layout in grid[::max(1, len(grid) // 25)]:
        p = planner.prepared_for(prepared, layout)
        request = p.request(p.cluster)
        _, (_, gpus) = nic_aware_ranks(request)[0]
        groups = base.build_groups(p.cluster, gpus, p.tp, p.pp, p.dp, request.num_chunks,
                                   p.workload.tie_embeddings, policy.chooser(request, gpus))
        timer = StageTimer(request, gpus, groups, OptimizerMode.DISTRIBUTED_OVERLAPPED)
        if p.workload.num_layers < p.pp * request.num_chunks:
            continue

        def plain(s, layers, timer=timer):
            return max(timer._replica_time_s(s, node, layers) for node in timer.nodes[s])

        v, pp = request.num_chunks, p.pp
        totals = [v] * pp
        trials = [plain(s, _even(v + 1, v)) for s in range(pp)]
        for _ in range(p.workload.num_layers - pp * v):
            best = min(range(pp), key=lambda s, trials=trials: (trials[s], s))
            totals[best] += 1
            trials[best] = plain(best, _even(totals[best] + 1, v))
        per_stage = [_even(t, v) for t in totals]
        assert _greedy(timer) == tuple(per_stage[j % pp][j // pp] for j in range(pp * v)), layout


def test_overlap_hides_data_parallel_time():
    prepared = prepare(SCENARIOS / "mixed_ib_roce.yaml")
    on = run_policy(prepared, "holmes").result
    off = run_policy(prepared, "holmes-no-overlap").result
    assert on.breakdown_s["dp_exposed"] < off.breakdown_s["dp_exposed"]
    assert on.iteration_time_s < off.iteration_time_s


def test_references_bound_holmes_in_the_mixed_scenarios():
    for name in ("mixed_ib_eth", "mixed_ib_roce", "two_clusters_39b"):
        prepared = prepare(SCENARIOS / f"{name}.yaml")
        t = {p: run_policy(prepared, p).result.iteration_time_s
             for p in ("all-ib", "holmes", "megatron", "all-ethernet")}
        assert t["all-ib"] <= t["holmes"] < t["megatron"], name
        assert t["holmes"] < t["all-ethernet"], name


def test_all_ib_view_puts_every_node_on_one_fabric():
    prepared = prepare(SCENARIOS / "mixed_ib_eth.yaml")
    _, cluster = plan_policy(prepared, "all-ib")
    assert all(n.rdma_fabrics == ("all-ib",) for n in cluster.nodes)


def test_a_plan_with_lazy_groups_equals_serialises_and_pickles_as_with_its_tuple():
    import pickle
    from dataclasses import replace

    from holmes_sim.plan import Groups

    plan, _ = plan_policy(prepare(SCENARIOS / "two_clusters_39b.yaml"), "holmes")
    assert isinstance(plan.groups, Groups)
    eager = replace(plan, groups=tuple(plan.groups))
    assert plan == eager and eager == plan and hash(plan) == hash(eager)
    assert plan.to_json() == eager.to_json()
    assert Plan.from_json(plan.to_json()) == plan
    assert pickle.loads(pickle.dumps(plan)) == eager


def test_a_plan_releases_gradients_in_backward_exactly_for_the_modes_that_reduce_there():
    from dataclasses import replace

    from holmes_sim.plan import OptimizerMode

    plan, _ = plan_policy(prepare(SCENARIOS / "mixed_ib_roce.yaml"), "megatron")
    for mode in OptimizerMode:
        for overlap in (False, True):
            p = replace(plan, optimizer=mode, overlap_grad_reduce=overlap)
            expected = overlap or mode.overlapped or mode.reduces_every_microbatch
            assert p.releases_gradients_in_backward is expected, (mode, overlap)


def test_a_transport_error_found_while_simulating_names_the_policy(write_scenario):
    """IB nodes without Ethernet in groups with RoCE nodes: no transport reaches both. The error
    surfaces when the simulation meets the group and names the policy whose plan made it, and
    the file, line and path of the NICs to change."""
    text = (SCENARIOS / "mixed_ib_roce.yaml").read_text().replace(
        ", {type: ethernet, model: eth-100g, bandwidth_gbit_per_s: 32}]}", "]}", 1)
    path = write_scenario(text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "name: ib-a," in t)
    check = CliRunner().invoke(app, ["check", str(path)])
    assert check.exit_code == 2 and f"{path}:{line}: clusters[0].nodes[0].nics" in check.output
    for policy in ("megatron", "holmes"):
        result = CliRunner().invoke(app, ["run", str(path), "-q", "-p", policy])
        message = " ".join(result.output.split())
        assert result.exit_code == 2, message
        assert f"error: {policy}: {path}:{line}: clusters[0].nodes[0].nics: nodes ib-a-0" \
            in message, message
        assert "share no RDMA fabric" in message and message.count("error:") == 1


def test_the_transport_error_follows_an_edited_file(write_scenario):
    """In one process (a notebook), the error's line is the file's as it is now."""
    from holmes_sim.errors import PlanError
    from holmes_sim.runner import run_policy

    text = (SCENARIOS / "mixed_ib_roce.yaml").read_text().replace(
        ", {type: ethernet, model: eth-100g, bandwidth_gbit_per_s: 32}]}", "]}", 1)
    path = write_scenario(text)
    lines = []
    for prefix in ("", "# one\n# two\n"):
        path.write_text(prefix + text)
        with pytest.raises(PlanError) as err:
            run_policy(prepare(path), "megatron")
        lines.append(int(str(err.value).split(f"{path}:")[1].split(":")[0]))
    assert lines[1] == lines[0] + 2
