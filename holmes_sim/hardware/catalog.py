"""Built-in GPU, NIC and intra-node link models, each with its source.

Values are the vendors' data-sheet figures. Efficiencies and latencies are modelling assumptions
(what fraction of line rate a collective library reaches, per-message software latency): they are
stated here with their basis and can be replaced per scenario (`catalog:` or per-NIC overrides) or
by a measured profile (`holmes-sim validate` writes one).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from holmes_sim.errors import FieldError
from holmes_sim.spec.hardware import CatalogSpec, GpuModelSpec
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
    benchmark_shape: tuple[int, int, int] | None = None
    """(m, n, k) of the best shape of the MAMF search whose maximum `compute_efficiency` is
    (None: no search known; the GEMM model then runs its main loop at `compute_efficiency`,
    unquantized). `cost.gemm.mainloop_efficiency` solves on the search's whole grid."""
    fp8_peak_flop_per_s: float | None = None
    """Dense FP8 tensor peak; None: no FP8 tensor cores."""
    fp8_compute_efficiency: float | None = None
    """As `compute_efficiency`, for FP8 GEMMs."""
    fp8_benchmark_shape: tuple[int, int, int] | None = None
    """As `benchmark_shape`, for FP8 GEMMs."""
    persistent_gemm: bool = False
    """cuBLAS runs warp-specialized persistent GEMM kernels that overlap each tile's pipeline fill
    with another tile's main loop (Hopper, Blackwell); False: data-parallel multistage kernels
    that pay fill and epilogue once per tile (Ampere)."""
    overlapped_epilogue: bool = True
    """With `persistent_gemm`: each tile's epilogue also runs beside another tile's main loop
    (Blackwell: accumulators double-buffered in tensor memory); False: the kernel's consumer warp
    groups store each tile with the tensor cores idle (Hopper's cooperative kernels,
    `cost.gemm.tile_overhead_s`)."""
    attention_rates: AttentionRates | None = None
    """Measured rates of the fused attention kernel the training stack runs on this GPU by
    default (`TrainingSpec.attention_backend` auto or fused), by sequence length; None:
    `attention_efficiency` at every length."""
    flash_attention_rates: AttentionRates | None = None
    """Measured rates of FlashAttention-2, the kernel `attention_backend: flash` runs; None:
    `attention_efficiency` at every length."""
    compute_capability: int | None = None
    """Major CUDA compute capability (8 Ampere, 9 Hopper, 10 Blackwell), which launch settings
    depend on; None: not known (GPUs declared in a scenario's catalog)."""
    nvlink: str | None = None
    """The intra-node link (`LINKS`) of the GPU's SXM boards, the default `intra_node` of its
    nodes: NVLink 3 on A100, 4 on H100 and H200, 5 on B200 and GB200 (data sheets); None: its
    nodes must name one."""


@dataclass(frozen=True, slots=True)
class AttentionRates:
    """A fused attention kernel's measured BF16 throughput (TFLOP/s, short boost-clock runs, the
    benchmark's own FLOP count: causal counted half) at sequence lengths `seq` (tokens), and the
    ratio of the GPU's sustained to burst tensor rate that turns them into training rates."""

    seq: tuple[int, ...]
    forward_causal_tflops: tuple[float, ...]
    forward_full_tflops: tuple[float, ...]
    backward_full_tflops: tuple[float, ...]
    sustained_ratio: float
    source: str


@dataclass(frozen=True, slots=True)
class GemmRate:
    """A GPU's GEMM rate at one precision: dense peak, the measured whole-kernel efficiency and
    the (m, n, k) it was measured at."""

    peak_flop_per_s: float
    measured_efficiency: float
    benchmark_shape: tuple[int, int, int] | None


