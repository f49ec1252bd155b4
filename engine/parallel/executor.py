"""Running one engine step on W ranks: rank 0 decides, every rank computes its share.

The engine on rank 0 is the ordinary `LLMEngine`: it owns the scheduler and the block manager
and samples the tokens. Only the forward is spread. At every step rank 0 broadcasts a `StepPlan`
(the block moves the block manager decided, and the packed batch with its attention metadata),
then every rank, rank 0 included, does the same two things on ITS share:

    rank 0:  schedule ─► StepPlan ─broadcast─► apply moves ─► forward (shard 0) ─► logits ─► sample
    rank 1:              StepPlan ◄───────────  apply moves ─► forward (shard 1)  (all-reduces /
                                                                                   sends tie the
                                                                                   ranks together)

Every rank's KV pool has the same block ids (one block table for everyone, rank 0's); a rank stores
in block b only ITS heads (tensor parallel) or ITS layers (pipeline parallel). So the block manager,
the prefix cache and the scheduler need no change at all: they never see a tensor.

Ranks are processes. `ParallelExecutor.start` spawns ranks 1..W-1 with
`torch.multiprocessing` (their model weights travel through shared memory, not pickled
bytes) and joins them in a gloo group; under `torchrun` the launcher started them all,
and ranks > 0 enter `serve_steps` when they build the engine. Every wait is bounded
(`ParallelConfig.collective_timeout_s`): a rank that dies makes the step fail with an
error naming it, and the engine refuses further steps instead of hanging.
"""

from __future__ import annotations

import sys
import traceback
import weakref
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.kv.block_manager import BlockMove
from engine.kv.kv_pool import PagedKVPool, PoolShape
from engine.model import LlamaModel
from engine.parallel.comm import Comm, CommStats, connect, connect_from_env, free_port
from engine.parallel.pipeline import (
    StageTimeline,
    make_stage,
    run_stage,
    split_into_micro_batches,
    stage_layers,
)
from engine.parallel.tensor_parallel import check_tensor_parallel, shard_model
from engine.runner import build_batch, run_model
from engine.speed import accelerate
from engine.threads import available_cores

JOIN_TIMEOUT_S = 10.0  # how long shutdown waits for a worker to exit before it is terminated


@dataclass
class StepPlan:
    """One step, as rank 0 broadcasts it: the block moves, then the batch in
    micro-batches (one for TP)."""

    moves: list[BlockMove]
    # [(input_ids [1, N], positions [1, N], meta), ...]
    batches: list[tuple] = field(default_factory=list)
    stop: bool = False


class RankRunner:
    """One rank's share of the model and of the KV pool, and how it runs a `StepPlan`."""

    def __init__(self, model: LlamaModel, config: EngineConfig, pool: PoolShape, comm: Comm,
                 sliding_window: int | None):
        cfg, par = model.config, config.parallel
        self.comm, self.tp, self.pp = comm, par.tensor_parallel_size, par.pipeline_parallel_size
        if self.tp > 1:
            self.model = shard_model(model, comm)
            num_layers, num_kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads // self.tp
        else:
            self.model = make_stage(model, comm.rank, self.pp)
            num_layers, num_kv_heads = len(self.model.layers), cfg.num_key_value_heads
        self.kv_pool = PagedKVPool(num_layers, pool.num_blocks, pool.block_size, num_kv_heads,
                                   cfg.head_dim, pool.dtype, "cpu", pool.num_swap_blocks,
                                   pool.num_host_blocks)
        # the shards stay as they are; speed="fast" brings its attention backend and argmax only
        self.acceleration = accelerate(self.model, self.kv_pool, config, sliding_window,
                                       torch.get_num_threads(), transform_model=False)
        self.attention = self.acceleration.attention
        self.timeline = StageTimeline()

    def run(self, plan: StepPlan):
        """Apply the moves, run this rank's forward; returns (blocks moved per kind,
        logits [S, V] on rank 0)."""
        moved = self.kv_pool.apply_moves(plan.moves)
        if not plan.batches:
            return moved, None
        if self.tp > 1:
            (input_ids, positions, meta), = plan.batches
            return moved, run_model(self.model, self.attention, input_ids, positions, meta)
        self.timeline = StageTimeline()
        return moved, run_stage(self.model, self.attention, plan.batches, self.comm, self.comm.rank,
                                self.pp, self.timeline)


def serve_steps(runner: RankRunner, num_threads: int) -> None:
    """A worker rank's life: wait for rank 0's next StepPlan, run it, until told to stop."""
    torch.set_num_threads(num_threads)
    while True:
        plan = runner.comm.broadcast_object()
        if plan.stop:
            return
        runner.run(plan)
        if runner.pp > 1 and runner.comm.rank > 0:
            # so rank 0 can draw the whole pipeline
            runner.comm.send_object(runner.timeline.spans, 0)


