"""Predicted against measured: one policy's case, the cases of a run, whether the policies rank
alike, the effect of each Holmes mechanism, and the table the command prints."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from rich.table import Table
from rich.text import Text

from holmes_sim.report.tables import fit_table


@dataclass(frozen=True, slots=True)
class Case:
    """One policy: predicted and measured iteration time (s) and the error in %."""

    policy: str
    predicted_s: float
    measured_s: float
    measured_iterations_s: tuple[float, ...]
    losses: tuple[float, ...]
    predicted_breakdown_s: dict = dataclasses.field(default_factory=dict)
    """The simulator's time breakdown (mean over entities) of this policy."""
    measured_ops_s: dict = dataclasses.field(default_factory=dict)
    """Measured seconds per op kind per rank per iteration (forward, backward, recv, ...)."""
    profile: dict = dataclasses.field(default_factory=dict)
    """The calibration the prediction used (taken just before this case's run)."""
    emulation_lag_pct: float = 0.0
    """Emulated compute: how much longer the ranks' compute waits took than requested, in % of
    the requested (the host's wake-up lag; 0 under real compute)."""
    plans: tuple[dict, ...] = ()
    """The plans the simulator chose on the measured profile and the rounds ran (placement,
    layers, groups with their NICs; `testbed_plan.plan_summary`), each distinct one once:
    normally one, more where real compute's per-round calibrations moved the plan."""

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def measured_ci_s(self) -> tuple[float, float]:
        """Distribution-free ~95% confidence interval of the measured median (order statistics;
        the whole range when there are too few iterations for one)."""
        return median_ci(self.measured_iterations_s)

    @property
    def noise_pct(self) -> float:
        """Half-width of the measured median's interval, in % of the median."""
        lo, hi = self.measured_ci_s
        return 100.0 * (hi - lo) / 2 / self.measured_s if self.measured_s > 0 else 0.0


def median_ci(samples: tuple[float, ...] | list[float], z: float = 1.96) -> tuple[float, float]:
    """~95% interval of the median: the order statistics n/2 -+ z sqrt(n)/2 (binomial, normal
    approximation); (min, max) below 6 samples, where that rank interval covers everything."""
    xs = sorted(samples)
    n = len(xs)
    if n == 0:
        return (0.0, 0.0)
    half = z * math.sqrt(n) / 2
    lo, hi = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half) - 1)
    return (xs[lo], xs[hi]) if n >= 6 else (xs[0], xs[-1])


@dataclass(frozen=True, slots=True)
class ValidationResult:
    """All cases of one validation run, with the profile and where it ran."""

    cases: tuple[Case, ...]
    tolerance_pct: float
    profile: dict
    provenance: dict
    host_warnings: tuple[str, ...] = ()
    """Why the host cannot be trusted (overloaded, unstable calibration); empty: it can."""
    compute: str = "real"
    """How the ranks computed: "emulated" (calibrated waits) or "real"."""

    @property
    def host_unstable(self) -> bool:
        return bool(self.host_warnings)

    @property
    def ranking_agrees(self) -> bool:
        return ranking_agrees(self.cases)

    @property
    def within_tolerance(self) -> bool:
        return all(abs(c.error_pct) <= self.tolerance_pct for c in self.cases)

    def to_json(self) -> dict:
        return {
            "cases": [{"policy": c.policy, "predicted_s": c.predicted_s, "measured_s": c.measured_s,
                       "error_pct": c.error_pct,
                       "measured_iterations_s": list(c.measured_iterations_s),
                       "measured_ci_s": list(c.measured_ci_s), "noise_pct": c.noise_pct,
                       "losses": list(c.losses),
                       "predicted_breakdown_s": c.predicted_breakdown_s,
                       "measured_ops_s": c.measured_ops_s,
                       "emulation_lag_pct": c.emulation_lag_pct,
                       "plans": list(c.plans),
                       "profile_compute": c.profile.get("compute", {}),
                       "profile_host": c.profile.get("host", {})} for c in self.cases],
            "ranking_agrees": self.ranking_agrees,
            "mechanism_effects": mechanism_effects(self.cases),
            "host_unstable": self.host_unstable,
            "host_warnings": list(self.host_warnings),
            "compute": self.compute,
            "within_tolerance": self.within_tolerance,
            "tolerance_pct": self.tolerance_pct,
            "mean_abs_error_pct": statistics.fmean(abs(c.error_pct) for c in self.cases),
            "max_abs_error_pct": max(abs(c.error_pct) for c in self.cases),
            "profile": self.profile,
            "provenance": self.provenance,
        }