def gemm_rate(gpu: GpuModel, fp8: bool = False) -> GemmRate:
    """The GPU's 16-bit (bf16/fp16) or FP8 GEMM rate."""
    if not fp8:
        return GemmRate(gpu.peak_flop_per_s, gpu.compute_efficiency, gpu.benchmark_shape)
    if gpu.fp8_peak_flop_per_s is None or gpu.fp8_compute_efficiency is None:
        raise FieldError("training.precision", f"GPU model '{gpu.name}' has no FP8 tensor rate; "
                                               "use bf16 or declare fp8_peak_tflops for it")
    return GemmRate(gpu.fp8_peak_flop_per_s, gpu.fp8_compute_efficiency, gpu.fp8_benchmark_shape)


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
    nvls_efficiency: float | None = None
    """NVLink SHARP (in-switch reduction, NCCL's NVLS algorithms): NCCL's `nvlsEfficiency` of
    the GPU generation, the fraction of the link's rate its NVLS kernels reach; None: none."""
    pcie: bool = False
    """The GPUs talk over PCIe, not NVLink: NCCL's PCI latencies and no LL128
    (`cost.nccl_algorithms.intra_hw`)."""

    @property
    def step_latency_s(self) -> float:
        """Latency of one ring-collective step over this link (s)."""
        return self.latency_s if self.collective_latency_s is None else self.collective_latency_s


# compute_efficiency is the GEMM rate a GPU sustains through a training run, over its data-sheet
# peak, measured as a whole kernel at one shape (benchmark_shape). Source: S. Bekman, "Machine
# Learning Engineering", compute/accelerator (mamf-finder.py and its MAMF tables: the best shape
# MxNxK and its rate in a short boost-clock burst). BF16: A100 SXM 271.2 of 312 TFLOP/s at
# 1024x10240x5120 (0.869); H100 SXM 794.5 of 989 at 2048x2048x13312 (0.803; "H200 is the same");
# B200 SXM 1745 of 2250 at 1792x16128x3072 (0.776); GB200 1822 of 2500 at 4096x9728x2048
# (0.729). FP8 (e4m3): H100 SXM 1402.6 of 1979 at 1024x9216x14336 (0.709); H200 SXM 1453.4 of
# 1979 at 1280x4096x12032 (0.734); B200 3432.5 of 4500 at 15360x4096x3072 (0.763); GB200 3615.6
# of 5000 at 19456x5120x1536 (0.723). Under sustained load the clock drops to its power limit:
# the maximum *sustained* rate (MSMF) measured on H200 is 702.9 TFLOP/s (0.711 of peak, 0.849 of
# its MAMF); B200 shows 0.840 of its MAMF. Hopper BF16: 0.711 measured. Others: MAMF x the
# sustained ratio of their architecture (Ampere: Hopper's 0.849 for want of an A100 MSMF;
# Blackwell: 0.840). Each is the maximum over the finder's search grid (`cost.gemm`).
# persistent_gemm: Hopper and Blackwell GEMMs are TMA warp-specialized persistent kernels (CUTLASS
# 3.x kernel schedules: a producer warp prefetches the next tile's k-blocks during the epilogue,
# and the ping-pong schedule runs one warp group's epilogue under the other's main loop: NVIDIA
# CUTLASS, "Efficient GEMM in CUDA", warp-specialized persistent ping-pong and cooperative
# kernels); Ampere's are multistage cp.async kernels, one tile per CTA.
# SM counts: data sheets / architecture whitepapers (GA100 in A100: 108; GH100 SXM: 132);
# Blackwell B200 and the B200 GPUs of GB200: 148 (CUDA device properties, multiProcessorCount).
# compute_capability: NVIDIA's CUDA GPU compute capability list (developer.nvidia.com/cuda-gpus):
# A100 8.0, H100 and H200 9.0, B200 and GB200 10.0.
# memory_efficiency 0.9: streaming kernels (BabelStream Triad) reach about 90% of the HBM
# data-sheet bandwidth on A100 and H100 (Deakin et al., BabelStream results).
# attention_efficiency: FlashAttention-2 reaches 50-73% of A100 peak (Dao 2023, arXiv
# 2307.08691), FlashAttention-3 up to 75% on H100 forward (Shah et al. 2024, arXiv 2407.08608),
# less in the backward: 0.6 where no kernel measurement by sequence length is in the catalog.
# attention_rates (Hopper): Transformer Engine, which Megatron-Core's attention runs through,
# prefers its cuDNN FusedAttention backend over FlashAttention on compute capability 9.0 and
# later ("Disabling FlashAttention to give FusedAttention preference on Hopper+",
# transformer_engine/pytorch attention backend selection, `get_attention_backend`). Its BF16
# rates on H100 SXM5, head dimension 128, 16k tokens per batch, are those of Shah et al. 2024
# (FlashAttention-3, arXiv 2407.08608, section 4.1, Figure 5 forward with and without the
# causal mask, Figure 6 backward without it), read at 512 ... 16k tokens. The same figures give
# FlashAttention-2 (flash-attn 2.x, what Transformer Engine 1.x runs with NVTE_FUSED_ATTN=0 or
# Megatron-Core's `--attention-backend flash`) at the same lengths.
_HOPPER_SUSTAINED = 0.849
_HOPPER_CUDNN_ATTENTION = AttentionRates(
    seq=(512, 1024, 2048, 4096, 8192, 16384),
    forward_causal_tflops=(315, 410, 484, 518, 529, 539),
    forward_full_tflops=(497, 574, 617, 609, 600, 595),
    backward_full_tflops=(305, 408, 465, 499, 518, 516),
    sustained_ratio=_HOPPER_SUSTAINED,
    source="cuDNN fused attention on H100 SXM5, BF16, head dim 128 (Shah et al. 2024, "
           "arXiv 2407.08608, Figures 5 and 6)")
