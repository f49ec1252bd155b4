"""Chapter 08: whole engines side by side. This folder sits ABOVE the engine: each replica is an
`LLMEngine` in its own process, and a router picks which one gets a request (nothing below imports
this folder).

    router.py    which replica gets a request: round robin, least outstanding, prefix-aware
    replicas.py  N independent engines in N processes behind a router
"""

from engine.replicas.replicas import ReplicaError, ReplicaPool, ReplicaStats
from engine.replicas.router import (
    ROUTERS,
    LeastOutstanding,
    PrefixAware,
    RoundRobin,
    Router,
    make_router,
)

__all__ = ["ROUTERS", "LeastOutstanding", "PrefixAware", "ReplicaError", "ReplicaPool",
           "ReplicaStats", "RoundRobin", "Router", "make_router"]
