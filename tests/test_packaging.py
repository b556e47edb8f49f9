"""A wheel built from the repository works on its own: bundled scenarios and testbeds inside it,
torch only behind the validate/test extras. Builds the wheel and installs it (without
dependencies) into a fresh venv that borrows this environment's site-packages for simpy, numpy
and friends; about 15-30 s. Skipped when HOLMES_SKIP_WHEEL_TEST=1."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

BUNDLED = len(list((REPO / "holmes_sim" / "data" / "scenarios").glob("*.yaml")))
"""The bundled scenarios a wheel must carry and list."""

pytestmark = pytest.mark.skipif(os.environ.get("HOLMES_SKIP_WHEEL_TEST") == "1",
                                reason="HOLMES_SKIP_WHEEL_TEST=1")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the source (setuptools' build/ cache in the checkout could
    carry stale files into it)."""
    src, out = tmp_path_factory.mktemp("src") / "repo", tmp_path_factory.mktemp("wheel")
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", ".*_cache", "__pycache__", "out"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(src), "-w", str(out)],
                   check=True, timeout=300, capture_output=True)
    return next(out.glob("holmes_sim-*.whl"))


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = root / "lib" / version / "site-packages"
    with zipfile.ZipFile(wheel) as z:  # a wheel install is an unzip plus the entry point
        z.extractall(site)
    # the runtime dependencies from this environment, after the wheel's own files on sys.path
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root


def _run(venv: Path, code: str, cwd: Path) -> str:
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                          cwd=cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_wheel_carries_scenarios_and_testbeds_and_keeps_torch_optional(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert sum(n.startswith("holmes_sim/data/scenarios/") and n.endswith(".yaml") for n in names) == BUNDLED
    assert "holmes_sim/data/testbeds/default.yaml" in names
    torch = [line for line in meta.splitlines() if line.startswith("Requires-Dist: torch")]
    assert torch and all("extra ==" in line for line in torch), torch


def test_installed_wheel_lists_runs_and_finds_its_testbed(venv, tmp_path):
    code = f"""
import sys
from typer.testing import CliRunner
import holmes_sim
from holmes_sim.bundled import default_testbed, scenario_names
from holmes_sim.cli import app
assert holmes_sim.__file__.startswith(sys.prefix), (holmes_sim.__file__, sys.prefix)
assert default_testbed().exists(), default_testbed()
r = CliRunner().invoke(app, ["scenarios"])
assert r.exit_code == 0 and len(r.output.strip().splitlines()) == {BUNDLED}, r.output
r = CliRunner().invoke(app, ["run", "mixed_ib_roce", "-q", "-p", "holmes", "-p", "megatron"])
assert r.exit_code == 0, r.output
print(len(scenario_names()), "torch" in sys.modules)
"""
    assert _run(venv, code, tmp_path).split() == [str(BUNDLED), "False"]


def test_installed_wheel_walks_in_c_where_it_was_built(wheel, venv, tmp_path):
    """The estimate's walk is an optional C extension: a wheel built with a C compiler carries
    it and uses it (without one, the wheel walks in Python and this is skipped)."""
    with zipfile.ZipFile(wheel) as z:
        built = any(n.startswith("holmes_sim/estimate/_walk_kernel.") and n.endswith((".so", ".pyd"))
                    for n in z.namelist())
    if not built:
        pytest.skip("built without a C compiler: the walk runs in Python")
    code = "from holmes_sim.estimate import walk; print(walk._walk_kernel is not None)"
    assert _run(venv, code, tmp_path).split() == ["True"]


def test_installed_wheel_runs_the_engine_loop_and_rows_in_c_where_it_was_built(wheel, venv, tmp_path):
    """The run loop, the trace's row packing, the network's agenda entries, the pipeline
    messages and an entity's common ops are optional C extensions too (`sim/_run_loop.c`,
    `sim/_trace_rows.c`, `sim/_agenda_entries.c`, `sim/_pipeline_messages.c`,
    `sim/_entity_steps.c`): a wheel built with a C compiler carries them and uses them."""
    with zipfile.ZipFile(wheel) as z:
        built = [m for m in ("_agenda_entries", "_entity_steps", "_pipeline_messages",
                             "_run_loop", "_trace_rows")
                 if any(n.startswith(f"holmes_sim/sim/{m}.") and n.endswith((".so", ".pyd"))
                        for n in z.namelist())]
    if not built:
        pytest.skip("built without a C compiler: the loop and the rows run in Python")
    assert built == ["_agenda_entries", "_entity_steps", "_pipeline_messages", "_run_loop",
                     "_trace_rows"]
    code = ("from holmes_sim.sim import agenda_entries, entity_steps, environment, network, "
            "pipeline_messages, trace; "
            "print(environment.take is not environment._take, "
            "trace.append_row is not trace._append_row_struct, "
            "network.apply is not agenda_entries._apply, "
            "pipeline_messages.Core is not None, entity_steps.Steps is not None)")
    assert _run(venv, code, tmp_path).split() == ["True"] * 5
