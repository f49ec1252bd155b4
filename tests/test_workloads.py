"""Request-length workloads: seeded, inside the context, and shaped like the lognormal they claim."""

import math
import random
import statistics

import pytest

from engine.lab.workloads import (
    CHAT,
    LengthDistribution,
    RequestLengths,
    length_summary,
    sample_request_lengths,
    total_lengths,
)

NO_LIMIT = 10**9  # a context so large that nothing is clipped: the raw distribution shows
MANY = 20_000  # samples for the shape checks: the mean's standard error is under 1% of the mean


def test_the_same_seed_gives_the_same_requests_and_another_seed_does_not():
    assert sample_request_lengths(50, seed=3) == sample_request_lengths(50, seed=3)
    assert sample_request_lengths(50, seed=3) != sample_request_lengths(50, seed=4)


def test_asking_for_more_requests_only_appends():
    assert sample_request_lengths(200, seed=1)[:30] == sample_request_lengths(30, seed=1)


def test_sampling_leaves_the_global_random_state_alone():
    before = random.getstate()
    sample_request_lengths(100, seed=0)
    assert random.getstate() == before


@pytest.mark.parametrize("max_context", [2, 16, 300, 2048])
def test_every_request_fits_its_context_with_at_least_one_token_each(max_context):
    requests = sample_request_lengths(2000, seed=0, max_context=max_context)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in requests)
    assert max(r.total for r in requests) <= max_context


def test_a_small_context_clips_the_long_tail_to_exactly_the_context():
    # With median prompts of 256 and a 300-token context, many requests hit the limit exactly.
    totals = total_lengths(sample_request_lengths(1000, seed=0, max_context=300))
    assert totals.count(300) > 100


def test_medians_and_means_match_the_lognormal_formulas():
    requests = sample_request_lengths(MANY, seed=0, max_context=NO_LIMIT)
    prompts = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    # The median of a lognormal is exp(mu) = the median we asked for; its mean is median * exp(sigma^2 / 2).
    assert statistics.median(prompts) == pytest.approx(CHAT.prompt_median, rel=0.05)
    assert statistics.median(outputs) == pytest.approx(CHAT.output_median, rel=0.05)
    assert statistics.mean(prompts) == pytest.approx(256 * math.exp(0.5), rel=0.05)  # ~422
    assert statistics.mean(outputs) == pytest.approx(128 * math.exp(0.32), rel=0.05)  # ~176


def test_sigma_zero_gives_every_request_the_medians():
    fixed = LengthDistribution(prompt_median=100, prompt_sigma=0, output_median=20, output_sigma=0)
    assert set(sample_request_lengths(10, seed=5, distribution=fixed)) == {RequestLengths(100, 20)}


def test_total_is_prompt_plus_output():
    assert RequestLengths(7, 5).total == 12
    assert total_lengths([RequestLengths(7, 5), RequestLengths(1, 1)]) == [12, 2]


@pytest.mark.parametrize("kwargs, field", [
    ({"n": -1, "seed": 0}, "n"),
    ({"n": 2.5, "seed": 0}, "n"),
    ({"n": 3, "seed": 0, "max_context": 1}, "max_context"),
])
def test_bad_arguments_are_refused_with_the_field_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        sample_request_lengths(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"prompt_median": 0}, "prompt_median"),
    ({"output_sigma": -0.1}, "output_sigma"),
])
def test_a_distribution_with_a_bad_parameter_is_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LengthDistribution(**kwargs)


def test_length_summary_uses_nearest_rank_percentiles():
    # 1..100: the median is 50 (the 50th value), p90 the 90th, p99 the 99th; the mean is 50.5.
    summary = length_summary(list(range(100, 0, -1)))
    assert summary == {"count": 100, "mean": 50.5, "median": 50, "p90": 90, "p99": 99, "max": 100}
    with pytest.raises(ValueError, match="empty"):
        length_summary([])