_HOPPER_FLASH_ATTENTION_2 = AttentionRates(
    seq=(512, 1024, 2048, 4096, 8192, 16384),
    forward_causal_tflops=(191, 260, 298, 319, 333, 335),
    forward_full_tflops=(309, 350, 362, 368, 370, 370),
    backward_full_tflops=(214, 260, 291, 310, 318, 322),
    sustained_ratio=_HOPPER_SUSTAINED,
    source="FlashAttention-2 on H100 SXM5, BF16, head dim 128 (Shah et al. 2024, "
           "arXiv 2407.08608, Figures 5 and 6)")
_HOPPER_ATTENTION = (_HOPPER_CUDNN_ATTENTION, _HOPPER_FLASH_ATTENTION_2)
_BLACKWELL_SUSTAINED = 0.840
_A100 = "NVIDIA A100 Tensor Core GPU data sheet (2021): 312 TFLOP/s dense BF16, 108 SMs"
_H100 = ("NVIDIA H100 Tensor Core GPU data sheet (2023), SXM: 989 TFLOP/s dense BF16, 1,979 FP8, "
         "80 GB HBM3, 3.35 TB/s, 132 SMs")
_H200 = ("NVIDIA H200 Tensor Core GPU data sheet (2024), SXM: 989 TFLOP/s dense BF16, 1,979 FP8, "
         "141 GB HBM3e, 4.8 TB/s, 132 SMs")
_B200 = ("NVIDIA HGX B200 data sheet (2024), per GPU: 2.25 PFLOP/s dense BF16, 4.5 FP8, 180 GB "
         "HBM3e, 8 TB/s")
_GB200 = ("NVIDIA GB200 NVL72 data sheet (2024), per GPU (1/72 of the rack): 2.5 PFLOP/s dense "
          "BF16, 5 FP8, 186 GB HBM3e, 8 TB/s")


def _a100(name: str, memory_gb: float, bandwidth_gbyte_per_s: float, hbm: str) -> GpuModel:
    return GpuModel(name, tflops_to_flop_per_s(312), gib_to_bytes(memory_gb),
                    gbyte_per_s_to_bytes_per_s(bandwidth_gbyte_per_s), 0.738,
                    f"{_A100}, {memory_gb:.0f} GB {hbm}, {bandwidth_gbyte_per_s:,.0f} GB/s",
                    sm_count=108, benchmark_shape=(1024, 10240, 5120), compute_capability=8,
                    nvlink="nvlink3")


