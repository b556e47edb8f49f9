"""What a rank of a real run needs besides the plan (`RunConfig`), as launch writes it to JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from holmes_sim.backend.groups import default_interface_of
from holmes_sim.backend.model import GPTConfig


@dataclass(slots=True)
class RunConfig:
    """Everything a rank needs besides the plan.

    Attributes:
        model: the GPT shape.
        micro_batch_size: sequences per micro-batch.
        iterations: total iterations run, warm-up included.
        warmup: leading iterations left out of the timing summary.
        lr: learning rate.
        optimizer: "adam" or "sgd".
        store: rendezvous: {"kind": "file", "path": P} or {"kind": "tcp", "host": H, "port": N};
            empty: launch fills in a FileStore in its temp dir.
        interface_map: plan NIC name -> interface name; key "*" maps every NIC (local tests: "lo").
            NICs not mapped keep their name (the testbed names interfaces like NICs).
        world_interfaces: per-rank interface of the world (barrier) group, or empty: gloo default.
        output_dir: where rank_R.json / rank_R.log go; empty: launch fills it in.
        timeout_s: gloo operation and rendezvous timeout, seconds.
        bucket_numel: gradient elements per DP bucket (the overlapped mode's unit of launch);
            None: the framework's default (`Plan.bucket_numel`).
        torch_threads: intra-op threads per rank (1: ranks share few cores honestly).
        dry_run: build groups and stages, then exit without training.
    """

    model: GPTConfig = field(default_factory=GPTConfig)
    micro_batch_size: int = 2
    iterations: int = 3
    warmup: int = 1
    lr: float = 1e-3
    optimizer: str = "adam"
    store: dict = field(default_factory=dict)
    interface_map: dict = field(default_factory=dict)
    world_interfaces: list = field(default_factory=list)
    output_dir: str = ""
    timeout_s: float = 60.0
    bucket_numel: int | None = 1 << 16
    torch_threads: int = 1
    dry_run: bool = False
    pipeline_split: bool = False
    """Each TP rank sends 1/tp of a pipeline message and the receiving TP group all-gathers it
    (`Workload.pp_message_bytes`: sequence parallelism or Megatron-LM's scatter-gather of
    2021-2022 [N21, 4.1]); False: every TP rank sends the whole tensor, as Megatron-Core does."""
    backend: str = "gloo"
    """"gloo" (CPU, emulated testbed) or "nccl" (GPUs, under torchrun; see backend/nccl.py)."""
    nic_devices: dict = field(default_factory=dict)
    """NCCL only: plan NIC name -> the site's HCA or interface name (e.g. "ib0": "mlx5_0")."""
    roce_fabrics: list = field(default_factory=list)
    """NCCL only: fabrics that are RoCE (get NCCL_IB_GID_INDEX); empty: fabrics named *roce*."""
    roce_gid_index: int = 3
    """NCCL only: the GID index of RoCE v2 on the site's HCAs (`show_gids`)."""
    bootstrap_ifname: str = ""
    """NCCL only: the Ethernet interface for NCCL's bootstrap on RDMA groups and for the gloo
    barrier group; empty: NCCL's and gloo's own choice."""
    node_hosts: dict = field(default_factory=dict)
    """NCCL only: plan node name -> host name, for the placement check (unmapped: equal)."""
    dump_params: bool = False
    """Put every final parameter (canonical full-model name -> values) in the rank's result;
    for the gradient-equality tests on tiny models."""
    mutation: str = ""
    """Test only: inject a known bug (one of MUTATIONS) so the equality tests can prove they
    catch it. Empty in every real run."""
    emulated_compute: list = field(default_factory=list)
    """Per rank, the compute durations to emulate (seconds; keys of `emulation.EMULATED_KEYS`),
    or empty: real compute. Emulated, every compute op (embedding, each layer, head, forward and
    backward, the optimizer step) becomes a precise wait of its duration while every byte still
    moves: activations and gradients of the real shapes over the pipeline groups, gradient
    buckets over the DP group, the overlap threads as in a real run. Waiting ranks leave the
    host's cores to the communication, so a busy host does not change what is measured; the
    simulator predicts with the same durations. Losses are not computed (the result has none)."""
    realtime_priority: int = 0
    """> 0: the rank (and every thread it starts) runs under SCHED_FIFO at this priority, so a
    waiting rank wakes on time and its messages move when due although other processes keep
    the host's cores busy (the kernel's RT throttling still leaves them 5%). For emulated
    compute, whose ranks mostly wait; 0: the default scheduler. Without the permission the
    rank runs on, and its result says so."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> RunConfig:
        d = json.loads(text)
        d["model"] = GPTConfig(**d["model"])
        return RunConfig(**d)

    def interface_of(self, nic: str) -> str:
        """Interface a plan NIC maps to (see `interface_map`)."""
        if "*" in self.interface_map:
            return self.interface_map["*"]
        return self.interface_map.get(nic, default_interface_of(nic))


# Known bugs the gradient-equality tests must catch (RunConfig.mutation).
MUTATIONS = ("reduce-scatter-no-dp", "all-reduce-no-dp", "no-microbatch-scaling", "grad-x7",
             "tp-no-input-grad-reduce", "experts-reduced-over-dp")
