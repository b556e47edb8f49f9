"""Start every rank of a plan, wait for them, and gather their results.

`spawn(rank, argv) -> subprocess.Popen` starts one rank; the default runs it as a local
subprocess in its own session. The testbed passes one that starts it inside the rank's network
namespace. Ranks write their stderr to `rank_R.log` themselves, so any spawn works.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from holmes_sim.backend.records import mark_owner
from holmes_sim.backend.run_config import RunConfig
from holmes_sim.errors import TestbedError
from holmes_sim.plan import Plan

Spawn = Callable[[int, list[str]], subprocess.Popen]
MakeTemp = Callable[[str], Path]

_POLL_S = 0.05
# Runs the worker like `python -m holmes_sim.backend.worker`, but imports holmes_sim from this
# checkout whatever the spawned process's working directory (the package may not be installed).
_ROOT = str(Path(__file__).resolve().parents[2])
_BOOTSTRAP = (f"import sys; sys.path.insert(0, {_ROOT!r}); "
              "from holmes_sim.backend.worker import main; sys.exit(main())")
_TAIL_CHARS = 3000


@dataclass(frozen=True, slots=True)
class RunResult:
    """Timings and losses of a real run.

    Attributes:
        iteration_times_s: per measured iteration (after warm-up): latest end minus earliest
            start across ranks, seconds.
        losses: mean micro-batch loss of every iteration (warm-up included), over all DP replicas;
            empty under emulated compute.
        op_times_s: kind -> total seconds per measured iteration, averaged over ranks and
            iterations (kinds: forward, backward, recv, send-wait, dp-sync, optimizer).
        ranks: each rank's raw result document (iterations, ops, losses, groups, stages).
    """

    iteration_times_s: tuple[float, ...]
    losses: tuple[float, ...]
    op_times_s: dict[str, float]
    ranks: tuple[dict, ...]

    @property
    def mean_iteration_s(self) -> float:
        return statistics.fmean(self.iteration_times_s)


def local_spawn(rank: int, argv: list[str]) -> subprocess.Popen:
    """Start a rank on this host, in its own session so the whole tree can be killed, dying with
    its parent so no kill of the launcher leaves it running."""
    from holmes_sim.backend.netns import die_with_parent

    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent)


def run_plan(plan: Plan, run_config: RunConfig, spawn: Spawn | None = None,
             timeout_s: float = 300.0, mkdtemp: MakeTemp | None = None) -> RunResult:
    """Run `plan` for real and summarise it (`mkdtemp(prefix)` makes its temporary folder, e.g.
    `Testbed.mkdtemp`, which records it).

    Raises:
        TestbedError: a rank exited non-zero or the run passed `timeout_s` seconds; every rank is
            killed first and the message carries the failing rank's log tail.
    """
    docs = _run_all(plan, replace(run_config, dry_run=False), spawn, timeout_s, mkdtemp)
    return summarise(docs, run_config.warmup)


def dry_run(plan: Plan, run_config: RunConfig, spawn: Spawn | None = None,
            timeout_s: float = 120.0) -> list[dict]:
    """Build every group and stage on every rank without training.

    Returns one summary per rank: groups (index, kind, ranks, nic, interface), stages (chunk,
    virtual stage, first_layer, num_layers, embedding, head, parameters).
    """
    return _run_all(plan, replace(run_config, dry_run=True), spawn, timeout_s)


def summarise(docs: list[dict], warmup: int) -> RunResult:
    """RunResult from the per-rank documents."""
    num_iters = len(docs[0]["iterations"])
    measured = range(warmup, num_iters)
    times = tuple(max(d["iterations"][i]["end"] for d in docs)
                  - min(d["iterations"][i]["start"] for d in docs) for i in measured)
    losses = []  # none under emulated compute (RunConfig.emulated_compute)
    for i in range(num_iters if any(d["losses"] for d in docs) else 0):
        vals = [v for d in docs if d["losses"] for v in d["losses"][i]]
        losses.append(statistics.fmean(vals))
    totals: dict[str, float] = {}
    for d in docs:
        for op in d["ops"]:
            if op["iteration"] >= warmup:
                totals[op["kind"]] = totals.get(op["kind"], 0.0) + op["end"] - op["start"]
    per = max(1, len(measured)) * len(docs)
    return RunResult(times, tuple(losses), {k: v / per for k, v in sorted(totals.items())},
                     tuple(docs))


def _run_all(plan: Plan, cfg: RunConfig, spawn: Spawn | None, timeout_s: float,
             mkdtemp: MakeTemp | None = None) -> list[dict]:
    spawn = spawn or local_spawn
    tmp = mkdtemp("holmes-run-") if mkdtemp else Path(tempfile.mkdtemp(prefix="holmes-run-"))
    procs: dict[int, subprocess.Popen] = {}
    try:
        mark_owner(tmp)  # a killed run's folder is then --cleanup's to remove
        config_path = _write_config(plan, cfg, tmp)
        out_dir = Path(cfg.output_dir) if cfg.output_dir else tmp
        for rank in range(plan.world_size):
            argv = [sys.executable, "-c", _BOOTSTRAP,
                    "--config", str(config_path), "--rank", str(rank)]
            procs[rank] = spawn(rank, argv)
        _wait(procs, out_dir, timeout_s)
        return [json.loads((out_dir / f"rank_{r}.json").read_text())
                for r in range(plan.world_size)]
    finally:
        # Also on KeyboardInterrupt: no rank and no temp file outlives the call.
        _kill_all(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def _write_config(plan: Plan, cfg: RunConfig, tmp: Path) -> Path:
    if not cfg.store:
        cfg = replace(cfg, store={"kind": "file", "path": str(tmp / "store")})
    if not cfg.output_dir:
        cfg = replace(cfg, output_dir=str(tmp))
    Path(cfg.output_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    (tmp / "plan.json").write_text(plan.to_json())
    path = tmp / "run.json"
    doc = {"plan_path": str(tmp / "plan.json"), "run": json.loads(cfg.to_json())}
    path.write_text(json.dumps(doc))
    return path


class RunTimedOut(TestbedError):
    """The run passed its `timeout_s`; `timeout_s` says how long it had."""

    def __init__(self, message: str, timeout_s: float) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s


class RankFailed(TestbedError):
    """A rank exited non-zero; `peer_timeout`: its log says it timed out waiting on a peer."""

    def __init__(self, message: str, peer_timeout: bool) -> None:
        super().__init__(message)
        self.peer_timeout = peer_timeout


# What gloo writes when an operation waits past its timeout for a peer that never answers, and
# what the rendezvous store writes when a peer never joins the group.
_PEER_TIMEOUT = ("Timed out waiting", "timed out waiting", "RuntimeError: Wait timeout")


def _wait(procs: dict[int, subprocess.Popen], out_dir: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = {r: p.poll() for r, p in procs.items()}
        failed = [r for r, c in codes.items() if c not in (None, 0)]
        if failed:
            raise failure(procs, codes, out_dir)
        if all(c == 0 for c in codes.values()):
            return
        if time.monotonic() > deadline:
            raise timed_out(procs, codes, out_dir, timeout_s)
        time.sleep(_POLL_S)


def failure(procs: dict[int, subprocess.Popen], codes: dict[int, int | None],
            out_dir: Path) -> RankFailed:
    """The error of a run a rank failed: the likely cause (`_culprit`) and how it ended, every
    failed rank, the ranks still running (a stopped or stuck one among them is what a peer
    timed out on), and the rank's log tail."""
    failed = [r for r, c in codes.items() if c not in (None, 0)]
    r = culprit(failed, codes, lambda k: _log(out_dir, k))
    tail = read_tail(_log(out_dir, r))
    peer_timeout = tail is not None and any(t in tail for t in _PEER_TIMEOUT)
    running = _running(procs, codes)
    text = f"rank {r} {how_it_ended(codes[r])} (ranks failed: {failed}"
    text += f"; still running: [{', '.join(running)}])" if running else ")"
    if peer_timeout:
        text += (f"; rank {r} timed out waiting on a peer"
                 + (" (a still-running rank is stuck: stopped, or starved of CPU)"
                    if running else ""))
    return RankFailed(text + tail_text(f"rank {r}", tail), peer_timeout)


