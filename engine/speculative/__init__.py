"""Chapter 12: speculative decoding. Cheap guesses, verified by one step of the real model.

A decode step reads every weight once to produce ONE token per request. On a machine where that
read is the cost (decode is bandwidth-bound, chapter 02), feeding k + 1 tokens instead of one costs
about the same step, so if someone can guess the next k tokens, one step checks them all:

    output so far   ... the cat sat          last token "sat" not yet fed
    proposer        guesses  on  the  mat     (k = 3, cheap: a lookup, a small model)
    target step     feeds    sat on  the  mat   -> logits at 4 positions, one forward
    target says     on   the  rug   .          (its own choice after each fed token)
    accepted        on   the                   the guesses up to the first disagreement
    emitted         on   the  rug              + the target's token where they disagreed
                                               (all k accepted: + the "bonus" token after them)

Greedy outputs are exactly the ones plain decoding gives (the target chooses every emitted token),
and with sampling the rejection rule keeps the target's distribution exactly (`rejection.py`).

    proposer.py     the Proposer protocol and what a proposer sees; registry.py builds the one a
                    config names
    speculator.py   the engine's side before each step: how many guesses, from whom, and when none
    ngram.py        prompt lookup: copy what followed the last n tokens earlier in the text
    draft_model.py  a smaller model (or the target's first layers) with its own paged KV cache
    rejection.py    verification: accept a prefix of the guesses, exactly

The engine's side: the Speculator proposes before scheduling (speculator.py), the scheduler
budgets k + 1 tokens for a request with guesses (engine/scheduler.py), the runner feeds them as
k + 1 decode rows of one sequence (engine/runner.py), and the engine verifies them and has the
block manager roll back the slots of rejected guesses (engine/llm_engine.py's `_accept`,
engine/kv/block_manager.py's `rollback`).
"""
