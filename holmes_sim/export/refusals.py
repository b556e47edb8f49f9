"""Which plans get no launch files, and why: a framework whose launch the export does not write
(Megatron-LLaMA, Megatron-DeepSpeed), a schedule Megatron-LM lacks (GPipe) or refuses
(interleaving at pipeline 2 with blocking p2p), or a model it cannot build."""

from __future__ import annotations

from holmes_sim.errors import ScenarioError
from holmes_sim.model.workload import Workload
from holmes_sim.plan import OptimizerMode, Plan
from holmes_sim.policies import get_policy
from holmes_sim.policies.megatron import MegatronPolicy
from holmes_sim.schedule import ScheduleKind, check_megatron_interleaving


def plan_launch_refusal(plan: Plan, workload: Workload) -> str | None:
    """Why `plan` gets no launch files: its framework has none here (`framework_refusal`), or
    Megatron-LM would not run it (`launch_refusal`); None if it gets them."""
    return framework_refusal(plan) or launch_refusal(plan.schedule_kind, plan.pp, workload)


_OURS = ("the export writes arguments for upstream Megatron-LM and the Holmes fork (policies "
         "megatron and holmes), not for ")
MEGATRON_LLAMA_REFUSAL = (
    _OURS + "Megatron-LLaMA: upstream Megatron-LM refuses its --overlapped-distributed-optimizer, "
    "and its own 2023 arguments.py lacks Megatron-Core flags the export writes for many plans "
    "(--normalization, --position-embedding-type, --group-query-attention, --overlap-grad-reduce)")
MEGATRON_DEEPSPEED_REFUSAL = (
    _OURS + "Megatron-DeepSpeed: its ZeRO-1 run needs --deepspeed with a DeepSpeed configuration "
    "file (--deepspeed_config: ZeRO stage, batch sizes), which upstream Megatron-LM lacks and the "
    "export does not write, and its arguments.py lacks Megatron-Core flags the export writes for "
    "many plans (--position-embedding-type, --group-query-attention, --overlap-grad-reduce)")


def policy_launch_refusal(name: str) -> str | None:
    """`framework_refusal` of every plan of the policy registered as `name`, or None."""
    policy = get_policy(name)
    if isinstance(policy, MegatronPolicy) and policy.llama_release is not None:
        return MEGATRON_LLAMA_REFUSAL
    if isinstance(policy, MegatronPolicy) and policy.optimizer is OptimizerMode.ZERO1:
        return MEGATRON_DEEPSPEED_REFUSAL
    return None


def framework_refusal(plan: Plan) -> str | None:
    """Why the export writes no launch for the plan's framework, or None: it writes arguments
    of upstream Megatron-LM and the Holmes fork, not of Megatron-LLaMA (its own optimizer flag
    and 2023 parser) or Megatron-DeepSpeed (its DeepSpeed configuration and parser)."""
    if plan.optimizer.is_megatron_llama:
        return MEGATRON_LLAMA_REFUSAL
    if plan.optimizer is OptimizerMode.ZERO1:
        return MEGATRON_DEEPSPEED_REFUSAL
    return None


GPIPE_REFUSAL = (
    "Megatron-LM has no GPipe schedule (get_forward_backward_func, "
    "megatron/core/pipeline_parallel/schedules.py, runs no pipelining, 1F1B or interleaved), "
    "so its launch would train another schedule than the one simulated; plan with schedule "
    "1f1b or interleaved")


def launch_refusal(schedule: str, pp: int, workload: Workload) -> str | None:
    """Why Megatron-LM would not run the pipeline schedule (GPipe, which it lacks, or
    `schedule.check_megatron_interleaving`) or the model (`model_launch_refusal`), or None."""
    if ScheduleKind(schedule) is ScheduleKind.GPIPE:
        return GPIPE_REFUSAL
    try:
        check_megatron_interleaving(schedule, pp, workload.overlap_p2p_comm)
    except ScenarioError as exc:
        return str(exc)
    return model_launch_refusal(workload)


def model_launch_refusal(workload: Workload) -> str | None:
    """Why Megatron-LM cannot build the simulated model, whatever the layout, or None: biases
    without the QKV bias, which `validate_args` turns back on with `--add-bias-linear` (since
    d28e26e, 2024-10; Megatron-LM has no flag that drops it alone)."""
    if workload.bias and not workload.qkv_bias:
        return ("Megatron-LM cannot drop the QKV bias alone (with model.bias on, validate_args "
                "adds it back); set model.qkv_bias: true, or model.bias: false with qkv_bias: "
                "false")
    return None
