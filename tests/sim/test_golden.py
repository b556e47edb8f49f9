"""Every bundled scenario's results, byte for byte, against a committed golden file.

A model change that moves any figure fails here; when the change is intended, regenerate with
`pytest tests/sim/test_golden.py --update-golden` and commit the diff with the reason.

The goldens pin the full simulation (every replica); `test_symmetry.py` checks that the default,
one replica per class, agrees with it to 1e-9."""

from __future__ import annotations

import json

import pytest

from holmes_sim.bundled import resolve_scenario
from holmes_sim.prepare import prepare
from holmes_sim.runner import results_document, run_scenario
from tests.conftest import REPO, SCENARIOS

GOLDEN = REPO / "tests" / "golden"
# The 1,024-GPU scenario takes minutes for all its policies; two of them cover it.
POLICIES = {"large_175b_1024": ["megatron", "holmes"]}


@pytest.mark.parametrize("name", sorted(p.stem for p in SCENARIOS.glob("*.yaml")))
def test_scenario_matches_golden(name, update_golden):
    prepared = prepare(resolve_scenario(name))  # by its bundled name, as `holmes-sim run NAME`
    document = results_document(prepared, run_scenario(prepared, POLICIES.get(name), full_simulation=True), 0)
    assert document["scenario"]["file"] == name  # the name, the same in every checkout
    text = json.dumps(document, indent=1, sort_keys=True) + "\n"
    path = GOLDEN / f"{name}.json"
    if update_golden:
        path.write_text(text)
    assert path.exists(), f"no golden file for {name}; run pytest --update-golden"
    assert text == path.read_text(), f"{name} changed; if intended, run pytest --update-golden"
