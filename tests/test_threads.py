"""The engine computes each step on its own `num_threads` setting and gives the caller's count back."""

import pytest
import torch

from engine.llm_engine import LLMEngine, engine_config
from engine.sampling import SamplingParams
from engine.threads import SMALL_MODEL_PARAMS, available_cores, default_num_threads, torch_threads, use_threads
from engine_fixtures import random_model


def test_small_models_get_one_thread_and_big_ones_every_core():
    assert default_num_threads(4_500_000) == 1
    assert default_num_threads(SMALL_MODEL_PARAMS - 1) == 1
    assert default_num_threads(SMALL_MODEL_PARAMS) == available_cores()


def test_torch_threads_restores_the_callers_count_even_after_an_error():
    before = torch.get_num_threads()
    target = 2 if before == 1 else 1
    with pytest.raises(RuntimeError), torch_threads(target):
        assert torch.get_num_threads() == target
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_a_bad_thread_count_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="num_threads"):
        use_threads(bad)
    with pytest.raises(ValueError, match="num_threads"):
        engine_config(num_threads=bad)


def _threads_seen_by_the_forward(engine: LLMEngine) -> list[int]:
    seen = []
    engine.model.embed_tokens.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    engine.add_request([3, 4, 5], SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    return seen


@pytest.mark.parametrize("setting,expected", [(None, 1), (2, 2)])
def test_every_step_runs_on_the_engines_setting_and_the_caller_keeps_its_own(setting, expected):
    torch.set_num_threads(3)
    try:
        engine = LLMEngine(random_model(), None, engine_config(num_threads=setting, num_blocks=8, block_size=4))
        seen = _threads_seen_by_the_forward(engine)
        assert seen and set(seen) == {expected}
        assert torch.get_num_threads() == 3
        assert engine.trace.config["num_threads"] == expected
    finally:
        torch.set_num_threads(1)
