"""Verification: which of the proposer's guesses the target keeps, decided exactly.

A verify step gives us the target's logits at k + 1 positions: after the last real token, and after
each of the k guesses. Position i's logits are only meaningful if guesses 1..i were all kept, so we
walk them in order and stop at the first rejection:

    guesses          g1     g2     g3                      k = 3
    target rows      r0     r1     r2     r3               r_i: logits after g_i (r0: after the
                     |      |      |      |                     last real token)
    greedy           argmax(r0) == g1 ? keep : emit argmax(r0) and stop
                     ...    every guess kept: emit argmax(r3) too (the "bonus" token)

Greedy keeps a guess when it IS the target's argmax, so the emitted tokens are exactly the ones
plain greedy decoding would produce, one per step, only several at once.

Sampling (Leviathan et al. 2023, Chen et al. 2023): the guess g was drawn from the proposer's
distribution q, the target wants p (after penalties, temperature, top-k/p, min-p: exactly what
engine/sampling.py would draw from). Keep g with probability min(1, p(g) / q(g)); on rejection draw
from the RESIDUAL, max(0, p - q) normalized. Then every emitted token is distributed exactly as p:

    P(emit x) = q(x) min(1, p(x)/q(x))  +  P(reject) * max(0, p(x) - q(x)) / sum(max(0, p - q))
              = min(q(x), p(x))         +  max(0, p(x) - q(x))               (P(reject) = that sum)
              = p(x)

A proposer that picks deterministically (prompt lookup, a greedy draft) has q = one-hot(g): g is
kept with probability p(g), and the residual is p with g removed. A seeded request draws from its
own generator, so its outputs repeat run to run (though not the same tokens as without
speculation: the draws are used in a different order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.sampling import (
    SamplingState,
    TokenLogprobs,
    argmax_rows,
    is_plain_greedy,
    processed_logits,
    sampling_probs,
    top_logprobs,
)


def accepts(p_guess: float, q_guess: float, u: float) -> bool:
    """Keep a guess that the target gives probability p_guess and the proposer q_guess, with the
    uniform draw u in [0, 1): true with probability min(1, p/q) (u * q < p avoids dividing)."""
    return u * q_guess < p_guess


def residual(p: Tensor, q: Tensor) -> Tensor:
    """The distribution to draw from after a rejection: max(0, p - q), normalized. [V] -> [V].

    Its sum is the probability of a rejection, which is > 0 whenever a rejection happened."""
    rest = (p - q).clamp(min=0)
    total = rest.sum()
    if total <= 0:
        raise ValueError("the residual max(0, p - q) is all zero: with p == q every guess is kept, "
                         "so a rejection cannot have happened")
    return rest / total


def _one_hot(token: int, like: Tensor) -> Tensor:
    return F.one_hot(torch.tensor(token), like.shape[-1]).to(like.dtype)


def choose(processed: Tensor, state: SamplingState, guess: int | None,
           q: Tensor | None) -> tuple[int, bool]:
    """At one position: (the token emitted, whether it is the guess and verification goes on).

    processed: the target's row after `processed_logits` [V]; guess: the proposer's token here
    (None at the bonus position, past the last guess); q: the distribution it was drawn from [V]
    (None: deterministic, one-hot)."""
    params, gen = state.params, state.generator
    if params.greedy:
        token = int(torch.argmax(processed))
        return token, token == guess
    p = sampling_probs(processed, params).to(gen.device)  # [V]
    if guess is None:  # the bonus position: a plain draw from p
        return int(torch.multinomial(p, 1, generator=gen)), False
    q = _one_hot(guess, p) if q is None else q.to(p.device, p.dtype)
    if q[guess] <= 0:
        raise ValueError(f"the proposer guessed token {guess} but gave it probability "
                         f"{float(q[guess])}: a sampled guess must come from its q")
    u = float(torch.rand((), generator=gen, device=gen.device))
    if accepts(float(p[guess]), float(q[guess]), u):
        return guess, True
    return int(torch.multinomial(residual(p, q), 1, generator=gen)), False


def verify(rows: Tensor, guesses: Sequence[int], state: SamplingState,
           eos_token_ids: Sequence[int], q: Tensor | None = None,
           argmax: Callable[[Tensor], Tensor] = argmax_rows) -> list[tuple[int, TokenLogprobs]]:
    """The tokens one request emits from a verify step: the kept guesses, then the target's own.

    rows [k + 1, V]: the target's logits after the last real token and after each guess; guesses:
    the k tokens fed; q [k, V] or None: what the proposer drew them from. Returns 1 to k + 1
    (token, logprobs or None) pairs. The state is not changed: each position sees the history the
    target would have there (output so far + the guesses kept before it), so penalties, min_tokens
    and logits processors apply exactly as in plain decoding."""
    k = len(guesses)
    if rows.dim() != 2 or rows.shape[0] != k + 1:
        raise ValueError(f"rows must be [k + 1, V] = [{k + 1}, V] for {k} guesses, "
                         f"got {tuple(rows.shape)}")
    if is_plain_greedy(state):  # the argmax of every row at once; keep the agreeing prefix
        targets = argmax(rows).tolist()
        kept = next((i for i, g in enumerate(guesses) if targets[i] != g), k)
        return [(t, None) for t in targets[:kept + 1]]
    emitted, history = [], list(state.output_ids)
    for i in range(k + 1):
        here = SamplingState(state.params, state.generator, state.prompt_ids, history,
                             state.grammar)
        processed = processed_logits(rows[i], here, eos_token_ids)
        guess = guesses[i] if i < k else None
        token, kept = choose(processed, here, guess, None if q is None or i == k else q[i])
        emitted.append((token, top_logprobs(processed, token, state.params.logprobs)))
        history.append(token)
        if not kept:
            break
    return emitted

