"""Chapter 01: the sampler. Expected distributions are worked out by hand in the comments."""

import math

import pytest
import torch

from engine.sampling import (
    GREEDY_EPSILON,
    SamplingParams,
    SamplingState,
    apply_penalties,
    apply_temperature,
    check_stop,
    min_p_filter,
    probs_after_each_stage,
    sample,
    shows_text,
    top_k_filter,
    top_p_filter,
)

ATOL = 1e-6  # float32 softmax of a handful of logits is exact to ~1e-7
PROBS = [0.4, 0.3, 0.2, 0.1]  # the hand-made distribution most tests start from
CHI2_DF2_P001 = 13.82  # chi-square critical value, 2 degrees of freedom, p = 0.001
CHI2_DF1_P001 = 10.83  # same, 1 degree of freedom


def logits_of(probs):
    """Logits whose softmax is exactly `probs` (up to float rounding): log p."""
    return torch.tensor(probs, dtype=torch.float32).log()


def dist(logits):
    return torch.softmax(logits, dim=-1)


def assert_dist(got_logits, expected):
    got = dist(got_logits)
    want = torch.tensor(expected, dtype=torch.float32)
    assert torch.allclose(got, want, atol=ATOL), f"got {got.tolist()}, want {want.tolist()}"


def greedy_state(**kw):
    return SamplingState(SamplingParams(temperature=0.0, **kw))


# ---- filters -------------------------------------------------------------------------------------


def test_top_p_keeps_the_smallest_head_and_renormalizes():
    # 0.4 < 0.5, 0.4 + 0.3 = 0.7 >= 0.5: keep {0.4, 0.3} -> [4/7, 3/7, 0, 0]
    assert_dist(top_p_filter(logits_of(PROBS), 0.5), [4 / 7, 3 / 7, 0, 0])


def test_top_p_keeps_the_boundary_token():
    # 0.4 + 0.3 = 0.7 < 0.75, so 0.2 is the token that crosses 0.75: it stays -> [4/9, 3/9, 2/9, 0]
    assert_dist(top_p_filter(logits_of(PROBS), 0.75), [4 / 9, 3 / 9, 2 / 9, 0])
    # p below the top token's probability keeps exactly the top token
    assert_dist(top_p_filter(logits_of(PROBS), 0.35), [1, 0, 0, 0])


def test_top_p_of_one_keeps_tokens_of_vanishing_probability():
    logits = torch.tensor([100.0, 0.0, 0.0])  # e^-100 rounds the cumulative sum to 1.0 in float32
    assert torch.isfinite(top_p_filter(logits, 1.0)).all()


def test_top_p_keeps_every_token_tied_at_the_boundary():
    # 0.4 < 0.5 and the 0.2s are tied: whichever comes first crosses 0.5, so all three stay
    assert_dist(top_p_filter(logits_of([0.4, 0.2, 0.2, 0.2]), 0.5), [0.4, 0.2, 0.2, 0.2])


def test_top_k_keeps_the_k_largest_logits():
    logits = torch.tensor([1.0, 4.0, 2.0, 3.0])
    e = math.e  # survivors 4 and 3: softmax = [e/(e+1), 1/(e+1)]
    assert_dist(top_k_filter(logits, 2), [0, e / (e + 1), 0, 1 / (e + 1)])


@pytest.mark.parametrize("k", [0, -1, 4, 10])
def test_top_k_is_off_for_zero_minus_one_and_k_at_least_vocab(k):
    logits = torch.tensor([1.0, 4.0, 2.0, 3.0])
    assert torch.equal(top_k_filter(logits, k), logits)


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([1.0, 2.0, 2.0, 0.0])
    assert torch.isfinite(top_k_filter(logits, 1)).tolist() == [False, True, True, False]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    # threshold 0.4 * 0.5 = 0.2: keep 0.5 and 0.25 -> [2/3, 1/3, 0, 0]
    assert_dist(min_p_filter(logits_of([0.5, 0.25, 0.15, 0.1]), 0.4), [2 / 3, 1 / 3, 0, 0])


