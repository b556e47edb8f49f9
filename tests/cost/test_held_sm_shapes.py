"""`held_sm_loss_s` is kept by the GEMMs it prices: workloads that differ elsewhere share it,
and every one of them gets what its own GEMMs give; each GEMM's loss is its two prices' difference."""

from __future__ import annotations

import dataclasses

import pytest

from holmes_sim.cost import transformer as T
from holmes_sim.cost.gemm import Gemm, gemm_sm_loss_s, gemm_time_s
from holmes_sim.errors import FieldError
from holmes_sim.hardware.catalog import GPUS
from holmes_sim.model.mla import MlaShape
from holmes_sim.model.moe import MoeShape
from holmes_sim.model.workload import Workload

GPU = GPUS["h100-sxm"]
MLA = MlaShape(heads=32, q_rank=1536, kv_rank=512, qk_dim=128, rope_dim=64, v_dim=128)
MOE = MoeShape(experts=16, topk=2, ffn=2048, shared_ffn=0, pattern=(1,) * 8,
               capacity_factor=None, imbalance=1.0, load_balancing="aux_loss")


def _base(**overrides) -> Workload:
    base = dict(num_layers=8, hidden=4096, heads=32, seq=4096, vocab=32000, ffn=11008,
                tie_embeddings=False, micro_batch=2, global_batch=64, dtype_bytes=2, grad_bytes=4,
                recompute="none", sequence_parallel=False, bucket_bytes=40e6)
    return Workload(**{**base, **overrides})


VARIANTS = [dict(), dict(recompute="selective"), dict(recompute="full"),
            dict(flash_attention=True), dict(flash_attention=True, recompute="selective"),
            dict(flash_attention=True, recompute="full"), dict(sequence_parallel=True),
            dict(sequence_parallel=True, tp_comm_overlap=True, recompute="full"),
            dict(sequence_parallel=True, tp_comm_overlap=True, recompute="full", ub_rs_sms=1),
            dict(tp_comm_overlap=True, recompute="full"), dict(mla=MLA),
            dict(mla=MLA, sequence_parallel=True), dict(micro_batch=1), dict(seq=2048),
            dict(cp=2), dict(cp=2, cp_comm_type="a2a"), dict(query_groups=8), dict(swiglu=True),
            dict(ffn=14336), dict(hidden=5120, heads=40), dict(vocab=64000),
            dict(defer_embedding_wgrad=True), dict(fp8_gemms=True), dict(dtype_bytes=4),
            dict(num_layers=16, global_batch=128, bucket_bytes=80e6, grad_bytes=2),
            dict(hidden_dropout=0.0, attention_dropout=0.0, rmsnorm=True, bias=False),
            dict(position_embedding="rope"), dict(moe=MOE, ep=2)]


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("held", [4, 16])
def test_every_workload_gets_its_own_gemms_loss_whichever_came_first(tp, held):
    own = []
    for overrides in VARIANTS:
        w = _base(**overrides)
        T._held_sm_loss_s.cache_clear()
        own.append(T.held_sm_loss_s(GPU, w, tp, held))
    T._held_sm_loss_s.cache_clear()
    for (overrides, alone) in zip(VARIANTS, own):  # each after all the others, kept
        for other in VARIANTS:
            T.held_sm_loss_s(GPU, _base(**other), tp, held)
        assert T.held_sm_loss_s(GPU, _base(**overrides), tp, held) == alone, overrides


def test_fields_the_gemms_ignore_share_one_loss():
    a = _base(flash_attention=True, recompute="selective", sequence_parallel=True)
    b = dataclasses.replace(a, recompute="none", sequence_parallel=False, num_layers=16,
                            bucket_bytes=80e6, hidden_dropout=0.0)
    assert T._HeldSmShapes(a, 4) == T._HeldSmShapes(b, 4)
    assert T._HeldSmShapes(a, 4) != T._HeldSmShapes(a, 2)
    assert T._HeldSmShapes(_base(), 4) != T._HeldSmShapes(_base(recompute="selective"), 4)


@pytest.mark.parametrize("name", sorted(GPUS))
def test_a_gemms_loss_is_its_two_prices_difference_to_the_bit(name):
    gpu, shapes = GPUS[name], [Gemm(8192, 1536, 4096), Gemm(4096, 4096, 1536), Gemm(128, 64, 8192),
                               Gemm(4096, 4096, 128, 64), Gemm(16384, 14336, 4096), Gemm(1, 1, 1)]
    for g in shapes:
        for d, fp8 in ((2, False), (4, False), (2, True)):
            if fp8 and gpu.fp8_peak_flop_per_s is None:
                with pytest.raises(FieldError):
                    gemm_sm_loss_s(gpu, g, d, fp8, 16)
                continue
            for held, base in ((16, 0), (4, 0), (8, 16), (200, 0), (0, 0)):
                assert gemm_sm_loss_s(gpu, g, d, fp8, held, base) == \
                    gemm_time_s(gpu, g, d, fp8, base + held) - gemm_time_s(gpu, g, d, fp8, base)
    unknown = dataclasses.replace(gpu, sm_count=None)
    assert gemm_sm_loss_s(unknown, shapes[0], 2, False, 16) == 0.0 == \
        gemm_time_s(unknown, shapes[0], 2, False, 16) - gemm_time_s(unknown, shapes[0])
