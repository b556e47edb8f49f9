"""The testbed a scenario describes: whether the backend and the testbed can run it (every
refusal a FieldError naming the scenario field), its emulated nodes and uplinks, the backend's
model, the policies that run on it, and each plan group's transport settings."""

from __future__ import annotations

import math
from dataclasses import dataclass

from holmes_sim.errors import FieldError, ScenarioError
from holmes_sim.hardware.cluster import ETHERNET
from holmes_sim.plan import Plan
from holmes_sim.policies import get_policy
from holmes_sim.prepare import Prepared
from holmes_sim.spec.scenario import MIN_LINK_PROBE_BYTES


def runnable_policies(prepared: Prepared, policies: list[str] | None) -> list[str]:
    """`policies` (default: the scenario's), or a ScenarioError naming one that assumes other
    hardware than the testbed has."""
    names = policies or list(prepared.scenario.policies)
    for name in names:
        policy = get_policy(name)
        if policy.cluster_view(prepared.cluster) is not prepared.cluster:
            raise ScenarioError(f"policy '{name}' assumes other hardware than the testbed has "
                                "(a reference); it can be simulated but not run; remove it from "
                                "--policy or the testbed's policies")
    return names


def model_config(prepared: Prepared):
    """The backend GPT of the scenario's model, or a ScenarioError naming what cannot run."""
    from holmes_sim.backend.model import GPTConfig

    check_backend(prepared)
    s, w = prepared.scenario, prepared.workload
    moe = {} if w.moe is None else {"num_experts": w.moe.experts, "moe_topk": w.moe.topk,
                                    "moe_ffn": w.moe.ffn}
    return GPTConfig(n_layer=w.num_layers, n_head=w.heads, n_embd=w.hidden, block_size=w.seq,
                     vocab_size=w.vocab, seed=1234 + s.seed, **moe)


def check_backend(prepared: Prepared) -> None:
    """A FieldError naming what the real-run backend cannot run (no torch import)."""
    s, w = prepared.scenario, prepared.workload
    if s.training.precision != "fp32" or w.grad_bytes != 4:
        raise FieldError("training.precision", "the CPU backend trains in fp32; set precision: fp32 "
                                               "and grad_reduce_in_fp32: true so predicted message "
                                               "sizes match")
    if w.tie_embeddings:
        raise FieldError("model.tie_embeddings", "the backend's GPT has an untied head; set "
                                                 "tie_embeddings: false")
    if prepared.nominal_cluster is not None:
        raise FieldError("variability", "the testbed runs every rank at one speed and shapes "
                                        "links at their declared rates; remove it for a real run")
    if prepared.cp > 1:
        raise FieldError("parallel.context", "the real-run backend has no context parallelism "
                                             "(no ring attention); set context: 1")
    if s.training.cross_entropy_loss_fusion:
        raise FieldError("training.cross_entropy_loss_fusion", "the backend runs its own unfused "
                                                               "vocab-parallel cross entropy; set "
                                                               "cross_entropy_loss_fusion: false")
    _check_gpt_architecture(s.model)
    if w.moe is not None:
        _check_moe(prepared)


def _check_moe(prepared: Prepared) -> None:
    """The backend's MoE layer (`backend/moe.py`): every layer MoE, no shared expert, dropless,
    balanced round-robin routing (`moe_routing: even`, M k divisible by E), and no tensor
    parallelism (so no expert tensor parallelism either). Expert-data-parallel groups
    (dp > expert) run: the backend reduces the routed experts' gradients over them
    (`backend/data_parallel.py`)."""
    model, w = prepared.scenario.model, prepared.workload
    fixed = {"moe_layer_freq": (1, "1 (every layer MoE)"),
             "moe_shared_expert_intermediate_size": (None, "no shared expert"),
             "moe_expert_capacity_factor": (None, "dropless routing"),
             "moe_expert_imbalance": (1.0, "1 (the backend routes every expert the same tokens)"),
             "moe_routing": ("even", "even (the backend routes round-robin)")}
    for field, (allowed, what) in fixed.items():
        value = getattr(model, field)
        if value != allowed and not (field == "moe_layer_freq" and set(w.moe.pattern) == {1}):
            raise FieldError(f"model.{field}", f"the backend's MoE layer needs {what}; got "
                                               f"{value}")
    if prepared.tp > 1:
        raise FieldError("parallel.tensor", "the backend runs MoE layers with tensor: 1 only "
                                            "(no sequence parallelism)")
    tokens = w.micro_batch * w.seq
    if tokens * w.moe.topk % w.moe.experts:
        raise FieldError("training.micro_batch_size", f"balanced routing sends micro_batch_size x "
                         f"seq_length x moe_router_topk = {tokens * w.moe.topk} token copies; "
                         f"make it a multiple of num_experts={w.moe.experts}")


