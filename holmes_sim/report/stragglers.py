"""What each piece of slow hardware (`scenario.variability`) costs a plan: the pipeline stages it
holds back and the seconds per iteration it adds.

A straggler's cost is the plan's analytic iteration time (`estimate.analytic`) on the scenario's
hardware less the same plan's on that hardware without this one straggler (everything else kept),
so stragglers that overlap (two slow nodes holding the same stage) each show what removing it
alone would win back; with several, a last line ("all") gives what removing them all would. The plan is the one the policy made on the varied hardware: a placement
that adapts (Holmes' partition giving a slow stage fewer layers) shows a smaller cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from holmes_sim.estimate.analytic import estimate_iteration
from holmes_sim.hardware.variability import Straggler, apply_variability, stragglers, without
from holmes_sim.policies import get_policy
from holmes_sim.prepare import Prepared
from holmes_sim.runner import Outcome


@dataclass(frozen=True, slots=True)
class StragglerCost:
    """One straggler under one plan."""

    straggler: Straggler
    stages: tuple[int, ...]
    """Pipeline stages with a GPU on the straggler's node (empty: not one node's)."""
    added_s: float
    """Seconds per iteration it adds (analytic estimate; see the module docstring)."""

    def sentence(self) -> str:
        """E.g. 'stage 1 (node roce-a-1 at 0.85x) adds 0.210 s/iteration'."""
        st = self.straggler
        if st.kind == "all":
            return f"all of them together add {self.added_s:.3f} s/iteration"
        if st.kind == "spread":
            what = _spread_phrase(st)
        elif st.kind == "uplink":
            what = f"uplink {st.where} at {st.factor:g}x rate"
        else:
            unit = "speed" if st.kind == "gpu" else f"{st.what} rate"
            where = st.where if st.where.startswith("cluster") else f"node {st.where}"
            what = f"{where} at {st.factor:g}x {unit}"
        if self.stages:
            label = "stage" if len(self.stages) == 1 else "stages"
            what = f"{label} {', '.join(map(str, self.stages))} ({what})"
        return f"{what} adds {self.added_s:.3f} s/iteration"


def straggler_costs(prepared: Prepared, outcome: Outcome) -> list[StragglerCost]:
    """Each straggler of the scenario under `outcome`'s plan (empty without variability)."""
    nominal = prepared.nominal_cluster
    if nominal is None:
        return []
    s, plan = prepared.scenario, outcome.plan
    view = get_policy(plan.policy).cluster_view

    def iteration_s(cluster) -> float:
        return estimate_iteration(plan, cluster, prepared.workload, prepared.compute).iteration_s

    base = iteration_s(outcome.cluster)
    out = []
    items = stragglers(s.variability)
    for k, st in enumerate(items):
        cluster = view(apply_variability(nominal, without(s.variability, k), s.seed))
        out.append(StragglerCost(st, _stages_on(plan, st), base - iteration_s(cluster)))
    if len(items) > 1:
        together = Straggler("all", "", "", 0.0)
        out.append(StragglerCost(together, (), base - iteration_s(view(nominal))))
    return out


def _stages_on(plan, straggler: Straggler) -> tuple[int, ...]:
    if straggler.kind not in ("gpu", "nic") or straggler.where.startswith("cluster"):
        return ()
    return tuple(s for s in range(plan.pp)
                 if any(g.node == straggler.where for d in range(plan.dp)
                        for g in plan.entity_gpus(s, d)))


def with_stragglers(document: dict, prepared: Prepared, outcomes: list[Outcome]) -> dict:
    """The results `document` with a "stragglers" entry (policy -> each straggler's kind, place,
    factor, stages and added seconds) when the scenario has variability; else as it is."""
    if prepared.nominal_cluster is None:
        return document
    return {**document, "stragglers": {
        o.plan.policy: [{"kind": c.straggler.kind, "where": c.straggler.where,
                         "what": c.straggler.what, "factor": c.straggler.factor,
                         "stages": list(c.stages), "added_s": c.added_s, "text": c.sentence()}
                        for c in straggler_costs(prepared, o)] for o in outcomes}}


def stragglers_markdown(prepared: Prepared, outcomes: list[Outcome]) -> str:
    """Per policy, one line per straggler: the stages it holds back and its cost."""
    lines = []
    for o in outcomes:
        costs = straggler_costs(prepared, o)
        lines.append(f"- **{o.plan.policy}** (layers per stage "
                     f"{', '.join(map(str, o.result.layers_per_stage))}): "
                     + "; ".join(c.sentence() for c in costs) + ".")
    return "\n".join(lines)


def stragglers_text(prepared: Prepared, outcomes: list[Outcome]) -> str:
    """`stragglers_markdown` as plain text under a heading, for the terminal."""
    return ("slow hardware (scenario variability), per policy:\n"
            + stragglers_markdown(prepared, outcomes).replace("**", ""))


def variability_note(prepared: Prepared) -> str:
    """A line saying which variability plans were ranked under ('' without variability)."""
    if prepared.nominal_cluster is None:
        return ""
    items = "; ".join(_spread_phrase(s) if s.kind == "spread" else
                      " ".join(filter(None, (s.kind, s.where, s.what, f"at {s.factor:g}x")))
                      for s in stragglers(prepared.scenario.variability))
    return f"plans ranked on the scenario's variability: {items}"


def _spread_phrase(st: Straggler) -> str:
    """A spread's factor is a coefficient of variation, not a speed: say so."""
    return f"a {st.what} spread of GPU speed (coefficient of variation {st.factor:g})"
