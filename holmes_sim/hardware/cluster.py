"""The hardware as the simulator sees it: nodes, their GPUs, NICs, fabrics and inter-cluster links,
built from the scenario's specs and the catalog, in SI units."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from holmes_sim.hardware.catalog import Catalog, GpuModel, LinkModel
from holmes_sim.errors import FieldError
from holmes_sim.spec.hardware import (ClusterSpec, FabricSpec, InterClusterLinkSpec, NicSpec,
                                     NodeGroupSpec)
from holmes_sim.units import gbit_per_s_to_bytes_per_s, us_to_s

ETHERNET = "ethernet"
"""Name of the one Ethernet network every Ethernet NIC joins (it spans all clusters)."""
_NIC_PREFIX = {"ib": "ib", "roce": "roce", "ethernet": "eth"}


@dataclass(frozen=True, slots=True)
class Nic:
    """One NIC of a node.

    Attributes:
        name: node-local name, e.g. "ib0", "roce1", "eth0": holmes-sim's label (the interface
            name on the testbed), not the OS's.
        type: ib | roce | ethernet.
        fabric: the RDMA fabric it plugs into, or ETHERNET.
        bandwidth_bytes_per_s: line rate, each direction.
        latency_s: per-message latency of one collective step or send.
        efficiency: achievable fraction of line rate.
        gpus: local indices of the GPUs that use this NIC.
        collective_latency_s: per-step software latency of a ring collective, when measured
            (a collective library's step costs more than a ping-pong); None: `latency_s`.
        device: the name the OS and NCCL give it (ens1f0, mlx5_0:1) where the scenario says;
            launch exports use it, costs do not, and NICs equal but for it compare equal.
    """

    name: str
    type: str
    fabric: str
    bandwidth_bytes_per_s: float
    latency_s: float
    efficiency: float
    gpus: tuple[int, ...]
    collective_latency_s: float | None = None
    device: str | None = field(default=None, compare=False)

    @property
    def step_latency_s(self) -> float:
        """Latency of one ring-collective step over this NIC (s)."""
        return self.latency_s if self.collective_latency_s is None else self.collective_latency_s

    @property
    def effective_bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency


@dataclass(frozen=True, slots=True)
class Node:
    """One server: its GPUs, intra-node link and NICs.

    `gpu_speeds` holds each local GPU's compute speed relative to its model (empty: all 1;
    `hardware.variability`); `speed` is the slowest one's, the speed every GPU of the node is
    priced at (a TP group lives on one node and its ranks wait for each other every layer)."""

    name: str
    cluster: str
    gpu: GpuModel
    num_gpus: int
    intra_link: LinkModel
    nics: tuple[Nic, ...]
    gpu_speeds: tuple[float, ...] = ()
    group_path: str = field(default="", compare=False)
    """The dotted path of the scenario's node group that made this node
    (`clusters[0].nodes[1]`; empty for a node built otherwise)."""
    speed: float = field(init=False, compare=False)
    _rdma_fabrics: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _on: dict[str, tuple[Nic, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "speed", min(self.gpu_speeds, default=1.0))
        object.__setattr__(self, "_rdma_fabrics",
                           tuple(dict.fromkeys(n.fabric for n in self.nics if n.type != ETHERNET)))
        object.__setattr__(self, "_on", {})

    @property
    def rdma_fabrics(self) -> tuple[str, ...]:
        """The RDMA fabrics this node reaches, in declaration order (placement and transport
        choices ask for every GPU's node)."""
        return self._rdma_fabrics

    def nics_on(self, fabric: str) -> tuple[Nic, ...]:
        """This node's NICs on `fabric` (found once per fabric)."""
        got = self._on.get(fabric)
        if got is None:
            got = self._on[fabric] = tuple(n for n in self.nics if n.fabric == fabric)
        return got

    def nic_of_gpu(self, local_gpu: int, fabric: str) -> Nic | None:
        """The NIC on `fabric` that GPU `local_gpu` uses, or None when the node is not on it."""
        for nic in self.nics_on(fabric):
            if local_gpu in nic.gpus:
                return nic
        return None


@dataclass(frozen=True, slots=True)
class Uplink:
    """The Ethernet link between two clusters (capacity each direction)."""

    clusters: tuple[str, str]
    bandwidth_bytes_per_s: float
    latency_s: float


@dataclass(frozen=True, slots=True)
class Cluster:
    """All nodes of a scenario (possibly several physical clusters), fabrics and uplinks."""

    nodes: tuple[Node, ...]
    fabrics: dict[str, str]
    """Fabric name -> type (ib, roce, ethernet)."""
    uplinks: tuple[Uplink, ...]
    _by_name: dict[str, Node] = field(init=False, repr=False, compare=False)
    _nic_of: dict[tuple[str, int, str], Nic | None] = field(init=False, repr=False, compare=False)
    _derived: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {n.name: n for n in self.nodes})
        object.__setattr__(self, "_nic_of", {})
        object.__setattr__(self, "_derived", {})

    def derived(self, key: tuple, make):
        """A fact of this hardware alone, `make()`'s result made once and kept with the cluster
        (every placement of a search shares it; `cost.paths` and `cost.link_uses`: link
        capacities, each GPU's NIC links, each node's NIC sides). The caller must not change it."""
        got = self._derived.get(key)
        if got is None:
            got = self._derived[key] = make()
        return got

    def nic_of_gpu(self, node: str, local_gpu: int, fabric: str) -> Nic | None:
        """`Node.nic_of_gpu` of node `node`, remembered (paths and groups ask it for every
        member of every group)."""
        key = (node, local_gpu, fabric)
        try:
            return self._nic_of[key]
        except KeyError:
            got = self._nic_of[key] = self._by_name[node].nic_of_gpu(local_gpu, fabric)
            return got

    @property
    def num_gpus(self) -> int:
        return sum(n.num_gpus for n in self.nodes)

    def node(self, name: str) -> Node:
        return self._by_name[name]

    def uplink(self, cluster_a: str, cluster_b: str) -> Uplink | None:
        """The uplink between two different clusters (None for the same cluster)."""
        if cluster_a == cluster_b:
            return None
        for u in self.uplinks:
            if set(u.clusters) == {cluster_a, cluster_b}:
                return u
        return None

    def with_nodes(self, nodes: tuple[Node, ...], fabrics: dict[str, str] | None = None,
                   uplinks: tuple[Uplink, ...] | None = None) -> Cluster:
        """A copy with other nodes (used by the all-ib / all-ethernet reference policies)."""
        return replace(self, nodes=nodes, fabrics=fabrics if fabrics is not None else self.fabrics,
                       uplinks=uplinks if uplinks is not None else self.uplinks)


