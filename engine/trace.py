"""What one engine step did (`StepReport`) and a whole run of them (`Trace`), saved as JSON.

Every figure of chapter 05 is drawn from a `Trace`, so it holds plain Python values only (ints,
floats, strings, lists, dicts; never a tensor) and `Trace.save` / `Trace.load` round-trip it.

One `StepReport` per `LLMEngine.step()`:

    step 7   t = 0.412 s .. 0.419 s
    ├── time_s      schedule 0.0002 | prefill 0.0041 | decode 0.0013 | sample 0.0007 | other 0.0001
    ├── scheduled   "a" decode  [37, 38)  in 1  out 1  -> token 52
    │               "c" prefill [16, 32)  in 16 out 0            (a chunk: no token yet)
    ├── queues      waiting ["d"]  running ["a", "c"]  swapped []  preempted []
    │               finished {"b": "stop"}
    ├── blocks      16 total, 7 used, 7 free, 2 cached, 5 slots wasted, tables {"a": [0, 3, 4], ...}
    └── events      {"type": "finished", "request_id": "b", "reason": "stop"}, ...

When each part is measured (documented once here, relied on by `engine/viz.py`):
- `scheduled` and `queues.running` are the requests the scheduler picked for this step's forward;
  `queues.waiting` / `swapped` are those left out; `queues.finished` are the requests that finished
  (or were aborted) during this step, with their reason.
- `blocks` is the pool as the forward pass saw it: after this step's allocations and preemptions,
  before the requests that finished in this step gave their blocks back (the step's peak).
  total = used + free + cached, where `cached` blocks are free but cached (prefix caching,
  chapter 06).
- `events` are in the order they happened, including `arrived` / `aborted` calls made between the
  previous step and this one.
- `time_s.prefill` / `time_s.decode` split the one batched forward in proportion to the number of
  prefill and decode tokens in it (both kinds share every matmul, so this is an estimate).
- `start_time` / `end_time` are on the engine's clock (`time.time` unless the engine was given
  another), the same clock as a request's `arrival_time`, so
  TTFT = first token's step end - arrival.

The events (small dicts, `type` first):

    {"type": "arrived",   "request_id", "arrival_time", "num_prompt_tokens", "max_tokens",
                          "priority", "tenant"}
    {"type": "admitted",  "request_id", "after_preemption": bool}
                          (again after a recompute preemption)
    {"type": "preempted", "request_id", "mode": "recompute" | "swap", "reason"}
    {"type": "swapped_in", "request_id"}
    {"type": "window_freed", "request_id", "blocks"}             sliding window: blocks given back
    {"type": "blocks_moved", "swap_out"|"swap_in"|"copy"|"offload"|"reload": count, ..., "bytes"}
    {"type": "prefix_hit", "request_id", "num_tokens", "num_query_tokens", "num_host_tokens"}
                          (prefix caching on) a request got its blocks: num_tokens of its
                          num_query_tokens were found in the prefix cache and are not prefilled
                          (0: a miss); num_host_tokens of them came back from the host tier.
                          Again after a recompute preemption.
    {"type": "forked",    "request_id", "parent"}
                          sample i of an n > 1 request, on sample 0's blocks
    {"type": "aborted",   "request_id", "time"}
    {"type": "finished",  "request_id", "reason": "stop" | "length" | "error", "error"?}
                          "error": the step that ran it raised; its blocks were freed and the
                          engine went on
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

PHASES = ("prefill", "decode")
# The states `Trace.state_at` reports for a request at a step, for the timeline renderer.
STATES = ("absent", "waiting", "prefill", "decode", "stalled", "preempted", "swapped", "finished")


@dataclass
class TimeSplit:
    """Seconds spent in each part of one step."""

    schedule: float = 0.0
    prefill: float = 0.0
    decode: float = 0.0
    sample: float = 0.0
    other: float = 0.0

    @property
    def total(self) -> float:
        return self.schedule + self.prefill + self.decode + self.sample + self.other


@dataclass
class ScheduledRequest:
    """One request's share of this step's forward: tokens at positions [start, end)."""

    request_id: str
    # "prefill" (prompt, or prompt + output again after a recompute preemption) or "decode"
    phase: str
    start: int  # first position fed in this step (= tokens already in the KV cache)
    end: int  # one past the last position fed
    tokens_out: int  # tokens sampled this step: 1, or 0 for a prefill chunk that is not the last
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def tokens_in(self) -> int:
        return self.end - self.start


@dataclass
class QueueSnapshot:
    # arrived, not running (new or recompute-preempted)
    waiting: list[str] = field(default_factory=list)
    running: list[str] = field(default_factory=list)  # admitted (holding KV blocks)
    # preempted by swap: their KV waits in the CPU pool
    swapped: list[str] = field(default_factory=list)
    # of waiting + swapped: those that were preempted
    preempted: list[str] = field(default_factory=list)
    # in this step: id -> "stop"/"length"/"abort"/"error"
    finished: dict[str, str] = field(default_factory=dict)


@dataclass
class BlockSnapshot:
    total: int = 0
    used: int = 0
    free: int = 0
    cached: int = 0  # free but cached: held by the prefix cache only (chapter 06; 0 when it is off)
    block_size: int = 0
    # empty slots inside allocated blocks (the tails of partly filled last blocks)
    wasted_slots: int = 0
    tables: dict[str, list[int]] = field(default_factory=dict)  # request id -> physical block ids
    # request id -> tokens held in its blocks
    num_tokens: dict[str, int] = field(default_factory=dict)
    swap_total: int = 0  # the CPU-side swap pool (0 when preemption is by recompute)
    swap_used: int = 0
    # the `cached` blocks, next to be evicted first
    cached_block_ids: list[int] = field(default_factory=list)
    host_total: int = 0  # the host tier of the prefix cache (kv_offload_blocks; 0 when off)
    host_used: int = 0  # host blocks holding offloaded K/V


@dataclass
class StepReport:
    """Everything one `LLMEngine.step()` did; plain data, JSON-serialisable (see the module
    docstring)."""

    step: int
    start_time: float
    end_time: float
    time_s: TimeSplit = field(default_factory=TimeSplit)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    queues: QueueSnapshot = field(default_factory=QueueSnapshot)
    blocks: BlockSnapshot = field(default_factory=BlockSnapshot)
    events: list[dict] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in this step's forward (the packed batch's length N)."""
        return sum(s.tokens_in for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.tokens_in for s in self.scheduled if s.phase == "prefill")

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.tokens_in for s in self.scheduled if s.phase == "decode")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepReport:
        return cls(
            step=d["step"], start_time=d["start_time"], end_time=d["end_time"],
            time_s=TimeSplit(**d["time_s"]),
            scheduled=[ScheduledRequest(**s) for s in d["scheduled"]],
            queues=QueueSnapshot(**d["queues"]),
            blocks=BlockSnapshot(**d["blocks"]),
            events=[dict(e) for e in d["events"]],
        )


