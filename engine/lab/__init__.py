"""The lab: everything around the engine that is not on a request's path.

    tasks.py          the task suite (arith, recall, json, refuse, story): generators and scorers
    training.py       tinylab's trainer (`python -m engine train-tinylab`)
    eval.py           a model on the task suite (`python -m engine eval`)
    workloads.py      traffic: realistic request lengths, and `run_arrivals`, the arrivals driver
    inspect_model.py  parameter and tokenization tables of chapter 00
    demo.py           `python -m engine demo`: the task demo and the step-through of the scheduler

The request path (tokenizer -> LLMEngine -> scheduler -> block manager -> runner -> model ->
sampler) never imports from here; the lab imports the engine, never the other way round.
"""
