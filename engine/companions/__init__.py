"""Calculators and chapter companions: code a chapter reads or plots, off the request path.

    naive.py      chapter 01's uncached generation loop: the oracle every cached path must equal
    kv_cache.py   chapter 03's contiguous and sliding-window caches
    memory.py     bytes of weights, KV and activations; capacity planning
    roofline.py   FLOPs, bytes and the roofline of your machine
    timing.py     medians of repeated timings
    metrics.py    TTFT, TPOT, ITL, E2E, goodput, percentiles and buckets, computed from a trace
    placement.py  which TP/PP/replica layouts fit a model on given devices
"""
