"""Built-in GPU, NIC and intra-node link models, each with its source.

Values are the vendors' data-sheet figures. Efficiencies and latencies are modelling assumptions
(what fraction of line rate a collective library reaches, per-message software latency): they are
stated here with their basis and can be replaced per scenario (`catalog:` or per-NIC overrides) or
by a measured profile (`holmes-sim validate` writes one).
"""

from __future__ import annotations

from dataclasses import dataclass

from holmes_sim.errors import FieldError
from holmes_sim.spec.hardware import CatalogSpec
from holmes_sim.units import (
    gbit_per_s_to_bytes_per_s,
    gbyte_per_s_to_bytes_per_s,
    gib_to_bytes,
    tflops_to_flop_per_s,
    us_to_s,
)


@dataclass(frozen=True, slots=True)
class GpuModel:
    """A GPU model in SI units."""

    name: str
    peak_flop_per_s: float
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    compute_efficiency: float
    """Fraction of the dense peak that well-shaped GEMMs sustain in training (measured MSMF)."""
    source: str
    sm_count: int | None = None
    """Streaming multiprocessors (wave quantization); None: no quantization."""
    memory_efficiency: float = 0.9
    """Achievable fraction of HBM bandwidth for streaming (memory-bound) kernels."""
    attention_efficiency: float = 0.6
    """Achieved fraction of peak of a fused (flash) attention kernel."""


@dataclass(frozen=True, slots=True)
class NicModel:
    """A NIC model in SI units; `efficiency` is the achievable fraction of line rate."""

    name: str
    type: str
    bandwidth_bytes_per_s: float
    latency_s: float
    efficiency: float
    source: str