def test_min_p_of_one_keeps_exactly_the_tokens_tied_for_the_top():
    logits = torch.tensor([1.0, 3.0, 3.0, 0.0])
    assert torch.isfinite(min_p_filter(logits, 1.0)).tolist() == [False, True, True, False]


def test_min_p_of_zero_keeps_everything():
    logits = logits_of(PROBS)
    assert torch.equal(min_p_filter(logits, 0.0), logits)


def test_temperature_divides_logits():
    logits = logits_of([1 / 3, 2 / 3])  # odds 2:1
    assert_dist(apply_temperature(logits, 0.5), [1 / 5, 4 / 5])  # odds squared: 4:1
    r = math.sqrt(2)  # t = 2: odds square-rooted, sqrt(2):1
    assert_dist(apply_temperature(logits, 2.0), [1 / (1 + r), r / (1 + r)])


def test_temperature_zero_is_refused_by_the_pure_function():
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(torch.zeros(3), 0.0)


def test_filters_treat_each_row_of_a_batch_on_its_own():
    batch = torch.stack([logits_of(PROBS), logits_of([0.1, 0.2, 0.3, 0.4])])  # [B=2, V=4]
    assert_dist(top_p_filter(batch, 0.5)[0], [4 / 7, 3 / 7, 0, 0])
    assert_dist(top_p_filter(batch, 0.5)[1], [0, 0, 3 / 7, 4 / 7])
    assert_dist(top_k_filter(batch, 1)[1], [0, 0, 0, 1])
    assert_dist(min_p_filter(batch, 0.6)[1], [0, 0, 3 / 7, 4 / 7])  # threshold 0.24


def test_filters_do_not_modify_their_input():
    logits = logits_of(PROBS)
    before = logits.clone()
    for filtered in (top_k_filter(logits, 2), top_p_filter(logits, 0.5), min_p_filter(logits, 0.5)):
        filtered.fill_(0.0)
    assert torch.equal(logits, before)


def test_probs_after_each_stage_follow_the_pipeline():
    params = SamplingParams(top_k=3, top_p=0.6)
    stages = probs_after_each_stage(logits_of(PROBS), params)
    assert list(stages) == ["raw", "temperature", "top_k", "top_p", "min_p"]
    want = {
        "raw": PROBS,
        "temperature": PROBS,  # t = 1
        "top_k": [4 / 9, 3 / 9, 2 / 9, 0],
        "top_p": [4 / 7, 3 / 7, 0, 0],  # on [4/9, 3/9, 2/9]: 4/9 < 0.6, 7/9 >= 0.6
        "min_p": [4 / 7, 3 / 7, 0, 0],  # min_p = 0: unchanged
    }
    for name, probs in want.items():
        assert torch.allclose(stages[name], torch.tensor(probs), atol=ATOL), name


def test_probs_after_each_stage_are_one_hot_when_greedy():
    stages = probs_after_each_stage(logits_of([0.1, 0.6, 0.3]), SamplingParams(temperature=0.0))
    assert stages["min_p"].tolist() == [0.0, 1.0, 0.0]


# ---- penalties -----------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    got = apply_penalties(logits, prompt_ids=[0], output_ids=[1], repetition_penalty=2.0)
    assert got.tolist() == [1.0, -2.0, 0.5, 3.0]  # 0 (prompt) and 1 (output) penalized, 2 and 3 untouched


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(4)
    got = apply_penalties(logits, prompt_ids=[0], output_ids=[2, 2, 3],
                          presence_penalty=0.5, frequency_penalty=0.25)
    # token 2: -0.5 - 2 * 0.25 = -1.0; token 3: -0.5 - 0.25 = -0.75; token 0 only in the prompt
    assert got.tolist() == [0.0, 0.0, -1.0, -0.75]


def test_sampler_applies_penalties_before_choosing():
    logits = torch.tensor([[1.0, 0.9]])
    state = SamplingState(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt_ids=[0])
    assert sample(logits, [state]).token_ids.tolist() == [1]  # 1.0 / 2 = 0.5 < 0.9


