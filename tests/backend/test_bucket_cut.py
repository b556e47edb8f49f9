"""The simulator's gradient buckets (`model.bucket_layout`, Megatron-Core's cut) against the
backend's (`backend/data_parallel.py`), and the cut's rules on hand-worked cases."""

from __future__ import annotations

import dataclasses

import pytest

from holmes_sim.backend.data_parallel import bucket_sizes, make_buckets, routed_expert_ids
from holmes_sim.backend.model import TensorParallel
from holmes_sim.backend.moe import ExpertParallel
from holmes_sim.backend.rank import build_stages
from holmes_sim.cost.ops import OpCosts
from holmes_sim.model.bucket_layout import chunk_bucket_runs
from holmes_sim.plan import DEFAULT_BUCKET_NUMEL, OptimizerMode
from holmes_sim.prepare import prepare, prepare_text
from holmes_sim.runner import plan_policy
from holmes_sim.sim.gradient_buckets import chunk_buckets
from holmes_sim.validation.testbed_plan import model_config
from tests.conftest import REPO

TESTBEDS = REPO / "holmes_sim" / "data" / "testbeds"


@pytest.mark.parametrize("name", sorted(p.stem for p in TESTBEDS.glob("*.yaml")))
def test_simulated_buckets_are_the_backends_for_every_bundled_testbed(name):
    """Every chunk of every stage of each policy's plan: the dense and the routed experts'
    buckets have the elements the backend's buckets of the same model have, in the same order
    (one per buffer where the plan reduces after the backward), with and without the
    distributed optimizer's parameter alignment."""
    prepared = prepare(TESTBEDS / f"{name}.yaml")
    w = prepared.workload
    plans = [plan_policy(prepared, policy)[0] for policy in prepared.scenario.policies]
    # Megatron-Core's DDP with overlapped reduction: only pipeline rank 0's first chunk is cut.
    plans += [dataclasses.replace(p, overlap_grad_reduce=True) for p in plans
              if p.policy == "megatron" and not p.overlap_grad_reduce]
    for plan in plans:
        policy = (plan.policy, plan.overlap_grad_reduce)
        for s in range(plan.pp):
            tp = TensorParallel(plan.tp, 0, lambda x: x, lambda x: x) if plan.tp > 1 else None
            ep = ExpertParallel(w.ep, 0, None) if w.ep > 1 else None
            stages = build_stages(plan, model_config(prepared), s, tp, ep)
            experts = routed_expert_ids(stages)
            numels = bucket_sizes(plan, s, w.given_bucket_numel)
            for c in range(plan.num_chunks):
                backend = [[b.numel for b in make_buckets(stages, [c], plan.dp, numels, keep)]
                           for keep in (lambda p: id(p) not in experts, lambda p: id(p) in experts)]
                v = c * plan.pp + s
                for sharded in (False, True):
                    dense, routed = chunk_bucket_runs(
                        w, plan.tp, sum(plan.layers_per_stage[:v]), plan.layers_per_stage[v],
                        v == 0, v == len(plan.layers_per_stage) - 1, sharded,
                        plan.bucket_numel(v, w.given_bucket_numel))
                    assert list(dense.numels) == backend[0], (policy, s, c)
                    assert list(routed.numels if routed else ()) == backend[1], (policy, s, c)


def test_moe_edp_cut_by_hand():
    """moe_edp (h 128, 4 layers, V 512, s 128, E 4 of FFN 256, EP 2, 0.5 MB = 125,000 fp32
    elements): reversed, the output layer (65,536) and final norm (256), then layer 3's router
    (512), pre-MLP norm (256), QKV (384 + 49,152) reach 116,096 < 125,000, its projection
    (128 + 16,384) closes the bucket at 132,608; the next ends with layer 1's QKV at 134,144;
    the last holds the rest (149,248). Each layer's two local experts (2 x 65,920) close an
    expert bucket at the layer's end. The head's bucket is ready first, the last at 1."""
    w = prepare(TESTBEDS / "moe_edp.yaml").workload
    dense, routed = chunk_bucket_runs(w, 1, 0, 4, True, True, True, 125_000)
    assert dense.numels == (132_608, 134_144, 149_248)
    assert routed.numels == (131_840,) * 4
    assert sum(dense.shares) == pytest.approx(1.0) and dense.ready[-1] == 1.0
    assert list(dense.ready) == sorted(dense.ready) and list(routed.ready) == sorted(routed.ready)
    assert routed.ready[-1] < 1.0  # layer 0's attention runs after its experts
    # Without overlapped reduction Megatron-Core keeps one bucket per buffer.
    one, experts = chunk_bucket_runs(w, 1, 0, 4, True, True, True, None)
    assert one.numels == (sum(dense.numels),) and experts.numels == (4 * 131_840,)