def _worker_main(rank: int, world: int, port: int, model: LlamaModel, config: EngineConfig,
                 pool: PoolShape, sliding_window: int | None, num_threads: int) -> None:
    """Entry point of a spawned rank > 0 (see ParallelExecutor.start)."""
    try:
        comm = connect(rank, world, port, config.parallel.collective_timeout_s)
        serve_steps(RankRunner(model, config, pool, comm, sliding_window), num_threads)
    except Exception:  # the traceback is all rank 0's user will have: print it, exit non-zero
        print(f"[servelab rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
        sys.exit(1)


class ParallelExecutor:
    """Rank 0's side: starts the other ranks, broadcasts each step's plan, runs its own share.

    `execute(moves, work, block_manager)` has the same contract as `runner.ModelRunner.execute`."""

    def __init__(self, runner: RankRunner, processes: list, config: EngineConfig):
        self.runner, self.processes, self.config = runner, processes, config
        self.kv_pool, self.attention, self.comm = runner.kv_pool, runner.attention, runner.comm
        self.acceleration = runner.acceleration
        self.failure: str | None = None  # once a rank is lost, every later step fails with this
        self._finalizer = weakref.finalize(self, _stop_ranks, runner.comm, processes)

    @classmethod
    def start(cls, model: LlamaModel, config: EngineConfig, pool: PoolShape,
              sliding_window: int | None, num_threads: int) -> ParallelExecutor:
        """Spawn ranks 1..W-1 as processes, join them in a gloo group and build rank 0's share
        (under torchrun, `join_torchrun` takes this one's place)."""
        par, world = config.parallel, config.parallel.world_size
        if par.tensor_parallel_size > 1:
            check_tensor_parallel(model.config, par.tensor_parallel_size)
        else:
            # raises if too many
            stage_layers(model.config.num_hidden_layers, par.pipeline_parallel_size, 0)
        if type(model.embed_tokens) is not torch.nn.Embedding:
            raise TypeError("this model is already split; give the engine the whole model")
        model.share_memory()  # the children map the same pages instead of receiving pickled copies
        port, ctx = free_port(), mp.get_context("spawn")
        processes = [ctx.Process(target=_worker_main, daemon=True, name=f"servelab-rank{rank}",
                                 args=(rank, world, port, model, config, pool, sliding_window,
                                       num_threads))
                     for rank in range(1, world)]
        for p in processes:
            p.start()
        try:
            comm = connect(0, world, port, par.collective_timeout_s)
        except Exception as exc:
            _stop_ranks(None, processes)
            raise RuntimeError(f"the {world - 1} worker rank(s) did not join in time (see their "
                               f"errors above, if any): {exc}") from exc
        return cls(RankRunner(model, config, pool, comm, sliding_window), processes, config)

    @classmethod
    def join_torchrun(cls, model: LlamaModel, config: EngineConfig, pool: PoolShape,
                      sliding_window: int | None, num_threads: int) -> ParallelExecutor:
        """Under `torchrun --nproc-per-node W`: every process builds the engine; rank 0
        gets the executor, every other rank serves steps here and then EXITS the process
        (it never returns to the script)."""
        comm = connect_from_env(config.parallel.collective_timeout_s)
        if comm.world_size != config.parallel.world_size:
            raise ValueError(f"torchrun started {comm.world_size} processes but "
                             "tensor_parallel_size x pipeline_parallel_size = "
                             f"{config.parallel.world_size}; make them equal")
        runner = RankRunner(model, config, pool, comm, sliding_window)
        if comm.rank > 0:
            serve_steps(runner, num_threads)
            raise SystemExit(0)
        return cls(runner, [], config)

    def execute(self, moves: list[BlockMove], work: list,
                block_manager) -> tuple[dict, torch.Tensor | None]:
        self._check_ranks()
        num_mb = (1 if self.runner.tp > 1
                  else self.config.parallel.num_micro_batches or self.runner.pp)
        groups = split_into_micro_batches(work, num_mb, weight=lambda w: w.end - w.start)
        plan = StepPlan(moves, [build_batch(g, block_manager, "cpu") for g in groups])
        try:
            self.comm.broadcast_object(plan)
            moved, logits = self.runner.run(plan)
            if self.runner.pp > 1 and plan.batches:
                for rank in range(1, self.comm.world_size):
                    self.runner.timeline.spans += self.comm.recv_object(rank)
        except Exception as exc:  # the ranks may now be out of step: no later step may run
            self.failure = self._lost_ranks() or f"{type(exc).__name__}: {exc}"
            raise RuntimeError(f"parallel step failed: {self.failure}") from exc
        return moved, logits

    @property
    def comm_stats(self) -> CommStats:
        return self.comm.stats

    @property
    def timeline(self) -> StageTimeline:
        """When each pipeline stage worked on each micro-batch in the last step
        (pipeline parallel only)."""
        return self.runner.timeline

    def shutdown(self) -> None:
        """Tell every rank to stop and wait for them (idempotent)."""
        self._finalizer()

    def _lost_ranks(self) -> str | None:
        dead = [f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                for rank, p in enumerate(self.processes, start=1) if p.exitcode is not None]
        return "; ".join(dead) + ": restart the engine" if dead else None

    def _check_ranks(self) -> None:
        if self.failure is None:
            self.failure = self._lost_ranks()
        if self.failure is not None:
            raise RuntimeError(f"the parallel engine lost a rank and cannot step: {self.failure}")


def _stop_ranks(comm: Comm | None, processes: list) -> None:
    """Broadcast the stop plan (if the group still stands), then join or terminate every worker."""
    if comm is not None and all(p.exitcode is None for p in processes):
        try:
            comm.broadcast_object(StepPlan([], stop=True))
        except Exception:  # noqa: BLE001 - the group is broken already: terminate below
            pass
    for p in processes:
        p.join(JOIN_TIMEOUT_S)
        if p.is_alive():  # stuck: ask, then insist (SIGKILL also ends a stopped process)
            p.terminate()
            p.join(JOIN_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join(JOIN_TIMEOUT_S)


def default_worker_threads(num_threads: int, world: int) -> int:
    """Threads per rank: the engine's setting, but never more than the cores
    shared out among the ranks."""
    return max(1, min(num_threads, available_cores() // world))
