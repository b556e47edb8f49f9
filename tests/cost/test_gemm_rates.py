"""One GEMM derivation: the model's fastest shape of each MAMF search grid runs at the catalog
GPU's measured (maximum) efficiency, BF16 and FP8 alike; FP8 GEMMs at the FP8 tensor rate; the
Hopper/Blackwell catalog entries."""

from __future__ import annotations

import pytest

from holmes_sim.cost import transformer as T
from holmes_sim.cost.gemm import (BF16_SEARCH_GRID, FP8_SEARCH_GRID, Gemm, best_grid_quantization,
                                  epilogue_s, fill_epilogue_s, fill_s, gemm_time_s,
                                  grid_maximum_efficiency,
                                  kernel_overhead_s, mainloop_efficiency, quantization_efficiency,
                                  search_grid, tile_overhead_s)
from holmes_sim.errors import FieldError
from holmes_sim.hardware.catalog import GPUS, LINKS, NICS, gemm_rate
from holmes_sim.model.workload import Workload
from holmes_sim.units import gbit_per_s_to_bytes_per_s, gbyte_per_s_to_bytes_per_s, tflops_to_flop_per_s
from tests.conftest import small_scenario

_RATES = [(name, fp8) for name, gpu in GPUS.items() for fp8 in (False, True)
          if not fp8 or gpu.fp8_peak_flop_per_s is not None]


@pytest.mark.parametrize("name,fp8", _RATES)
def test_the_fastest_grid_shape_runs_at_the_measured_maximum(name, fp8):
    """MAMF is the maximum over its search grid: the model's fastest grid shape (deepest k, best
    quantization) runs at the measured efficiency, and the published best shape no faster."""
    gpu = GPUS[name]
    rate = gemm_rate(gpu, fp8)
    e_main = mainloop_efficiency(gpu, fp8)
    assert rate.measured_efficiency <= e_main < 1.0
    assert grid_maximum_efficiency(gpu, e_main, fp8) == \
        pytest.approx(rate.measured_efficiency, rel=1e-8)
    best = Gemm(*rate.benchmark_shape)
    assert all(d in BF16_SEARCH_GRID for d in rate.benchmark_shape)  # the 256-step grid
    achieved = best.flop / gemm_time_s(gpu, best, fp8=fp8) / rate.peak_flop_per_s
    assert achieved <= rate.measured_efficiency * (1 + 1e-9)


