"""What a proposer is: it sees each decoding request's tokens and guesses the next few.

The engine asks once per step, before scheduling, for every running request whose next step is a
decode. A proposer keeps whatever state it likes per request (a draft model keeps a KV cache), but
must never assume its last guesses were accepted: it is shown the request's true tokens every time
and catches up from them (`DraftRequest.token_ids` only ever grows by accepted guesses and the
target's own tokens). `engine/speculative/registry.py` builds the proposer a config names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from engine.sampling import SamplingParams


@dataclass
class DraftRequest:
    """One request as a proposer sees it."""

    request_id: str  # unique per sequence (a sample of n > 1 is "<id>#i")
    token_ids: list[int]  # prompt + output so far; the last one is what the target feeds next
    params: SamplingParams
    num_draft_tokens: int  # guess at most this many (k, or fewer near max_tokens / the context)
    # where the prompt ends in token_ids (penalties and min_tokens count the output only); None:
    # unknown, treat every known token as prompt
    num_prompt_tokens: int | None = None


@dataclass
class Proposal:
    """A proposer's guesses for one request: at most `num_draft_tokens` of them, maybe none."""

    token_ids: list[int]
    # [len(token_ids), V]: the distribution each guess was DRAWN from, when the proposer sampled
    # it; None: chosen deterministically (a lookup, a greedy draft), i.e. q is one-hot
    probs: Tensor | None = None


class Proposer(Protocol):
    """Anything that guesses tokens for the target to verify (one file per kind in this package)."""

    name: str  # recorded in the trace's config

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """One Proposal per request, in order."""

    def forget(self, request_id: str) -> None:
        """The request finished, was aborted, or was preempted by recompute: drop its state."""

