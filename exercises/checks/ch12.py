"""Checks for chapter 12: the rejection rule, the residual, greedy verification, the expected
tokens per step and the k that pays best, and rolling back a block table.

Each `check_<claim>(mod)` runs against the student's `exercises/ch12_speculative.py` or the
reference in `exercises/solutions/`. The oracles are cases worked by hand in the comments, a
seeded simulation of speculative sampling tested against the target distribution (chi-square),
a plain greedy loop, and the engine itself: `accepts`, `residual` and `verify` in
engine/speculative/rejection.py, `BlockManager.rollback` in engine/kv/block_manager.py.
"""

from __future__ import annotations

import math
import random

import torch

from engine.kv.block_manager import BlockManager
from engine.sampling import SamplingParams, SamplingState
from engine.speculative.rejection import accepts as engine_accepts
from engine.speculative.rejection import residual as engine_residual
from engine.speculative.rejection import verify as engine_verify
from exercises.checks import raises_naming

SEED = 12  # chapter 12: any fixed seed makes every random check the same on every run
TRIALS = 200
ATOL = 1e-9  # sums and quotients of a few float probabilities
U_GRID = 1000  # u = i / 1000: the fraction of the grid that says keep is min(1, p/q) to 1/1000
# The lossless claim, tested as the chapter does: 10,000 seeded draws of speculative sampling
# against the target p. With 6 tokens (5 degrees of freedom) the chi-square statistic stays
# below 15.086 in 99% of runs of a correct rule (the 0.01 critical value of a chi-square table);
# the seed is fixed, so the check gives the same answer on every run.
NUM_DRAWS = 10_000
CHI2_CRITICAL_5_DOF = 15.086
TARGET_P = [0.35, 0.25, 0.15, 0.12, 0.08, 0.05]  # what the target wants
PROPOSER_Q = [0.10, 0.30, 0.30, 0.05, 0.20, 0.05]  # what the proposer draws guesses from
VOCAB = 11  # the toy greedy model's vocabulary


def _close(got, want, what: str) -> None:
    assert isinstance(got, int | float) and not isinstance(got, bool), (
        f"{what}: expected a number, got {type(got).__name__}")
    assert abs(got - want) <= ATOL, f"{what}: got {got!r}, expected {want!r}"


