"""Time of one (batched) GEMM on a GPU: tile and wave quantization under a roofline.

A GEMM C[m x n] = A[m x k] B[k x n] is split into output tiles, one thread block each; the GPU runs
`sm_count` blocks at a time, so the work is done in ceil(tiles / SMs) waves and a last partial
wave leaves SMs idle (wave quantization), and a tile that overhangs the matrix computes padding
(tile quantization). cuBLAS on Ampere/Hopper uses 128x256 / 256x128 / 128x128 CTA tiles for large
half-precision GEMMs (Anthony et al., "The Case for Co-Designing Model Architectures with
Hardware", arXiv 2401.14489, section 4; NVIDIA, "Matrix Multiplication Background User's Guide",
Deep Learning Performance documentation). On a GPU whose GEMMs are data-parallel multistage
kernels (Ampere) each tile also pays a fixed pipeline fill and epilogue (`tile_overhead_s`)
besides its main loop, so the rate rises with k; persistent warp-specialized kernels hide the
fill under the previous tile, and Blackwell's the epilogue too, while Hopper's cooperative
kernels store each tile with the tensor cores idle. The result is bounded below
by the time to stream the operands and the output through HBM (roofline, Williams et al., CACM
2009), which is what limits the small-k batched GEMMs of attention.

The catalog's GEMM efficiency is a whole-kernel measurement: the maximum of S. Bekman's MAMF
finder over its search grid of shapes, fill, epilogue and waves included. The main loop's rate
is derived from it (`mainloop_efficiency`) so that this model's fastest shape of that grid runs
at exactly the measured rate: nothing is counted twice, and no grid shape beats the measured
maximum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from holmes_sim.hardware.catalog import GpuModel, gemm_rate

_TILES: tuple[tuple[int, int], ...] = ((128, 256), (256, 128), (128, 128))
_K_BLOCK = 32
"""k-depth of one pipeline stage of the Ampere/Hopper half-precision CTA tiles (CUTLASS defaults)."""
_FILL_STAGES = 2
"""k-blocks loaded before the first MMA of a 3-stage cp.async pipeline."""
_FP8_BYTES = (1, 2)
"""Bytes per operand and per output element of an FP8 GEMM: E4M3/E5M2 inputs, bf16 output
(Transformer Engine's FP8 linear layers)."""


@dataclass(frozen=True, slots=True)
class Gemm:
    """`batch` independent GEMMs of m x n outputs with inner dimension k."""

    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def flop(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch

    def operand_bytes(self, dtype_bytes: int, output_bytes: int | None = None) -> float:
        """Bytes read (A, B, `dtype_bytes` each element) and written (C, `output_bytes`, default
        the same) once each."""
        out = dtype_bytes if output_bytes is None else output_bytes
        return self.batch * (dtype_bytes * (self.m * self.k + self.k * self.n) + out * self.m * self.n)

    def backward(self) -> tuple[Gemm, Gemm]:
        """Input gradient dA = dC B^T (m x k, inner n) and weight gradient dB = A^T dC (k x n,
        inner m)."""
        return Gemm(self.m, self.k, self.n, self.batch), Gemm(self.k, self.n, self.m, self.batch)


def quantization_efficiency(gemm: Gemm, sm_count: int | None) -> float:
    """Useful fraction of the SM time the GEMM occupies, with the best of the CTA tiles."""
    if sm_count is None:
        return 1.0
    return max(_tile_efficiency(gemm, tm, tn, sm_count) for tm, tn in _TILES)


def _waves(gemm: Gemm, tm: int, tn: int, sm_count: int) -> int:
    """Waves of tm x tn output tiles, `sm_count` at a time."""
    return math.ceil(math.ceil(gemm.m / tm) * math.ceil(gemm.n / tn) * gemm.batch / sm_count)


def _tile_efficiency(gemm: Gemm, tm: int, tn: int, sm_count: int) -> float:
    return gemm.m * gemm.n * gemm.batch / (_waves(gemm, tm, tn, sm_count) * sm_count * tm * tn)


def fill_s(gpu: GpuModel, tm: int, tn: int, k: int, nbytes: tuple[int, int]) -> float:
    """Seconds one SM spends filling a tm x tn tile's software pipeline before its first MMA:
    `_FILL_STAGES` k-blocks of A and B (or all of k when shorter) at the SM's share of HBM
    bandwidth (NVIDIA CUTLASS, "Efficient GEMM in CUDA": software pipelining). `nbytes`: bytes
    per operand element and per output element."""
    fill_blocks = min(_FILL_STAGES, math.ceil(k / _K_BLOCK))
    return nbytes[0] * fill_blocks * (tm + tn) * _K_BLOCK * _sm_seconds_per_byte(gpu)


def epilogue_s(gpu: GpuModel, tm: int, tn: int, nbytes: tuple[int, int]) -> float:
    """Seconds one SM spends storing a tm x tn tile's outputs after its main loop, at the SM's
    share of HBM bandwidth (CUTLASS, "Efficient GEMM in CUDA": epilogue)."""
    return nbytes[1] * tm * tn * _sm_seconds_per_byte(gpu)


def _sm_seconds_per_byte(gpu: GpuModel) -> float:
    return gpu.sm_count / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency)


def fill_epilogue_s(gpu: GpuModel, tm: int, tn: int, k: int, nbytes: tuple[int, int]) -> float:
    """Seconds one SM spends on a tm x tn tile outside its main loop, with its tensor cores idle
    unless another tile's main loop runs beside them: the pipeline fill and the epilogue."""
    return fill_s(gpu, tm, tn, k, nbytes) + epilogue_s(gpu, tm, tn, nbytes)


def tile_overhead_s(gpu: GpuModel, tm: int, tn: int, k: int, nbytes: tuple[int, int]) -> float:
    """Seconds of a tile's fill and epilogue that every tile pays with the tensor cores idle.
    Data-parallel multistage kernels (Ampere) pay both: one CTA per SM at a time (a 128x256
    tile's fp32 accumulators take half the register file) leaves nothing to hide them under,
    once per tile and wave (Osama et al., "Stream-K", PPoPP 2023, section 2). Persistent
    warp-specialized kernels (`GpuModel.persistent_gemm`) hide the fill: the producer warp's TMA
    loads the next tile's first k-blocks while the consumers finish the last one. Hopper's
    cooperative kernels still pay the epilogue (`GpuModel.overlapped_epilogue` False): both
    consumer warp groups split one tile and store it before starting the next one's MMAs, where
    only the ping-pong schedule runs one group's epilogue beside the other's math (CUTLASS,
    "Efficient GEMM in CUDA", Hopper warp specialization); cuBLAS's sm90 kernels for large
    GEMMs are of the two-group kind (kernel names `..._tilesize256x128x64_warpgroupsize2x1x1_...`
    in profiler traces). Blackwell double-buffers the accumulators in tensor memory and drains
    one while the MMAs fill the other, so neither is paid per tile."""
    return _overheads(gpu, tm, tn, k, nbytes)[0]


def kernel_overhead_s(gpu: GpuModel, tm: int, tn: int, k: int, nbytes: tuple[int, int]) -> float:
    """Seconds a persistent GEMM pays once per kernel on every SM: its first tile's fill, before
    there is a main loop to prefetch under, and, where epilogues overlap the next tile's math,
    its last tile's epilogue, after the last main loop. None on data-parallel kernels, which pay
    both per tile (`tile_overhead_s`)."""
    return _overheads(gpu, tm, tn, k, nbytes)[1]


def _overheads(gpu: GpuModel, tm: int, tn: int, k: int, nbytes: tuple[int, int]
               ) -> tuple[float, float]:
    """(`tile_overhead_s`, `kernel_overhead_s`) in one pass: the planner prices thousands of
    GEMMs from cold caches."""
    fill, epilogue = fill_s(gpu, tm, tn, k, nbytes), epilogue_s(gpu, tm, tn, nbytes)
    if not gpu.persistent_gemm:
        return fill + epilogue, 0.0
    if gpu.overlapped_epilogue:
        return 0.0, fill + epilogue
    return epilogue, fill


def _model_time_s(gpu: GpuModel, gemm: Gemm, mainloop_flop_per_s: float,
                  nbytes: tuple[int, int], sms: int | None = None) -> float:
    """The fastest tile's waves of `sms` tiles (default all SMs) x (main loop + tile overhead)
    + the kernel overhead (`_tile_costs`)."""
    sms = gpu.sm_count if sms is None else sms
    return _fastest_tiling_s(gemm, _tile_costs(gpu, gemm.k, mainloop_flop_per_s, nbytes), sms)


def _fastest_tiling_s(gemm: Gemm, costs: tuple[tuple[int, int, float, float], ...],
                      sms: int) -> float:
    """The fastest of `_tile_costs`' tiles: its waves of `sms` tiles x the wave's seconds + the
    kernel overhead."""
    return min(_waves(gemm, tm, tn, sms) * wave + per_kernel for tm, tn, wave, per_kernel in costs)


@lru_cache(maxsize=1024)
def _tile_costs(gpu: GpuModel, k: int, mainloop_flop_per_s: float, nbytes: tuple[int, int]
                ) -> tuple[tuple[int, int, float, float], ...]:
    """Per CTA tile at inner dimension k: (tm, tn, seconds of one wave: the main loop over k at
    one SM's share of `mainloop_flop_per_s` + the tile's fixed overhead, the kernel's fixed
    overhead). Independent of m, n and the SMs a wave has: the GEMMs of a layer share k, and
    a price on fewer SMs (`gemm_time_s(reserved_sms=)`) reuses the full GPU's."""
    costs = []
    for tm, tn in _TILES:
        mainloop = 2.0 * tm * tn * k * gpu.sm_count / mainloop_flop_per_s
        per_tile, per_kernel = _overheads(gpu, tm, tn, k, nbytes)
        costs.append((tm, tn, mainloop + per_tile, per_kernel))
    return tuple(costs)


BF16_SEARCH_GRID = range(256, 20480 + 1, 256)
"""m, n and k of the BF16 MAMF search (S. Bekman, "Machine Learning Engineering",
compute/accelerator/benchmarks/README.md: the exhaustive command and the H100 one,
`mamf-finder.py --m_range 0 20480 256 --n_range 0 20480 256 --k_range 0 20480 256`; it holds
every catalog GPU's published best shape)."""
FP8_SEARCH_GRID = range(1024, 20480 + 1, 1024)
"""m, n and k of the FP8 MAMF search (same README, "fp8 on NVIDIA GPUs example": `mamf-finder.py
--m_range 0 20480 1024 --n_range 0 20480 1024 --k_range 0 20480 1024 --dtype float8_e4m3fn`; the
finer 256-step grids contain it)."""


def search_grid(fp8: bool) -> range:
    """The MAMF search grid of a precision (each of m, n, k)."""
    return FP8_SEARCH_GRID if fp8 else BF16_SEARCH_GRID


@lru_cache(maxsize=64)
def _grid_tilings(sm_count: int, tile: tuple[int, int], grid: range
                  ) -> tuple[np.ndarray, np.ndarray]:
    """For every count of waves an m x n of `grid` takes (k does not quantize): the most useful
    fraction of a whole wave's tiles such a shape computes, m n / (tm tn sm_count) (its work in
    full waves), and the waves. The other shapes of as many waves are left out: a shape's
    efficiency and time (`grid_maximum_efficiency`) depend on its work and waves alone and rise
    with its work at equal waves, so the grid's maximum is among those kept, to the bit (each
    kept shape's figures are the same float expressions of its own work and waves)."""
    tm, tn = tile
    sizes = np.arange(grid.start, grid.stop, grid.step, dtype=np.int64)
    m, n = sizes[:, None], sizes[None, :]
    waves = -(-(-(-m // tm) * -(-n // tn)) // sm_count)
    work = np.zeros(int(waves.max()) + 1)  # by waves; 0 for a count no shape takes
    np.maximum.at(work, waves.ravel(), (m * n / (sm_count * tm * tn)).ravel())
    counts = np.flatnonzero(work)
    return work[counts], counts


def best_tile_quantization(sm_count: int, tile: tuple[int, int], grid: range) -> float:
    """The best `_tile_efficiency` of one tile over every m x n of `grid`."""
    work, waves = _grid_tilings(sm_count, tile, grid)
    return float(np.max(work / waves))


def best_grid_quantization(sm_count: int, grid: range = FP8_SEARCH_GRID) -> float:
    """The best `quantization_efficiency` of any m x n of `grid`: 1.0 on 132 SMs for the FP8 grid
    (3072 x 11264 is 24 x 88 tiles of 128 x 128, 16 waves of 132), 0.9998 on 148."""
    return max(best_tile_quantization(sm_count, t, grid) for t in _TILES)


def grid_maximum_efficiency(gpu: GpuModel, mainloop_efficiency: float, fp8: bool) -> float:
    """The model's highest whole-kernel efficiency (fraction of peak) over the precision's search
    grid, for a given main-loop efficiency: at the grid's deepest k, where the fixed overheads
    weigh least, over every m x n and tile (the model takes the fastest tile of each shape, so
    the grid's maximum is the best (shape, tile) pair's). A shape of work w whole waves run in W
    waves takes W (mainloop + tile overhead) + kernel overhead for w mainloops of work."""
    grid, rate = search_grid(fp8), gemm_rate(gpu, fp8)
    k, nbytes = grid[-1], _FP8_BYTES if fp8 else (2, 2)
    best = 0.0
    for tile in _TILES:
        tm, tn = tile
        mainloop = 2.0 * tm * tn * k * gpu.sm_count / (rate.peak_flop_per_s * mainloop_efficiency)
        work, waves = _grid_tilings(gpu.sm_count, tile, grid)
        per_tile, per_kernel = _overheads(gpu, tm, tn, k, nbytes)
        time = waves * (mainloop + per_tile) + per_kernel
        best = max(best, float((work * mainloop / time).max()) * mainloop_efficiency)
    return best


@lru_cache(maxsize=256)
def mainloop_efficiency(gpu: GpuModel, fp8: bool = False) -> float:
    """Fraction of peak the tensor cores run at inside a tile's main loop: the efficiency for
    which the model's fastest shape of the MAMF search grid runs at the measured efficiency
    (MAMF is the maximum over that grid, so no faster main loop is consistent with it, and a
    slower one would leave the measured maximum unexplained): the measured efficiency with the
    grid's best quantization and the fixed overheads at its deepest k divided out (bisection to
    1e-9, the grid's maximum rising monotonically with the main loop). The published best shape
    itself then runs at or below its measurement. Without an SM count or a measured grid: the
    measured efficiency."""
    rate = gemm_rate(gpu, fp8)
    if gpu.sm_count is None or rate.benchmark_shape is None:
        return rate.measured_efficiency
    low, high = rate.measured_efficiency, 1.0
    if grid_maximum_efficiency(gpu, high, fp8) < rate.measured_efficiency:
        return high
    while high - low > 1e-9:
        mid = 0.5 * (low + high)
        low, high = (mid, high) if grid_maximum_efficiency(gpu, mid, fp8) < \
            rate.measured_efficiency else (low, mid)
    return high


def _operands(gpu: GpuModel, gemm: Gemm, dtype_bytes: int, fp8: bool
              ) -> tuple[tuple[int, int], float]:
    """(operand and output bytes per element, the seconds of streaming them through HBM once:
    the roofline bound of `gemm_time_s`)."""
    nbytes = _FP8_BYTES if fp8 else (dtype_bytes, dtype_bytes)
    return nbytes, gemm.operand_bytes(*nbytes) / (gpu.memory_bandwidth_bytes_per_s *
                                                  gpu.memory_efficiency)


@lru_cache(maxsize=4096)
def gemm_time_s(gpu: GpuModel, gemm: Gemm, dtype_bytes: int = 2, fp8: bool = False,
                reserved_sms: int = 0) -> float:
    """Seconds for `gemm` on `gpu`: the fastest tiling's waves x (main loop + fixed tile overhead)
    + the kernel's fixed overhead, bounded below by streaming the operands and output through
    HBM once (roofline, Williams et al., CACM 2009). `fp8`: the GEMM runs at the FP8 tensor
    rate with one-byte operands and a 16-bit output (Transformer Engine). `reserved_sms`: SMs
    held by a kernel running beside it, so its waves are of sm_count - reserved_sms tiles at the
    same per-SM rate. Without an SM count the GEMM runs at the measured efficiency, unquantized,
    on the whole GPU. Kept: a search's layer, head and overlap prices ask for the same GEMMs many
    times (a cold 64-GPU planner sample for each about eight times)."""
    rate = gemm_rate(gpu, fp8)
    nbytes, traffic = _operands(gpu, gemm, dtype_bytes, fp8)
    if gpu.sm_count is None:
        return max(gemm.flop / (rate.peak_flop_per_s * rate.measured_efficiency), traffic)
    mainloop = rate.peak_flop_per_s * mainloop_efficiency(gpu, fp8)
    sms = max(1, gpu.sm_count - reserved_sms)
    return max(_model_time_s(gpu, gemm, mainloop, nbytes, sms), traffic)


@lru_cache(maxsize=4096)
def gemm_sm_loss_s(gpu: GpuModel, gemm: Gemm, dtype_bytes: int = 2, fp8: bool = False,
                   held_sms: int = 0, base_sms: int = 0) -> float:
    """Seconds `gemm` loses when a collective holds `held_sms` SMs beside it besides the
    `base_sms` already held: `gemm_time_s` at reserved_sms = base_sms + held_sms minus at
    base_sms, both from one roofline bound and one lookup of the tile costs. 0 without an SM
    count (no waves to lose). Kept: a search's workloads share most of their GEMMs."""
    rate = gemm_rate(gpu, fp8)  # raises where the GPU has no such rate, as gemm_time_s does
    if gpu.sm_count is None:
        return 0.0
    nbytes, traffic = _operands(gpu, gemm, dtype_bytes, fp8)
    costs = _tile_costs(gpu, gemm.k, rate.peak_flop_per_s * mainloop_efficiency(gpu, fp8), nbytes)
    held = _fastest_tiling_s(gemm, costs, max(1, gpu.sm_count - base_sms - held_sms))
    return max(held, traffic) - max(_fastest_tiling_s(gemm, costs, max(1, gpu.sm_count - base_sms)),
                                    traffic)
