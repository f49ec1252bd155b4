"""Chapter 08: splitting one model across processes (tensor and pipeline parallel) and running replicas.

    comm.py             a gloo process group (NCCL's place on GPUs) and the bytes every collective moves
    tensor_parallel.py  column- and row-parallel layers, vocab-parallel embedding and LM head
    pipeline.py         stages of layers, micro-batches, the bubble
    executor.py         rank 0 broadcasts each step's plan; every rank runs its share
    router.py           which replica gets a request: round robin, least outstanding, prefix-aware
    replicas.py         N independent engines in N processes behind a router

The engine switches them on by configuration: `LLM("tinylab", tensor_parallel_size=2)`.
"""

from engine.parallel.replicas import ReplicaError, ReplicaPool, ReplicaStats
from engine.parallel.router import ROUTERS, LeastOutstanding, PrefixAware, RoundRobin, Router, make_router

__all__ = ["ROUTERS", "LeastOutstanding", "PrefixAware", "ReplicaError", "ReplicaPool", "ReplicaStats",
           "RoundRobin", "Router", "make_router"]