def _distribution(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _random_distribution(rng: random.Random, vocab: int, zeros: int = 0) -> torch.Tensor:
    """A random distribution over `vocab` tokens, `zeros` of them ruled out."""
    weights = [rng.expovariate(1.0) for _ in range(vocab)]
    for i in rng.sample(range(vocab), zeros):
        weights[i] = 0.0
    p = _distribution(weights)
    return p / p.sum()


# ---- the rejection rule --------------------------------------------------------------------------


def _keep_fraction(mod, p: float, q: float) -> float:
    """The fraction of u = 0, 1/1000, ..., 999/1000 for which accept_guess keeps the guess."""
    kept = [mod.accept_guess(p, q, i / U_GRID) for i in range(U_GRID)]
    assert all(isinstance(k, bool) for k in kept), (
        f"accept_guess({p}, {q}, u) must return a bool, got {type(kept[0]).__name__}")
    return sum(kept) / U_GRID


def check_accept_guess_keeps_with_probability_min_1_p_over_q(mod) -> None:
    # p < q: keep for u < p / q only; p >= q: always keep (the target wants it at least as much)
    for p, q in [(0.2, 0.5), (0.1, 0.4), (0.3, 0.6), (0.05, 0.5), (0.5, 0.5), (0.6, 0.2),
                 (0.9, 0.01)]:
        got, want = _keep_fraction(mod, p, q), min(1.0, p / q)
        assert abs(got - want) <= 1.5 / U_GRID, (
            f"accept_guess(p={p}, q={q}, u) keeps the guess for a fraction {got:.3f} of u in "
            f"[0, 1), expected min(1, p/q) = {want:.3f}: a guess is kept with a random draw, "
            "not by comparing p with q")


def check_accept_guess_never_keeps_a_token_the_target_rules_out(mod) -> None:
    for q in (0.5, 1.0, 1e-6):
        for u in (0.0, 0.25, 0.999):
            assert mod.accept_guess(0.0, q, u) is False, (
                f"accept_guess(p=0.0, q={q}, u={u}) kept a token the target gives probability 0: "
                "it could then be emitted, which plain sampling never does")
    assert mod.accept_guess(1e-9, 0.5, 0.0) is True, (
        "accept_guess(p=1e-9, q=0.5, u=0.0) must keep the guess: u = 0 is below any p/q > 0")


def check_accept_guess_matches_the_engine(mod) -> None:
    rng = random.Random(SEED)
    for _ in range(TRIALS):
        p, q, u = rng.random(), rng.uniform(1e-3, 1.0), rng.random()
        want = engine_accepts(p, q, u)
        assert mod.accept_guess(p, q, u) == want, (
            f"accept_guess({p:.4f}, {q:.4f}, {u:.4f}) gave {not want}, the engine's accepts "
            f"{want}")


# ---- the residual --------------------------------------------------------------------------------


def check_residual_is_max_0_p_minus_q_normalized(mod) -> None:
    # p - q = [0.4, 0.2, -0.3, -0.3]; max(0, .) = [0.4, 0.2, 0, 0], sum 0.6 -> [2/3, 1/3, 0, 0]
    p, q = _distribution([0.5, 0.3, 0.1, 0.1]), _distribution([0.1, 0.1, 0.4, 0.4])
    p_before, q_before = p.clone(), q.clone()
    got = mod.residual_distribution(p, q)
    assert torch.equal(p, p_before) and torch.equal(q, q_before), (
        "residual_distribution changed p or q in place: the caller still needs them")
    assert isinstance(got, torch.Tensor) and got.shape == p.shape, (
        f"residual_distribution must return a [V] tensor like p, got {got!r}")
    assert bool((got >= 0).all()), (
        f"residual_distribution gave {got.tolist()}: a probability cannot be negative (clamp "
        "p - q at 0)")
    total = float(got.sum())
    assert abs(total - 1.0) <= 1e-6, (
        f"residual_distribution gave {got.tolist()}, which sums to {total:.4f}: normalize "
        "max(0, p - q) so it sums to 1")
    want = [2 / 3, 1 / 3, 0.0, 0.0]
    assert torch.allclose(got, _distribution(want).to(got.dtype), atol=1e-6), (
        f"residual_distribution(p={p.tolist()}, q={q.tolist()}) = {got.tolist()}, expected "
        f"{want}")


def check_residual_of_a_deterministic_guess_is_p_without_it(mod) -> None:
    # prompt lookup or a greedy draft guesses token 1 for sure: q is one-hot. On a rejection we
    # draw from p with the guess taken out: [0.2, 0, 0.3] / 0.5
    p, q = _distribution([0.2, 0.5, 0.3]), _distribution([0.0, 1.0, 0.0])
    got = mod.residual_distribution(p, q)
    want = [0.4, 0.0, 0.6]
    assert torch.allclose(got, _distribution(want).to(got.dtype), atol=1e-6), (
        f"residual_distribution(p={p.tolist()}, q=one-hot(1)) = {got.tolist()}, expected {want}")


def check_residual_refuses_p_equal_to_q(mod) -> None:
    p = _distribution([0.25, 0.5, 0.25])
    raises_naming("p", lambda: mod.residual_distribution(p, p.clone()),
                  "residual_distribution(p, q) with p == q (all zero: no rejection can happen, "
                  "and 0 / 0 gives nan)")


def check_residual_matches_the_engine(mod) -> None:
    rng = random.Random(SEED + 1)
    for _ in range(TRIALS):
        vocab = rng.randint(2, 12)
        p = _random_distribution(rng, vocab, zeros=rng.randint(0, vocab - 2))
        q = _random_distribution(rng, vocab, zeros=rng.randint(0, vocab - 2))
        if float((p - q).clamp(min=0).sum()) <= 1e-9:
            continue
        got, want = mod.residual_distribution(p, q), engine_residual(p, q)
        assert torch.allclose(got.to(want.dtype), want, atol=1e-9), (
            f"residual_distribution(p={p.tolist()}, q={q.tolist()}) = {got.tolist()}, the "
            f"engine's residual {want.tolist()}")


# ---- the two together: speculative sampling is exact ---------------------------------------------


def _draw(cumulative: list[float], u: float) -> int:
    """Inverse-CDF sampling, as a sampler reads a distribution: the first token whose running
    total passes u (the last token if rounding leaves u past the end)."""
    return next((i for i, c in enumerate(cumulative) if u < c), len(cumulative) - 1)


def check_speculative_sampling_draws_exactly_the_target_distribution(mod) -> None:
    rng = random.Random(SEED + 2)
    p, q = _distribution(TARGET_P), _distribution(PROPOSER_Q)
    residual = mod.residual_distribution(p, q).tolist()
    cumulative = [sum(residual[:i + 1]) for i in range(len(residual))]
    counts = [0] * len(TARGET_P)
    for _ in range(NUM_DRAWS):
        guess = rng.choices(range(len(PROPOSER_Q)), weights=PROPOSER_Q)[0]  # the proposer's draw
        if mod.accept_guess(TARGET_P[guess], PROPOSER_Q[guess], rng.random()):
            counts[guess] += 1
        else:
            counts[_draw(cumulative, rng.random())] += 1
    expected = [NUM_DRAWS * x for x in TARGET_P]
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expected, strict=True))
    assert chi2 < CHI2_CRITICAL_5_DOF, (
        f"{NUM_DRAWS} draws of speculative sampling (guess from q, keep with accept_guess, else "
        f"draw from residual_distribution) gave counts {counts}, where the target p expects "
        f"{[round(e) for e in expected]}: chi-square {chi2:.1f} >= {CHI2_CRITICAL_5_DOF}, so "
        "the emitted tokens are not distributed as p")


