"""Checks for chapter 01: the sampling filters and the naive generation loop.

Each `check_<claim>(mod)` runs against the student's `exercises/ch01_sampling.py` or the reference
in `exercises/solutions/`, and raises with a message saying what went wrong. The filters are
compared with engine/sampling.py on random logits (several seeds, one row and a batch, and integer
logits full of ties) and on hand-made cases whose answers are worked out in the comments. The
filters have the engine's names and signatures, so these checks also run against engine/sampling.py
itself.
"""

from __future__ import annotations

import torch

from engine import sampling as engine

SEEDS = (0, 1, 2)
VOCAB = 11  # small, and different from BATCH so that a mixed-up dim shows as a shape error
BATCH = 3
LOGIT_SCALE = 3.0  # spreads random logits so the filters have real work to do
ATOL = 1e-6  # float32 softmax over a few logits; room for a different, correct order of operations
# a logit below this counts as dropped: we accept -inf or a huge negative number
DROPPED_BELOW = -1e4
PROBS = [0.4, 0.3, 0.2, 0.1]  # the hand-made distribution of the edge cases
TIED_LOGITS = (-2, 3)  # integer logits in [-2, 3): six values over 11 tokens, so every row has ties


# ---- helpers (no `check_` prefix, so they are not checks) ----------------------------------------


