"""The link probe (`backend/calibrate_links.py`) on loopback: its figures, and the all-reduce fit
that prices an unshaped intra-node link as the ranks use it."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from holmes_sim.backend.calibrate_links import alpha_beta, probe
from holmes_sim.cost.collectives import ring_collective_time_s
from holmes_sim.errors import TestbedError
from holmes_sim.spec.scenario import TestbedSpec
from holmes_sim.validation import calibration
from tests.backend.threads import in_threads


def _both_sides(tmp_path, **kw) -> dict:
    store = str(tmp_path / "store")
    return in_threads((0, 1), lambda rank: probe(rank, store, "lo", 1 << 20, 30.0, **kw), 120)[0]


def test_probe_reports_rate_latency_and_step(tmp_path) -> None:
    got = _both_sides(tmp_path)
    assert got["bandwidth_bytes_per_s"] > 0 and got["latency_s"] > 0
    assert got["collective_step_s"] > 0 and got["rtt_samples"] == 30
    assert "streaming_bytes_per_s" not in got  # no all-reduce fit unless asked


def test_all_reduce_fit_on_loopback(tmp_path) -> None:
    got = _both_sides(tmp_path, all_reduce_bytes=256 * 1024)
    assert got["all_reduce_bytes"] == 256 * 1024
    assert 0 < got["bandwidth_bytes_per_s"] <= got["streaming_bytes_per_s"]
    assert got["collective_step_s"] > 0


def test_the_fit_reproduces_both_measured_all_reduces() -> None:
    size = 256 * 1024
    fit = alpha_beta(0.35e-3, 0.60e-3, size, 2.4e9)
    for n, measured in ((0, 0.35e-3), (size, 0.60e-3)):
        priced = ring_collective_time_s("all-reduce", 2, n, fit["bandwidth_bytes_per_s"],
                                        fit["collective_step_s"])
        assert priced == pytest.approx(measured, rel=1e-9)


def test_noise_cannot_make_the_fitted_rate_beat_the_stream() -> None:
    # The sized median no slower than the tiny one: the bytes then cost their streaming time.
    fit = alpha_beta(0.40e-3, 0.38e-3, 256 * 1024, 2.4e9)
    assert fit["bandwidth_bytes_per_s"] == pytest.approx(2.4e9)


class _SelfKillingTestbed:
    """A testbed whose every process kills itself with `signal` after writing to its log."""

    def __init__(self, tmp_path, signal_number: int) -> None:
        self.tmp_path, self.signal_number = tmp_path, signal_number

    def mkdtemp(self, prefix: str):
        path = self.tmp_path / prefix
        path.mkdir()
        return path

    def popen(self, node, argv, **kwargs):
        return subprocess.Popen(["sh", "-c", f"echo probing >&2; kill -{self.signal_number} $$"],
                                **kwargs)


@pytest.mark.parametrize(("signal_number", "words"), [
    (9, "was killed (signal 9; likely the host ran out of memory)"),
    (15, "was killed by SIGTERM")])
def test_a_probe_killed_by_a_signal_says_so_and_cleans_up(tmp_path, signal_number, words) -> None:
    spec = TestbedSpec(link_probe_bytes=1 << 20)
    with pytest.raises(TestbedError) as info:
        calibration._probe(_SelfKillingTestbed(tmp_path, signal_number), "fabric 'ib'",
                           [("n0", "eth0"), ("n1", "eth0")], spec, 0)
    text = str(info.value)
    assert re.fullmatch(rf"link probe on fabric 'ib' failed: its rank (\d) {re.escape(words)}"
                        r"( \(rank \d still running\))?; rank \1 log tail:\nprobing\n", text), text
    assert list(tmp_path.iterdir()) == []  # the probe's folder is removed


class _OneRankCrashesTestbed(_SelfKillingTestbed):
    """Rank 1 exits 3 at once saying why; rank 0 waits for it, as a probe waits for its peer
    (here 20 s, then exits 1 as gloo's timeout would). Records every command line."""

    def __init__(self, tmp_path) -> None:
        super().__init__(tmp_path, 0)
        self.argvs: list[list[str]] = []

    def popen(self, node, argv, **kwargs):
        self.argvs.append(list(argv))
        rank = argv[argv.index("--rank") + 1]
        code = ("import sys; print('bad interface eth7', file=sys.stderr); sys.exit(3)"
                if rank == "1" else
                "import sys, time; time.sleep(20); print('gloo timed out', file=sys.stderr); "
                "sys.exit(1)")
        return subprocess.Popen([sys.executable, "-c", code], **kwargs)


def test_a_crashed_probe_rank_is_named_at_once_with_its_log_and_both_get_the_timeout(tmp_path):
    tb = _OneRankCrashesTestbed(tmp_path)
    t = time.monotonic()
    with pytest.raises(TestbedError) as info:
        calibration._probe(tb, "fabric 'ib'", [("n0", "eth0"), ("n1", "eth0")],
                           TestbedSpec(timeout_s=25), 0)
    assert time.monotonic() - t < 10  # not after rank 0's wait
    assert str(info.value) == ("link probe on fabric 'ib' failed: its rank 1 exited with code 3 "
                               "(rank 0 still running); rank 1 log tail:\nbad interface eth7\n")
    # gloo's operation timeout, min(60 s, testbed.timeout_s), as the ranks get it.
    assert all(argv[argv.index("--timeout") + 1] == "25" for argv in tb.argvs)
    assert list(tmp_path.iterdir()) == []
