"""`training.attention_backend` (Megatron-Core's `--attention-backend`): flash runs at
FlashAttention-2's measured rates, auto and fused at cuDNN's, the same in the engine and the
analytic estimate; the combinations no stack runs are refused with the field named."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from holmes_sim.cli import app
from holmes_sim.cost.attention import fused_attention_s, kernel_rates, measured_rate_flop_per_s
from holmes_sim.errors import FieldError
from holmes_sim.hardware.catalog import GPUS
from holmes_sim.prepare import prepare
from holmes_sim.search.planner import Layout, confirm, evaluate
from holmes_sim.spec.job import TrainingSpec
from tests.conftest import REPO, small_scenario

H100, A100 = GPUS["h100-sxm"], GPUS["a100-80gb"]
SUSTAINED = 0.849
FULL = 4.0 * 4096 * 4096 * 128  # s = 4,096, one head of 128


def test_hopper_gpus_hold_flashattention_2s_rates_of_the_fa3_figures():
    """Shah et al. 2024, Figures 5 and 6, head dim 128: FA2 at s = 512 ... 16k."""
    fa2 = H100.flash_attention_rates
    assert fa2 is not None and GPUS["h200"].flash_attention_rates is fa2
    assert fa2.forward_causal_tflops == (191, 260, 298, 319, 333, 335)
    assert fa2.forward_full_tflops == (309, 350, 362, 368, 370, 370)
    assert fa2.backward_full_tflops == (214, 260, 291, 310, 318, 322)
    assert fa2.sustained_ratio == SUSTAINED == H100.attention_rates.sustained_ratio
    assert A100.flash_attention_rates is None


@pytest.mark.parametrize("backend, causal_tflops", [("auto", 518), ("fused", 518), ("flash", 319)])
def test_each_backend_runs_its_kernels_measured_rate(backend, causal_tflops):
    """s = 4,096, causal forward: cuDNN 518 TFLOP/s, FlashAttention-2 319."""
    assert fused_attention_s(H100, FULL, 4096, 4096, False, backend=backend) == \
        pytest.approx(FULL / 2 / (causal_tflops * 1e12 * SUSTAINED))
    rates = kernel_rates(H100, backend)
    assert measured_rate_flop_per_s(rates, 4096, False, True) == \
        pytest.approx((310 if backend == "flash" else 499) * 1e12 * SUSTAINED)


def test_without_flash_rates_the_tile_model_stays():
    for backend in ("auto", "flash"):
        assert fused_attention_s(A100, FULL, 4096, 4096, True, backend=backend) == \
            fused_attention_s(A100, FULL, 4096, 4096, True)


@pytest.mark.parametrize("backend, flash, message", [
    ("flash", False, "flash runs a fused attention kernel; set training.flash_attention: true"),
    ("fused", False, "fused runs a fused attention kernel"),
    ("unfused", True, "unfused computes the s x s scores"),
    ("local", False, "local is Megatron-Core's own attention"),
])
def test_backends_that_cannot_run_with_the_kernel_choice_are_refused(write_scenario, backend,
                                                                     flash, message):
    from holmes_sim.model.checks import check_attention_backend

    training = TrainingSpec(global_batch_size=8, micro_batch_size=1, flash_attention=flash,
                            attention_backend=backend)  # a frozen spec the planner may copy
    with pytest.raises(FieldError, match=message) as info:
        check_attention_backend(training)
    assert info.value.path == "training.attention_backend"
    path = write_scenario(small_scenario().replace(
        "micro_batch_size: 1}", f"micro_batch_size: 1, flash_attention: {str(flash).lower()}, "
                                f"attention_backend: {backend}}}"))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"training.attention_backend: {message}" in " ".join(result.output.split())


def test_an_unknown_backend_names_the_field_and_the_choices(write_scenario):
    path = write_scenario(small_scenario().replace(
        "micro_batch_size: 1}", "micro_batch_size: 1, flash_attention: true, "
                                "attention_backend: flash2}"))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2
    assert "training.attention_backend: 'flash2' is not allowed (expected one of: auto, flash, " \
           "fused, unfused, local); did you mean 'flash'?" in " ".join(result.output.split())


NEMO = REPO / "validation/published/scenarios/nemo_dgx_h100/llama2-7b-8gpu-nemo-24.07.yaml"


def _with_backend(write_scenario, backend: str):
    lines = [line for line in Path(NEMO).read_text().splitlines(keepends=True)
             if not line.startswith("  attention_backend:")]
    text = "".join(lines).replace("  flash_attention: true\n",
                                  f"  flash_attention: true\n  attention_backend: {backend}\n")
    return prepare(write_scenario(text))


def test_engine_and_estimate_price_flash_alike(write_scenario):
    """Llama 2 7B on one DGX H100 (TP 1, s = 4,096): FlashAttention-2 makes the step slower by
    the same seconds in the event engine and in the analytic estimate."""
    layout = Layout(1, 1, 8, 1, "1f1b", 1, "none", False)
    times = {}
    for backend in ("auto", "flash"):
        prepared = _with_backend(write_scenario, backend)
        estimated = evaluate(prepared, layout, "megatron")
        times[backend] = (estimated.predicted_iteration_s,
                          confirm(prepared, estimated).predicted_iteration_s)
    (est_auto, sim_auto), (est_flash, sim_flash) = times["auto"], times["flash"]
    assert sim_flash / sim_auto - 1 == pytest.approx(0.10, abs=0.02)
    assert est_flash - est_auto == pytest.approx(sim_flash - sim_auto, rel=0.01)
    assert est_flash / sim_flash - 1 == pytest.approx(0.0, abs=0.01)


def test_the_default_is_what_transformer_engine_picks():
    spec = TrainingSpec(global_batch_size=8, micro_batch_size=1, flash_attention=True)
    assert spec.attention_backend == "auto"
    assert dataclasses.replace(spec, attention_backend="fused").attention_backend == "fused"
