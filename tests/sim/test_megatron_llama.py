"""Megatron-LLaMA's overlapped distributed optimizer in both releases: the traffic each moves
in a steady-state iteration, in the engine and the estimate (policies/megatron.py)."""

from __future__ import annotations

import pytest

from holmes_sim.errors import PlanError
from holmes_sim.estimate.analytic import estimate_iteration
from holmes_sim.export.refusals import MEGATRON_LLAMA_REFUSAL, framework_refusal
from holmes_sim.plan import OptimizerMode
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy, run_policy
from holmes_sim.sim.trace import OpKind
from tests.conftest import small_scenario

POLICIES = "[megatron, megatron-llama, megatron-llama-2023-08]"


def _dp_bound(write_scenario, pp: int, schedule: str = "1f1b", virtual: int = 1):
    """Ethernet-only nodes, DP 2, 4 MB buckets: the gradient sync is a large share of the step."""
    text = small_scenario(nodes_eth=2 * pp, nodes_ib=0, tp=8, pp=pp, layers=4, global_batch=8,
                          eth_gbit=10, schedule=schedule, virtual=virtual, policies=POLICIES)
    text = text.replace("training: {", "training: {bucket_size_mb: 4, ")
    return prepare(write_scenario(text))


def _bytes(out, kind: OpKind) -> float:
    return sum(r.bytes for r in out.trace.records if r.kind is kind)


@pytest.fixture
def pipelined(write_scenario):
    prepared = _dp_bound(write_scenario, pp=2)
    return prepared, {p: run_policy(prepared, p) for p in ("megatron", "megatron-llama",
                                                           "megatron-llama-2023-08")}


def test_each_release_gets_its_optimizer(pipelined):
    _, out = pipelined
    assert out["megatron-llama"].plan.optimizer is OptimizerMode.PER_MICROBATCH_OVERLAPPED
    assert out["megatron-llama-2023-08"].plan.optimizer is OptimizerMode.REDUCE_SCATTER_ONCE
    for policy in ("megatron-llama", "megatron-llama-2023-08"):
        assert framework_refusal(out[policy].plan) == MEGATRON_LLAMA_REFUSAL  # no launch


def test_released_optimizer_moves_no_gradients_in_a_steady_iteration(pipelined):
    """d2e05b8 under PP > 1: each bucket was reduce-scattered in the run's first micro-batch and
    never again, so a later iteration moves only the parameter all-gather of `step()`."""
    prepared, out = pipelined
    assert _bytes(out["megatron"], OpKind.DP_REDUCE_SCATTER) > 0
    assert _bytes(out["megatron-llama-2023-08"], OpKind.DP_REDUCE_SCATTER) == 0
    assert _bytes(out["megatron-llama-2023-08"], OpKind.DP_ALL_GATHER) == \
        pytest.approx(_bytes(out["megatron"], OpKind.DP_ALL_GATHER), rel=1e-12)
    t = {p: o.result.iteration_time_s for p, o in out.items()}
    assert t["megatron-llama-2023-08"] < t["megatron"] < t["megatron-llama"]


def test_fixed_optimizer_reduces_every_microbatch(pipelined):
    """e48bbb3 / 25306de: every micro-batch's backward reduce-scatters every bucket (m times
    Megatron-LM's gradient bytes), and the parameter all-gather gates the next forward."""
    prepared, out = pipelined
    assert _bytes(out["megatron-llama"], OpKind.DP_REDUCE_SCATTER) == pytest.approx(
        prepared.num_microbatches * _bytes(out["megatron"], OpKind.DP_REDUCE_SCATTER), rel=1e-12)
    assert _bytes(out["megatron-llama"], OpKind.DP_ALL_GATHER) == \
        pytest.approx(_bytes(out["megatron"], OpKind.DP_ALL_GATHER), rel=1e-12)


@pytest.mark.parametrize("pp", [1, 2])
def test_estimate_agrees_with_the_engine_for_both_releases(write_scenario, pp):
    prepared = _dp_bound(write_scenario, pp=pp)
    for policy in ("megatron-llama", "megatron-llama-2023-08"):
        out = run_policy(prepared, policy)
        est = estimate_iteration(out.plan, out.cluster, prepared.workload, prepared.compute)
        assert est.iteration_s == pytest.approx(out.result.iteration_time_s, rel=0.02), policy


def test_without_pipeline_both_releases_reduce_every_microbatch(write_scenario):
    """forward_backward_no_pipelining calls `backward_epilogue()` in both releases; the fixed one
    also moves the all-gather ahead of the next forward."""
    prepared = _dp_bound(write_scenario, pp=1)
    out = {p: run_policy(prepared, p) for p in ("megatron", "megatron-llama", "megatron-llama-2023-08")}
    assert out["megatron-llama-2023-08"].plan.optimizer is OptimizerMode.PER_MICROBATCH_GATHER_IN_STEP
    grads = prepared.num_microbatches * _bytes(out["megatron"], OpKind.DP_REDUCE_SCATTER)
    for policy in ("megatron-llama", "megatron-llama-2023-08"):
        assert _bytes(out[policy], OpKind.DP_REDUCE_SCATTER) == pytest.approx(grads, rel=1e-12)


def test_fixed_release_refuses_the_interleaved_schedule(write_scenario):
    """Its interleaved schedule neither resets the buckets nor gathers the parameters (upstream
    issue #37); the released one reduces once under it as under 1F1B."""
    prepared = _dp_bound(write_scenario, pp=2, schedule="interleaved", virtual=2)
    with pytest.raises(PlanError, match="interleaved"):
        plan_policy(prepared, "megatron-llama")
    assert plan_policy(prepared, "megatron-llama-2023-08")[0].optimizer is OptimizerMode.REDUCE_SCATTER_ONCE
