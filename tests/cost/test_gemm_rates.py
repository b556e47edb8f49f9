"""One GEMM derivation: the model reproduces each catalog GPU's measured efficiency at the shape
it was measured at; FP8 GEMMs at the FP8 tensor rate; the Hopper/Blackwell catalog entries."""

from __future__ import annotations

import pytest

from holmes_sim.cost import transformer as T
from holmes_sim.cost.gemm import Gemm, gemm_time_s, mainloop_efficiency, tile_overhead_s
from holmes_sim.errors import FieldError
from holmes_sim.hardware.catalog import GPUS, LINKS, NICS, gemm_rate
from holmes_sim.model.workload import Workload
from holmes_sim.units import gbit_per_s_to_bytes_per_s, gbyte_per_s_to_bytes_per_s, tflops_to_flop_per_s
from tests.conftest import small_scenario

_RATES = [(name, fp8) for name, gpu in GPUS.items() for fp8 in (False, True)
          if not fp8 or gpu.fp8_peak_flop_per_s is not None]


@pytest.mark.parametrize("name,fp8", _RATES)
def test_the_model_at_the_benchmark_shape_reproduces_the_measured_efficiency(name, fp8):
    gpu = GPUS[name]
    rate = gemm_rate(gpu, fp8)
    shape = Gemm(*rate.benchmark_shape)
    achieved = shape.flop / gemm_time_s(gpu, shape, fp8=fp8) / rate.peak_flop_per_s
    assert achieved == pytest.approx(rate.measured_efficiency, rel=0.01)
    assert rate.measured_efficiency <= mainloop_efficiency(gpu, fp8) < 1.0


def test_a100_mamf_shape_pays_fill_and_epilogue_inside_the_measured_rate():
    """A100's 0.738 is MAMF 0.869 at 1024x10240x5120 x the sustained-clock ratio 0.849; the main
    loop runs faster, by what the tile overhead and the waves cost at that shape."""
    a100 = GPUS["a100-80gb"]
    assert a100.benchmark_shape == (1024, 10240, 5120)
    assert a100.compute_efficiency == pytest.approx(0.869 * 0.849, abs=5e-4)
    assert tile_overhead_s(a100, 128, 256, 5120, (2, 2)) > 0
    assert mainloop_efficiency(a100) == pytest.approx(0.781, abs=0.002)


def test_hopper_and_blackwell_hide_the_tile_overhead():
    for name in ("h100-sxm", "h200", "b200", "gb200"):
        assert GPUS[name].persistent_gemm
        assert tile_overhead_s(GPUS[name], 128, 256, 64, (2, 2)) == 0.0


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
    assert ratio == pytest.approx(fp8_rate / bf16_rate, rel=1e-9)
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
