"""Issue 9: no request, however bad, can break the engine or other requests.

One table of bad inputs. For each: the exact error type, a fragment of its message (which names the
request and what is wrong), then nothing held (no block, no registered request, nothing queued, no
event), and a good request afterwards still gets the naive loop's tokens. `render_table` turns the
table into markdown with the REAL messages; `pytest -s -k table` prints it.
"""

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from engine.companions.naive import generate_naive
from engine.llm import LLM
from engine.llm_engine import LLMEngine, engine_config
from engine.sampling import SamplingParams
from engine_fixtures import CONTEXT, VOCAB, random_model

GOOD_PROMPT = [5, 17, 42, 3]
GOOD_PARAMS = SamplingParams(temperature=0, max_tokens=5)
BAD_ID = "bad"  # the request id every engine row uses, so we can check the message names it
SMALL_POOL = dict(num_blocks=6, block_size=4)  # 24 slots: room for the good request, not for a 40-token one


@pytest.fixture(scope="module")
def model():
    return random_model(seed=9)


@pytest.fixture(scope="module")
def good_output(model):
    return generate_naive(model, None, GOOD_PROMPT, GOOD_PARAMS).token_ids


@dataclass
class Case:
    shown: str  # the call, as a reader would write it (the table's first column)
    call: Any  # engine -> None, or llm -> None when `via_llm`
    error: type
    fragment: str  # must appear in the message
    via_llm: bool = False


def add(prompt, params=None, **kw):
    return lambda engine: engine.add_request(prompt, params, request_id=BAD_ID, **kw)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


CASES = [
    Case("add_request([5000])", add([5000]), ValueError,
         f"prompt[0] = 5000 is outside the model's vocabulary [0, {VOCAB})"),
    Case(f"add_request([{VOCAB}])  (vocab_size)", add([VOCAB]), ValueError, f"prompt[0] = {VOCAB} is outside"),
    Case(f"add_request([5, 6, {VOCAB + 7}])", add([5, 6, VOCAB + 7]), ValueError, f"prompt[2] = {VOCAB + 7}"),
    Case("add_request([-1])", add([-1]), ValueError, "prompt[0] = -1 is outside"),
    Case("add_request([5.0])", add([5.0]), TypeError, "prompt[0] is float 5.0: token ids must be ints"),
    Case("add_request([True])", add([True]), TypeError, "prompt[0] is bool True"),
    Case("add_request([np.bool_(True)])", add([np.bool_(True)]), TypeError, "prompt[0] is bool"),
    Case("add_request([torch.tensor(True)])", add([torch.tensor(True)]), TypeError, "prompt[0] is Tensor"),
    Case("add_request([torch.tensor(5.0)])", add([torch.tensor(5.0)]), TypeError, "prompt[0] is Tensor"),
    Case("add_request(b'ab')", add(b"ab"), TypeError, "prompt must be a list of token ids"),
    Case("add_request([b'a'])", add([b"a"]), TypeError, "prompt[0] is bytes b'a'"),
    Case("add_request(None)", add(None), TypeError, "prompt must be a list of token ids"),
    Case("add_request([5, None])", add([5, None]), TypeError, "prompt[1] is NoneType None"),
    Case("add_request([[5, 6]])", add([[5, 6]]), TypeError, "prompt[0] is list [5, 6]"),
    Case("add_request([np.array([5])])", add([np.array([5])]), TypeError, "prompt[0] is ndarray"),
    Case("add_request([5, 'a'])", add([5, "a"]), TypeError, "prompt[1] is str 'a'"),
    Case("add_request(7)", add(7), TypeError, "got int 7"),
    Case("add_request({5, 6})", add({5, 6}), TypeError, "got set"),
    Case("add_request([])", add([]), ValueError, "prompt is empty"),
    Case("add_request('hi')  (no tokenizer)", add("hi"), ValueError, "no tokenizer"),
    Case(f"add_request([5] * {CONTEXT})  (the whole context)", add([5] * CONTEXT), ValueError,
         f"context is {CONTEXT}"),
    Case("add_request([5] * 30, max_tokens=10)  (6-block pool)", add([5] * 30, greedy(max_tokens=10)), ValueError,
         "num_blocks=6"),
    Case(f"stop_token_ids=[{VOCAB}]", add([5], greedy(stop_token_ids=[VOCAB])), ValueError,
         f"SamplingParams.stop_token_ids[0] = {VOCAB} is outside"),
    Case("stop_token_ids=[-3]", add([5], greedy(stop_token_ids=[-3])), ValueError, "stop_token_ids[0] = -3"),
    Case("stop_token_ids=[2.5]", add([5], greedy(stop_token_ids=[2.5])), TypeError, "stop_token_ids[0] is float"),
    Case("SamplingParams(n=17)  (max_num_seqs=16)", add([5], greedy(n=17)), ValueError, "max_num_seqs=16"),
    Case("params={'max_tokens': 4}", add([5], {"max_tokens": 4}), TypeError, "params must be a SamplingParams"),
    Case("priority=None", add([5], priority=None), TypeError, "priority must be an int"),
    Case("priority='high'", add([5], priority="high"), TypeError, "priority must be an int"),
    Case("tenant=['a']", add([5], tenant=["a"]), TypeError, "tenant must be a str or None"),
    Case("arrival_time=nan", add([5], arrival_time=math.nan), ValueError, "arrival_time must be a finite"),
    Case("LLM.generate([[5, 6], [5000]])", lambda llm: llm.generate([[5, 6], [5000]], use_tqdm=False), ValueError,
         "prompts[1]: request '1': prompt[0] = 5000 is outside", via_llm=True),
    Case("LLM.generate([5, 6.5])", lambda llm: llm.generate([5, 6.5], use_tqdm=False), TypeError,
         "prompts[0]: request '0': prompt[1] is float 6.5", via_llm=True),
    Case("LLM.generate([[5], None])", lambda llm: llm.generate([[5], None], use_tqdm=False), TypeError,
         "prompts[1]: request '1': prompt must be a list of token ids", via_llm=True),
]


