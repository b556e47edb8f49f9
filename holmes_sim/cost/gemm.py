"""Time of one (batched) GEMM on a GPU: tile and wave quantization under a roofline.

A GEMM C[m x n] = A[m x k] B[k x n] is split into output tiles, one thread block each; the GPU runs
`sm_count` blocks at a time, so the work is done in ceil(tiles / SMs) waves and a last partial
wave leaves SMs idle (wave quantization), and a tile that overhangs the matrix computes padding
(tile quantization). cuBLAS on Ampere/Hopper uses 128x256 / 256x128 / 128x128 CTA tiles for large
half-precision GEMMs (Anthony et al., "The Case for Co-Designing Model Architectures with
Hardware", arXiv 2401.14489, section 4; NVIDIA, "Matrix Multiplication Background User's Guide",
Deep Learning Performance documentation). A tile's main loop runs at the SM's share of the
GPU's sustained GEMM rate (peak x `compute_efficiency`); each tile also pays a fixed pipeline fill
and epilogue (`tile_overhead_s`), so the rate rises with k. The result is bounded below by the time to
stream the operands and the output through HBM (roofline, Williams et al., CACM 2009), which is
what limits the small-k batched GEMMs of attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from holmes_sim.hardware.catalog import GpuModel

_TILES: tuple[tuple[int, int], ...] = ((128, 256), (256, 128), (128, 128))
_K_BLOCK = 32
"""k-depth of one pipeline stage of the Ampere/Hopper half-precision CTA tiles (CUTLASS defaults)."""
_FILL_STAGES = 2
"""k-blocks loaded before the first MMA of a 3-stage cp.async pipeline."""


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

    def operand_bytes(self, dtype_bytes: int) -> float:
        """Bytes read (A, B) and written (C) once each."""
        return dtype_bytes * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n)

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


def tile_overhead_s(gpu: GpuModel, tm: int, tn: int, k: int, dtype_bytes: int) -> float:
    """Seconds one SM spends on a tm x tn tile outside its main loop, with the tensor cores idle:
    filling the software pipeline before the first MMA (`_FILL_STAGES` k-blocks of A and B, or
    all of k when shorter) and the epilogue storing the tile's outputs, both at the SM's share of
    HBM bandwidth. Modelling assumption: one CTA per SM at a time (a 128x256 tile's fp32
    accumulators take half the register file), so nothing hides these phases; the data-parallel
    tiling of cuBLAS/CUTLASS pays them once per tile and wave (NVIDIA CUTLASS, "Efficient GEMM in
    CUDA": software pipelining, epilogue; Osama et al., "Stream-K", PPoPP 2023, section 2)."""
    fill_blocks = min(_FILL_STAGES, math.ceil(k / _K_BLOCK))
    nbytes = dtype_bytes * (tm * tn + fill_blocks * (tm + tn) * _K_BLOCK)
    return nbytes * gpu.sm_count / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency)


def _tiled_time_s(gpu: GpuModel, gemm: Gemm, tm: int, tn: int, dtype_bytes: int) -> float:
    """Waves x (main loop over k at the sustained per-SM rate + the tile's fixed overhead)."""
    waves = _waves(gemm, tm, tn, gpu.sm_count)
    per_sm_rate = gpu.peak_flop_per_s * gpu.compute_efficiency / gpu.sm_count
    mainloop = 2.0 * tm * tn * gemm.k / per_sm_rate
    return waves * (mainloop + tile_overhead_s(gpu, tm, tn, gemm.k, dtype_bytes))


def gemm_time_s(gpu: GpuModel, gemm: Gemm, dtype_bytes: int = 2) -> float:
    """Seconds for `gemm` on `gpu`: the fastest tiling's waves x (main loop + fixed tile overhead),
    bounded below by streaming the operands and output through HBM once (roofline, Williams et
    al., CACM 2009). The fixed overhead is what makes small-k GEMMs (attention scores, row-parallel
    projections under wide TP) run well below the tensor-core rate. Without an SM count the GEMM
    runs at the sustained rate, unquantized."""
    traffic = gemm.operand_bytes(dtype_bytes) / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency)
    if gpu.sm_count is None:
        return max(gemm.flop / (gpu.peak_flop_per_s * gpu.compute_efficiency), traffic)
    return max(min(_tiled_time_s(gpu, gemm, tm, tn, dtype_bytes) for tm, tn in _TILES), traffic)