# ---- greedy verification -------------------------------------------------------------------------


def _verify_case(mod, target_argmax, guesses, want, why: str) -> None:
    got = mod.greedy_verify(list(target_argmax), list(guesses))
    assert got == want, (
        f"greedy_verify(target_argmax={target_argmax}, guesses={guesses}) = {got}, expected "
        f"{want}: {why}")


def check_greedy_verify_keeps_the_agreeing_prefix_then_the_targets_token(mod) -> None:
    _verify_case(mod, [5, 7, 9, 2], [5, 7, 3], [5, 7, 9],
                 "g1, g2 agree; g3 = 3 is not row 2's argmax 9, so 9 is emitted and the step ends")
    _verify_case(mod, [5, 7, 9, 2], [4, 7, 9], [5],
                 "g1 = 4 disagrees with row 0: the target's 5, and g2, g3 (fed after a wrong "
                 "token) do not count, even though they agree")
    _verify_case(mod, [1, 2, 3, 4, 5], [1, 9, 3, 4], [1, 2],
                 "the first disagreement ends the step; later agreements do not count")


def check_greedy_verify_adds_the_bonus_token_when_every_guess_is_kept(mod) -> None:
    _verify_case(mod, [5, 7, 9, 2], [5, 7, 9], [5, 7, 9, 2],
                 "every guess agrees: the last row's argmax 2 is a free bonus token (k + 1 tokens)")
    _verify_case(mod, [6], [], [6], "no guesses: a plain decode step, one token")
    _verify_case(mod, [3, 3], [3], [3, 3], "one guess kept, then the bonus")


def _toy_next(history: list[int]) -> int:
    """A deterministic toy 'model': the greedy next token of a history."""
    return (sum(history) * 7 + len(history) * 3 + history[-1]) % VOCAB


