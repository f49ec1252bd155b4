"""Checks for chapter 03: the KV cache formula, a cache update at given slots,
and capacity questions.

Each `check_<claim>(mod)` runs against the student's `exercises/ch03_kv_cache.py` or the reference
in `exercises/solutions/`. The formula is compared with real tensors' `.nbytes` and with
`engine.companions.memory`; the capacity answers are worked out by hand in the comments.
"""

from __future__ import annotations

import math

import torch

from engine.companions import memory
from engine.config import MODEL_PRESETS

GB = 10**9
REL_TOL = 1e-12  # products of integers (and 0.5): only float rounding may differ
# (layers, batch, tokens, kv_heads, head_dim): small cache shapes we can allocate for real
SMALL_CACHES = [(1, 1, 1, 1, 1), (2, 3, 5, 2, 8), (4, 2, 17, 4, 16), (3, 1, 64, 1, 32)]
TORCH_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)
# Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json): 32 layers, 8 KV heads, head dim 128.
L3_LAYERS, L3_KV_HEADS, HEAD_DIM = 32, 8, 128
FP16 = 2
CONTEXT_8K = 8192


def _assert_close(got, want, call: str) -> None:
    assert isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=REL_TOL), (
        f"{call} gave {got!r}, expected {want!r}")


# ---- the formula ---------------------------------------------------------------------------------


def check_kv_cache_bytes_equals_the_nbytes_of_a_real_cache(mod) -> None:
    for layers, batch, tokens, kv_heads, head_dim in SMALL_CACHES:
        for dtype in TORCH_DTYPES:
            # [L, K/V, B, T, Hkv, D]
            cache = torch.empty(layers, 2, batch, tokens, kv_heads, head_dim, dtype=dtype)
            got = mod.kv_cache_bytes(layers, batch, tokens, kv_heads, head_dim, dtype.itemsize)
            _assert_close(got, cache.nbytes,
                          f"kv_cache_bytes({layers}, {batch}, {tokens}, {kv_heads}, "
                          f"{head_dim}, {dtype.itemsize}) (a {dtype} tensor of that shape has "
                          f"{cache.nbytes} bytes)")


def check_kv_cache_bytes_matches_the_engine_on_every_preset(mod) -> None:
    for name, s in MODEL_PRESETS.items():
        L, Hkv, D = s.num_hidden_layers, s.num_key_value_heads, s.head_dim
        for batch, tokens, b in ((1, 1, 2), (32, CONTEXT_8K, 2), (4, 1000, 0.5), (2, 4096, 1)):
            want = memory.kv_cache_bytes(L, batch, tokens, Hkv, D, b)
            got = mod.kv_cache_bytes(L, batch, tokens, Hkv, D, b)
            _assert_close(got, want, f"kv_cache_bytes({name}: L={L}, B={batch}, T={tokens}, "
                          f"Hkv={Hkv}, D={D}, b={b})")


def check_llama3_8b_at_8k_tokens_for_1_and_32_sequences(mod) -> None:
    # Per token: 2 * 32 layers * 8 KV heads * 128 dims * 2 bytes = 131,072 bytes (128 KiB).
    # 8192 tokens: 131,072 * 8192 = 1,073,741,824 bytes (1 GiB, about 1.07 GB).
    # 32 sequences: 34,359,738,368 bytes (32 GiB, about 34.4 GB): twice the 16 GB of fp16 weights.
    one = mod.kv_cache_bytes(L3_LAYERS, 1, CONTEXT_8K, L3_KV_HEADS, HEAD_DIM, FP16)
    _assert_close(one, 1_073_741_824, "kv_cache_bytes(Llama-3-8B, 1 sequence of 8192 tokens, fp16)")
    many = mod.kv_cache_bytes(L3_LAYERS, 32, CONTEXT_8K, L3_KV_HEADS, HEAD_DIM, FP16)
    _assert_close(many, 34_359_738_368,
                  "kv_cache_bytes(Llama-3-8B, 32 sequences of 8192 tokens, fp16)")


def check_mha_caches_4x_more_than_gqa_and_mqa_8x_less(mod) -> None:
    # Same 32 layers and head dim 128. MHA (Llama-2-7B, 32 KV heads): 524,288 B per token, so
    # 4,294,967,296 at 8k (4 GiB). GQA (Llama-3-8B, 8): 1 GiB. MQA (1 KV head): 16,384 B per token,
    # 134,217,728 at 8k (128 MiB).
    for kv_heads, want, what in ((32, 4_294_967_296, "MHA, 32 KV heads"),
                                 (8, 1_073_741_824, "GQA, 8 KV heads"),
                                 (1, 134_217_728, "MQA, 1 KV head")):
        got = mod.kv_cache_bytes(L3_LAYERS, 1, CONTEXT_8K, kv_heads, HEAD_DIM, FP16)
        _assert_close(got, want,
                      f"kv_cache_bytes(32 layers, 8192 tokens, {what}, head dim 128, fp16)")


