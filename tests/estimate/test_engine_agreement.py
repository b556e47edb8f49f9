"""The analytic estimate against the event engine on bundled layouts where no two transfers
contend for a link for long: the overlapped distributed optimizer's gathers before each chunk's
first forward, and its reductions released in each chunk's last backward, priced where the
engine runs them (docs/architecture.md, "The analytic estimate")."""

import pytest

from holmes_sim.bundled import bundled_scenario
from holmes_sim.prepare import prepare
from holmes_sim.search.planner import Layout, confirm, evaluate

BOUND = 0.01
"""|estimate / engine - 1| allowed (docs/architecture.md promises 1%)."""


@pytest.mark.parametrize("scenario, layout, policy", [
    # interleaved at pipeline 2: the old estimate delayed chunk 0's first forward by every
    # chunk's gathers and reduced every chunk's gradients after the last backward (+11%)
    ("mixed_ib_eth", Layout(2, 2, 16, 4, "interleaved", 3, "selective", True), "holmes"),
    ("mixed_ib_eth", Layout(4, 2, 8, 8, "interleaved", 2, "selective", True), "holmes"),
    ("moe_mixed_nics", Layout(1, 2, 32, 1, "interleaved", 2, "selective", True, ep=4), "holmes"),
    ("straggler", Layout(2, 2, 16, 8, "interleaved", 5, "selective", True),
     "holmes-no-nic-aware-order"),
    ("mixed_ib_eth", Layout(2, 2, 16, 4, "1f1b", 1, "selective", True), "holmes"),
    ("mixed_ib_eth", Layout(2, 2, 16, 4, "interleaved", 3, "selective", True), "holmes-no-overlap"),
    ("mixed_ib_eth", Layout(2, 2, 16, 4, "interleaved", 3, "selective", True), "megatron"),
])
def test_estimate_agrees_with_the_engine(scenario, layout, policy):
    prepared = prepare(bundled_scenario(scenario))
    estimated = evaluate(prepared, layout, policy)
    assert estimated.fits_memory, estimated.reason
    simulated = confirm(prepared, estimated).predicted_iteration_s
    assert estimated.predicted_iteration_s / simulated - 1 == pytest.approx(0.0, abs=BOUND), \
        (estimated.predicted_iteration_s, simulated)