def make_engine(model) -> LLMEngine:
    return LLMEngine(model, None, engine_config(model="random", **SMALL_POOL))


def run_case(model, case: Case) -> tuple[BaseException | None, LLMEngine]:
    """Make the bad call on a fresh engine (through `LLM.generate` for its rows); returns the exception
    it raised (None if it raised nothing) and the engine."""
    llm = LLM(model, **SMALL_POOL) if case.via_llm else None
    engine = llm.engine if llm else make_engine(model)
    try:
        case.call(llm if llm else engine)
    except Exception as exc:  # the table records whatever was raised
        return exc, engine
    return None, engine


def holds_nothing(engine: LLMEngine) -> bool:
    s, bm = engine.scheduler, engine.block_manager
    return (engine.requests == {} and not (s.waiting or s.running or s.swapped)
            and bm.usage().used_blocks == 0 and bm.seq_ids() == [])


@pytest.mark.parametrize("case", CASES, ids=[c.shown for c in CASES])
def test_a_bad_input_is_rejected_naming_the_request_and_holds_nothing(model, good_output, case):
    exc, engine = run_case(model, case)
    assert type(exc) is case.error, f"{case.shown} raised {exc!r}"
    assert case.fragment in str(exc)
    if not case.via_llm:
        assert f"request '{BAD_ID}'" in str(exc)  # the message names the request
    assert holds_nothing(engine)
    rid = engine.add_request(GOOD_PROMPT, GOOD_PARAMS)  # and the engine still serves good requests
    while engine.has_unfinished_requests():
        report = engine.step()
        assert all(e.get("request_id") != BAD_ID for e in report.events)  # no trace of the bad one
    assert engine.get_request(rid).output_token_ids == good_output


def test_numpy_and_torch_integer_ids_are_accepted_as_plain_ints(model, good_output):
    engine = make_engine(model)
    a, b, c, d = GOOD_PROMPT
    prompt = [np.int64(a), torch.tensor(b), np.int32(c), d]
    rid = engine.add_request(prompt, GOOD_PARAMS)
    assert engine.get_request(rid).prompt_token_ids == GOOD_PROMPT
    assert all(type(t) is int for t in engine.get_request(rid).prompt_token_ids)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_request(rid).output_token_ids == good_output
    (out,) = LLM(model).generate(np.array(GOOD_PROMPT), GOOD_PARAMS, use_tqdm=False)  # one prompt, numpy
    assert out.outputs[0].token_ids == good_output


def test_a_bad_prompt_in_the_middle_of_a_generate_call_leaves_the_llm_usable(model, good_output):
    llm = LLM(model, **SMALL_POOL)
    with pytest.raises(ValueError, match=r"prompts\[2\]"):
        llm.generate([GOOD_PROMPT, GOOD_PROMPT, [VOCAB]], GOOD_PARAMS, use_tqdm=False)
    assert holds_nothing(llm.engine)
    outputs = llm.generate([GOOD_PROMPT, GOOD_PROMPT], GOOD_PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [good_output, good_output]


def render_table(model) -> str:
    """The bad-input table as markdown, with the messages the engine really raises today."""
    lines = ["| input | error message | nothing held |", "| --- | --- | --- |"]
    for case in CASES:
        exc, engine = run_case(model, case)
        message = f"{type(exc).__name__}: {exc}".replace("|", "\\|")
        lines.append(f"| `{case.shown}` | {message} | {'yes' if holds_nothing(engine) else 'NO'} |")
    return "\n".join(lines)


def test_the_bad_input_table_renders_with_every_row_holding_nothing(model):
    table = render_table(model)
    print("\n" + table)  # `pytest -s -k table` shows it
    rows = table.splitlines()[2:]
    assert len(rows) == len(CASES) and all(row.endswith("| yes |") for row in rows)
