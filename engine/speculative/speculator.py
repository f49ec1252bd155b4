"""The engine's side of speculative decoding, before each step: who guesses, how many, and when not.

    running requests ──► decoding ones ──► k per request (the busy-step rules) ──► Proposer.propose
                                                                                      │
    Request.draft_token_ids / draft_probs  ◄── checked guesses (vocabulary, count, shape)

The scheduler then budgets 1 + len(guesses) tokens for each (engine/scheduler.py), the runner feeds
them as decode rows (engine/runner.py), and the engine verifies them and rolls back the rejected
(engine/llm_engine.py's `_accept`, engine/speculative/rejection.py).
"""

from __future__ import annotations

import warnings

from engine.config import SpeculativeConfig
from engine.request import Request, validate_token_ids
from engine.speculative.proposer import DraftRequest, Proposal, Proposer


class Speculator:
    """Attaches this step's guesses to the running requests (or none, and says why)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, vocab_size: int):
        self.config, self.proposer, self.vocab_size = config, proposer, vocab_size

    def propose(self, running: list[Request], events: list[dict]) -> None:
        """Guesses for every running request whose next step is a decode.

        None at all when the step is too busy to gain (`guesses_per_request`), recorded as a
        "speculation_off" event. A proposer that raises costs its guesses, not the step: the error
        is recorded as a "speculation_error" event and the step decodes plainly."""
        for req in running:
            req.draft_token_ids, req.draft_probs = [], None
        decoding = [r for r in running if r.is_decoding]
        if not decoding:
            return
        k, why_off = self.guesses_per_request(len(decoding))
        if why_off:
            events.append({"type": "speculation_off", "reason": why_off})
            return
        asks = [(r, DraftRequest(r.request_id, r.all_token_ids, r.params, draft_room(r, k),
                                 len(r.prompt_token_ids))) for r in decoding]
        asks = [(r, a) for r, a in asks if a.num_draft_tokens > 0]
        try:
            proposals = self.proposer.propose([a for _, a in asks]) if asks else []
            for (req, ask), proposal in zip(asks, proposals, strict=True):
                req.draft_token_ids = self.checked_guesses(proposal, ask)
                req.draft_probs = proposal.probs
        except Exception as exc:  # noqa: BLE001 - a proposer's bug must not stop the serving
            for req in running:
                req.draft_token_ids, req.draft_probs = [], None
            events.append({"type": "speculation_error", "error": f"{type(exc).__name__}: {exc}"})
            warnings.warn(f"the {self.proposer.name} proposer failed ({exc}); this step decodes "
                          "without guesses", stacklevel=4)

    def guesses_per_request(self, num_decoding: int) -> tuple[int, str | None]:
        """(guesses per request this step, or why none): k, cut so that the step feeds at most
        max_verify_rows rows; none at all from disable_by_batch_size decodes on."""
        spec = self.config
        limit, rows = spec.disable_by_batch_size, spec.max_verify_rows
        if limit is not None and num_decoding >= limit:
            return 0, f"{num_decoding} decoding requests >= disable_by_batch_size={limit}"
        k = spec.num_speculative_tokens
        if rows is not None:
            k = min(k, rows // num_decoding - 1)
            if k < 1:
                return 0, (f"{num_decoding} decoding requests leave no room for a guess in "
                           f"max_verify_rows={rows}")
        return k, None

    def checked_guesses(self, proposal: Proposal, ask: DraftRequest) -> list[int]:
        """A proposal's token ids, checked: at most the guesses asked for, each in the vocabulary,
        and a `probs` of one row per guess when given."""
        where = f"the {self.proposer.name} proposer's guesses for request {ask.request_id!r}"
        guesses = validate_token_ids(proposal.token_ids, self.vocab_size, where, allow_empty=True)
        if len(guesses) > ask.num_draft_tokens:
            raise ValueError(f"{where}: {len(guesses)} guesses, at most "
                             f"{ask.num_draft_tokens} were asked for")
        probs = proposal.probs
        if probs is not None and tuple(probs.shape) != (len(guesses), self.vocab_size):
            raise ValueError(f"{where}: probs must be [{len(guesses)}, {self.vocab_size}], "
                             f"got {tuple(probs.shape)}")
        return guesses

    def forget(self, req: Request) -> None:
        """req is done (finished, aborted, failed): its proposer state can go."""
        self.proposer.forget(req.request_id)


def draft_room(req: Request, k: int) -> int:
    """Guesses worth making for req: k, but never past max_tokens (a verify step emits up to
    len(guesses) + 1 tokens), which also keeps every fed position inside the context."""
    left = req.params.max_tokens - len(req.output_token_ids)
    return max(0, min(k, left - 1))
