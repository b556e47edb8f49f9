"""The optional C extensions are used only with the interface their Python callers expect and,
where their .c files sit beside them, only when built from those files as they are now: a build
left in place from other sources (an editable install after a pull) is never called, the Python
code runs instead, with the same results (`version.extension`)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from holmes_sim.version import extension, source_digest

REPO = Path(__file__).resolve().parent.parent

EXTENSIONS = {  # extension: (its caller, the caller's expected `ABI`, what the caller calls)
    "holmes_sim.estimate._walk_kernel": ("holmes_sim.estimate.walk", "WALK_KERNEL_ABI",
                                         ["advance"]),
    "holmes_sim.sim._trace_rows": ("holmes_sim.sim.trace", "TRACE_ROWS_ABI", ["append"]),
    "holmes_sim.sim._run_loop": ("holmes_sim.sim.environment", "RUN_LOOP_ABI", ["take"]),
    "holmes_sim.sim._agenda_entries": ("holmes_sim.sim.agenda_entries", "AGENDA_ENTRIES_ABI",
                                       ["apply", "post"]),
    "holmes_sim.sim._pipeline_messages": ("holmes_sim.sim.pipeline_messages",
                                          "PIPELINE_MESSAGES_ABI", ["Core"]),
    "holmes_sim.sim._entity_steps": ("holmes_sim.sim.entity_steps", "ENTITY_STEPS_ABI",
                                     ["Steps"]),
}

RUN = """
import hashlib, sys, types

def stale(*args, **kwargs):
    raise AssertionError("a stale extension was called")

for name, (names, stamps) in {stale_modules!r}.items():  # stand-ins: builds from other sources
    module = types.ModuleType(name)
    for attr in names:
        setattr(module, attr, stale)
    for attr, value in stamps.items():  # `ABI`, `SOURCE_SHA256`
        setattr(module, attr, value)
    sys.modules[name] = module

from holmes_sim.bundled import bundled_scenario
from holmes_sim.estimate import walk
from holmes_sim.estimate.analytic import estimate_iteration
from holmes_sim.prepare import prepare
from holmes_sim.runner import plan_policy
from holmes_sim.sim import agenda_entries, entity_steps, environment, pipeline_messages, trace
from holmes_sim.sim.engine import EngineOptions, simulate

prepared = prepare(bundled_scenario("straggler"))
plan, cluster = plan_policy(prepared, "holmes")  # estimates its candidates: walks
result = simulate(plan, cluster, prepared.workload, prepared.compute,
                  EngineOptions(full_simulation=True))
estimate = estimate_iteration(plan, cluster, prepared.workload, prepared.compute)
print([walk._walk_kernel is not None, trace.append_row is not trace._append_row_struct,
       environment.take is not environment._take,
       agenda_entries.apply is not agenda_entries._apply, pipeline_messages.Core is not None,
       entity_steps.Steps is not None])
print(repr(result.iteration_s), result.events, result.flows,
      hashlib.sha256(bytes(result.rows)).hexdigest(), repr(estimate.iteration_s),
      repr(estimate.stage_end_s))
