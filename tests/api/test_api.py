"""The Python API: simulate() from a path, a bundled name or a dict, typed results, JSON stamp."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import yaml

import holmes_sim
from holmes_sim.errors import HolmesError
from holmes_sim.runner import SCHEMA_VERSION
from tests.conftest import SCENARIOS


def test_importing_the_package_imports_nothing_heavy():
    code = ("import sys, holmes_sim; print(sorted(m for m in ('torch', 'simpy', 'matplotlib', "
            "'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert set(holmes_sim.__all__) >= {"simulate", "Simulation", "PolicyResult"}


def test_a_name_a_path_and_a_dict_give_the_same_figures():
    policies = ["megatron", "holmes"]
    by_name = holmes_sim.simulate("mixed_ib_eth", policies=policies)
    by_path = holmes_sim.simulate(SCENARIOS / "mixed_ib_eth.yaml", policies=policies)
    by_dict = holmes_sim.simulate(yaml.safe_load((SCENARIOS / "mixed_ib_eth.yaml").read_text()),
                                  policies=policies)
    times = [[r.iteration_time_s for r in s.results] for s in (by_name, by_path, by_dict)]
    assert times[0] == times[1] == times[2]
    assert isinstance(by_name.results[0], holmes_sim.PolicyResult)
    holmes = by_name.result("holmes")
    assert holmes.speedup_over_megatron > 1 and by_name.best.policy == "holmes"
    assert by_name.result("megatron").speedup_over_megatron == pytest.approx(1.0)


def test_a_policy_result_reads_its_result_fields():
    r = holmes_sim.simulate("mixed_ib_eth", policies=["holmes"]).result("holmes")
    for f in dataclasses.fields(r.result):
        assert getattr(r, f.name) is getattr(r.result, f.name), f.name
    assert r.peak_memory_gib == r.result.memory.peak_gib and r.fits_memory is r.result.memory.fits
    assert {"policy", "breakdown_s", "fits_memory"} <= set(dir(r))
    with pytest.raises(AttributeError):
        r.to_json  # noqa: B018 (a method of the Result, not a field)


def test_references_and_identical_plans_are_flagged():
    sim = holmes_sim.simulate("mixed_ib_roce")
    assert sim.result("all-ib").reference and not sim.result("holmes").reference
    assert sim.result("holmes-no-adaptive-partition").same_plan_as == "holmes"
    assert not sim.best.reference


def test_seed_and_json_document():
    sim = holmes_sim.simulate("mixed_ib_eth", policies=["holmes"], seed=11)
    doc = sim.to_json()
    assert doc["scenario"]["seed"] == 11 and doc["schema_version"] == SCHEMA_VERSION
    assert doc["tool"] == {"name": "holmes-sim", "version": holmes_sim.__version__}


def test_bad_input_raises_the_cli_error():
    with pytest.raises(HolmesError, match="unknown policy"):
        holmes_sim.simulate("mixed_ib_eth", policies=["holmez"])
    with pytest.raises(HolmesError, match="<dict scenario>"):
        holmes_sim.simulate({"clusters": []})


def test_str_subclasses_as_values_and_keys_read_as_plain_text():
    """numpy.str_ and StrEnum (values read from a table or an enum) as a value or a key: the
    scenario is the one plain str gives, not a YAML RepresenterError."""
    import enum

    import numpy as np

    from holmes_sim.spec.load import mapping_text

    Names = enum.StrEnum("Names", {"ONE_F_ONE_B": "1f1b", "PRECISION": "precision"})
    plain = yaml.safe_load((SCENARIOS / "mixed_ib_eth.yaml").read_text())
    mixed = yaml.safe_load((SCENARIOS / "mixed_ib_eth.yaml").read_text())
    mixed["parallel"] = {np.str_(k): v for k, v in mixed["parallel"].items()}
    mixed["parallel"]["schedule"] = Names.ONE_F_ONE_B
    mixed["training"] = {Names(k) if k == "precision" else k: v
                         for k, v in mixed["training"].items()}
    mixed["description"] = plain["description"] = "numpy"
    mixed["description"] = np.str_("numpy")
    assert mapping_text(mixed, "<dict scenario>") == mapping_text(plain, "<dict scenario>")
    sim = holmes_sim.simulate(mixed, policies=["megatron"])
    assert sim.prepared.scenario.parallel.schedule == "1f1b"
    assert type(sim.prepared.scenario.parallel.schedule) is str


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"full_simulation": "yes"}, "full_simulation: expected True or False, got 'yes' (str)"),
    ({"full_simulation": 1}, "full_simulation: expected True or False, got 1 (int)"),
    ({"policies": []}, "policies: the list is empty; name at least one policy, or pass None"),
    ({"policies": ()}, "policies: the list is empty"),
])
def test_a_truthy_flag_or_an_empty_policy_list_is_refused_naming_the_argument(kwargs, says):
    """Any truthy full_simulation ran the slow full simulation, and policies=[] silently ran
    every policy of the scenario."""
    with pytest.raises(HolmesError) as info:
        holmes_sim.simulate("mixed_ib_eth", **kwargs)
    assert says in str(info.value)
