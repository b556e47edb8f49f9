"""Holmes' NIC-aware rank order: the same plan whatever order a scenario lists its nodes in."""

from __future__ import annotations

from dataclasses import replace

from holmes_sim.plan import GroupKind, TransportKind
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy, run_policy
from tests.conftest import SCENARIOS

_NIC = {"ib": "{{type: ib, bandwidth_gbit_per_s: 200, count: 1, fabric: {}}}",
        "roce": "{{type: roce, bandwidth_gbit_per_s: 200, count: 1, fabric: {}}}"}


def _scenario(nodes: list[tuple[str, str, tuple[str, ...]]], tp: int = 8, pp: int = 2,
              batch: int = 16) -> str:
    """YAML of one cluster of 8-GPU nodes (name, GPU model, RDMA fabrics: `ib*` is InfiniBand,
    `roce*` RoCE), each also on Ethernet."""
    rows = []
    for name, gpu, fabrics in nodes:
        nics = [_NIC[f.split("-")[0]].format(f) for f in fabrics]
        nics.append("{type: ethernet, bandwidth_gbit_per_s: 100}")
        rows.append(f"      - {{name: {name}, gpu: {gpu}, gpus_per_node: 8, "
                    f"nics: [{', '.join(nics)}]}}")
    return f"""name: order
seed: 0
fabrics:
  - {{name: ib-a, type: ib}}
  - {{name: roce-a, type: roce}}
clusters:
  - name: c
    nodes:
{chr(10).join(rows)}
model: {{num_layers: 16, hidden_size: 1024, num_attention_heads: 16, seq_length: 1024,
        vocab_size: 51200}}
training: {{global_batch_size: {batch}, micro_batch_size: 1}}
parallel: {{tensor: {tp}, pipeline: {pp}}}
policies: [holmes, holmes-no-nic-aware-order, all-ib]
"""


def _stages(plan) -> list[list[str]]:
    """Each stage's nodes, in rank order."""
    per_stage = len(plan.rank_to_gpu) // plan.pp
    return [list(dict.fromkeys(g.node for g in plan.rank_to_gpu[s * per_stage:(s + 1) * per_stage]))
            for s in range(plan.pp)]


def _listings(write_scenario, *listings, **degrees):
    return [prepare(write_scenario(_scenario(nodes, **degrees))) for nodes in listings]


def test_gpu_models_share_stages_whatever_the_listing(write_scenario):
    """H100 and A100 nodes on one IB fabric, listed alternately or grouped: each stage holds
    one model (the slower first), so no stage runs the H100s at A100 speed."""
    h = [(f"h{k}", "h100-sxm", ("ib-a",)) for k in range(2)]
    a = [(f"a{k}", "a100-80gb", ("ib-a",)) for k in range(2)]
    prepared = _listings(write_scenario, [h[0], a[0], h[1], a[1]], h + a, a + h)
    for policy in ("holmes", "all-ib"):
        plans = [plan_policy(p, policy)[0] for p in prepared]
        assert all(_stages(p) == [["a0-0", "a1-0"], ["h0-0", "h1-0"]] for p in plans), policy
        times = {run_policy(p, policy).result.iteration_time_s for p in prepared}
        assert len(times) == 1, (policy, times)


def _dual_fabric_listings(write_scenario, first: str, tp: int = 4, pp: int = 2):
    """RoCE nodes ra and rb, IB nodes i and nodes d on both fabrics (`first` listed first), in
    two listings: d between ra and i with rb last, and d after rb."""
    def group(name, fabrics):
        return [(f"{name}{k}", "a100-80gb", fabrics) for k in range(2)]
    both = ("roce-a", "ib-a") if first == "roce-a" else ("ib-a", "roce-a")
    ra, rb, d, i = group("ra", ("roce-a",)), group("rb", ("roce-a",)), group("d", both), \
        group("i", ("ib-a",))
    return _listings(write_scenario, ra + d + i + rb, ra + rb + d + i, tp=tp, pp=pp)


