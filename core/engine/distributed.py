"""Tensor-parallel ranks: the process group, the collectives the layers call, and the sizes
each rank owns.

One engine with --tp-size N runs N worker processes (ranks), each with a 1/N slice of the
attention heads, the MLP's intermediate dim and the vocabulary, and its own KV pool for its
heads. torch.distributed joins them, and the hardware target's Platform says how: the backend
(`dist_backend()`: nccl, gloo, xccl, hccl, ...), the device a rank binds before joining
(`dist_bind`) and where the worker's own collectives run (`dist_device`), so the core names no
vendor and no device.

Every rank runs the same scheduler on the same inputs: rank 0 reads the client's messages and
broadcasts them (JSON bytes in a uint8 tensor; nothing is pickled) at the top of every loop turn,
then every rank applies them and steps. Their decisions agree because a scheduler's state is a
function of its inputs (the seeded sampler included) and every rank sees the same logits: the
LM head's vocab shards are all-gathered, so the full logits are the same bits everywhere. This
costs one small broadcast per step instead of shipping the batch (rank 0 deciding and the others
following would need every runner input serialized per step), and keeps graphs, overlap and
grammar masks per rank unchanged.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from core.contract.platform import Platform

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group and the collectives over it. size 1:
    every collective is the identity and torch.distributed is not needed (unless `group`
    is set: a one-rank group still runs its collectives through the backend, which is how the
    NCCL path is exercised on one GPU)."""

    rank: int = 0
    size: int = 1
    ep: bool = False  # experts placed whole on ranks (expert parallel) instead of split
    group: ProcessGroup | None = None  # None: the world group, or single

    @property
    def active(self) -> bool:
        return self.size > 1 or self.group is not None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (x returned)."""
        if self.active:
            torch.distributed.all_reduce(x, group=self._pg())
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size * n], rank r's part at [r * n, (r + 1) * n)."""
        if not self.active:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x, group=self._pg())
        return torch.cat(parts, dim=-1) if self.size > 1 else parts[0]

    def _pg(self) -> ProcessGroup | None:
        return self.group if self.group is not None else torch.distributed.group.WORLD

    # ---- sizes ----

    def split(self, n: int, what: str = "size") -> tuple[int, int]:
        """(start, length) of rank's even share of n (the resolver checked divisibility)."""
        if n % self.size:
            raise ValueError(f"{what} {n} does not split over {self.size} tensor-parallel ranks")
        part = n // self.size
        return self.rank * part, part

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, count) this rank holds: an even share, or one replicated head when
        there are fewer KV heads than ranks (ranks r * heads // size ... share head r // (size /
        heads), the head their query heads read)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "KV heads")
        if self.size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over "
                             f"{self.size} tensor-parallel ranks")
        return self.rank // (self.size // num_kv_heads), 1

    def vocab_part(self, vocab_size: int) -> tuple[int, int]:
        """(start, rows) of this rank's vocab shard: ceil(vocab / size) rows, the last shard
        padded past the vocabulary (its extra rows are zero and their logits dropped)."""
        part = -(-vocab_size // self.size)
        return self.rank * part, part


SINGLE = TPGroup()


def tp_problems(num_heads: int, num_kv_heads: int, intermediate_sizes: dict[str, int],
                tp: int, num_experts: int | None = None, ep: int = 1) -> list[str]:
    """Why a model's sizes do not split over `tp` ranks (empty: they do). Vocab never blocks:
    it is padded to a multiple of tp."""
    out = []
    if num_heads % tp:
        out.append(f"{num_heads} attention heads do not split over {tp} ranks")
    if num_kv_heads % tp and tp % num_kv_heads:
        out.append(f"{num_kv_heads} KV heads neither split over {tp} ranks nor replicate "
                   f"evenly onto them")
    for name, size in intermediate_sizes.items():
        if not size or (ep > 1 and name == "moe_intermediate_size"):
            continue  # under expert parallelism the experts stay whole
        if size % tp:
            out.append(f"{name} {size} does not split over {tp} ranks")
    if num_experts and ep > 1 and num_experts % ep:
        out.append(f"{num_experts} experts do not place evenly on {ep} expert-parallel ranks")
    return out


def fitting_tp_sizes(num_heads: int, num_kv_heads: int, intermediate_sizes: dict[str, int],
                     up_to: int = 8, num_experts: int | None = None) -> list[int]:
    """The --tp-size values up to `up_to` this model's sizes allow."""
    return [n for n in range(1, up_to + 1)
            if not tp_problems(num_heads, num_kv_heads, intermediate_sizes, n, num_experts)]


# ---- process group ----

def free_loopback_port() -> int:
    """A port free on 127.0.0.1 now (the rendezvous of a one-node group; a race with another
    process taking it is possible and fails the start with the port named)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RankSpec:
    """Where one worker process sits: its global rank, the world, the rendezvous, and the
    device index it uses on its node."""

    rank: int
    world: int
    init_addr: str  # host:port of rank 0's store
    local_index: int  # device index on this node
    backend: str  # torch.distributed backend (Platform.dist_backend)
    device: str  # the torch device of that index (Platform.torch_device)
    target: str  # the hardware target whose Platform the rank loads before joining
    # this process's place among the node's engine processes (replica x ranks per node +
    # local rank): which slice of a shared device's cores it takes (share_threads)
    slot: int = 0

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @staticmethod
    def from_json(text: str) -> RankSpec:
        return RankSpec(**json.loads(text))


def init_process_group(spec: RankSpec, platform: Platform, device: torch.device,
                       timeout_s: float = 600.0) -> None:
    """Join the group (TCP rendezvous at spec.init_addr; rank 0 hosts the store). The platform
    binds the rank's device first where its backend needs one per rank (Platform.dist_bind)."""
    from datetime import timedelta

    if torch.distributed.is_initialized():
        return
    kwargs = platform.dist_bind(device)
    torch.distributed.init_process_group(
        backend=spec.backend, init_method=f"tcp://{spec.init_addr}", rank=spec.rank,
        world_size=spec.world, timeout=timedelta(seconds=timeout_s), **kwargs)


def share_threads(ranks_here: int, slot: int = 0) -> str | None:
    """Engine processes sharing one device (ranks and replicas on a CPU target) share its
    cores: each takes an even share of torch's threads instead of all of them (N processes
    x all cores would thrash) and, where there are at least as many cores as processes, its own
    slice of this process's affinity mask (process `slot` of `ranks_here`), so that their
    thread pools never compete for a core or migrate onto another's. Before any parallel work:
    the thread pools started later inherit the mask. Returns a note (None when not shared)."""
    if ranks_here <= 1:
        return None
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    per = max(1, len(cores) // ranks_here)
    torch.set_num_threads(per)
    if len(cores) < ranks_here or not hasattr(os, "sched_setaffinity"):
        return (f"CPU threads: {per} per engine process, {ranks_here} processes sharing "
                f"{len(cores)} core(s) (not pinned: fewer cores than processes)")
    mine = cores[(slot % ranks_here) * per:(slot % ranks_here + 1) * per]
    os.sched_setaffinity(0, mine)
    return (f"CPU threads: {per} on core(s) {','.join(map(str, mine))} (engine process "
            f"{slot % ranks_here + 1} of {ranks_here} on this node, each pinned to its own "
            f"{per} of the {len(cores)} cores)")


def broadcast_bytes(data: bytes | None, dev: torch.device, src: int = 0) -> bytes:
    """Rank src's bytes on every rank (two broadcasts: the length, then the payload); `dev`:
    where the worker's collectives run (Platform.dist_device)."""
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=dev)
    torch.distributed.broadcast(n, src)
    size = int(n.item())
    if size == 0:
        return b""
    if data is not None:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=dev)
    torch.distributed.broadcast(buf, src)
    return bytes(buf.cpu().numpy().tobytes()) if data is None else data


def all_min(value: int, dev: torch.device) -> int:
    """The smallest of every rank's value (so pool sizes agree across ranks)."""
    t = torch.tensor([value], dtype=torch.int64, device=dev)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())
