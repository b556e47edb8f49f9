"""How a failed real run is reported (`launch.failure`, `launch.timed_out`): how the rank ended
(signal 9: likely out of memory), the ranks still running (a stopped one marked), a rank that
timed out waiting on a peer, and no empty "log tail:". And compute calibration's workers ignore
a terminal's Ctrl-C, which the calibrating process alone handles."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

from holmes_sim.backend import launch

GLOO_TIMEOUT = ("RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "60000ms for recv operation to complete\n")


def _procs(pids: dict[int, int]) -> dict:
    return {r: SimpleNamespace(pid=pid) for r, pid in pids.items()}


def test_a_failed_rank_names_the_ranks_still_running_and_the_peer_timeout(tmp_path):
    (tmp_path / "rank_0.log").write_text("Traceback ...\n" + GLOO_TIMEOUT)
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stopped.send_signal(signal.SIGSTOP)
        os.waitpid(stopped.pid, os.WUNTRACED)  # stopped for sure
        procs = _procs({0: 1, 1: stopped.pid, 2: os.getpid(), 3: 1})
        exc = launch.failure(procs, {0: 1, 1: None, 2: None, 3: 1}, tmp_path)
    finally:
        stopped.kill()
        stopped.wait()
    text = str(exc)
    assert text.startswith("rank 0 exited with code 1 (ranks failed: [0, 3]; still running: "
                           "[1 (stopped), 2]); rank 0 timed out waiting on a peer")
    assert "rank 0 log tail:\nTraceback" in text and exc.peer_timeout
    # A peer that never joined: the rendezvous store's timeout (seen with rank 1 stopped at start).
    (tmp_path / "rank_0.log").write_text("Traceback ...\nRuntimeError: Wait timeout\n")
    assert launch.failure(_procs({0: 1, 1: 1}), {0: 1, 1: 0}, tmp_path).peer_timeout


def test_a_rank_killed_by_signal_9_says_it_was_killed_and_skips_an_empty_tail(tmp_path):
    (tmp_path / "rank_0.log").write_text("\n")
    exc = launch.failure(_procs({0: 1, 1: 1}), {0: -9, 1: 0}, tmp_path)
    assert str(exc) == ("rank 0 was killed (signal 9; likely the host ran out of memory) "
                        "(ranks failed: [0]); rank 0's log is empty")
    assert not exc.peer_timeout
    assert "killed by SIGTERM" in str(launch.failure(_procs({0: 1}), {0: -15}, tmp_path))
    # No log at all (it never got to open one): it wrote none.
    (tmp_path / "rank_0.log").unlink()
    assert str(launch.failure(_procs({0: 1}), {0: -9}, tmp_path)).endswith("; rank 0 wrote no log")


def test_the_rank_a_signal_ended_is_blamed_over_peers_that_lost_their_connection(tmp_path):
    # Seen on the testbed: rank 2 SIGKILLed, rank 0 exited 1 on the broken socket in the same
    # 50 ms poll, and the error blamed rank 0.
    lost = "RuntimeError: [gloo/transport/tcp/pair.cc:598] Connection closed by peer\n"
    (tmp_path / "rank_0.log").write_text("Traceback ...\n" + lost)
    (tmp_path / "rank_2.log").write_text("")
    procs = _procs({0: 1, 1: os.getpid(), 2: 1})
    text = str(launch.failure(procs, {0: 1, 1: None, 2: -9}, tmp_path))
    assert text.startswith("rank 2 was killed (signal 9; likely the host ran out of memory) "
                           "(ranks failed: [0, 2]; still running: [1])")
    # No signal: the rank whose log was written first (its traceback, as it exited).
    os.utime(tmp_path / "rank_0.log", ns=(2_000_000_000, 2_000_000_000))
    (tmp_path / "rank_1.log").write_text("Traceback ...\nValueError: the cause\n")
    os.utime(tmp_path / "rank_1.log", ns=(1_000_000_000, 1_000_000_000))
    text = str(launch.failure(procs, {0: 1, 1: 1, 2: 0}, tmp_path))
    assert text.startswith("rank 1 exited with code 1 (ranks failed: [0, 1])")
    assert "ValueError: the cause" in text


def test_a_timeout_names_the_ranks_still_running_without_an_empty_tail(tmp_path):
    exc = launch.timed_out(_procs({0: os.getpid(), 1: 1}), {0: None, 1: 0}, tmp_path, 2.0)
    assert str(exc) == "run timed out after 2 s; ranks still running: [0]; rank 0 wrote no log"
    assert exc.timeout_s == 2.0


def _sigint_ignored() -> None:
    sys.exit(0 if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else 1)


def test_calibration_workers_start_ignoring_sigint():
    from holmes_sim.backend.calibrate_compute import _start_without_sigint

    handler, mask = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    proc = mp.get_context("spawn").Process(target=_sigint_ignored)
    _start_without_sigint([proc])
    proc.join(timeout=60)
    assert proc.exitcode == 0  # ignored from the worker's first instruction on
    assert signal.getsignal(signal.SIGINT) is handler  # the caller still handles Ctrl-C
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