def _random_logits(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * LOGIT_SCALE


def _random_inputs():
    """(description, logits) pairs: one row [V] and a batch [B, V] per seed, and a batch of integer
    logits in which many tokens tie (where a filter that decides by sort position goes wrong)."""
    for seed in SEEDS:
        yield f"seed {seed}, shape ({VOCAB},)", _random_logits(seed, (VOCAB,))
        yield f"seed {seed}, shape ({BATCH}, {VOCAB})", _random_logits(seed, (BATCH, VOCAB))
        generator = torch.Generator().manual_seed(seed)
        tied = torch.randint(*TIED_LOGITS, (BATCH, VOCAB), generator=generator).float()
        yield f"seed {seed}, integer logits with ties, shape ({BATCH}, {VOCAB})", tied


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()  # softmax(log p) = p


def _ids(mask: torch.Tensor) -> list[int]:
    return torch.nonzero(mask).flatten().tolist()


def _call(fn, logits: torch.Tensor, arg, call: str) -> torch.Tensor:
    """Call a filter and check it left its input alone."""
    before = logits.clone()
    out = fn(logits, arg)
    assert torch.equal(logits, before), (
        f"{call} modified its input in place; return a new tensor instead")
    assert isinstance(out, torch.Tensor), (
        f"{call} returned {type(out).__name__}, expected a torch.Tensor")
    assert out.shape == logits.shape, (
        f"{call} returned shape {tuple(out.shape)}, expected {tuple(logits.shape)}")
    return out


def _assert_same_distribution(got: torch.Tensor, want: torch.Tensor, call: str) -> None:
    """Same kept tokens in every row, and the same renormalized probabilities."""
    kept_got = (got > DROPPED_BELOW).reshape(-1, got.shape[-1])
    kept_want = (want > DROPPED_BELOW).reshape(-1, want.shape[-1])
    for row, (g, w) in enumerate(zip(kept_got, kept_want, strict=True)):
        assert torch.equal(g, w), f"{call}: row {row} kept tokens {_ids(g)}, expected {_ids(w)}"
    p_got, p_want = torch.softmax(got.float(), -1), torch.softmax(want.float(), -1)
    worst = (p_got - p_want).abs().max().item()
    assert worst <= ATOL, f"{call}: probabilities after softmax differ by up to {worst:.2e}"


def _assert_keeps(fn, probs_or_logits, arg, expected: list[int], call: str, why: str = "") -> None:
    logits = (probs_or_logits if isinstance(probs_or_logits, torch.Tensor)
              else _logits_of(probs_or_logits))
    kept = _ids(_call(fn, logits, arg, call) > DROPPED_BELOW)
    assert kept == expected, f"{call} kept tokens {kept}, expected {expected}{why}"


def _compare_with_engine(fn, reference, args, name: str) -> None:
    for arg in args:
        for where, logits in _random_inputs():
            call = f"{name}(logits, {arg}) on random logits ({where})"
            _assert_same_distribution(_call(fn, logits, arg, call), reference(logits, arg), call)


# ---- temperature ---------------------------------------------------------------------------------


def check_apply_temperature_divides_the_logits(mod) -> None:
    for t in (0.5, 1.0, 2.0):
        for where, logits in _random_inputs():
            call = f"apply_temperature(logits, {t}) ({where})"
            got = _call(mod.apply_temperature, logits, t, call)
            want = engine.apply_temperature(logits, t)
            assert torch.allclose(got, want, atol=ATOL), (
                f"{call}: got {got.flatten()[:4].tolist()}..., "
                f"expected {want.flatten()[:4].tolist()}...")


# ---- top-k ---------------------------------------------------------------------------------------


def check_top_k_matches_the_engine_on_random_logits(mod) -> None:
    _compare_with_engine(mod.top_k_filter, engine.top_k_filter, (1, 3, VOCAB - 1), "top_k_filter")


def check_top_k_keeps_ties_at_the_boundary(mod) -> None:
    logits = torch.tensor([1.0, 2.0, 2.0, 0.0])  # the two 2.0s tie for first place
    _assert_keeps(mod.top_k_filter, logits, 1, [1, 2], "top_k_filter([1, 2, 2, 0], k=1)",
                  " (a token tied with the k-th largest stays)")
    _assert_keeps(mod.top_k_filter, logits, 2, [1, 2], "top_k_filter([1, 2, 2, 0], k=2)")


def check_top_k_is_off_for_0_minus_1_and_k_at_least_vocab(mod) -> None:
    logits = _random_logits(0, (BATCH, VOCAB))
    for k in (0, -1, VOCAB, VOCAB + 5):
        call = f"top_k_filter(logits of shape {tuple(logits.shape)}, k={k})"
        _assert_same_distribution(_call(mod.top_k_filter, logits, k, call), logits, call)


# ---- top-p ---------------------------------------------------------------------------------------


def check_top_p_matches_the_engine_on_random_logits(mod) -> None:
    _compare_with_engine(mod.top_p_filter, engine.top_p_filter, (0.1, 0.5, 0.9), "top_p_filter")


def check_top_p_keeps_the_boundary_token(mod) -> None:
    # sorted probs 0.4 0.3 0.2 0.1; mass of the more likely tokens: 0 0.4 0.7 0.9
    why = " (the token whose probability carries the total past p must stay)"
    _assert_keeps(mod.top_p_filter, PROBS, 0.75, [0, 1, 2],
                  "top_p_filter(probs [.4 .3 .2 .1], p=0.75)", why)
    _assert_keeps(mod.top_p_filter, PROBS, 0.5, [0, 1],
                  "top_p_filter(probs [.4 .3 .2 .1], p=0.5)", why)
    _assert_keeps(mod.top_p_filter, PROBS, 0.35, [0],
                  "top_p_filter(probs [.4 .3 .2 .1], p=0.35)", why)


def check_top_p_keeps_every_token_tied_with_the_boundary(mod) -> None:
    # sorted 0.4 0.3 0.3, p = 0.5: mass before 0 0.4 0.7, so the first 0.3 crosses p (the boundary).
    # The second 0.3 is exactly as likely: which of the two a sort puts first is arbitrary,
    # so both stay.
    why = " (a token as likely as the boundary token stays too, whatever order the sort gave them)"
    for probs, want in (([0.4, 0.3, 0.3], [0, 1, 2]), ([0.3, 0.4, 0.3], [0, 1, 2]),
                        ([0.3, 0.3, 0.4], [0, 1, 2]), ([0.1, 0.3, 0.3, 0.3], [1, 2, 3])):
        _assert_keeps(mod.top_p_filter, probs, 0.5, want,
                      f"top_p_filter(probs {probs}, p=0.5)", why)
    # the same in a batch: each row finds its own boundary
    logits = torch.stack([_logits_of([0.4, 0.3, 0.3]), _logits_of([0.6, 0.3, 0.1])])  # [2, 3]
    got = _call(mod.top_p_filter, logits, 0.5,
                "top_p_filter(batch of 2 rows, p=0.5)") > DROPPED_BELOW
    assert [_ids(row) for row in got] == [[0, 1, 2], [0]], (
        f"top_p_filter(probs [[.4 .3 .3], [.6 .3 .1]], p=0.5) kept {[_ids(row) for row in got]}, "
        f"expected [[0, 1, 2], [0]]{why}")


def check_top_p_handles_ties_inside_the_kept_set(mod) -> None:
    # 0.3 < 0.5 and 0.3 + 0.3 >= 0.5: both 0.3s stay, in whichever order a sort puts them
    _assert_keeps(mod.top_p_filter, [0.2, 0.3, 0.2, 0.3], 0.5, [1, 3],
                  "top_p_filter(probs [.2 .3 .2 .3], p=0.5)")


def check_top_p_of_one_keeps_every_token(mod) -> None:
    # e^-30 is lost when added to 1.0 in float32:
    # a cumulative sum reaches 1.0 before the last tokens
    logits = torch.tensor([[30.0, 0.0, 0.0, -5.0], [0.0, 1.0, 2.0, 3.0]])
    call = "top_p_filter([[30, 0, 0, -5], [0, 1, 2, 3]], p=1.0)"
    _assert_same_distribution(_call(mod.top_p_filter, logits, 1.0, call), logits,
                              call + " (p = 1 keeps all)")


# ---- min-p ---------------------------------------------------------------------------------------


def check_min_p_matches_the_engine_on_random_logits(mod) -> None:
    _compare_with_engine(mod.min_p_filter, engine.min_p_filter, (0.05, 0.2, 0.5), "min_p_filter")


def check_min_p_drops_tokens_below_a_fraction_of_the_top(mod) -> None:
    # threshold 0.4 * 0.5 = 0.2: 0.5 and 0.25 stay, 0.15 and 0.1 go
    _assert_keeps(mod.min_p_filter, [0.5, 0.25, 0.15, 0.1], 0.4, [0, 1],
                  "min_p_filter(probs [.5 .25 .15 .1], 0.4)")
    # min_p = 1 keeps exactly the tokens tied for the top (probability == threshold stays)
    _assert_keeps(mod.min_p_filter, torch.tensor([1.0, 3.0, 3.0, 0.0]), 1.0, [1, 2],
                  "min_p_filter([1, 3, 3, 0], 1.0)",
                  " (a probability equal to the threshold stays)")
    _assert_keeps(mod.min_p_filter, PROBS, 0.0, [0, 1, 2, 3],
                  "min_p_filter(probs [.4 .3 .2 .1], 0.0)")


# ---- the naive generation loop -------------------------------------------------------------------

TABLE_MARGIN = 100.0  # how far the chosen next token's logit stands above random noise of std 1
# logits within 0.01 of each other: softmax is nearly uniform, argmax still unique
NEAR_TIE_SPREAD = 0.01
NEAR_TIE_STEPS = 40  # a sampler agrees with argmax about 1 step in 11 here: never 40 times running
TORCH_SEEDS = (0, 1234)  # global seeds set before the runs: a greedy loop must not care


class _TableModel:
    """A fake language model: the next token's logits depend only on the last token.

    Row t of a random table gets TABLE_MARGIN added at (3t + 1) mod 11, so greedy decoding walks
    t -> 3t + 1 (mod 11).
    From 9: 9 -> 28 mod 11 = 6 -> 19 mod 11 = 8 -> 25 mod 11 = 3 -> 10 -> 9 -> 6.
    It records every sequence it is called with.
    """

    PROMPT = [5, 9]
    GREEDY = [6, 8, 3, 10, 9, 6]  # the walk above, worked out by hand

    def __init__(self) -> None:
        nxt = torch.tensor([(3 * t + 1) % VOCAB for t in range(VOCAB)])
        self.table = _random_logits(7, (VOCAB, VOCAB)) / LOGIT_SCALE
        self.table[torch.arange(VOCAB), nxt] += TABLE_MARGIN
        self.calls: list[list[int]] = []

    def __call__(self, ids) -> torch.Tensor:
        ids = [int(t) for t in ids]  # a list or a 1-D tensor are both fine
        self.calls.append(ids)
        return self.table[ids[-1]].clone()


class _NearTieModel:
    """A fake model whose logits are nearly equal (within NEAR_TIE_SPREAD) and depend on the whole
    sequence: only a true argmax follows its greedy path; sampling would wander off at once."""

    def __call__(self, ids) -> torch.Tensor:
        # any fixed function of the ids
        key = sum((i + 1) * int(t) for i, t in enumerate(ids)) + len(ids)
        return torch.rand(VOCAB, generator=torch.Generator().manual_seed(key)) * NEAR_TIE_SPREAD

    def greedy_path(self, prompt: list[int], steps: int) -> list[int]:
        ids = list(prompt)
        for _ in range(steps):
            row = self(ids).tolist()
            ids.append(row.index(max(row)))  # the argmax, in plain Python
        return ids[len(prompt):]


def _generate(mod, max_new_tokens: int, eos_id: int, prompt=None) -> tuple[list[int], _TableModel]:
    model = _TableModel()
    prompt = list(_TableModel.PROMPT) if prompt is None else prompt
    out = mod.naive_generate(model, prompt, max_new_tokens, eos_id)
    assert isinstance(out, list), (
        f"naive_generate returned {type(out).__name__}, expected a list of ints")
    return [int(t) for t in out], model


def check_naive_generate_is_greedy(mod) -> None:
    out, _ = _generate(mod, max_new_tokens=6, eos_id=0)  # 0 is never reached from 9
    want = _TableModel.GREEDY
    assert out == want, f"naive_generate gave {out}, expected the argmax walk {want}"


def check_naive_generate_takes_the_argmax_on_near_ties(mod) -> None:
    model = _NearTieModel()
    want = model.greedy_path([1, 2], NEAR_TIE_STEPS)
    for seed in TORCH_SEEDS:
        torch.manual_seed(seed)
        out = [int(t) for t in mod.naive_generate(model, [1, 2], NEAR_TIE_STEPS, eos_id=VOCAB)]
        first_wrong = next((i for i, (a, b) in enumerate(zip(out, want, strict=False)) if a != b),
                           None)
        assert out == want, (
            f"with torch.manual_seed({seed}), on logits that differ by at most {NEAR_TIE_SPREAD}, "
            f"naive_generate gave {out[:8]}... (first differs from the argmax path at step "
            f"{first_wrong}), expected the argmax path {want[:8]}...: greedy means the most likely "
            "token, never a sample")


def check_naive_generate_stops_after_eos(mod) -> None:
    out, _ = _generate(mod, max_new_tokens=6, eos_id=3)
    assert out == [6, 8, 3], (
        f"naive_generate with eos_id=3 gave {out}, expected [6, 8, 3] (eos included, then stop)")
    # The prompt may itself end in (or contain) eos: only a GENERATED eos stops the loop.
    out, _ = _generate(mod, max_new_tokens=6, eos_id=9)
    assert out == [6, 8, 3, 10, 9], (
        f"naive_generate(prompt [5, 9], eos_id=9) gave {out}, expected [6, 8, 3, 10, 9]: the 9 in "
        "the prompt does not count, the loop stops after it generates a 9")


def check_naive_generate_leaves_the_prompt_alone(mod) -> None:
    prompt = list(_TableModel.PROMPT)
    out, _ = _generate(mod, max_new_tokens=3, eos_id=0, prompt=prompt)
    assert prompt == _TableModel.PROMPT, (
        f"after naive_generate the caller's prompt list is {prompt}, it was {_TableModel.PROMPT}: "
        "copy it into a list of your own before appending")
    out_tuple, _ = _generate(mod, max_new_tokens=3, eos_id=0, prompt=tuple(_TableModel.PROMPT))
    assert out_tuple == out == [6, 8, 3], (
        f"naive_generate gave {out} for a list prompt and {out_tuple} for a tuple, expected "
        "[6, 8, 3] for both (prompt_ids is any sequence of ints)")


def check_naive_generate_feeds_the_whole_sequence_every_step(mod) -> None:
    out, model = _generate(mod, max_new_tokens=4, eos_id=0)
    prompt = _TableModel.PROMPT
    expected = [prompt + out[:i] for i in range(len(out))]
    assert model.calls == expected, (
        f"the model was called with {model.calls}, expected {expected}: each step passes the "
        "prompt plus every token generated so far (there is no cache yet)")


def check_naive_generate_respects_max_new_tokens(mod) -> None:
    out, model = _generate(mod, max_new_tokens=0, eos_id=0)
    assert out == [] and model.calls == [], (
        f"max_new_tokens=0 gave {out} after {len(model.calls)} model calls, "
        "expected [] and no calls")
    out, _ = _generate(mod, max_new_tokens=2, eos_id=0)
    assert out == [6, 8], f"max_new_tokens=2 gave {out}, expected [6, 8]"