def _check_gpt_architecture(model) -> None:
    """The backend's GPT is multi-head (no latent attention), GeLU, LayerNorm, with biases and a
    learned position table."""
    gpt = {"multi_latent_attention": (False,), "num_query_groups": (None, model.num_attention_heads), "swiglu": (False,),
           "squared_relu": (False,), "normalization": ("layernorm",), "bias": (True,),
           "position_embedding": ("learned",)}
    for field, allowed in gpt.items():
        if getattr(model, field) not in allowed:
            raise FieldError(f"model.{field}", f"the backend's GPT cannot run {field}="
                             f"{getattr(model, field)}; remove it (or the preset) for a real run")


def testbed_nodes(prepared: Prepared):
    """One emulated node per scenario node, one shaped NIC per scenario NIC (line rate). With
    two clusters, each cluster's Ethernet NICs plug into a segment of its own (the uplink joins
    them, `testbed_uplinks`)."""
    from holmes_sim.backend.topology import TestbedNic, TestbedNode

    split = bool(prepared.cluster.uplinks)
    return [TestbedNode(n.name, tuple(TestbedNic(
        nic.name, nic.fabric, nic.bandwidth_bytes_per_s * 8,
        n.cluster if split and nic.fabric == ETHERNET else "") for nic in n.nics))
            for n in prepared.cluster.nodes]


def testbed_uplinks(prepared: Prepared):
    """The scenario's inter-cluster link as a shaped uplink between the clusters' Ethernet
    segments (check_testbed allows at most one)."""
    from holmes_sim.backend.topology import TestbedUplink

    return [TestbedUplink(ETHERNET, u.clusters, u.bandwidth_bytes_per_s * 8)
            for u in prepared.cluster.uplinks]