"""


def _stamps(name: str, stale: str) -> dict:
    """A stand-in's `ABI` and `SOURCE_SHA256` for the `stale` case: "without-abi" (none, as
    before interfaces had versions), "older-abi" (0), "other-source" (the expected interface,
    built from another .c: a pull that changed a body)."""
    if stale == "without-abi":
        return {}
    if stale == "older-abi":
        return {"ABI": 0}
    caller, constant, _ = EXTENSIONS[name]
    return {"ABI": getattr(importlib.import_module(caller), constant), "SOURCE_SHA256": "0" * 64}


def _run(stale: str | None) -> tuple[str, str]:
    """Which extensions a fresh process uses (a list of six flags) and its results (a line):
    with `stale` stand-in extensions (`_stamps`) in `sys.modules`, or with the extensions
    built here where None."""
    modules = {n: (names, _stamps(n, stale)) for n, (_, _, names) in EXTENSIONS.items()
               } if stale else {}
    code = RUN.format(stale_modules=modules)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    used, results = done.stdout.splitlines()
    return used, results


def _built(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.mark.parametrize("stale", ["without-abi", "older-abi", "other-source"])
def test_a_stale_extension_is_not_called_and_the_results_are_the_c_paths(stale):
    """A module of another interface (none, as before interfaces had versions, or an older one)
    or built from another .c than the one beside it is left alone: the walk and the engine run
    in Python and give the C path's results bit for bit (before: `TypeError: advance() takes
    exactly 9 arguments (10 given)`; for "other-source": `AssertionError: a stale extension
    was called`)."""
    used, results = _run(stale)
    assert used == str([False] * 6)
    built_used, built_results = _run(None)
    assert built_used == str([_built(name) for name in EXTENSIONS])
    assert results == built_results


def test_extension_returns_a_module_only_with_the_expected_abi(monkeypatch):
    name = "holmes_sim.sim._stand_in"
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)
    assert extension(name, 1) is None  # no `ABI`
    module.ABI = 2
    assert extension(name, 1) is None
    module.ABI = 1
    assert extension(name, 1) is module
    assert extension("holmes_sim.sim._never_built", 1) is None


def test_extension_with_a_source_beside_it_needs_that_sources_sha256(monkeypatch):
    """Where the .c sits beside the module (an editable install, a source checkout), its
    `SOURCE_SHA256` must be that file's; where none does, the `ABI` alone decides."""
    name = "holmes_sim.sim._run_loop"
    module = types.ModuleType(name)
    module.ABI = importlib.import_module("holmes_sim.sim.environment").RUN_LOOP_ABI
    monkeypatch.setitem(sys.modules, name, module)
    assert extension(name, module.ABI) is None  # no `SOURCE_SHA256`: built before the stamp
    module.SOURCE_SHA256 = "0" * 64
    assert extension(name, module.ABI) is None
    module.SOURCE_SHA256 = hashlib.sha256((REPO / "holmes_sim/sim/_run_loop.c").read_bytes()
                                          ).hexdigest()
    assert extension(name, module.ABI) is None  # the .c alone: its header `_slots.h` left out
    module.SOURCE_SHA256 = source_digest(REPO / "holmes_sim/sim/_run_loop.c")
    assert extension(name, module.ABI) is module
    unsourced = "holmes_sim.sim._stand_in"  # no .c beside it
    monkeypatch.setitem(sys.modules, unsourced, types.SimpleNamespace(ABI=1, SOURCE_SHA256="0"))
    assert extension(unsourced, 1) is sys.modules[unsourced]


def test_every_c_source_is_an_extension_with_its_callers_abi():
    """Each .c defines `ABI` as its caller's expected version (bump both together)."""
    sources = {".".join(("holmes_sim", *p.relative_to(REPO / "holmes_sim").with_suffix("").parts))
               : p for p in (REPO / "holmes_sim").rglob("_*.c")}
    assert sorted(sources) == sorted(EXTENSIONS)
    for name, (caller, constant, _) in EXTENSIONS.items():
        defined = re.search(r"^#define ABI (\d+)$", sources[name].read_text(), re.M)
        assert defined, f"{sources[name]} defines no ABI"
        assert int(defined.group(1)) == getattr(importlib.import_module(caller), constant), name


@pytest.mark.parametrize("name", sorted(EXTENSIONS))
def test_every_built_extension_has_its_callers_abi(name):
    """The extensions built here are of the interface their callers expect (else the tests of
    the C path are skipped; rebuild: `python setup.py build_ext --inplace`)."""
    if not _built(name):
        pytest.skip(f"{name} was not built")
    caller, constant, _ = EXTENSIONS[name]
    expected = getattr(importlib.import_module(caller), constant)
    got = getattr(importlib.import_module(name), "ABI", None)
    assert got == expected, (f"{name} has ABI {got}, {caller} expects {expected}: rebuild "
                             "with `python setup.py build_ext --inplace`")


@pytest.mark.parametrize("name", sorted(EXTENSIONS))
def test_every_built_extension_is_stamped_with_its_sources_sha256(name):
    """setup.py stamps each build with the SHA-256 of its .c file and the headers it includes: a
    build from the sources as they are now (else rebuild: `python setup.py build_ext --inplace`)."""
    if not _built(name):
        pytest.skip(f"{name} was not built")
    source = REPO.joinpath(*name.split(".")).with_suffix(".c")
    got = getattr(importlib.import_module(name), "SOURCE_SHA256", None)
    assert got == source_digest(source), (
        f"{name} was built from another {source.name}: rebuild with "
        "`python setup.py build_ext --inplace`")


def test_a_header_it_includes_is_part_of_the_digest(tmp_path):
    """`source_digest` covers the .c file and, in order, the headers of its folder it includes:
    a change to a header alone changes it (so a build from an older header is not used)."""
    (tmp_path / "_h.h").write_text("#define X 1\n")
    (tmp_path / "_m.c").write_text('#include <Python.h>\n#include "_h.h"\nint x = X;\n')
    before = source_digest(tmp_path / "_m.c")
    (tmp_path / "_h.h").write_text("#define X 2\n")
    assert source_digest(tmp_path / "_m.c") != before
