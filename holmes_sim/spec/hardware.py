"""YAML-facing hardware specs: clusters, node groups, NICs, fabrics, inter-cluster links, catalog
overrides. Frozen dataclasses; validation of values only (a `FieldError` whose path is relative
to the spec), no behaviour. Units live in the names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from holmes_sim.errors import FieldError

NicType = Literal["ib", "roce", "ethernet"]


@dataclass(frozen=True, kw_only=True, slots=True)
class NicSpec:
    """NICs of one kind on every node of a node group."""

    type: NicType
    """ib | roce | ethernet."""
    model: str | None = None
    """Catalog NIC model giving defaults (e.g. ib-hdr, roce-200g, eth-100g)."""
    count: int = 1
    """How many such NICs each node has; GPUs are split evenly across them unless `gpus` says."""
    bandwidth_gbit_per_s: float | None = None
    """Line rate in Gbit/s per NIC (overrides the model's)."""
    latency_us: float | None = None
    """Per-message latency in microseconds (overrides the model's)."""
    efficiency: float | None = None
    """Achievable fraction of line rate for this transport (overrides the model's)."""
    fabric: str | None = None
    """Name of the RDMA fabric (declared under `fabrics`) the NIC plugs into; ib and roce only.
    Ethernet NICs all join the one Ethernet network that reaches every node."""
    gpus: tuple[tuple[int, ...], ...] | None = None
    """Optional: for each NIC, the local GPU indices that use it."""
    devices: tuple[str, ...] | None = None
    """Optional: for each NIC, the device name the OS and NCCL use: the interface of an Ethernet
    NIC (ens1f0, bond0), the HCA of an ib or roce NIC (mlx5_0, optionally with its port:
    mlx5_0:1). Launch exports only; no cost depends on it."""

    def __post_init__(self) -> None:
        if self.devices is not None:
            _check_devices(self.devices, self.count, self.type)


def _check_devices(devices: tuple[str, ...], count: int, nic_type: str) -> None:
    """Raise FieldError (its path relative to the NIC) for a device list NCCL cannot take: one
    name per NIC, and ':' only as an HCA's port (NCCL reads `name:port` in both of its lists)."""
    if len(devices) != count:
        raise FieldError("devices", f"{len(devices)} names for {count} NICs (count); give one "
                                    "device name per NIC, in NIC order")
    for k, name in enumerate(devices):
        base, colon, port = name.partition(":")
        if colon and nic_type == "ethernet":
            raise FieldError(f"devices[{k}]", f"{name!r}: NCCL reads ':' as a port; give the "
                                              "interface name alone (as `ip link` lists it)")
        if colon and not (base and port.isascii() and port.isdigit()):
            raise FieldError(f"devices[{k}]", f"{name!r} is not HCA[:port]; give e.g. mlx5_0 "
                                              "or mlx5_0:1")


def _check_devices_named_alike(nics: tuple[NicSpec, ...]) -> None:
    """Raise FieldError (its path relative to the node group) where one NIC entry names its
    devices and another of the same list does not: NCCL_IB_HCA lists all ib and roce NICs,
    NCCL_SOCKET_IFNAME all Ethernet ones, either the named ones or placeholders."""
    first: dict[bool, int] = {}  # Ethernet or not -> the first entry naming its devices
    for i, nic in enumerate(nics):
        if nic.devices is not None:
            first.setdefault(nic.type == "ethernet", i)
    for i, nic in enumerate(nics):
        named = first.get(nic.type == "ethernet")
        if nic.devices is None and named is not None:
            kind = "Ethernet" if nic.type == "ethernet" else "ib and roce"
            raise FieldError(f"nics[{i}]", f"names no `devices`, but nics[{named}] of this node "
                                           f"group does; give `devices` on every {kind} NIC "
                                           "entry of the group, or on none")


def _check_unique_devices(nics: tuple[NicSpec, ...]) -> None:
    """Raise FieldError (its path relative to the node group) for a device that two NICs of the
    node name: the same name, or an HCA both whole and by one of its ports (mlx5_0, mlx5_0:1)."""
    named: dict[str, str] = {}  # name -> its path
    whole: dict[str, str] = {}  # HCA named without a port -> its path
    ported: dict[str, str] = {}  # HCA named with a port -> the first such path
    for i, nic in enumerate(nics):
        for k, name in enumerate(nic.devices or ()):
            path, (base, colon, _) = f"nics[{i}].devices[{k}]", name.partition(":")
            other = named.get(name) or (whole.get(base) if colon else ported.get(base))
            if other is not None:
                raise FieldError(path, f"device {name!r} is named by this node group's {other} "
                                       "already; give each NIC of a node its own device")
            named[name] = path
            (ported if colon else whole).setdefault(base, path)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeGroupSpec:
    """`count` identical nodes."""

    count: int = 1
    """Number of nodes in this group."""
    gpu: str
    """Catalog GPU model (a100-40gb, a100-80gb, h100-sxm, h200, b200, gb200, or one under
    catalog.gpus)."""
    gpus_per_node: int = 8
    """GPUs per node."""
    intra_node: str | None = None
    """Catalog intra-node link (nvlink3, nvlink4, nvlink5, pcie4, pcie5, or one under
    catalog.links); omit: the GPU model's NVLink (A100 nvlink3, H100 and H200 nvlink4, B200 and
    GB200 nvlink5; a GPU under catalog.gpus its `intra_node`). A GB200 NVL72 rack is one node
    of 72 GPUs on nvlink5."""
    nics: tuple[NicSpec, ...]
    """The node's NICs."""
    name: str | None = None
    """Prefix of the node names (default: the cluster's name)."""

    def __post_init__(self) -> None:
        _check_devices_named_alike(self.nics)
        _check_unique_devices(self.nics)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """One cluster: a set of node groups in one place."""

    name: str
    nodes: tuple[NodeGroupSpec, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class FabricSpec:
    """A switched RDMA network (one InfiniBand or RoCE fabric) shared by the NICs that name it."""

    name: str
    type: Literal["ib", "roce"]


@dataclass(frozen=True, kw_only=True, slots=True)
class InterClusterLinkSpec:
    """The Ethernet uplink joining two clusters; all Ethernet traffic between them shares it."""

    clusters: tuple[str, str]
    bandwidth_gbit_per_s: float
    """Capacity in Gbit/s, each direction."""
    latency_us: float = 50.0
    """Added one-way latency in microseconds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuModelSpec:
    """A GPU model for the catalog (adds to or overrides the built-in one of the same name). An
    optional field left out takes the built-in GPU's value when the name is a built-in one
    (with its measured GEMM search shape and fused attention rates, which no field states),
    else the default given."""

    peak_tflops: float | None = None
    """Dense peak TFLOP/s at the training precision (bf16/fp16); required for a new GPU."""
    memory_gib: float | None = None
    """HBM capacity in GiB; required for a new GPU."""
    memory_bandwidth_gbyte_per_s: float | None = None
    """HBM bandwidth in GB/s; required for a new GPU."""
    compute_efficiency: float | None = None
    """Achievable fraction of peak for well-shaped GEMMs (a measured MAMF / peak); default 0.8.
    Given for a built-in GPU, it replaces the built-in's measurement and its search shape."""
    sm_count: int | None = None
    """Streaming multiprocessors, for wave quantization (default: none, no quantization)."""
    memory_efficiency: float | None = None
    """Achievable fraction of memory bandwidth for streaming kernels; default 0.9."""
    attention_efficiency: float | None = None
    """Achieved fraction of peak of a fused (flash) attention kernel; default 0.6. Given for a
    built-in GPU, it replaces the built-in's measured attention rates."""
    fp8_peak_tflops: float | None = None
    """Dense FP8 tensor peak TFLOP/s (default: none, no FP8; `precision: fp8` is then refused)."""
    fp8_compute_efficiency: float | None = None
    """As compute_efficiency, for FP8 GEMMs (default: compute_efficiency)."""
    persistent_gemm: bool | None = None
    """GEMMs run as persistent warp-specialized kernels that hide each tile's pipeline fill
    (Hopper and later); false (the default): each tile pays its fill and epilogue (Ampere)."""
    overlapped_epilogue: bool | None = None
    """With persistent_gemm: each tile's epilogue runs beside the next tile's math (Blackwell;
    the default); false: each tile pays it (Hopper's cooperative kernels)."""
    intra_node: str | None = None
    """The intra-node link of nodes with this GPU that name none (omit: the built-in GPU's of
    the same name; a new GPU's nodes must then name their `intra_node`)."""
    source: str = "user"


@dataclass(frozen=True, kw_only=True, slots=True)
class NicModelSpec:
    """A NIC model for the catalog."""

    type: NicType
    bandwidth_gbit_per_s: float
    latency_us: float
    efficiency: float
    source: str = "user"


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkModelSpec:
    """An intra-node link model for the catalog (per GPU, each direction)."""

    bandwidth_gbyte_per_s: float
    latency_us: float
    efficiency: float
    type: Literal["nvlink", "pcie"] | None = None
    """What the GPUs talk over, as NCCL tunes for it (omit: the built-in link's of the same
    name; a new link: pcie if its name starts with "pcie", else nvlink)."""
    source: str = "user"


@dataclass(frozen=True, kw_only=True, slots=True)
class CatalogSpec:
    """Scenario-local catalog entries, by name."""

    gpus: dict[str, GpuModelSpec] = field(default_factory=dict)
    nics: dict[str, NicModelSpec] = field(default_factory=dict)
    links: dict[str, LinkModelSpec] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowGpuSpec:
    """Named GPUs, or a whole node, that compute slower (or faster) than their model."""

    node: str
    """The node's name as the simulator names it (<group name or cluster>-<index>)."""
    speed_factor: float
    """Compute speed relative to the GPU model (0.85: every op takes 1 / 0.85 as long)."""
    gpus: tuple[int, ...] | None = None
    """Local GPU indices (omit: every GPU of the node)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowLinkSpec:
    """NICs that run below their line rate (a degraded or failed-over port), on one node or on
    every node of one cluster (a slower rack or cluster uplink to its switch)."""

    rate_factor: float
    """Fraction of the NIC's rate it achieves (0.5: half)."""
    node: str | None = None
    """The node whose NICs are slow (give `node` or `cluster`)."""
    cluster: str | None = None
    """The cluster all of whose nodes' NICs are slow."""
    nic: str | None = None
    """Node-local NIC name (ib0, roce1, eth0; omit: every NIC that `fabric` allows)."""
    fabric: str | None = None
    """Only NICs on this fabric (a declared fabric name, or ethernet; omit: any)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowUplinkSpec:
    """An inter-cluster link that runs below its declared capacity."""

    clusters: tuple[str, str]
    rate_factor: float
    """Fraction of the link's capacity it achieves."""


@dataclass(frozen=True, kw_only=True, slots=True)
class VariabilitySpec:
    """Persistent differences between nominally identical hardware: stragglers, a seeded spread
    of per-GPU compute speed, degraded NICs and uplinks. Run-to-run jitter of each op's time is
    `engine.compute_cv` instead."""

    compute_spread: float = 0.0
    """Coefficient of variation of per-GPU compute speed around 1 (0: none); each GPU draws once."""
    distribution: Literal["normal", "uniform"] = "normal"
    """normal: N(1, spread) clipped to 1 +- 3 standard deviations; uniform: the uniform
    distribution of the same mean and standard deviation (half-width sqrt(3) x spread)."""
    seed: int | None = None
    """Seed of the spread's draws (omit: the scenario's seed)."""
    slow_gpus: tuple[SlowGpuSpec, ...] = ()
    slow_links: tuple[SlowLinkSpec, ...] = ()
    slow_uplinks: tuple[SlowUplinkSpec, ...] = ()

    def __post_init__(self) -> None:
        _check_slow_gpus(self.slow_gpus)


def _check_slow_gpus(entries: tuple[SlowGpuSpec, ...]) -> None:
    """Raise FieldError (its path relative to `variability`) for a GPU that two places of
    `slow_gpus` name: a whole node's entry names each of its GPUs."""
    named: dict[tuple[str, int], str] = {}  # (node, local GPU) -> the path naming it
    first: dict[str, str] = {}  # node -> the first path naming any of its GPUs
    whole: dict[str, str] = {}  # node -> the entry naming all of its GPUs
    for i, entry in enumerate(entries):
        node, path = entry.node, f"slow_gpus[{i}]"
        if entry.gpus is None and node in first:
            some = "all of them" if node in whole else "one of them"
            raise FieldError(path, f"this entry names every GPU of node {node}, but "
                             f"variability.{first[node]} names {some} already; list each GPU "
                             "once (merge the entries)")
        if entry.gpus is None:
            first[node] = whole[node] = path
            continue
        for k, gpu in enumerate(entry.gpus):
            other = named.get((node, gpu)) or whole.get(node)
            if other is not None:
                raise FieldError(f"{path}.gpus[{k}]", f"GPU {gpu} of node {node} is named by "
                                 f"variability.{other} already; list each GPU once (merge the "
                                 "entries)")
            named[(node, gpu)] = f"{path}.gpus[{k}]"
            first.setdefault(node, f"{path}.gpus[{k}]")