def _modern(name: str, bf16: tuple[float, float, tuple[int, int, int]],
            fp8: tuple[float, float, tuple[int, int, int]], memory_gb: float,
            bandwidth_gbyte_per_s: float, sm_count: int, source: str,
            attention: tuple[AttentionRates, AttentionRates] | None = None,
            overlapped_epilogue: bool = True, compute_capability: int = 10) -> GpuModel:
    """A GPU with BF16 and FP8 tensor cores and persistent GEMM kernels: each rate as (peak
    TFLOP/s, efficiency, shape); `attention`: the default fused kernel's rates and
    FlashAttention-2's."""
    return GpuModel(name, tflops_to_flop_per_s(bf16[0]), gib_to_bytes(memory_gb),
                    gbyte_per_s_to_bytes_per_s(bandwidth_gbyte_per_s), bf16[1], source,
                    sm_count=sm_count, benchmark_shape=bf16[2],
                    fp8_peak_flop_per_s=tflops_to_flop_per_s(fp8[0]), fp8_compute_efficiency=fp8[1],
                    fp8_benchmark_shape=fp8[2], persistent_gemm=True,
                    overlapped_epilogue=overlapped_epilogue,
                    attention_rates=attention[0] if attention else None,
                    flash_attention_rates=attention[1] if attention else None,
                    compute_capability=compute_capability,
                    nvlink="nvlink4" if compute_capability == 9 else "nvlink5")


GPUS: dict[str, GpuModel] = {
    "a100-40gb": _a100("a100-40gb", 40, 1555, "HBM2"),
    "a100-80gb": _a100("a100-80gb", 80, 2039, "HBM2e"),
    "h100-sxm": _modern("h100-sxm", (989, 0.711, (2048, 2048, 13312)),
                        (1979, round(0.709 * _HOPPER_SUSTAINED, 3), (1024, 9216, 14336)),
                        80, 3350, 132, _H100, _HOPPER_ATTENTION, overlapped_epilogue=False,
                        compute_capability=9),
    "h200": _modern("h200", (989, 0.711, (2048, 2048, 13312)),
                    (1979, round(0.734 * _HOPPER_SUSTAINED, 3), (1280, 4096, 12032)),
                    141, 4800, 132, _H200, _HOPPER_ATTENTION, overlapped_epilogue=False,
                    compute_capability=9),
    "b200": _modern("b200", (2250, round(0.776 * _BLACKWELL_SUSTAINED, 3), (1792, 16128, 3072)),
                    (4500, round(0.763 * _BLACKWELL_SUSTAINED, 3), (15360, 4096, 3072)),
                    180, 8000, 148, _B200),
    "gb200": _modern("gb200", (2500, round(0.729 * _BLACKWELL_SUSTAINED, 3), (4096, 9728, 2048)),
                     (5000, round(0.723 * _BLACKWELL_SUSTAINED, 3), (19456, 5120, 1536)),
                     186, 8000, 148, _GB200),
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
    "connectx-7": NicModel("connectx-7", "ib", gbit_per_s_to_bytes_per_s(400), us_to_s(10), 0.92,
                           "NVIDIA ConnectX-7 data sheet: InfiniBand NDR 400 Gb/s per port"),
    "connectx-8": NicModel("connectx-8", "ib", gbit_per_s_to_bytes_per_s(800), us_to_s(10), 0.92,
                           "NVIDIA ConnectX-8 SuperNIC data sheet: InfiniBand XDR 800 Gb/s"),
    "roce-100g": NicModel("roce-100g", "roce", gbit_per_s_to_bytes_per_s(100), us_to_s(12), 0.90,
                          "NVIDIA ConnectX-6 Dx data sheet, 100 GbE RoCEv2"),
    "roce-200g": NicModel("roce-200g", "roce", gbit_per_s_to_bytes_per_s(200), us_to_s(12), 0.90,
                          "NVIDIA ConnectX-6 Dx data sheet, 200 GbE RoCEv2"),
    "eth-10g": NicModel("eth-10g", "ethernet", gbit_per_s_to_bytes_per_s(10), us_to_s(50), 0.9, _ETH),
    "eth-25g": NicModel("eth-25g", "ethernet", gbit_per_s_to_bytes_per_s(25), us_to_s(50), 0.8, _ETH),
    "eth-100g": NicModel("eth-100g", "ethernet", gbit_per_s_to_bytes_per_s(100), us_to_s(50), 0.6, _ETH),
}

