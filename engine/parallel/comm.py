"""How the ranks talk: a `torch.distributed` process group, and a ledger of every byte it moves.

We use the distributed layer the field uses, never a home-made one: a gloo process group on CPU
(NCCL would take its place on GPUs), so the same calls run between processes on one machine or
across nodes. Each rank holds a `Comm`: its rank, the world size, the group, and `CommStats`,
which counts the bytes and the seconds of every collective, so chapter 08 can put a measured
number next to the formula:

    all_reduce     every rank ends with the SUM of everyone's tensor     (per tensor-parallel layer)
    all_gather     every rank ends with everyone's tensors side by side  (the vocab-split logits)
    send / recv    one rank hands a tensor to one other                  (pipeline stages)
    broadcast_obj  rank 0's Python object, pickled, to every rank        (each step's plan)

The group is an object we pass around, not torch's global default group: a notebook can start an
engine with two ranks, shut it down and start another, and nothing else in the process changes.

Bytes are counted as the tensor's size at each call (what this rank hands to the
collective); a ring all-reduce actually puts 2 (W - 1) / W times that on each rank's link,
see `ring_allreduce_link_bytes`.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

# how long ranks may take to start and meet (spawning a Python with torch takes seconds)
STARTUP_TIMEOUT_S = 120.0
# gloo matches point-to-point messages by (peer, tag); our messages arrive in order on one tag
TAG = 0


@dataclass
class CommStats:
    """Bytes and seconds per kind of collective, as this rank saw them
    (reset between experiments)."""

    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.seconds.clear()
        self.calls.clear()


def ring_allreduce_link_bytes(nbytes: int, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of an `nbytes` tensor:
    2 (W-1)/W x nbytes (a reduce-scatter then an all-gather, each moving W-1 chunks of nbytes/W)."""
    return 2 * (world_size - 1) / world_size * nbytes


class Comm:
    """One rank's handle on the group: the collectives the parallel layers need,
    each timed and counted."""

    def __init__(self, group, rank: int, world_size: int):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.stats = CommStats()

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        t0 = time.perf_counter()
        self.group.allreduce([x]).wait()
        self.stats.add("all_reduce", x.nbytes, time.perf_counter() - t0)
        return x

    def all_gather(self, x: Tensor) -> list[Tensor]:
        """Every rank's `x` (same shape on all), in rank order."""
        t0 = time.perf_counter()
        out = [torch.empty_like(x) for _ in range(self.world_size)]
        self.group.allgather([out], [x.contiguous()]).wait()
        self.stats.add("all_gather", x.nbytes, time.perf_counter() - t0)
        return out

    def send(self, x: Tensor, dst: int) -> None:
        t0 = time.perf_counter()
        self.group.send([x.contiguous()], dst, TAG).wait()
        self.stats.add("send", x.nbytes, time.perf_counter() - t0)

    def isend(self, x: Tensor, dst: int) -> tuple:
        """Start sending `x` and return at once; `wait(handle)` before the
        step ends (x must stay alive)."""
        x = x.contiguous()
        self.stats.add("send", x.nbytes, 0.0)
        return self.group.send([x], dst, TAG), x

    def wait(self, handle: tuple) -> None:
        t0 = time.perf_counter()
        handle[0].wait()
        self.stats.add("send_wait", 0, time.perf_counter() - t0)

    def send_object(self, obj, dst: int) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.send(torch.tensor([payload.numel()], dtype=torch.int64), dst)
        self.send(payload, dst)

    def recv_object(self, src: int):
        length = self.recv((1,), torch.int64, src)
        return pickle.loads(self.recv((int(length),), torch.uint8, src).numpy().tobytes())

    def recv(self, shape: tuple, dtype: torch.dtype, src: int) -> Tensor:
        t0 = time.perf_counter()
        x = torch.empty(shape, dtype=dtype)
        self.group.recv([x], src, TAG).wait()
        self.stats.add("recv", x.nbytes, time.perf_counter() - t0)
        return x

    def broadcast_object(self, obj=None, src: int = 0):
        """Rank `src`'s object on every rank (pickled: its length first, then its bytes)."""
        t0 = time.perf_counter()
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            length = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        self.group.broadcast(length, src).wait()
        if self.rank != src:
            payload = torch.empty(int(length), dtype=torch.uint8)
        self.group.broadcast(payload, src).wait()
        self.stats.add("broadcast_object", payload.numel() + length.nbytes,
                       time.perf_counter() - t0)
        return obj if self.rank == src else pickle.loads(payload.numpy().tobytes())


def free_port() -> int:
    """A TCP port nobody listens on right now (for the group's rendezvous on this machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(rank: int, world_size: int, port: int, timeout_s: float,
            host: str = "127.0.0.1") -> Comm:
    """Join a gloo group of `world_size` ranks that meet at host:port
    (rank 0 hosts the meeting point).

    `timeout_s` bounds every collective: a rank that died makes the others fail with
    an error within that time (usually at once: the peer's socket closes), never hang.
    The meeting itself may take up to STARTUP_TIMEOUT_S (or `timeout_s` if longer)."""
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=_startup_timeout(timeout_s))
    return Comm(dist.ProcessGroupGloo(dist.PrefixStore("servelab", store), rank, world_size,
                                      datetime.timedelta(seconds=timeout_s)), rank, world_size)


def _startup_timeout(timeout_s: float) -> datetime.timedelta:
    """Meeting takes longer than any later collective should: never less than STARTUP_TIMEOUT_S."""
    return datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S))


def connect_from_env(timeout_s: float) -> Comm:
    """Join the group `torchrun` set up: RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT from the environment.

    Under torchrun the launcher's agent usually hosts the store (TORCHELASTIC_USE_AGENT_STORE=True);
    then every rank, rank 0 included, connects to it as a client."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          rank == 0 and not agent_hosts, timeout=_startup_timeout(timeout_s))
    return Comm(dist.ProcessGroupGloo(dist.PrefixStore("servelab", store), rank, world,
                                      datetime.timedelta(seconds=timeout_s)), rank, world)


def launched_by_torchrun() -> bool:
    """True in a process that torchrun started with more than one rank."""
    return (int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
            and "MASTER_PORT" in os.environ)
