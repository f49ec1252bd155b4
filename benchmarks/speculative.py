"""Speculative decoding, measured: plain decoding against each proposer, side by side in one run (issue 30).

A plain decode step reads every weight once to emit one token per request. A verify step feeds the request's
last token plus k guesses and emits 1 to k + 1 tokens for about the same read (engine/speculative/__init__.py).
Whether that pays comes down to two numbers, both measured in every row:

    tokens_per_step   tokens a decoding request gets per step (plain: 1; a verify step: mean acceptance length)
    step_cost         seconds of a speculative decode step / seconds of a plain one (k + 1 rows, the proposer)
    ratio             tokens/s speculative / tokens/s plain; at batch 1 it is tokens_per_step / step_cost

A case is one workload at one batch size. Its engines (plain decoding and each proposer, built once over the same
loaded weights) run the same greedy requests in rounds, A B C ... then ... C B A, so a slow patch of a shared
machine falls on every engine alike (an even number of rounds, so each engine runs as often early as late);
numbers are medians over the rounds (the ratio: the median of each round's ratio). Every speculative run's
outputs must equal plain decoding's token for token, that is the oracle: a difference stops the run.

Peak memory is about 11 GB: SmolLM2's eight batch-1 engines (each with the fast wing's packed copy of the
weights, the int4 self-draft with its own copy) live at once; the int4 draft is also most of the run time.

    workloads   tinylab's recall and json tasks (engine/lab/tasks.py's held-out examples: answers copied from
                the prompt); SmolLM2-135M-Instruct: a chat prompt asking to summarise a long document (the
                first DOCUMENT_CHARS of this repo's README.md) and a free story
    proposers   ngram (prompt lookup) k = 2, 4, 8; layer_skip and draft_model (engine/speculative/
                draft_model.py, configs in DRAFTS) k = 2, 4, wherever they build (else skipped, with why)
    batch       1 for every proposer; 4 and 16 for ngram k = SWEEP_K. B requests start together (one generate
                call per group of B); at 16 both with the default disable_by_batch_size (a step with that many
                decoding requests runs plain) and with it off, which shows why it switches off; and a second
                plain engine (the A/A control): how far two identical engines differ, beside the 5 % target
    speed       "fast" (the default) everywhere; "reference" for one case (REFERENCE_CASE)

Decode speed counts pure decode steps only (every scheduled request decoding, no prefill chunk): the tokens they
emit over their seconds (StepReport.time_s.total, the proposer's time included; a draft model's catch-up on a
new prompt happens there too). Targets (issue 30), reported, never asserted: ngram on tinylab recall/JSON >= 2x
tokens/s at batch 1; SmolLM2 on the document >= 1.5x; never more than 5 % slower than plain at batch 16.

    python benchmarks/speculative.py                  # both models, 4 rounds: about 15 minutes on a quiet machine
    python benchmarks/speculative.py --quick          # tinylab, 2 examples, 2 rounds (seconds; the test runs it)
    python benchmarks/speculative.py --models tinylab --threads 2 --out /tmp/spec
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from benchmarks._common import REAL_MODEL, REPO_ROOT, markdown_table, write_results  # noqa: E402
from benchmarks.prefix_cache import cpu_simd_flags  # noqa: E402
from engine.companions.metrics import SpecDecodeStats, spec_decode_stats  # noqa: E402
from engine.config import DEFAULT_DISABLE_BY_BATCH_SIZE, CacheConfig  # noqa: E402
from engine.lab.tasks import MAX_NEW_TOKENS  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

MODELS = ("tinylab", REAL_MODEL)
TASKS = ("recall", "json")  # tinylab's tasks whose answers copy from the prompt
NGRAM_KS = (2, 4, 8)
DRAFT_KS = (2, 4)  # every guess of a draft costs a draft forward: fewer of them than prompt lookup
SWEEP_K = 4  # the batch sweep's ngram k (SpeculativeConfig's default)
BATCHES = (1, 4, 16)
FULL_BATCH = 16  # the target's batch: never more than 5 % slower than plain here
SWITCH_OFF = f">= {DEFAULT_DISABLE_BY_BATCH_SIZE}"  # a row's switch_off with the default disable_by_batch_size
CONTROL = "plain (A/A)"  # the control row's proposer
DRAFT_METHODS = ("layer_skip", "draft_model")
# Each model's draft configs. layer_skip keeps about a third (tinylab) or a quarter (SmolLM2) of the layers: a
# guess must cost well under 1/k of a target step to pay. tinylab's draft is the small model this repo trains
# (engine/models/tinylab-draft); SmolLM2 has none, so its draft is an int4 copy of itself.
DRAFTS = {"tinylab": {"layer_skip": {"num_draft_layers": 2}, "draft_model": {"model": "tinylab-draft"}},
          REAL_MODEL: {"layer_skip": {"num_draft_layers": 8},
                       "draft_model": {"model": "self", "quantization": "int4"}}}
REFERENCE_CASE = ("tinylab/json", 1, SWEEP_K)  # the one case also run at speed="reference"
# The summarised document: about 1,200 tokens of README.md, cut at a paragraph, so the summary has much to copy.
DOCUMENT_CHARS = 4000
SUMMARY_ASK = "Summarise this document in a few sentences.\n\n"
STORY_ASK = "Write a short story about a lighthouse keeper who finds a message in a bottle."
WARMUP_TOKENS = max(NGRAM_KS) + 2  # each engine's warm-up: the case's first group, room for a verify of the largest k
BLOCK_SIZE = CacheConfig.block_size  # the engines' default; their pools are sized in these
SPEEDUP_BARS = {"tinylab": 2.0, "document": 1.5, "batch16": 0.95}  # issue 30's targets
FULL = dict(models=MODELS, examples=16, repeats=4, batches=BATCHES, ngram_ks=NGRAM_KS, draft_ks=DRAFT_KS,
            smol_tokens=128)
QUICK = dict(models=("tinylab",), examples=2, repeats=2, batches=(1, FULL_BATCH), ngram_ks=(2, SWEEP_K),
             draft_ks=(2,), smol_tokens=16)


@dataclass(frozen=True)
class Setup:
    """One engine of a case: plain decoding (method None) or a proposer making k guesses per step."""

    method: str | None = None
    k: int = 0
    never_off: bool = False  # disable_by_batch_size=None: guesses even in a full batch
    speed: str = "fast"
    # a second plain engine, the A/A control: how far two identical engines differ here (the noise floor)
    control: bool = False

    @property
    def label(self) -> str:
        name = ("plain" + (" (A/A control)" if self.control else "")) if self.method is None \
            else f"{self.method} k={self.k}"
        return name + (", never off" if self.never_off else "") + ("" if self.speed == "fast" else f", {self.speed}")

    def speculative_config(self, model: str) -> dict | None:
        """engine_config's speculative_config (vLLM's dict shape) for this setup on `model`; None: plain."""
        if self.method is None:
            return None
        spec = {"method": self.method, "num_speculative_tokens": self.k, **DRAFTS[model].get(self.method, {})}
        return {**spec, "disable_by_batch_size": None, "max_verify_rows": None} if self.never_off else spec


@dataclass(frozen=True)
class Workload:
    name: str  # "<model>/<task>"
    prompts: tuple[tuple[int, ...], ...]  # token ids (a chat template already applied)
    max_tokens: int


@dataclass(frozen=True)
class Case:
    workload: Workload
    batch: int
    setups: tuple[Setup, ...]  # setups[0]: plain decoding at the case's speed, the oracle


@dataclass
class Run:
    """What one engine did on one pass over a case's prompts."""

    outputs: list[list[int]]
    decode_tokens: int  # emitted by pure decode steps
    decode_s: float
    decode_steps: int
    request_steps: int  # (request, decode step) pairs: a step of batch 4 counts 4
    off_steps: int  # pure decode steps where speculation switched itself off
    errors: int  # "speculation_error" events: the proposer raised
    stats: SpecDecodeStats

    @property
    def tok_s(self) -> float:
        return self.decode_tokens / self.decode_s