@pytest.mark.parametrize("name,fp8", _RATES)
def test_no_sampled_grid_shape_beats_the_measured_maximum(name, fp8):
    gpu, grid = GPUS[name], search_grid(fp8)
    rate = gemm_rate(gpu, fp8)
    for m in grid[::7]:
        for n in grid[::5]:
            for k in (grid[0], grid[len(grid) // 2], grid[-1]):
                g = Gemm(m, n, k)
                achieved = g.flop / gemm_time_s(gpu, g, fp8=fp8) / rate.peak_flop_per_s
                assert achieved <= rate.measured_efficiency * (1 + 1e-9)


@pytest.mark.parametrize("name", [n for n, fp8 in _RATES if fp8])
def test_the_fastest_shape_of_the_whole_fp8_grid_runs_at_the_measured_maximum(name):
    """FP8 MAMF is the maximum over the grid m, n, k in 1024..20480 step 1024: brute force over
    every m x n at the deepest k (where the fixed overheads weigh least), the model's fastest
    shape runs at the measured efficiency."""
    gpu = GPUS[name]
    rate = gemm_rate(gpu, True)
    k = FP8_SEARCH_GRID[-1]
    fastest = max(Gemm(m, n, k).flop / gemm_time_s(gpu, Gemm(m, n, k), fp8=True)
                  for m in FP8_SEARCH_GRID for n in FP8_SEARCH_GRID) / rate.peak_flop_per_s
    assert fastest == pytest.approx(rate.measured_efficiency, rel=1e-8)


# At an H100 SM's share of 0.9 x 3.35 TB/s: a 128 x 128 tile's pipeline fill (two 32-deep k-blocks
# of A and B, 2 bytes each) 1.44 us and its epilogue (its bf16 outputs) 1.43 us; 2.87 us together.
_H100_S_PER_BYTE = 132 / (0.9 * 3350e9)
_H100_FILL_S = 2 * 2 * (128 + 128) * 32 * _H100_S_PER_BYTE
_H100_EPILOGUE_S = 2 * 128 * 128 * _H100_S_PER_BYTE


def _main_loop_over_epilogue(peak_flop_per_s: float, e_main: float, k: int) -> float:
    """A tile's epilogue over its main loop on H100 at depth k, for bf16 outputs (the tile size
    cancels): 2 tm tn s / (2 tm tn k 132 / (peak e_main)) = s peak e_main / (132 k), s the SM's
    seconds per byte."""
    return _H100_S_PER_BYTE * peak_flop_per_s * e_main / (132 * k)


def test_h100_bf16_main_loop_is_the_measured_sustained_rate():
    """Hand calculation: MSMF 0.711 is the BF16 grid's maximum; the grid holds whole waves on 132
    SMs (4224 x 1024 is 33 x 4 = 132 tiles of 128 x 256) and shapes of many whole waves at its
    deepest k = 20480, where each tile's epilogue (cooperative kernels: paid per tile) costs
    c = s peak e_main / (132 k) of its main loop and the one fill per kernel under 0.02%: so
    0.711 = e_main / (1 + c), e_main = 0.711 / (1 - 0.711 s peak / (132 k)) = 0.7192. The best shape
    2048 x 2048 (256 tiles of 128 x 128 on 132 SMs, two waves: the same quantization and the
    same epilogue bytes per SM as one wave of 128 tiles of 128 x 256, and a smaller fill) takes
    two waves' main loops and epilogues plus one fill."""
    h100 = GPUS["h100-sxm"]
    assert not h100.overlapped_epilogue
    assert quantization_efficiency(Gemm(4224, 1024, 8192), 132) == 1.0
    assert best_grid_quantization(132, BF16_SEARCH_GRID) == 1.0
    e_main = mainloop_efficiency(h100)
    per_unit = _main_loop_over_epilogue(989e12, 1.0, 20480)
    assert e_main == pytest.approx(0.711 / (1 - 0.711 * per_unit), rel=2e-4)
    assert e_main == pytest.approx(0.7192, abs=1e-4)
    t = gemm_time_s(h100, Gemm(2048, 2048, 13312))
    mainloop = 2 * 128 * 128 * 13312 * 132 / (989e12 * e_main)
    assert t == pytest.approx(2 * (mainloop + _H100_EPILOGUE_S) + _H100_FILL_S, rel=1e-9)
    assert 2 * 2048 * 2048 * 13312 / t / 989e12 == pytest.approx(0.679, abs=5e-4)


def test_h100_fp8_main_loop_is_the_measured_rate():
    """Hand calculation: MAMF 1402.6 / 1979 = 0.709, x 0.849 sustained = 0.602 at the FP8 grid's
    fastest shape; 3072 x 11264 is 24 x 88 = 2112 tiles of 128 x 128, exactly 16 waves on 132
    SMs, each tile's bf16 epilogue c = s 1979e12 e_main / (132 x 20480) of its main loop and
    one fill beside them: e_main = 0.602 / (1 - 0.602 c / e_main) = 0.614; the best shape
    1024 x 9216 quantizes to 8 x 72 = 576 tiles in 5 waves (0.873): five main loops and
    epilogues and one fill of one-byte operands."""
    h100 = GPUS["h100-sxm"]
    assert quantization_efficiency(Gemm(3072, 11264, 14336), 132) == 1.0
    assert best_grid_quantization(132) == 1.0
    e_main = mainloop_efficiency(h100, True)
    per_unit = _main_loop_over_epilogue(1979e12, 1.0, 20480)
    assert e_main == pytest.approx(0.602 / (1 - 0.602 * per_unit), rel=1e-3)
    assert quantization_efficiency(Gemm(1024, 9216, 14336), 132) == pytest.approx(576 / 660)
    t = gemm_time_s(h100, Gemm(1024, 9216, 14336), fp8=True)
    fill = 2 * 1 * 256 * 32 * _H100_S_PER_BYTE
    assert fill == pytest.approx(kernel_overhead_s(h100, 128, 128, 14336, (1, 2)))
    mainloop = 2 * 128 * 128 * 14336 * 132 / (1979e12 * e_main)
    assert t == pytest.approx(5 * (mainloop + _H100_EPILOGUE_S) + fill, rel=1e-9)


def test_a_hopper_gemm_pays_one_fill_per_kernel_and_an_epilogue_per_tile():
    """Ten whole waves of 128 x 128 tiles at k = 2048 on H100 (4224 x 1280): ten main loops and
    epilogues of 1.43 us and one fill of 1.44 us (Ampere's rule would add ten fills too)."""
    h100 = GPUS["h100-sxm"]
    g = Gemm(128 * 33, 128 * 10 * 4, 2048)
    mainloop = 2 * 128 * 128 * 2048 * 132 / (989e12 * mainloop_efficiency(h100))
    assert _H100_FILL_S == pytest.approx(1.44e-6, abs=0.01e-6)
    assert _H100_EPILOGUE_S == pytest.approx(1.43e-6, abs=0.01e-6)
    assert gemm_time_s(h100, g) == \
        pytest.approx(10 * (mainloop + _H100_EPILOGUE_S) + _H100_FILL_S, rel=1e-9)


def test_a100_main_loop_divides_out_the_tile_overhead_at_the_grids_deepest_k():
    """A100's 0.738 is MAMF 0.869 x the sustained-clock ratio 0.849; the model's fastest grid
    shape is a whole-wave shape at k = 20480, where a 128 x 256 tile's fill and epilogue cost
    what the main loop must make up: the main loop runs faster than 0.738, and the published
    best shape (k = 5120, more overhead per tile) below it."""
    a100 = GPUS["a100-80gb"]
    assert a100.benchmark_shape == (1024, 10240, 5120)
    assert a100.compute_efficiency == pytest.approx(0.869 * 0.849, abs=5e-4)
    e_main = mainloop_efficiency(a100)
    tm, tn, k = 128, 256, 20480
    mainloop = 2 * tm * tn * k * 108 / (a100.peak_flop_per_s * e_main)
    whole_wave = e_main * mainloop / (mainloop + tile_overhead_s(a100, tm, tn, k, (2, 2)))
    assert whole_wave == pytest.approx(a100.compute_efficiency, rel=1e-8)
    assert mainloop_efficiency(a100) == pytest.approx(0.746, abs=0.002)
    best = Gemm(1024, 10240, 5120)
    assert best.flop / gemm_time_s(a100, best) / a100.peak_flop_per_s < 0.738


def test_each_kernel_family_pays_what_it_cannot_hide():
    """Ampere: fill and epilogue per tile; Hopper (cooperative): epilogue per tile, one fill per
    kernel; Blackwell (epilogue beside the next tile's math): one fill and epilogue per kernel."""
    args = (128, 256, 64, (2, 2))
    for name in ("h100-sxm", "h200"):
        gpu = GPUS[name]
        assert gpu.persistent_gemm and not gpu.overlapped_epilogue
        assert tile_overhead_s(gpu, *args) == epilogue_s(gpu, 128, 256, (2, 2)) > 0.0
        assert kernel_overhead_s(gpu, *args) == fill_s(gpu, *args) > 0.0
    for name in ("b200", "gb200"):
        gpu = GPUS[name]
        assert gpu.persistent_gemm and gpu.overlapped_epilogue
        assert tile_overhead_s(gpu, *args) == 0.0
        assert kernel_overhead_s(gpu, *args) == fill_epilogue_s(gpu, *args) > 0.0
    a100 = GPUS["a100-80gb"]
    assert kernel_overhead_s(a100, *args) == 0.0
    assert tile_overhead_s(a100, *args) == fill_epilogue_s(a100, *args)


@pytest.mark.parametrize("name,bf16,fp8,memory_gb,bandwidth_gbyte_per_s,sms", [
    ("h100-sxm", 989, 1979, 80, 3350, 132),
    ("h200", 989, 1979, 141, 4800, 132),
    ("b200", 2250, 4500, 180, 8000, 148),
    ("gb200", 2500, 5000, 186, 8000, 148),
])
def test_data_sheet_figures(name, bf16, fp8, memory_gb, bandwidth_gbyte_per_s, sms):
    gpu = GPUS[name]
    assert gpu.peak_flop_per_s == tflops_to_flop_per_s(bf16)
    assert gpu.fp8_peak_flop_per_s == tflops_to_flop_per_s(fp8)
    assert gpu.memory_bytes == pytest.approx(memory_gb * 2**30)
    assert gpu.memory_bandwidth_bytes_per_s == gbyte_per_s_to_bytes_per_s(bandwidth_gbyte_per_s)
    assert gpu.sm_count == sms


def test_measured_efficiencies():
    """Bekman's MAMF/peak x the sustained-clock ratio of the architecture (Hopper 0.849,
    Blackwell 0.840); Hopper BF16 is the measured MSMF 0.711."""
    expected = {"h100-sxm": (0.711, 0.709 * 0.849), "h200": (0.711, 0.734 * 0.849),
                "b200": (0.776 * 0.840, 0.763 * 0.840), "gb200": (0.729 * 0.840, 0.723 * 0.840)}
    for name, (bf16, fp8) in expected.items():
        assert GPUS[name].compute_efficiency == pytest.approx(bf16, abs=5e-4)
        assert GPUS[name].fp8_compute_efficiency == pytest.approx(fp8, abs=5e-4)


def test_nvlink_and_nic_line_rates():
    assert LINKS["nvlink4"].bandwidth_bytes_per_s == gbyte_per_s_to_bytes_per_s(450)
    assert LINKS["nvlink5"].bandwidth_bytes_per_s == gbyte_per_s_to_bytes_per_s(900)
    assert NICS["connectx-7"].bandwidth_bytes_per_s == gbit_per_s_to_bytes_per_s(400)
    assert NICS["connectx-8"].bandwidth_bytes_per_s == gbit_per_s_to_bytes_per_s(800)


def test_fp8_gemm_is_faster_by_the_rate_ratio_on_a_large_gemm():
    h100 = GPUS["h100-sxm"]
    g = Gemm(128 * 132 * 4, 256 * 8, 16384)  # whole waves of 128x256 tiles, compute-bound
    ratio = gemm_time_s(h100, g) / gemm_time_s(h100, g, fp8=True)
    fp8_rate = h100.fp8_peak_flop_per_s * mainloop_efficiency(h100, True)
    bf16_rate = h100.peak_flop_per_s * mainloop_efficiency(h100)
    epilogues = 2 * g.m * g.n / (0.9 * 3350e9)  # the bf16 outputs of both, per-tile epilogues
    assert ratio == pytest.approx((g.flop / bf16_rate + epilogues) / (g.flop / fp8_rate + epilogues),
                                  rel=1e-3)  # one fill aside
    assert ratio > 1.5


def _layer(fp8: bool) -> Workload:
    return Workload(num_layers=80, hidden=8192, heads=64, seq=4096, vocab=128256, ffn=28672,
                    tie_embeddings=False, micro_batch=1, global_batch=512, dtype_bytes=2,
                    grad_bytes=4, recompute="none", sequence_parallel=True, bucket_bytes=40e6,
                    flash_attention=True, fp8_gemms=fp8)


def test_fp8_speeds_up_the_linear_layers_not_attention_or_the_head():
    h100 = GPUS["h100-sxm"]
    assert T.layer_s(h100, _layer(True), 4, False) < 0.8 * T.layer_s(h100, _layer(False), 4, False)
    assert T.head_s(h100, _layer(True), 4, False) == T.head_s(h100, _layer(False), 4, False)


def test_fp8_on_a_gpu_without_fp8_names_the_field():
    with pytest.raises(FieldError, match="training.precision"):
        T.layer_s(GPUS["a100-80gb"], _layer(True), 4, False)


def test_unknown_precision_names_the_field(write_scenario):
    from holmes_sim.errors import ScenarioError
    from holmes_sim.prepare import prepare
    text = small_scenario().replace("training: {", "training: {precision: fp4, ")
    with pytest.raises(ScenarioError) as info:
        prepare(write_scenario(text))
    assert "training.precision" in str(info.value) and "fp8" in str(info.value)


def _small(fp8: bool, sp: bool) -> Workload:
    return Workload(num_layers=2, hidden=1024, heads=8, seq=512, vocab=32000, ffn=4096,
                    tie_embeddings=False, micro_batch=2, global_batch=16, dtype_bytes=2,
                    grad_bytes=2, recompute="none", sequence_parallel=sp, bucket_bytes=40e6,
                    flash_attention=True, fp8_gemms=fp8)


def test_fp8_quantization_bytes_by_hand_without_sequence_parallelism():
    """M = 2 x 512 = 1024 tokens, h = 1024, f = 4096, t = 2, multi-head (QKV 3h).
    Forward: cast-transposes of the projection input (M h/t) and fc2 input (M f/t) at 4 bytes,
    minus 1 byte for each of the two FP8 norm outputs (M h): 4 (524288 + 2097152) - 2097152.
    Backward: two FP8 transposes of M h (2 bytes), cast-transposes of QKV's (3 M h / t) and
    fc1's (M f / t) output gradients and of the two row-parallel M h gradients (4 bytes)."""
    w = _small(True, False)
    fwd, bwd = T.fp8_quantization_bytes(w, 2)
    m, h, f = 1024, 1024, 4096
    assert fwd == 4 * (m * h / 2 + m * f / 2) - 2 * m * h == 8_388_608
    assert bwd == 2 * 2 * m * h + 4 * (3 * m * h / 2 + m * f / 2) + 2 * 4 * m * h == 27_262_976


def test_fp8_quantization_bytes_by_hand_with_sequence_parallelism():
    """SP, t = 2: the row-parallel inputs are cast (3 bytes) and transposed in the backward
    (2 bytes); the norms save 1 byte on the rank's M h / t; the row-parallel output gradients
    are cast on M h / t (3 bytes) and transposed after the all-gather (2 bytes on M h)."""
    fwd, bwd = T.fp8_quantization_bytes(_small(True, True), 2)
    m, h, f = 1024, 1024, 4096
    rows = m * h / 2 + m * f / 2
    assert fwd == 3 * rows - 2 * m * h / 2
    assert bwd == 2 * 2 * m * h + 2 * rows + 4 * (3 * m * h / 2 + m * f / 2) + \
        2 * (3 * m * h / 2 + 2 * m * h)


def test_fp8_quantization_bytes_are_priced_at_hbm_bandwidth_in_the_layer():
    h100 = GPUS["h100-sxm"]
    w_fp8, tp = _small(True, False), 2
    fwd, bwd = T.fp8_quantization_bytes(w_fp8, tp)
    k = T.layer_kernels(w_fp8, tp)
    plain = T.layer_kernels(_small(False, False), tp)
    assert k.other_bytes_fwd - plain.other_bytes_fwd == pytest.approx(fwd)
    assert k.other_bytes_bwd - plain.other_bytes_bwd == pytest.approx(bwd)
    extra = T.layer_pass_s(h100, w_fp8, tp, True) - \
        T._gemms_s(h100, k.dense, 2, True, True) - T._memory_s(h100, plain.other_bytes_bwd) - \
        T.attention_core_s(h100, k, 2, True)
    assert extra == pytest.approx(bwd / (3350e9 * 0.9), rel=1e-9)


def test_the_one_pass_overheads_equal_the_documented_terms():
    from holmes_sim.cost.gemm import _overheads
    for gpu in GPUS.values():
        for tm, tn in ((128, 256), (256, 128), (128, 128)):
            for k, nbytes in ((16, (2, 2)), (48, (1, 2)), (4096, (2, 2))):
                assert _overheads(gpu, tm, tn, k, nbytes) == \
                    (tile_overhead_s(gpu, tm, tn, k, nbytes), kernel_overhead_s(gpu, tm, tn, k, nbytes))


@pytest.mark.parametrize("name,fp8", _RATES)
def test_the_grid_maximum_is_every_grid_shapes_maximum_to_the_bit(name, fp8):
    """`_grid_tilings` keeps the most work of each wave count; the maximum over every m x n of the
    grid, each priced from its own work and waves, is the same float."""
    import numpy as np

    from holmes_sim.cost.gemm import _TILES, _overheads, best_tile_quantization
    gpu, grid = GPUS[name], search_grid(fp8)
    sizes = np.arange(grid.start, grid.stop, grid.step, dtype=np.int64)
    m, n = sizes[:, None], sizes[None, :]
    rate, k = gemm_rate(gpu, fp8), grid[-1]
    nbytes = (1, 2) if fp8 else (2, 2)
    for e_main in (rate.measured_efficiency, mainloop_efficiency(gpu, fp8), 0.99):
        best = 0.0
        for tm, tn in _TILES:
            waves = -(-(-(-m // tm) * -(-n // tn)) // gpu.sm_count)
            work = m * n / (gpu.sm_count * tm * tn)
            assert best_tile_quantization(gpu.sm_count, (tm, tn), grid) == \
                float(np.max(work / waves))
            mainloop = 2.0 * tm * tn * k * gpu.sm_count / (rate.peak_flop_per_s * e_main)
            per_tile, per_kernel = _overheads(gpu, tm, tn, k, nbytes)
            time = waves * (mainloop + per_tile) + per_kernel
            best = max(best, float(np.max(work * mainloop / time)) * e_main)
        assert grid_maximum_efficiency(gpu, e_main, fp8) == best
