"""One door for speed: `speed="reference"` runs the spine alone, `speed="fast"` plugs the fast wing in, both
compute the same thing, and the package's imports keep the house in order.

The claims:
- a reference engine (tinylab and the real SmolLM2) generates the naive loop's tokens with no module of
  engine/fast imported and no compiled library of ours mapped into the process (a fast engine maps one:
  the check can fail);
- no spine module imports the fast wing or a compiled kernel (only `*.reference` kernels), and only
  engine/speed.py (the door) imports engine/fast;
- the package's imports have no cycle and no arrow from a lower layer to a higher one;
- the engine's logits at every scored position equal `transformers` in both speeds (the multi-position
  seam: one step keeps the logits of several positions of one request);
- a reference engine refuses the fast wing's options by name; the speed and its choices are in the trace;
- a logits processor is applied on every sampling path (plain greedy included) in both speeds and the
  naive loop alike.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import load_model
from engine.companions.naive import generate_naive
from engine.llm_engine import LLMEngine, engine_config
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledWork
from engine_fixtures import random_model
from hf_oracle import save_tiny_hf_model

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"
SPEEDS = ["reference", "fast"]
# The spine: what a student reads along one request's way (DESIGN.md, "Speed behind one door").
SPINE = ["llm", "llm_engine", "request", "scheduler", "runner", "model", "sampling", "tokenizer", "config",
         "trace", "threads", "speed", "kv.block_manager", "kv.prefix_cache", "kv.evictor", "kv.kv_pool"]
DOOR = "engine.speed"
# Layers from the bottom up: a module may import its own layer and the ones below, never one above.
LAYERS = [
    ("kernels",),
    ("engine.config", "engine.threads", "engine.model", "engine.surgery", "engine.trace", "engine.request",
     "engine.tokenizer", "engine.sampling", "engine.kv", "engine.loading", "engine.companions.memory",
     "engine.companions.timing", "engine.companions.metrics", "engine.companions.roofline"),
    ("engine.scheduler", "engine.runner", "engine.fast", "engine.speed", "engine.parallel",
     "engine.speculative", "engine.structured",
     "engine.companions.naive", "engine.companions.kv_cache", "engine.companions.placement"),
    ("engine.llm_engine", "engine.llm", "engine", "engine.replicas"),
    ("engine.serving", "engine.lab", "engine.viz", "engine.__main__"),
]

REFERENCE_RUN = r"""
import json, sys
from engine import LLM, SamplingParams
from engine.companions.naive import generate_naive
from kernels.toolchain import kernel_cache_dir
llm = LLM(sys.argv[1], speed=sys.argv[2], max_num_seqs=2)
params = SamplingParams(temperature=0, max_tokens=8)
prompts = ["Q: 347+85=", "Once upon a time"]
outs = llm.generate(prompts, params, use_tqdm=False)
naive = [generate_naive(llm.engine.model, llm.tokenizer, p, params).token_ids for p in prompts]
cache = str(kernel_cache_dir())
maps = open("/proc/self/maps").read().splitlines()
native = sys.modules.get("kernels.paged_attention.cpu_native")  # imported by the fast wing only
c_built = native is not None and native.why_library_cannot_load() is None
print(json.dumps({
    "fast_modules": sorted(m for m in sys.modules if m.startswith("engine.fast")),
    "kernel_modules": sorted(m for m in sys.modules if m.startswith("kernels.")),
    "our_libraries": sorted({line.split()[-1] for line in maps if cache in line}),
    "equal_naive": [o.outputs[0].token_ids == n for o, n in zip(outs, naive)],
    "c_built": c_built,
}))
"""


def run_in_fresh_process(model: str, speed: str) -> dict:
    done = subprocess.run([sys.executable, "-c", REFERENCE_RUN, model, speed], capture_output=True, text=True,
                          cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["tinylab", "smollm2-135m-instruct"])
def test_a_reference_engine_runs_the_spine_alone_and_equals_the_naive_loop(model):
    if model != "tinylab":
        pytest.importorskip("gguf", reason="the real model needs the gguf package (requirements.txt)")
    ref = run_in_fresh_process(model, "reference")
    assert ref["fast_modules"] == [], ref
    assert all(m.endswith(".reference") or m in ("kernels.paged_attention", "kernels.toolchain")
               for m in ref["kernel_modules"]), ref
    assert ref["our_libraries"] == [], ref
    assert ref["equal_naive"] == [True, True]
    assert ref["c_built"] is False
    fast = run_in_fresh_process(model, "fast")  # the control: the same probes see the fast wing
    assert fast["fast_modules"] and fast["equal_naive"] == [True, True]
    if fast["c_built"]:  # (no C compiler here: the fast wing runs sdpa and torch, nothing to map)
        assert fast["our_libraries"], "a fast engine that built C kernels must show them mapped"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code (lazy imports inside functions count)."""
    tree, name = ast.parse(path.read_text()), module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m.split(".")[0] in ("engine", "kernels")}