# ---- workloads -------------------------------------------------------------------------------------------------


def document() -> str:
    """The document to summarise: README.md's first DOCUMENT_CHARS characters, cut at a paragraph."""
    text = (REPO_ROOT / "README.md").read_text()
    cut = text.rfind("\n\n", 0, DOCUMENT_CHARS)
    return text[:cut if cut > 0 else DOCUMENT_CHARS]


def workloads(model: str, tokenizer, max_len: int, cfg: dict) -> list[Workload]:
    """The model's workloads, every prompt as the token ids the engine will see."""
    from engine.tokenizer import encode_prompt

    if model == "tinylab":
        from engine.lab.tasks import eval_examples

        return [Workload(f"tinylab/{task}",
                         tuple(tuple(encode_prompt(e.prompt, tokenizer, max_len))
                               for e in eval_examples(task, cfg["examples"])), MAX_NEW_TOKENS[task])
                for task in TASKS]

    def chat(text: str) -> tuple[int, ...]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], True)
        return tuple(tokenizer.encode(prompt, add_special_tokens=False))  # the template writes its own BOS

    return [Workload(f"{model}/document", (chat(SUMMARY_ASK + document()),), cfg["smol_tokens"]),
            Workload(f"{model}/story", (chat(STORY_ASK),), cfg["smol_tokens"])]


