"""The tutorial's outputs are today's: regenerating them (docs/tools/generate_outputs.py) must
leave docs/tutorial.md unchanged. docs/scenario_schema.md lists every scenario field, and its
`search:` example loads."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import fields
from pathlib import Path

import pytest

from holmes_sim.prepare import check_search_values, prepare
from holmes_sim.search.planner import layouts, settings_per_layout
from holmes_sim.spec.hardware import VariabilitySpec
from holmes_sim.spec.scenario import EngineSpec, ModelSpec, ParallelSpec, Scenario, \
    SearchSpec, TestbedSpec, TrainingSpec

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("generate_outputs",
                                                  ROOT / "docs" / "tools" / "generate_outputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tutorial_outputs_are_regenerated_unchanged():
    gen = _generator()
    text = gen.TUTORIAL.read_text()
    assert "<!-- gen:" in text and "```console\n$ holmes-sim" in text
    assert gen.regenerate(text) == text, (
        "docs/tutorial.md differs from the current version's outputs; run "
        "python docs/tools/generate_outputs.py and review the diff")


SCHEMA = ROOT / "docs" / "scenario_schema.md"


def _schema_entries(top: str) -> dict[str, str]:
    """The keys of section `top:` in the schema's scenario block (a key commented out counts),
    each with its line and the comment lines that continue it."""
    block = re.search(r"```yaml\n(.*?)```", SCHEMA.read_text(), re.S).group(1)
    entries: dict[str, str] = {}
    inside, key = False, None
    for line in block.splitlines():
        if re.match(r"[a-z_]+:", line):
            inside, key = line.startswith(f"{top}:"), None
            continue
        match = re.match(r" {2}#? ?([a-z_0-9]+):", line)
        if inside and match:
            key = match.group(1)
            entries[key] = line
        elif inside and key and line.lstrip().startswith("#"):
            entries[key] += "\n" + line
    return entries


@pytest.mark.parametrize("top, spec", [
    ("search", SearchSpec), ("testbed", TestbedSpec), ("model", ModelSpec),
    ("training", TrainingSpec), ("parallel", ParallelSpec), ("engine", EngineSpec),
    ("variability", VariabilitySpec)])
def test_schema_lists_every_field(top, spec):
    missing = [f.name for f in fields(spec) if f.name not in _schema_entries(top)]
    assert not missing, "docs/scenario_schema.md lacks " + ", ".join(f"{top}.{m}" for m in missing)


def test_schema_lists_every_top_level_key():
    block = re.search(r"```yaml\n(.*?)```", SCHEMA.read_text(), re.S).group(1)
    present = set(re.findall(r"^([a-z_]+):", block, re.M))
    assert {f.name for f in fields(Scenario)} <= present


@pytest.mark.parametrize("top", ["search", "testbed"])
def test_schema_gives_each_default(top):
    entries = _schema_entries(top)
    assert [k for k, text in entries.items() if "default" not in text] == []


def test_schema_search_example_loads_and_counts(tmp_path):
    """The copyable `search:` block loads into a bundled scenario, passes `plan`'s checks and
    gives the plan count the doc states."""
    text = SCHEMA.read_text()
    example = re.search(r"## Searching layouts.*?```yaml\n(.*?)```", text, re.S).group(1)
    scenario = tmp_path / "mixed_ib_roce_search.yaml"
    scenario.write_text((ROOT / "scenarios" / "mixed_ib_roce.yaml").read_text() + example)
    prepared = prepare(scenario)
    check_search_values(prepared.scenario)
    spec = prepared.scenario.search
    count = len(list(layouts(prepared, spec))) * settings_per_layout(spec)
    assert f"searches {count} plans" in " ".join(text.split())