def our_modules() -> dict[str, Path]:
    files = [*ENGINE.rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]
    return {module_name(f): f for f in files}


def resolved(imported: str, modules: dict[str, Path]) -> str | None:
    """The module of ours an import names (`from engine.kv import block_manager` names the module)."""
    while imported and imported not in modules:
        imported = imported.rpartition(".")[0]
    return imported or None


@pytest.mark.parametrize("spine", SPINE)
def test_no_spine_module_imports_the_fast_wing_or_a_compiled_kernel(spine):
    imported = imports_of(ENGINE / (spine.replace(".", "/") + ".py"))
    fast = {m for m in imported if m.startswith("engine.fast")}
    compiled = {m for m in imported if m.startswith("kernels.") and ".reference" not in m
                and m not in ("kernels.paged_attention",)}
    if f"engine.{spine}" == DOOR:
        import engine.fast

        # the door imports the wing's package and its public names only, never a module inside it
        public = {"engine.fast"} | {f"engine.fast.{name}" for name in engine.fast.__all__}
        assert "engine.fast.accelerate" in fast and fast <= public, fast - public
        fast = set()
    assert not fast and not compiled, f"engine.{spine} imports {sorted(fast | compiled)}"


def test_only_the_door_imports_the_fast_wing():
    offenders = {name: sorted(m for m in imports_of(path) if m.startswith("engine.fast"))
                 for name, path in our_modules().items()
                 if not name.startswith("engine.fast") and name != DOOR}
    assert {k: v for k, v in offenders.items() if v} == {}


def layer_of(name: str) -> int:
    best = max(((len(p), i) for i, group in enumerate(LAYERS) for p in group
                if name == p or name.startswith(p + ".")), default=None)
    assert best is not None, f"{name} is in no layer of LAYERS: add it"
    return best[1]


def import_graph() -> dict[str, set[str]]:
    modules = our_modules()
    graph = {}
    for name, path in modules.items():
        targets = {resolved(m, modules) for m in imports_of(path)} - {None, name}
        graph[name] = {t for t in targets if not name.startswith(t + ".")}  # a package's own __init__
    return graph


def test_no_module_imports_one_above_its_layer():
    upward = sorted(f"{a} -> {b}" for a, targets in import_graph().items() for b in targets
                    if layer_of(b) > layer_of(a))
    assert upward == []


def test_the_package_imports_have_no_cycle():
    graph, state, cycles = import_graph(), {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


@pytest.mark.parametrize("name", ["llama_gqa", "mistral", "qwen2_qkv_bias_untied"])
@pytest.mark.parametrize("speed", SPEEDS)
def test_scoring_every_prompt_position_gives_transformers_logits(tmp_path, name, speed):
    """One step, one request, every prompt position scored (`ScheduledWork.scored`): [T, V] logits."""
    hf = save_tiny_hf_model(name, tmp_path)
    model, _ = load_model(tmp_path)
    ids = torch.randint(0, hf.config.vocab_size, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = LLMEngine(model, None, engine_config("oracle", speed=speed, block_size=4, num_blocks=32))
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=2))
    sched = engine.scheduler.schedule()
    (work,) = sched.work
    work.scored = work.end - work.start  # all 30 positions
    assert sched.num_scored == 30
    _, logits = engine.runner.execute(sched.moves, [work], engine.block_manager)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]  # [T, V]
    assert logits.shape == theirs.shape
    assert (logits - theirs).abs().max() <= 1e-4


def test_scored_positions_must_be_fed_ones():
    with pytest.raises(ValueError, match=r"scored=4 must be in \[0, 3\]"):
        ScheduledWork(None, 2, 5, "prefill", [0, 1, 2], scored=4)


