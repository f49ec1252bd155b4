"""Small models and workloads for the engine tests (chapter 05): fast on two CPU cores."""

from __future__ import annotations

import torch

from engine.companions.naive import generate_naive
from engine.config import ModelConfig
from engine.llm_engine import LLMEngine, engine_config
from engine.model import LlamaModel
from engine.sampling import SamplingParams

VOCAB = 101
EOS = 1  # token 1 ends a sequence; prompts are drawn from 2.. so they never contain it
CONTEXT = 96  # max_position_embeddings of the random model


def random_model(seed: int = 0, context: int = CONTEXT, kv_heads: int = 2) -> LlamaModel:
    """A 2-layer, hidden-64 Llama with sharp random weights (logits far from ties, so greedy is stable)."""
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=context,
                      eos_token_id=EOS)
    torch.manual_seed(seed)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    return model.eval()


def mixed_workload(n: int, seed: int = 0, max_prompt: int = 60, max_out: int = 24):
    """n (prompt ids, greedy params): prompt lengths 1..max_prompt, max_tokens 1..max_out."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        prompt = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        max_tokens = int(torch.randint(1, max_out + 1, (1,), generator=g))
        out.append((prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    return out


def naive_outputs(model: LlamaModel, workload) -> list[list[int]]:
    """The oracle: each prompt alone through the no-cache loop."""
    return [generate_naive(model, None, prompt, params).token_ids for prompt, params in workload]


def run_engine(model: LlamaModel, workload, **options) -> tuple[LLMEngine, dict[str, list[int]]]:
    """Add every request at once, step until all finish; returns the engine and id -> output ids."""
    engine = LLMEngine(model, None, engine_config(model="random", **options))
    ids = [engine.add_request(prompt, params) for prompt, params in workload]
    while engine.has_unfinished_requests():
        engine.step()
    return engine, {rid: engine.get_request(rid).output_token_ids for rid in ids}