def build_cluster(clusters: tuple[ClusterSpec, ...], fabrics: tuple[FabricSpec, ...],
                  links: tuple[InterClusterLinkSpec, ...], catalog: Catalog) -> Cluster:
    """Resolve specs against the catalog and check that names, fabrics and links fit together.

    Raises:
        FieldError: with the dotted path of the offending field.
    """
    fabric_types = _check_fabrics(fabrics)
    nodes: list[Node] = []
    seen_clusters: set[str] = set()
    for ci, c in enumerate(clusters):
        path = f"clusters[{ci}]"
        if c.name in seen_clusters:
            raise FieldError(f"{path}.name", f"cluster '{c.name}' is declared twice; rename one")
        seen_clusters.add(c.name)
        nodes.extend(_build_nodes(c, path, fabric_types, catalog, start=len(nodes)))
    names = [n.name for n in nodes]
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    dup = next((n for n in names if counts[n] > 1), None)  # the first repeated, in order
    if dup:
        raise FieldError("clusters", f"two node groups produce the node name '{dup}'; give the "
                         "groups distinct `name` prefixes")
    uplinks = _build_uplinks(links, [c.name for c in clusters])
    return Cluster(tuple(nodes), {**fabric_types, ETHERNET: ETHERNET}, uplinks)


def check_catalog_names(clusters: tuple[ClusterSpec, ...], catalog: Catalog) -> None:
    """That every GPU, intra-node link and NIC model the node groups name is in `catalog`: a
    rule of the names alone, checked without building the cluster (a sweep checks every
    point's names before any runs)."""
    for ci, c in enumerate(clusters):
        for gi, g in enumerate(c.nodes):
            gpath = f"clusters[{ci}].nodes[{gi}]"
            intra_node_link(g, catalog, gpath)
            for ni, n in enumerate(g.nics):
                if n.model is not None:
                    catalog.nic(n.model, f"{gpath}.nics[{ni}].model")


