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
from collections import deque
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
    sample: float = 0.0  # with speculative decoding: verifying the guesses too
    other: float = 0.0
    propose: float = 0.0  # speculative decoding's proposer (chapter 12); 0 without one

    @property
    def total(self) -> float:
        return (self.schedule + self.prefill + self.decode + self.sample + self.other
                + self.propose)


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
    # speculative decoding (chapter 12): the guesses this decode fed after its last token (so
    # end - start = 1 + len(draft_token_ids)) and how many of them the target kept (None: no guess)
    draft_token_ids: list[int] = field(default_factory=list)
    num_accepted: int | None = None

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


@dataclass(frozen=True)
class StepSummary:
    """One step in a few numbers: what a server keeps for its whole recent past (a fixed ~200 bytes
    a step, whatever the workload; a `StepReport` copies every block table)."""

    step: int
    end_time: float
    busy_s: float  # the step's time_s.total
    prefill_tokens: int
    decode_tokens: int
    running: int
    waiting: int
    blocks_used: int
    blocks_cached: int
    finished: int  # requests that finished (or were aborted) in this step

    @classmethod
    def of(cls, r: StepReport) -> StepSummary:
        return cls(r.step, r.end_time, r.time_s.total, r.num_prefill_tokens, r.num_decode_tokens,
                   len(r.queues.running), len(r.queues.waiting), r.blocks.used, r.blocks.cached,
                   len(r.queues.finished))


# A server's defaults (python -m engine serve --trace-steps / --trace-file): a short window of full
# reports (a few MB even with many long requests), a long one of summaries (~4 MB).
SERVER_FULL_STEPS = 1_000
SERVER_SUMMARY_STEPS = 20_000
TRACE_FILE_MAX_BYTES = 100 * 2**20  # one trace file before it is rotated
TRACE_FILE_BACKUPS = 3  # rotated files kept: PATH.1 (newest) .. PATH.3 (oldest)


@dataclass(frozen=True)
class TraceRetention:
    """How much of its past a `Trace` keeps: the one place this policy lives.

    A learner's run is short, so notebooks, `LLM.generate` and every `LLMEngine` keep everything
    (`TraceRetention()`, the default). A server runs for weeks: `TraceRetention.server()` keeps the
    last `full_steps` reports whole, a summary (`StepSummary`) of the last `summary_steps`, and can
    stream every full report to `file` as JSON lines (rotated at `file_max_bytes`, `file_backups`
    old files kept), so memory is bounded in bytes however long it runs. Metrics that span the
    server's life (/metrics, the dashboard) are folded in step by step; they never read the trace.
    """

    full_steps: int | None = None  # None: every report
    summary_steps: int = 0
    file: Path | None = None
    file_max_bytes: int = TRACE_FILE_MAX_BYTES
    file_backups: int = TRACE_FILE_BACKUPS

    def __post_init__(self) -> None:
        if self.full_steps is not None and (isinstance(self.full_steps, bool)
                                            or not isinstance(self.full_steps, int)
                                            or self.full_steps < 1):
            raise ValueError(f"trace full_steps={self.full_steps!r} must be an integer >= 1 "
                             "(or None to keep every step)")
        for name in ("summary_steps", "file_backups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"trace {name}={value!r} must be an integer >= 0")
        if isinstance(self.file_max_bytes, bool) or not isinstance(self.file_max_bytes, int) \
                or self.file_max_bytes < 4096:
            raise ValueError(f"trace file_max_bytes={self.file_max_bytes!r} must be an integer "
                             ">= 4096")

    @classmethod
    def server(cls, full_steps: int = SERVER_FULL_STEPS, file: str | Path | None = None,
               summary_steps: int = SERVER_SUMMARY_STEPS,
               file_max_bytes: int = TRACE_FILE_MAX_BYTES) -> TraceRetention:
        return cls(full_steps, summary_steps, None if file is None else Path(file),
                   file_max_bytes)


class TraceFile:
    """Full `StepReport`s appended to a file as JSON lines, rotated like logging's
    RotatingFileHandler: when PATH would pass max_bytes it becomes PATH.1 (PATH.1 becomes PATH.2,
    ...; the oldest beyond `backups` is deleted). Every file starts with a {"config": ...} line, so
    each one loads on its own (`Trace.load`, `python -m engine diagnose PATH`)."""

    def __init__(self, path: Path, config: dict, max_bytes: int, backups: int):
        self.path, self.config = Path(path), config
        self.max_bytes, self.backups = max_bytes, backups
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open()

    def write(self, report: StepReport) -> None:
        line = json.dumps(report.to_dict(), separators=(",", ":")) + "\n"
        if self._file.tell() + len(line) > self.max_bytes:
            self._rotate()
        self._file.write(line)
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def _open(self) -> None:
        self._file = self.path.open("w", encoding="utf-8")
        self._file.write(json.dumps({"config": self.config}, default=str) + "\n")

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.backups - 1, 0, -1):  # PATH.i -> PATH.i+1, the oldest overwritten
            older = self._backup(i)
            if older.exists():
                older.replace(self._backup(i + 1))
        if self.backups:
            self.path.replace(self._backup(1))
        self._open()  # "w": without backups, the file starts again

    def _backup(self, i: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{i}")


@dataclass
class Trace:
    """The configuration of a run and the `StepReport` of each of its steps (all of them by
    default; `retention` says otherwise, see `TraceRetention`)."""

    config: dict = field(default_factory=dict)
    steps: list[StepReport] = field(default_factory=list)
    # how much is kept; not part of what a trace IS (two traces of the same run compare equal)
    retention: TraceRetention = field(default_factory=TraceRetention, compare=False)
    # the last retention.summary_steps steps, one `StepSummary` each
    summaries: deque = field(default_factory=deque, repr=False, compare=False)
    # steps ever appended (more than len(steps) once a window drops some)
    num_recorded: int = field(default=0, compare=False)
    _file: TraceFile | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.num_recorded = max(self.num_recorded, len(self.steps))

    def retain(self, retention: TraceRetention) -> None:
        """Switch to `retention` from now on (the steps kept so far are trimmed to it)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.retention = retention
        self.summaries = deque(self.summaries, maxlen=retention.summary_steps)
        if retention.file is not None:
            self._file = TraceFile(retention.file, self.config, retention.file_max_bytes,
                                   retention.file_backups)
        self._trim()

    def append(self, report: StepReport) -> None:
        self.num_recorded += 1
        self.steps.append(report)
        if self.retention.summary_steps:
            self.summaries.append(StepSummary.of(report))
        if self._file is not None:
            self._file.write(report)
        self._trim()

    def close(self) -> None:
        """Close the trace file, if any (a server at shutdown)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _trim(self) -> None:
        keep = self.retention.full_steps
        if keep is not None and len(self.steps) > keep:
            del self.steps[: len(self.steps) - keep]

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i: int) -> StepReport:
        return self.steps[i]

    def save(self, path: str | Path) -> None:
        data = {"config": self.config, "steps": [s.to_dict() for s in self.steps]}
        Path(path).write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """A trace `save` wrote (one JSON document), or a server's trace file (JSON lines: a
        {"config": ...} line, then one StepReport a line)."""
        text = Path(path).read_text()
        if text.startswith('{"config"'):  # `save` writes '{\n "config"' (indented)
            head, *lines = text.splitlines()
            return cls(config=json.loads(head)["config"],
                       steps=[StepReport.from_dict(json.loads(line)) for line in lines if line])
        data = json.loads(text)
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
