"""Holmes' adaptive partition keeps every stage within its GPUs' memory, as the report counts it."""

from __future__ import annotations

import itertools

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.plan import OptimizerMode
from holmes_sim.policies import POLICIES, base
from holmes_sim.policies.partition import StageTimer, _even, _greedy, adaptive_partition
from holmes_sim.prepare import prepare
from holmes_sim.runner import run_policy

# GPT-39B on 6 H100 nodes (IB) and 2 A100 nodes (RoCE), TP 8 PP 4 DP 2, 1F1B: in listing order
# (`holmes-no-nic-aware-order`) the three H100 stages lead, and the first holds 4 micro-batches'
# activations.
_MIXED = """\
name: partition-memory
fabrics: [{{name: ib-a, type: ib}}, {{name: roce-a, type: roce}}]
clusters:
- name: hop
  nodes:
  - count: 6
    gpu: {hop_gpu}
    gpus_per_node: 8
    intra_node: {hop_link}
    nics:
    - {{type: ib, model: ib-hdr, count: 8, fabric: ib-a}}
    - {{type: ethernet, model: eth-100g}}
- name: amp
  nodes:
  - count: 2
    gpu: a100-80gb
    gpus_per_node: 8
    intra_node: nvlink3
    nics:
    - {{type: roce, model: roce-200g, count: 8, fabric: roce-a}}
    - {{type: ethernet, model: eth-100g}}
model: {{name: gpt-39b, num_layers: 48, hidden_size: 8192, num_attention_heads: 64,
        seq_length: 2048}}
training: {{global_batch_size: 512, micro_batch_size: {mb}, recompute: none,
           sequence_parallel: true}}
parallel: {{tensor: 8, pipeline: 4, schedule: 1f1b}}
policies: [holmes, holmes-no-adaptive-partition]
inter_cluster_links:
- {{clusters: [hop, amp], bandwidth_gbit_per_s: 200, latency_us: 100}}
"""


def _scenario(write_scenario, mb: int, hop_gpu: str = "h100-sxm", hop_link: str = "nvlink4"):
    return write_scenario(_MIXED.format(mb=mb, hop_gpu=hop_gpu, hop_link=hop_link))


def _timer(prepared) -> StageTimer:
    """Holmes' partition timer of the scenario's layout in listing order."""
    request = prepared.request(prepared.cluster)
    _, gpus = base.rank_order(prepared.cluster, "listing", list)
    groups = base.build_groups(prepared.cluster, gpus, prepared.tp, prepared.pp, prepared.dp,
                               request.num_chunks, prepared.workload.tie_embeddings,
                               POLICIES["holmes"].chooser(request, gpus))
    return StageTimer(request, gpus, groups, OptimizerMode.DISTRIBUTED_OVERLAPPED)


def test_the_fast_stage_gets_no_more_layers_than_fit_its_memory(write_scenario):
    """Micro-batch 8: the time-optimal split (14/15/14/5) does not fit the first H100 stage; the
    plan (listing order) takes an uneven split that fits, still giving the H100 stages more than
    their equal share and still faster than the equal split."""
    prepared = prepare(_scenario(write_scenario, mb=8))
    holmes = run_policy(prepared, "holmes-no-nic-aware-order")
    equal = run_policy(prepared, "holmes-no-adaptive-partition")
    mem = holmes.result.memory
    assert mem.fits, mem.shortfall()
    assert all(b <= c for b, c in zip(mem.per_stage_bytes, mem.capacity_bytes))
    assert equal.plan.layers_per_stage == (12, 12, 12, 12)
    assert sum(holmes.plan.layers_per_stage[:3]) > 36
    assert holmes.result.iteration_time_s < equal.result.iteration_time_s
    timer = _timer(prepared)
    assert _greedy(timer) == (14, 15, 14, 5) and not timer.memory(_greedy(timer)).fits


def test_holmes_leads_with_the_class_whose_first_stage_fits_more(write_scenario):
    """Micro-batch 8: both class orders keep every DP group on RDMA; H100s first (the listing),
    the first stage holds 4 micro-batches' activations and cannot take the layers the H100s'
    speed earns (22.62 s). Holmes plans both orders and leads with the A100 stage (14.09 s)."""
    prepared = prepare(_scenario(write_scenario, mb=8))
    holmes = run_policy(prepared, "holmes")
    listing = run_policy(prepared, "holmes-no-nic-aware-order")
    assert holmes.plan.rank_to_gpu[0].node.startswith("amp")
    assert listing.plan.rank_to_gpu[0].node.startswith("hop")
    assert holmes.result.memory.fits, holmes.result.memory.shortfall()
    assert holmes.result.iteration_time_s < 0.7 * listing.result.iteration_time_s


def test_the_partition_is_the_fastest_split_that_fits(write_scenario):
    """Against every split of the 48 layers over the 4 stages: none that fits has a slower
    slowest stage than the search's."""
    timer = _timer(prepare(_scenario(write_scenario, mb=8)))
    got = adaptive_partition(timer)
    assert timer.memory(got).fits

    def slowest(split):
        return max(timer.stage_time_s(s, _even(n, 1)) for s, n in enumerate(split))

    fitting = [split for cuts in itertools.combinations(range(1, 48), 3)
               for split in [tuple(b - a for a, b in zip((0, *cuts), (*cuts, 48)))]
               if timer.memory(split).fits]
    assert slowest(got) == min(slowest(split) for split in fitting)


def test_holmes_keeps_a_fitting_split_over_a_faster_equal_one_that_does_not(write_scenario):
    """All A100s, micro-batch 8: the equal split needs 99.8 GiB on the first stage (4 micro-batches
    in flight) and estimates faster; the holmes plan is the uneven split that fits."""
    prepared = prepare(_scenario(write_scenario, mb=8, hop_gpu="a100-80gb", hop_link="nvlink3"))
    holmes = run_policy(prepared, "holmes")
    equal = run_policy(prepared, "holmes-no-adaptive-partition")
    assert not equal.result.memory.fits
    assert holmes.result.memory.fits, holmes.result.memory.shortfall()
    assert holmes.plan.layers_per_stage[0] < 12


def test_with_no_split_fitting_the_fastest_stays_and_the_warning_names_the_batch(write_scenario):
    """Micro-batch 16: no stage holds its share of the layers; the partition is the time-optimal
    split as before, and the warning says to shrink the micro-batch or the model state."""
    path = _scenario(write_scenario, mb=16)
    timer = _timer(prepare(path))
    assert adaptive_partition(timer) == _greedy(timer) == (14, 15, 14, 5)
    out = CliRunner().invoke(app, ["run", str(path), "--wide"], terminal_width=250)
    assert out.exit_code == 0, out.output
    assert "holmes needs 216.0 GiB per GPU, the GPUs have 80" in out.output
    assert "lower training.micro_batch_size, set training.recompute: full" in out.output


@pytest.mark.parametrize("mb", [1, 2])
def test_a_fitting_fastest_split_is_kept(write_scenario, mb):
    """Where the time-optimal split fits, the partition is that split."""
    timer = _timer(prepare(_scenario(write_scenario, mb=mb)))
    assert timer.memory(_greedy(timer)).fits
    assert adaptive_partition(timer) == _greedy(timer)
