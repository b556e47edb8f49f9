"""The shape-aware compute model: GEMM quantization and roofline, the memory-bound kernels, and what
recomputation, sequence parallelism and fused attention change."""

from __future__ import annotations

import dataclasses

import pytest

from holmes_sim.hardware.catalog import GPUS
from holmes_sim.cost import transformer as T
from holmes_sim.cost.gemm import (Gemm, gemm_time_s, mainloop_efficiency, quantization_efficiency,
                                  tile_overhead_s)
from holmes_sim.model.workload import Workload

A100 = GPUS["a100-80gb"]


def _gpt(**overrides) -> Workload:
    base = dict(num_layers=24, hidden=2048, heads=16, seq=2048, vocab=51200, ffn=8192,
                tie_embeddings=True, micro_batch=4, global_batch=512, dtype_bytes=2, grad_bytes=4,
                recompute="none", sequence_parallel=False, bucket_bytes=160e6)
    return Workload(**{**base, **overrides})


def _mainloop_s(tm: int, tn: int, k: int) -> float:
    return 2 * tm * tn * k / (A100.peak_flop_per_s * mainloop_efficiency(A100) / 108)


def _overhead_s(tm: int, tn: int) -> float:
    # epilogue (tm x tn fp16 outputs) + 2 pipeline stages of 32-deep A and B tiles, per SM's HBM share
    per_sm = A100.memory_bandwidth_bytes_per_s * A100.memory_efficiency / 108
    return 2 * (tm * tn + 2 * (tm + tn) * 32) / per_sm


def test_full_waves_of_whole_tiles_run_the_main_loop_at_the_sustained_rate_plus_the_tile_overhead():
    g = Gemm(128 * 108, 256 * 4, 8192)  # 432 tiles of 128x256: exactly 4 waves on 108 SMs
    assert quantization_efficiency(g, 108) == pytest.approx(1.0)
    assert gemm_time_s(A100, g) == pytest.approx(4 * (_mainloop_s(128, 256, 8192) + _overhead_s(128, 256)))
    assert tile_overhead_s(A100, 128, 256, 8192, (2, 2)) == pytest.approx(_overhead_s(128, 256))


def test_one_tile_row_more_than_a_wave_costs_about_half_a_wave_more():
    full = Gemm(128 * 108, 256, 8192)  # 108 tiles of 128x256: one wave
    over = Gemm(128 * 109, 256, 8192)  # best: 218 tiles of 128x128 in 3 half-size waves
    assert gemm_time_s(A100, full) == pytest.approx(_mainloop_s(128, 256, 8192) + _overhead_s(128, 256))
    assert gemm_time_s(A100, over) == pytest.approx(3 * (_mainloop_s(128, 128, 8192) + _overhead_s(128, 128)))
    assert 1.5 < gemm_time_s(A100, over) / gemm_time_s(A100, full) < 1.6


def test_gemm_rate_rises_with_the_inner_dimension():
    """The fixed per-tile cost weighs less as k grows: why narrow models run below the MAMF."""
    gemms = {k: Gemm(32768, 6912, k) for k in (768, 2304, 16384)}
    rate = {k: g.flop / gemm_time_s(A100, g) for k, g in gemms.items()}
    sustained = A100.peak_flop_per_s * mainloop_efficiency(A100)
    assert rate[768] < rate[2304] < rate[16384] < sustained
    assert rate[16384] > 0.97 * sustained and rate[768] < 0.8 * sustained