def test_dual_fabric_nodes_sit_where_dp_groups_stay_on_rdma(write_scenario):
    """Nodes on RoCE and IB join the class whose fabric reaches the most GPUs (RoCE) at its
    boundary with IB: the stage that holds them and the IB nodes keeps its DP groups on IB,
    whichever order the nodes and their NICs are listed in."""
    prepared = [*_dual_fabric_listings(write_scenario, "roce-a"),
                *_dual_fabric_listings(write_scenario, "ib-a")]
    plans = [plan_policy(p, "holmes")[0] for p in prepared]
    for plan in plans:
        assert _stages(plan) == [["ra0-0", "ra1-0", "rb0-0", "rb1-0"],
                                 ["d0-0", "d1-0", "i0-0", "i1-0"]]
        assert {g.transport.kind for g in plan.groups_of(GroupKind.DATA)} == {TransportKind.RDMA}
        assert plan.notes == ()
    assert len({run_policy(p, "holmes").result.iteration_time_s for p in prepared}) == 1


def test_a_stage_is_noted_only_when_its_nodes_share_no_rdma_fabric(write_scenario):
    """In listing order, stage 1 of `ra rb | d i` (d on RoCE, listed first, and IB) runs its
    DP groups on IB: no note; stage 1 of `ra d | i rb` has no fabric in common: noted."""
    apart, shares = _dual_fabric_listings(write_scenario, "roce-a")
    plan = plan_policy(shares, "holmes-no-nic-aware-order")[0]
    assert {g.transport.kind for g in plan.groups_of(GroupKind.DATA)} == {TransportKind.RDMA}
    assert plan.notes == ()
    plan = plan_policy(apart, "holmes-no-nic-aware-order")[0]
    assert TransportKind.TCP in {g.transport.kind for g in plan.groups_of(GroupKind.DATA)}
    assert plan.notes == ("stage 1 spans NIC classes ib-a, roce-a",)


def test_class_boundaries_fall_on_stage_boundaries(write_scenario):
    """One IB node, four RoCE and three Ethernet-only, TP 8 PP 4 (two nodes a stage): the classes
    ordered RoCE (32 GPUs), Ethernet, IB leave one stage spanning classes, not two (IB first,
    in listing order), whichever class is listed first."""
    i = [("i0", "a100-80gb", ("ib-a",))]
    r = [(f"r{k}", "a100-80gb", ("roce-a",)) for k in range(4)]
    e = [(f"e{k}", "a100-80gb", ()) for k in range(3)]
    prepared = _listings(write_scenario, i + r + e, r + e + i, e + i + r, pp=4)
    for p in prepared:
        plan = plan_policy(p, "holmes")[0]
        assert _stages(plan) == [["r0-0", "r1-0"], ["r2-0", "r3-0"], ["e0-0", "e1-0"],
                                 ["e2-0", "i0-0"]]
        assert plan.notes == ("stage 3 spans NIC classes ethernet, ib-a",)


def test_a_class_that_fills_stages_keeps_them_whatever_the_other_sizes(write_scenario):
    """Six IB A100 nodes, two RoCE H100 and four Ethernet-only A100, TP 8 PP 2 (six nodes a
    stage): the IB class fills stage 0, so only stage 1 (RoCE and Ethernet, which share no
    fabric whatever the order) runs its DP groups on TCP, in every listing. Ordered by the
    largest power of two dividing each class's GPUs, Ethernet (32) led and both stages
    spanned classes (0.171 s against 0.121 s)."""
    i = [(f"i{k}", "a100-80gb", ("ib-a",)) for k in range(6)]
    r = [(f"r{k}", "h100-sxm", ("roce-a",)) for k in range(2)]
    e = [(f"e{k}", "a100-80gb", ()) for k in range(4)]
    prepared = _listings(write_scenario, i + r + e, e + i + r, r + e + i, batch=24)
    for p in prepared:
        plan = plan_policy(p, "holmes")[0]
        assert _stages(plan) == [[f"i{k}-0" for k in range(6)],
                                 [*(f"e{k}-0" for k in range(4)), "r0-0", "r1-0"]]
        assert plan.notes == ("stage 1 spans NIC classes ethernet, roce-a",)
        assert {str(g.transport) for g in plan.groups_of(GroupKind.DATA)
                if g.ranks[0] < 48} == {"rdma:ib-a"}
    times = [run_policy(p, "holmes").result.iteration_time_s for p in prepared]
    assert len(set(times)) == 1
    assert times[0] <= min(run_policy(p, "holmes-no-nic-aware-order").result.iteration_time_s
                           for p in prepared)


