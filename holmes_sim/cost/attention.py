"""Time of a fused (flash) attention kernel on a GPU, forward or backward.

Work: 4 b s_q s_k h / t FLOP forward for the b (a/t) heads of s_q queries against s_k keys, 2.5
times that backward (it recomputes the scores; Dao 2023, FlashAttention-2, arXiv 2307.08691,
section 3.1). Under a causal mask the benchmarks of the FlashAttention papers count half of it
(Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, section 4.1), so a causal kernel's time is
that half over the kernel's measured causal rate.

Where the catalog holds the measured rates of the kernel the training stack runs
(`kernel_rates`: `GpuModel.attention_rates`, cuDNN on Hopper, for the `auto` and `fused`
attention backends; `GpuModel.flash_attention_rates`, FlashAttention-2, for `flash`), the rate
at the kernel's query length is read from them, piecewise linear in log2 of the length and held
flat beyond the measured range, and scaled by the GPU's sustained-to-burst tensor rate (the
benchmarks are short boost-clock runs, as MAMF is; a training run holds the power-limited
clock, `hardware.catalog`). The papers
measure the backward without a mask only; its causal rate is taken as the full one times the
forward's causal-to-full ratio at the same length (both passes skip the same tiles above the
diagonal and pay the same diagonal tiles). Ring attention's steps over other ranks' chunks run
unmasked, at the unmasked rate (`cost.transformer`). Without measured rates: `attention_efficiency` of
peak on the work of the score tiles the kernel computes, n (n + 1) / 2 of n x n tiles of 128
tokens (`causal_block_fraction`; Dao 2023, section 3.1.1).
"""

from __future__ import annotations

import bisect
import math

from holmes_sim.hardware.catalog import AttentionRates, GpuModel

BACKWARD_WORK = 2.5
"""Backward FLOP over forward FLOP of a fused attention kernel (Dao 2023, section 3.1)."""

FLASH_BLOCK = 128
"""FlashAttention-2's query and key block size in tokens (128 x 128 tiles for head dimensions up
to 128; Dao 2023, arXiv 2307.08691, section 3.3)."""


def causal_block_fraction(s: int) -> float:
    """Share of the s x s score tiles a causal FlashAttention kernel computes: of n = ceil(s /
    128) x n square tiles it skips those wholly above the diagonal and computes n (n + 1) / 2
    (Dao 2023, arXiv 2307.08691, section 3.1.1 "Causal masking"), (n + 1) / (2 n)."""
    n = -(-s // FLASH_BLOCK)
    return (n + 1) / (2 * n)


def _interpolate(rates: AttentionRates, values: tuple[float, ...], seq: int) -> float:
    """`values` at `seq` tokens: linear in log2(seq) between the measured lengths, flat beyond."""
    points = rates.seq
    if seq <= points[0]:
        return values[0]
    if seq >= points[-1]:
        return values[-1]
    i = bisect.bisect_left(points, seq)
    x0, x1 = math.log2(points[i - 1]), math.log2(points[i])
    return values[i - 1] + (values[i] - values[i - 1]) * (math.log2(seq) - x0) / (x1 - x0)


def measured_rate_flop_per_s(rates: AttentionRates, seq: int, causal: bool,
                             backward: bool) -> float:
    """Sustained training rate (FLOP/s, the benchmarks' FLOP count) of the measured kernel at a
    query length of `seq` tokens."""
    causal_fwd = _interpolate(rates, rates.forward_causal_tflops, seq)
    full_fwd = _interpolate(rates, rates.forward_full_tflops, seq)
    tflops = _interpolate(rates, rates.backward_full_tflops, seq) if backward else full_fwd
    if causal:
        tflops *= causal_fwd / full_fwd
    return tflops * 1e12 * rates.sustained_ratio


def kernel_rates(gpu: GpuModel, backend: str) -> AttentionRates | None:
    """The measured rates of the fused kernel attention backend `backend` runs on `gpu`
    (`TrainingSpec.attention_backend`): FlashAttention-2's for `flash`; for `auto` and `fused`
    cuDNN's, which Transformer Engine prefers on Hopper; None where the catalog has none."""
    return gpu.flash_attention_rates if backend == "flash" else gpu.attention_rates


def fused_attention_s(gpu: GpuModel, full_flop: float, seq: int, keys: int, backward: bool,
                      causal_share: float = 1.0, backend: str = "auto") -> float:
    """Seconds of a GPT's causal fused attention whose forward, unmasked, is `full_flop` FLOP,
    in kernels of `seq` queries against at most `keys` keys, run by attention backend
    `backend`; `causal_share` of its (halved) work runs in masked kernels, the rest in unmasked
    ones (ring attention's off-diagonal steps). Without measured rates every tile the mask
    leaves of the keys x keys square is priced at `attention_efficiency`."""
    work = full_flop * (BACKWARD_WORK if backward else 1.0)
    rates = kernel_rates(gpu, backend)
    if rates is not None:
        counted = 0.5 * work
        masked = measured_rate_flop_per_s(rates, seq, True, backward)
        unmasked = measured_rate_flop_per_s(rates, seq, False, backward)
        return counted * (causal_share / masked + (1.0 - causal_share) / unmasked)
    computed = work * causal_block_fraction(keys)
    return computed / (gpu.peak_flop_per_s * gpu.attention_efficiency)
