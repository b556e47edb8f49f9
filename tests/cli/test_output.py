"""What a user sees and gets: tables whole at 80 columns, JSON on stdout, safe output targets,
literal names, marked references / identical / infeasible plans, --version, no torch needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.report.tables import footnotes, results_table
from holmes_sim.runner import ranked, speedups
from tests.conftest import small_scenario
from tests.report.test_document import default_run

runner = CliRunner()
CLI = [sys.executable, "-m", "holmes_sim"]


def _cli(*args: str, columns: int = 80, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=300, **kw)


@pytest.mark.parametrize("columns", [80, 120])
def test_default_table_fits_and_shows_every_number_whole(tmp_path, columns):
    out = tmp_path / "r.json"
    proc = _cli("run", "mixed_ib_roce", "--json", str(out), columns=columns)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= columns and "…" not in proc.stdout
    for r in json.loads(out.read_text())["results"]:
        row = next(line for line in lines if f" {r['policy']} " in line)
        for text in (f"{r['iteration_time_s']:.3f}", f"{r['tflops_per_gpu']:.1f}",
                     f"{r['peak_memory_gib']:.1f}", f"{r['speedup_over_megatron']:.2f}x"):
            assert text in row, (r["policy"], text)
    assert "* reference on a hypothetical network" in proc.stdout
    assert "holmes-no-adaptive-partition: same plan as holmes" in proc.stdout.replace("\n", " ")


def test_wide_shows_every_column_even_on_a_narrow_terminal():
    proc = _cli("run", "mixed_ib_eth", "-p", "holmes", "--wide", columns=80)
    assert proc.returncode == 0, proc.stderr
    for header in ("samples/s", "MFU", "bubble", "DP exposed s", "PP exposed s", "layers/stage"):
        assert header in proc.stdout
    assert "…" not in proc.stdout


def test_json_dash_is_valid_json_on_stdout_and_the_table_goes_to_stderr():
    proc = _cli("run", "mixed_ib_eth", "-p", "holmes", "-p", "megatron", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert {r["policy"] for r in doc["results"]} == {"holmes", "megatron"}
    assert doc["schema_version"] >= 1 and doc["tool"]["name"] == "holmes-sim"
    assert "iter s" in proc.stderr


def test_json_dev_stdout_streams_and_leaves_the_symlink():
    assert os.path.islink("/dev/stdout")
    proc = _cli("run", "mixed_ib_eth", "-p", "holmes", "--json", "/dev/stdout")
    assert proc.returncode == 0, proc.stderr
    assert "iter s" in proc.stderr  # the table moves out of the way of the JSON
    assert json.loads(proc.stdout)["results"][0]["policy"] == "holmes"
    assert os.path.islink("/dev/stdout")


@pytest.mark.parametrize("link", ["/dev/stdout", "/proc/self/fd/1"])
def test_json_to_stdout_redirected_to_a_file_points_to_dash(tmp_path, link):
    # It said "/dev/stdout is a symlink; ... remove it or choose another name".
    out = tmp_path / "out.txt"
    with out.open("w") as f:
        proc = subprocess.run([*CLI, "run", "mixed_ib_eth", "-p", "holmes", "--json", link],
                              stdout=f, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 2 and out.read_text() == ""
    assert proc.stderr == (f"error: --json: {link} is a link to {out}, an open file of this "
                           "process, which holmes-sim does not write through; use '--json -' "
                           "for standard output\n")
    assert os.path.islink("/dev/stdout")


@pytest.mark.parametrize("link", ["/dev/stderr", "/proc/self/fd/2"])
def test_json_to_stderr_redirected_to_a_file_is_not_sent_to_stdout(tmp_path, link):
    # It said "use '--json -' for standard output", which is not where the user sent it.
    err = tmp_path / "err.txt"
    with err.open("w") as f:
        proc = subprocess.run([*CLI, "run", "mixed_ib_eth", "-p", "holmes", "--json", link],
                              stdout=subprocess.PIPE, stderr=f, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert err.read_text() == (f"error: --json: {link} is a link to {err}, an open file of "
                               "this process, which holmes-sim does not write through; give "
                               "--json a file of its own, or '--json -' for standard output\n")


def test_a_symlink_to_a_character_device_stays_a_symlink(tmp_path):
    link = tmp_path / "out.json"
    link.symlink_to("/dev/null")
    result = runner.invoke(app, ["run", "mixed_ib_eth", "-p", "holmes", "--json", str(link), "-q"])
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and os.readlink(link) == "/dev/null"


@pytest.mark.parametrize(("option", "target", "message"), [
    ("--json", "{tmp}", "is a folder"),
    ("--json", "{tmp}/missing/r.json", "does not exist"),
    ("--report", "{tmp}/file.txt", "is not a folder"),
    ("--report", "{tmp}/missing/report", "does not exist"),
    ("--plans", "{tmp}/file.txt", "is not a folder"),
])
def test_bad_output_targets_exit_2_before_any_work(tmp_path, option, target, message):
    (tmp_path / "file.txt").write_text("keep")
    path = target.format(tmp=tmp_path)
    result = runner.invoke(app, ["run", "mixed_ib_eth", option, path, "-q"])
    assert result.exit_code == 2, result.output
    assert message in result.output and option in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "missing").exists() and (tmp_path / "file.txt").read_text() == "keep"


@pytest.mark.parametrize(("args", "message"), [
    ("run s.yaml --json s.yaml", "--json: s.yaml is a file this command reads"),
    ("plan s.yaml --json s.yaml", "--json: s.yaml is a file this command reads"),
    ("run s.yaml --report d --json d/report.md", "--json: d/report.md is inside the --report folder"),
    ("run s.yaml --plans d --json d/.holmes-sim-files.json", "is inside the --plans folder d"),
    ("run s.yaml --plans d --json d/plan_holmes.json", "is inside the --plans folder d"),
    ("plan s.yaml --export x --json x", "--json: x is also the --export target"),
    ("plan s.yaml --export d --json d/1-holmes", "is inside the --export folder d"),
    ("run s.yaml --report d --plans d/report.md", "--plans: d/report.md is inside the --report"),
])
def test_outputs_that_collide_with_an_input_or_each_other_exit_2_first(tmp_path, monkeypatch,
                                                                      args, message):
    """Refused before any work, nothing written: the scenario keeps its bytes and the folder
    stays empty."""
    monkeypatch.chdir(tmp_path)
    scenario = small_scenario()
    (tmp_path / "s.yaml").write_text(scenario)
    (tmp_path / "d").mkdir()
    result = runner.invoke(app, [*args.split(), "-q"] if args.startswith("run") else args.split())
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output
    assert (tmp_path / "s.yaml").read_text() == scenario and not any((tmp_path / "d").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "s.yaml"]


def test_json_may_be_the_report_folders_results_and_two_folders_one_path(tmp_path):
    result = runner.invoke(app, ["run", "mixed_ib_eth", "-p", "holmes", "-q", "--report",
                                 str(tmp_path), "--plans", str(tmp_path), "--json",
                                 str(tmp_path / "results.json")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "report.md").exists() and (tmp_path / "plan_holmes.json").exists()


@pytest.mark.parametrize("points_to", ["real.json", "nowhere.json"])
def test_a_symlink_json_target_is_refused_before_any_work(tmp_path, monkeypatch, points_to):
    from holmes_sim.search import planner

    def no_search(*args, **kwargs):
        raise AssertionError("the search ran")

    monkeypatch.setattr(planner, "search", no_search)
    (tmp_path / "real.json").write_text("keep")
    (tmp_path / "l.json").symlink_to(tmp_path / points_to)
    result = runner.invoke(app, ["plan", "mixed_ib_roce", "--json", str(tmp_path / "l.json")])
    assert result.exit_code == 2 and "--json: " in result.output and "is a symlink" in result.output
    assert (tmp_path / "real.json").read_text() == "keep" and not (tmp_path / "nowhere.json").exists()


def test_json_beside_plans_and_export_files_is_theirs_only_where_they_write(tmp_path, monkeypatch):
    """`--plans .` writes plan_*.json and a folder per policy: a results.json beside them is
    the user's to write; plan_holmes.json or holmes/ is not."""
    monkeypatch.chdir(tmp_path)
    for name in ("plan_holmes.json", "holmes"):
        refused = runner.invoke(app, ["run", "mixed_ib_eth", "-q", "-p", "holmes", "--plans",
                                      ".", "--json", name])
        assert refused.exit_code == 2 and "is inside the --plans folder" in refused.output
    assert not any(tmp_path.iterdir())
    ok = runner.invoke(app, ["run", "mixed_ib_eth", "-q", "-p", "holmes", "--plans", ".",
                             "--json", "results.json"])
    assert ok.exit_code == 0 and (tmp_path / "results.json").exists(), ok.output