def test_a_reference_engine_refuses_fast_options_by_name_and_records_its_speed():
    with pytest.raises(ValueError, match=r"attention_backend='native'.*speed='reference'"):
        engine_config(speed="reference", attention_backend="native")
    with pytest.raises(ValueError, match=r"speed must be one of reference, fast; got 'turbo'"):
        engine_config(speed="turbo")
    model = random_model()
    ref = LLMEngine(model, None, engine_config("random", speed="reference", attention_backend="torch"))
    assert ref.trace.config["speed"] == "reference" and ref.runner.model is model
    assert ref.runner.decode_step is None and type(ref.attention).__name__ == "PagedAttention"
    fast = LLMEngine(model, None, engine_config("random", speed="fast"))
    config = fast.trace.config
    choices, named = set(config["speed_choices"]), {"speed", "attention", "weight_layout",
                                                    "layer_backend", "tuning"}
    assert config["speed"] == "fast" and named <= choices
    # and one answer per shape class of engine/fast/tuning.py (constants here: tests/conftest.py)
    assert choices - named and all(n.startswith(("linear-", "prefill-")) for n in choices - named)
    assert all(config["speed_reasons"][n].startswith("defaults: ") for n in choices - named)
    assert set(config["speed_reasons"]) == choices - {"speed"}
    assert config["speed_choices"]["weight_layout"] == fast.weight_layout == "packed"
    assert config["speed_choices"]["layer_backend"] == ("native" if fast.runner.decode_step else "python")


class BanToken:
    """A logits processor: token `banned` can never be chosen."""

    def __init__(self, banned: int):
        self.banned, self.calls = banned, 0

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        logits[self.banned] = float("-inf")
        return logits


@pytest.mark.parametrize("speed", SPEEDS)
def test_a_logits_processor_applies_on_the_plain_greedy_path_too(speed):
    model, prompt = random_model(seed=6), [5, 9, 12, 40, 7]
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    free = generate_naive(model, None, prompt, plain).token_ids
    ban = BanToken(free[0])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logits_processors=[ban])
    expected = generate_naive(model, None, prompt, params).token_ids
    assert ban.banned not in expected and expected != free
    engine = LLMEngine(model, None, engine_config("random", speed=speed))
    rid = engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_request(rid).output_token_ids == expected


def test_a_bad_logits_processor_is_refused_by_name():
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=[3])


# The spine a student steps through, file by file. Issue 29's bar was 14 with prefix caching off (13 were
# walked); with it on by default (issue 32, as in vLLM) the walk adds engine/kv/prefix_cache.py and its
# eviction policy, engine/kv/evictor.py.
MAX_FILES_ON_THE_WALK = 15


def files_touched_by_one_request(speed: str) -> set[str]:
    """The files of engine/ and kernels/ whose code runs while one request goes from add_request to done."""
    from engine import LLM

    llm = LLM("tinylab", speed=speed)
    touched, root = set(), str(ROOT) + "/"

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if name.startswith(root) and name[len(root):].startswith(("engine/", "kernels/")):
            touched.add(name[len(root):])

    sys.setprofile(profile)
    try:
        llm.engine.add_request("Q: 1+2=", SamplingParams(temperature=0, max_tokens=4))
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    finally:
        sys.setprofile(None)
    return touched


def test_one_request_in_reference_mode_walks_at_most_fifteen_files_and_no_fast_code():
    reference, fast = files_touched_by_one_request("reference"), files_touched_by_one_request("fast")
    assert len(reference) <= MAX_FILES_ON_THE_WALK, sorted(reference)
    assert not any(f.startswith("engine/fast/") for f in reference), sorted(reference)
    assert "engine/runner.py" in reference and "engine/model.py" in reference
    assert any(f.startswith("engine/fast/") for f in fast)  # the control: the probe sees the fast wing


@pytest.mark.parametrize("speed, shown", [("reference", "[speed: reference"), ("fast", "[attention: ")])
def test_the_cli_runs_the_engine_at_speed_and_prints_what_it_chose(speed, shown):
    done = subprocess.run([sys.executable, "-m", "engine", "generate", "Q: 347+85=", "--max-tokens", "4",
                           "--speed", speed], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert shown in done.stderr and f"speed={speed}" in done.stdout
    assert done.stdout.startswith("Q: 347+85=")


def test_the_cli_refuses_a_speed_it_does_not_have():
    done = subprocess.run([sys.executable, "-m", "engine", "generate", "hi", "--speed", "turbo"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode != 0 and "invalid choice: 'turbo'" in done.stderr