def intra_node_link(group: NodeGroupSpec, catalog: Catalog, path: str) -> LinkModel:
    """The intra-node link of the node group at `path`: the one it names, else its GPU model's
    NVLink (`GpuModel.nvlink`)."""
    gpu = catalog.gpu(group.gpu, f"{path}.gpu")
    name = gpu.nvlink if group.intra_node is None else group.intra_node
    if name is None:
        raise FieldError(f"{path}.intra_node", f"GPU model '{group.gpu}' has no default "
                         "intra-node link; name one (nvlink3, nvlink4, nvlink5, pcie4, pcie5 or "
                         f"one under catalog.links), or give catalog.gpus.{group.gpu}.intra_node")
    return catalog.link(name, f"{path}.intra_node")


def _check_fabrics(fabrics: tuple[FabricSpec, ...]) -> dict[str, str]:
    types: dict[str, str] = {}
    for i, f in enumerate(fabrics):
        if f.name in types or f.name == ETHERNET:
            raise FieldError(f"fabrics[{i}].name", f"fabric name '{f.name}' is taken; rename it")
        types[f.name] = f.type
    return types


def _build_nodes(c: ClusterSpec, path: str, fabric_types: dict[str, str], catalog: Catalog,
                 start: int) -> list[Node]:
    out = []
    for gi, g in enumerate(c.nodes):
        gpath = f"{path}.nodes[{gi}]"
        gpu, link = catalog.gpu(g.gpu, f"{gpath}.gpu"), intra_node_link(g, catalog, gpath)
        nics = _build_nics(g.nics, g.gpus_per_node, f"{gpath}.nics", fabric_types, catalog)
        if not nics:
            raise FieldError(f"{gpath}.nics", "a node needs at least one NIC; add e.g. "
                                              "`- {type: ethernet, model: eth-100g}`")
        prefix = g.name or c.name
        for k in range(g.count):
            index = len(out) if g.name is None else k
            out.append(Node(f"{prefix}-{index}", c.name, gpu, g.gpus_per_node, link, nics,
                            group_path=gpath))
    return out


def _build_nics(specs: tuple[NicSpec, ...], num_gpus: int, path: str,
                fabric_types: dict[str, str], catalog: Catalog) -> tuple[Nic, ...]:
    nics: list[Nic] = []
    counters: dict[str, int] = {}
    for i, s in enumerate(specs):
        npath = f"{path}[{i}]"
        fabric = _nic_fabric(s, npath, fabric_types)
        bandwidth, latency, efficiency = _nic_numbers(s, npath, catalog)
        devices = s.devices or (None,) * s.count
        for gpus, device in zip(_gpu_split(s, num_gpus, npath), devices, strict=True):
            n = counters.get(s.type, 0)
            counters[s.type] = n + 1
            nics.append(Nic(f"{_NIC_PREFIX[s.type]}{n}", s.type, fabric, bandwidth, latency,
                            efficiency, gpus, device=device))
    return tuple(nics)


def _nic_fabric(s: NicSpec, path: str, fabric_types: dict[str, str]) -> str:
    if s.type == ETHERNET:
        if s.fabric not in (None, ETHERNET):
            raise FieldError(f"{path}.fabric", "Ethernet NICs all join the one Ethernet network; "
                                               "remove `fabric` (fabrics are for ib and roce)")
        return ETHERNET
    if s.fabric is None:
        declared = [n for n, t in fabric_types.items() if t == s.type]
        fix = f"one of: {', '.join(declared)}" if declared else \
            f"declare one under `fabrics:` (e.g. `- {{name: {s.type}-a, type: {s.type}}}`)"
        raise FieldError(f"{path}.fabric", f"a {s.type} NIC must name the fabric it plugs into; "
                                           f"set fabric to {fix}")
    if s.fabric not in fabric_types:
        known = ", ".join(fabric_types) or "none declared"
        raise FieldError(f"{path}.fabric", f"no fabric named '{s.fabric}' carries this {s.type} "
                                           f"NIC (declared: {known}); declare it under `fabrics:`")
    if fabric_types[s.fabric] != s.type:
        raise FieldError(f"{path}.fabric", f"fabric '{s.fabric}' is {fabric_types[s.fabric]}, but "
                                           f"this NIC is {s.type}; plug it into a {s.type} fabric")
    return s.fabric