def check_greedy_verify_equals_plain_greedy_decoding(mod) -> None:
    rng = random.Random(SEED + 3)
    for _ in range(20):
        prompt, num_new = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))], 40
        plain = list(prompt)
        while len(plain) < len(prompt) + num_new:
            plain.append(_toy_next(plain))
        history = list(prompt)
        for _step in range(num_new):
            k, truth, guesses = rng.randint(0, 5), list(history), []
            for _ in range(k):  # guesses that are right most of the time, as a good proposer's
                right = _toy_next(truth + guesses)
                guesses.append(right if rng.random() < 0.7 else (right + 1) % VOCAB)
            targets = [_toy_next(history + guesses[:i]) for i in range(k + 1)]
            emitted = mod.greedy_verify(targets, guesses)
            assert 1 <= len(emitted) <= k + 1, (
                f"greedy_verify({targets}, {guesses}) emitted {len(emitted)} tokens: a verify "
                f"step of {k} guesses emits 1 to {k + 1}")
            history += emitted
            if len(history) >= len(plain):
                break
        n = len(plain)
        assert history[:n] == plain, (
            f"speculative greedy decoding from prompt {prompt} gave {history[len(prompt):n]}, "
            f"plain greedy decoding {plain[len(prompt):]}: greedy verification must be lossless")


def check_greedy_verify_matches_the_engine(mod) -> None:
    rng = random.Random(SEED + 4)
    state = SamplingState(SamplingParams(temperature=0.0))
    for _ in range(TRIALS):
        k = rng.randint(0, 6)
        targets = [rng.randrange(4) for _ in range(k + 1)]
        guesses = [t if rng.random() < 0.6 else rng.randrange(4) for t in targets[:k]]
        rows = torch.nn.functional.one_hot(torch.tensor(targets), 4).float()  # [k + 1, V]
        want = [token for token, _ in engine_verify(rows, guesses, state, eos_token_ids=[])]
        _verify_case(mod, targets, guesses, want, "the engine's verify emits that")


def check_greedy_verify_refuses_a_target_row_count_other_than_k_plus_1(mod) -> None:
    raises_naming("target_argmax", lambda: mod.greedy_verify([5, 7], [5, 7, 9]),
                  "greedy_verify([5, 7], [5, 7, 9]) (3 guesses need 4 rows)")
    raises_naming("target_argmax", lambda: mod.greedy_verify([5, 7, 9], [5]),
                  "greedy_verify([5, 7, 9], [5]) (1 guess needs 2 rows)")


# ---- what a step is worth ------------------------------------------------------------------------


def check_expected_tokens_per_step_by_hand(mod) -> None:
    cases = [(0.5, 2, 1.75),  # 1 + 0.5 + 0.25
             (0.8, 4, 3.3616),  # (1 - 0.8^5) / 0.2 = 0.67232 / 0.2
             (0.0, 5, 1.0),  # every guess rejected: still the target's own token
             (0.9, 0, 1.0),  # no guesses: one plain token
             (0.6, 1, 1.6)]  # the guess (kept 60%) and then always one more
    for alpha, k, want in cases:
        _close(mod.expected_tokens_per_step(alpha, k), want,
               f"expected_tokens_per_step(alpha={alpha}, k={k})")


def check_expected_tokens_per_step_is_k_plus_1_when_every_guess_is_kept(mod) -> None:
    for k in (0, 1, 4, 7):
        _close(mod.expected_tokens_per_step(1.0, k), k + 1,
               f"expected_tokens_per_step(alpha=1.0, k={k}) (the formula is 0 / 0 there: every "
               "guess is kept, then the bonus)")
    got = mod.expected_tokens_per_step(1.0 - 1e-9, 4)
    assert abs(got - 5.0) <= 1e-6, (
        f"expected_tokens_per_step(1 - 1e-9, 4) = {got!r}: it must approach k + 1 = 5 as alpha "
        "goes to 1")


def check_expected_tokens_per_step_sums_the_chance_of_reaching_each_position(mod) -> None:
    # position i emits a token when the i guesses before it were all kept: chance alpha^i
    rng = random.Random(SEED + 5)
    for _ in range(TRIALS):
        alpha, k = rng.random(), rng.randint(0, 12)
        _close(mod.expected_tokens_per_step(alpha, k), sum(alpha ** i for i in range(k + 1)),
               f"expected_tokens_per_step(alpha={alpha:.4f}, k={k})")


