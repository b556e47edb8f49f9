"""Time of one (batched) GEMM on a GPU: tile and wave quantization under a roofline.

A GEMM C[m x n] = A[m x k] B[k x n] is split into output tiles, one thread block each; the GPU runs
`sm_count` blocks at a time, so the work is done in ceil(tiles / SMs) waves and a last partial
wave leaves SMs idle (wave quantization), and a tile that overhangs the matrix computes padding
(tile quantization). cuBLAS on Ampere/Hopper uses 128x256 / 256x128 / 128x128 CTA tiles for large
half-precision GEMMs (Anthony et al., "The Case for Co-Designing Model Architectures with
Hardware", arXiv 2401.14489, section 4; NVIDIA, "Matrix Multiplication Background User's Guide",
Deep Learning Performance documentation). A full wave runs at the GPU's achievable GEMM rate
(peak x `compute_efficiency`, the measured MAMF). The result is bounded below by the time to
stream the operands and the output through HBM (roofline, Williams et al., CACM 2009), which is
what limits the small-k batched GEMMs of attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from holmes_sim.catalog import GpuModel

_TILES: tuple[tuple[int, int], ...] = ((128, 256), (256, 128), (128, 128))


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


def _tile_efficiency(gemm: Gemm, tm: int, tn: int, sm_count: int) -> float:
    tiles = math.ceil(gemm.m / tm) * math.ceil(gemm.n / tn) * gemm.batch
    waves = math.ceil(tiles / sm_count)
    return gemm.m * gemm.n * gemm.batch / (waves * sm_count * tm * tn)


def gemm_time_s(gpu: GpuModel, gemm: Gemm, dtype_bytes: int = 2) -> float:
    """Seconds for `gemm` on `gpu`: max(quantized compute time, operand traffic time)."""
    rate = gpu.peak_flop_per_s * gpu.compute_efficiency * quantization_efficiency(gemm, gpu.sm_count)
    traffic = gemm.operand_bytes(dtype_bytes) / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency)
    return max(gemm.flop / rate, traffic)
