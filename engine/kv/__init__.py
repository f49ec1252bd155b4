"""The KV cache's bookkeeping and storage (chapters 04 and 06), part of the spine.

    block_manager.py  every block table (device, CPU swap, host tier), ref counts, copy-on-write,
                      waste, and ``rollback`` of a sequence's last slots
    prefix_cache.py   the chained hash keys of full blocks, and the evictor of free-but-cached
                      blocks
    evictor.py        the ``Evictor`` protocol: which free-but-cached block goes first (LRU, FIFO)
    kv_pool.py        the paged K/V tensors themselves and the block copies the scheduler asks for

The block manager knows nothing of tensors' values; the pool knows nothing of requests.
"""
