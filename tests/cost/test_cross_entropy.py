"""The vocabulary-parallel cross entropy's HBM traffic by its kernels (`--cross-entropy-loss-
fusion`, `--cross-entropy-fusion-impl`), counted pass by pass from the kernels' sources, and its
effect on the simulated last pipeline stage."""

from __future__ import annotations

import pytest

from holmes_sim.cost.transformer import head_s
from holmes_sim.hardware.catalog import GPUS
from holmes_sim.model.workload import build_workload
from holmes_sim.prepare import prepare_text
from holmes_sim.runner import run_policy
from holmes_sim.spec.job import ModelSpec, TrainingSpec
from holmes_sim.spec.presets import preset_fields
from tests.conftest import small_scenario

H100 = GPUS["h100-sxm"]
FP32, BF16 = 4, 2

# Per kernel (bytes read, bytes written) per logit, from the sources: d is the logits' dtype.
_NATIVE = {  # megatron/core/fusions/fused_cross_entropy.py, each a torch.compile'd function
    "forward": lambda d: [(d, FP32),          # calculate_logits_max: cast, max; fp32 logits out
                          (FP32, FP32),       # calculate_predicted_logits: shift, exp in place
                          (FP32, FP32)],      # calculate_cross_entropy_loss: softmax in place
    "backward": lambda d: [(FP32, FP32 + BF16)]}  # calculate_gradients: softmax changed in
#                                               place (written back), bf16 gradient returned
_TE = {  # transformer_engine .../triton/cross_entropy.py (TE 2.2-2.17)
    "forward": lambda d: [(d, 0),             # online_softmax_kernel
                          (d, d)],            # cross_entropy_kernel: gradient over the logits
    "backward": lambda d: [(d, d)]}           # element_mul_kernel, in place


def _passes(kernels: str, d: int) -> tuple[float, float]:
    """Bytes per logit (forward, backward) summed over the kernels above."""
    if kernels == "unfused":  # the unfused head's own count (`cost.transformer`): 40 and 16
        return 40.0, 16.0
    table = _NATIVE if kernels == "native" else _TE
    return tuple(float(sum(r + w for r, w in table[side](d))) for side in ("forward", "backward"))


def _workload(kernels: str, precision: str = "bf16"):
    fused = kernels != "unfused"
    training = TrainingSpec(global_batch_size=8, micro_batch_size=1, precision=precision,
                            cross_entropy_loss_fusion=fused,
                            cross_entropy_fusion_impl="te" if kernels == "te" else "native")
    return build_workload(ModelSpec(**{**preset_fields("llama3-8b"), "seq_length": 8192}),
                          training, 1)


@pytest.mark.parametrize("precision, d", [("bf16", BF16), ("fp32", FP32)])
@pytest.mark.parametrize("kernels", ["native", "te"])
@pytest.mark.parametrize("backward", [False, True])
def test_a_fused_cross_entropy_saves_the_bytes_its_kernels_do_not_move(kernels, backward,
                                                                       precision, d):
    """head_s differs from the unfused head by the bytes saved at the streaming rate, on a
    128,256-entry vocabulary over 8,192 tokens (one GPU's logits, 1.05e9), for bf16 and fp32
    logits."""
    unfused, fused = _workload("unfused", precision), _workload(kernels, precision)
    assert fused.cross_entropy == kernels and unfused.cross_entropy == "unfused"
    assert fused.dtype_bytes == d
    logits = 8192 * unfused.vocab
    side = int(backward)
    saved = (_passes("unfused", d)[side] - _passes(kernels, d)[side]) * logits
    rate = H100.memory_bandwidth_bytes_per_s * H100.memory_efficiency
    assert head_s(H100, unfused, 1, backward) - head_s(H100, fused, 1, backward) == \
        pytest.approx(saved / rate, rel=1e-9)
    assert saved > 0


@pytest.mark.parametrize("kernels", ["native", "te"])
def test_only_the_last_stage_gains_the_fused_cross_entropy_in_the_simulation(kernels):
    """1F1B over two stages, 16 micro-batches: the last stage's busy time falls by 16 x (the
    head's forward + backward saving); the first stage's does not change."""
    base = small_scenario(pp=2, vocab=51200)
    fused_line = (f"micro_batch_size: 1, cross_entropy_loss_fusion: true, "
                  f"cross_entropy_fusion_impl: {'te' if kernels == 'te' else 'native'}}}")
    fused = base.replace("micro_batch_size: 1}", fused_line)
    assert fused != base
    results = []
    for text in (base, fused):
        prepared = prepare_text(text)
        results.append((prepared, run_policy(prepared, "megatron").result))
    (p0, m0), (p1, m1) = results
    gpu, tp = GPUS["a100-80gb"], 8
    saving = sum(head_s(gpu, p0.workload, tp, b) - head_s(gpu, p1.workload, tp, b)
                 for b in (False, True))
    assert saving > 0
    assert m0.stage_busy_s[0] == pytest.approx(m1.stage_busy_s[0], rel=1e-12)
    assert m0.stage_busy_s[-1] - m1.stage_busy_s[-1] == pytest.approx(16 * saving, rel=1e-9)
    assert m1.iteration_time_s < m0.iteration_time_s
