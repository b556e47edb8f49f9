"""GEMMs beside a pipelined userbuffer reduce-scatter run on the SMs it leaves."""

from __future__ import annotations

import dataclasses

import pytest

from holmes_sim.cost import transformer as T
from holmes_sim.cost.gemm import Gemm, gemm_time_s, kernel_overhead_s
from holmes_sim.hardware.catalog import GPUS
from holmes_sim.model.workload import Workload

H100 = GPUS["h100-sxm"]


def _llama(**overrides) -> Workload:
    base = dict(num_layers=80, hidden=8192, heads=64, seq=8192, vocab=128256, ffn=28672,
                tie_embeddings=False, micro_batch=1, global_batch=128, dtype_bytes=2, grad_bytes=4,
                recompute="none", sequence_parallel=True, bucket_bytes=40e6, flash_attention=True,
                tp_comm_overlap=True, query_groups=8, swiglu=True)
    return Workload(**{**base, **overrides})


def test_a_reserved_sm_block_adds_waves_at_the_same_per_sm_rate():
    one_wave = Gemm(128 * 12, 128 * 11, 4096)  # 132 tiles of 128 x 128: one wave on 132 SMs
    whole = gemm_time_s(H100, one_wave)
    once = kernel_overhead_s(H100, 128, 128, 4096, (2, 2))  # one fill per kernel
    assert gemm_time_s(H100, one_wave, reserved_sms=16) == pytest.approx(2 * whole - once)
    eight_waves = Gemm(128 * 116, 128 * 8, 4096)  # 928 tiles: 8 waves on 116 SMs and on 132
    assert gemm_time_s(H100, eight_waves, reserved_sms=16) == gemm_time_s(H100, eight_waves)


def test_the_forward_projection_and_fc2_pay_for_the_sms_of_their_reduce_scatters():
    w = _llama()
    qkv, proj, up, down = T.layer_kernels(w, 4).dense
    assert T.userbuffer_sm_gemms(w, 4, False) == (proj, down)
    assert T.userbuffer_sm_gemms(w, 4, True) == ()
    loss = sum(gemm_time_s(H100, g, reserved_sms=16) - gemm_time_s(H100, g) for g in (proj, down))
    plain = dataclasses.replace(w, tp_comm_overlap=False)
    assert T.layer_pass_s(H100, w, 4, False) - T.layer_pass_s(H100, plain, 4, False) == \
        pytest.approx(loss)
    assert loss > 0.05 * sum(gemm_time_s(H100, g) for g in (proj, down))
    assert T.layer_pass_s(H100, w, 4, True) == T.layer_pass_s(H100, plain, 4, True)


def test_no_reservation_without_the_overlap_its_sequence_parallelism_or_a_tp_group():
    for w, tp in ((_llama(tp_comm_overlap=False), 4), (_llama(sequence_parallel=False), 4),
                  (_llama(), 1)):
        assert T.userbuffer_sm_gemms(w, tp, False) == ()


@pytest.mark.parametrize("sms", [0, 1, 24])
def test_the_forward_gemms_lose_the_sms_the_configuration_gives_its_reduce_scatters(sms):
    """`training.tp_comm_overlap_rs_sms`: ring exchanges on 1 SM (Megatron-Bridge's FP8 H100
    configurations) cost the projection and fc2 what one SM fewer gives, none costs nothing,
    and the loss rises with the SMs held."""
    w = _llama(ub_rs_sms=sms)
    _, proj, _, down = T.layer_kernels(w, 4).dense
    plain = dataclasses.replace(w, tp_comm_overlap=False)
    loss = sum(gemm_time_s(H100, g, reserved_sms=sms) - gemm_time_s(H100, g) for g in (proj, down))
    assert T.layer_pass_s(H100, w, 4, False) - T.layer_pass_s(H100, plain, 4, False) == \
        pytest.approx(loss, abs=1e-15)
    assert (T.userbuffer_sm_gemms(w, 4, False) == ()) == (sms == 0)
    default = T.userbuffer_sm_loss_s(H100, _llama(), 4, False)
    assert (T.userbuffer_sm_loss_s(H100, w, 4, False) < default) == (sms < 16)
