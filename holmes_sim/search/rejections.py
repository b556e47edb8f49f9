"""Why the planner's search drops a layout: the schedule checks of a layout (`check_chunks`),
and, when it finds none, each check's rejections tallied by rule."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

from holmes_sim.errors import HolmesError, ScenarioError
from holmes_sim.model.fp8_shapes import check_fp8_shapes
from holmes_sim.prepare import MAX_MICROBATCHES, check_sequence_split
from holmes_sim.schedule import check_schedule
from holmes_sim.spec.scenario import Scenario, SearchSpec

Reject = Callable[[str, tuple], None]
"""`reject(message, where)`: a check dropped the partial layout `where` ((key, value) pairs)
with `message`."""

_WIDEN = {"parallel.tensor": ("tensor",), "parallel.pipeline": ("pipeline", "tensor"),
          "parallel.context": ("context", "tensor", "pipeline"),
          "parallel.cp_comm_type": ("context", "tensor"), "training.flash_attention": ("context",),
          "parallel.expert": ("expert", "tensor", "pipeline", "context"),
          "parallel.expert_tensor": ("expert_tensor", "expert", "tensor"),
          "training.global_batch_size": ("micro_batch_size", "tensor", "pipeline", "context"),
          "model.num_layers": ("pipeline", "virtual_stages"),
          "parallel.schedule": ("schedule", "pipeline"),
          "training.sequence_parallel": ("sequence_parallel", "tensor"),
          "model.seq_length": ("micro_batch_size", "context", "tensor", "sequence_parallel"),
          "model.hidden_size": ("tensor",), "model.ffn_hidden_size": ("tensor",),
          "model.moe_shared_expert_intermediate_size": ("tensor",)}
"""The `search:` keys whose other values may pass a check, by the field its message names
(a message without one, `schedule.check_schedule`'s: schedule, pipeline, micro-batch)."""
_OTHER = ("schedule", "virtual_stages", "pipeline", "micro_batch_size")
_EVERY = ("tensor", "pipeline", "micro_batch_size")
"""Keys whose omission already searches every valid value."""
_TOP = 3


def passes(reject: Reject | None, where: tuple, check: Callable, *args) -> bool:
    """Whether `check(*args)` passes; if not, `reject` (when given) hears `where` and the
    check's message."""
    try:
        check(*args)
    except HolmesError as exc:
        if reject is not None:
            reject(str(exc), where)
        return False
    return True


class Rejections:
    """A `Reject` that tallies the rejections by rule (the message with its numbers taken
    out), keeping each rule's first message and partial layout. A rejection the `search:`
    block did not ask for is kept apart, and reported only when there is no other: a value
    of a key it leaves out (those default to every value, the invalid ones included) dropped
    by that key's own check, or GPipe or interleaved without a pipeline while 1F1B is searched
    (the same layout)."""

    def __init__(self, spec: SearchSpec) -> None:
        self.spec = spec
        self.rules: dict[tuple[bool, str], list] = {}
        """(asked for, rule) -> [count, first message, first partial layout]."""

    def __call__(self, message: str, where: tuple) -> None:
        key = (self._asked(where), re.sub(r"\d+", "N", message))
        self.rules.setdefault(key, [0, message, where])[0] += 1

    def _asked(self, where: tuple) -> bool:
        last = where[-1][0]
        if last in _EVERY and getattr(self.spec, last) is None:
            return False
        got = dict(where)
        return not (got.get("pipeline") == 1 and got.get("schedule", "1f1b") != "1f1b"
                    and "1f1b" in (self.spec.schedule or ("1f1b",)))

    def summary(self) -> str:
        """The most common rules with their counts and an example each, and the keys to widen."""
        asked = any(a for a, _ in self.rules)
        rules = [r for (a, _), r in self.rules.items() if a == asked]
        top = sorted(rules, key=lambda r: -r[0])[:_TOP]
        if not top:
            return "no layout satisfies the cluster, model and batch; widen the search block"
        n = sum(r[0] for r in rules)
        reasons = "; ".join(f"[{c}x, e.g. {_layout(where)}] {message}" for c, message, where in top)
        more = f" (and {len(rules) - len(top)} rarer rules)" if len(rules) > len(top) else ""
        keys = [k for _, message, _ in top for k in _WIDEN.get(message.split(":")[0], _OTHER)
                if k not in _EVERY or getattr(self.spec, k) is not None]
        fix = (f"widen search.{', search.'.join(dict.fromkeys(keys))}" if keys else
               "the search block already allows every value of these keys; change the "
               "scenario as the reasons say")
        return (f"no layout satisfies the cluster, model and batch; the search dropped {n} "
                f"partial layout{'s' if n != 1 else ''}: {reasons}{more}; {fix}")


def _layout(where: tuple) -> str:
    """`tensor=4 pipeline=2 ...`, without the degrees at their defaults (CP 1, EP 1, no ETP)."""
    return " ".join(f"{k}={v}" for k, v in where
                    if (k, v) not in (("context", 1), ("expert", 1), ("expert_tensor", None)))


def check_chunks(layers: int, schedule: str, pp: int, m: int, v: int) -> None:
    """Raise ScenarioError where the planner skips `schedule` with `v` chunks per stage at
    pipeline `pp` with `m` micro-batches: GPipe and interleaved without a pipeline (1F1B's
    layout), too few layers or too many micro-batches, or `schedule.check_schedule`'s rules."""
    if pp == 1 and schedule != "1f1b":
        raise ScenarioError(f"parallel.schedule: {schedule} at pipeline=1 is 1f1b's layout "
                            "(searched as 1f1b)")
    if layers < pp * v:
        raise ScenarioError(f"model.num_layers: {layers} layers cannot fill pipeline={pp} x "
                            f"virtual_stages={v} = {pp * v} stages")
    if m * v > MAX_MICROBATCHES:
        raise ScenarioError(f"training.global_batch_size: {m:,} micro-batches x {v} virtual "
                            f"stages; at most {MAX_MICROBATCHES:,} are simulated")
    check_schedule(schedule, pp, m, v)


_MOE_SP = ("training.sequence_parallel: an MoE model with tensor > 1 needs sequence parallelism "
           "(Megatron-Core's MoELayer refuses to train without it)")


def sequence_parallel_values(scenario: Scenario, search: SearchSpec, tp: int, cp: int, mb: int,
                             where: tuple, reject: Reject | None) -> tuple[bool, ...]:
    """The `search.sequence_parallel` values a layout of these degrees and micro-batch size `mb`
    runs with: none but false at TP 1; true only where each rank's tokens split evenly over TP
    (`check_sequence_split`); true only for an MoE model at TP > 1 (Megatron-Core's MoELayer);
    under precision fp8, only those whose GEMM operands Transformer Engine takes
    (`model.fp8_shapes.check_fp8_shapes`)."""
    values: tuple[bool, ...] = (False,)
    if tp > 1:
        values = tuple(sp for sp in search.sequence_parallel if not sp or passes(
            reject, (*where, ("sequence_parallel", sp)), check_sequence_split, scenario, tp, cp,
            sp))
    if tp > 1 and scenario.model.num_experts is not None and False in values:
        values = tuple(sp for sp in values if sp)
        if reject is not None:
            reject(_MOE_SP, (*where, ("sequence_parallel", False)))
    if scenario.training.precision != "fp8":
        return values
    return tuple(sp for sp in values if passes(
        reject, (*where, ("sequence_parallel", sp)), check_fp8_shapes, scenario.model,
        replace(scenario.training, micro_batch_size=mb, sequence_parallel=sp), tp, cp))