def culprit(failed: list[int], codes: dict[int, int | None],
            log_of: Callable[[int], Path]) -> int:
    """The failed process (rank) that most likely caused the others to fail: one ended by a
    signal (its peers then exit non-zero on broken sockets within the same poll), then the one
    whose log (`log_of(rank)`) was last written earliest (a Python process writes its traceback
    as it exits), then the lowest rank (also among those without a log, whose time is
    unknown)."""
    def key(r: int) -> tuple[bool, float, int]:
        try:
            written = float(log_of(r).stat().st_mtime_ns)
        except OSError:
            written = math.inf
        return (codes[r] >= 0, written, r)
    return min(failed, key=key)


def timed_out(procs: dict[int, subprocess.Popen], codes: dict[int, int | None], out_dir: Path,
              timeout_s: float) -> RunTimedOut:
    """The error of a run that passed `timeout_s`: the ranks still running and the first one's
    log tail."""
    waiting = [r for r, c in codes.items() if c is None]
    return RunTimedOut(f"run timed out after {timeout_s:g} s; ranks still running: "
                       f"[{', '.join(_running(procs, codes))}]"
                       + tail_text(f"rank {waiting[0]}", read_tail(_log(out_dir, waiting[0]))),
                       timeout_s)


def how_it_ended(code: int) -> str:
    """How a process with exit status `code` ended, in words (a negative code: killed by that
    signal, as `subprocess` reports it)."""
    if code == -signal.SIGKILL:
        return "was killed (signal 9; likely the host ran out of memory)"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _running(procs: dict[int, subprocess.Popen], codes: dict[int, int | None]) -> list[str]:
    """The ranks still running, each marked '(stopped)' when it is stopped (SIGSTOP)."""
    return [f"{r} (stopped)" if _stopped(procs[r].pid) else str(r)
            for r, c in codes.items() if c is None]


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T or t in /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] in ("T", "t")


def tail_text(who: str, tail: str | None) -> str:
    """'; WHO log tail:' and the tail on the next lines, or that `who`'s log is empty (it
    started and wrote nothing; `tail` blank) or that it wrote none (None: no log to read)."""
    if tail is None:
        return f"; {who} wrote no log"
    if not tail.strip():
        return f"; {who}'s log is empty"
    return f"; {who} log tail:\n{tail}"


def _log(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank_{rank}.log"


def read_tail(path: Path, chars: int = _TAIL_CHARS) -> str | None:
    """The last `chars` characters of the log at `path` (None when there is none to read)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return None


def _kill_all(procs: dict[int, subprocess.Popen]) -> None:
    """SIGKILL every still-running rank (its process group when it leads one), then reap it."""
    for p in procs.values():
        if p.poll() is not None:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            # Only a group the rank leads: never our own group.
            if os.getpgid(p.pid) == p.pid:
                os.killpg(p.pid, signal.SIGKILL)
            else:
                p.kill()
    for p in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
