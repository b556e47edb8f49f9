"""Context parallelism's costs against hand-derived closed forms: what a CP rank computes (1/cp
of the causal attention, s/cp tokens everywhere else), what it sends per ring step, and the
ring's time as the per-step maximum of compute and transfer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from holmes_sim.cost.collectives import ring_collective_time_s
from holmes_sim.cost.context_parallel import (
    CpPass,
    cp_pass,
    cp_passes,
    exposed_s,
    kv_chunk_bytes,
    ring_attention_s,
)
from holmes_sim.cost.transformer import attention_core_s, layer_kernels
from holmes_sim.hardware.catalog import build_catalog
from holmes_sim.model.workload import build_workload
from holmes_sim.spec.hardware import CatalogSpec
from holmes_sim.spec.job import ModelSpec, TrainingSpec

# Llama-3-8B-like attention: h 4096, 32 heads, 8 query groups, so K and V are 1024 wide.
MODEL = ModelSpec(num_layers=4, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                  seq_length=8192, ffn_hidden_size=14336, swiglu=True)
TRAINING = TrainingSpec(global_batch_size=8, micro_batch_size=1, flash_attention=True)
GPU = build_catalog(CatalogSpec()).gpus["h100-sxm"]


def _workload(cp: int, comm: str = "p2p", **training):
    return build_workload(MODEL, replace(TRAINING, **training), 2, cp, comm)


def test_kv_chunk_is_k_and_v_of_the_ranks_tokens():
    # 2 (K, V) x b 1 x s/cp 2048 x k/t 512 x 2 bytes
    assert kv_chunk_bytes(_workload(4), 2) == 2 * 1 * 2048 * 512 * 2 == 4_194_304


def test_rank_does_one_cp_th_of_the_attention_and_sees_s_over_cp_tokens():
    whole, quarter = layer_kernels(_workload(1), 2), layer_kernels(_workload(4), 2)
    assert quarter.flash_flop * 4 == pytest.approx(whole.flash_flop, rel=1e-12)
    assert all(g.m == 8192 // 4 for g in quarter.dense)  # every linear GEMM: b s/cp rows
    assert _workload(4).layer_forward_flop * 4 == pytest.approx(_workload(1).layer_forward_flop)
    assert _workload(4).pp_message_bytes(2) * 4 == _workload(1).pp_message_bytes(2)


def test_activations_divide_by_cp():
    for recompute in ("none", "selective", "full"):
        one = _workload(1, recompute=recompute).activation_bytes_per_layer(2)
        assert _workload(8, recompute=recompute).activation_bytes_per_layer(2) * 8 == \
            pytest.approx(one, rel=1e-12)


@pytest.mark.parametrize("sp", [False, True])
def test_a2a_also_keeps_the_attention_output_before_its_all_to_all(sp):
    """TE's `AttnFuncWithCPAndQKVOA2A` saves `out_part` (s tokens, a/(t cp) heads) apart from the
    all-to-all's output the projection keeps: d b (s/cp) h/t bytes more than p2p, whose saved
    output is the one returned; none when the core attention or the layer is recomputed."""
    for recompute, extra in (("none", 2 * 1 * 2048 * 4096 / 2), ("selective", 0), ("full", 0)):
        p2p, a2a = (_workload(4, comm, recompute=recompute, sequence_parallel=sp)
                    .activation_bytes_per_layer(2) for comm in ("p2p", "a2a"))
        assert a2a - p2p == pytest.approx(extra, rel=1e-12), recompute
    assert _workload(4, "allgather").activation_bytes_per_layer(2) == \
        _workload(4).activation_bytes_per_layer(2)


def test_ring_attention_is_the_per_step_maximum():
    # cp = 4 forward: three overlapped steps and a last compute step
    assert ring_attention_s(4, 2e-3, (1e-3,) * 3) == pytest.approx(4 * 2e-3)  # compute-bound
    assert ring_attention_s(4, 1e-3, (5e-3,) * 3) == pytest.approx(3 * 5e-3 + 1e-3)
    # cp = 4 backward: every step waits for its own transfer, 1 / 2 / 2 / 1 chunks
    assert ring_attention_s(4, 1e-3, (2e-3, 4e-3, 4e-3, 2e-3)) == pytest.approx(12e-3)


def test_p2p_pass_steps_bytes_and_exposure():
    w = _workload(4)
    fwd, bwd = cp_pass(GPU, w, 2, False), cp_pass(GPU, w, 2, True)
    kv = kv_chunk_bytes(w, 2)
    assert (fwd.ring_bytes, fwd.exposed_bytes) == ((kv,) * 3, 0.0)
    # TE's backward: K/V first, K/V and dK/dV in the cp - 2 middle steps, dK/dV last
    assert (bwd.ring_bytes, bwd.exposed_bytes) == ((kv, 2 * kv, 2 * kv, kv), 0.0)
    assert cp_pass(GPU, _workload(2), 2, True).ring_bytes == (kv * 2, kv * 2)  # cp 2: s/2 chunks
    whole = attention_core_s(GPU, layer_kernels(w, 2), 2, False)
    assert fwd.step_s * 4 == pytest.approx(whole, rel=1e-12)
    rate, lat = 25e9, 5e-6
    transfer = lat + kv / rate
    assert exposed_s(fwd, rate, lat) == pytest.approx(3 * max(0.0, transfer - fwd.step_s))
    slow = exposed_s(fwd, 1e9, lat)  # a 1 GB/s link: transfer-bound
    assert slow == pytest.approx(3 * (lat + kv / 1e9 - fwd.step_s), rel=1e-12) and slow > 0
    assert exposed_s(fwd, 1e15, 0.0) == 0.0  # free links: the ring hides behind compute
    one, two = lat + kv / 1e9 - bwd.step_s, lat + 2 * kv / 1e9 - bwd.step_s
    assert one > 0 and exposed_s(bwd, 1e9, lat) == pytest.approx(2 * one + 2 * two, rel=1e-12)


def test_a2a_and_allgather_bytes():
    w = _workload(4, "a2a")
    p = cp_pass(GPU, w, 2, False)
    # Q, K, V before and the output after: b s/cp (2h + 2k)/t d, 3/4 of it leaves the rank
    assert p.exposed_bytes == pytest.approx(0.75 * 2048 * (2 * 4096 + 2 * 1024) / 2 * 2)
    assert (p.ring_bytes, p.exposed_hops) == ((), 6)
    assert exposed_s(p, 25e9, 5e-6) == pytest.approx(6 * 5e-6 + p.exposed_bytes / 25e9)
    g = _workload(4, "allgather")
    fwd, bwd = cp_pass(GPU, g, 2, False), cp_pass(GPU, g, 2, True)
    # the ring all-gather of the whole sequence's K and V (cp chunks), alpha-beta
    whole_kv = 4 * kv_chunk_bytes(g, 2)
    assert exposed_s(fwd, 25e9, 5e-6) == pytest.approx(
        ring_collective_time_s("all-gather", 4, whole_kv, 25e9, 5e-6), rel=1e-12)
    assert bwd.exposed_bytes == 2 * fwd.exposed_bytes  # gather again, reduce-scatter dK/dV


def test_passes_of_an_op():
    assert cp_passes(GPU, _workload(1), 2, True) == ()
    assert len(cp_passes(GPU, _workload(2), 2, False)) == 1
    assert len(cp_passes(GPU, _workload(2), 2, True)) == 1
    full = cp_passes(GPU, _workload(2, recompute="full"), 2, True)
    assert len(full) == 2 and full[1] == cp_pass(GPU, _workload(2, recompute="full"), 2, False)
    assert isinstance(full[0], CpPass)
    # selective recomputation redoes the core attention, its ring exchanges included
    selective = _workload(2, recompute="selective")
    assert cp_passes(GPU, selective, 2, True)[1] == cp_pass(GPU, selective, 2, False)