def test_clusters_listed_either_way_get_the_same_placement(write_scenario):
    """Four H100 nodes on IB and four A100 nodes on RoCE, TP 8 PP 2: both class orders keep
    every DP group on RDMA; Holmes plans both and keeps the one its estimate prices faster
    (the A100 stage first, 7 + 9 layers), whichever cluster is listed first. By first
    appearance, the H100s first took 8 + 8 layers, 0.0937 s against 0.0874 s."""
    h = [(f"h{k}", "h100-sxm", ("ib-a",)) for k in range(4)]
    a = [(f"a{k}", "a100-80gb", ("roce-a",)) for k in range(4)]
    prepared = _listings(write_scenario, h + a, a + h)
    plans = [plan_policy(p, "holmes")[0] for p in prepared]
    assert all(_stages(p) == [[f"a{k}-0" for k in range(4)], [f"h{k}-0" for k in range(4)]]
               for p in plans)
    assert {p.layers_per_stage for p in plans} == {(7, 9)}
    times = {run_policy(p, "holmes").result.iteration_time_s for p in prepared}
    assert len(times) == 1
    assert min(times) < run_policy(prepared[0], "holmes-no-nic-aware-order").result.iteration_time_s


SMALL_GPU = """catalog:
  gpus: {h100small: {peak_tflops: 312, memory_gib: 11.5, memory_bandwidth_gbyte_per_s: 3350,
                     compute_efficiency: 0.6, sm_count: 132, intra_node: nvlink4}}
"""


def test_an_order_whose_plan_fits_beats_a_faster_one_that_does_not(write_scenario):
    """Two H100 nodes on RoCE and two slow 11.5 GiB GPU nodes on IB, Llama 2 13B, TP 8 PP 2,
    equal split: the slow nodes first is estimated faster (5.20 s against 5.50 s) but needs
    12.2 GiB on stage 0, which holds the most micro-batches; Holmes keeps the order that fits
    (the slow nodes last, as megatron's listing order has them)."""
    text = (f"""name: memorder
fabrics: [{{name: ib, type: ib}}, {{name: roce, type: roce}}]
clusters:
  - name: c
    nodes:
      - {{name: big, count: 2, gpu: h100-sxm, nics: [{{type: roce, model: roce-200g, count: 4,
          fabric: roce}}, {{type: ethernet, model: eth-100g}}]}}
      - {{name: small, count: 2, gpu: h100small, nics: [{{type: ib, model: ib-ndr, count: 8,
          fabric: ib}}, {{type: ethernet, model: eth-100g}}]}}
model: {{preset: llama2-13b, seq_length: 4096}}
training: {{global_batch_size: 64, micro_batch_size: 1, recompute: selective,
           flash_attention: true, sequence_parallel: true}}
parallel: {{tensor: 8, pipeline: 2}}
policies: [megatron, holmes-no-adaptive-partition]
""" + SMALL_GPU)
    prepared = prepare(write_scenario(text))
    outcome = run_policy(prepared, "holmes-no-adaptive-partition")
    assert outcome.result.memory.fits
    assert _stages(outcome.plan)[1] == ["small-0", "small-1"]


def test_many_classes_are_ordered_class_by_class_whatever_the_listing():
    """Past `_PERMUTED` classes the order is built class by class: the same for any listing,
    and no worse (`_cost`) than the listing's own order of classes."""
    from holmes_sim.policies import holmes

    template = prepare(SCENARIOS / "mixed_ib_roce.yaml").cluster.nodes[0]
    sizes = (3, 1, 2, 2, 1, 3, 4)  # nodes a class: 16 nodes, 4 a stage at TP 8 PP 4 (DP 4)
    nodes = []
    for c, n in enumerate(sizes):
        nics = tuple(replace(nic, fabric=f"f{c}") if nic.fabric else nic for nic in template.nics)
        nodes += [replace(template, name=f"n{c}-{k}", nics=nics) for k in range(n)]
    assert len(sizes) > holmes._PERMUTED
    orders = [[n.name.split("-")[0] for n in holmes.nic_aware_order(listed, 32)]
              for listed in (nodes, nodes[::-1], nodes[1::2] + nodes[::2])]
    assert orders[0] == orders[1] == orders[2]
    classes = holmes._Classes(nodes)
    chosen = classes.best_orders(32, ())
    assert len(chosen) == 1
    listed = tuple(f"f{c}" for c in range(len(sizes)))
    assert holmes._cost(classes.runs(chosen[0]), 32, ()) <= \
        holmes._cost(classes.runs(listed), 32, ())