# ---- the sampler ---------------------------------------------------------------------------------


def test_greedy_is_argmax_and_draws_no_random_numbers():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 4.9]])
    rows = [greedy_state(top_k=2, seed=1), greedy_state(top_p=0.1, seed=2)]
    before = [row.generator.get_state() for row in rows]
    assert sample(logits, rows).token_ids.tolist() == [1, 0]
    assert all(torch.equal(row.generator.get_state(), b) for row, b in zip(rows, before, strict=True))


def test_greedy_is_any_temperature_below_epsilon():
    assert SamplingParams(temperature=GREEDY_EPSILON / 2).greedy
    assert not SamplingParams(temperature=GREEDY_EPSILON * 2).greedy


def draw(state, logits_1d, steps):
    return [int(sample(logits_1d[None], [state]).token_ids[0]) for _ in range(steps)]


def test_same_seed_gives_the_same_tokens():
    flat = torch.zeros(50)
    a = draw(SamplingState(SamplingParams(seed=7)), flat, 40)
    b = draw(SamplingState(SamplingParams(seed=7)), flat, 40)
    assert a == b


def test_different_seeds_give_different_tokens():
    flat = torch.zeros(50)  # 40 draws agreeing by chance: probability 50^-40
    assert draw(SamplingState(SamplingParams(seed=7)), flat, 40) != draw(
        SamplingState(SamplingParams(seed=8)), flat, 40)


def test_a_seeded_request_does_not_depend_on_its_batch_neighbours():
    flat = torch.zeros(50)
    alone = draw(SamplingState(SamplingParams(seed=3)), flat, 20)
    rows = [SamplingState(SamplingParams()), SamplingState(SamplingParams(seed=3)),
            SamplingState(SamplingParams(seed=99))]
    together = [int(sample(flat.expand(3, -1), rows).token_ids[1]) for _ in range(20)]
    assert together == alone


def test_each_row_follows_its_own_params():
    logits = torch.tensor([1.0, 3.0, 0.0, 2.0]).expand(3, -1)  # [B=3, V=4]
    rows = [SamplingState(SamplingParams(top_k=2, seed=0)),  # only tokens 1 and 3
            SamplingState(SamplingParams(min_p=0.9, seed=1)),  # only the top token, 1
            greedy_state()]
    seen = [set(), set(), set()]
    for _ in range(200):
        for i, token in enumerate(sample(logits, rows).token_ids.tolist()):
            seen[i].add(token)
    assert seen == [{1, 3}, {1}, {1}]


S4, S3 = math.sqrt(0.4), math.sqrt(0.3)


def chi_square(counts, expected_probs, n):
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, expected_probs, strict=True) if p > 0)


@pytest.mark.parametrize("params, expected, critical", [
    # top-p 0.75 on [.4 .3 .2 .1] -> [4/9, 3/9, 2/9, 0]
    (dict(top_p=0.75), [4 / 9, 3 / 9, 2 / 9, 0], CHI2_DF2_P001),
    # t = 0.5 squares the probs: [.16 .09 .04 .01]/.30; min_p 0.2 keeps >= 0.2 * .16/.30: [16, 9, 4, 0]/29
    (dict(temperature=0.5, min_p=0.2), [16 / 29, 9 / 29, 4 / 29, 0], CHI2_DF2_P001),
    # top-k 2 at t = 2: sqrt of the probs, [sqrt .4, sqrt .3] renormalized
    (dict(temperature=2.0, top_k=2), [S4 / (S4 + S3), S3 / (S4 + S3), 0, 0], CHI2_DF1_P001),
])
def test_empirical_frequencies_match_the_filtered_distribution(params, expected, critical):
    n = 4000
    state = SamplingState(SamplingParams(seed=1234, **params))
    logits = logits_of(PROBS)[None].expand(n, -1)  # n identical rows, drawn from one generator
    tokens = sample(logits, [state] * n).token_ids
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert all(c == 0 for c, p in zip(counts, expected, strict=True) if p == 0), counts
    assert chi_square(counts, expected, n) < critical, (counts, [n * p for p in expected])