def test_small_inner_dimension_pays_the_tile_overhead_above_its_traffic():
    g = Gemm(2048, 2048, 64, batch=64)  # attention scores with 64-wide heads: 2 k-blocks per tile
    traffic = g.operand_bytes(2) / (A100.memory_bandwidth_bytes_per_s * A100.memory_efficiency)
    waves = -(-16 * 8 * 64 // 108)  # 128x256 tiles
    assert gemm_time_s(A100, g) == pytest.approx(waves * (_mainloop_s(128, 256, 64) + _overhead_s(128, 256)))
    assert gemm_time_s(A100, g) > traffic
    assert g.flop / gemm_time_s(A100, g) < 0.25 * A100.peak_flop_per_s


def test_backward_gemms_carry_twice_the_forward_flop():
    g = Gemm(4096, 3072, 1024)
    assert sum(x.flop for x in g.backward()) == pytest.approx(2 * g.flop)


def test_attention_share_falls_with_width():
    """The s x s work grows with s/h: why one efficiency constant cannot fit narrow and wide models."""
    def share(h: int) -> float:
        w = _gpt(hidden=h, ffn=4 * h, heads=h // 128)
        k = T.layer_kernels(w, 1)
        return T.attention_core_s(A100, k, 2, False) / T.layer_pass_s(A100, w, 1, False)

    assert share(2048) > share(8192) > share(16384)


def test_full_recompute_adds_a_forward_and_selective_only_the_attention_core():
    none, sel, full = (_gpt(recompute=r) for r in ("none", "selective", "full"))
    fwd = T.layer_s(A100, none, 1, False)
    bwd = T.layer_s(A100, none, 1, True)
    core = T.attention_core_s(A100, T.layer_kernels(none, 1), 2, False)
    assert T.layer_s(A100, full, 1, True) == pytest.approx(bwd + fwd)
    assert T.layer_s(A100, sel, 1, True) == pytest.approx(bwd + core)
    assert 0 < core < fwd


def test_flash_attention_drops_the_score_traffic_and_selective_recomputes_the_kernel():
    # Megatron-Core checkpoints the core attention whatever its kernel (attention.py
    # `checkpoint_core_attention`): the backward redoes the fused forward, nothing else
    flash = _gpt(flash_attention=True, recompute="selective")
    k = T.layer_kernels(flash, 1)
    assert k.attention == () and k.core_bytes_fwd == 0 and k.flash_flop > 0
    kernel = T.attention_core_s(A100, k, 2, False)
    assert kernel > 0
    assert T.layer_s(A100, flash, 1, True) == \
        pytest.approx(T.layer_pass_s(A100, flash, 1, True) + kernel)


def test_sequence_parallel_splits_layernorm_and_dropout_work():
    plain, sp = T.layer_kernels(_gpt(), 8), T.layer_kernels(_gpt(sequence_parallel=True), 8)
    assert sp.other_bytes_fwd < plain.other_bytes_fwd
    assert sp.dense == plain.dense


def test_selective_recompute_drops_the_score_activations():
    w = _gpt(recompute="selective")
    s, b, h = w.seq, w.micro_batch, w.hidden
    assert w.activation_bytes_per_layer(1) == pytest.approx(s * b * h * 34)
    assert dataclasses.replace(w, recompute="none").activation_bytes_per_layer(1) > \
        w.activation_bytes_per_layer(1)


def test_tp_comm_overlap_hides_the_backward_all_reduces_behind_the_weight_gradient_gemms():
    """K22 section 6.2: the input-gradient all-reduces of QKV and the MLP up-projection run
    during their weight-gradient GEMMs; the forward's and the recomputed forward's stay exposed."""
    import dataclasses

    from holmes_sim.cost.compute import KernelCompute, ProfiledCompute
    from holmes_sim.cost.nccl_algorithms import collective_time_s
    from holmes_sim.cost.ops import OpCosts
    from holmes_sim.prepare import prepare
    from holmes_sim.validation.published import PUBLISHED_DIR

    p = prepare(PUBLISHED_DIR / "scenarios" / "megatron_k22_table5" / "gpt-22b-8gpu-full-recompute.yaml")
    node = p.cluster.nodes[0]
    on = OpCosts(p.cluster, p.workload, KernelCompute(), 8)
    off = OpCosts(p.cluster, dataclasses.replace(p.workload, async_tp_allreduce=False), KernelCompute(), 8)
    one = collective_time_s(off.tp_topology(node), "all-reduce", p.workload.tp_allreduce_bytes())
    hidden = sum(min(one, x) for x in T.tp_overlap_windows_s(node.gpu, p.workload, 8))
    assert p.workload.async_tp_allreduce and hidden > 0
    assert on.tp_comm_s(node, 3, False) == pytest.approx(off.tp_comm_s(node, 3, False))
    assert on.tp_comm_s(node, 3, True) == pytest.approx(off.tp_comm_s(node, 3, True) - 3 * hidden)
    assert on.tp_comm_s(node, 3, True) >= 3 * 2 * one - 1e-12  # the recomputed forward's two stay
    profiled = OpCosts(p.cluster, p.workload, ProfiledCompute({}, "test"), 8)
    assert profiled.tp_comm_s(node, 3, True) == pytest.approx(off.tp_comm_s(node, 3, True))
