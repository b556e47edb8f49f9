"""The fused attention kernel's time: measured cuDNN rates on Hopper, the tile model elsewhere."""

from __future__ import annotations

import dataclasses
import math

import pytest

from holmes_sim.cost.attention import (
    causal_block_fraction,
    fused_attention_s,
    measured_rate_flop_per_s,
)
from holmes_sim.cost.transformer import attention_core_s, layer_kernels
from holmes_sim.hardware.catalog import GPUS
from holmes_sim.model.workload import build_workload
from holmes_sim.spec.job import ModelSpec, TrainingSpec

H100, A100 = GPUS["h100-sxm"], GPUS["a100-80gb"]
RATES = H100.attention_rates
SUSTAINED = 0.849


def test_h100_and_h200_run_the_cudnn_rates_a100_has_none():
    assert RATES is not None and GPUS["h200"].attention_rates is RATES
    assert RATES.sustained_ratio == SUSTAINED
    assert A100.attention_rates is None


def test_measured_lengths_give_the_table_times_the_sustained_ratio():
    """s = 4,096: forward 518 (causal) and 609 TFLOP/s (full), backward 499 (full)."""
    assert measured_rate_flop_per_s(RATES, 4096, False, False) == pytest.approx(609e12 * SUSTAINED)
    assert measured_rate_flop_per_s(RATES, 4096, True, False) == pytest.approx(518e12 * SUSTAINED)
    assert measured_rate_flop_per_s(RATES, 4096, False, True) == pytest.approx(499e12 * SUSTAINED)


def test_causal_backward_takes_the_forwards_causal_to_full_ratio():
    assert measured_rate_flop_per_s(RATES, 2048, True, True) == \
        pytest.approx(465e12 * 484 / 617 * SUSTAINED)


def test_between_lengths_linear_in_log2_beyond_them_flat():
    s = 2 ** 11.5  # halfway between 2,048 and 4,096 in log2
    mid = measured_rate_flop_per_s(RATES, round(s), False, True)
    expected = 465 + (499 - 465) * (math.log2(round(s)) - 11)
    assert mid == pytest.approx(expected * 1e12 * SUSTAINED)
    assert measured_rate_flop_per_s(RATES, 131072, True, False) == \
        measured_rate_flop_per_s(RATES, 16384, True, False)
    assert measured_rate_flop_per_s(RATES, 128, False, True) == \
        measured_rate_flop_per_s(RATES, 512, False, True)


def test_causal_kernel_time_counts_half_the_work_at_the_causal_rate():
    full = 4.0 * 8192 * 8192 * 128  # s = 8,192, one head of 128
    fwd = fused_attention_s(H100, full, 8192, 8192, False)
    bwd = fused_attention_s(H100, full, 8192, 8192, True)
    assert fwd == pytest.approx(full / 2 / (529e12 * SUSTAINED))
    assert bwd == pytest.approx(2.5 * full / 2 / (518e12 * 529 / 600 * SUSTAINED))
    assert bwd / fwd > 2.5  # the backward kernel is the slower one


def test_without_rates_the_tiles_below_the_diagonal_at_attention_efficiency():
    full = 4.0 * 2048 * 2048 * 1024
    assert fused_attention_s(A100, full, 2048, 2048, True) == pytest.approx(
        2.5 * full * causal_block_fraction(2048) / (A100.peak_flop_per_s * 0.6))


def _workload(cp: int, comm: str = "p2p"):
    model = ModelSpec(num_layers=2, hidden_size=4096, num_attention_heads=32, seq_length=16384,
                      vocab_size=32000)
    training = TrainingSpec(global_batch_size=8, micro_batch_size=1, flash_attention=True)
    return dataclasses.replace(build_workload(model, training, tp=1, cp=cp), cp_comm_type=comm)


def test_ring_attention_runs_one_masked_step_of_s_over_cp_and_the_rest_unmasked():
    whole, eighth = layer_kernels(_workload(1), 1), layer_kernels(_workload(8), 1)
    assert (whole.flash_seq, whole.flash_causal_share) == (16384, 1.0)
    assert (eighth.flash_seq, eighth.flash_keys, eighth.flash_causal_share) == (2048, 16384, 1 / 8)
    # an eighth of the work: 1/8 of it masked at 484, 7/8 unmasked at 617 TFLOP/s (s = 2,048)
    ratio = attention_core_s(H100, eighth, 2, False) / attention_core_s(H100, whole, 2, False)
    assert ratio == pytest.approx(539 * (1 / 8 / 484 + 7 / 8 / 617) / 8)


def test_ulysses_runs_the_whole_sequence_masked_and_all_gather_its_chunks():
    a2a, gather = layer_kernels(_workload(8, "a2a"), 1), layer_kernels(_workload(8, "allgather"), 1)
    assert (a2a.flash_seq, a2a.flash_causal_share) == (16384, 1.0)
    assert (gather.flash_seq, gather.flash_causal_share) == (2048, 1.0)
