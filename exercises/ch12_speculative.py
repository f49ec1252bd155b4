"""Chapter 12 exercises: speculative decoding by hand. The rule that keeps a guess, the
distribution we draw from after a rejection, greedy verification, how many tokens a step is
worth (and which k pays best), and taking back the KV slots of rejected guesses.

Replace each `raise NotImplementedError(...)` with your code, then run

    python -m exercises check ch12

A proposer guesses k tokens g1..gk; one target step scores all of them at once and gives us
k + 1 rows of logits: r0 after the last real token, r_i after guess g_i. We walk them in order
and stop at the first guess the target does not keep:

    guesses          g1     g2     g3                      k = 3
    target rows      r0     r1     r2     r3
    verdict          keep   keep   REJECT                  r3 is never read: it came after g3
    emitted          g1     g2     t                       t: the target's own token from r2

    every guess kept: g1 g2 g3 and the BONUS token from r3 (k + 1 tokens from one step)

Greedy keeps a guess when it is the argmax of its row. Sampling keeps a guess g, drawn from the
proposer's distribution q where the target wants p, with probability min(1, p(g) / q(g)); after
a rejection it draws from the residual max(0, p - q), normalized. Together every emitted token is
distributed exactly as p, whatever q was (the notebook shows the algebra and a histogram).

The engine's versions: `accepts`, `residual` and `verify` in engine/speculative/rejection.py,
`BlockManager.rollback` in engine/kv/block_manager.py. Try not to peek until the checks pass.
"""

from __future__ import annotations

import math  # noqa: F401 (yours to use)
from collections.abc import Mapping, MutableMapping, Sequence

import torch  # noqa: F401 (yours to use)
from torch import Tensor

# ---- part 1: the rejection rule and the residual -------------------------------------------------


def accept_guess(p_guess: float, q_guess: float, u: float) -> bool:
    """Do we keep a guess that the target gives probability p_guess and the proposer q_guess
    (> 0: the guess was drawn from q)? `u` is a uniform draw in [0, 1): the answer must be True
    with probability min(1, p_guess / q_guess) over u, and never True when p_guess is 0.

    accept_guess(0.2, 0.5, 0.3) is True, accept_guess(0.2, 0.5, 0.5) is False (0.2 / 0.5 = 0.4).
    """
    raise NotImplementedError(
        "a fraction min(1, p/q) of the values u in [0, 1) must say keep: which ones? What must "
        "happen to a guess the target would never produce, even when u is 0?")


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """The distribution to draw from after a rejection: max(0, p - q), normalized to sum to 1.
    [V], [V] -> [V]; p and q are left as they were.

    p = [0.5, 0.3, 0.1, 0.1], q = [0.1, 0.1, 0.4, 0.4]  ->  [2/3, 1/3, 0, 0].
    A ValueError naming p and q when max(0, p - q) is all zero (p == q: no rejection can happen).
    """
    raise NotImplementedError(
        "where does the target want MORE than the proposer offered? What do you do with the "
        "tokens where it wants less, and what must a distribution sum to?")


# ---- part 2: greedy verification and what a step is worth ----------------------------------------


def greedy_verify(target_argmax: Sequence[int], guesses: Sequence[int]) -> list[int]:
    """The tokens one greedy verify step emits: target_argmax[i] is the argmax of row r_i
    (k + 1 of them), guesses the k tokens fed. The agreeing prefix of the guesses, then the
    target's own token: at the first disagreement, or the bonus token when every guess is kept.

    greedy_verify([5, 7, 9, 2], [5, 7, 3]) == [5, 7, 9];  greedy_verify([5, 7, 9, 2], [5, 7, 9])
    == [5, 7, 9, 2]. A ValueError naming target_argmax unless it holds len(guesses) + 1 tokens.
    """
    raise NotImplementedError(
        "which row does the first disagreeing guess's replacement come from, and which row is "
        "left over when every guess agrees? Should a guess after a disagreement count?")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """The mean number of tokens a verify step of k guesses emits, when each guess is kept with
    probability alpha (independently): (1 - alpha^(k + 1)) / (1 - alpha), and k + 1 at alpha = 1.

    expected_tokens_per_step(0.5, 2) == 1.75; a ValueError naming alpha unless 0 <= alpha <= 1,
    and one naming k unless k is an integer >= 0.
    """
    raise NotImplementedError(
        "position i of the step emits a token only if the i guesses before it were all kept: how "
        "likely is that, and how many positions are there? What does the formula do at alpha = 1?")


def best_k(alpha: float, cost_of_k: Mapping[int, float]) -> int:
    """The k that gives the most tokens per second: cost_of_k maps each k we measured to the
    seconds one verify step of k guesses takes (k = 0: a plain decode step). On a tie, the
    smaller k (it wastes less compute). A ValueError naming cost_of_k when it is empty or holds
    a cost that is not > 0.
    """
    raise NotImplementedError(
        "a step of k guesses yields how many tokens on average, and takes how long? Which ratio "
        "of the two do we want to be largest?")


# ---- part 3: rolling back a block table ----------------------------------------------------------


def rollback_block_table(table: Sequence[int], refcounts: MutableMapping[int, int],
                         num_tokens: int, n: int,
                         block_size: int) -> tuple[list[int], list[int]]:
    """Take back the last n of a sequence's num_tokens KV slots (its rejected guesses).

    table: the sequence's physical blocks (ceil(num_tokens / BS) of them; left as it was);
    refcounts: block -> how many block tables hold it (the allocator's count, updated here: every
    block that leaves our table loses our reference, and stays in refcounts at 0 once nobody holds
    it). Returns (the new table, the blocks that nobody holds any more, in table order). With
    BS = 4, 10 tokens, table [7, 2, 5], n = 5:

        positions   0 1 2 3 | 4 5 6 7 | 8 9
        kept        a b c d | e . . . | . .        new table [7, 2]: block 2 keeps token e
                    block 7   block 2   block 5    block 5 holds no token: it leaves the table,
                                                   and is freed if nobody else holds it

    A ValueError naming n unless 0 <= n <= num_tokens.
    """
    raise NotImplementedError(
        "how many blocks does a sequence of num_tokens - n tokens need, and what if the last one "
        "is only partly filled? When is a block that leaves the table really free?")
