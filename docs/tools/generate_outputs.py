"""Regenerate the outputs quoted in docs/tutorial.md from the current version.

The tutorial's scenario is its own `my_cluster.yaml` block. Every ```console block that starts
with `$ holmes-sim ...` is run (80 columns, in a folder holding that file) and its output put
in place; every inline figure written as `<!-- gen:NAME -->VALUE<!-- /gen -->` is recomputed
(`figures`). `--check` changes nothing and exits 1, printing a diff, when the doc differs.

    python docs/tools/generate_outputs.py [--check]
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial.md"
SCENARIO_BLOCK = re.compile(r"Save this as `my_cluster\.yaml`.*?```yaml\n(.*?)```", re.S)
CONSOLE_BLOCK = re.compile(r"```console\n\$ (holmes-sim [^\n]*)\n(.*?)```", re.S)
FIGURE = re.compile(r"<!-- gen:([a-z0-9_]+) -->(.*?)<!-- /gen -->")
COST_NAMES = {"tp_comm": "tensor-parallel communication",
              "cp_comm": "exposed context-parallel communication",
              "pp_exposed": "exposed pipeline communication",
              "dp_exposed": "exposed data-parallel communication",
              "optimizer": "the optimizer step", "bubble": "the pipeline bubble"}


def run_cli(command: str, cwd: Path) -> str:
    """The output `command` (a `holmes-sim ...` line) prints at 80 columns, lines right-trimmed."""
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "holmes_sim", *shlex.split(command)[1:]]
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return "".join(line.rstrip() + "\n" for line in (proc.stdout + proc.stderr).splitlines())


def figures(scenario: Path) -> dict[str, str]:
    """The inline figures of the tutorial, from one simulation of its scenario."""
    from holmes_sim.prepare import prepare
    from holmes_sim.report.document import largest_cost
    from holmes_sim.runner import run_scenario, speedups

    prepared = prepare(scenario)
    outcomes = {o.plan.policy: o for o in run_scenario(prepared, None)}
    holmes, bound = outcomes["holmes"].result, outcomes["all-ib"].result
    ups = speedups(list(outcomes.values()))
    key, seconds = largest_cost(holmes)
    return {
        **_placement_figures(outcomes),
        "holmes_layers": "/".join(map(str, holmes.layers_per_stage)),
        "holmes_speedup": f"{ups['holmes']:.2f}x",
        "holmes_vs_bound_pct": f"{100 * (holmes.iteration_time_s / bound.iteration_time_s - 1):.0f}%",
        "holmes_iteration_s": f"{holmes.iteration_time_s:.3f} s",
        "holmes_cost_name": COST_NAMES[key],
        "holmes_cost_s": f"{seconds:.3f} s",
        "holmes_cost_pct": f"{100 * seconds / holmes.iteration_time_s:.1f}%",
    }


def _placement_figures(outcomes) -> dict[str, str]:
    """Where megatron puts its stages, and the links of megatron's and holmes' DP groups."""
    plan = outcomes["megatron"].plan
    stages = [", ".join(dict.fromkeys(g.node for d in range(plan.dp)
                                      for g in plan.entity_gpus(k, d))) for k in range(plan.pp)]
    out = {f"megatron_stage{k}": nodes for k, nodes in enumerate(stages)}
    for policy in ("megatron", "holmes"):
        result = outcomes[policy].result
        out[f"{policy}_dp_links"] = result.transports["dp"]
        out[f"{policy}_dp_exposed_s"] = f"{result.breakdown_s['dp_exposed']:.3f} s"
    return out


def regenerate(text: str) -> str:
    """`text` (the tutorial) with every console output and inline figure recomputed."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        block = SCENARIO_BLOCK.search(text)
        if block is None:
            raise SystemExit("docs/tutorial.md: no my_cluster.yaml block")
        (folder / "my_cluster.yaml").write_text(block.group(1))
        text = CONSOLE_BLOCK.sub(
            lambda m: f"```console\n$ {m.group(1)}\n{run_cli(m.group(1), folder)}```", text)
        values = figures(folder / "my_cluster.yaml")
    return FIGURE.sub(lambda m: f"<!-- gen:{m.group(1)} -->{values[m.group(1)]}<!-- /gen -->", text)


def main(argv: list[str]) -> int:
    old = TUTORIAL.read_text()
    new = regenerate(old)
    if "--check" in argv:
        if new != old:
            sys.stdout.writelines(difflib.unified_diff(
                old.splitlines(True), new.splitlines(True), "docs/tutorial.md", "regenerated"))
            return 1
        return 0
    TUTORIAL.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