def groups(prompts: tuple, batch: int) -> list[list[list[int]]]:
    """The prompts in groups of `batch` (one generate call each: they start together); fewer prompts than
    `batch` are repeated to fill one group."""
    prompts = [list(p) for p in prompts]
    if len(prompts) < batch:
        prompts = [prompts[i % len(prompts)] for i in range(batch)]
    return [prompts[i:i + batch] for i in range(0, len(prompts), batch)]


def plan_cases(loads: list[Workload], cfg: dict, drafts_ok: bool) -> list[Case]:
    """Batch 1 with every proposer for each workload; the batch sweep (ngram k = SWEEP_K) for every workload
    but the free story; the reference-speed case. Cases that share engines come one after another."""
    plain, sweep = Setup(), Setup("ngram", SWEEP_K)
    proposers = [Setup("ngram", k) for k in cfg["ngram_ks"]]
    if drafts_ok:
        proposers += [Setup(m, k) for m in DRAFT_METHODS for k in cfg["draft_ks"]]
    cases = [Case(w, 1, (plain, *proposers)) for w in loads]
    for w in (w for w in loads if not w.name.endswith("/story")):
        for b in (b for b in cfg["batches"] if b > 1):
            full = (Setup("ngram", SWEEP_K, never_off=True), Setup(control=True)) if b == FULL_BATCH else ()
            cases.append(Case(w, b, (plain, sweep, *full)))
    name, batch, k = REFERENCE_CASE
    cases += [Case(w, batch, (Setup(speed="reference"), Setup("ngram", k, speed="reference")))
              for w in loads if w.name == name]
    return cases


# ---- engines ---------------------------------------------------------------------------------------------------


def draft_methods_reason() -> str | None:
    """None when engine.speculative.draft_model imports (layer_skip and draft_model can run), else why not."""
    try:
        import engine.speculative.draft_model  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import means: skip them, and say why
        return f"import engine.speculative.draft_model failed: {type(exc).__name__}: {exc}"
    return None