def test_logprobs_are_of_the_penalized_logits_before_temperature():
    state = SamplingState(SamplingParams(temperature=0.5, top_k=1, logprobs=2, seed=0))
    out = sample(logits_of([0.5, 0.3, 0.2])[None], [state]).logprobs[0]
    assert out.token_id == 0  # top-k 1 leaves one choice
    assert out.logprob == pytest.approx(math.log(0.5), abs=1e-6)
    assert list(out.top) == [0, 1]
    assert out.top[1] == pytest.approx(math.log(0.3), abs=1e-6)


def test_logprobs_are_none_when_not_requested():
    assert sample(torch.zeros(1, 3), [greedy_state()]).logprobs == [None]


def test_min_tokens_blocks_eos_and_stop_ids_until_enough_outputs():
    eos, stop_id = 0, 1
    logits = torch.tensor([[9.0, 8.0, 1.0, 0.0]])  # eos, then the stop id, are the favourites
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop_id])
    early = SamplingState(params, output_ids=[2])
    assert sample(logits, [early], eos_token_ids=eos).token_ids.tolist() == [2]
    enough = SamplingState(params, output_ids=[2, 3])
    assert sample(logits, [enough], eos_token_ids=eos).token_ids.tolist() == [eos]


def test_min_tokens_blocks_every_eos_id_of_a_chat_model():
    logits = torch.tensor([[9.0, 8.0, 1.0, 0.0]])  # two EOS ids (0 and 1) are the favourites
    params = SamplingParams(temperature=0.0, min_tokens=2)
    early = SamplingState(params, output_ids=[3])
    assert sample(logits, [early], eos_token_ids=[0, 1]).token_ids.tolist() == [2]
    enough = SamplingState(params, output_ids=[3, 3])
    assert sample(logits, [enough], eos_token_ids=[0, 1]).token_ids.tolist() == [0]


def test_sample_rejects_a_batch_that_does_not_match_its_rows():
    with pytest.raises(ValueError, match="len\\(rows\\) = 2"):
        sample(torch.zeros(3, 4), [greedy_state(), greedy_state()])


# ---- stopping ------------------------------------------------------------------------------------


def test_stop_strings_are_cut_from_the_text_at_the_earliest_match():
    params = SamplingParams(stop=["bye", "."])
    assert check_stop([5], 6, "hello world. bye", params, eos_token_ids=[0]) == (True, "stop", "hello world")


def test_a_single_stop_string_is_normalized_to_a_list():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams().stop == []


def test_eos_stops_unless_ignored():
    assert check_stop([5], 0, "hi", SamplingParams(), eos_token_ids=[0]) == (True, "stop", "hi")
    assert check_stop([5], 0, "hi", SamplingParams(ignore_eos=True), eos_token_ids=[0]) == (False, None, "hi")


def test_every_eos_id_stops_not_only_the_first():
    # A chat model often ends with either of two ids (e.g. <|endoftext|> and <|im_end|>).
    decision = check_stop([5], 9, "hi", SamplingParams(max_tokens=2), eos_token_ids=[0, 9])
    assert decision == (True, "stop", "hi")  # an EOS on the last allowed token is still a "stop"
    assert check_stop([5], 9, "hi", SamplingParams(ignore_eos=True), eos_token_ids=[0, 9])[:2] == (False, None)
    assert check_stop([5], 9, "hi", SamplingParams(), eos_token_ids=[])[:2] == (False, None)  # no EOS known


def test_eos_ids_never_show_as_text():
    assert not shows_text(9, [0, 9]) and shows_text(5, [0, 9])


def test_stop_token_ids_stop():
    assert check_stop([5], 7, "hi", SamplingParams(stop_token_ids=[7]), eos_token_ids=[0])[:2] == (True, "stop")


def test_max_tokens_finishes_with_reason_length():
    params = SamplingParams(max_tokens=2)
    assert check_stop([], 5, "a", params, eos_token_ids=[0])[:2] == (False, None)
    assert check_stop([5], 6, "ab", params, eos_token_ids=[0])[:2] == (True, "length")