# Each ablation and the Holmes mechanism it switches off (holmes_sim/policies/__init__.py).
MECHANISMS = {"holmes-no-nic-aware-order": "NIC-aware grouping",
              "holmes-no-nic-selection": "per-group NIC selection",
              "holmes-no-adaptive-partition": "adaptive partition",
              "holmes-no-overlap": "overlapped optimizer",
              "megatron": "all four (Megatron-LM's defaults)"}


def mechanism_effects(cases: tuple[Case, ...] | list[Case], tie_pct: float = 3.0) -> list[dict]:
    """Per ablation run next to holmes: how much slower it is without the mechanism, measured
    and predicted, in % of holmes' time, and whether the measured effect exceeds the noise
    band (`ranking_agrees`' band: `tie_pct` or both cases' measured noise)."""
    by = {c.policy: c for c in cases}
    base = by.get("holmes")
    if base is None:
        return []
    out = []
    for name, mechanism in MECHANISMS.items():
        c = by.get(name)
        if c is None:
            continue
        band = max(tie_pct, base.noise_pct, c.noise_pct)
        measured = 100.0 * (c.measured_s / base.measured_s - 1)
        out.append({"policy": name, "mechanism": mechanism, "measured_pct": measured,
                    "predicted_pct": 100.0 * (c.predicted_s / base.predicted_s - 1),
                    "band_pct": band, "beyond_noise": abs(measured) > band})
    return out


def ranking_agrees(cases: tuple[Case, ...] | list[Case], tie_pct: float = 3.0) -> bool:
    """Every pair the prediction orders (by more than its band) is measured in the same order,
    unless the two measured times are within that band of each other. A pair's band is
    `tie_pct` % or the larger of the two cases' measured noise (`Case.noise_pct`), whichever
    is wider: the prediction claims no order the measurement cannot resolve."""
    for a in cases:
        for b in cases:
            band = 1 + max(tie_pct, a.noise_pct, b.noise_pct) / 100
            if a.predicted_s * band < b.predicted_s and a.measured_s > b.measured_s * band:
                return False
    return True


COMPARISON_COLUMNS = ("policy", "predicted s", "measured s", "95% interval", "error %",
                      "iterations", "verdict")
COMPARISON_DROP_ORDER = ("iterations", "95% interval")


def comparison_table(result: ValidationResult, width: int = 80, wide: bool = False) -> Table:
    """Predicted against measured (median, ~95% interval), per policy, with mean/max error and
    the ranking verdict, or why there is none (host warnings); narrowed to `width` columns
    unless `wide`, the policy always whole."""
    return fit_table(lambda headers: _comparison_table(result, headers), COMPARISON_COLUMNS,
                     COMPARISON_DROP_ORDER, width, wide)


def _comparison_table(result: ValidationResult, headers: Sequence[str]) -> Table:
    doc = result.to_json()
    verdict = (f"ranking {'agrees' if result.ranking_agrees else 'DISAGREES'}"
               if not result.host_unstable else "NO VERDICT: " + "; ".join(result.host_warnings))
    table = Table(title=Text(f"validation (tolerance {result.tolerance_pct:g}%): mean |error| "
                             f"{doc['mean_abs_error_pct']:.1f}%, max {doc['max_abs_error_pct']:.1f}%, "
                             f"{verdict}"),
                  title_justify="left")
    keep = [i for i, col in enumerate(COMPARISON_COLUMNS) if col in headers]
    for i in keep:
        col = COMPARISON_COLUMNS[i]
        table.add_column(col, justify="left" if col in ("policy", "verdict") else "right",
                         no_wrap=col != "verdict", overflow="fold")
    for c in sorted(result.cases, key=lambda c: c.measured_s):
        ok = abs(c.error_pct) <= result.tolerance_pct
        lo, hi = c.measured_ci_s
        cells = (Text(c.policy), f"{c.predicted_s:.3f}", f"{c.measured_s:.3f}",
                 f"{lo:.3f}-{hi:.3f}", f"{c.error_pct:+.1f}", str(len(c.measured_iterations_s)),
                 Text("no verdict") if result.host_unstable else Text("ok") if ok
                 else Text("out of tolerance", style="red"))
        table.add_row(*(cells[i] for i in keep))
    return table