@dataclass
class RequestTimes:
    """One request's life as read back from a trace (times on the engine's clock, seconds): the
    facts only. The latencies they imply (TTFT, TPOT, ITL, E2E, queueing) are computed in
    `engine/companions/metrics.py` (`requests_from_trace`), and nowhere else."""

    request_id: str
    arrival_time: float
    arrival_step: int  # the first step that saw the request (its `arrived` event)
    num_prompt_tokens: int
    num_output_tokens: int = 0
    first_token_step: int | None = None
    first_token_time: float | None = None
    finish_step: int | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0


@dataclass
class Trace:
    """The configuration of a run and the `StepReport` of each of its steps."""

    config: dict = field(default_factory=dict)
    steps: list[StepReport] = field(default_factory=list)

    def append(self, report: StepReport) -> None:
        self.steps.append(report)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> StepReport:
        return self.steps[i]

    def save(self, path: str | Path) -> None:
        data = {"config": self.config, "steps": [s.to_dict() for s in self.steps]}
        Path(path).write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        data = json.loads(Path(path).read_text())
        return cls(config=data["config"], steps=[StepReport.from_dict(s) for s in data["steps"]])

    # ---- per-request views, for metrics and the timeline ---------------------------------------
    def request_ids(self) -> list[str]:
        """Every request that arrived during the trace, in arrival order."""
        return list(self.requests())

    def requests(self) -> dict[str, RequestTimes]:
        """id -> `RequestTimes`, read from the `arrived`/`preempted`/`finished` events and the
        `scheduled` lists (first token = the first step with tokens_out > 0)."""
        out: dict[str, RequestTimes] = {}
        for i, report in enumerate(self.steps):
            for e in report.events:
                _apply_event(out, e, i, report)
            for s in report.scheduled:
                r = out.get(s.request_id)
                if r is None or s.tokens_out == 0:
                    continue
                r.num_output_tokens += s.tokens_out
                if r.first_token_step is None:
                    r.first_token_step, r.first_token_time = i, report.end_time
        return out

    def state_at(self, request_id: str, i: int) -> str:
        """What `request_id` was doing at step i: one of `STATES`.

        "stalled" is running (holding blocks) but not scheduled in this step (e.g. no token budget
        left).
        """
        report = self.steps[i]
        for s in report.scheduled:
            if s.request_id == request_id:
                return s.phase
        q = report.queues
        if request_id in q.finished:
            return "finished"
        if request_id in q.swapped:
            return "swapped"
        if request_id in q.waiting:
            return "preempted" if request_id in q.preempted else "waiting"
        if request_id in q.running:
            return "stalled"
        return ("finished" if any(request_id in s.queues.finished for s in self.steps[:i])
                else "absent")


def _apply_event(out: dict[str, RequestTimes], e: dict, i: int, report: StepReport) -> None:
    kind, rid = e.get("type"), e.get("request_id")
    if kind == "arrived":
        out[rid] = RequestTimes(rid, e["arrival_time"], i, e["num_prompt_tokens"])
    elif kind == "forked" and e["parent"] in out:
        parent = out[e["parent"]]
        out[rid] = RequestTimes(rid, parent.arrival_time, parent.arrival_step,
                                parent.num_prompt_tokens)
    elif rid not in out:
        return
    elif kind == "preempted":
        out[rid].num_preemptions += 1
    elif kind in ("finished", "aborted"):
        r = out[rid]
        r.finish_step, r.finish_time = i, e.get("time", report.end_time)
        r.finish_reason = e.get("reason", "abort")
