"""Figures are drawn and saved under matplotlib's own defaults: the same bytes in every run,
whatever the user's matplotlibrc says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import small_scenario

HOSTILE_RC = """savefig.bbox: tight
savefig.facecolor: black
font.size: 14
axes.prop_cycle: cycler("color", ["k", "r"])
text.color: white
figure.dpi: 50
"""


def _report_pngs(tmp_path: Path, name: str, scenario: Path, rc: Path | None) -> dict[str, bytes]:
    env = {k: v for k, v in os.environ.items() if k != "MATPLOTLIBRC"}
    if rc is not None:
        env["MATPLOTLIBRC"] = str(rc)
    folder = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "holmes_sim", "run", str(scenario), "-q",
                           "--report", str(folder)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.png"))}


def test_report_figures_are_byte_identical_across_runs_and_user_rc(tmp_path):
    scenario = tmp_path / "small.yaml"
    scenario.write_text(small_scenario())
    rc = tmp_path / "matplotlibrc"
    rc.write_text(HOSTILE_RC)
    plain = _report_pngs(tmp_path, "a", scenario, None)
    assert len(plain) == 5
    assert _report_pngs(tmp_path, "b", scenario, None) == plain
    hostile = _report_pngs(tmp_path, "c", scenario, rc)
    assert [n for n in plain if hostile[n] != plain[n]] == []


def test_drawing_leaves_the_callers_matplotlib_settings_alone():
    import matplotlib

    from holmes_sim.report import plots
    from tests.report.test_document import default_run

    _, outcomes = default_run()
    plots.pyplot()  # selects the Agg backend, as every figure needs
    before = dict(matplotlib.rcParams)
    with matplotlib.rc_context({"font.size": 14}):
        png = plots.figure_png(plots.breakdown_figure([o.result for o in outcomes]))
        assert matplotlib.rcParams["font.size"] == 14
    assert png == plots.figure_png(plots.breakdown_figure([o.result for o in outcomes]))
    assert dict(matplotlib.rcParams) == before