def test_alignment_and_tied_embeddings_under_the_distributed_optimizer():
    """Sharded: parameters start at multiples of 64 elements, which can close a bucket one
    parameter earlier; a tied word embedding on a pipeline's first or last stage gets a bucket
    of its own."""
    prepared = prepare(TESTBEDS / "default.yaml")
    # h 100, V 512: the output layer (51,200) and the final norm's bias (100) end at 51,300
    # either way; aligned, the norm's weight starts at 51,328 and ends past 51,410, closing the
    # bucket; unaligned it ends at 51,400 and the next parameter (layer 3's fc2 bias) closes it.
    w = dataclasses.replace(prepared.workload, hidden=100)
    plain, _ = chunk_bucket_runs(w, 1, 2, 2, False, True, False, 51_410)
    aligned, _ = chunk_bucket_runs(w, 1, 2, 2, False, True, True, 51_410)
    assert sum(plain.numels) == sum(aligned.numels)
    assert plain.numels[0] == 51_500 and aligned.numels[0] == 51_400
    tied = dataclasses.replace(w, tie_embeddings=True)
    last, _ = chunk_bucket_runs(tied, 1, 2, 2, False, True, True, 250_000_000_000)
    first, _ = chunk_bucket_runs(tied, 1, 0, 2, True, False, True, 250_000_000_000)
    assert last.numels[0] == w.vocab * w.hidden and len(last.numels) == 2
    assert first.numels[-1] == w.vocab * w.hidden and len(first.numels) == 2
    assert len(chunk_bucket_runs(tied, 1, 0, 2, True, False, False, 250_000_000_000)[0].numels) == 1


def test_engine_buckets_carry_the_chunks_bytes_and_its_whole_compute():
    """The engine's buckets of each chunk: gradient bytes add up to the chunk's, compute
    fractions to 1, released in order of their ready points."""
    prepared = prepare(TESTBEDS / "moe_edp.yaml")
    plan, cluster = plan_policy(prepared, "megatron")
    w = prepared.workload
    costs = OpCosts(cluster, w, prepared.compute, plan.tp)
    got = chunk_buckets(costs, plan.layers_per_stage, 0, True, True, 125_000)
    params = costs.virtual_stage_params(plan.layers_per_stage, 0)
    assert sum(b.grad_bytes for b in got) == pytest.approx(w.grad_bytes_of(params), rel=1e-12)
    assert sum(b.fraction for b in got) == pytest.approx(1.0, rel=1e-12)
    assert [b.expert for b in got].count(True) == 4 and min(b.fraction for b in got) >= 0
    dense_only = chunk_buckets(costs, plan.layers_per_stage, 0, False, True, 125_000)
    assert [b.expert for b in dense_only] == [False] * 3


def _megatron_plan(testbed: str, **changes):
    prepared = prepare(TESTBEDS / f"{testbed}.yaml")
    plan = plan_policy(prepared, "megatron")[0]
    return prepared.workload, dataclasses.replace(plan, **changes)