def test_sweep_out_with_a_missing_parent_exits_2(tmp_path):
    result = runner.invoke(app, ["sweep", "mixed_ib_eth", "--set", "seed=1",
                                 "--out", str(tmp_path / "a" / "b")])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert not (tmp_path / "a").exists()


def test_report_creates_its_own_folder_only(tmp_path):
    result = runner.invoke(app, ["run", "mixed_ib_eth", "-p", "holmes", "--plans",
                                 str(tmp_path / "plans"), "-q"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plans" / "plan_holmes.json").exists()


def test_names_with_markup_print_literally(write_scenario):
    path = write_scenario(small_scenario().replace("name: small", "name: 'a[/x]b[bold]c'"))
    result = runner.invoke(app, ["run", str(path)])
    assert result.exit_code == 0, result.output
    assert "a[/x]b[bold]c" in result.output


def test_plans_that_do_not_fit_rank_last_without_speedup():
    _, outcomes = default_run()
    holmes = next(o for o in outcomes if o.plan.policy == "holmes")
    tiny = replace(holmes.result.memory, capacity_bytes=(1.0,) * len(holmes.result.memory.capacity_bytes))
    oom = replace(holmes, result=replace(holmes.result, memory=tiny))
    order = ranked([oom if o is holmes else o for o in outcomes])
    assert order[-1].plan.policy == "holmes"
    assert "holmes" not in speedups(order) and "megatron" in speedups(order)
    assert any(n.startswith("OOM: the plan does not fit") for n in footnotes(order))
    from rich.console import Console

    console = Console(width=80, record=True)
    console.print(results_table("t", order, 80))
    row = next(line for line in console.export_text().splitlines() if " holmes " in line)
    assert "OOM" in row and "no fit" in row


def test_run_with_a_plan_too_big_exits_0_and_says_why(write_scenario):
    path = write_scenario(small_scenario(tp=1, pp=1, hidden=8192, heads=64, layers=32, seq=4096,
                                         micro=16, global_batch=256))
    result = runner.invoke(app, ["run", str(path)])
    assert result.exit_code == 0, result.output
    assert "do not fit in GPU memory" in result.output and "GiB per GPU" in result.output
    assert "no fit" in result.output


def test_version_help_markup_and_completion():
    from holmes_sim import __version__

    assert runner.invoke(app, ["--version"]).output.strip() == f"holmes-sim {__version__}"
    assert "[index]" in runner.invoke(app, ["sweep", "--help"]).output
    assert "--install-completion" in runner.invoke(app, ["--help"]).output


def test_validate_without_torch_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torch" else real(n, *a))
    result = runner.invoke(app, ["validate", "--dry-run"])
    assert result.exit_code == 2 and "pip install 'holmes-sim[validate]'" in result.output


BLOCK_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Block())
from holmes_sim.cli import app
app(prog_name="holmes-sim")
"""


@pytest.mark.parametrize("args", [["scenarios"], ["check", "mixed_ib_roce"],
                                  ["run", "mixed_ib_roce", "-q", "--json", "-"],
                                  ["sweep", "mixed_ib_eth", "--set", "seed=1,2", "-p", "holmes",
                                   "--out", "{tmp}/sw", "-q"]])
def test_commands_other_than_validate_run_without_torch(tmp_path, args):
    argv = [a.format(tmp=tmp_path) for a in args]
    proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH, *argv], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_plan_refuses_a_hosts_file_of_the_wrong_length_before_the_search(tmp_path, monkeypatch):
    from holmes_sim.search import planner

    def no_search(*args, **kwargs):
        raise AssertionError("the search ran")

    monkeypatch.setattr(planner, "search", no_search)
    (tmp_path / "hosts").write_text("h1\n")
    result = runner.invoke(app, ["plan", "mixed_ib_roce", "--export", str(tmp_path / "ex"),
                                 "--hosts", str(tmp_path / "hosts")])
    assert result.exit_code == 2, result.output
    assert "names 1 hosts, the plan has 8 nodes" in " ".join(result.output.split())
    assert not (tmp_path / "ex").exists()


@pytest.mark.parametrize("name", ["no\x1b[31mfile.yaml", "a\nb.yaml"])
def test_an_error_naming_a_path_with_control_characters_is_one_escaped_line(name):
    proc = _cli("run", name)
    assert proc.returncode == 2 and "\x1b" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and repr(name)[1:-1] in proc.stderr


def test_a_zero_terminal_width_falls_back_to_80_columns(tmp_path):
    ran = _cli("run", "mixed_ib_roce", "-p", "holmes", columns=0)
    assert ran.returncode == 0 and "holmes" in ran.stdout, ran.stderr
    assert max(len(line) for line in ran.stdout.splitlines()) <= 80
    (tmp_path / "bad.yaml").write_text("seed: 1\nseed: 2\n")
    refused = _cli("run", str(tmp_path / "bad.yaml"), columns=0)
    assert refused.returncode == 2 and "duplicate key" in refused.stderr


def test_a_name_the_font_lacks_draws_without_warnings(write_scenario, tmp_path):
    path = write_scenario(small_scenario().replace("name: small", "name: 'Ünïcødé 名前 🚀'", 1))
    proc = _cli("run", str(path), "-q", "-p", "holmes", "--report", str(tmp_path / "r"))
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr
    assert (tmp_path / "r" / "iteration_time.png").exists()


def test_a_failed_ranks_log_keeps_its_lines_and_other_errors_are_one_line(monkeypatch):
    import io

    from rich.console import Console

    from holmes_sim import cli
    from holmes_sim.errors import PlanError, TestbedError

    for exc, lines in ((TestbedError("rank 1 exited 1; log tail:\nTraceback\n\tboom"), 3),
                       (PlanError("no file a\nb.yaml\x1b[31m"), 1)):
        buffer = io.StringIO()
        monkeypatch.setattr(cli, "err", Console(file=buffer, width=200))
        assert cli._fail(exc).exit_code == 2
        assert len(buffer.getvalue().strip().splitlines()) == lines and "\x1b" not in buffer.getvalue()


def test_a_hosts_path_too_long_to_open_is_one_line_from_its_reader(tmp_path):
    result = runner.invoke(app, ["run", "mixed_ib_roce", "-q", "-p", "holmes", "--plans",
                                 str(tmp_path / "p"), "--hosts", "a" * 300])
    assert result.exit_code == 2 and "cannot read hosts file" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("args", [("run", "pure_ib", "-q", "--json", "-"), ("check", "pure_ib")])
def test_a_full_standard_output_is_one_line_and_exit_2(args):
    # > /dev/full ended in a Python traceback from rich or write_output, and exit 1 (which
    # means a validation out of tolerance).
    with open("/dev/full", "w") as full:
        proc = subprocess.run([*CLI, *args], stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: cannot write standard output (No space left on device); redirect it")


def test_a_closed_standard_output_is_refused_before_any_work():
    # >&- made sys.stdout None: an AttributeError traceback after the whole simulation.
    proc = subprocess.run([*CLI, "run", "pure_ib", "-q", "--json", "-"], stdout=None,
                          stderr=subprocess.PIPE, text=True, timeout=300,
                          preexec_fn=lambda: os.close(1))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: standard output is closed; redirect it instead")


def test_check_keeps_each_plan_line_whole_on_a_narrow_terminal():
    # At 20 columns check folded "holmes-no-nic-awar" / "e-order" and "peak" / "18.1 GiB".
    proc = _cli("check", "moe_mixed_nics", columns=20)
    assert proc.returncode == 0, proc.stderr
    assert any(line.startswith("  holmes-no-nic-aware-order ") and "peak" in line
               and line.rstrip().endswith("GiB per GPU (fits)") for line in proc.stdout.splitlines())