def _edp_kinds(plan) -> set[str]:
    return {str(g.transport) for g in plan.groups_of(GroupKind.EXPERT_DATA)}


def test_expert_dp_groups_keep_rdma_where_their_reductions_cost_more(write_scenario):
    """The bundled `moe_mixed_nics` (IB and RoCE nodes alternate) at PP 1, EP 2, 8 micro-batches:
    one stage spans both fabrics, so either the EP groups (blocks of two nodes) or the
    expert-DP groups (every other node) can stay on RDMA. Mixtral's expert gradients outweigh
    its all-to-alls: Holmes lays the stage out for the expert-DP groups, as fast as the listing
    order, and notes the EP groups that cross (class by class, the expert-DP groups ran on TCP:
    15.84 s against 6.76 s)."""
    text = (SCENARIOS / "moe_mixed_nics.yaml").read_text()
    for old, new in (("\n  pipeline: 2", "\n  pipeline: 1"), ("\n  expert: 4", "\n  expert: 2"),
                     ("global_batch_size: 256", "global_batch_size: 64"),
                     ("policies: [megatron, ", "policies: [")):
        assert old in text
        text = text.replace(old, new)
    prepared = prepare(write_scenario(text))
    plan = plan_policy(prepared, "holmes")[0]
    assert _edp_kinds(plan) == {"rdma:ib", "rdma:roce"}
    on_tcp = sum(str(g.transport) == "tcp:ethernet" for g in plan.groups_of(GroupKind.EXPERT))
    assert on_tcp == 32  # the note counts the groups, not the blocks of ranks they lie in
    assert plan.notes == ("stage 0 spans NIC classes ib, roce",
                          f"stage 0: {on_tcp} EP group(s) span NIC classes (from rank 0); their "
                          "all-to-alls leave RDMA")
    times = {p: run_policy(prepared, p).result.iteration_time_s
             for p in ("holmes", "holmes-no-nic-aware-order")}
    assert times["holmes"] <= times["holmes-no-nic-aware-order"], times


def test_ep_groups_keep_rdma_where_their_all_to_alls_cost_more(write_scenario):
    """IB, RoCE, IB, RoCE nodes, TP 8, EP 2, a small MoE: at 2 micro-batches the expert-DP
    reductions weigh more (Holmes takes the listing's layout, 0.213 s; class by class 0.318 s),
    at 8 the all-to-alls (class by class, 0.428 s; the listing's 0.472 s), and the expert-DP
    groups that then cross are noted."""
    from tests.sim.test_expert_parallel import _mixed_nodes, ep_scenario

    def prepared(batch: int):
        return prepare(write_scenario(ep_scenario(
            groups=_mixed_nodes(("ib", "roce", "ib", "roce")), tp=8, ep=2, global_batch=batch,
            policies="[holmes, holmes-no-nic-aware-order]")))

    few, many = prepared(8), prepared(32)
    plan = plan_policy(few, "holmes")[0]
    assert _edp_kinds(plan) == {"rdma:ib", "rdma:roce"}
    assert _stages(plan) == [["n0-0", "n1-0", "n2-0", "n3-0"]]
    plan = plan_policy(many, "holmes")[0]
    assert {str(g.transport) for g in plan.groups_of(GroupKind.EXPERT)} == {"rdma:ib",
                                                                            "rdma:roce"}
    assert _edp_kinds(plan) == {"tcp:ethernet"}
    assert plan.notes == ("stage 0 spans NIC classes ib, roce",
                          "stage 0: 16 expert-DP group(s) span NIC classes (from rank 0); "
                          "their expert-gradient reductions leave RDMA")
    times = {p: run_policy(many, p).result.iteration_time_s
             for p in ("holmes", "holmes-no-nic-aware-order")}
    assert times["holmes"] < times["holmes-no-nic-aware-order"], times


def test_bundled_moe_mixed_nics_keeps_every_expert_group_on_rdma():
    """PP 2 puts the IB nodes on one stage and the RoCE nodes on the other: the EP groups on
    RDMA, nothing to note (EP 4 of 4 replicas: no expert-DP groups)."""
    plan = plan_policy(prepare(SCENARIOS / "moe_mixed_nics.yaml"), "holmes")[0]
    assert {str(g.transport) for g in plan.groups_of(GroupKind.EXPERT)} == {"rdma:ib",
                                                                            "rdma:roce"}
    assert _edp_kinds(plan) == set()
    assert plan.notes == ()