@dataclass(frozen=True, slots=True)
class LinkModel:
    """An intra-node GPU link (per GPU, each direction) in SI units. `collective_latency_s`:
    the measured software cost of one ring-collective step over it, when calibrated (None:
    `latency_s`), as `cluster.Nic` keeps for NICs."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    efficiency: float
    source: str
    collective_latency_s: float | None = None

    @property
    def step_latency_s(self) -> float:
        """Latency of one ring-collective step over this link (s)."""
        return self.latency_s if self.collective_latency_s is None else self.collective_latency_s


# compute_efficiency is the GEMM rate a GPU sustains through a training run, over its data-sheet
# peak. Source: S. Bekman, "Machine Learning Engineering", compute/accelerator (mamf-finder.py
# and its results table). MAMF, the best shape's rate in a short boost-clock burst: A100 SXM
# 271.2 of 312 TFLOP/s BF16 (0.869), H100 SXM 794.5 of 989 (0.803; "H200 is the same"). Under
# sustained load the clock drops to its power limit: the maximum *sustained* rate (MSMF) measured
# on H200 is 702.9 TFLOP/s (0.711 of peak, 0.849 of its MAMF); B200 shows the same ratio (0.840).
# Hopper: 0.711 measured. A100 (no MSMF published): its MAMF x the measured 0.849 = 0.738.
# SM counts: data sheets / architecture whitepapers (GA100 in A100: 108; GH100 SXM: 132).
# memory_efficiency 0.9: streaming kernels (BabelStream Triad) reach about 90% of the HBM
# data-sheet bandwidth on A100 and H100 (Deakin et al., BabelStream results).
# attention_efficiency: FlashAttention-2 reaches 50-73% of A100 peak (Dao 2023, arXiv
# 2307.08691), FlashAttention-3 up to 75% on H100 forward (Shah et al. 2024, arXiv 2407.08608),
# less in the backward: 0.6 for both.
_A100 = "NVIDIA A100 Tensor Core GPU data sheet (2021): 312 TFLOP/s dense BF16, 108 SMs"
_H100 = "NVIDIA H100 Tensor Core GPU data sheet (2023), SXM: 989 TFLOP/s dense BF16, 3.35 TB/s, 132 SMs"
_H200 = "NVIDIA H200 Tensor Core GPU data sheet (2024): 989 TFLOP/s dense BF16, 141 GB, 4.8 TB/s"
GPUS: dict[str, GpuModel] = {
    "a100-40gb": GpuModel("a100-40gb", tflops_to_flop_per_s(312), gib_to_bytes(40),
                          gbyte_per_s_to_bytes_per_s(1555), 0.738, _A100 + ", 40 GB HBM2, 1,555 GB/s",
                          sm_count=108),
    "a100-80gb": GpuModel("a100-80gb", tflops_to_flop_per_s(312), gib_to_bytes(80),
                          gbyte_per_s_to_bytes_per_s(2039), 0.738,
                          _A100 + ", 80 GB HBM2e, 2,039 GB/s", sm_count=108),
    "h100-sxm": GpuModel("h100-sxm", tflops_to_flop_per_s(989), gib_to_bytes(80),
                         gbyte_per_s_to_bytes_per_s(3350), 0.711, _H100, sm_count=132),
    "h200": GpuModel("h200", tflops_to_flop_per_s(989), gib_to_bytes(141),
                     gbyte_per_s_to_bytes_per_s(4800), 0.711, _H200, sm_count=132),
}

# Line rates: IBTA / NVIDIA ConnectX data sheets (EDR 100, HDR 200, NDR 400 Gb/s) and IEEE 802.3.
# RDMA efficiency 0.92: nccl-tests bus bandwidth on HDR reaches about 23 of 25 GB/s.
# TCP efficiency: NCCL's socket transport (multiple sockets per peer) reaches most of a 10-25 GbE
# link but well under line rate at 100 GbE (kernel copies, one core per stream): 0.9 / 0.8 / 0.6.
# Latency: per-message software + wire latency of a collective step, the order of NCCL's own
# tuning constants (src/graph/tuning.cc): ~10 us over RDMA, tens of us over sockets.
_IB = "IBTA spec / NVIDIA ConnectX-6/7 data sheets"
_ETH = "IEEE 802.3 line rate; TCP efficiency is a modelling assumption (see catalog.py)"
NICS: dict[str, NicModel] = {
    "ib-edr": NicModel("ib-edr", "ib", gbit_per_s_to_bytes_per_s(100), us_to_s(10), 0.92,
                       _IB + ", EDR 100 Gb/s"),
    "ib-hdr": NicModel("ib-hdr", "ib", gbit_per_s_to_bytes_per_s(200), us_to_s(10), 0.92,
                       _IB + ", HDR 200 Gb/s"),
    "ib-ndr": NicModel("ib-ndr", "ib", gbit_per_s_to_bytes_per_s(400), us_to_s(10), 0.92,
                       _IB + ", NDR 400 Gb/s"),
    "roce-100g": NicModel("roce-100g", "roce", gbit_per_s_to_bytes_per_s(100), us_to_s(12), 0.90,
                          "NVIDIA ConnectX-6 Dx data sheet, 100 GbE RoCEv2"),
    "roce-200g": NicModel("roce-200g", "roce", gbit_per_s_to_bytes_per_s(200), us_to_s(12), 0.90,
                          "NVIDIA ConnectX-6 Dx data sheet, 200 GbE RoCEv2"),
    "eth-10g": NicModel("eth-10g", "ethernet", gbit_per_s_to_bytes_per_s(10), us_to_s(50), 0.9, _ETH),
    "eth-25g": NicModel("eth-25g", "ethernet", gbit_per_s_to_bytes_per_s(25), us_to_s(50), 0.8, _ETH),
    "eth-100g": NicModel("eth-100g", "ethernet", gbit_per_s_to_bytes_per_s(100), us_to_s(50), 0.6, _ETH),
}

# Per-GPU, per-direction bandwidth. NVLink 3 (A100): 600 GB/s total = 300 GB/s each way; NVLink 4
# (H100/H200): 900 GB/s total = 450 each way (NVIDIA data sheets). PCIe 4/5 x16: 32/64 GB/s each
# way (PCI-SIG). Efficiency 0.77: nccl-tests all-reduce bus bandwidth on DGX A100 ~230 of 300 GB/s.
LINKS: dict[str, LinkModel] = {
    "nvlink3": LinkModel("nvlink3", gbyte_per_s_to_bytes_per_s(300), us_to_s(3), 0.77,
                         "NVIDIA A100 data sheet: NVLink 600 GB/s"),
    "nvlink4": LinkModel("nvlink4", gbyte_per_s_to_bytes_per_s(450), us_to_s(3), 0.77,
                         "NVIDIA H100 data sheet: NVLink 900 GB/s"),
    "pcie4": LinkModel("pcie4", gbyte_per_s_to_bytes_per_s(32), us_to_s(5), 0.8, "PCI-SIG PCIe 4.0 x16"),
    "pcie5": LinkModel("pcie5", gbyte_per_s_to_bytes_per_s(64), us_to_s(5), 0.8, "PCI-SIG PCIe 5.0 x16"),
}


@dataclass(frozen=True, slots=True)
class Catalog:
    """The built-in entries merged with a scenario's own (the scenario's win)."""

    gpus: dict[str, GpuModel]
    nics: dict[str, NicModel]
    links: dict[str, LinkModel]

    def gpu(self, name: str, path: str) -> GpuModel:
        return _lookup(self.gpus, name, path, "GPU model", "catalog.gpus")

    def nic(self, name: str, path: str) -> NicModel:
        return _lookup(self.nics, name, path, "NIC model", "catalog.nics")

    def link(self, name: str, path: str) -> LinkModel:
        return _lookup(self.links, name, path, "intra-node link", "catalog.links")


def build_catalog(spec: CatalogSpec) -> Catalog:
    """Merge the scenario's catalog entries over the built-in ones."""
    gpus = dict(GPUS)
    for name, g in spec.gpus.items():
        gpus[name] = GpuModel(name, tflops_to_flop_per_s(g.peak_tflops), gib_to_bytes(g.memory_gib),
                              gbyte_per_s_to_bytes_per_s(g.memory_bandwidth_gbyte_per_s),
                              g.compute_efficiency, g.source, g.sm_count, g.memory_efficiency,
                              g.attention_efficiency)
    nics = dict(NICS)
    for name, n in spec.nics.items():
        nics[name] = NicModel(name, n.type, gbit_per_s_to_bytes_per_s(n.bandwidth_gbit_per_s),
                              us_to_s(n.latency_us), n.efficiency, n.source)
    links = dict(LINKS)
    for name, lk in spec.links.items():
        links[name] = LinkModel(name, gbyte_per_s_to_bytes_per_s(lk.bandwidth_gbyte_per_s),
                                us_to_s(lk.latency_us), lk.efficiency, lk.source)
    return Catalog(gpus, nics, links)


def _lookup(table: dict, name: str, path: str, what: str, where: str):
    if name not in table:
        raise FieldError(path, f"unknown {what} '{name}' (known: {', '.join(table)}); "
                               f"use one of these or declare it under {where}")
    return table[name]
