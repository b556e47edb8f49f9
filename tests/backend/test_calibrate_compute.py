"""Compute calibration (`backend/calibrate_compute.py`) fails fast and says why: a measuring
process that dies or raises ends the calibration at once with a TestbedError naming it, and
repeats that cannot finish within the limit are refused after the warm-up, naming
testbed.calibration_repeats with a value that fits (`validation/calibration.layer_times`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from holmes_sim.backend import calibrate_compute as cc
from holmes_sim.backend.model import GPTConfig
from holmes_sim.errors import TestbedError
from holmes_sim.prepare import prepare
from holmes_sim.spec.scenario import TestbedSpec
from tests.conftest import TESTBED

TINY = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64, seed=1)


def _kill_one_worker_once_started() -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = mp.active_children()
        if len(kids) == 2 and all(k.pid for k in kids):
            os.kill(kids[0].pid, signal.SIGKILL)
            return
        time.sleep(0.05)


def test_a_dead_worker_fails_the_calibration_at_once():
    killer = threading.Thread(target=_kill_one_worker_once_started, daemon=True)
    killer.start()
    t = time.monotonic()
    with pytest.raises(TestbedError, match=r"calibration process [01] of 2 was killed \(signal 9"):
        cc.measure_layer_times(TINY, 1, concurrency=2, repeats=10**5, timeout_s=40)
    assert time.monotonic() - t < 30  # not after the limit (the other worker waits at the barrier)
    killer.join()
    assert not mp.active_children()


def test_a_workers_own_error_is_a_testbed_error():
    with pytest.raises(TestbedError, match="calibration process 0 of 1 failed: RuntimeError: "
                                           "Trying to create tensor with negative dimension"):
        cc.measure_layer_times(TINY, -1, repeats=3, timeout_s=60)


def test_repeats_that_cannot_finish_in_time_are_refused_after_the_warmup():
    t = time.monotonic()
    with pytest.raises(TestbedError) as info:
        cc.measure_layer_times(TINY, 1, repeats=10**6, timeout_s=40)
    assert time.monotonic() - t < 35
    exc = info.value
    assert isinstance(exc, cc.CalibrationTooSlow)
    assert exc.repeats == 10**6 and exc.need_s > exc.left_s and 0 <= exc.fits < 10**6
    assert "10000000 repeats" not in str(exc) and "1000000 repeats of about" in str(exc)


def test_pace_check_counts_the_processes_sharing_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    cc._check_pace(0.01, 100, 4, 2.1)  # 100 x 10 ms x 4 processes / 2 cores = 2 s: fits
    with pytest.raises(cc.CalibrationTooSlow) as info:
        cc._check_pace(0.01, 100, 4, 1.5)
    assert info.value.fits == 75 and info.value.need_s == pytest.approx(2.0)


def test_repeats_that_do_not_fit_name_the_fields_and_values_that_would(monkeypatch):
    from holmes_sim.validation.calibration import layer_times, repeats_advice
    from holmes_sim.validation.real_run import step

    spec = TestbedSpec(calibration_repeats=10_000, timeout_s=240)
    slow = cc.CalibrationTooSlow("10000 repeats of about 41.7 ms each need about 417 s, more "
                                 "than the 230 s left", 10_000, 417.0, 230.0, 5515)
    text = repeats_advice(spec, slow)
    assert text == ("compute calibration must finish within testbed.timeout_s (240 s): lower "
                    "testbed.calibration_repeats to at most 5515, or raise testbed.timeout_s to "
                    "at least 650 s")
    late = cc.CalibrationTooSlow("10000 repeats did not finish within 240 s", 10_000)
    assert "lower testbed.calibration_repeats (now 10000, default 30) or raise " \
           "testbed.timeout_s" in repeats_advice(spec, late)

    def too_slow(*args, **kwargs):
        assert kwargs["timeout_s"] == 240 and args[3] == 10_000
        raise slow

    monkeypatch.setattr(cc, "measure_layer_times", too_slow)
    with pytest.raises(TestbedError) as info, step("compute calibration", spec):
        layer_times(prepare(TESTBED), None, spec, 1)
    assert str(info.value) == f"compute calibration: testbed.calibration_repeats: {slow}; {text}"
