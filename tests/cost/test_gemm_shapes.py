"""The GEMM model against measured H100 BF16 rates at 55 shapes (XLA's sm_90 table): close at
large shapes, and the cooperative kernels' epilogue per tile accounting for the fall at small k."""

from __future__ import annotations

from pathlib import Path

import dataclasses

import numpy as np
import pytest

import holmes_sim.cost.gemm as gemm
from holmes_sim.hardware.catalog import GPUS

_TABLE = Path(__file__).resolve().parents[2] / "validation" / "kernels" / "xla_sm90_bf16.txt"
_SUSTAINED_OVER_BURST = 0.849
"""H200 MSMF / MAMF (S. Bekman, ml-engineering): the catalog's ratio of a sustained GEMM rate to
a short burst's, applied to the table's burst measurements."""


def _shapes() -> list[tuple[gemm.Gemm, float]]:
    rows = [line.split() for line in _TABLE.read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    return [(gemm.Gemm(int(m), int(n), int(k), int(b)), float(tflops) * 1e12)
            for b, m, n, k, tflops in rows]


def _errors(shapes, h100=GPUS["h100-sxm"]) -> np.ndarray:
    model = np.array([g.flop / gemm.gemm_time_s(h100, g) for g, _ in shapes])
    measured = np.array([rate * _SUSTAINED_OVER_BURST for _, rate in shapes])
    return model / measured - 1


def test_the_table_is_the_cited_one():
    shapes = _shapes()
    assert len(shapes) == 55
    assert max(rate for _, rate in shapes) == pytest.approx(809e12, rel=0.01)


def test_large_shapes_match_the_table_within_six_percent():
    """4096^3 at batch 1, 2 and 4: the model 2.6-5.2% below the table's rates, which spread by 3%
    themselves (783-808 TFLOP/s)."""
    shapes = [(g, r) for g, r in _shapes() if g.m * g.n >= 4096**2 and g.k >= 4096]
    assert shapes
    assert np.max(np.abs(_errors(shapes))) < 0.06


def test_an_epilogue_per_tile_follows_the_tables_fall_at_small_k():
    """Each tile's epilogue paid with the tensor cores idle (Hopper's cooperative kernels) puts
    the model 5.6% from the table on average, +0.8% signed, with no trend in k (shapes at
    k <= 1,024 +0.4% signed, at 4,096 -0.9%); one epilogue per kernel (ping-pong or Blackwell
    kernels) would put it 11.2% above the table, +31% at k = 512 and +2% at 4,096."""
    shapes = _shapes()
    errors = _errors(shapes)
    small_k = np.array([g.k <= 1024 for g, _ in shapes])
    assert np.mean(np.abs(errors)) < 0.06
    assert abs(np.mean(errors)) < 0.02
    assert abs(np.mean(errors[small_k]) - np.mean(errors[~small_k])) < 0.03
    overlapped = dataclasses.replace(GPUS["h100-sxm"], overlapped_epilogue=True)
    try:
        once = _errors(shapes, overlapped)
    finally:
        _forget_times()
    assert np.mean(np.abs(once)) > 0.10
    assert np.mean(once[small_k]) - np.mean(once[~small_k]) > 0.10


def _forget_times() -> None:
    """Empty the GEMM model's kept results, which a changed GPU model leaves behind."""
    gemm.mainloop_efficiency.cache_clear()
    gemm.gemm_time_s.cache_clear()