def pool_blocks(loads: list[Workload], batch: int, k: int) -> int:
    """KV blocks for every distinct prompt at once (the prefix cache keeps them) plus `batch` requests' output
    and guesses; sized so that several engines of a 135M model fit beside each other."""
    prompts = {p for w in loads for p in w.prompts}
    per_output = max(w.max_tokens for w in loads) + k + 1
    return sum(-(-len(p) // BLOCK_SIZE) + 1 for p in prompts) + batch * (-(-per_output // BLOCK_SIZE) + 1)


def build(setup: Setup, model, tokenizer, name: str, blocks: int, batch: int, budget: int, threads: int):
    """An LLM over the shared weights for `setup` (`budget`: max_num_batched_tokens); a draft proposer that
    cannot be built is (None, why)."""
    from engine import LLM

    try:
        llm = LLM(model, tokenizer, speed=setup.speed, num_threads=threads, max_num_seqs=batch,
                  num_blocks=blocks, max_num_batched_tokens=budget,
                  speculative_config=setup.speculative_config(name))
    except Exception as exc:
        if setup.method not in DRAFT_METHODS:
            raise
        return None, f"{type(exc).__name__}: {exc}"
    return llm, None


def engines_for(case: Case, built: dict, skipped: dict, ctx: dict) -> dict:
    """The case's engines: those already built are reused, the others built (a draft that fails is skipped,
    its reason kept); engines no case needs now are dropped first, so few models' copies live at once."""
    for setup in [s for s in built if s not in case.setups]:
        del built[setup]
    gc.collect()
    for setup in case.setups:
        if setup not in built and setup not in skipped:
            llm, why = build(setup, **ctx)
            if llm is None:
                skipped[setup] = why
                print(f"skipped {setup.label} on {ctx['name']}: {why}", flush=True)
            else:
                built[setup] = llm
    return {s: built[s] for s in case.setups if s in built}


# ---- one run, one case -----------------------------------------------------------------------------------------


def run_once(llm, load: Workload, batch: int) -> Run:
    """Every prompt of `load` once, greedy, in groups of `batch`; the decode steps read from the trace."""
    trace, params = llm.engine.trace, SamplingParams(temperature=0.0, max_tokens=load.max_tokens)
    first, outputs = len(trace.steps), []
    for group in groups(load.prompts, batch):
        outputs += [list(o.outputs[0].token_ids) for o in llm.generate(group, params, use_tqdm=False)]
    steps = trace.steps[first:]
    decode = [s for s in steps if s.scheduled and all(x.phase == "decode" for x in s.scheduled)]
    return Run(outputs, sum(x.tokens_out for s in decode for x in s.scheduled),
               sum(s.time_s.total for s in decode), len(decode), sum(len(s.scheduled) for s in decode),
               sum(any(e["type"] == "speculation_off" for e in s.events) for s in decode),
               sum(e["type"] == "speculation_error" for s in steps for e in s.events), spec_decode_stats(steps))


def check_same_outputs(expected: list[list[int]], got: list[list[int]], where: str) -> int:
    """Raise AssertionError at the first token where `got` differs from plain decoding's `expected` (greedy
    speculation is exact: any difference is a bug); returns how many outputs were compared."""
    if len(got) != len(expected):
        raise AssertionError(f"{where}: {len(got)} outputs, plain decoding gave {len(expected)}")
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        if want != have:
            pairs = enumerate(zip(want, have, strict=False))
            at = next((j for j, (a, b) in pairs if a != b), min(len(want), len(have)))
            raise AssertionError(f"{where}: prompt {i} differs from plain decoding at output token {at}: "
                                 f"plain {want[at:at + 4]}, speculative {have[at:at + 4]} "
                                 f"({len(want)} vs {len(have)} tokens)")
    return len(got)


def round_order(setups: list, r: int) -> list:
    """Round r's order: as given on even rounds (plain first, so round 0 sets the oracle), reversed on odd."""
    return list(setups) if r % 2 == 0 else list(reversed(setups))


def measure_case(case: Case, llms: dict, repeats: int) -> tuple[dict, dict]:
    """Every engine of the case, `repeats` rounds ABC / CBA; returns each setup's runs and outputs checked."""
    plain = case.setups[0]
    if plain not in llms:
        raise RuntimeError(f"{case.workload.name}: plain decoding did not build, nothing to compare with")
    runs, checked, expected = {s: [] for s in llms}, dict.fromkeys(llms, 0), None
    # first-use costs out (this batch's shapes, the verify rows'), and the first group's prompts cached
    warm = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS)
    for llm in llms.values():
        llm.generate(groups(case.workload.prompts, case.batch)[0], warm, use_tqdm=False)
    for r in range(repeats):
        for setup in round_order(list(llms), r):
            run = run_once(llms[setup], case.workload, case.batch)
            expected = run.outputs if expected is None else expected  # round 0 runs plain first
            where = f"{case.workload.name}, batch {case.batch}, {setup.label}, round {r}"
            checked[setup] += check_same_outputs(expected, run.outputs, where)
            runs[setup].append(run)
    return runs, checked


# ---- rows and targets ------------------------------------------------------------------------------------------


def finite(x: float | None, digits: int) -> float | None:
    """x rounded, or None where it is nan (no guess was made: JSON has no nan)."""
    return None if x is None or math.isnan(x) else round(x, digits)


def step_s(run: Run) -> float:
    return run.decode_s / run.decode_steps


def case_rows(case: Case, runs: dict, checked: dict) -> list[dict]:
    """One row per proposer of the case (and the A/A control), against the case's plain decoding."""
    plain, rows = runs[case.setups[0]], []
    for setup, spec in runs.items():
        if setup.method is None and not setup.control:
            continue
        last = spec[-1]  # greedy: every round guesses, keeps and emits the same tokens
        stats = last.stats
        rows.append({
            "workload": case.workload.name, "batch": case.batch, "proposer": setup.method or CONTROL, "k": setup.k,
            "switch_off": None if setup.control else "never" if setup.never_off else SWITCH_OFF,
            "speed": setup.speed,
            "tok_s_plain": round(statistics.median(p.tok_s for p in plain), 1),
            "tok_s_spec": round(statistics.median(s.tok_s for s in spec), 1),
            "ratio": round(statistics.median(s.tok_s / p.tok_s for s, p in zip(spec, plain, strict=True)), 2),
            "acceptance_rate": finite(stats.acceptance_rate, 3),
            "mean_acceptance_length": finite(stats.mean_acceptance_length, 2),
            "tokens_per_step": round(last.decode_tokens / last.request_steps, 2),
            "step_cost": round(statistics.median(step_s(s) / step_s(p) for s, p in zip(spec, plain, strict=True)), 2),
            "guessed_pct": round(100 * stats.num_drafts / last.request_steps, 1),
            "spec_off_pct": round(100 * last.off_steps / last.decode_steps, 1),
            "mean_batch": round(last.request_steps / last.decode_steps, 1),
            "output_tokens": sum(len(o) for o in last.outputs),
            "outputs_checked": checked[setup],
            "proposer_errors": sum(s.errors for s in spec)})
    return rows


def why(row: dict) -> str:
    """A row's speed-up explained by its two measured factors."""
    accepted = "no guess" if row["acceptance_rate"] is None else f"{100 * row['acceptance_rate']:.0f} % kept"
    return (f"{row['workload']} {row['proposer']} k={row['k']} ({row['switch_off']}): {row['ratio']}x; a decoding "
            f"request got {row['tokens_per_step']} tokens a step (guesses on {row['guessed_pct']} % of its steps, "
            f"{accepted}) and a step cost {row['step_cost']}x a plain one")


def judge(target: str, row: dict | None, bar: float) -> dict:
    if row is None:
        return {"target": target, "result": "not run", "measured": "its workload was not in this run"}
    return {"target": target, "result": "met" if row["ratio"] >= bar else "missed", "measured": why(row)}


def target_rows(rows: list[dict]) -> list[dict]:
    """Issue 30's targets, each met / missed / not run, with the row that decides it and why."""
    def best(workload: str, method: str | None = None) -> dict | None:
        fit = [r for r in rows if r["workload"] == workload and r["batch"] == 1 and r["speed"] == "fast"
               and method in (None, r["proposer"])]
        return max(fit, key=lambda r: r["ratio"], default=None)

    out = [judge(f"ngram on tinylab {task}, batch 1: >= {SPEEDUP_BARS['tinylab']:g}x tokens/s",
                 best(f"tinylab/{task}", "ngram"), SPEEDUP_BARS["tinylab"]) for task in TASKS]
    out.append(judge(f"SmolLM2 on the document, batch 1: >= {SPEEDUP_BARS['document']:g}x tokens/s",
                     best(f"{REAL_MODEL}/document"), SPEEDUP_BARS["document"]))
    full = [r for r in rows if r["batch"] == FULL_BATCH and r["speed"] == "fast"]
    worst = min((r for r in full if r["switch_off"] == SWITCH_OFF), key=lambda r: r["ratio"], default=None)
    verdict = judge(f"batch {FULL_BATCH}: never more than 5 % slower than plain", worst, SPEEDUP_BARS["batch16"])
    if worst is not None:
        verdict["measured"] += f"; speculation was off on {worst['spec_off_pct']} % of its decode steps"
        forced = [why(r) for r in full if r["switch_off"] == "never"]
        verdict["measured"] += "".join(f"; with the switch off: {f}" for f in forced)
        verdict["measured"] += "".join(f"; the A/A control (a second plain engine) on {r['workload']} ran "
                                       f"{r['ratio']}x, the noise floor" for r in full if r["proposer"] == CONTROL)
    return out + [verdict]


# ---- the run ---------------------------------------------------------------------------------------------------


def measure_model(name: str, cfg: dict, threads: int) -> tuple[list[dict], dict]:
    """Every case of one model; returns its rows and what the notes need (prompt sizes, skipped proposers)."""
    from engine.loading.loader import load_model

    model, tokenizer = load_model(name)
    max_len = model.config.max_position_embeddings
    loads = workloads(name, tokenizer, max_len, cfg)
    no_drafts = draft_methods_reason()
    if no_drafts:
        print(f"skipped layer_skip and draft_model on {name}: {no_drafts}", flush=True)
    cases = plan_cases(loads, cfg, no_drafts is None)
    batch, k = max(c.batch for c in cases), max(s.k for c in cases for s in c.setups)
    longest = max(len(p) for w in loads for p in w.prompts)
    # the whole group's prompts in one step: the decode steps that follow carry the full batch
    ctx = dict(model=model, tokenizer=tokenizer, name=name, blocks=pool_blocks(loads, batch, k), batch=batch,
               budget=max(max_len, batch * longest), threads=threads)
    built, skipped, rows = {}, {}, []
    for case in cases:
        runs, checked = measure_case(case, engines_for(case, built, skipped, ctx), cfg["repeats"])
        for row in case_rows(case, runs, checked):
            rows.append(row)
            table = markdown_table([row]).splitlines()
            print("\n".join(table if len(rows) == 1 else table[-1:]), flush=True)
    built.clear()
    gc.collect()
    skips = {s.label: why for s, why in skipped.items()}
    if no_drafts:
        skips.update({m: no_drafts for m in DRAFT_METHODS})
    return rows, {"prompt_tokens": {w.name: [len(p) for p in w.prompts] for w in loads}, "skipped": skips,
                  "num_blocks": ctx["blocks"], "drafts": DRAFTS[name]}


NOTES = ("Plain decoding and each proposer run in one process over the same weights, interleaved in rounds "
         "(A B C, then C B A); medians over the rounds (ratio: the median of each round's spec/plain). Greedy; "
         "every speculative output was checked equal to plain decoding's, token for token (outputs_checked). "
         "tok_s: tokens emitted by pure decode steps / their seconds (the proposer's time included). "
         "tokens_per_step: tokens a decoding request got per step (plain 1); step_cost: a speculative decode "
         "step's seconds / a plain one's; at batch 1 ratio = tokens_per_step / step_cost. guessed_pct: the "
         "request-steps that carried guesses; spec_off_pct: decode steps where speculation switched itself off "
         "(switch_off: disable_by_batch_size). mean_batch: decoding requests per decode step (a group of B starts "
         "together and drains as its requests finish). plain (A/A): a second plain engine in the batch-16 cases; "
         "its ratio to the first is how far two identical engines differ on this machine (the noise floor under "
         "the 5 % target).")


def write_report(rows: list[dict], targets: list[dict], settings: dict, info: dict, out: Path | None,
                 name: str) -> tuple[Path, Path]:
    """benchmarks/results/<name>.json and .md (or under `out`): machine and settings first, the rows, then the
    targets, the prompts' sizes and any proposer that was skipped, with why."""
    import json

    json_path, md_path = write_results(name, rows, settings, results_dir=out)
    payload = json.loads(json_path.read_text())
    json_path.write_text(json.dumps({**payload, "targets": targets, "models": info}, indent=2) + "\n")
    lines = ["", "## Targets (issue 30)", "", markdown_table(targets), "## Notes", "", NOTES, ""]
    for model, i in info.items():
        sizes = ", ".join(f"{w} {min(n)}-{max(n)}" for w, n in i["prompt_tokens"].items())
        lines.append(f"- {model}: prompt tokens {sizes}; drafts {i['drafts']}; {i['num_blocks']} KV blocks per "
                     "engine" + "".join(f"; skipped {s}: {why}" for s, why in i["skipped"].items()))
    with md_path.open("a") as f:
        f.write("\n".join(lines) + "\n")
    return json_path, md_path


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tinylab, 2 examples, 2 rounds (seconds)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=None, help="which models (default: both)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, for the engines and outside them")
    parser.add_argument("--repeats", type=int, default=None, help="override the rounds")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write speculative.json/.md (default benchmarks/results/)")
    args = parser.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    cfg.update({k: v for k, v in (("models", args.models), ("repeats", args.repeats)) if v is not None})
    torch.set_num_threads(args.threads)
    t0, rows, info = time.perf_counter(), [], {}
    for name in cfg["models"]:
        model_rows, info[name] = measure_model(name, cfg, args.threads)
        rows += model_rows
    targets = target_rows(rows)
    print("\n" + markdown_table(rows) + "\n" + markdown_table(targets))
    doc = document()
    settings = dict(cpu_flags=" ".join(cpu_simd_flags()) or "unknown", torch_threads=args.threads, quick=args.quick,
                    **{k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}, sweep_k=SWEEP_K,
                    task_max_tokens={t: MAX_NEW_TOKENS[t] for t in TASKS}, document=f"README.md[:{len(doc)}] sha256 "
                    f"{hashlib.sha256(doc.encode()).hexdigest()[:12]}", wall_s=round(time.perf_counter() - t0))
    paths = write_report(rows, targets, settings, info, args.out, "speculative_quick" if args.quick else "speculative")
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
