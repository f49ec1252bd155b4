"""The proposer a `SpeculativeConfig` names, built for a target model (one place, so the engine
never compares method names itself)."""

from __future__ import annotations

from engine.config import SpeculativeConfig
from engine.speculative.proposer import Proposer


def make_proposer(config: SpeculativeConfig, target, tokenizer=None, engine_config=None,
                  num_threads: int = 1) -> Proposer:
    """The proposer `config.method` names, built for `target` (an engine.model.LlamaModel).
    engine_config (an EngineConfig): a draft model runs at the same `speed` and dtype as the
    target's engine, with its cache's block size."""
    if config.method == "ngram":
        from engine.speculative.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from engine.speculative.draft_model import draft_proposer

    return draft_proposer(config, target, tokenizer, engine_config, num_threads)
