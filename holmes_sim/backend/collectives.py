"""Ring collectives and the all-to-all over a plan group's point-to-point connections, and a
rank's TP and EP group collectives built on them.

The rings move the volume the analytic model assumes, (p-1)/p * N elements per member and
phase, which gloo's own collectives do not (see each function).
"""

from __future__ import annotations

import time

import torch

from holmes_sim.backend.groups import BuiltGroup


def ring_reduce_scatter(group: BuiltGroup, flat: torch.Tensor, tag: int) -> torch.Tensor:
    """Sum `flat` over the group; returns this member's reduced shard (a view of `flat`).

    A ring: p - 1 steps, each sending one 1/p shard, so every member sends (p-1)/p * N elements,
    the volume the analytic model assumes. (gloo's own reduce_scatter in torch 2.13 moves an
    all-reduce's volume, 2 (p-1)/p * N, measured on loopback.) Member i ends with shard i.
    """
    p, i = group.size, group.group_rank
    shards = flat.view(p, -1)
    right, left = (i + 1) % p, (i - 1) % p
    incoming = torch.empty_like(shards[0])
    for step in range(p - 1):
        send = group.send(shards[(i - step - 1) % p], right, tag + step)
        group.recv(incoming, left, tag + step).wait()
        shards[(i - step - 2) % p].add_(incoming)
        send.wait()  # the next step reads the shard this step just summed into, not this one
    return shards[i]


def all_gather(group: BuiltGroup, flat: torch.Tensor, tag: int) -> None:
    """Fill every shard of `flat` from its owner: a ring of p - 1 steps, each passing one shard
    on, so every member sends (p-1)/p * N elements (NCCL's ring all-gather; the volume the
    analytic model assumes). Point-to-point like `ring_reduce_scatter`: gloo's own allgather
    ran 1.4x slower than its bytes at the NIC's rate on the testbed (0.5 MB buckets, p = 2,
    100 Mbit/s, rate-sized shaper buckets: 122 ms where send/recv took 87 ms)."""
    p, i = group.size, group.group_rank
    shards = flat.view(p, -1)
    right, left = (i + 1) % p, (i - 1) % p
    for step in range(p - 1):
        send = group.send(shards[(i - step) % p], right, tag + step)
        group.recv(shards[(i - step - 1) % p], left, tag + step).wait()
        send.wait()



class TensorParallelComm:
    """A rank's collectives on its TP group (`group` None: no TP), counted and timed."""

    def __init__(self, group: BuiltGroup | None, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank
        self._calls = 0  # TP collectives so far: both ranks of a group run them in one order
        self.collectives = 0  # of the iterations (not the parameter dump)
        self.comm_s = 0.0  # seconds spent in them (not emulated compute)
        self.training = True  # False once the iterations are done

    def _tag(self) -> int:
        """The next TP collective's tags (p - 1 ring steps in each of two phases)."""
        self._calls += 1
        self.collectives += self.training
        return (self._calls % (1 << 24)) * 2 * self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The TP group's sum of `x`, a new tensor: the ring reduce-scatter and all-gather the
        simulator prices on the intra-node link [N21, section 3.2]."""
        t = time.perf_counter()
        p = self.size
        flat = torch.zeros(-(-x.numel() // p) * p, dtype=x.dtype, device=x.device)
        flat[:x.numel()] = x.detach().reshape(-1)
        tag = self._tag()
        ring_reduce_scatter(self.group, flat, tag)
        all_gather(self.group, flat, tag + p)
        self.comm_s += time.perf_counter() - t
        return flat[:x.numel()].view_as(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every TP member's `x`, stacked in group-rank order: shape (tp, *x.shape)."""
        t = time.perf_counter()
        p = self.size
        flat = torch.empty(x.numel() * p, dtype=x.dtype, device=x.device)
        flat.view(p, -1)[self.rank].copy_(x.detach().reshape(-1))
        all_gather(self.group, flat, self._tag())
        self.comm_s += time.perf_counter() - t
        return flat.view(p, *x.shape)

    def slice(self, tensor: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of a pipeline message (each rank sends 1/tp of it)."""
        return tensor.reshape(self.size, -1)[self.rank]


def pairwise_all_to_all(group: BuiltGroup, chunks: torch.Tensor, tag: int) -> torch.Tensor:
    """The all-to-all of `chunks` (group size, ...): chunk j to group rank j, all receives and
    sends posted at once, then waited (NCCL's `all_to_all_single`, a send and a receive per peer
    in one group: torch/csrc/cuda/nccl.cpp `all2all_single_equal_split`; the pairwise exchange
    of Thakur et al. 2005). Each member sends (p-1)/p of `chunks`, the volume
    `cost.expert_parallel` prices. Returns the chunks received, chunk j from group rank j.

    Under gloo the sends and receives use the group's two connections (one per direction,
    `groups.py`; gloo's own alltoall would put both directions of a pair on one). Under NCCL
    (one communicator, no `pg_rev`) it is `all_to_all_single` itself, Megatron-Core's call
    (megatron/core/tensor_parallel/mappings.py `_AllToAll`): separate sends and receives to one
    peer share a stream there, where a send could wait for a receive queued behind it."""
    if group.pg_rev is None:
        import torch.distributed as dist

        out = torch.empty_like(chunks)
        dist.all_to_all_single(out, chunks, group=group.pg)
        return out
    p, i = group.size, group.group_rank
    out = torch.empty_like(chunks)
    out[i].copy_(chunks[i])
    peers = [j for j in range(p) if j != i]
    # Receives first: gloo's send waits for the receiver's ready message (groups.py).
    works = [group.recv(out[j], j, tag + j) for j in peers]
    works += [group.send(chunks[j], j, tag + i) for j in peers]
    for work in works:
        work.wait()
    return out


class ExpertParallelComm:
    """A rank's all-to-alls on its EP group, counted (calls and bytes it sent, of the training
    iterations) and timed."""

    def __init__(self, group: BuiltGroup) -> None:
        self.group = group
        self._calls = 0
        self.collectives = 0  # all-to-alls of the iterations
        self.bytes_sent = 0  # bytes sent to peers by them
        self.comm_s = 0.0  # seconds spent in them
        self.training = True

    def all_to_all(self, chunks: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        self._calls += 1
        p = self.group.size
        if self.training:
            self.collectives += 1
            self.bytes_sent += (p - 1) * chunks[0].numel() * chunks.element_size()
        out = pairwise_all_to_all(self.group, chunks, (self._calls % (1 << 24)) * p)
        self.comm_s += time.perf_counter() - t
        return out
