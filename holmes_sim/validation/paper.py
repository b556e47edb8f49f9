"""The Holmes paper's framework comparison (Figure 6), reproduced with one fitted unknown.

The paper does not state its Ethernet rate. `fit_ethernet` finds the line rate (bisection on
Gbit/s, all Ethernet NICs alike, catalog efficiency) at which the simulated Holmes / Megatron-LM
throughput ratio equals the figure's; the other frameworks' ratios to Megatron-LM at that rate
are predictions, compared with the figure within its tolerance, together with the ranking.

Each bar is simulated as the policy that models the code the authors ran (`figure6.json`
`bar_policies` says why); a policy listed under `beside` (another release of the same framework)
is simulated at the same rate and reported next to its bar without being held to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from holmes_sim.errors import ScenarioError

PAPER_DIR = Path(__file__).resolve().parents[2] / "validation" / "paper"


@dataclass(frozen=True, slots=True)
class PaperComparison:
    """Fitted Ethernet rate (Gbit/s), and per framework the figure's and the simulated ratio to
    Megatron-LM (throughput), plus whether the rankings agree."""

    ethernet_gbit_per_s: float
    measured_ratio: dict[str, float]
    predicted_ratio: dict[str, float]
    fitted: str
    tolerance_pct: float
    beside: dict[str, str] = field(default_factory=dict)
    """Policy reported beside a bar -> the bar's policy (not held to the figure)."""
    beside_ratio: dict[str, float] = field(default_factory=dict)
    """Simulated ratio to Megatron-LM of each policy in `beside`."""
    bar_policies: str = ""
    """Why each bar is simulated as its policy (`figure6.json`)."""

    def beside_error(self, policy: str) -> float:
        """Error of a policy reported beside a bar, against that bar."""
        return self.beside_ratio[policy] / self.measured_ratio[self.beside[policy]] - 1.0

    def error(self, policy: str) -> float:
        return self.predicted_ratio[policy] / self.measured_ratio[policy] - 1.0

    @property
    def ranking_agrees(self) -> bool:
        def order(d):
            return sorted(d, key=lambda p: -d[p])
        return order(self.measured_ratio) == order(self.predicted_ratio)

    @property
    def within_tolerance(self) -> bool:
        return all(abs(self.error(p)) * 100 <= self.tolerance_pct for p in self.predicted_ratio)


def _with_ethernet(prepared, gbit: float):
    nodes = tuple(replace(n, nics=tuple(replace(c, bandwidth_bytes_per_s=gbit * 1e9 / 8)
                                        if c.type == "ethernet" else c for c in n.nics))
                  for n in prepared.cluster.nodes)
    return replace(prepared, cluster=prepared.cluster.with_nodes(nodes))


def _throughputs(prepared, policies) -> dict[str, float]:
    from holmes_sim.runner import run_policy

    return {p: 1.0 / run_policy(prepared, p).result.iteration_time_s for p in policies}


def fit_ethernet(prepared, target: float, over: str, policy: str, lo: float = 1.0,
                 hi: float = 400.0, steps: int = 30) -> float:
    """Gbit/s at which throughput(policy) / throughput(over) = target (bisection on log rate;
    the ratio falls as Ethernet gets faster)."""
    def ratio(gbit: float) -> float:
        t = _throughputs(_with_ethernet(prepared, gbit), (policy, over))
        return t[policy] / t[over]

    if not ratio(hi) <= target <= ratio(lo):
        raise ScenarioError(f"no Ethernet rate in [{lo}, {hi}] Gbit/s gives a {policy}/{over} ratio "
                            f"of {target:.3f}")
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        if ratio(mid) > target:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5


def compare(directory: Path = PAPER_DIR) -> PaperComparison:
    """Fit the Ethernet rate on Figure 6's scenario and predict the other ratios."""
    from holmes_sim.prepare import prepare

    spec = json.loads((directory / "figure6.json").read_text())
    measured = spec["tflops_per_gpu"]
    base, fitted = spec["fit"]["over"], spec["fit"]["policy"]
    prepared = prepare(directory / spec["scenario"])
    gbit = fit_ethernet(prepared, measured[fitted] / measured[base], base, fitted)
    beside = spec.get("beside", {})
    t = _throughputs(_with_ethernet(prepared, gbit), list(measured) + list(beside))
    return PaperComparison(gbit, {p: v / measured[base] for p, v in measured.items()},
                           {p: t[p] / t[base] for p in measured}, fitted, spec["tolerance_pct"],
                           beside, {p: t[p] / t[base] for p in beside}, spec.get("bar_policies", ""))