def check_expected_tokens_per_step_refuses_alpha_outside_0_to_1(mod) -> None:
    for alpha in (-0.1, 1.5, math.nan):
        raises_naming("alpha", lambda a=alpha: mod.expected_tokens_per_step(a, 3),
                      f"expected_tokens_per_step(alpha={alpha}, k=3)")
    for k in (-1, 2.5):
        raises_naming("k", lambda k=k: mod.expected_tokens_per_step(0.5, k),
                      f"expected_tokens_per_step(alpha=0.5, k={k})")


# measured seconds per verify step of k guesses on a bandwidth-bound machine: more guesses cost
# little until the step turns compute-bound
STEP_COST_S = {0: 1.00, 1: 1.05, 2: 1.10, 4: 1.20, 8: 1.60}


def check_best_k_weighs_tokens_against_the_cost(mod) -> None:
    # tokens / cost at alpha 0.8: 1.00, 1.71, 2.22, 2.80 (k = 4), 2.71 (k = 8: more tokens, slower)
    # at alpha 0.3: 1.00, 1.24, 1.26 (k = 2), 1.19, 0.89; at alpha 0: 1 token whatever k costs
    for alpha, want in ((0.8, 4), (0.3, 2), (0.0, 0), (1.0, 8)):
        got = mod.best_k(alpha, dict(STEP_COST_S))
        assert got == want, (
            f"best_k(alpha={alpha}, cost_of_k={STEP_COST_S}) = {got!r}, expected {want}: the k "
            "with the most expected tokens per second of step")


def check_best_k_takes_the_smallest_k_on_a_tie(mod) -> None:
    flat = {2: 1.0, 0: 1.0, 1: 1.0}  # alpha 0: one token a step whatever k, all at the same cost
    assert mod.best_k(0.0, flat) == 0, (
        f"best_k(0.0, {flat}) = {mod.best_k(0.0, flat)!r}: every k gives 1 token a second, so "
        "the smallest k, 0, which wastes no compute")
    # alpha 0.5: k = 1 gives 1.5 tokens in 1.5 s, k = 0 gives 1 token in 1 s: a tie
    tie = {1: 1.5, 0: 1.0}
    assert mod.best_k(0.5, tie) == 0, f"best_k(0.5, {tie}) = {mod.best_k(0.5, tie)!r}, expected 0"


def check_best_k_refuses_no_costs_and_costs_that_are_not_positive(mod) -> None:
    for costs in ({}, {0: 1.0, 2: 0.0}, {1: -1.0}):
        raises_naming("cost_of_k", lambda c=costs: mod.best_k(0.5, c), f"best_k(0.5, {costs})")


# ---- rolling back a block table ------------------------------------------------------------------

BS = 4  # the worked examples' block size: table [7, 2, 5] holds 10 tokens (4 + 4 + 2)


def _rollback(mod, table, refcounts, num_tokens, n, block_size=BS):
    counts = dict(refcounts)
    new_table, freed = mod.rollback_block_table(list(table), counts, num_tokens, n, block_size)
    return list(new_table), list(freed), counts


def _rollback_case(mod, refcounts, n, want_table, want_freed, want_counts, why) -> None:
    got = _rollback(mod, [7, 2, 5], refcounts, 10, n)
    call = f"rollback_block_table([7, 2, 5], {refcounts}, num_tokens=10, n={n}, block_size=4)"
    assert got[0] == want_table, f"{call}: table {got[0]}, expected {want_table}: {why}"
    assert got[1] == want_freed, f"{call}: freed {got[1]}, expected {want_freed}: {why}"
    assert got[2] == want_counts, f"{call}: refcounts {got[2]}, expected {want_counts}: {why}"


ALONE = {7: 1, 2: 1, 5: 1}  # the sequence holds its blocks alone


def check_rollback_frees_the_blocks_left_without_a_token(mod) -> None:
    _rollback_case(mod, ALONE, 5, [7, 2], [5], {7: 1, 2: 1, 5: 0},
                   "5 tokens stay: block 7 full, block 2 holds 1, block 5 none")
    _rollback_case(mod, ALONE, 10, [], [7, 2, 5], {7: 0, 2: 0, 5: 0}, "no token stays")
    _rollback_case(mod, ALONE, 0, [7, 2, 5], [], ALONE, "n = 0 takes nothing back")