def test_megatron_core_cuts_only_the_first_chunk_of_pipeline_rank_0():
    """`DistributedDataParallel.__init__`: `bucket_size` None where `pp_rank > 0` or
    `disable_bucketing` (every model chunk after the first, `get_model`): on the interleaved
    testbed (PP 2 x 2 chunks) virtual stage 0 keeps the scenario's 0.5 MB (125,000 elements)
    and is cut into several buckets; stage 1 (rank 1) and stages 2, 3 (second chunks) hold one
    bucket per buffer, ready at the end of the chunk's backward, in the engine and the backend."""
    w, plan = _megatron_plan("interleaved", overlap_grad_reduce=True)
    assert plan.pp == 2 and plan.num_chunks == 2 and w.given_bucket_numel == 125_000
    assert [plan.bucket_numel(j, 125_000) for j in range(4)] == [125_000, None, None, None]
    assert bucket_sizes(plan, 0, 125_000) == [125_000, None]
    assert bucket_sizes(plan, 1, 125_000) == [None, None]
    prepared = prepare(TESTBEDS / "interleaved.yaml")
    costs = OpCosts(plan_policy(prepared, "megatron")[1], w, prepared.compute, plan.tp)
    for j in range(4):
        got = chunk_buckets(costs, plan.layers_per_stage, j, False, True,
                            plan.bucket_numel(j, w.given_bucket_numel))
        assert len(got) > 1 if j == 0 else [b.fraction for b in got] == [1.0], j
    # Holmes' overlapped optimizer (Megatron-LLaMA's code) cuts every chunk.
    holmes = dataclasses.replace(plan, overlap_grad_reduce=False,
                                 optimizer=OptimizerMode.DISTRIBUTED_OVERLAPPED)
    assert [holmes.bucket_numel(j, 125_000) for j in range(4)] == [125_000] * 4


def test_default_bucket_size_follows_megatron_core_and_a_given_size_stays():
    """Unset `bucket_size_mb`: Megatron-Core's max(40,000,000, 1,000,000 x dp) elements, dp the
    data-parallel group without context parallelism (`dp_group`); 48M at dp 48, 40M at dp 8
    and at dp 24 x cp 2; a given size stays as given at any dp; the other frameworks' default
    stays 40M; ZeRO-1 and Megatron-Core without overlapped reduction keep one bucket."""
    _, plan = _megatron_plan("default", overlap_grad_reduce=True, dp=48, cp=1)
    assert plan.bucket_numel(0, None) == 48_000_000
    assert dataclasses.replace(plan, dp=8).bucket_numel(0, None) == DEFAULT_BUCKET_NUMEL
    assert dataclasses.replace(plan, dp=48, cp=2).bucket_numel(0, None) == 40_000_000
    assert plan.bucket_numel(0, 125_000) == 125_000 and plan.bucket_numel(1, 125_000) is None
    llama = dataclasses.replace(plan, overlap_grad_reduce=False,
                                optimizer=OptimizerMode.PER_MICROBATCH_OVERLAPPED)
    assert llama.bucket_numel(3, None) == 40_000_000 and llama.bucket_numel(3, 7) == 7
    for optimizer in (OptimizerMode.ZERO1, OptimizerMode.DISTRIBUTED):
        assert dataclasses.replace(plan, overlap_grad_reduce=False,
                                   optimizer=optimizer).bucket_numel(0, 125_000) is None
    text = (TESTBEDS / "default.yaml").read_text()
    given = prepare(TESTBEDS / "default.yaml").workload
    assert given.bucket_size_given and given.given_bucket_numel == 125_000
    unset = prepare_text(text.replace("bucket_size_mb: 0.5", "")).workload
    assert not unset.bucket_size_given and unset.given_bucket_numel is None
    assert unset.bucket_bytes == 160e6


