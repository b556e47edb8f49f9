"""Holmes' NIC-aware rank order: the same plan whatever order a scenario lists its nodes in."""

from __future__ import annotations

from holmes_sim.plan import GroupKind, TransportKind
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy, run_policy

_NIC = {"ib": "{{type: ib, bandwidth_gbit_per_s: 200, count: 1, fabric: {}}}",
        "roce": "{{type: roce, bandwidth_gbit_per_s: 200, count: 1, fabric: {}}}"}


def _scenario(nodes: list[tuple[str, str, tuple[str, ...]]], tp: int = 8, pp: int = 2) -> str:
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
training: {{global_batch_size: 16, micro_batch_size: 1}}
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