def check_the_cache_grows_linearly_with_context_and_layers(mod) -> None:
    # Llama-3-70B: 80 layers, 8 KV heads, head dim 128: 2 * 80 * 8 * 128 * 2 = 327,680 B per token.
    # 8192 tokens: 2,684,354,560; 32k tokens (4x): 10,737,418,240.
    for tokens, want in ((CONTEXT_8K, 2_684_354_560), (4 * CONTEXT_8K, 10_737_418_240)):
        got = mod.kv_cache_bytes(80, 1, tokens, 8, HEAD_DIM, FP16)
        _assert_close(got, want,
                      f"kv_cache_bytes(Llama-3-70B, 1 sequence of {tokens} tokens, fp16)")


def check_int8_halves_the_cache_and_int4_quarters_it(mod) -> None:
    # Llama-3-8B at 8k: fp16 1,073,741,824 -> int8 536,870,912 -> int4 (half a byte) 268,435,456.
    for b, want in ((1, 536_870_912), (0.5, 268_435_456)):
        got = mod.kv_cache_bytes(L3_LAYERS, 1, CONTEXT_8K, L3_KV_HEADS, HEAD_DIM, b)
        _assert_close(got, want,
                      f"kv_cache_bytes(Llama-3-8B, 8192 tokens, {b} byte(s) per element)")


# ---- writing into a cache ------------------------------------------------------------------------

B, SLOTS, KV_HEADS, DIM = 2, 8, 2, 4


