"""Compute time of layers on a GPU: a kernel-by-kernel default (`cost.transformer`), or a measured profile.

Both answer per micro-batch, per GPU of a TP group (the group's GPUs run in lock-step).
The profile is the JSON `holmes-sim validate` writes (see `docs/validation.md`):

    {"schema": "holmes-sim-profile/1", "provenance": {...},
     "compute": {GPU_MODEL: {"layer_forward_s", "layer_backward_s", "embedding_forward_s",
                             "embedding_backward_s", "head_forward_s", "head_backward_s",
                             "optimizer_s_per_param", "op_overhead_s"}},
     "fabrics": {FABRIC: {"bandwidth_bytes_per_s", "latency_s", "collective_step_s"}},
     "intra_node": {"bandwidth_bytes_per_s", "latency_s", "collective_step_s"},  # if measured
     "host": {"effective_cores", "compute_cv"}}   # only for an emulated testbed (shared CPU)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from holmes_sim.hardware.catalog import GpuModel
from holmes_sim.cost import transformer
from holmes_sim.errors import ScenarioError
from holmes_sim.model.workload import Workload

PROFILE_SCHEMA = "holmes-sim-profile/1"
# The mixed-precision optimizer step is memory-bound. Per parameter of the GPU's shard (Megatron's
# FP16/BF16 optimizer, optimizer.py): copy the 16-bit gradient to the fp32 main gradient (2 + 4),
# unscale and check for inf/NaN (4 + 4), gradient-norm clipping reads it (4), Adam reads and writes
# the fp32 master weight, momentum and variance and reads the gradient (3 x 8 + 4), and the master
# weight is copied back to the 16-bit model weight (4 + 2): 52 bytes of HBM traffic.
_ADAM_BYTES_PER_PARAM = 52.0
# Every step also passes over the GPU's whole gradient buffer (every parameter it holds, sharded
# optimizer or not), `Workload.gradient_buffer_passes` x g bytes per gradient: the zeroing, the NaN
# check's norm and the 1/DP scaling (PyTorch DDP's default all-reduce hook divides likewise).


class ComputeModel(Protocol):
    """Seconds of compute per micro-batch on one GPU of a TP group of degree `tp`."""

    def layer_s(self, gpu: GpuModel, workload: Workload, tp: int, backward: bool) -> float: ...

    def embedding_s(self, gpu: GpuModel, workload: Workload, tp: int, backward: bool) -> float: ...

    def head_s(self, gpu: GpuModel, workload: Workload, tp: int, backward: bool) -> float: ...

    def optimizer_s(self, gpu: GpuModel, params_per_gpu: float) -> float: ...

    def gradient_buffer_s(self, gpu: GpuModel, workload: Workload, params_per_gpu: float) -> float:
        """Seconds a step spends on the passes over the gradients of `params_per_gpu` parameters,
        the GPU's whole buffer, not its optimizer shard (`Workload.gradient_buffer_passes`:
        zeroing, NaN check, 1/DP scaling); 0 when the model cannot tell."""
        ...

    def op_overhead_s(self, gpu: GpuModel) -> float:
        """Fixed cost of launching one forward or backward op (framework time), seconds."""
        ...

    def tp_overlap_windows_s(self, gpu: GpuModel, workload: Workload, tp: int) -> tuple[float, ...]:
        """Per layer, the backward GEMMs an asynchronous TP all-reduce can hide behind, seconds
        (`training.async_tensor_model_parallel_allreduce`); empty when the model cannot tell."""
        ...

    def tp_userbuffer_windows_s(self, gpu: GpuModel, workload: Workload, tp: int,
                                backward: bool) -> tuple[float, ...]:
        """Per layer pass, the GEMM beside each TP all-gather and reduce-scatter under
        `training.tp_comm_overlap`, seconds (`transformer.tp_userbuffer_windows_s`); empty
        when the model cannot tell."""
        ...

    def head_wgrad_s(self, gpu: GpuModel, workload: Workload, tp: int) -> float:
        """The output layer's weight-gradient GEMM of a micro-batch, seconds (part of
        `head_s(backward=True)`); 0 when the model cannot tell."""
        ...

    def held_sm_loss_s(self, gpu: GpuModel, workload: Workload, tp: int,
                       held: int) -> tuple[float, float]:
        """(a layer's backward, the output layer's backward): seconds their GEMMs lose on
        sm_count - `held` SMs (`transformer.held_sm_loss_s`); (0, 0) when the model cannot
        tell."""
        ...


@dataclass(frozen=True, slots=True)
class KernelCompute:
    """The default: every kernel of a layer priced from its shape (`cost.transformer`): GEMMs with
    tile and wave quantization at the GPU's measured achievable GEMM rate, memory-bound kernels at
    its achievable HBM bandwidth, fused attention at its measured efficiency."""

    def layer_s(self, gpu: GpuModel, workload: Workload, tp: int, backward: bool) -> float:
        return transformer.layer_s(gpu, workload, tp, backward)

    def embedding_s(self, gpu: GpuModel, workload: Workload, tp: int, backward: bool) -> float:
        return transformer.embedding_s(gpu, workload, tp, backward)

    def head_s(self, gpu: GpuModel, workload: Workload, tp: int, backward: bool) -> float:
        return transformer.head_s(gpu, workload, tp, backward)

    def optimizer_s(self, gpu: GpuModel, params_per_gpu: float) -> float:
        return params_per_gpu * _ADAM_BYTES_PER_PARAM / (gpu.memory_bandwidth_bytes_per_s *
                                                         gpu.memory_efficiency)

    def gradient_buffer_s(self, gpu: GpuModel, workload: Workload, params_per_gpu: float) -> float:
        return (params_per_gpu * workload.gradient_buffer_passes * workload.grad_bytes
                / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency))

    def op_overhead_s(self, gpu: GpuModel) -> float:
        return 0.0  # kernel launches overlap GPU work in a well-fed training loop

    def tp_overlap_windows_s(self, gpu: GpuModel, workload: Workload, tp: int) -> tuple[float, ...]:
        return transformer.tp_overlap_windows_s(gpu, workload, tp)

    def tp_userbuffer_windows_s(self, gpu: GpuModel, workload: Workload, tp: int,
                                backward: bool) -> tuple[float, ...]:
        return transformer.tp_userbuffer_windows_s(gpu, workload, tp, backward)

    def head_wgrad_s(self, gpu: GpuModel, workload: Workload, tp: int) -> float:
        return transformer.head_wgrad_s(gpu, workload, tp)

    def held_sm_loss_s(self, gpu: GpuModel, workload: Workload, tp: int,
                       held: int) -> tuple[float, float]:
        return transformer.held_sm_loss_s(gpu, workload, tp, held)


@dataclass(frozen=True, slots=True)
class ProfiledCompute:
    """Measured per-micro-batch times by GPU model (TP degree 1: the validator runs no TP)."""

    times: dict[str, dict[str, float]]
    source: str

    def _get(self, gpu: GpuModel, key: str) -> float:
        entry = self.times.get(gpu.name)
        if entry is None:
            raise ScenarioError(f"{self.source}: profile has no compute entry for GPU model "
                                f"'{gpu.name}' (has: {', '.join(self.times)}); re-run calibration")
        return entry[key]

    def layer_s(self, gpu: GpuModel, workload: Workload, tp: int, backward: bool) -> float:
        return self._get(gpu, "layer_backward_s" if backward else "layer_forward_s") / tp

    def embedding_s(self, gpu: GpuModel, workload: Workload, tp: int, backward: bool) -> float:
        return self._get(gpu, "embedding_backward_s" if backward else "embedding_forward_s") / tp

    def head_s(self, gpu: GpuModel, workload: Workload, tp: int, backward: bool) -> float:
        return self._get(gpu, "head_backward_s" if backward else "head_forward_s") / tp

    def optimizer_s(self, gpu: GpuModel, params_per_gpu: float) -> float:
        return self._get(gpu, "optimizer_s_per_param") * params_per_gpu

    def gradient_buffer_s(self, gpu: GpuModel, workload: Workload, params_per_gpu: float) -> float:
        return 0.0  # the measured optimizer step includes the backend's gradient passes

    def op_overhead_s(self, gpu: GpuModel) -> float:
        entry = self.times.get(gpu.name, {})
        return entry.get("op_overhead_s", 0.0)

    def tp_overlap_windows_s(self, gpu: GpuModel, workload: Workload, tp: int) -> tuple[float, ...]:
        return ()  # a measured profile has no GEMM shapes

    def tp_userbuffer_windows_s(self, gpu: GpuModel, workload: Workload, tp: int,
                                backward: bool) -> tuple[float, ...]:
        return ()

    def head_wgrad_s(self, gpu: GpuModel, workload: Workload, tp: int) -> float:
        return 0.0

    def held_sm_loss_s(self, gpu: GpuModel, workload: Workload, tp: int,
                       held: int) -> tuple[float, float]:
        return 0.0, 0.0  # a measured profile has no GEMM shapes


@dataclass(frozen=True, slots=True)
class Profile:
    """A measured profile: compute times and per-fabric achieved link numbers."""

    compute: ProfiledCompute
    fabrics: dict[str, dict[str, float]]
    raw: dict

    @property
    def compute_cv(self) -> float:
        """Measured spread of compute op times on a shared host (0 when not measured)."""
        return float((self.raw.get("host") or {}).get("compute_cv", 0.0))

    @property
    def shared_cpu_cores(self) -> float | None:
        """Cores the ranks of an emulated testbed share (None: independent accelerators)."""
        host = self.raw.get("host")
        return None if not host else float(host["effective_cores"])


def load_profile(path: str | Path) -> Profile:
    """Read a profile JSON written by the validator's calibration.

    Raises:
        ScenarioError: when the file is missing, not JSON, of another schema or has a value
            missing, non-finite or out of range.
    """
    from holmes_sim.spec.profile import read_profile  # checks every value

    path = Path(path)
    raw = read_profile(path, PROFILE_SCHEMA)
    return Profile(ProfiledCompute(raw.get("compute", {}), str(path)), raw.get("fabrics", {}), raw)