# Per-GPU, per-direction bandwidth. NVLink 3 (A100): 600 GB/s total = 300 GB/s each way; NVLink 4
# (H100/H200): 900 GB/s total = 450 each way; NVLink 5 (B200, GB200): 1.8 TB/s total = 900 each
# way (NVIDIA data sheets). PCIe 4/5 x16: 32/64 GB/s each way (PCI-SIG). Efficiency 0.77:
# nccl-tests all-reduce bus bandwidth on DGX A100 ~230 of 300 GB/s, kept for NVLink 4/5.
# NVSwitch domain: a node's GPUs share its intra-node link (`gpus_per_node`): 8 on HGX/DGX
# H100, H200 and B200 boards; 72 in a GB200 NVL72 rack, whose NVLink Switch trays connect all 72
# GPUs at the full NVLink 5 rate (NVIDIA GB200 NVL72 data sheet: 130 TB/s NVLink domain), so the
# rack is one 72-GPU node: `gpus_per_node: 72, intra_node: nvlink5, gpu: gb200`.
# NVLink SHARP: third-generation NVSwitch (HGX/DGX H100 and H200) and the fourth-generation
# NVLink Switch (HGX B200, GB200 NVL72) reduce in the switch (NVIDIA NVLink and NVSwitch page and
# DGX H100 / GB200 NVL72 data sheets: "NVIDIA SHARP in-network reductions"; second-generation
# NVSwitch, A100, has none). nvls_efficiency: NCCL src/graph/tuning.cc `nvlsEfficiency`, Hopper
# 0.85, Blackwell 0.74.
LINKS: dict[str, LinkModel] = {
    "nvlink3": LinkModel("nvlink3", gbyte_per_s_to_bytes_per_s(300), us_to_s(3), 0.77,
                         "NVIDIA A100 data sheet: NVLink 600 GB/s"),
    "nvlink4": LinkModel("nvlink4", gbyte_per_s_to_bytes_per_s(450), us_to_s(3), 0.77,
                         "NVIDIA H100 data sheet: NVLink 900 GB/s; NVSwitch gen3 with SHARP",
                         nvls_efficiency=0.85),
    "nvlink5": LinkModel("nvlink5", gbyte_per_s_to_bytes_per_s(900), us_to_s(3), 0.77,
                         "NVIDIA HGX B200 / GB200 NVL72 data sheets: NVLink 5, 1.8 TB/s per GPU; "
                         "NVLink Switch with SHARP", nvls_efficiency=0.74),
    "pcie4": LinkModel("pcie4", gbyte_per_s_to_bytes_per_s(32), us_to_s(5), 0.8,
                       "PCI-SIG PCIe 4.0 x16", pcie=True),
    "pcie5": LinkModel("pcie5", gbyte_per_s_to_bytes_per_s(64), us_to_s(5), 0.8,
                       "PCI-SIG PCIe 5.0 x16", pcie=True),
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
    """Merge the scenario's catalog entries over the built-in ones. An entry that re-declares a
    built-in one keeps what its fields cannot say: a GPU's compute capability and what
    `declared_gpu` keeps, a link's NVLink SHARP and, unless its `type` says, whether it is PCIe
    (a new link: if its name starts with "pcie")."""
    gpus = dict(GPUS)
    for name, g in spec.gpus.items():
        gpus[name] = declared_gpu(name, g)
    nics = dict(NICS)
    for name, n in spec.nics.items():
        nics[name] = NicModel(name, n.type, gbit_per_s_to_bytes_per_s(n.bandwidth_gbit_per_s),
                              us_to_s(n.latency_us), n.efficiency, n.source)
    links = dict(LINKS)
    for name, lk in spec.links.items():
        base = LINKS.get(name)
        pcie = lk.type == "pcie" if lk.type is not None else \
            base.pcie if base is not None else name.startswith("pcie")
        nvls = None if base is None or pcie else base.nvls_efficiency
        links[name] = LinkModel(name, gbyte_per_s_to_bytes_per_s(lk.bandwidth_gbyte_per_s),
                                us_to_s(lk.latency_us), lk.efficiency, lk.source,
                                nvls_efficiency=nvls, pcie=pcie)
    for name, g in spec.gpus.items():  # a GPU's default link, checked where it is written
        if g.intra_node is not None:
            _lookup(links, g.intra_node, f"catalog.gpus.{name}.intra_node", "intra-node link",
                    "catalog.links")
    return Catalog(gpus, nics, links)


_NEW_GPU = GpuModel("", 0.0, 0.0, 0.0, 0.8, "")
"""What a GPU declared under a new name gets for each optional field left out."""


def declared_gpu(name: str, g: GpuModelSpec) -> GpuModel:
    """The catalog's model of a GPU declared in a scenario: its stated fields over the built-in
    GPU of the same name (`_NEW_GPU`'s defaults for a new name). A built-in's GEMM search shape
    goes with its measured efficiency and its fused attention rates with attention_efficiency:
    each is kept unless that field is given."""
    base = GPUS.get(name, _NEW_GPU)
    _check_data_sheet(name, g, base)
    efficiency = _given(g.compute_efficiency, base.compute_efficiency)
    fp8_efficiency = _given(g.fp8_compute_efficiency, base.fp8_compute_efficiency, efficiency)
    fp8_peak = _given_as(g.fp8_peak_tflops, tflops_to_flop_per_s, base.fp8_peak_flop_per_s)
    measured = g.attention_efficiency is None  # else the stated efficiency at every length
    return replace(
        base, name=name, peak_flop_per_s=_given_as(g.peak_tflops, tflops_to_flop_per_s,
                                                   base.peak_flop_per_s),
        memory_bytes=_given_as(g.memory_gib, gib_to_bytes, base.memory_bytes),
        memory_bandwidth_bytes_per_s=_given_as(g.memory_bandwidth_gbyte_per_s,
                                               gbyte_per_s_to_bytes_per_s,
                                               base.memory_bandwidth_bytes_per_s),
        compute_efficiency=efficiency, source=g.source, sm_count=_given(g.sm_count, base.sm_count),
        memory_efficiency=_given(g.memory_efficiency, base.memory_efficiency),
        attention_efficiency=_given(g.attention_efficiency, base.attention_efficiency),
        benchmark_shape=base.benchmark_shape if g.compute_efficiency is None else None,
        fp8_peak_flop_per_s=fp8_peak, fp8_compute_efficiency=fp8_efficiency if fp8_peak else None,
        fp8_benchmark_shape=base.fp8_benchmark_shape if g.fp8_compute_efficiency is None else None,
        persistent_gemm=_given(g.persistent_gemm, base.persistent_gemm),
        overlapped_epilogue=_given(g.overlapped_epilogue, base.overlapped_epilogue),
        nvlink=g.intra_node or base.nvlink,
        attention_rates=base.attention_rates if measured else None,
        flash_attention_rates=base.flash_attention_rates if measured else None)


def _check_data_sheet(name: str, g: GpuModelSpec, base: GpuModel) -> None:
    """A GPU under a new name must state its data-sheet figures; a built-in one keeps its own."""
    if base is not _NEW_GPU:
        return
    for field, what in (("peak_tflops", "its dense BF16/FP16 peak in TFLOP/s"),
                        ("memory_gib", "its HBM capacity in GiB"),
                        ("memory_bandwidth_gbyte_per_s", "its HBM bandwidth in GB/s")):
        if getattr(g, field) is None:
            raise FieldError(f"catalog.gpus.{name}.{field}",
                             f"required for a GPU that is not built in: give {what} "
                             f"(built-in GPUs, which may leave it out: {', '.join(GPUS)})")


def _given_as(value, convert, inherited):
    """`convert(value)`, or `inherited` when the value is not given."""
    return inherited if value is None else convert(value)


def _given(*values):
    """The first value that is not None."""
    return next((v for v in values if v is not None), None)


def _lookup(table: dict, name: str, path: str, what: str, where: str):
    if name not in table:
        raise FieldError(path, f"unknown {what} '{name}' (known: {', '.join(table)}); "
                               f"use one of these or declare it under {where}")
    return table[name]