def _cache_and_new(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # [B, S, Hkv, D]
    cache_k, cache_v = (torch.randn(B, SLOTS, KV_HEADS, DIM, generator=g) for _ in range(2))
    # [B, T, Hkv, D]
    k_new, v_new = (torch.randn(B, tokens, KV_HEADS, DIM, generator=g) for _ in range(2))
    return cache_k, cache_v, k_new, v_new


def _write_and_compare(mod, positions: list[list[int]], what: str) -> None:
    """Call write_kv, then compare every slot with the expected cache built one slot at a time."""
    cache_k, cache_v, k_new, v_new = _cache_and_new(len(positions[0]))
    want_k, want_v = cache_k.clone(), cache_v.clone()
    for b, row in enumerate(positions):
        for t, slot in enumerate(row):
            want_k[b, slot], want_v[b, slot] = k_new[b, t], v_new[b, t]
    before_k, before_v = cache_k.clone(), cache_v.clone()
    returned = mod.write_kv(cache_k, cache_v, k_new, v_new, torch.tensor(positions))
    call = f"write_kv(..., positions={positions}) ({what})"
    for name, got, want, before in (("cache_k", cache_k, want_k, before_k),
                                    ("cache_v", cache_v, want_v, before_v)):
        _assert_changed_in_place(call, name, got, before, returned)
        _assert_slots(call, name, got, want, before)


def _changed_slots(got: torch.Tensor, other: torch.Tensor) -> list[tuple[int, int]]:
    """The (sequence, slot) pairs where two [B, S, Hkv, D] caches differ."""
    return sorted({(b, s) for b, s, *_ in torch.nonzero(got != other).tolist()})


def _assert_changed_in_place(call: str, name: str, cache: torch.Tensor, before: torch.Tensor,
                             returned) -> None:
    """A cache left exactly as it was was written somewhere else (a copy), or not at all."""
    returned_note = "" if returned is None else " (it returned something: the caller ignores it)"
    assert _changed_slots(cache, before), (
        f"{call} left {name} exactly as it was{returned_note}: did you write it at all? Write "
        f"into the tensor you are given, in place (`{name} = ...` only rebinds your local "
        f"name, `{name}[...] = ...` changes the caller's tensor)")


def _assert_slots(call: str, name: str, got: torch.Tensor, want: torch.Tensor,
                  before: torch.Tensor) -> None:
    """Name the slots that should have changed and did not, and those that changed and should
    not have: the two halves of a wrong slot index."""
    to_write = set(_changed_slots(want, before))
    wrong = _changed_slots(got, want)
    missed = [slot for slot in wrong if slot in to_write]  # should hold a new token, does not
    stray = [slot for slot in wrong if slot not in to_write]  # should be untouched, is not
    problems = [f"{what} at (sequence, slot) {slots}" for what, slots in (
        ("lacks its new token", missed),
        ("was overwritten where it should keep its old value", stray)) if slots]
    assert not problems, (f"{call}: {name} " + "; and ".join(problems)
                          + ": cache_k[b, positions[b, t]] must become k_new[b, t]")


def check_write_kv_writes_each_token_at_its_slot(mod) -> None:
    _write_and_compare(mod, [[0, 1, 2], [0, 1, 2]], "a 3-token prefill into empty caches")
    _write_and_compare(mod, [[5], [5]], "one decode step at slot 5")


def check_write_kv_handles_sequences_at_different_lengths(mod) -> None:
    _write_and_compare(mod, [[3, 4], [0, 1]], "sequence 0 has 3 tokens cached, sequence 1 none")


def check_write_kv_leaves_every_other_slot_untouched(mod) -> None:
    # Slots written out of order and wrapping around, as in a sliding-window ring buffer
    # (slot = pos % 8).
    _write_and_compare(mod, [[7, 0], [6, 7]], "a ring buffer wrapping around")


def check_write_kv_writes_in_place(mod) -> None:
    # In place means the caller's tensors change. WHERE they change is the other checks' business:
    # a write at the wrong slots fails those, with the slots named, not this one.
    cache_k, cache_v, k_new, v_new = _cache_and_new(1, seed=1)
    before = {"cache_k": cache_k.clone(), "cache_v": cache_v.clone()}
    returned = mod.write_kv(cache_k, cache_v, k_new, v_new, torch.tensor([[2], [2]]))
    for name, cache in (("cache_k", cache_k), ("cache_v", cache_v)):
        _assert_changed_in_place("write_kv(..., positions=[[2], [2]])", name, cache, before[name],
                                 returned)


# ---- capacity ------------------------------------------------------------------------------------

L3_WEIGHTS_GB = 16.06  # 8,030,261,248 params * 2 bytes = 16.06 GB in fp16
L3_KV_PER_TOKEN = 131_072


def check_max_sequences_of_llama3_8b_at_8k_on_80_and_24_gb(mod) -> None:
    # One 8k sequence: 1,073,741,824 bytes. 80 GB card: (80 - 16.06) * 10**9 = 63.94e9 bytes free
    # -> 63.94e9 / 1,073,741,824 = 59.5 -> 59 sequences. 24 GB: 7.94e9 / 1,073,741,824 = 7.39 -> 7.
    for gpu, want in ((80, 59), (24, 7)):
        got = mod.max_sequences(gpu, L3_WEIGHTS_GB, L3_KV_PER_TOKEN, CONTEXT_8K)
        assert got == want, (f"max_sequences({gpu} GB, weights {L3_WEIGHTS_GB} GB, 131072 B/token, "
                             f"8192 tokens) gave {got!r}, expected {want}")


def check_max_sequences_gains_from_smaller_weights_and_gqa(mod) -> None:
    # int4 weights (4.015 GB) on 24 GB: 19.985e9 / 1,073,741,824 = 18.6 -> 18 sequences.
    got = mod.max_sequences(24, 4.015, L3_KV_PER_TOKEN, CONTEXT_8K)
    assert got == 18, (
        f"max_sequences(24 GB, int4 weights 4.015 GB, Llama-3-8B, 8k) gave {got!r}, expected 18")
    # Llama-2-7B (MHA, 524,288 B/token, 13.48 GB of fp16 weights) on 80 GB:
    # 66.52e9 / 4,294,967,296 = 15.5 -> 15 sequences, a quarter of Llama-3-8B's 59
    # despite smaller weights.
    got = mod.max_sequences(80, 13.48, 524_288, CONTEXT_8K)
    assert got == 15, (
        f"max_sequences(80 GB, Llama-2-7B fp16 13.48 GB, 524288 B/token, 8k) gave {got!r}, "
        "expected 15")


def check_max_sequences_is_zero_when_the_weights_do_not_fit(mod) -> None:
    # Llama-3-70B in fp16 needs 141.1 GB of weights: nothing fits on a 141 GB (or 80 GB) card.
    for gpu in (80, 141):
        got = mod.max_sequences(gpu, 141.1, 327_680, CONTEXT_8K)
        assert got == 0, f"max_sequences({gpu} GB, weights 141.1 GB, ...) gave {got!r}, expected 0"


def check_max_sequences_matches_the_engine_without_reserve(mod) -> None:
    for name, s in MODEL_PRESETS.items():
        weights_gb = memory.weight_bytes(s, "fp16") / GB
        per_token = memory.kv_bytes_per_token(s, "fp16")
        for gpu in memory.GPU_MEMORY_GB.values():
            for context in (1024, CONTEXT_8K):
                # Mistral caches at most its window
                cached = memory.cached_tokens_per_sequence(s, context)
                got = mod.max_sequences(gpu, weights_gb, per_token, cached)
                if weights_gb >= gpu:
                    want = 0
                else:
                    want = memory.max_concurrent_sequences(s, gpu * GB, context, "fp16", "fp16",
                                                           reserve_fraction=0)
                assert got == want, (
                    f"max_sequences({gpu} GB, {name} weights {weights_gb:.3f} GB, "
                    f"{per_token} B/token, {cached} tokens) gave {got!r}, expected {want}")
