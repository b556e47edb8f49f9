"""From a scenario file to everything a policy and the engine need, with every consistency check
(degrees, batch, layers, fabrics, policies) reported against the file's line and field."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from holmes_sim.hardware.catalog import LinkModel, build_catalog, gemm_rate
from holmes_sim.hardware.cluster import ETHERNET, Cluster, Nic, build_cluster
from holmes_sim.hardware.variability import apply_variability
from holmes_sim.collector import quiet_collector
from holmes_sim.cost.compute import ComputeModel, KernelCompute, Profile, load_profile
from holmes_sim.errors import FieldError, ScenarioError
from holmes_sim.policies import POLICIES, PlanRequest
from holmes_sim.schedule import ScheduleKind, check_pipelined, check_schedule
from holmes_sim.spec.load import FIELD_BOUNDS, load_scenario, load_scenario_text
from holmes_sim.spec.scenario import Scenario
from holmes_sim.model.bucket_layout import BUCKET_ELEMENT_BYTES
from holmes_sim.model.checks import check_layout_settings
from holmes_sim.model.pipeline_split import PipelineSplit, megatron_layers_per_stage
from holmes_sim.model.mla import check_mla_context
from holmes_sim.model.workload import Workload, build_workload, expert_ffn_width

MAX_GRADIENT_BUCKETS = 100_000
"""Most gradient buckets a model may fill (`training.bucket_size_mb`), so a run stays bounded."""
MAX_MICROBATCHES = 2**14
"""Most micro-batches per iteration (times the virtual stages) a schedule is built for: each is
an op per stage in every simulation (Megatron-LM runs use at most a few thousand)."""
MAX_NODES = 100_000
MAX_GPUS = 2**17
"""Most nodes and GPUs of all clusters together (each group's `count` is bounded on its own)."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked scenario, resolved into hardware, workload, compute model and degrees."""

    scenario: Scenario
    source: str
    cluster: Cluster
    workload: Workload
    compute: ComputeModel
    tp: int
    pp: int
    dp: int
    num_microbatches: int
    profile: Profile | None
    nominal_cluster: Cluster | None = None
    """The cluster before `scenario.variability` (None: the same as `cluster`)."""
    cp: int = 1
    """Context-parallel degree (`dp` is Megatron's data-parallel degree; a plan's replicas are
    dp x cp, `plan`)."""

    @property
    def profile_path(self) -> Path | None:
        """The scenario's `profile:` file, resolved against the scenario's folder (None
        without one)."""
        given = self.scenario.profile
        return None if given is None else Path(self.source).parent / given

    def request(self, cluster: Cluster | None = None) -> PlanRequest:
        """The PlanRequest for a policy (on `cluster` when the policy views another one)."""
        par = self.scenario.parallel
        return PlanRequest(cluster or self.cluster, self.workload, self.compute, self.tp, self.pp,
                           self.dp * self.cp, ScheduleKind(par.schedule), self.num_microbatches,
                           par.virtual_stages, self.scenario.training.distributed_optimizer,
                           self.scenario.training.overlap_grad_reduce,
                           self.scenario.training.overlap_param_gather, cp=self.cp)


def prepare_text(text: str, source: str = "<scenario>", base_dir: str | Path = ".",
                 profile_override: str | Path | None = None) -> Prepared:
    """Check scenario YAML text (`source` names it in errors; a relative `profile:` is read
    from `base_dir`); see `prepare`."""
    box: list[Prepared] = []
    load_scenario_text(text, source, check=lambda s: box.append(_resolve(s, source, Path(base_dir),
                                                                         profile_override)))
    return box[0]


def prepare(path: str | Path, profile_override: str | Path | None = None,
            check: Callable[[Prepared], object] | None = None) -> Prepared:
    """Load a scenario file and check it.

    Args:
        path: the scenario YAML.
        profile_override: a profile JSON to use instead of the scenario's `profile:`.
        check: a further check of the result (e.g. that a testbed can run it); its `FieldError`
            is reported with the file and line of its path.

    Raises:
        ScenarioError: naming file, line and field.
    """
    path = Path(path)
    box: list[Prepared] = []

    def resolve(s: Scenario) -> None:
        box.append(_resolve(s, str(path), path.parent, profile_override))
        if check is not None:
            check(box[0])

    with quiet_collector():
        load_scenario(path, check=resolve)
    return box[0]


def passes_checks(prepared: Prepared, training: dict | None = None, **parallel: int) -> bool:
    """Whether `prepared`'s scenario with these `training` and `parallel` fields changed (with a
    parallel one, its data degree derived again from the GPU count) passes every check
    `prepare` makes."""
    s = prepared.scenario
    par = replace(s.parallel, data=None, **parallel) if parallel else s.parallel
    changed = replace(s, parallel=par, training=replace(s.training, **(training or {})))
    try:
        with quiet_collector():
            _resolve(changed, prepared.source, Path(prepared.source).parent, None)
    except ScenarioError:
        return False
    return True


def _resolve(s: Scenario, source: str, base_dir: Path, profile_override) -> Prepared:
    _check_size(s)
    cluster = build_cluster(s.clusters, s.fabrics, s.inter_cluster_links, build_catalog(s.catalog))
    check_policies(s)
    _check_search(s)
    profile = _load_profile(s, base_dir, profile_override)
    if profile is not None:
        cluster = apply_link_profile(cluster, profile)
    nominal, cluster = cluster, apply_variability(cluster, s.variability, s.seed)
    workload = build_workload(s.model, s.training, s.parallel.tensor, s.parallel.context,
                              s.parallel.cp_comm_type, s.parallel.expert, s.parallel.expert_tensor)
    _check_buckets(workload)
    _check_precision(s, cluster)
    tp, pp, dp, cp = _degrees(s, cluster)
    check_expert(s, s.parallel.expert, dp * cp, tp=tp, etp=s.parallel.expert_tensor)
    _check_expert_bias(s, tp)
    m = _microbatches(s, dp)
    _check_layers(s, pp)
    _check_overlaps(s, tp, pp)
    _check_schedule_size(m, s.parallel.virtual_stages)
    try:
        check_pipelined(s.parallel.schedule, pp)
        check_schedule(s.parallel.schedule, pp, m, s.parallel.virtual_stages)
    except ScenarioError as exc:
        raise FieldError("parallel.schedule", str(exc)) from None
    compute = profile.compute if profile is not None else KernelCompute()
    return Prepared(s, source, cluster, workload, compute, tp, pp, dp, m, profile,
                    None if nominal is cluster else nominal, cp)


def _check_precision(s: Scenario, cluster: Cluster) -> None:
    """Every GPU model of the cluster has a GEMM rate at the training precision."""
    if s.training.precision == "fp8":
        for gpu in dict.fromkeys(n.gpu for n in cluster.nodes):
            gemm_rate(gpu, fp8=True)


_SEARCH_DEFAULTS = {"context": "the scenario's own value", "expert": "the scenario's own value",
                    "expert_tensor": "1 and each layout's TP degree"}
"""What a `search:` key searches when it is left out, where that is not every valid value."""


def _check_search(s: Scenario) -> None:
    """Every list of the `search:` block non-empty, its policies known (`plan` also checks its
    values, `check_search_values`)."""
    search = s.search
    for name in search.__dataclass_fields__:
        if getattr(search, name) == ():
            default = _SEARCH_DEFAULTS.get(name, "every valid value")
            raise FieldError(f"search.{name}", f"list at least one value, or remove the key to "
                                               f"search {default}")
    for i, name in enumerate(search.policies):
        if name not in POLICIES:
            raise FieldError(f"search.policies[{i}]", f"unknown policy '{name}' (known: "
                                                      f"{', '.join(POLICIES)})")


def check_search_values(s: Scenario) -> None:
    """Refuse a value of `search.tensor`, `pipeline`, `context`, `expert`, `expert_tensor` or
    `micro_batch_size` (`plan`, before its search: no other command reads them) that the
    planner would drop from every layout, whatever the other values: its own checks, with the
    others where they ask least of it (TP, PP and data parallelism 1, every GPU a replica; for
    an expert TP degree, TP equal to it and EP 1)."""
    nodes = tuple({g.gpus_per_node for c in s.clusters for g in c.nodes})
    gpus = sum(g.count * g.gpus_per_node for c in s.clusters for g in c.nodes)
    checks: dict[str, Callable[[int], object]] = {
        "tensor": lambda v: check_tensor(s, v, nodes),
        "pipeline": lambda v: check_pipeline(s, v, gpus),
        "context": lambda v: check_context_in(s, v, 1, 1, gpus),
        "expert": lambda v: check_expert(s, v, gpus),
        "micro_batch_size": lambda v: check_micro_batch(s, v),
    }
    if s.model.num_experts is not None:  # a dense model's search leaves expert_tensor unused
        checks["expert_tensor"] = lambda v: (check_tensor(s, v, nodes, "expert_tensor"),
                                             check_expert_tensor(s, 1, 1, v, v))
    for key, check in checks.items():
        for i, value in enumerate(getattr(s.search, key) or ()):
            try:
                check(value)
            except FieldError as exc:
                fix = "" if exc.path.startswith("parallel.") else f" or change {exc.path}"
                raise FieldError(f"search.{key}[{i}]", f"{key}={value} fits no layout of this "
                                 f"scenario, whatever the other values ({exc.path}: "
                                 f"{exc.message}); remove {value} from search.{key}{fix}") from None


def check_tensor(s: Scenario, tp: int, node_gpus: tuple[int, ...], what: str = "tensor") -> int:
    """Check TP degree `tp` against the model's heads and query groups and each of the
    `node_gpus` (the GPU counts of the nodes): TP stays inside a node; returns it. `what` names
    the degree in the message."""
    groups = s.model.num_query_groups or s.model.num_attention_heads
    for count, name in ((s.model.num_attention_heads, "model.num_attention_heads"),
                        (groups, "model.num_query_groups"), *((g, "GPUs per node") for g in node_gpus)):
        if count % tp:
            inside = "" if what == "tensor" else ", as the tensor degree it divides must"
            raise FieldError("parallel.tensor", f"{what}={tp} must divide {name}={count}{inside}: "
                             "each TP rank holds an equal share of the heads and query groups, and "
                             f"a TP group stays inside a node; {_tensor_choices(s, node_gpus)}")
    for width, name in _tp_widths(s):
        if width % tp:
            raise FieldError("parallel.tensor", f"{what}={tp} must divide {name}={width}: each "
                             "TP rank holds width / tensor of that MLP (Megatron-Core's "
                             "tensor-parallel linear layers divide it when the model is built); "
                             f"{_tensor_choices(s, node_gpus)}")
    return tp


def _tensor_choices(s: Scenario, node_gpus: tuple[int, ...]) -> str:
    """The TP degrees every rule of `check_tensor` allows, as a fix."""
    common = math.gcd(s.model.num_attention_heads, s.model.num_query_groups or 0, *node_gpus,
                      *(width for width, _ in _tp_widths(s)))
    degrees = [d for d in range(1, common + 1) if common % d == 0]
    return "use " + (f"one of {', '.join(map(str, degrees))}" if len(degrees) > 1 else "1") + \
        " (the degrees that divide the heads, query groups, MLP widths and GPUs per node)"


def _tp_widths(s: Scenario) -> list[tuple[int, str]]:
    """The given MLP widths that tensor parallelism splits: the dense FFN where a layer has a
    dense MLP, and the MoE shared expert (which takes the TP degree, not the experts')."""
    m = s.model
    freq = m.moe_layer_freq
    dense = m.num_experts is None or (0 in freq if isinstance(freq, tuple) else freq != 1)
    widths = [(m.ffn_hidden_size, "model.ffn_hidden_size")] if m.ffn_hidden_size and dense else []
    if m.num_experts is not None and m.moe_shared_expert_intermediate_size:
        widths.append((m.moe_shared_expert_intermediate_size,
                       "model.moe_shared_expert_intermediate_size"))
    return widths


def check_pipeline(s: Scenario, pp: int, gpus: int, tp: int = 1) -> int:
    """Check PP degree `pp` at TP `tp` on `gpus` GPUs: tensor x pipeline divides them and each
    stage gets a layer; returns it."""
    if gpus % (tp * pp):
        raise FieldError("parallel.pipeline", f"tensor={tp} x pipeline={pp} = {tp * pp} does not "
                         f"divide the {gpus} GPUs of the clusters; "
                         f"{_pipeline_choices(gpus, tp, s.model.num_layers)}")
    if s.model.num_layers < pp:
        raise FieldError("parallel.pipeline", f"pipeline={pp} stages cannot each hold one of "
                         f"the model.num_layers={s.model.num_layers} layers; lower the pipeline "
                         "degree or add layers")
    return pp


def _pipeline_choices(gpus: int, tp: int, layers: int, shown: int = 12) -> str:
    """The pipeline degrees that divide the `gpus` / `tp` tensor groups and give each stage one
    of the `layers` at least, as a fix: the first `shown` of them."""
    groups = gpus // tp
    degrees = [d for d in range(1, min(groups, layers) + 1) if groups % d == 0]
    listed = ", ".join(map(str, degrees[:shown])) + (", ..." if len(degrees) > shown else "")
    use = f"use one of {listed}" if len(degrees) > 1 else "use pipeline=1"
    return f"{use} (the degrees that divide {gpus} GPUs / tensor={tp} = {groups})"


def check_context_in(s: Scenario, cp: int, tp: int, pp: int, gpus: int) -> int:
    """`check_context`, and tensor x pipeline x context dividing the `gpus`; returns cp."""
    if gpus // (tp * pp) % cp:
        raise FieldError("parallel.context", f"tensor={tp} x pipeline={pp} x context={cp} = "
                         f"{tp * pp * cp} does not divide the {gpus} GPUs of the clusters; use a "
                         f"context degree that divides {gpus // (tp * pp)}")
    return check_context(s, cp, tp)


def check_micro_batch(s: Scenario, mb: int, dp: int = 1) -> int:
    """Check micro-batch size `mb` at data-parallel degree `dp`: their product divides the
    global batch; returns the micro-batches per iteration."""
    batch = s.training.global_batch_size
    if batch % (mb * dp):
        raise FieldError("training.global_batch_size", f"micro_batch_size={mb} x data={dp} = "
                         f"{mb * dp} does not divide training.global_batch_size={batch}")
    return batch // (mb * dp)


def check_policies(s: Scenario) -> None:
    """FieldError unless `s.policies` lists at least one policy, each known and once."""
    if not s.policies:
        raise FieldError("policies", f"list at least one policy (known: {', '.join(POLICIES)})")
    for i, name in enumerate(s.policies):
        if name not in POLICIES:
            raise FieldError(f"policies[{i}]", f"unknown policy '{name}' (known: "
                                               f"{', '.join(POLICIES)})")
        if s.policies.index(name) != i:
            raise FieldError(f"policies[{i}]", f"policy '{name}' is listed twice; keep one")


def _degrees(s: Scenario, cluster: Cluster) -> tuple[int, int, int, int]:
    """The scenario's (tensor, pipeline, data, context) degrees, checked as the planner checks
    each layout (`check_tensor`, `check_pipeline`, `check_context_in`)."""
    par, n = s.parallel, cluster.num_gpus
    tp = check_tensor(s, par.tensor, tuple(dict.fromkeys(node.num_gpus for node in cluster.nodes)))
    pp = check_pipeline(s, par.pipeline, n, tp)
    cp = check_context_in(s, par.context, tp, pp, n)
    check_sequence_split(s, tp, cp, s.training.sequence_parallel)
    check_layout_settings(s, tp, cp)
    dp = n // (tp * pp * cp)
    if par.data is not None and par.data != dp:
        raise FieldError("parallel.data", f"tensor={tp} x pipeline={pp} x context={cp} x "
                         f"data={par.data} = {tp * pp * cp * par.data}, but the clusters have {n} "
                         f"GPUs; set data: {dp} or remove it")
    return tp, pp, dp, cp


def check_expert(s: Scenario, ep: int, replicas: int, field: str = "parallel.expert", tp: int = 1,
                 etp: int | None = None) -> int:
    """Check expert-parallel degree `ep` against the model and the `replicas` (data x context)
    as Megatron-Core does (`TransformerConfig.__post_init__`, `initialize_model_parallel`):
    an MoE model, ep dividing num_experts and the data x context ranks; with the experts' TP
    degree `etp` (`check_expert_tensor`) ep x etp dividing tensor x context x data."""
    if etp is not None:
        return check_expert_tensor(s, ep, replicas, tp, etp)
    _check_expert_width_at_tensor(s, tp)
    if ep == 1:
        return ep
    experts = s.model.num_experts
    if experts is None:
        raise FieldError(field, f"expert={ep} needs an MoE model (model.num_experts); use "
                         "expert: 1 or an MoE model")
    if experts % ep:
        raise FieldError(field, f"expert={ep} must divide model.num_experts={experts}: each EP "
                         f"rank holds num_experts / expert experts; use a divisor of {experts}")
    if replicas % ep:
        raise FieldError(field, f"expert={ep} must divide data x context = {replicas}: an EP "
                         f"group is `expert` consecutive data-parallel replicas (Megatron-Core "
                         f"`RankGenerator`); use a divisor of {replicas}")
    return ep


def _check_expert_width_at_tensor(s: Scenario, tp: int) -> None:
    """Without `parallel.expert_tensor` the experts take the TP degree (Megatron-Core's
    `expert_tensor_parallel_size` defaults to `tensor_model_parallel_size`), which must then
    divide their FFN width as `check_expert_tensor` requires of an explicit one."""
    if s.model.num_experts is None:
        return
    width = expert_ffn_width(s.model)
    if width % tp:
        raise FieldError("parallel.tensor", f"tensor={tp} must divide the experts' FFN width "
                         f"{width} (model.moe_ffn_hidden_size): without parallel.expert_tensor the "
                         "experts take the tensor degree and each rank holds width / tensor of "
                         "them; use a tensor degree that divides it, or set "
                         "parallel.expert_tensor to a divisor of it")


def check_expert_tensor(s: Scenario, ep: int, replicas: int, tp: int, etp: int,
                        field: str = "parallel.expert_tensor") -> int:
    """Check the experts' TP degree `etp` (`ParallelSpec.expert_tensor`) and `ep` with it: an
    MoE model, etp dividing the expert FFN width (`TEGroupedMLP` splits it over ETP), Megatron-Core's
    grid rule tp x cp x dp = etp x ep x edp per pipeline stage (`initialize_model_parallel`:
    the expert `RankGenerator` over the same ranks), and holmes-sim's own limit: etp divides tp
    and tp divides ep x etp, so each expert-TP group lies in a TP group and an EP group spans
    whole TP groups. Returns ep."""
    experts = s.model.num_experts
    if experts is None:
        raise FieldError(field, f"expert_tensor={etp} needs an MoE model (model.num_experts); "
                         "remove it for a dense model")
    check_expert_bias(s, etp, field)
    width = expert_ffn_width(s.model)
    if width % etp:
        raise FieldError(field, f"expert_tensor={etp} must divide the experts' FFN width {width} "
                         "(model.moe_ffn_hidden_size): each expert-TP rank holds width / "
                         "expert_tensor of it; use a divisor of it")
    if tp % etp:
        raise FieldError(field, f"expert_tensor={etp} must divide tensor={tp}: holmes-sim keeps "
                         f"each expert-TP group inside a TP group; use 1 or a divisor of {tp}")
    if experts % ep:
        raise FieldError("parallel.expert", f"expert={ep} must divide model.num_experts="
                         f"{experts}: each EP rank holds num_experts / expert experts")
    if ep * etp % tp:
        raise FieldError(field, f"expert={ep} x expert_tensor={etp} must be a multiple of "
                         f"tensor={tp}: holmes-sim builds EP groups of whole TP groups; raise "
                         f"parallel.expert to a multiple of {tp // etp} or expert_tensor to {tp}")
    if tp * replicas % (ep * etp):
        raise FieldError(field, f"expert={ep} x expert_tensor={etp} = {ep * etp} must divide "
                         f"tensor x context x data = {tp * replicas}, a pipeline stage's ranks "
                         "(Megatron-Core `initialize_model_parallel`: tp x cp x dp = etp x ep x "
                         "edp); lower expert or expert_tensor")
    return ep


def check_expert_bias(s: Scenario, etp: int, field: str = "parallel.expert_tensor") -> None:
    """An MoE model with biases (`model.bias`, on by default) only at expert TP degree `etp` 1:
    Megatron-Core's `TransformerConfig.__post_init__` asserts "Bias in Moe is only supported
    when ETP==1" (megatron/core/transformer/transformer_config.py since a329dd6, 2025-09; before
    it refused biased MoE at any degree)."""
    if s.model.num_experts is not None and s.model.bias and etp > 1:
        raise FieldError(field, f"expert_tensor={etp}: Megatron-Core splits no expert with "
                         "biases over tensor ranks (model.bias is on); set model.bias: false, "
                         "or parallel.expert_tensor: 1 with parallel.expert a multiple of "
                         "tensor")


def _check_expert_bias(s: Scenario, tp: int) -> None:
    """`check_expert_bias` where `parallel.expert_tensor` is unset: the experts then take the
    TP degree (Megatron-LM's default), which `parallel.tensor` sets."""
    if s.parallel.expert_tensor is None:
        check_expert_bias(s, tp, "parallel.tensor")


def check_context(s: Scenario, cp: int, tp: int) -> int:
    """Check context-parallel degree `cp` against the model and training (Megatron-Core's own
    conditions); returns it."""
    if cp == 1:
        return cp
    check_mla_context(s.model, cp)
    seq = s.model.seq_length
    if seq % (2 * cp):
        raise FieldError("parallel.context", f"model.seq_length={seq} must be a multiple of 2 x "
                         f"context = {2 * cp}: each CP rank holds two load-balanced causal chunks "
                         f"of seq_length / (2 x context) tokens (Megatron-Core "
                         f"`get_batch_on_this_cp_rank`); change context or seq_length")
    if not s.training.flash_attention:
        raise FieldError("training.flash_attention", f"context={cp} runs only in Transformer "
                         "Engine's fused attention (Megatron-Core `TEDotProductAttention`); set "
                         "flash_attention: true or parallel.context: 1")
    groups = s.model.num_query_groups or s.model.num_attention_heads
    if s.parallel.cp_comm_type == "a2a" and (s.model.num_attention_heads // tp % cp or
                                             groups // tp % cp):
        raise FieldError("parallel.cp_comm_type", f"a2a splits each TP rank's heads over the "
                         f"CP group: context={cp} must divide num_attention_heads / tensor = "
                         f"{s.model.num_attention_heads // tp} and the query groups / tensor = "
                         f"{groups // tp}; use cp_comm_type: p2p or a smaller context")
    return cp


def check_sequence_split(s: Scenario, tp: int, cp: int, sp: bool) -> None:
    """With sequence parallelism (`sp`) at TP `tp` > 1, each CP rank's seq_length / `cp` tokens
    split evenly over the TP ranks: Megatron-Core's `_split_along_first_dim`
    (megatron/core/tensor_parallel/mappings.py), which scatters the embedding output, asserts
    "First dimension of the tensor should be divisible by tensor parallel size"."""
    tokens = s.model.seq_length // cp
    if sp and tp > 1 and tokens % tp:
        per_rank = f" / context={cp} = {tokens}" if cp > 1 else ""
        raise FieldError("training.sequence_parallel", f"model.seq_length={s.model.seq_length}"
                         f"{per_rank} tokens are not a multiple of tensor={tp}: sequence "
                         "parallelism splits them over the TP ranks (Megatron-Core "
                         "`_split_along_first_dim` asserts an even split); "
                         f"{_sp_off(s)}a seq_length that is a multiple of "
                         f"{cp * math.lcm(tp, 2 if cp > 1 else 1)}, or another tensor degree")


def _sp_off(s: Scenario) -> str:
    """'set sequence_parallel: false, or ' where the model may run without it (an MoE model at
    TP > 1 may not: Megatron-Core's MoELayer), else 'use '."""
    return "use " if s.model.num_experts is not None else "set sequence_parallel: false, or "


def _microbatches(s: Scenario, dp: int) -> int:
    t = s.training
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise FieldError("training.global_batch_size",
                         f"{t.global_batch_size} is not a multiple of micro_batch_size="
                         f"{t.micro_batch_size} x data-parallel degree {dp} = {per_step}; use "
                         f"e.g. {max(1, t.global_batch_size // per_step) * per_step}")
    return t.global_batch_size // per_step


def _check_schedule_size(m: int, chunks: int) -> None:
    if m * chunks > MAX_MICROBATCHES:
        raise FieldError("training.global_batch_size", f"{m:,} micro-batches per iteration"
                         f"{f' x {chunks} virtual stages' if chunks > 1 else ''}; at most "
                         f"{MAX_MICROBATCHES:,} are simulated; raise training.micro_batch_size "
                         "or lower training.global_batch_size")


def _check_size(s: Scenario) -> None:
    groups = [g for c in s.clusters for g in c.nodes]
    nodes, gpus = sum(g.count for g in groups), sum(g.count * g.gpus_per_node for g in groups)
    if nodes > MAX_NODES or gpus > MAX_GPUS:
        raise FieldError("clusters", f"{nodes:,} nodes with {gpus:,} GPUs in all; at most "
                                     f"{MAX_NODES:,} nodes and {MAX_GPUS:,} GPUs are simulated")


def _check_buckets(workload: Workload) -> None:
    """At most MAX_GRADIENT_BUCKETS gradient buckets; the error blames the bucket size where the
    scenario sets it, else the model's size."""
    # `bucket_size_mb` counts fp32 elements (`model.bucket_layout`), whatever the gradient dtype
    buckets = workload.total_params * BUCKET_ELEMENT_BYTES / workload.bucket_bytes
    if buckets <= MAX_GRADIENT_BUCKETS:
        return
    least_mb = math.ceil(workload.total_params * BUCKET_ELEMENT_BYTES / MAX_GRADIENT_BUCKETS / 1e6)
    limit = f"(at most {MAX_GRADIENT_BUCKETS:,} are simulated)"
    if workload.bucket_size_given:
        raise FieldError("training.bucket_size_mb", f"the gradients would fill {buckets:.3g} "
                         f"buckets {limit}; raise it to at least {least_mb:,}")
    settable = least_mb <= FIELD_BOUNDS["bucket_size_mb"].high
    raise FieldError("model", f"its {workload.total_params:.3g} parameters would fill "
                     f"{buckets:.3g} gradient buckets of the default "
                     f"{workload.bucket_bytes / 1e6:g} MB {limit}; check num_layers, hidden_size "
                     "and num_experts" + (f", or set training.bucket_size_mb to at least "
                                          f"{least_mb:,}" if settable else ""))


def _check_overlaps(s: Scenario, tp: int, pp: int) -> None:
    """The Megatron-LM overlap and split flags only in the combinations Megatron-LM accepts."""
    t, schedule = s.training, s.parallel.schedule
    if t.overlap_param_gather and not (t.distributed_optimizer and t.overlap_grad_reduce):
        raise FieldError("training.overlap_param_gather", "needs training.distributed_optimizer: "
                         "true and training.overlap_grad_reduce: true (as Megatron-LM requires)")
    if t.tp_comm_overlap and (tp == 1 or not t.sequence_parallel):
        raise FieldError("training.tp_comm_overlap", "Transformer Engine's TP overlap needs "
                         "parallel.tensor > 1 and training.sequence_parallel: true")
    if s.model.num_experts is not None and tp > 1 and not t.sequence_parallel:
        raise FieldError("training.sequence_parallel", "an MoE model with parallel.tensor > 1 "
                         "needs sequence_parallel: true (Megatron-Core's MoELayer refuses to "
                         "train without it)")
    if t.tp_comm_overlap and t.async_tensor_model_parallel_allreduce:
        raise FieldError("training.async_tensor_model_parallel_allreduce",
                         "set it or training.tp_comm_overlap (which overlaps every TP "
                         "collective), not both")
    if t.overlap_p2p_comm and schedule != "interleaved":
        raise FieldError("training.overlap_p2p_comm", f"applies to the interleaved schedule "
                         f"only (parallel.schedule is {schedule}); remove it or use interleaved")
    if t.defer_embedding_wgrad_compute and pp == 1:
        raise FieldError("training.defer_embedding_wgrad_compute", "needs parallel.pipeline > 1 "
                         "(there is no pipeline flush to hide it in)")
    split = PipelineSplit.of(t)
    if split.is_set:
        megatron_layers_per_stage(s.model.num_layers, pp, s.parallel.virtual_stages, split)


def _check_layers(s: Scenario, pp: int) -> None:
    stages = pp * s.parallel.virtual_stages
    if s.model.num_layers < stages:
        raise FieldError("model.num_layers", f"{s.model.num_layers} layers cannot fill pipeline="
                         f"{pp} x virtual_stages={s.parallel.virtual_stages} = {stages} stages; "
                         "lower parallel.pipeline or add layers")


def _load_profile(s: Scenario, base_dir: Path, override) -> Profile | None:
    if override is not None:
        return load_profile(override)
    if s.profile is None:
        return None
    path = base_dir / s.profile
    if not path.exists():
        raise FieldError("profile", f"no file {path}; run `holmes-sim validate --real` to write "
                                    "one, or remove `profile:`")
    return load_profile(path)


def apply_link_profile(cluster: Cluster, profile: Profile) -> Cluster:
    """Replace each profiled fabric's NIC numbers by the measured achieved rate and latency, and
    every node's intra-node link by the measured one (`intra_node`, when the profile has it)."""
    nodes = []
    intra = profile.raw.get("intra_node")
    for node in cluster.nodes:
        nics = tuple(_profiled_nic(n, profile.fabrics.get(n.fabric)) for n in node.nics)
        link = node.intra_link if intra is None else _profiled_link(node.intra_link, intra)
        nodes.append(replace(node, nics=nics, intra_link=link))
    # Uplinks are Ethernet too: they achieve the fraction of their shaped rate the NICs do.
    eth = profile.fabrics.get(ETHERNET) or {}
    uplinks = tuple(replace(u, bandwidth_bytes_per_s=_achieved(u.bandwidth_bytes_per_s, eth))
                    for u in cluster.uplinks) if eth.get("line_rate_bytes_per_s") else cluster.uplinks
    return cluster.with_nodes(tuple(nodes), uplinks=uplinks)


def _achieved(line_rate: float, measured: dict) -> float:
    """What a link of `line_rate` (bytes/s) achieves on a measured fabric: the probe's rate
    times line_rate / the probed pair's line rate (`line_rate_bytes_per_s`, an emulated
    testbed's; every link is shaped by the same token bucket at its own rate), or the probe's
    rate itself when the profile does not say what it ran against."""
    rate, probed = measured["bandwidth_bytes_per_s"], measured.get("line_rate_bytes_per_s")
    return rate * (line_rate / probed) if probed else rate


def _profiled_link(link: LinkModel, measured: dict) -> LinkModel:
    return LinkModel(f"{link.name} (measured)", measured["bandwidth_bytes_per_s"],
                     measured["latency_s"], 1.0, "calibration", measured.get("collective_step_s"),
                     link.nvls_efficiency, link.pcie)


def _profiled_nic(nic: Nic, measured: dict | None) -> Nic:
    if measured is None:
        return nic
    return replace(nic, bandwidth_bytes_per_s=_achieved(nic.bandwidth_bytes_per_s, measured),
                   efficiency=1.0, latency_s=measured["latency_s"],
                   collective_latency_s=measured.get("collective_step_s"))
