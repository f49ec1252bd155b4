"""servelab's engine: a step-through, vLLM-style LLM inference engine you can read in a weekend.

The public API is small, in vLLM's shape:

    from engine import LLM, SamplingParams
    llm = LLM("tinylab")
    outputs = llm.generate(["Q: 347+85="], SamplingParams(temperature=0.0, max_tokens=8))
    print(outputs[0].outputs[0].text)

`LLMEngine` is the step-through layer underneath (`add_request`, `step() -> StepReport`), and
`load_model` gives the bare model and tokenizer.
"""

from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.loading.loader import load_model
from engine.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "load_model"]
