"""Chapter 12 through the server: a speculative engine streams several tokens per step with exactly the text
plain decoding gives, through the `openai` client, and /metrics counts its guesses in vLLM's names."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.llm import LLM
from engine.llm_engine import LLMEngine, engine_config
from engine.loading.loader import load_model
from engine.sampling import SamplingParams
from engine.serving.server import BackgroundServer, build_app

MODEL = "tinylab"
# copying from the prompt: prompt lookup finds the continuation, so verify steps emit several tokens
PROMPTS = ["Make JSON: the name is Ada, city Oslo, 41 years old, job is baker.\nJSON:",
           "Finn lived in a small house near the school. Finn lived in a small house near the"]
MAX_TOKENS = 24
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None, "max_verify_rows": None}


@pytest.fixture(scope="module")
def served():
    model, tok = load_model(MODEL)
    plain = LLM(model, tok).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    engine = LLMEngine(model, tok, engine_config(MODEL, max_num_seqs=4, speculative_config=SPEC))
    with BackgroundServer(build_app(engine)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield server, client, plain, engine


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_streamed_speculative_text_equals_plain_decoding(served, index):
    _, client, plain, engine = served
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[index], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert "".join(chunks) == plain[index].outputs[0].text
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[index], max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].text == plain[index].outputs[0].text


def test_verify_steps_emitted_several_tokens_and_metrics_count_the_guesses(served):
    server, client, _, engine = served
    client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    several = [s for r in engine.trace.steps for s in r.scheduled if s.draft_token_ids and s.tokens_out > 1]
    assert several, "no verify step emitted more than one token: the test prompts no longer copy"
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    values = {s.name: s.value for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                                           "vllm:spec_decode_num_accepted_tokens")
              for s in families[name].samples if s.name.endswith("_total")}
    assert values["vllm:spec_decode_num_drafts_total"] >= len(several)
    assert 0 < values["vllm:spec_decode_num_accepted_tokens_total"] <= values["vllm:spec_decode_num_draft_tokens_total"]
    per_pos = {s.labels["position"]: s.value for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
               if s.name.endswith("_total")}
    assert sum(per_pos.values()) == values["vllm:spec_decode_num_accepted_tokens_total"]
    assert per_pos["0"] >= max(per_pos.values())  # a later guess is only kept after every earlier one
