"""Parameters after SGD steps: distributed run == single-process run, and known bugs are caught.

SGD, not Adam: Adam divides by the gradient's own scale, so a gradient scaled x7 or by dp moves
the parameters almost the same way; SGD's update is proportional to the gradient. The test
compares updates (final - initial parameters) so that a wrong scale shows as an O(1) relative
error while float32 summation-order differences stay around 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from holmes_sim.backend.launch import run_plan
from holmes_sim.backend.model import build_full_model
from holmes_sim.backend.reference import train_reference_model
from holmes_sim.backend.run_config import MUTATIONS
from holmes_sim.plan import OptimizerMode
from holmes_sim.schedule import ScheduleKind
from tests.backend.conftest import TINY_MOE

# Relative error of the update a correct run stays under (measured <= 3e-7; 1.9e-6 with MoE
# layers, whose routed copies add in another order; 3.5e-5 with TP 2, whose partial sums do)
# and the one every mutation exceeds (measured worst parameter: x7 15, /dp dropped 1.06, no
# 1/num_microbatches 4.0, TP input gradients not all-reduced 1.06, routed experts reduced over
# the DP group instead of their expert-DP group 1.42).
# Every copy counts: DP replicas, TP members and the expert-DP replicas of each expert.
UPDATE_RTOL = 1e-3

CASES = {
    "pp2-dp2-1f1b-replicated": dict(pp=2, dp=2),
    "pp2-dp2-gpipe-distributed-uneven": dict(pp=2, dp=2, schedule=ScheduleKind.GPIPE,
                                             optimizer=OptimizerMode.DISTRIBUTED,
                                             layers=(1, 3)),
    "pp2-dp2-interleaved-overlapped": dict(pp=2, dp=2, schedule=ScheduleKind.INTERLEAVED,
                                           num_chunks=2, num_microbatches=4,
                                           optimizer=OptimizerMode.DISTRIBUTED_OVERLAPPED),
    "tp2-pp2-dp2-1f1b-overlapped": dict(tp=2, pp=2, dp=2,
                                        optimizer=OptimizerMode.DISTRIBUTED_OVERLAPPED),
    # MoE with EP 2 < dp 4: routed experts reduced over expert-DP groups of 2, the rest over 4.
    "moe-dp4-ep2-replicated": dict(dp=4, ep=2),
    "moe-pp2-dp4-ep2-distributed-uneven": dict(pp=2, dp=4, ep=2, layers=(1, 3),
                                              optimizer=OptimizerMode.DISTRIBUTED),
    "moe-dp4-ep2-overlapped": dict(dp=4, ep=2, num_microbatches=3,
                                   optimizer=OptimizerMode.DISTRIBUTED_OVERLAPPED),
}

# Each mutation on a case whose code path it breaks.
MUTATION_CASES = {
    "all-reduce-no-dp": "pp2-dp2-1f1b-replicated",
    "reduce-scatter-no-dp": "pp2-dp2-gpipe-distributed-uneven",
    "no-microbatch-scaling": "pp2-dp2-interleaved-overlapped",
    "grad-x7": "pp2-dp2-1f1b-replicated",
    "tp-no-input-grad-reduce": "tp2-pp2-dp2-1f1b-overlapped",
    "experts-reduced-over-dp": "moe-dp4-ep2-replicated",
}


def _update_errors(case: str, plan_factory, run_config_factory, tiny_config,
                   mutation: str = "") -> dict[str, float]:
    """Per parameter: ||update_dist - update_ref|| / ||update_ref||, checking DP replicas agree."""
    plan = plan_factory(**CASES[case])
    if case.startswith("moe-"):
        tiny_config = TINY_MOE
    cfg = run_config_factory(model=tiny_config, optimizer="sgd", lr=0.5, iterations=2, warmup=1,
                             bucket_numel=20_000, dump_params=True, mutation=mutation)
    result = run_plan(plan, cfg, timeout_s=90)
    _, ref_model = train_reference_model(tiny_config, cfg.micro_batch_size,
                                         plan.num_microbatches, plan.dp, cfg.iterations, cfg.lr,
                                         cfg.optimizer)
    initial = {n: p.detach() for n, p in build_full_model(tiny_config).named_parameters()}
    reference = {n: p.detach() for n, p in ref_model.named_parameters()}
    copies: dict[str, list[torch.Tensor]] = {}  # every DP replica's and TP member's copy
    for doc in result.ranks:
        for name, values in doc["params"].items():
            copies.setdefault(name, []).append(torch.tensor(values).view_as(initial[name]))
    assert set(copies) == set(reference)
    errors = {}
    for name in reference:
        ref_update = reference[name] - initial[name]
        assert ref_update.norm() > 0, name  # the step moved every parameter
        # The worst copy: replicas that disagree are as wrong as a wrong update.
        errors[name] = max(float((t - initial[name] - ref_update).norm() / ref_update.norm())
                           for t in copies[name])
    return errors


@pytest.mark.parametrize("case", CASES)
def test_parameters_after_sgd_equal_single_process(case, plan_factory, run_config_factory,
                                                   tiny_config) -> None:
    errors = _update_errors(case, plan_factory, run_config_factory, tiny_config)
    worst = max(errors, key=errors.get)
    assert errors[worst] < UPDATE_RTOL, f"{worst}: relative update error {errors[worst]:.2e}"


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_each_known_bug_breaks_equality(mutation, plan_factory, run_config_factory,
                                        tiny_config) -> None:
    assert set(MUTATION_CASES) == set(MUTATIONS)
    errors = _update_errors(MUTATION_CASES[mutation], plan_factory, run_config_factory,
                            tiny_config, mutation)
    assert max(errors.values()) > 100 * UPDATE_RTOL, f"{mutation} went unnoticed"


def test_parameter_all_gather_overlaps_the_next_forward(plan_factory, run_config_factory) -> None:
    # Several buckets per chunk: the forward waits for each bucket just before its first use, so
    # some of iteration 1's forward compute starts before its chunk's last all-gather finishes.
    plan = plan_factory(dp=2, optimizer=OptimizerMode.DISTRIBUTED_OVERLAPPED)
    cfg = run_config_factory(bucket_numel=5_000, iterations=2, warmup=1)
    result = run_plan(plan, cfg, timeout_s=60)
    for doc in result.ranks:
        # Two launches (after each step), the same buckets each time; the first launch's gathers
        # are the earlier half. (Their iteration tag is racy: the thread records them.)
        gathers = sorted((o for o in doc["ops"] if o["detail"].startswith("all-gather bucket")),
                         key=lambda o: o["start"])
        assert len(gathers) % 2 == 0 and len(gathers) // 2 > 2
        first_launch = gathers[:len(gathers) // 2]
        waits = [o for o in doc["ops"] if o["detail"].startswith("wait parameter all-gather")]
        assert len(waits) == len(gathers)  # each bucket waited for once per launch
        # The first launch's waits happen inside iteration 1's first forward, module by module
        # (not one wait for the whole chunk before it, not in the gap between iterations).
        it1 = doc["iterations"][1]
        first_forward = min((o for o in doc["ops"] if o["iteration"] == 1
                             and o["kind"] == "forward"), key=lambda o: o["start"])
        mine = [w for w in waits if w["start"] < it1["end"]]  # not finish()'s waits
        assert len(mine) == len(first_launch)
        assert all(it1["start"] <= w["start"] and w["end"] <= first_forward["end"] for w in mine)
