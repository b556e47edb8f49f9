"""`holmes-sim plan` searches context parallelism, and the export launches what it found:
`--context-parallel-size` and `--cp-comm-type` as Megatron-LM's argument table reads them."""

from __future__ import annotations

import shlex

from holmes_sim.export.launch import TE_CP_COMM_TYPES, launch_files
from holmes_sim.prepare import prepare
from holmes_sim.runner import run_policy
from holmes_sim.search import planner
from tests.export.test_launch_targets import FORK, UPSTREAM, parse
from tests.sim.test_context_parallel import cp_scenario

SEARCH = """search: {tensor: [4, 8], pipeline: [1, 2], context: [1, 2, 4], micro_batch_size: [1],
         schedule: [1f1b], recompute: [none], sequence_parallel: [false],
         optimizer: [distributed], top_k: 2}
"""


def test_search_covers_the_valid_cp_degrees(write_scenario):
    text = cp_scenario(cp=1, global_batch=16, seq=32768, policies="[megatron, holmes]") + SEARCH
    prepared = prepare(write_scenario(text))
    layouts = list(planner.layouts(prepared, prepared.scenario.search))
    got = {(lay.tp, lay.pp, lay.cp, lay.dp) for lay in layouts}
    # 32 GPUs: TP 8 x PP 2 x CP 4 needs 64 (a CP degree that never divides them is refused:
    # tests/search/test_search_causes.py)
    assert got == {(tp, pp, cp, 32 // (tp * pp * cp)) for tp in (4, 8) for pp in (1, 2)
                   for cp in (1, 2, 4) if tp * pp * cp <= 32}
    assert (4, 2, 4, 1) in got
    result = planner.search(prepared, jobs=1)
    assert any(c.layout.cp > 1 for c in result.candidates)
    best = result.candidates[0]
    assert best.simulated and best.to_json()["cp"] == best.layout.cp
    # the planner's figures are the runner's for that layout
    p = planner.prepared_for(prepared, best.layout)
    assert p.cp == best.layout.cp and p.workload.cp == best.layout.cp
    assert run_policy(p, best.policy).result.iteration_time_s == best.predicted_iteration_s


def test_without_a_search_list_the_scenarios_cp_is_kept(write_scenario):
    text = cp_scenario(cp=2, global_batch=16) + "search: {tensor: [8], pipeline: [1]}\n"
    prepared = prepare(write_scenario(text))
    assert {lay.cp for lay in planner.layouts(prepared, prepared.scenario.search)} == {2}


def test_export_writes_megatrons_cp_flags(write_scenario):
    for comm in ("p2p", "a2a", "allgather"):
        prepared = prepare(write_scenario(cp_scenario(tp=2, cp=2, comm=comm, global_batch=16,
                                                      policies="[megatron, holmes]")))
        for policy in ("megatron", "holmes"):
            out = run_policy(prepared, policy)
            files = launch_files(out.plan, out.cluster, prepared.workload, "bf16").files
            parsed = parse(shlex.split(files["megatron_args.txt"]), UPSTREAM)
            assert parsed["--context-parallel-size"] == ["2"]
            assert parsed["--cp-comm-type"] == [TE_CP_COMM_TYPES[comm]]  # allgather: all_gather
            fork = files["holmes_args.txt"]
            if comm == "p2p" and not fork.startswith("#"):
                assert parse(shlex.split(fork), FORK)["--context-parallel-size"] == ["2"]
            else:
                assert "--cp-comm-type" not in fork
    plain = prepare(write_scenario(cp_scenario(tp=8, cp=1, global_batch=16)))
    out = run_policy(plain, "megatron")
    assert "--context-parallel-size" not in \
        launch_files(out.plan, out.cluster, plain.workload, "bf16").files["megatron_args.txt"]