def _cut_one_by_one(params, limit, sharded):
    """Megatron-Core's cut [BUF] as its loop: parameter after parameter (elements, ready point,
    routed expert's, own bucket), the reference `bucket_layout._cut` is held to."""
    numels, ready = [], []
    count, end, point = 0, 0, 0.0
    for numel, at, _, own in params:
        start = -(-end // 64) * 64 if sharded else end
        own = own and sharded
        if own and count:
            numels.append(count)
            ready.append(point)
            count, start = 0, 0
        count += numel
        end = start + numel
        point = max(point, at)
        if (limit is not None and end >= limit) or own:
            numels.append(count)
            ready.append(point)
            count, end = 0, 0
    if count:
        numels.append(count)
        ready.append(point)
    return tuple(numels), tuple(ready)


def _workloads():
    """Every testbed's and bundled scenario's workload and a small latent-attention model's,
    each also with tied embeddings and without the learned position embedding."""
    from holmes_sim.bundled import bundled_scenario, scenario_names
    from holmes_sim.model.workload import build_workload
    from tests.test_mla import _TRAINING, _small

    found = [prepare(p).workload for p in sorted(TESTBEDS.glob("*.yaml"))]
    found += [prepare(bundled_scenario(n)).workload for n in scenario_names()]
    found += [build_workload(_small(q_lora_rank=48), _TRAINING, 2)]
    return [v for w in found for v in (w, dataclasses.replace(w, tie_embeddings=True,
                                                              position_embedding="rope"))]


def test_cut_by_prefix_sums_is_the_loops_for_every_workload():
    """`chunk_bucket_runs` (prefix sums and a search per bucket) gives the buckets, shares and
    ready points of the loop over `chunk_params`, bit for bit: every workload, TP 1 and 2,
    chunks of one, two and all layers at the start, middle and end, with and without the
    embedding and head, sharded or not, at bucket sizes from a parameter's to the whole."""
    from holmes_sim.model.bucket_layout import chunk_params

    for w in _workloads():
        n = w.num_layers
        for tp in (1, 2):
            for first_layer, layers in {(0, 1), (0, n), (n - 1, 1), (n // 2, 2), (0, 2)}:
                if first_layer + layers > n or layers < 1:
                    continue
                for first, last in ((False, False), (True, False), (False, True), (True, True)):
                    params = chunk_params(w, tp, first_layer, layers, first, last)
                    whole = sum(p[0] for p in params)
                    for numel in (None, 1, 7_000, whole // 5 + 1, whole, 40_000_000):
                        for sharded in (False, True):
                            dense, routed = chunk_bucket_runs(w, tp, first_layer, layers, first,
                                                              last, sharded, numel)
                            ways = [(dense, [p for p in params if not p[2]])]
                            if routed is not None:
                                ways.append((routed, [p for p in params if p[2]]))
                            assert routed is not None or not any(p[2] for p in params)
                            for run, part in ways:
                                numels, ready = _cut_one_by_one(part, numel, sharded)
                                assert (run.numels, run.ready) == (numels, ready), \
                                    (tp, first_layer, layers, first, last, numel, sharded)
                                total = sum(numels)
                                assert run.shares == tuple(x / total for x in numels)


def test_cut_by_prefix_sums_is_the_loops_on_odd_sizes():
    """Random parameter lists with sizes of 0 and off the alignment, own buckets (of some
    elements) anywhere and points out of order: the same buckets as the loop."""
    import random

    import numpy as np

    from holmes_sim.model.bucket_layout import _cut

    rng = random.Random(7)
    for _ in range(3000):
        size = rng.randrange(0, 12)
        sizes = [rng.choice((0, 1, 63, 64, 65, rng.randrange(0, 300))) for _ in range(size)]
        params = [(n, rng.random(), False, n > 0 and rng.random() < 0.15) for n in sizes]
        limit = rng.choice((None, 1, 64, 100, 200, 1000))
        for sharded in (False, True):
            run = _cut(np.array([p[0] for p in params], dtype=np.int64),
                       np.array([p[1] for p in params]), np.array([p[3] for p in params], dtype=bool),
                       limit, sharded)
            assert (run.numels, run.ready) == _cut_one_by_one(params, limit, sharded), \
                (params, limit, sharded)


def test_cut_shared_across_recompute_modes_keeps_each_modes_ready_points():
    """Workloads that differ in their recompute mode or deferred weight gradient share one cut
    (`param_token`) and keep their own ready points: each the loop's over `chunk_params`, asked
    in turn with the caches warm from the others, every workload with and without MoE."""
    from holmes_sim.model import bucket_layout
    from holmes_sim.model.bucket_layout import chunk_params, param_token, shape_token

    for base in _workloads():
        n = base.num_layers
        variants = [dataclasses.replace(base, recompute=r, defer_embedding_wgrad=d)
                    for r in ("none", "selective", "full") for d in (False, True)]
        assert len({param_token(w) for w in variants}) == 1
        assert len({shape_token(w) for w in variants}) == len(variants)
        bucket_layout._CUTS.clear()
        for w in variants:
            for first_layer, layers, first, last in ((0, n, True, True), (0, 1, True, False),
                                                     (n - 1, 1, False, True)):
                params = chunk_params(w, 1, first_layer, layers, first, last)
                for numel, sharded in ((7_000, True), (None, True), (40_000_000, False)):
                    dense, routed = chunk_bucket_runs(w, 1, first_layer, layers, first, last,
                                                      sharded, numel)
                    for run, part in [(dense, [p for p in params if not p[2]])] + (
                            [(routed, [p for p in params if p[2]])] if routed else []):
                        assert (run.numels, run.ready) == _cut_one_by_one(part, numel, sharded)
