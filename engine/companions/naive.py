"""Chapter 01: the generation loop with no cache, exactly the loop a reader first imagines.

    ids = prompt
    repeat:
        logits = model(ids)            # the FULL sequence, every step: nothing is remembered
        next = sample(logits[-1])      # only the last position predicts the next token
        ids.append(next)
        stop on EOS, a stop string/id, or max_tokens

Every step recomputes the keys and values of every earlier token, so step t costs O(t) work
(and attention O(t^2)): chapter 03's KV cache exists to remove exactly that waste.

The loop itself (`run_loop`) only asks for "the logits of the next position, given the tokens that
are new since last time"; `generate_naive` answers by re-running the whole sequence, and
`engine.companions.kv_cache.generate_cached` answers from a cache. Same loop, same sampler, same
stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.companions.metrics import RequestTiming
from engine.model import LlamaModel
from engine.sampling import SamplingParams, SamplingState, check_stop, sample, shows_text
from engine.tokenizer import Tokenizer, encode_prompt, eos_ids

# step_fn(new_token_ids) -> logits [V] of the position after the last token fed so far.
StepFn = Callable[[list[int]], Tensor]


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str  # generated text (stop strings removed)
    finish_reason: str  # "stop" (EOS, stop id or stop string) or "length"
    # step 0 is the prefill (gives the first token)
    step_times_s: list[float] = field(default_factory=list)

    @property
    def timing(self) -> RequestTiming:
        """This run as `engine.companions.metrics` sees a request:
        one token at the end of each timed step."""
        return RequestTiming.from_step_times(self.step_times_s, finish_reason=self.finish_reason)

    @property
    def ttft_s(self) -> float:
        """Time to first token: the prompt's forward pass plus the first sample."""
        return self.timing.ttft_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        return self.timing.tpot_s


@torch.inference_mode()
def full_logits(model: LlamaModel, input_ids: Tensor) -> Tensor:
    """Logits at every position, no cache: input_ids [B, T] -> [B, T, V]."""
    return model(input_ids)


@torch.inference_mode()
def run_loop(step_fn: StepFn, prompt_ids: list[int], params: SamplingParams,
             tokenizer: Tokenizer | None, eos: list[int], max_len: int,
             on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """The autoregressive loop: feed new tokens, sample, append, check stops."""
    state = SamplingState(params, prompt_ids=list(prompt_ids))
    detok = tokenizer.detokenizer() if tokenizer is not None else None
    new, times, reason, text = list(prompt_ids), [], "length", ""
    while len(prompt_ids) + len(state.output_ids) < max_len:
        start = time.perf_counter()
        logits = step_fn(new)  # [V]
        if params.structured_outputs is not None and state.grammar is None:
            state.grammar = _grammar(params, tokenizer, eos, logits.shape[-1])
        # EOS kept out until min_tokens
        token = int(sample(logits[None].float(), [state], eos).token_ids[0])
        times.append(time.perf_counter() - start)
        if detok is not None and shows_text(token, eos):
            delta = detok.push(token)
            if on_text and delta:
                on_text(delta)
            text = detok.text
        done, why, text = check_stop(state.output_ids, token, text, params, eos)
        state.output_ids.append(token)
        if done:
            reason = why
            break
        new = [token]
    return GenerationResult(list(prompt_ids), state.output_ids, text, reason, times)


def _grammar(params: SamplingParams, tokenizer: Tokenizer | None, eos: list[int], vocab_size: int):
    """params.structured_outputs compiled for this one sequence (chapter 13)."""
    from engine.structured.grammar import GrammarProcessor, compile_grammar

    if tokenizer is None:
        raise ValueError("structured_outputs needs a tokenizer (a grammar is over text)")
    return GrammarProcessor(compile_grammar(params.structured_outputs, tokenizer, vocab_size), eos)


def generate_naive(model: LlamaModel, tokenizer: Tokenizer | None, prompt: str | list[int],
                   params: SamplingParams | None = None, on_text=None) -> GenerationResult:
    """Generate with no cache: every step runs the model over the whole sequence so far."""
    params = params or SamplingParams()
    max_len = model.config.max_position_embeddings
    prompt_ids = encode_prompt(prompt, tokenizer, max_len)
    device = model.embed_tokens.weight.device
    sequence: list[int] = []

    def step_fn(new_ids: list[int]) -> Tensor:
        sequence.extend(new_ids)
        ids = torch.tensor([sequence], device=device)  # [1, T]: the WHOLE sequence, every step
        return model(ids, last_only=True)[0]  # [V]

    return run_loop(step_fn, prompt_ids, params, tokenizer, eos_ids(model, tokenizer), max_len,
                    on_text)