def _nic_numbers(s: NicSpec, path: str, catalog: Catalog) -> tuple[float, float, float]:
    """(line rate bytes/s, latency s, efficiency) from the model, overridden by the NIC's fields."""
    if s.model is not None:
        m = catalog.nic(s.model, f"{path}.model")
        if m.type != s.type:
            raise FieldError(f"{path}.model", f"model '{s.model}' is a {m.type} NIC but type is "
                                              f"'{s.type}'; pick a {s.type} model")
        bandwidth, latency, efficiency = m.bandwidth_bytes_per_s, m.latency_s, m.efficiency
    elif s.bandwidth_gbit_per_s is None:
        raise FieldError(path, "give either `model` (a catalog NIC such as ib-hdr, roce-200g, "
                               "eth-100g) or `bandwidth_gbit_per_s`")
    else:
        bandwidth, latency, efficiency = 0.0, us_to_s(10 if s.type != ETHERNET else 50), \
            (0.92 if s.type != ETHERNET else 0.6)
    if s.bandwidth_gbit_per_s is not None:
        bandwidth = gbit_per_s_to_bytes_per_s(s.bandwidth_gbit_per_s)
    if s.latency_us is not None:
        latency = us_to_s(s.latency_us)
    if s.efficiency is not None:
        efficiency = s.efficiency
    return bandwidth, latency, efficiency


def _gpu_split(s: NicSpec, num_gpus: int, path: str) -> list[tuple[int, ...]]:
    """For each of the `count` NICs, the local GPUs using it."""
    if s.gpus is None:
        if num_gpus % s.count and s.count % num_gpus:
            raise FieldError(f"{path}.count", f"{s.count} NICs cannot be shared evenly by "
                                              f"{num_gpus} GPUs; give `gpus:` per NIC")
        return [tuple(g for g in range(num_gpus) if g * s.count // num_gpus == k)
                or (k * num_gpus // s.count,) for k in range(s.count)]
    if len(s.gpus) != s.count:
        raise FieldError(f"{path}.gpus", f"has {len(s.gpus)} entries but count is {s.count}; give "
                                         "one list of GPU indices per NIC")
    used = sorted(g for gs in s.gpus for g in gs)
    if used != list(range(num_gpus)):
        raise FieldError(f"{path}.gpus", f"must use every GPU 0..{num_gpus - 1} exactly once, got "
                                         f"{used}")
    return [tuple(gs) for gs in s.gpus]


def _build_uplinks(links: tuple[InterClusterLinkSpec, ...], cluster_names: list[str]) -> tuple[Uplink, ...]:
    out: list[Uplink] = []
    known, joined = set(cluster_names), set()
    for i, lk in enumerate(links):
        path = f"inter_cluster_links[{i}].clusters"
        a, b = lk.clusters
        for name in (a, b):
            if name not in known:
                raise FieldError(path, f"no cluster named '{name}' (clusters: "
                                       f"{', '.join(cluster_names)})")
        if a == b:
            raise FieldError(path, "an inter-cluster link joins two different clusters")
        if frozenset((a, b)) in joined:
            raise FieldError(path, f"clusters '{a}' and '{b}' are joined twice; keep one link")
        joined.add(frozenset((a, b)))
        out.append(Uplink((a, b), gbit_per_s_to_bytes_per_s(lk.bandwidth_gbit_per_s),
                          us_to_s(lk.latency_us)))
    for i, a in enumerate(cluster_names):
        for b in cluster_names[i + 1:]:
            if frozenset((a, b)) not in joined:
                raise FieldError("inter_cluster_links", f"clusters '{a}' and '{b}' are not joined; "
                                 f"add `- {{clusters: [{a}, {b}], bandwidth_gbit_per_s: 100}}`")
    return tuple(out)


def fabric_notes(cluster: Cluster) -> tuple[str, ...]:
    """One note per RDMA fabric that reaches nodes of several clusters (two pods on one IB
    network): RDMA traffic between those clusters runs on the fabric, and only TCP traffic
    between clusters crosses `inter_cluster_links` (`cost.paths`, `cost.link_uses`)."""
    joined: dict[str, dict[str, None]] = {}
    for node in cluster.nodes:
        for fabric in node.rdma_fabrics:
            joined.setdefault(fabric, {})[node.cluster] = None
    notes = []
    for fabric, names in joined.items():
        if len(names) > 1:
            *first, last = names
            notes.append(f"note: fabric {fabric} joins clusters {', '.join(first)} and {last}: "
                         "RDMA traffic between them uses the fabric, not the inter-cluster link "
                         "(declare one fabric per cluster to route it over the link)")
    return tuple(notes)
