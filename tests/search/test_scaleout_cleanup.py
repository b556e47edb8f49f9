"""`ray_map` leaves nothing behind: a Ctrl-C during `ray.init` still shuts Ray down (and comes
after), a local instance it starts runs in a temporary folder of holmes-sim's own that is
removed after, and a cluster it connects to keeps its files. A stand-in `ray` module records
the calls, so these run without Ray."""

from __future__ import annotations

import os
import signal
import sys
import types
from pathlib import Path

import pytest

from holmes_sim.search.scaleout import ray_map


class FakeRay(types.ModuleType):
    """`ray` as `ray_map` uses it: `running` is whether `init(address='auto')` finds a cluster,
    `interrupt` whether a Ctrl-C comes in the middle of `init`."""

    def __init__(self, running: bool = False, interrupt: bool = False,
                 local_error: OSError | None = None):
        super().__init__("ray")
        self.running, self.interrupt, self.local_error = running, interrupt, local_error
        self.calls: list[tuple] = []
        self.temp_dirs: list[Path] = []
        self.up = False

    def is_initialized(self) -> bool:
        return self.up

    def init(self, address: str | None = None, **kwargs) -> None:
        self.calls.append(("init", address, kwargs.get("_temp_dir")))
        if address == "auto" and not self.running:
            raise ConnectionError("no cluster")
        if kwargs.get("_temp_dir"):
            temp = Path(kwargs["_temp_dir"])
            assert temp.is_dir()
            (temp / "session_1").mkdir()  # what Ray writes there
            self.temp_dirs.append(temp)
            if self.local_error is not None:
                raise self.local_error
        if self.interrupt:
            os.kill(os.getpid(), signal.SIGINT)  # handled (or held) at the next bytecode
        self.up = True

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))
        self.up = False

    def remote(self, fn):
        return types.SimpleNamespace(remote=lambda *args: fn(*args))

    def put(self, value):
        return value

    def get(self, ref):
        return ref


def _chunk_sum(context, options, chunk):
    return sum(chunk) + context


@pytest.fixture
def fake_ray(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.delenv("RAY_TMPDIR", raising=False)

    def install(**kwargs) -> FakeRay:
        fake = FakeRay(**kwargs)
        monkeypatch.setitem(sys.modules, "ray", fake)
        return fake

    return install


def test_a_local_instance_runs_in_a_temp_folder_removed_after(fake_ray, tmp_path):
    ray = fake_ray()
    assert ray_map(_chunk_sum, 10, None, [[1, 2], [3]], "auto") == [13, 13]
    (temp,) = ray.temp_dirs
    assert temp.parent == tmp_path and temp.name.startswith("hs-ray-")
    assert ray.calls == [("init", "auto", None), ("init", None, str(temp)), ("shutdown",)]
    assert not temp.exists() and list(tmp_path.iterdir()) == []


def test_a_ctrl_c_during_ray_init_comes_after_ray_is_shut_down(fake_ray, tmp_path):
    ray = fake_ray(interrupt=True)
    with pytest.raises(KeyboardInterrupt):
        ray_map(_chunk_sum, 0, None, [[1]], "auto")
    assert ray.calls[-1] == ("shutdown",) and not ray.up
    assert list(tmp_path.iterdir()) == []


def test_a_running_cluster_is_left_its_files(fake_ray, tmp_path):
    ray = fake_ray(running=True)
    assert ray_map(_chunk_sum, 0, None, [[1]], "auto") == [1]
    assert ray.calls == [("init", "auto", None), ("shutdown",)]
    assert list(tmp_path.iterdir()) == []


def test_a_connection_the_caller_opened_stays_open(fake_ray):
    ray = fake_ray(running=True)
    ray.up = True
    assert ray_map(_chunk_sum, 0, None, [[1]], "auto") == [1]
    assert ray.calls == [] and ray.up


def test_a_local_instance_that_cannot_start_names_ray_tmpdir(fake_ray, tmp_path):
    # Ray refuses socket paths past 107 bytes; a long RAY_TMPDIR made `--ray auto` end in a
    # traceback (an OSError ray_map did not turn into a message).
    from holmes_sim.errors import FieldError

    ray = fake_ray(local_error=OSError("validate_socket_filename failed: AF_UNIX path length "
                                       "cannot exceed 107 bytes"))
    with pytest.raises(FieldError, match="set RAY_TMPDIR to a shorter folder") as caught:
        ray_map(_chunk_sum, 0, None, [[1]], "auto")
    assert caught.value.path == "--ray" and "107 bytes" in str(caught.value)
    assert ray.calls[-1] == ("shutdown",) and list(tmp_path.iterdir()) == []
