"""Chapter 08: one model split across processes. These are runner variants: they sit BELOW the
engine and implement the same `execute(moves, work, block_manager)` as `engine.runner.ModelRunner`.

    comm.py             a gloo process group (NCCL's place on GPUs) and the bytes every
                        collective moves
    tensor_parallel.py  column- and row-parallel layers, vocab-parallel embedding and LM head
    pipeline.py         stages of layers, micro-batches, the bubble
    executor.py         rank 0 broadcasts each step's plan; every rank runs its share

The engine switches them on by configuration: `LLM("tinylab", tensor_parallel_size=2)`.
Replicas of the whole engine behind a router live ABOVE the engine, in `engine/replicas/`.
"""