def check_testbed(prepared: Prepared) -> None:
    """Everything the testbed would refuse, as a FieldError naming the scenario field, before
    anything is built: names and interface names the kernel takes, rates tc can shape, at most
    254 nodes, one NIC per fabric on each node, two nodes on every fabric (link calibration
    measures between two)."""
    from holmes_sim.backend import topology as tbmod

    check_backend(prepared)
    nodes = prepared.cluster.nodes
    links = prepared.scenario.inter_cluster_links
    limits, slowest = rate_limits(prepared), _slowest_rate(prepared)
    if len(links) > 1:
        raise FieldError("inter_cluster_links", f"{len(links)} inter-cluster links; the testbed "
                         "joins at most two clusters (one uplink: more would loop the bridges)")
    for i, link in enumerate(links):
        if link.latency_us != 0:
            raise FieldError(f"inter_cluster_links[{i}].latency_us", "the testbed cannot add "
                             "latency (its shapers set rates only; no netem); set latency_us: 0")
        if not 0 < link.bandwidth_gbit_per_s * 1e9 <= tbmod.MAX_RATE_BIT_PER_S:
            raise FieldError(f"inter_cluster_links[{i}].bandwidth_gbit_per_s",
                             "cannot be shaped on the testbed")
        _check_rate_carries(link.bandwidth_gbit_per_s * 1e9, limits, slowest,
                            f"inter_cluster_links[{i}].bandwidth_gbit_per_s")
    if len(nodes) > tbmod.MAX_NODES:
        raise FieldError("clusters", f"{len(nodes)} nodes; the testbed emulates at most "
                                     f"{tbmod.MAX_NODES} (one address each in a /24)")
    _check_rank_count(prepared.cluster.num_gpus)
    _check_memory(prepared)
    fabrics = list(dict.fromkeys(nic.fabric for n in nodes for nic in n.nics))
    if len(fabrics) > tbmod.MAX_FABRICS:
        raise FieldError("fabrics", f"{len(fabrics)} fabrics; the testbed has at most "
                                    f"{tbmod.MAX_FABRICS}")
    on_fabric: dict[str, list[tuple[str, str]]] = {}
    for i, (node, name_path, nic_paths) in enumerate(zip(nodes, *_node_paths(prepared), strict=True)):
        problem = tbmod.name_problem(node.name)
        if problem is not None:
            raise FieldError(name_path, f"node name '{node.name}' ({len(node.name)} characters) "
                                        f"cannot name a testbed node: it {problem}")
        if len(nic_paths) != len(node.nics):  # NICs split by `gpus`: name the group's list
            nic_paths = [name_path.rsplit(".", 1)[0] + ".nics"] * len(node.nics)
        _check_one_nic_per_fabric(node, nic_paths)
        for nic, nic_path in zip(node.nics, nic_paths, strict=True):
            _check_testbed_nic(i, fabrics.index(nic.fabric), nic, nic_path, limits, slowest)
            on_fabric.setdefault(nic.fabric, []).append((node.name, nic_path))
    for fabric, members in on_fabric.items():
        if len(members) < 2:
            raise FieldError(f"{members[0][1]}.fabric" if fabric != "ethernet" else members[0][1],
                             f"fabric '{fabric}' reaches only node '{members[0][0]}'; link "
                             "calibration measures between two nodes, so give it a second one")


def _check_one_nic_per_fabric(node, nic_paths: list[str]) -> None:
    """A FieldError naming the NIC when `node` has a second NIC on one fabric: the testbed gives
    each fabric one subnet, so a node reaches it through one interface (`backend/topology.py`)."""
    first: dict[str, str] = {}
    for nic, path in zip(node.nics, nic_paths, strict=True):
        if nic.fabric not in first:
            first[nic.fabric] = path
            continue
        same = path == first[nic.fabric]  # one entry with count > 1
        raise FieldError(f"{path}.count" if same else path,
                         f"node '{node.name}' has two NICs on fabric '{nic.fabric}'; the testbed "
                         "gives each fabric one subnet, so a node reaches it through one NIC: "
                         + ("use count: 1" if same else
                            f"remove it ({first[nic.fabric]} is on that fabric already)"))


def _check_rank_count(ranks: int) -> None:
    from holmes_sim.validation.host import max_ranks

    if ranks > max_ranks():
        raise FieldError("clusters", f"{ranks} GPUs, one rank process each; this host runs at "
                                     f"most {max_ranks()} (its cores and memory); use fewer nodes "
                                     "or gpus_per_node")


BACKEND_BYTES_PER_PARAM = 24
"""Bytes a rank holds per parameter of its stage at its peak: the fp32 weight and gradient, the
flat gradient and parameter copies of the data-parallel step (`backend/data_parallel.py`) and
Adam's two fp32 moments (`backend/optimizer.py`), none sharded. Measured: a PP 2 x DP 2 run of
hidden 1024 (25.8 M parameters a stage) peaked at 1059 MiB resident on rank 0, 24.5 bytes a
parameter beside its activations and the 300 MiB of a tiny model's rank."""


