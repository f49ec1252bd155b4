"""Prompt lookup ("ngram", vLLM's name): guess by copying from the text we already have.

Much of what a model writes repeats what it has read: a value looked up in a document, a name, a
JSON key, code being edited. So we take the last n tokens, find where they appeared before, and
guess that what followed them then follows them now:

    tokens   k7 = 3 9 ; k2 = 5 1 ; ... what is k2 ? k2 =         last n = 2 tokens: "k2 ="
                        ^^^^ ^ ^                                 earlier "k2 =" at position 5
    guess                      5 1 ; ...                         the k tokens after it

We try n from `max_n` down to `min_n` (a longer match is a better predictor) and take the LATEST
earlier occurrence of the suffix (the most recent context is the likeliest to be copied). No model
runs, so a wrong guess costs only the extra rows of the verify step.
"""

from __future__ import annotations

from engine.speculative.proposer import DraftRequest, Proposal


def ngram_guess(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The up-to-k tokens that followed the latest earlier occurrence of tokens' longest suffix of
    length in [min_n, max_n]; [] when no such suffix occurs earlier."""
    if k <= 0:
        return []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        # latest start i < len - n with tokens[i:i + n] == suffix (the suffix itself excluded)
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


class NgramProposer:
    """Guesses by prompt lookup; it keeps no state between steps."""

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {min_n} / {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [Proposal(ngram_guess(r.token_ids, r.num_draft_tokens, self.min_n, self.max_n))
                for r in requests]

    def forget(self, request_id: str) -> None:
        """Nothing to drop: every guess is made from the request's tokens alone."""
