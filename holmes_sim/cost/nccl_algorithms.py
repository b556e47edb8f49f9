"""Which algorithm and protocol NCCL runs a collective with, and what it costs.

NCCL prices every (algorithm, protocol) pair of a collective as latency + size / bandwidth and
runs the cheapest (src/graph/tuning.cc: `ncclTopoTuneModel` fills the latency and bandwidth
tables, `ncclTopoGetAlgoTime` adds the size term; NVIDIA/nccl master, 2026). This module applies
that rule with the simulator's own figures:

- bandwidths come from the links (`CollectiveTopology`: the ring's bus bandwidth, its intra-node
  and node-exit hop rates), times NCCL's per-algorithm and per-protocol factors: ring LL 0.5
  (at most `llMaxBw`: on one node by GPU architecture, across nodes the x86 Intel row), ring
  LL128 0.92; tree all-reduce 0.92, then LL 1/3.8 (at most `llMaxBw`) or LL128 120/128 across
  nodes, then `treeCorrectionFactor` by size (its power-of-two samples joined linearly in log2
  size, `_tree_correction`); NVLS and NVLS-tree at the NVSwitch's `nvlsEfficiency` (Hopper
  0.85, Blackwell 0.74); PAT 0.75;
- a step's latency is the catalog's per-step latency alpha (NCCL's ring/Simple step on that
  hardware), scaled for another algorithm or protocol by the ratio of NCCL's hardware latencies
  (`hwLatencies`: NVLink, PCI, NET rows); base latencies are left out, as the ring's alpha-beta
  cost has none;
- step counts are NCCL's: ring 2(n-1) (all-reduce) or n-1 steps, of which 2(K-1) or K-1
  cross nodes (the rest on the intra-node link: NCCL's hierarchical ring latency, each at
  least NCCL's `netOverhead` when the ring spans nodes: 1 us, 3 us for Simple, the x86 Intel
  row, as `llMaxBw`'s); tree all-reduce
  2((n/K - 1) intra + floor(log2 K) inter) steps (double binary tree across K nodes, a chain inside
  a node; NCCL >= 2.4); NVLS-tree one NVLS step + 2 floor(log2 K) inter steps; NVLS one step;
  PAT floor(log2 K)/3.5 inter steps + n x 2.8/14 (its linear part, 2.8 us against the NET ring
  step's 14 us).

Traffic per hop, as a multiple of N (the buffer: the all-reduce input, the all-gather output,
the reduce-scatter input), over the protocol/algorithm efficiency: ring 2(n-1)/n or (n-1)/n on
every hop; tree 2 on every hop (N up and N down each chain link and tree edge; a node of the
double binary tree is inner in one tree and a leaf in the other, so its NICs carry 2N; on two
nodes each tree is one edge and they carry N); NVLS 1 on a GPU's NVLink (all-reduce: N to the
switch, N back from it; reduce-scatter and all-gather (ppn - 1)/ppn) and NVLS-tree the tree's
2 (two nodes: 1) on a node's exit; PAT 1 (its AG/RS bandwidth is not converted
by (n-1)/n in tuning.cc). In this network (GPU and NIC links, no fabric core) those loads are what
the links see, so the engine carries them on the ring's hops (`sim.collectives`).

Enabled as NCCL enables them by default: tree only for all-reduce across nodes; NVLS on one
node with NVLink SHARP (NVSwitch gen3: H100, H200, B200, GB200), for reduce-scatter and
all-gather with at most 32 GPUs on it (`NCCL_MAX_NVLS_ARITY`: not a 72-GPU NVL72 rack);
NVLS-tree across nodes with it and at least 2 members per node; PAT for reduce-scatter and
all-gather with one member per node. LL128 only where a node's GPUs talk over NVLink (not
between PCIe GPUs of one node). The reduction's op matters too: `ReduceOp.AVG` (Megatron's
`--ddp-average-in-collective`) on a float type runs as NCCL's `ncclDevPreMulSum` (enqueue.cc,
`hostToDevRedOp`), which the NVLS kernels do not implement (device.h `ncclNvlsSupported`: Sum
and MinMax only) and PAT reduce-scatter skips (enqueue.cc `updateCollCostTable`: "Tree
reduceScatter doesn't support scaling yet"); an all-gather reduces nothing and ignores it.
`NCCL_NVLS_ENABLE=0` (`TrainingSpec.nccl_nvls_enable`, `with_nvls`) turns NVLS and NVLS-tree off
(src/transport/nvls.cc `ncclNvlsInit`: no NVLS support, which enqueue.cc
`updateCollCostTable` requires of both; NCCL's default, 2, enables them where supported).
CollNet (IB SHARP) and multi-node NVLS need `NCCL_COLLNET_ENABLE=1` and the SHARP plugin
(tuning.cc disables them when `collnetEnable` is 0, its default) and are not chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from math import floor, inf, log2
from operator import itemgetter

# NCCL hwLatencies (us), [hardware][algorithm] = (LL, LL128, Simple), tuning.cc.
_HW_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0.0, 0.0, 25.0),
               "nvls-tree": (0.0, 0.0, 25.0), "pat": (0.0, 0.0, 4.0)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "pat": (0.0, 0.0, 4.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": (0.0, 0.0, 18.0),
            "nvls-tree": (0.0, 0.0, 20.9), "pat": (0.0, 0.0, 14.0)},
}
PROTOCOLS = ("LL", "LL128", "Simple")
# getNetOverhead (us), the x86 Intel row (as `llMaxBw` across nodes): the floor of an intra-node
# ring step's latency when the ring spans nodes, x3 for Simple (tuning.cc).
_NET_OVERHEAD_US = 1.0
# llMaxBws (GB/s): one node by GPU architecture, the major compute capability of the slowest
# GPU (NCCL's minCompCap: Volta 7, Ampere 8, Hopper 9, Blackwell 10 and later; unknown: Hopper);
# across nodes the x86 Intel row (N2, N4+).
_LL_MAX_GBPS_ONE_NODE = {7: 39.0, 8: 87.7, 9: 141.0, 10: 2 * 141.0}
_LL_MAX_GBPS_NODES = (39.0, 20.4)
# treeCorrectionFactor[protocol][log2(bytes / 64)], 64 B to 256 MiB (`_tree_correction`).
_TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0,
           1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9,
              .9, .9, 1.0, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7,
               .8, .9, .9, .9),
}
KINDS = ("all-reduce", "reduce-scatter", "all-gather")
# NCCL_MAX_NVLS_ARITY (device.h): NVLS reduce-scatter and all-gather need at most this many
# local ranks (enqueue.cc `updateCollCostTable`).
_MAX_NVLS_ARITY = 32
OPS = ("sum", "avg")
"""Reduction ops: "sum" (`ReduceOp.SUM`), "avg" (`ReduceOp.AVG`, a float type's
`ncclDevPreMulSum`)."""


@dataclass(frozen=True, slots=True)
class CollectiveTopology:
    """What NCCL's choice depends on, for one group on an idle network.

    members: ranks n; nodes: K, the nodes they span (members of a node are consecutive);
    intra_rate / exit_rate: the slowest intra-node hop and node-exit hop of the ring (bytes/s;
    exit_rate is inf on one node, intra_rate inf with one member per node); step_latency_s: the
    ring's per-step latency (its slowest hop, s); intra_latency_s / inter_latency_s: the slowest
    intra-node and node-exit hop's step latency (s); intra_hw: "nvlink" or "pci";
    nvls_efficiency: NCCL's NVLS efficiency of the members' NVSwitch (None: no NVLink SHARP)."""

    members: int
    nodes: int
    intra_rate: float
    exit_rate: float
    step_latency_s: float
    intra_latency_s: float
    inter_latency_s: float
    intra_hw: str = "nvlink"
    nvls_efficiency: float | None = None
    lanes: int = 1
    """GPUs per member: a member stands for that many parallel communicators (one per TP
    rank), each moving 1/lanes of the bytes at 1/lanes of the rates."""
    compute_capability: int | None = None
    """The members' lowest major CUDA compute capability (NCCL's minCompCap; `GpuModel`), which
    picks the one-node `llMaxBw`; None: not known (Hopper's)."""
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    """The hash, found once: a planner's caches look NCCL's picks and bucket times up by
    topology thousands of times. Of numbers only (`intra_hw` as whether it is "pci", no
    NVLS or compute capability as -1), so the same in every process."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((
            self.members, self.nodes, self.intra_rate, self.exit_rate, self.step_latency_s,
            self.intra_latency_s, self.inter_latency_s, self.intra_hw == "pci",
            -1.0 if self.nvls_efficiency is None else self.nvls_efficiency, self.lanes,
            -1 if self.compute_capability is None else self.compute_capability)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def bus_rate(self) -> float:
        """The ring's bus bandwidth: its slowest hop (bytes/s)."""
        return min(self.intra_rate, self.exit_rate)

    @property
    def per_node(self) -> int:
        """Members on the fullest node."""
        return -(-self.members // self.nodes)


@dataclass(frozen=True, slots=True)
class Choice:
    """An (algorithm, protocol) with its latency (s) and bytes per intra-node hop and per node
    exit hop as multiples of N (already over the efficiency); `time_s` on the idle network."""

    algorithm: str
    protocol: str
    latency_s: float
    intra_share: float
    exit_share: float
    time_s: float


def _ratio(hw: str, algorithm: str, protocol: str) -> float:
    """NCCL's step latency of (algorithm, protocol) on `hw` over its ring/Simple step there."""
    table = _HW_LATENCY_US[hw]
    return table[algorithm][PROTOCOLS.index(protocol)] / table["ring"][2]


def _ll_cap(topo: CollectiveTopology) -> float:
    """llMaxBw in bytes/s, for all of a member's lanes (tuning.cc: one node by the GPUs'
    architecture, `compCapIndex`; across nodes by the CPU's)."""
    if topo.nodes == 1:
        cc = 9 if topo.compute_capability is None else min(max(topo.compute_capability, 7), 10)
        return _LL_MAX_GBPS_ONE_NODE[cc] * 1e9 * topo.lanes
    return _LL_MAX_GBPS_NODES[0 if topo.nodes <= 2 else 1] * 1e9 * topo.lanes


def _time(topo: CollectiveTopology, size: float, latency: float, intra: float, exit_: float) -> float:
    t = 0.0
    if topo.intra_rate < inf:
        t = intra * size / topo.intra_rate
    if topo.exit_rate < inf:
        t = max(t, exit_ * size / topo.exit_rate)
    return latency + t


def _ring(topo: CollectiveTopology, kind: str, protocol: str, size: float) -> Choice:
    """Ring: NCCL's steps, hierarchical (the 2(K-1) or K-1 steps that cross nodes at the
    network's latency, the others at the intra-node link's), every hop's share over the
    protocol's efficiency."""
    n, k = topo.members, topo.nodes
    steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
    inter = 0 if k == 1 else (2 * (k - 1) if kind == "all-reduce" else k - 1)
    # One member per node: every step crosses the network, priced as a tree step (tuning.cc).
    net = _ratio("net", "tree" if topo.per_node == 1 else "ring", protocol)
    intra = _ratio(topo.intra_hw, "ring", protocol)
    if k > 1:  # "inter-node rings still have to launch nsteps * net overhead"
        overhead = _NET_OVERHEAD_US * (3 if protocol == "Simple" else 1)
        intra = max(intra, overhead / _HW_LATENCY_US[topo.intra_hw]["ring"][2])
    latency = (steps - inter) * topo.intra_latency_s * intra + inter * topo.inter_latency_s * net
    eff = {"LL": 0.5, "LL128": 0.92, "Simple": 1.0}[protocol]
    if protocol == "LL":
        eff = min(eff, _ll_cap(topo) / topo.bus_rate)
    share = steps / n / eff
    return Choice("ring", protocol, latency, share, share,
                  _time(topo, size, latency, share, share))


def _tree(topo: CollectiveTopology, protocol: str, size: float) -> Choice:
    """Tree all-reduce: a chain inside each node, a double binary tree across nodes."""
    intra = "pci" if topo.intra_hw == "pci" else "nvlink"
    latency = 2 * ((topo.per_node - 1) * topo.intra_latency_s * _ratio(intra, "tree", protocol)
                   + floor(log2(topo.nodes)) * topo.inter_latency_s * _ratio("net", "tree", protocol))
    eff = 0.92
    if protocol == "LL":
        eff = min(eff / 3.8, _ll_cap(topo) / topo.bus_rate)
    elif protocol == "LL128":
        eff *= 120 / 128
    correction = _tree_correction(protocol, size / topo.lanes)
    share, exit_ = 2 / eff / correction, _tree_exit(topo) / eff / correction
    return Choice("tree", protocol, latency, share, exit_, _time(topo, size, latency, share, exit_))


def _tree_correction(protocol: str, lane_bytes: float) -> float:
    """NCCL's `treeCorrectionFactor` of the tree's bandwidth for `lane_bytes` per communicator,
    read as what its table is, samples at powers of two ("Powers of two, 64 B to 256MB",
    tuning.cc): entry i at 64 x 2^i bytes, linear in log2(size) between two samples, none (1)
    at 32 B and from 512 MiB on, where NCCL applies none. NCCL holds entry i up to the next
    power of two (`ncclTopoGetAlgoTime`), a step by which more bytes could take less time; the
    two agree at every power of two."""
    if not 32.0 < lane_bytes < 64.0 * 2.0 ** 23:
        return 1.0
    x = log2(lane_bytes / 64.0)
    i = floor(x)
    table = _TREE_CORRECTION[protocol]
    low = table[i] if i >= 0 else 1.0
    high = table[i + 1] if i + 1 < 23 else 1.0
    return low + (high - low) * (x - i)


def _tree_exit(topo: CollectiveTopology) -> float:
    """A node's network bytes in a double binary tree all-reduce, x N: 2 (N/2 up and N/2 down
    on each of its edges, three in the tree where it is inner, one where it is a leaf); 1 on
    two nodes, each tree a single edge (tuning.cc doubles NVLS-tree's inter-node rate there)."""
    return 1.0 if topo.nodes == 2 else 2.0


def _nvls(topo: CollectiveTopology, kind: str, size: float) -> Choice:
    """NVLink SHARP: one node (NVLS) or NVLS inside nodes and a tree across them (NVLS-tree)."""
    eff = topo.nvls_efficiency or 0.0
    ppn = topo.per_node
    intra = (1.0 if kind == "all-reduce" else (ppn - 1) / ppn) / eff
    latency = topo.intra_latency_s * _ratio("nvlink", "nvls", "Simple")
    if topo.nodes == 1:
        return Choice("nvls", "Simple", latency, intra, 0.0,
                      _time(topo, size, latency, intra, 0.0))
    latency = topo.intra_latency_s * _ratio("nvlink", "nvls-tree", "Simple") + \
        2 * floor(log2(topo.nodes)) * topo.inter_latency_s * _ratio("net", "nvls-tree", "Simple")
    exit_ = _tree_exit(topo)
    return Choice("nvls-tree", "Simple", latency, intra, exit_,
                  _time(topo, size, latency, intra, exit_))


def _pat(topo: CollectiveTopology, size: float) -> Choice:
    """PAT reduce-scatter / all-gather, one member per node."""
    latency = topo.inter_latency_s * (floor(log2(topo.nodes)) / 3.5 + topo.members * 2.8 / 14.0)
    share = 1 / 0.75
    return Choice("pat", "Simple", latency, share, share, _time(topo, size, latency, share, share))


def _protocols(topo: CollectiveTopology) -> tuple[str, ...]:
    """The protocols NCCL enables by default: LL128 only where a node's GPUs talk over NVLink
    (tuning.cc: `typeIntra <= PATH_NVB`; GPUs of one node on PCIe have PATH_PIX or farther, a
    lone GPU per node PATH_LOC)."""
    return ("LL", "Simple") if topo.intra_hw == "pci" and topo.per_node > 1 else PROTOCOLS


def candidates(topo: CollectiveTopology, kind: str, size_bytes: float,
               op: str = "sum") -> list[Choice]:
    """Every (algorithm, protocol) NCCL enables by default for this collective with reduction
    `op` (`OPS`), priced."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")
    if op not in OPS:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {OPS}")
    # PreMulSum (AVG): no NVLS kernels, no PAT reduce-scatter; an all-gather does not reduce.
    scaled = op == "avg" and kind != "all-gather"
    protocols = _protocols(topo)
    out = [_ring(topo, kind, p, size_bytes) for p in protocols]
    if kind == "all-reduce" and topo.nodes > 1:
        out += [_tree(topo, p, size_bytes) for p in protocols]
    if topo.nvls_efficiency and 1 < topo.per_node and not scaled and \
            (kind == "all-reduce" or topo.nodes == 1 and topo.per_node <= _MAX_NVLS_ARITY):
        out.append(_nvls(topo, kind, size_bytes))
    if kind != "all-reduce" and topo.nodes > 1 and topo.per_node == 1 and not scaled:
        out.append(_pat(topo, size_bytes))
    return out


@lru_cache(maxsize=4096)
def choose(topo: CollectiveTopology, kind: str, size_bytes: float, op: str = "sum") -> Choice:
    """NCCL's pick for reduction `op` (`OPS`): the candidate of least time (ties: ring/Simple
    before others, then the first); kept for the same arguments (a simulation asks once per
    bucket). The candidates' latencies and shares come from `_shapes`, a tree's shares
    corrected for the size as `_tree` does, their times from `_time` as `candidates` prices
    them."""
    if topo.members <= 1:
        return Choice("ring", "Simple", 0.0, 0.0, 0.0, 0.0)
    # `min` of (time, not ring/Simple) over the candidates, the first on a tie: a later
    # candidate wins when faster, ring/Simple also when as fast.
    intra_rate, exit_rate = topo.intra_rate, topo.exit_rate
    best, best_t, lane = None, inf, size_bytes / topo.lanes
    for shape in _shapes(topo, kind, op):
        algorithm, protocol, latency, intra, exit_ = shape
        if algorithm == "tree":
            correction = _tree_correction(protocol, lane)
            intra, exit_ = intra / correction, exit_ / correction
            shape = (algorithm, protocol, latency, intra, exit_)
        t = intra * size_bytes / intra_rate if intra_rate < inf else 0.0
        if exit_rate < inf:
            t_exit = exit_ * size_bytes / exit_rate
            t = t_exit if t_exit > t else t  # `max(t, t_exit)`
        t = latency + t
        if t < best_t or best is None or \
                (t == best_t and protocol == "Simple" and algorithm == "ring"):
            best, best_t = shape, t
    return Choice(*best, best_t)


@lru_cache(maxsize=1024)
def _shapes(topo: CollectiveTopology, kind: str, op: str
            ) -> tuple[tuple[str, str, float, float, float], ...]:
    """(algorithm, protocol, latency s, intra share, exit share) of `candidates` (reduction
    `op`), a tree's shares uncorrected (`_tree_correction` is 1 at size 0): nothing else of
    them depends on the size."""
    return tuple((c.algorithm, c.protocol, c.latency_s, c.intra_share, c.exit_share)
                 for c in candidates(topo, kind, 0.0, op))


def collective_time_s(topo: CollectiveTopology, kind: str, size_bytes: float,
                      op: str = "sum") -> float:
    """Seconds of the collective NCCL picks for reduction `op` (`OPS`), on an idle network."""
    return choose(topo, kind, size_bytes, op).time_s


def gradient_op(average_in_collective: bool) -> str:
    """The op of Megatron's data-parallel gradient reductions: "avg" with
    `--ddp-average-in-collective` (`Workload.average_in_collective`), else "sum" (Megatron-LM
    megatron/core/distributed/param_and_grad_buffer.py, `start_grad_sync`: `reduce_op =
    ReduceOp.AVG` if `ddp_config.average_in_collective`, the gradients otherwise pre-scaled
    by 1/DP and summed)."""
    return "avg" if average_in_collective else "sum"


@lru_cache(maxsize=1024)
def with_nvls(topo: CollectiveTopology | None, enabled: bool) -> CollectiveTopology | None:
    """`topo` as NCCL sees it under `NCCL_NVLS_ENABLE` (`Workload.nvls_enable`): itself when
    enabled (NCCL's default, 2: wherever the NVSwitch has NVLink SHARP), without NVLink SHARP
    when 0, so that no NVLS or NVLS-tree is a candidate. Kept: the same object for the same
    topology, as the planner's identity caches want."""
    if enabled or topo is None or topo.nvls_efficiency is None:
        return topo
    return replace(topo, nvls_efficiency=None)


def intra_hw(links) -> str:
    """NCCL's kind of the nodes' GPU links (`LinkModel`s): "pci" when any is PCIe, else
    "nvlink"."""
    return "pci" if any(link.pcie for link in links) else "nvlink"


def topology_of(hops, nodes: int, intra_hw: str = "nvlink",
                nvls_efficiency: float | None = None, lanes: int = 1,
                compute_capability: int | None = None) -> CollectiveTopology:
    """The topology of a ring whose hops are (leaves a node, rate bytes/s, step latency s), one per
    member, over `nodes` nodes; `intra_hw` and `nvls_efficiency` of its nodes' GPU link; `lanes`
    GPUs per member; `compute_capability` the members' lowest (None: not known)."""
    intra = [h for h in hops if not h[0]]
    exits = [h for h in hops if h[0]]
    rate, step = itemgetter(1), itemgetter(2)
    slowest = max(map(step, hops))
    return CollectiveTopology(
        len(hops), nodes, min(map(rate, intra), default=inf), min(map(rate, exits), default=inf),
        slowest, max(map(step, intra), default=slowest), max(map(step, exits), default=slowest),
        intra_hw, nvls_efficiency, lanes, compute_capability)


def leaves_node(links) -> bool:
    """Whether a hop's links (link id, weight) cross a NIC or an uplink."""
    return any(link[0] in ("nic", "uplink") for link, _ in links)
