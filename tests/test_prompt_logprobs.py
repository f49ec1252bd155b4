"""Chapter 13: prompt logprobs from the paged engine equal the full-sequence log-softmax of a no-cache forward
(to 1e-4 in fp32), whatever the chunking, with the prefix cache on (a request asking for them computes its whole
prompt), in both speeds. They are what evaluation harnesses score loglikelihood tasks with."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.loading.loader import load_model
from engine.sampling import SamplingParams

PROMPTS = ["Once upon a time there was a fox who lived near the river.", "Q: 347+85=", "Make JSON: name Ada"]
TOP = 3
TOLERANCE = 1e-4  # fp32: the paged attention sums in another order than the no-cache forward


@pytest.fixture(scope="module")
def tinylab():
    return load_model("tinylab")


def full_sequence_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[T - 1, V]: row i is log P(next | ids[:i + 1]), from one no-cache forward."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0, :-1].float(), dim=-1)


@pytest.mark.parametrize("speed", ["reference", "fast"])
@pytest.mark.parametrize("chunk", [None, 5])
def test_prompt_logprobs_equal_the_no_cache_forward(tinylab, speed, chunk):
    options = {"enable_chunked_prefill": True, "max_prefill_chunk_tokens": chunk} if chunk else {}
    llm = LLM(*tinylab, speed=speed, **options)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # fills the prefix cache
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP), use_tqdm=False)
    for out in outs:
        ids = out.prompt_token_ids
        expected = full_sequence_logprobs(tinylab[0], ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for position in range(1, len(ids)):
            got, row = out.prompt_logprobs[position], expected[position - 1]
            assert got.token_id == ids[position]
            assert got.logprob == pytest.approx(float(row[ids[position]]), abs=TOLERANCE)
            top = torch.topk(row, TOP)
            assert list(got.top) == top.indices.tolist()
            assert list(got.top.values()) == pytest.approx(top.values.tolist(), abs=TOLERANCE)


def test_without_prompt_logprobs_nothing_is_kept_and_the_cache_is_used(tinylab):
    llm = LLM(*tinylab)
    llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_logprobs is None
    hits = [e for r in llm.engine.trace.steps for e in r.events if e["type"] == "prefix_hit"]
    assert hits[-1]["num_tokens"] > 0


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_a_bad_prompt_logprobs_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