def check_rollback_keeps_a_partly_filled_last_block(mod) -> None:
    _rollback_case(mod, ALONE, 1, [7, 2, 5], [], ALONE,
                   "9 tokens stay: block 5 still holds token 8")
    _rollback_case(mod, ALONE, 3, [7, 2], [5], {7: 1, 2: 1, 5: 0},
                   "7 tokens stay: block 2 holds 3 of them, so it stays; block 5 goes")


def check_rollback_to_a_block_boundary_keeps_no_empty_block(mod) -> None:
    _rollback_case(mod, ALONE, 2, [7, 2], [5], {7: 1, 2: 1, 5: 0},
                   "8 tokens stay, exactly 2 full blocks: block 5 is left empty and must go")
    _rollback_case(mod, ALONE, 6, [7], [2, 5], {7: 1, 2: 0, 5: 0},
                   "4 tokens stay, exactly block 7: blocks 2 and 5 are left empty")


def check_rollback_never_frees_a_block_still_shared(mod) -> None:
    forked = {7: 2, 2: 2, 5: 2}  # a fork (n > 1, or a prefix-cache hit) holds every block too
    _rollback_case(mod, forked, 6, [7], [], {7: 2, 2: 1, 5: 1},
                   "blocks 2 and 5 leave our table, but the fork still holds them: our reference "
                   "goes, the blocks stay")
    copied = {7: 2, 2: 2, 5: 1}  # the fork copied the partly filled last block on its first write
    _rollback_case(mod, copied, 6, [7], [5], {7: 2, 2: 1, 5: 0},
                   "block 5 is ours alone and goes free; block 2 is still the fork's")


def check_rollback_leaves_the_callers_table_alone(mod) -> None:
    table, counts = [7, 2, 5], dict(ALONE)
    new_table, _ = mod.rollback_block_table(table, counts, 10, 5, BS)
    assert table == [7, 2, 5], (
        f"rollback_block_table changed the caller's table to {table}: return a new one")
    assert list(new_table) == [7, 2], f"the new table is {new_table}, expected [7, 2]"


def check_rollback_matches_the_engine_on_random_forks(mod) -> None:
    rng = random.Random(SEED + 6)
    for _ in range(TRIALS):
        bs, num_blocks = rng.choice([1, 2, 4, 16]), 64
        manager = BlockManager(num_blocks, bs)
        num_tokens = rng.randint(0, 6 * bs)
        manager.allocate(0, num_tokens)
        if rng.random() < 0.6:  # a fork that may grow on its own (copy-on-write, new blocks)
            manager.fork(0, 1)
            manager.append_slots(1, rng.randint(0, 2 * bs))
        table = manager.block_table(0)
        counts = {b: manager.allocator.refcount(b) for b in range(num_blocks)}
        n = rng.randint(0, num_tokens)
        got_table, got_freed, got_counts = _rollback(mod, table, counts, num_tokens, n, bs)
        want_freed = manager.rollback(0, n)
        want_counts = {b: manager.allocator.refcount(b) for b in range(num_blocks)}
        call = (f"rollback_block_table({table}, ..., num_tokens={num_tokens}, n={n}, "
                f"block_size={bs})")
        assert got_table == manager.block_table(0), (
            f"{call}: table {got_table}, the engine's {manager.block_table(0)}")
        assert got_freed == want_freed, f"{call}: freed {got_freed}, the engine's {want_freed}"
        changed = {b: (got_counts[b], want_counts[b]) for b in want_counts
                   if got_counts.get(b) != want_counts[b]}
        assert not changed, f"{call}: refcounts (yours, the engine's) differ at {changed}"


def check_rollback_refuses_n_outside_0_to_num_tokens(mod) -> None:
    for n in (-1, 11):
        raises_naming("n", lambda n=n: _rollback(mod, [7, 2, 5], ALONE, 10, n),
                      f"rollback_block_table([7, 2, 5], ..., num_tokens=10, n={n})")