def test_min_tokens_holds_back_every_stop_condition():
    params = SamplingParams(min_tokens=3, stop=["."], stop_token_ids=[7])
    assert check_stop([], 0, "x.", params, eos_token_ids=[0]) == (False, None, "x.")
    assert check_stop([5], 7, "x.", params, eos_token_ids=[0]) == (False, None, "x.")
    assert check_stop([5, 6], 1, "x.", params, eos_token_ids=[0, 1])[:2] == (True, "stop")


# ---- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, allowed", [
    ("n", 0, ">= 1"),
    ("temperature", -0.1, ">= 0"),
    ("temperature", float("nan"), ">= 0"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_k", -2, "-1"),
    ("min_p", -0.1, "[0, 1]"),
    ("min_p", 1.1, "[0, 1]"),
    ("repetition_penalty", 0.0, "> 0"),
    ("presence_penalty", 2.5, "[-2.0, 2.0]"),
    ("frequency_penalty", -2.5, "[-2.0, 2.0]"),
    ("max_tokens", 0, ">= 1"),
    ("min_tokens", -1, "[0, max_tokens=16]"),
    ("min_tokens", 17, "[0, max_tokens=16]"),
    ("stop", [""], "non-empty"),
    ("logprobs", -1, ">= 0"),
    # the wrong kind of value, refused by name before any range check
    ("max_tokens", 5.5, "an integer"),
    ("max_tokens", 5.0, "an integer"),  # whole floats too: max_tokens counts tokens
    ("max_tokens", True, "an integer"),  # a bool is not a count
    ("n", 2.0, "an integer"),
    ("top_k", 4.0, "an integer"),
    ("logprobs", 2.5, "an integer or None"),
    ("temperature", "0.5", "a number"),
    ("top_p", None, "a number"),
    ("repetition_penalty", False, "a number"),
    ("stop", 5, "a string, a list of strings"),
    ("stop", ["a", 5], "a string, a list of strings"),
    ("stop_token_ids", 7, "a list of token ids"),  # each id is checked against the vocabulary on add
    ("ignore_eos", 1, "True or False"),
])
def test_every_bad_param_is_refused_with_its_name_value_and_range(field, value, allowed):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert f"{field}={value!r}" in message and allowed in message, message


def test_numpy_scalars_are_taken_and_stored_as_python_numbers():
    import numpy as np

    params = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5), top_k=np.int32(3))
    assert (params.max_tokens, params.top_k, params.temperature) == (5, 3, 0.5)
    assert type(params.max_tokens) is int and type(params.temperature) is float  # JSON-ready


def test_plain_greedy_rows_in_one_argmax_equal_row_by_row_sampling():
    """sample() takes every plain greedy row with one argmax over the batch; rows with penalties, logprobs or a
    banned EOS before min_tokens go row by row. Each must pick what it would pick alone, ties included."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[1, [3, 17]] = 9.0  # a tie: the first index wins, alone or batched
    logits[4, 2] = 20.0  # the EOS id below: banned for the min_tokens row, so it must pick another
    states = [SamplingState(SamplingParams(temperature=0.0)),
              SamplingState(SamplingParams(temperature=0.0)),
              SamplingState(SamplingParams(temperature=0.0, repetition_penalty=3.0),
                            prompt_ids=[int(logits[2].argmax())]),
              SamplingState(SamplingParams(temperature=0.0, logprobs=2)),
              SamplingState(SamplingParams(temperature=0.0, min_tokens=2)),
              SamplingState(SamplingParams(temperature=0.0))]
    batched = sample(logits, states, eos_token_ids=2)
    alone = [sample(logits[i:i + 1], [s], eos_token_ids=2) for i, s in enumerate(states)]
    assert batched.token_ids.tolist() == [int(a.token_ids[0]) for a in alone]
    assert batched.token_ids[1] == 3 and batched.token_ids[4] != 2
    assert batched.token_ids[2] != logits[2].argmax()  # the penalty row really went through the penalty
    assert batched.logprobs[3] is not None and batched.logprobs[0] is None