def rank_memory_bytes(prepared: Prepared) -> tuple[float, float, float]:
    """A rank's peak resident memory, estimated, as (bytes, its stage's parameters, its
    activation bytes), for the stage that takes the most of an even split: each holds
    ceil(layers / (pp v)) layers per chunk (TP: 1/t of them), the first the embedding, the last
    the head, in fp32 at BACKEND_BYTES_PER_PARAM, plus the activations the schedule holds
    (`Workload.activation_bytes_per_layer`, fp32) and the torch baseline RANK_MEMORY_BYTES."""
    from holmes_sim.schedule import peaks_in_flight
    from holmes_sim.validation.host import RANK_MEMORY_BYTES

    w, pp, tp = prepared.workload, prepared.pp, prepared.tp
    par = prepared.scenario.parallel
    v = par.virtual_stages if par.schedule == "interleaved" else 1
    per_chunk = -(-w.num_layers // (pp * v))
    peaks = peaks_in_flight(par.schedule, pp, prepared.num_microbatches, v)
    worst = (0.0, 0.0, 0.0)
    for s in range(pp):
        params = (per_chunk * v * w.layer_params + (w.embedding_params if s == 0 else 0)
                  + (w.head_params if s == pp - 1 else 0)) / tp
        acts = (peaks[s] * per_chunk * w.activation_bytes_per_layer(tp)
                + (w.output_activation_bytes(tp) if s == pp - 1 else 0.0))
        total = RANK_MEMORY_BYTES + params * BACKEND_BYTES_PER_PARAM + acts
        worst = max(worst, (total, params, acts))
    return worst


def whole_model_bytes(prepared: Prepared) -> float:
    """Peak memory of compute calibration's one-rank run of the whole model (one micro-batch
    in flight), estimated as `rank_memory_bytes` does."""
    from holmes_sim.validation.host import RANK_MEMORY_BYTES

    w = prepared.workload
    return (RANK_MEMORY_BYTES + w.total_params * BACKEND_BYTES_PER_PARAM
            + w.num_layers * w.activation_bytes_per_layer(1) + w.output_activation_bytes(1))


def _check_memory(prepared: Prepared, available: int | None = None) -> None:
    """A FieldError naming the model's fields when the ranks, or compute calibration's one
    process of the whole model, need more memory than the host has available (MemAvailable;
    no check when it cannot be read)."""
    from holmes_sim.units import GIB
    from holmes_sim.validation.host import RANK_MEMORY_BYTES, available_memory

    have = available_memory() if available is None else available
    ranks = prepared.cluster.num_gpus
    per, params, acts = rank_memory_bytes(prepared)
    whole = whole_model_bytes(prepared)
    need = max(ranks * per, whole)
    if not have or need <= have:
        return
    what = (f"{ranks} rank processes of about {per / GIB:.2f} GiB each ({params / 1e6:.1f} M "
            f"parameters of the largest stage at {BACKEND_BYTES_PER_PARAM} bytes each: fp32 "
            f"weights, gradients and Adam; {acts / GIB:.2f} GiB of activations; "
            f"{RANK_MEMORY_BYTES // 2**20} MiB for torch)")
    if whole > ranks * per:
        what = (f"compute calibration's one process of the whole model "
                f"({prepared.workload.total_params / 1e6:.1f} M parameters)")
    raise FieldError("model", f"the real run needs about {need / GIB:.1f} GiB of memory but this "
                     f"host has {have / GIB:.1f} GiB available (MemAvailable): {what}; shrink the "
                     "model (model.hidden_size, model.num_layers, model.vocab_size, "
                     "model.seq_length) or training.micro_batch_size, or use fewer nodes or "
                     "gpus_per_node")


def smallest_rate_bit_per_s(prepared: Prepared) -> float:
    """The lowest NIC rate (bit/s) that carries the run's largest message within half of
    gloo's operation timeout (`_rate_needed`)."""
    limits = rate_limits(prepared)
    return _rate_needed(max(limits.run_bytes, limits.probe_bytes), limits.timeout_s)


@dataclass(frozen=True, slots=True)
class RateLimits:
    """What sets the lowest rate a testbed link may have: the run's largest message (a
    gradient bucket, at most the whole gradient, or a TP all-reduce), the link probe's
    (`testbed.link_probe_bytes`), both in bytes, and `testbed.timeout_s`."""

    run_bytes: float
    probe_bytes: int
    timeout_s: float

    @property
    def gloo_timeout_s(self) -> float:
        return min(GLOO_TIMEOUT_S, self.timeout_s)


def rate_limits(prepared: Prepared) -> RateLimits:
    from holmes_sim.spec.scenario import TestbedSpec

    spec = prepared.scenario.testbed or TestbedSpec()
    w = prepared.workload
    return RateLimits(max(min(w.bucket_bytes, w.grad_bytes_of(w.total_params)),
                          w.tp_allreduce_bytes()), spec.link_probe_bytes, spec.timeout_s)


def _slowest_rate(prepared: Prepared) -> float:
    """The lowest rate (bit/s) of the testbed's NICs and uplinks."""
    return min([nic.bandwidth_bytes_per_s * 8 for n in prepared.cluster.nodes for nic in n.nics]
               + [u.bandwidth_gbit_per_s * 1e9 for u in prepared.scenario.inter_cluster_links])


def _rate_needed(message_bytes: float, timeout_s: float) -> float:
    """The rate (bit/s) that moves `message_bytes` within half of gloo's operation timeout,
    min(GLOO_TIMEOUT_S, `timeout_s`): a ring all-reduce moves about twice its buffer through
    each NIC (Patarasuk and Yuan 2009), the other half is left for compute and the other
    messages."""
    return max(MIN_RATE_BIT_PER_S, 2 * message_bytes * 8 / (min(GLOO_TIMEOUT_S, timeout_s) / 2))


MIN_RATE_BIT_PER_S = 8.0
"""tc shapes whole bytes per second."""
GLOO_TIMEOUT_S = 60.0
"""The real run's gloo operation timeout (seconds; `real_run._run_real`, at most the
testbed's timeout_s)."""


def _check_rate_carries(rate: float, limits: RateLimits, slowest: float, path: str) -> None:
    """A FieldError when `rate` (bit/s, of the field at `path`) cannot carry the largest
    message within gloo's timeout, naming the field that sets the limit: testbed.timeout_s
    when raising it (up to GLOO_TIMEOUT_S) lets the testbed's `slowest` rate carry it,
    testbed.link_probe_bytes when the probe is the largest message and a smaller one fits,
    else the rate at `path`."""
    largest = max(limits.run_bytes, limits.probe_bytes)
    if rate >= _rate_needed(largest, limits.timeout_s):
        return
    probe = _probe_fix(limits, slowest)
    need_s = 2 * 2 * largest * 8 / slowest
    rule = ("a ring all-reduce moves a message twice through each NIC, within half of "
            "gloo's operation timeout, min(60 s, testbed.timeout_s)")
    if limits.timeout_s < need_s <= GLOO_TIMEOUT_S:
        raise FieldError("testbed.timeout_s", f"{limits.timeout_s:g} s is too short for the "
                         f"run's largest message ({_what(limits)}, {largest:.0f} bytes) on the "
                         f"testbed's slowest link ({slowest / 1e9:g} Gbit/s): {rule}; raise "
                         f"timeout_s to at least {_up(need_s):g}"
                         + (f", or lower testbed.link_probe_bytes to at most {probe}"
                            if probe else ""))
    if probe:
        raise FieldError("testbed.link_probe_bytes", f"{limits.probe_bytes} bytes, the run's "
                         f"largest message, is too large for the testbed's slowest link "
                         f"({slowest / 1e9:g} Gbit/s): {rule}; lower it to at most {probe}")
    raise FieldError(path, f"{rate:g} bit/s cannot carry the run's largest message within "
                           f"gloo's timeout; give at least "
                           f"{_rate_needed(largest, limits.timeout_s) / 1e9:.3g} Gbit/s")


def _probe_fix(limits: RateLimits, slowest: float) -> int:
    """The largest link probe (bytes) the `slowest` rate carries when the probe alone is too
    big and one of at least MIN_LINK_PROBE_BYTES would do; else 0."""
    if limits.probe_bytes <= limits.run_bytes or \
            slowest < _rate_needed(limits.run_bytes, limits.timeout_s):
        return 0
    most = int(slowest * limits.gloo_timeout_s / 2 / (2 * 8))
    return most if most >= MIN_LINK_PROBE_BYTES else 0


def _what(limits: RateLimits) -> str:
    return "the link probe" if limits.probe_bytes >= limits.run_bytes else "a gradient bucket " \
        "or TP all-reduce"


def _up(seconds: float) -> float:
    """`seconds` rounded up to 3 significant digits."""
    step = 10.0 ** (math.floor(math.log10(seconds)) - 2)
    return round(math.ceil(seconds / step - 1e-9) * step, 12)


def _check_testbed_nic(i: int, j: int, nic, path: str, limits: RateLimits, slowest: float) -> None:
    from holmes_sim.backend import topology as tbmod

    longest = max((nic.name, tbmod.peer_name(i, j), tbmod.bridge_name(j)), key=len)
    if len(longest) > tbmod.IFNAME_MAX or tbmod.name_problem(nic.name) is not None:
        raise FieldError(path, f"interface name '{longest}' is longer than Linux allows "
                               f"({tbmod.IFNAME_MAX} characters)")
    rate = nic.bandwidth_bytes_per_s * 8
    if not 0 < rate <= tbmod.MAX_RATE_BIT_PER_S:
        raise FieldError(f"{path}.bandwidth_gbit_per_s", f"{rate / 1e9:g} Gbit/s cannot be "
                         f"shaped on the testbed (at most {tbmod.MAX_RATE_BIT_PER_S / 1e9:g})")
    _check_rate_carries(rate, limits, slowest, f"{path}.bandwidth_gbit_per_s")


def _node_paths(prepared: Prepared) -> tuple[list[str], list[list[str]]]:
    """For each node of the cluster, in order: the field that names it, and its NICs' fields."""
    names, nics = [], []
    for ci, c in enumerate(prepared.scenario.clusters):
        for gi, g in enumerate(c.nodes):
            group = f"clusters[{ci}].nodes[{gi}]"
            per_nic = [f"{group}.nics[{k}]" for k, spec in enumerate(g.nics) for _ in range(spec.count)]
            for _ in range(g.count):
                names.append(f"{group}.name" if g.name is not None else f"clusters[{ci}].name")
                nics.append(per_nic)
    return names, nics


def plan_summary(plan: Plan) -> dict:
    """What a validation case ran, for its JSON and report: the schedule, layers per virtual
    stage, each rank's node and GPU (placement), and each group's kind, ranks, transport and
    member NICs ("" for a node-local member)."""
    return {"schedule": plan.schedule_kind.value, "optimizer": plan.optimizer.value,
            "tp": plan.tp, "pp": plan.pp, "dp": plan.dp,
            "layers_per_stage": list(plan.layers_per_stage),
            "ranks": [str(g) for g in plan.rank_to_gpu],
            "groups": [{"kind": g.kind.value, "ranks": list(g.ranks), "transport": str(g.transport),
                        "nics": list(g.nics)} for g in plan.groups]}


def transport_lines(plan: Plan) -> list[str]:
    """Each plan group's transport settings: the gloo interface per member on the testbed, and
    the NCCL variables a real cluster run sets while creating it (plan NIC names; a site maps
    them to devices with RunConfig.nic_devices)."""
    from holmes_sim.backend.nccl import nccl_settings

    lines = []
    for i, g in enumerate(plan.groups):
        nccl = nccl_settings(g, {})
        shown = " ".join(f"{k}={v}" for k, v in sorted(nccl.items())) or "none (NVLink/PCIe)"
        members = ", ".join(f"{r}:{n or 'lo'}" for r, n in zip(g.ranks, g.nics, strict=True))
        lines.append(f"  group {i} {g.kind.value}{tuple(g.ranks)} {g.transport}: "
                     f"gloo {members}; NCCL {shown}")
    return lines
