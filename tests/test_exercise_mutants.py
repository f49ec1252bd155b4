"""Mutation tests for the exercise checks: the mistakes students really make must fail a check.

A mutant is a reference solution with one plausible mistake patched into its source: `old` text
replaced by `new` text inside one function. `old` must occur exactly once in that function, so a
mutant whose solution changed under it fails loudly instead of silently testing nothing. Each
mutant names the check that catches it (the table in exercises/README.md lists them); the test runs
that check against the mutated module and demands that it fail.

    python tests/test_exercise_mutants.py     # print the README table: every check each mutant fails
"""

from __future__ import annotations

import inspect
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

import exercises

MIN_MUTANTS_PER_FUNCTION = 3  # the issue asks for 3-6 plausible mistakes per solution function
README = Path(exercises.PACKAGE_DIR) / "README.md"


@dataclass(frozen=True)
class Mutant:
    chapter: str
    function: str  # the solution function (or class) the mistake is in
    mistake: str  # what the student got wrong, in words
    old: str
    new: str
    caught_by: str  # the check that must fail on it (its claim, without "check_")

    @property
    def id(self) -> str:
        return f"{self.chapter}-{self.function}-{self.mistake}"


def _m(chapter, function, mistake, old, new, caught_by):
    return Mutant(chapter, function, mistake, old, new, caught_by)


OLD_TOP_P = '''    sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # [..., V]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [..., V]
    # mass of the more likely tokens
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # [..., 1]: the boundary token is the last one
    n_keep = (mass_before < p).sum(dim=-1, keepdim=True)
    boundary = sorted_logits.gather(-1, n_keep - 1)  # [..., 1], the boundary token's logit
    return logits.masked_fill(logits < boundary, NEG_INF)  # comparing values keeps every tie'''
BY_SORT_POSITION = '''    sorted_probs, order = torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
    drop_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= p
    return logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), NEG_INF)'''
APPEND_THEN_STOP = '''        ids.append(token)
        new_ids.append(token)
        if token == eos_id:
            break'''
STOP_THEN_APPEND = '''        if token == eos_id:
            break
        ids.append(token)
        new_ids.append(token)'''
WRITE_K_AND_V = '''    cache_k[rows, positions] = k_new  # cache_k[rows, positions] is [B, T, Hkv, D]
    cache_v[rows, positions] = v_new'''
RUN_IF_IT_FITS = '''        if tokens <= budget and need <= blocks:
            ran.append(rid)
            budget, blocks = budget - tokens, blocks - need'''

MUTANTS = [
    # ---- ch01: sampling filters and the naive loop ------------------------------------------------
    _m("ch01", "apply_temperature", "multiplies by t", "logits / temperature", "logits * temperature",
       "apply_temperature_divides_the_logits"),
    _m("ch01", "apply_temperature", "divides in place", "return logits / temperature",
       "logits /= temperature\n    return logits", "apply_temperature_divides_the_logits"),
    _m("ch01", "apply_temperature", "softmax before temperature", "return logits / temperature",
       "return torch.softmax(logits, dim=-1) / temperature", "apply_temperature_divides_the_logits"),
    _m("ch01", "top_k_filter", "drops the k-th (<= instead of <)", "logits < kth_largest", "logits <= kth_largest",
       "top_k_keeps_ties_at_the_boundary"),
    _m("ch01", "top_k_filter", "keeps exactly k (ties broken by index)",
       "    return logits.masked_fill(logits < kth_largest, NEG_INF)",
       "    keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, torch.topk(logits, k, dim=-1).indices, "
       "True)\n    return logits.masked_fill(~keep, NEG_INF)",
       "top_k_keeps_ties_at_the_boundary"),
    _m("ch01", "top_k_filter", "keeps k - 1 tokens", "torch.topk(logits, k, dim=-1)",
       "torch.topk(logits, k - 1, dim=-1)", "top_k_matches_the_engine_on_random_logits"),
    _m("ch01", "top_k_filter", "k = 0 / -1 not treated as off", "if k <= 0 or k >= logits.shape[-1]:",
       "if k >= logits.shape[-1]:", "top_k_is_off_for_0_minus_1_and_k_at_least_vocab"),
    _m("ch01", "top_k_filter", "top-k over the batch axis", "torch.topk(logits, k, dim=-1)",
       "torch.topk(logits, k, dim=0)", "top_k_matches_the_engine_on_random_logits"),
    _m("ch01", "top_p_filter", "drops the boundary token", "(mass_before < p)",
       "(mass_before + sorted_probs < p)", "top_p_keeps_the_boundary_token"),
    _m("ch01", "top_p_filter", "decides by sort position (drops tokens tied with the boundary)", OLD_TOP_P,
       BY_SORT_POSITION, "top_p_keeps_every_token_tied_with_the_boundary"),
    _m("ch01", "top_p_filter", "no shortcut for p = 1 (float rounding drops tokens)",
       "    if p >= 1.0:  # skip the arithmetic: float rounding could drop tokens of tiny probability\n"
       "        return logits.clone()\n", "", "top_p_of_one_keeps_every_token"),
    _m("ch01", "top_p_filter", "sorts ascending", "descending=True", "descending=False",
       "top_p_keeps_the_boundary_token"),
    _m("ch01", "top_p_filter", "keeps one token past the boundary", "gather(-1, n_keep - 1)",
       "gather(-1, torch.clamp(n_keep, max=logits.shape[-1] - 1))", "top_p_keeps_the_boundary_token"),
    _m("ch01", "top_p_filter", "softmax over the batch axis", "torch.softmax(sorted_logits, dim=-1)",
       "torch.softmax(sorted_logits, dim=0)", "top_p_matches_the_engine_on_random_logits"),
    _m("ch01", "min_p_filter", "drops a probability equal to the threshold", "probs < threshold",
       "probs <= threshold", "min_p_drops_tokens_below_a_fraction_of_the_top"),
    _m("ch01", "min_p_filter", "absolute threshold (not relative to the top)",
       "min_p * probs.max(dim=-1, keepdim=True).values", "min_p",
       "min_p_drops_tokens_below_a_fraction_of_the_top"),
    _m("ch01", "min_p_filter", "threshold from the top logit, not the top probability", "min_p * probs.max(",
       "min_p * logits.max(", "min_p_matches_the_engine_on_random_logits"),
    _m("ch01", "min_p_filter", "one max over the whole batch", "probs.max(dim=-1, keepdim=True).values",
       "probs.max()", "min_p_matches_the_engine_on_random_logits"),
    _m("ch01", "min_p_filter", "max without keepdim", "keepdim=True", "keepdim=False",
       "min_p_matches_the_engine_on_random_logits"),
    _m("ch01", "naive_generate", "samples instead of taking the argmax", "int(torch.argmax(logits))",
       "int(torch.multinomial(torch.softmax(logits, dim=-1), 1))", "naive_generate_takes_the_argmax_on_near_ties"),
    _m("ch01", "naive_generate", "samples with a fixed seed (deterministic, still not greedy)",
       "int(torch.argmax(logits))",
       "int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=torch.Generator().manual_seed(0)))",
       "naive_generate_takes_the_argmax_on_near_ties"),
    _m("ch01", "naive_generate", "appends to the caller's prompt list", "ids = list(prompt_ids)", "ids = prompt_ids",
       "naive_generate_leaves_the_prompt_alone"),
    _m("ch01", "naive_generate", "stops before appending eos", APPEND_THEN_STOP, STOP_THEN_APPEND,
       "naive_generate_stops_after_eos"),
    _m("ch01", "naive_generate", "stops on an eos in the prompt", "if token == eos_id:", "if eos_id in ids:",
       "naive_generate_stops_after_eos"),
    _m("ch01", "naive_generate", "feeds only the last token", "next_token_logits_fn(list(ids))",
       "next_token_logits_fn(ids[-1:])", "naive_generate_feeds_the_whole_sequence_every_step"),
    _m("ch01", "naive_generate", "one token too many", "range(max_new_tokens)", "range(max_new_tokens + 1)",
       "naive_generate_respects_max_new_tokens"),
    _m("ch01", "naive_generate", "returns the prompt too", "return new_ids", "return ids",
       "naive_generate_is_greedy"),
    # ---- ch02: FLOPs, bytes, the roofline ----------------------------------------------------------
    _m("ch02", "decode_step_flops", "1 FLOP per parameter", "FLOPS_PER_MAC * matmul_params * batch",
       "matmul_params * batch", "decode_step_flops_of_llama2_7b_by_hand"),
    _m("ch02", "decode_step_flops", "matmuls once per batch, not per sequence",
       "FLOPS_PER_MAC * matmul_params * batch", "FLOPS_PER_MAC * matmul_params",
       "decode_step_flops_match_the_engine"),
    _m("ch02", "decode_step_flops", "attention counts only q.k (2 D)", "ATTENTION_FLOPS_PER_PAIR_PER_DIM * layers",
       "FLOPS_PER_MAC * layers", "decode_step_flops_of_llama2_7b_by_hand"),
    _m("ch02", "decode_step_flops", "leaves attention out", "return matmuls + attention", "return matmuls",
       "decode_step_flops_of_llama2_7b_by_hand"),
    _m("ch02", "decode_step_flops", "attention in one layer only", "* layers * heads", "* heads",
       "decode_step_flops_of_llama2_7b_by_hand"),
    _m("ch02", "decode_step_bytes", "weights read once per sequence", "weight_params * weight_bytes +",
       "weight_params * weight_bytes * batch +", "decode_step_bytes_read_the_weights_once_per_batch"),
    _m("ch02", "decode_step_bytes", "forgets the new token's KV write", " + kv_per_token * 1", "",
       "decode_step_bytes_of_llama2_7b_by_hand"),
    _m("ch02", "decode_step_bytes", "K only (no factor 2)", "KV_TENSORS * layers * batch", "layers * batch",
       "decode_step_bytes_of_llama2_7b_by_hand"),
    _m("ch02", "decode_step_bytes", "KV in the weights' dtype", "head_dim * kv_bytes", "head_dim * weight_bytes",
       "decode_step_bytes_match_the_engine"),
    _m("ch02", "decode_step_bytes", "one sequence's KV for the whole batch", "layers * batch * kv_heads",
       "layers * kv_heads", "decode_step_bytes_read_the_weights_once_per_batch"),
    _m("ch02", "arithmetic_intensity", "bytes per FLOP", "return flops / bytes_moved", "return bytes_moved / flops",
       "arithmetic_intensity_is_flops_per_byte"),
    _m("ch02", "arithmetic_intensity", "integer division", "return flops / bytes_moved",
       "return flops // bytes_moved", "arithmetic_intensity_is_flops_per_byte"),
    _m("ch02", "arithmetic_intensity", "multiply-adds per byte", "return flops / bytes_moved",
       "return flops / 2 / bytes_moved", "arithmetic_intensity_is_flops_per_byte"),
    _m("ch02", "classify", "the ridge point on the bandwidth side", "intensity >= ridge", "intensity > ridge",
       "classify_puts_the_ridge_point_on_the_compute_side"),
    _m("ch02", "classify", "ridge = bandwidth / peak", "peak_flops / bandwidth_bytes_per_s",
       "bandwidth_bytes_per_s / peak_flops", "classify_puts_the_ridge_point_on_the_compute_side"),
    _m("ch02", "classify", "labels swapped", '"compute-bound" if intensity >= ridge else "bandwidth-bound"',
       '"bandwidth-bound" if intensity >= ridge else "compute-bound"',
       "classify_puts_the_ridge_point_on_the_compute_side"),
    _m("ch02", "classify", "compares with the peak, not the ridge", "intensity >= ridge", "intensity >= peak_flops",
       "classify_puts_the_ridge_point_on_the_compute_side"),
    # ---- ch03: the KV cache formula, writing a cache, capacity ---------------------------------------
    _m("ch03", "kv_cache_bytes", "K only (no factor 2)", "KV_TENSORS * layers", "layers",
       "kv_cache_bytes_equals_the_nbytes_of_a_real_cache"),
    _m("ch03", "kv_cache_bytes", "rounds half a byte down", "* dtype_bytes", "* int(dtype_bytes)",
       "int8_halves_the_cache_and_int4_quarters_it"),
    _m("ch03", "kv_cache_bytes", "forgets the batch", "layers * batch * tokens", "layers * tokens",
       "kv_cache_bytes_equals_the_nbytes_of_a_real_cache"),
    _m("ch03", "kv_cache_bytes", "returns GiB", "* head_dim * dtype_bytes", "* head_dim * dtype_bytes / 2**30",
       "kv_cache_bytes_equals_the_nbytes_of_a_real_cache"),
    _m("ch03", "write_kv", "the first sequence's positions for every sequence", WRITE_K_AND_V,
       "    cache_k[:, positions[0]] = k_new\n    cache_v[:, positions[0]] = v_new",
       "write_kv_handles_sequences_at_different_lengths"),
    _m("ch03", "write_kv", "writes token t at slot t", WRITE_K_AND_V,
       "    cache_k[:, :k_new.shape[1]] = k_new\n    cache_v[:, :v_new.shape[1]] = v_new",
       "write_kv_writes_each_token_at_its_slot"),
    _m("ch03", "write_kv", "writes into a copy", WRITE_K_AND_V,
       "    cache_k = cache_k.index_put((rows.expand_as(positions), positions), k_new)\n"
       "    cache_v = cache_v.index_put((rows.expand_as(positions), positions), v_new)",
       "write_kv_writes_in_place"),
    _m("ch03", "write_kv", "forgets V", "\n    cache_v[rows, positions] = v_new", "",
       "write_kv_writes_each_token_at_its_slot"),
    _m("ch03", "write_kv", "one slot off", WRITE_K_AND_V,
       "    cache_k[rows, positions + 1] = k_new\n    cache_v[rows, positions + 1] = v_new",
       "write_kv_writes_each_token_at_its_slot"),
    _m("ch03", "write_kv", "K and V swapped", WRITE_K_AND_V,
       "    cache_k[rows, positions] = v_new\n    cache_v[rows, positions] = k_new",
       "write_kv_writes_each_token_at_its_slot"),
    _m("ch03", "max_sequences", "rounds up", "math.floor(", "math.ceil(",
       "max_sequences_of_llama3_8b_at_8k_on_80_and_24_gb"),
    _m("ch03", "max_sequences", "GiB instead of spec-sheet GB", "* BYTES_PER_GB", "* 2**30",
       "max_sequences_of_llama3_8b_at_8k_on_80_and_24_gb"),
    _m("ch03", "max_sequences", "negative when the weights do not fit",
       "return max(0, math.floor(free_bytes / per_sequence))", "return math.floor(free_bytes / per_sequence)",
       "max_sequences_is_zero_when_the_weights_do_not_fit"),
    _m("ch03", "max_sequences", "forgets the weights", "(gpu_gb - weights_gb)", "gpu_gb",
       "max_sequences_of_llama3_8b_at_8k_on_80_and_24_gb"),
    _m("ch03", "max_sequences", "rounds to nearest", "math.floor(", "round(",
       "max_sequences_of_llama3_8b_at_8k_on_80_and_24_gb"),
    # ---- ch04: allocator, slots, growth, fork, waste ---------------------------------------------------
    _m("ch04", "BlockAllocator", "hands out from the back", "self._free.popleft()", "self._free.pop()",
       "allocator_hands_out_every_block_once_then_raises"),
    _m("ch04", "BlockAllocator", "puts freed blocks at the front", "self._free.append(block)",
       "self._free.appendleft(block)", "allocator_matches_the_engine_on_random_operations"),
    _m("ch04", "BlockAllocator", "frees a shared block at once", "self._refcount[block] -= 1",
       "self._refcount[block] = 0", "allocator_frees_a_shared_block_only_when_the_last_owner_lets_go"),
    _m("ch04", "BlockAllocator", "no double-free check", "self._check_held(block)\n        self._refcount[block] -= 1",
       "self._check_id(block)\n        self._refcount[block] -= 1", "allocator_refuses_a_double_free_and_unknown_ids"),
    _m("ch04", "BlockAllocator", "incref of a free block allowed",
       "self._check_held(block)\n        self._refcount[block] += 1",
       "self._check_id(block)\n        self._refcount[block] += 1", "allocator_refuses_a_double_free_and_unknown_ids"),
    _m("ch04", "BlockAllocator", "negative ids index from the end", "if not 0 <= block < self.num_blocks:",
       "if block >= self.num_blocks:", "allocator_refuses_a_double_free_and_unknown_ids"),
    _m("ch04", "BlockAllocator", "allocate_many takes some, then raises",
       "        if n > len(self._free):  # all or nothing: check before taking the first one\n"
       "            raise NoFreeBlocksError(needed=n, free=len(self._free))\n", "",
       "allocate_many_takes_all_or_nothing"),
    _m("ch04", "BlockAllocator", "num_used sums refcounts", "return self.num_blocks - len(self._free)",
       "return sum(self._refcount)", "allocator_matches_the_engine_on_random_operations"),
    _m("ch04", "slot_mapping", "block and offset swapped",
       "block_table[p // block_size] * block_size + p % block_size",
       "block_table[p % block_size] * block_size + p // block_size", "slot_mapping_of_the_worked_example"),
    _m("ch04", "slot_mapping", "logical block instead of physical", "block_table[p // block_size] * block_size",
       "(p // block_size) * block_size", "slot_mapping_of_the_worked_example"),
    _m("ch04", "slot_mapping", "scales by the table length", "* block_size + p % block_size",
       "* len(block_table) + p % block_size", "slot_mapping_of_the_worked_example"),
    _m("ch04", "append_tokens", "floor instead of ceiling", "needed = math.ceil(", "needed = math.floor(",
       "append_tokens_crosses_a_block_boundary"),
    _m("ch04", "append_tokens", "new blocks for the new tokens only (ignores the partly filled last block)",
       "math.ceil((num_tokens + new_tokens) / block_size) - len(block_table)", "math.ceil(new_tokens / block_size)",
       "append_tokens_fills_the_last_block_before_taking_a_new_one"),
    _m("ch04", "append_tokens", "extends the caller's table",
       "return [*block_table, *(allocate_fn() for _ in range(needed))]",
       "block_table.extend(allocate_fn() for _ in range(needed))\n    return block_table",
       "append_tokens_crosses_a_block_boundary"),
    _m("ch04", "append_tokens", "reserves the next token's slot too", "(num_tokens + new_tokens) / block_size",
       "(num_tokens + new_tokens + 1) / block_size", "append_tokens_fills_the_last_block_before_taking_a_new_one"),
    _m("ch04", "fork_copy_on_write", "forgets the refcounts on fork",
       "    for block in child:  # the fork: one more table holds each block\n        allocator.incref(block)\n", "",
       "fork_copies_a_shared_partly_filled_last_block"),
    _m("ch04", "fork_copy_on_write", "keeps its reference to the swapped-out block (a leak)",
       "        allocator.free(child[-1])  # the child lets go; the parent still holds the shared block\n", "",
       "fork_copies_a_shared_partly_filled_last_block"),
    _m("ch04", "fork_copy_on_write", "frees the shared block for everyone", "        allocator.free(child[-1])  #",
       "        allocator.free(child[-1])\n        allocator.free(child[-1])  #",
       "fork_copies_a_shared_partly_filled_last_block"),
    _m("ch04", "fork_copy_on_write", "copies a full last block too", "if new_tokens and num_tokens % block_size != 0:",
       "if new_tokens:", "fork_shares_full_blocks_without_copying"),
    _m("ch04", "fork_copy_on_write", "copies even when the child writes nothing",
       "if new_tokens and num_tokens % block_size != 0:", "if num_tokens % block_size != 0:",
       "fork_shares_full_blocks_without_copying"),
    _m("ch04", "fork_copy_on_write", "reports (dst, src)", "copies.append((child[-1], copy))",
       "copies.append((copy, child[-1]))", "fork_copies_a_shared_partly_filled_last_block"),
    _m("ch04", "fork_copy_on_write", "edits the parent's table", "child, copies = list(block_table), []",
       "child, copies = block_table, []", "fork_copies_a_shared_partly_filled_last_block"),
    _m("ch04", "expected_waste_slots", "BS / 2", "(block_size - 1) / 2", "block_size / 2",
       "expected_waste_is_the_average_over_a_full_period_of_lengths"),
    _m("ch04", "expected_waste_slots", "(BS + 1) / 2", "(block_size - 1) / 2", "(block_size + 1) / 2",
       "expected_waste_is_the_average_over_a_full_period_of_lengths"),
    _m("ch04", "expected_waste_slots", "integer division", "(block_size - 1) / 2", "(block_size - 1) // 2",
       "expected_waste_is_the_average_over_a_full_period_of_lengths"),
    _m("ch04", "contiguous_waste", "the batch's longest sequence instead of the reserved length",
       "sum(max_len - n for n in lengths)", "sum(max(lengths) - n for n in lengths)",
       "contiguous_waste_of_a_small_batch"),
    _m("ch04", "contiguous_waste", "counts the used slots", "sum(max_len - n for n in lengths)",
       "sum(n for n in lengths)", "contiguous_waste_of_a_small_batch"),
    _m("ch04", "contiguous_waste", "one reservation for the whole batch", "sum(max_len - n for n in lengths)",
       "max_len - sum(lengths)", "contiguous_waste_of_a_small_batch"),
    _m("ch04", "paged_waste", "floor instead of ceiling", "math.ceil(n / block_size)", "(n // block_size)",
       "paged_waste_of_a_small_batch_and_of_the_engine"),
    _m("ch04", "paged_waste", "a full last block counted as empty", "math.ceil(n / block_size) * block_size - n",
       "block_size - n % block_size", "paged_waste_of_a_small_batch_and_of_the_engine"),
    _m("ch04", "paged_waste", "counts every reserved slot", "math.ceil(n / block_size) * block_size - n",
       "math.ceil(n / block_size) * block_size", "paged_waste_of_a_small_batch_and_of_the_engine"),
    _m("ch04", "concurrency_gain", "ignores the waste", "(mean_len + expected_waste_slots(block_size))",
       "mean_len", "concurrency_gain_of_paging"),
    _m("ch04", "concurrency_gain", "upside down", "max_len / (mean_len + expected_waste_slots(block_size))",
       "(mean_len + expected_waste_slots(block_size)) / max_len", "concurrency_gain_of_paging"),
    _m("ch04", "concurrency_gain", "a whole block wasted per sequence", "mean_len + expected_waste_slots(block_size)",
       "mean_len + block_size", "concurrency_gain_of_paging"),
    # ---- ch05: scheduling, preemption, TTFT/TPOT, static batching ------------------------------------
    _m("ch05", "schedule_step", "later requests overtake one that does not fit (FCFS violated)",
       "break  # FCFS", "continue  # FCFS", "schedule_step_admits_until_the_first_request_that_does_not_fit"),
    _m("ch05", "schedule_step", "seats counted for the requests that ran only", "len(running) + len(admitted)",
       "len(ran) + len(admitted)", "schedule_step_counts_every_running_request_against_max_num_seqs"),
    _m("ch05", "schedule_step", "one seat too many", ">= max_num_seqs", "> max_num_seqs",
       "schedule_step_counts_every_running_request_against_max_num_seqs"),
    _m("ch05", "schedule_step", "stops at the first running request that does not fit", RUN_IF_IT_FITS,
       "        if tokens > budget or need > blocks:\n            break\n        ran.append(rid)\n"
       "        budget, blocks = budget - tokens, blocks - need",
       "schedule_step_lets_a_running_request_sit_out_and_keeps_going"),
    _m("ch05", "schedule_step", "running requests ignore the free blocks", "if tokens <= budget and need <= blocks:",
       "if tokens <= budget:", "schedule_step_lets_a_running_request_sit_out_and_keeps_going"),
    _m("ch05", "schedule_step", "a request that fills the budget exactly is refused", "or tokens > budget or",
       "or tokens >= budget or", "schedule_step_lets_a_running_request_sit_out_and_keeps_going"),
    _m("ch05", "schedule_step", "running requests use no budget or blocks", RUN_IF_IT_FITS,
       "        if tokens <= budget and need <= blocks:\n            ran.append(rid)",
       "schedule_step_admits_until_the_first_request_that_does_not_fit"),
    _m("ch05", "choose_victim", "preempts the highest priority", "(candidates[i][1], candidates[i][2], i)",
       "(-candidates[i][1], candidates[i][2], i)", "choose_victim_takes_the_lowest_priority_then_the_latest_arrival"),
    _m("ch05", "choose_victim", "preempts the earliest arrival", "(candidates[i][1], candidates[i][2], i)",
       "(candidates[i][1], -candidates[i][2], i)", "choose_victim_takes_the_lowest_priority_then_the_latest_arrival"),
    _m("ch05", "choose_victim", "exact ties go to the first in the list", "(candidates[i][1], candidates[i][2], i)",
       "(candidates[i][1], candidates[i][2], -i)", "choose_victim_takes_the_lowest_priority_then_the_latest_arrival"),
    _m("ch05", "choose_victim", "arrival before priority", "(candidates[i][1], candidates[i][2], i)",
       "(candidates[i][2], candidates[i][1], i)", "choose_victim_takes_the_lowest_priority_then_the_latest_arrival"),
    _m("ch05", "ttft_and_tpot", "TPOT divides by every token", "/ (tokens[rid] - 1)", "/ tokens[rid]",
       "ttft_and_tpot_of_a_hand_made_trace"),
    _m("ch05", "ttft_and_tpot", "TTFT at the first step scheduled (a prefill chunk makes no token)",
       'if s["tokens_out"] > 0 and rid in arrival:', "if rid in arrival:", "ttft_and_tpot_of_a_hand_made_trace"),
    _m("ch05", "ttft_and_tpot", "times from the step's start", 'first.setdefault(rid, step["end_time"])',
       'first.setdefault(rid, step["start_time"])', "ttft_and_tpot_of_a_hand_made_trace"),
    _m("ch05", "ttft_and_tpot", "TPOT of a single token (0 / 0)", "done = rid in finish and tokens[rid] >= 2",
       "done = rid in finish", "ttft_and_tpot_of_a_hand_made_trace"),
    _m("ch05", "ttft_and_tpot", "TPOT counted from the arrival", "(finish[rid] - t_first)",
       "(finish[rid] - arrival[rid])", "ttft_and_tpot_of_a_hand_made_trace"),
    _m("ch05", "static_idle_fraction", "the last batch holds only its own seats",
       "max_num_seqs * max(lengths[i:i + max_num_seqs])",
       "len(lengths[i:i + max_num_seqs]) * max(lengths[i:i + max_num_seqs])", "static_idle_fraction_by_hand"),
    _m("ch05", "static_idle_fraction", "the longest request of all, not of the batch",
       "max(lengths[i:i + max_num_seqs])", "max(lengths)", "static_idle_fraction_by_hand"),
    _m("ch05", "static_idle_fraction", "returns the busy share", "return 1.0 - sum(lengths) / held",
       "return sum(lengths) / held", "static_idle_fraction_by_hand"),
    _m("ch05", "static_idle_fraction", "batches sorted by length", "lengths = list(output_lengths)",
       "lengths = sorted(output_lengths)", "static_idle_fraction_by_hand"),
    _m("ch05", "static_idle_fraction", "no check of the lengths", "if not lengths or min(lengths) < 1:",
       "if False:", "static_idle_fraction_by_hand"),
    # ---- ch06: block hashes, the longest cached prefix, the bug zoo ------------------------------------
    _m("ch06", "block_hash", "leaves the parent out (no chain)",
       "parent if parent is not None else root_hash(extra_keys)", "root_hash(extra_keys)",
       "block_hash_matches_the_engine"),
    _m("ch06", "block_hash", "leaves the extra keys out", "else root_hash(extra_keys)", 'else "00" * 32',
       "block_hash_matches_the_engine"),
    _m("ch06", "block_hash", "big-endian token ids (other bytes, other hash)", 'f"<{len(token_ids)}q"',
       'f">{len(token_ids)}q"', "block_hash_matches_the_engine"),
    _m("ch06", "block_hash", "32-bit token ids (other bytes, other hash)", 'f"<{len(token_ids)}q"',
       'f"<{len(token_ids)}i"', "block_hash_matches_the_engine"),
    _m("ch06", "block_hash", "Python's salted hash() instead of sha256",
       'return hashlib.sha256(start + struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()',
       'return format(hash((start, tuple(token_ids))) & (2**64 - 1), "016x")', "block_hash_matches_the_engine"),
    _m("ch06", "block_hashes", "each block hashed alone (no chain)", "parent = block_hash(parent,",
       "parent = block_hash(None,", "block_hashes_chain_and_skip_the_partial_block"),
    _m("ch06", "block_hashes", "hashes the partial last block too", "len(token_ids) // block_size)",
       "-(-len(token_ids) // block_size))", "block_hashes_chain_and_skip_the_partial_block"),
    _m("ch06", "block_hashes", "ignores start", "range(start, ", "range(0, ",
       "block_hashes_continue_from_a_parent"),
    _m("ch06", "block_hashes", "one block too few", "len(token_ids) // block_size)",
       "len(token_ids) // block_size - 1)", "block_hashes_chain_and_skip_the_partial_block"),
    _m("ch06", "find_cached_prefix", "skips a miss instead of stopping", "break  # the chain",
       "continue  # the chain", "find_cached_prefix_stops_at_the_first_miss"),
    _m("ch06", "find_cached_prefix", "ignores max_tokens", "token_ids[:max_tokens]", "token_ids",
       "find_cached_prefix_respects_max_tokens"),
    _m("ch06", "find_cached_prefix", "one token past max_tokens", "token_ids[:max_tokens]",
       "token_ids[:max_tokens + 1]", "find_cached_prefix_respects_max_tokens"),
    _m("ch06", "find_cached_prefix", "returns the hashes, not the blocks", "blocks.append(cached[h])",
       "blocks.append(h)", "find_cached_prefix_stops_at_the_first_miss"),
    _m("ch06", "cached_prefix_tokens", "the last token counted as cached", "min(shared_len, prompt_len - 1)",
       "shared_len", "cached_prefix_tokens_by_hand"),
    _m("ch06", "cached_prefix_tokens", "rounds up to whole blocks",
       "min(shared_len, prompt_len - 1) // block_size * block_size",
       "-(-min(shared_len, prompt_len - 1) // block_size) * block_size", "cached_prefix_tokens_by_hand"),
    _m("ch06", "cached_prefix_tokens", "partial blocks counted", " // block_size * block_size", "",
       "cached_prefix_tokens_by_hand"),
    _m("ch06", "cached_prefix_tokens", "no check of the inputs",
       "if prompt_len < 1 or not 0 <= shared_len <= prompt_len or block_size < 1:", "if False:",
       "cached_prefix_tokens_by_hand"),
    _m("ch06", "plan_prefill", "a fully cached prompt leaves nothing to compute (the stub's bug)",
       "token_ids[:len(token_ids) - 1]", "token_ids",
       "plan_prefill_recomputes_the_last_token_of_a_fully_cached_prompt"),
    _m("ch06", "plan_prefill", "stops a whole block short", "token_ids[:len(token_ids) - 1]",
       "token_ids[:len(token_ids) - block_size]", "plan_prefill_recomputes_the_last_token_of_a_fully_cached_prompt"),
    _m("ch06", "plan_prefill", "skips a miss instead of stopping", "break", "continue",
       "plan_prefill_shares_the_longest_cached_prefix"),
    _m("ch06", "plan_prefill", "start counted in blocks, not tokens", "len(blocks) * block_size", "len(blocks)",
       "plan_prefill_shares_the_longest_cached_prefix"),
    _m("ch06", "allocate_block", "reuses a block with its old hash (the stub's bug)",
       "    del block_of[hash_of.pop(block)]  # nobody may find the old contents once new tokens go in\n", "",
       "allocate_block_drops_the_hash_before_reuse"),
    _m("ch06", "allocate_block", "drops hash -> block but keeps block -> hash",
       "del block_of[hash_of.pop(block)]", "del block_of[hash_of[block]]",
       "allocate_block_drops_the_hash_before_reuse"),
    _m("ch06", "allocate_block", "evicts the most recently used", "popitem(last=False)", "popitem(last=True)",
       "allocate_block_takes_free_blocks_first_then_the_least_recently_used"),
    _m("ch06", "allocate_block", "evicts a cached block while free ones are left", "if free:",
       "if free and not evictor:", "allocate_block_takes_free_blocks_first_then_the_least_recently_used"),
    _m("ch06", "request_cache_key", "every tenant's private scope is the same (the stub's bug)",
       'f"tenant:{tenant}"', '"private"', "request_cache_key_keeps_tenants_apart"),
    _m("ch06", "request_cache_key", "a tenant's opt-in to public ignored",
       "if scope == PUBLIC_SCOPE or tenant is None:", "if tenant is None:", "request_cache_key_keeps_tenants_apart"),
    _m("ch06", "request_cache_key", 'no tenant gives "tenant:None"', "if scope == PUBLIC_SCOPE or tenant is None:",
       "if scope == PUBLIC_SCOPE:", "request_cache_key_matches_the_engine"),
    _m("ch06", "request_cache_key", "drops the template version", 'return (model_id, template_version, f"tenant:',
       'return (model_id, None, f"tenant:', "request_cache_key_matches_the_engine"),
    _m("ch06", "request_cache_key", "private without a tenant allowed", 'if scope == "private" and tenant is None:',
       "if False:", "request_cache_key_matches_the_engine"),
    # ---- ch07: the int4 grid, a per-group quantizer, a dequantizing GEMV, granularity, bytes ---------------
    _m("ch07", "int4_scale_and_zero", "0 left outside the range", "lo, hi = lo.clamp(max=0), hi.clamp(min=0)",
       "lo, hi = lo, hi", "int4_grid_maps_min_and_max_to_0_and_15"),
    _m("ch07", "int4_scale_and_zero", "16 steps instead of 15", "(hi - lo) / INT4_MAX", "(hi - lo) / (INT4_MAX + 1)",
       "int4_grid_maps_min_and_max_to_0_and_15"),
    _m("ch07", "int4_scale_and_zero", "a fractional zero point", "(-lo / scale).round()", "(-lo / scale)",
       "int4_grid_matches_the_engine"),
    _m("ch07", "int4_scale_and_zero", "a zero scale for an all-zero group", ".clamp(min=TINY_SCALE)", "",
       "int4_grid_matches_the_engine"),
    _m("ch07", "quantize_int4", "nibbles swapped (even input high)", "q[:, 0::2] | (q[:, 1::2] << 4)",
       "q[:, 1::2] | (q[:, 0::2] << 4)", "quantize_int4_packs_the_even_input_in_the_low_nibble"),
    _m("ch07", "quantize_int4", "subtracts the zero point", "+ zero[..., None]).round()", "- zero[..., None]).round()",
       "quantize_int4_matches_the_engine"),
    _m("ch07", "quantize_int4", "truncates instead of rounding", ".round().clamp(0, INT4_MAX)",
       ".floor().clamp(0, INT4_MAX)", "quantize_int4_round_trip_error_is_at_most_half_a_step"),
    _m("ch07", "quantize_int4", "groups strided across the row",
       "weight.float().reshape(n, k // group_size, group_size)",
       "weight.float().reshape(n, group_size, k // group_size).transpose(1, 2)", "quantize_int4_matches_the_engine"),
    _m("ch07", "quantize_int4", "no check of the group size", "if group_size < 1 or k % group_size or group_size % 2:",
       "if False:", "quantize_int4_rejects_a_group_size_that_does_not_divide_k"),
    _m("ch07", "quant_matmul_ref", "nibbles swapped", "torch.stack((low, high), dim=-1)",
       "torch.stack((high, low), dim=-1)", "dequant_gemv_by_hand"),
    _m("ch07", "quant_matmul_ref", "forgets the zero point",
       "w = q if qw.zeros is None else q - qw.zeros.expand(n, -1).repeat_interleave(per_group, dim=1)", "w = q",
       "dequant_gemv_by_hand"),
    _m("ch07", "quant_matmul_ref", "scales tiled instead of repeated per group",
       "w = w * qw.scales.expand(n, -1).repeat_interleave(per_group, dim=1)",
       "w = w * qw.scales.expand(n, -1).repeat(1, per_group)", "dequant_gemv_matches_the_engine_for_int8_and_int4"),
    _m("ch07", "quant_matmul_ref", "returns fp32 whatever x was", "return y.to(x.dtype)", "return y",
       "dequant_gemv_returns_the_activations_dtype"),
    _m("ch07", "quant_matmul_ref", "drops the bias", "y = y + bias.float()", "y = y",
       "dequant_gemv_matches_the_engine_for_int8_and_int4"),
    _m("ch07", "pick_granularity", "a budget met exactly does not count", "<= max_error", "< max_error",
       "pick_granularity_returns_the_coarsest_that_meets_the_budget"),
    _m("ch07", "pick_granularity", "finest first", "for c in candidates:", "for c in reversed(candidates):",
       "pick_granularity_returns_the_coarsest_that_meets_the_budget"),
    _m("ch07", "pick_granularity", "tries a group size that does not divide K", "elif k % c == 0:", "elif True:",
       "pick_granularity_skips_group_sizes_that_do_not_divide_k"),
    _m("ch07", "pick_granularity", "returns the finest when nothing fits",
       'raise ValueError(f"max_error: no granularity in {list(candidates)} reaches {max_error}")',
       "return candidates[-1]", "pick_granularity_says_when_nothing_is_good_enough"),
    _m("ch07", "quantized_bytes", "forgets the int4 zero points", "(ZERO_BYTES if bits == 4 else 0)", "0",
       "quantized_bytes_of_a_4096_square_layer"),
    _m("ch07", "quantized_bytes", "a bit per byte", "n * k * bits // 8", "n * k * bits",
       "quantized_bytes_of_a_4096_square_layer"),
    _m("ch07", "quantized_bytes", "one scale per row, not per group", "groups = n * (k // group_size)", "groups = n",
       "quantized_bytes_of_a_4096_square_layer"),
    _m("ch07", "gemv_bytes_per_output", "naive reads the fp32 row once", "2 * K * FP32_BYTES", "K * FP32_BYTES",
       "naive_dequant_moves_more_bytes_than_fp32"),
    _m("ch07", "gemv_bytes_per_output", "int8 counted with zero points", "(ZERO_BYTES if bits == 4 else 0)",
       "ZERO_BYTES",
       "gemv_bytes_match_the_engine"),
    _m("ch07", "gemv_bytes_per_output", "fused forgets the scales", '"fused": integers + meta', '"fused": integers',
       "naive_dequant_moves_more_bytes_than_fp32"),
    # ---- ch08: column and row shards, W ranks in one process, all-reduce bytes, the bubble, a layout --------
    _m("ch08", "column_shard", "slices the input features (dim 1)", "return weight[start:stop],",
       "return weight[:, start:stop],", "column_shard_takes_output_rows"),
    _m("ch08", "column_shard", "the [in, out] slice (x W on paper, not nn.Linear's [out, in])",
       "return weight[start:stop],", "return weight.T[:, start:stop],", "column_shard_takes_output_rows"),
    _m("ch08", "column_shard", "the whole bias on every rank", "bias[start:stop]", "bias",
       "column_shard_takes_output_rows"),
    _m("ch08", "column_shard", "drops the remainder (out // world rows each)",
       "    start = rank * base + min(rank, extra)\n    stop = start + base + (rank < extra)\n",
       "    start = rank * base\n    stop = start + base\n", "column_shards_tile_the_weight_as_evenly_as_can_be"),
    _m("ch08", "column_shard", "the remainder all on the last rank",
       "    start = rank * base + min(rank, extra)\n    stop = start + base + (rank < extra)\n",
       "    start = rank * base\n    stop = out if rank == world - 1 else start + base\n",
       "column_shards_tile_the_weight_as_evenly_as_can_be"),
    _m("ch08", "column_shard", "ceil-sized chunks (torch.chunk's split)",
       "    start = rank * base + min(rank, extra)\n    stop = start + base + (rank < extra)\n",
       "    start = rank * -(-out // world)\n    stop = min(start - (-out // world), out)\n",
       "column_shards_tile_the_weight_as_evenly_as_can_be"),
    _m("ch08", "row_shard", "slices the output rows (dim 0)", "return weight[:, start:stop]",
       "return weight[start:stop]", "row_shard_takes_input_columns"),
    _m("ch08", "row_shard", "returns the slice transposed", "return weight[:, start:stop]",
       "return weight[:, start:stop].T", "row_shard_takes_input_columns"),
    _m("ch08", "row_shard", "drops the remainder (in // world columns each)",
       "    start = rank * base + min(rank, extra)\n    stop = start + base + (rank < extra)\n",
       "    start = rank * base\n    stop = start + base\n", "row_shards_tile_the_weight_as_evenly_as_can_be"),
    _m("ch08", "row_shard", "ceil-sized chunks (torch.chunk's split)",
       "    start = rank * base + min(rank, extra)\n    stop = start + base + (rank < extra)\n",
       "    start = rank * -(-n_in // world)\n    stop = min(start - (-n_in // world), n_in)\n",
       "row_shards_tile_the_weight_as_evenly_as_can_be"),
    _m("ch08", "tensor_parallel_linear", "the bias on every rank in the row split",
       "w)\n"
       "            total = partial if total is None else total + partial  # all-reduce adds W partial sums\n"
       "            start += w.shape[1]\n        return total if bias is None else total + bias",
       "w, bias)\n            total = partial if total is None else total + partial\n"
       "            start += w.shape[1]\n        return total", "row_parallel_linear_adds_the_bias_once"),
    _m("ch08", "tensor_parallel_linear", "concatenates the partial sums instead of adding them",
       "else total + partial  #", "else torch.cat((total, partial), dim=-1)  #",
       "row_parallel_linear_equals_the_full_matmul"),
    _m("ch08", "tensor_parallel_linear", "the whole x on every rank in the row split",
       "F.linear(x[..., start:start + w.shape[1]], w)", "F.linear(x, w)", "row_parallel_linear_equals_the_full_matmul"),
    _m("ch08", "tensor_parallel_linear", "adds the column outputs instead of gathering them",
       "return torch.cat(parts, dim=-1)", "return sum(parts)", "column_parallel_linear_equals_the_full_matmul"),
    _m("ch08", "tensor_parallel_linear", "gathers along the batch axis", "torch.cat(parts, dim=-1)",
       "torch.cat(parts)", "column_parallel_linear_equals_the_full_matmul"),
    _m("ch08", "tensor_parallel_linear", "drops the bias in the column split",
       "F.linear(x, *column_shard(weight, bias, rank, world))",
       "F.linear(x, column_shard(weight, bias, rank, world)[0])",
       "column_parallel_linear_equals_the_full_matmul"),
    _m("ch08", "tensor_parallel_linear", "any kind but 'column' runs as a row split", 'if kind == "row":', "if True:",
       "tensor_parallel_linear_refuses_an_unknown_kind"),
    _m("ch08", "allreduce_bytes_per_token", "one all-reduce per layer",
       "model.num_hidden_layers * ALLREDUCES_PER_LAYER * per_allreduce", "model.num_hidden_layers * per_allreduce",
       "allreduce_bytes_of_llama3_by_hand"),
    _m("ch08", "allreduce_bytes_per_token", "one layer only",
       "model.num_hidden_layers * ALLREDUCES_PER_LAYER * per_allreduce", "ALLREDUCES_PER_LAYER * per_allreduce",
       "allreduce_bytes_of_llama3_by_hand"),
    _m("ch08", "allreduce_bytes_per_token", "forgets the ring's (tp - 1) / tp", "RING_PASSES * (tp - 1) / tp * message",
       "RING_PASSES * message", "allreduce_bytes_are_0_for_a_single_gpu"),
    _m("ch08", "allreduce_bytes_per_token", "counts the reduce-scatter only (no factor 2)",
       "RING_PASSES * (tp - 1) / tp * message", "(tp - 1) / tp * message", "allreduce_bytes_of_llama3_by_hand"),
    _m("ch08", "allreduce_bytes_per_token", "bits, not bytes", "dtype_bytes(dtype)", "dtype_bytes(dtype) * 8",
       "allreduce_bytes_of_llama3_by_hand"),
    _m("ch08", "allreduce_bytes_per_token", "2 bytes whatever the dtype", "dtype_bytes(dtype)", "2",
       "allreduce_bytes_of_llama3_by_hand"),
    _m("ch08", "pipeline_bubble", "idle over the busy slots, not over all", "return (P - 1) / (M + P - 1)",
       "return (P - 1) / M",
       "pipeline_bubble_by_hand"),
    _m("ch08", "pipeline_bubble", "one slot too many", "return (P - 1) / (M + P - 1)", "return (P - 1) / (M + P)",
       "pipeline_bubble_by_hand"),
    _m("ch08", "pipeline_bubble", "ignores the micro-batches", "return (P - 1) / (M + P - 1)", "return (P - 1) / P",
       "pipeline_bubble_by_hand"),
    _m("ch08", "pipeline_bubble", "integer division", "return (P - 1) / (M + P - 1)",
       "return (P - 1) // (M + P - 1)",
       "pipeline_bubble_by_hand"),
    _m("ch08", "pipeline_bubble", "no check of the inputs",
       "if isinstance(value, bool) or not isinstance(value, int) or value < 1:", "if False:",
       "pipeline_bubble_refuses_zero_stages_or_micro_batches"),
    _m("ch08", "pick_layout", "ignores the divisibility rule", "            continue  # whole",
       "            pass  # whole",
       "pick_layout_skips_a_tp_that_does_not_divide_the_heads"),
    _m("ch08", "pick_layout", "forgets the KV cache", "if weights + reserve + kv <= device_memory_bytes:",
       "if weights + reserve <= device_memory_bytes:", "pick_layout_leaves_room_for_the_kv_cache"),
    _m("ch08", "pick_layout", "forgets the reserve", "if weights + reserve + kv <= device_memory_bytes:",
       "if weights + kv <= device_memory_bytes:", "pick_layout_keeps_the_reserve"),
    _m("ch08", "pick_layout", "a device filled exactly does not count", "<= device_memory_bytes:",
       "< device_memory_bytes:", "pick_layout_counts_a_device_filled_exactly_as_fitting"),
    _m("ch08", "pick_layout", "largest TP first", "range(1, num_devices + 1)", "range(num_devices, 0, -1)",
       "pick_layout_of_llama3_70b_on_8_h100_by_hand"),
    _m("ch08", "pick_layout", "replicas rounded up", "return tp, num_devices // tp", "return tp, -(-num_devices // tp)",
       "pick_layout_skips_a_tp_that_does_not_divide_the_heads"),
    _m("ch08", "pick_layout", "KV heads split below one a GPU", "max(1, Hkv // tp)", "Hkv // tp",
       "pick_layout_keeps_one_kv_head_per_gpu_past_tp_equal_hkv"),
    _m("ch08", "pick_layout", "returns the error instead of raising it", 'raise ValueError(f"num_devices=',
       'return ValueError(f"num_devices=', "pick_layout_says_when_nothing_fits"),
    # ---- ch09: inter-token latencies and TPOT, nearest-rank percentiles, goodput ---------------------------
    _m("ch09", "inter_token_latencies", "counts the first token as a gap from time 0",
       "zip(times, times[1:], strict=False)", "zip([0.0] + times, times, strict=False)",
       "inter_token_latencies_are_the_gaps_between_consecutive_tokens"),
    _m("ch09", "inter_token_latencies", "gaps the wrong way round", "later - earlier", "earlier - later",
       "inter_token_latencies_are_the_gaps_between_consecutive_tokens"),
    _m("ch09", "inter_token_latencies", "drops the last gap", "times[1:], strict", "times[1:-1], strict",
       "inter_token_latencies_are_the_gaps_between_consecutive_tokens"),
    _m("ch09", "inter_token_latencies", "times since the first token, not gaps", "later - earlier",
       "later - times[0]", "inter_token_latencies_match_the_engine"),
    _m("ch09", "time_per_output_token", "divides by n instead of n - 1", "token_times[0]) / (n - 1)",
       "token_times[0]) / n",
       "tpot_divides_the_decode_time_by_the_gaps_not_the_tokens"),
    _m("ch09", "time_per_output_token", "0 for a single token instead of nan", "return math.nan", "return 0.0",
       "tpot_of_a_single_token_is_nan"),
    _m("ch09", "time_per_output_token", "the median gap instead of the mean",
       "return (token_times[-1] - token_times[0]) / (n - 1)",
       'return __import__("statistics").median(b - a for a, b in zip(token_times, token_times[1:]))',
       "tpot_is_the_mean_of_the_inter_token_latencies"),
    _m("ch09", "time_per_output_token", "counts from time 0 (TTFT included)", "(token_times[-1] - token_times[0])",
       "token_times[-1]", "tpot_divides_the_decode_time_by_the_gaps_not_the_tokens"),
    _m("ch09", "nearest_rank", "interpolates between neighbours (numpy's default)",
       "    return ordered[max(rank, 1) - 1]",
       "    pos = q / 100 * (len(ordered) - 1)\n    lo = math.floor(pos)\n"
       "    return ordered[lo] + (pos - lo) * (ordered[min(lo + 1, len(ordered) - 1)] - ordered[lo])",
       "nearest_rank_is_always_an_observed_value"),
    _m("ch09", "nearest_rank", "off by one (the rank used as a 0-based index)", "ordered[max(rank, 1) - 1]",
       "ordered[min(rank, len(ordered) - 1)]", "nearest_rank_by_hand"),
    _m("ch09", "nearest_rank", "rounds the rank instead of taking its ceiling", "math.ceil(q / 100 * len(ordered))",
       "round(q / 100 * len(ordered))", "nearest_rank_by_hand"),
    _m("ch09", "nearest_rank", "forgets to sort", "sorted(values)", "list(values)", "nearest_rank_by_hand"),
    _m("ch09", "nearest_rank", "no check of q", "if not 0 < q <= 100:", "if False:",
       "nearest_rank_refuses_q_outside_0_to_100"),
    _m("ch09", "goodput", "counts requests that met only one SLO", "if fast_start and steady_pace:",
       "if fast_start or steady_pace:", "goodput_counts_only_requests_within_both_limits"),
    _m("ch09", "goodput", "counts aborted requests", 'if r["finish_reason"] == "abort":', "if False:",
       "goodput_never_counts_an_aborted_request"),
    _m("ch09", "goodput", "a one-token answer (no TPOT) counted as a miss",
       'r["tpot_ms"] is None or r["tpot_ms"] <= tpot_slo_ms',
       'r["tpot_ms"] is not None and r["tpot_ms"] <= tpot_slo_ms',
       "goodput_judges_a_one_token_answer_by_its_ttft"),
    _m("ch09", "goodput", "a limit met exactly counts as a miss", 'r["ttft_ms"] <= ttft_slo_ms',
       'r["ttft_ms"] < ttft_slo_ms', "goodput_counts_a_limit_met_exactly"),
    _m("ch09", "goodput", "a fraction of the requests, not per second", "return met / duration_s",
       "return met / len(requests)", "goodput_is_per_second_of_the_run"),
    # ---- ch10: a token bucket, Retry-After, the queue caps, a cap from the TTFT target, two halves of a run ----
    _m("ch10", "TokenBucket", "starts empty", "self.level = float(burst)", "self.level = 0.0",
       "token_bucket_starts_full_and_a_burst_drains_it"),
    _m("ch10", "TokenBucket", "refill not capped at the burst",
       "min(self.burst, self.level + (now - self.updated) * self.rate_per_s)",
       "self.level + (now - self.updated) * self.rate_per_s", "token_bucket_refill_stops_at_the_burst"),
    _m("ch10", "TokenBucket", "waits in tokens, not seconds", "(amount - self.level) / self.rate_per_s",
       "(amount - self.level)", "token_bucket_wait_s_is_seconds_until_the_amount_is_there"),
    _m("ch10", "TokenBucket", "waits in milliseconds", "(amount - self.level) / self.rate_per_s",
       "(amount - self.level) / self.rate_per_s * 1000", "token_bucket_starts_full_and_a_burst_drains_it"),
    _m("ch10", "TokenBucket", "a negative wait when there is more than enough",
       "return max(0.0, (amount - self.level) / self.rate_per_s)", "return (amount - self.level) / self.rate_per_s",
       "token_bucket_wait_s_is_seconds_until_the_amount_is_there"),
    _m("ch10", "TokenBucket", "a finite wait for more than the burst", "if amount > self.burst:", "if False:",
       "token_bucket_wait_s_is_seconds_until_the_amount_is_there"),
    _m("ch10", "TokenBucket", "reads the wall clock instead of now", "    def refill(self, now: float) -> None:\n",
       '    def refill(self, now: float) -> None:\n        now = __import__("time").monotonic()\n',
       "token_bucket_runs_on_the_clock_it_is_given"),
    _m("ch10", "TokenBucket", "a reading from the past drains the bucket",
       "if self.updated is not None and now > self.updated:", "if self.updated is not None:",
       "token_bucket_ignores_a_reading_earlier_than_the_last"),
    _m("ch10", "TokenBucket", "a reading from the past replaces the latest one",
       "self.updated = now if self.updated is None else max(self.updated, now)", "self.updated = now",
       "token_bucket_ignores_a_reading_earlier_than_the_last"),
    _m("ch10", "TokenBucket", "accepts a rate or burst of 0", "if not (math.isfinite(value) and value > 0):",
       "if False:", "token_bucket_refuses_a_rate_or_burst_that_is_not_positive"),
    _m("ch10", "retry_after_header", "rounds to nearest", "math.ceil(retry_after_s)", "round(retry_after_s)",
       "retry_after_rounds_up_to_whole_seconds"),
    _m("ch10", "retry_after_header", "truncates (int())", "math.ceil(retry_after_s)", "int(retry_after_s)",
       "retry_after_rounds_up_to_whole_seconds"),
    _m("ch10", "retry_after_header", "milliseconds", "math.ceil(retry_after_s)", "math.ceil(retry_after_s * 1000)",
       "retry_after_rounds_up_to_whole_seconds"),
    _m("ch10", "retry_after_header", "fractional seconds", "str(max(1, math.ceil(retry_after_s)))",
       "str(max(1.0, retry_after_s))", "retry_after_rounds_up_to_whole_seconds"),
    _m("ch10", "retry_after_header", "says 0 for no wait", "max(1, math.ceil(retry_after_s))",
       "math.ceil(retry_after_s)", "retry_after_rounds_up_to_whole_seconds"),
    _m("ch10", "retry_after_header", "a header even when waiting would not help",
       "if retry_after_s is None or math.isinf(retry_after_s):", "if retry_after_s is None:",
       "retry_after_is_none_when_waiting_would_not_help"),
    _m("ch10", "queue_cap_rejection", "admits one request past the cap (> instead of >=)",
       "num_requests >= max_num_queued_reqs", "num_requests > max_num_queued_reqs",
       "queue_cap_turns_away_the_request_past_max_num_queued_reqs"),
    _m("ch10", "queue_cap_rejection", "refuses a prompt that reaches the token cap exactly (>= instead of >)",
       "num_queued_tokens + num_prompt_tokens > max_num_queued_tokens",
       "num_queued_tokens + num_prompt_tokens >= max_num_queued_tokens",
       "queue_cap_counts_this_prompt_against_max_num_queued_tokens"),
    _m("ch10", "queue_cap_rejection", "forgets this prompt's tokens",
       "num_queued_tokens + num_prompt_tokens > max_num_queued_tokens", "num_queued_tokens > max_num_queued_tokens",
       "queue_cap_counts_this_prompt_against_max_num_queued_tokens"),
    _m("ch10", "queue_cap_rejection", "refuses a long prompt when nothing is queued",
       "max_num_queued_tokens is not None and num_queued_tokens > 0", "max_num_queued_tokens is not None",
       "queue_cap_lets_a_long_prompt_in_when_nothing_is_queued"),
    _m("ch10", "queue_cap_rejection", "checks the token cap first",
       "    if max_num_queued_reqs is not None and num_requests >= max_num_queued_reqs:\n",
       "    if max_num_queued_tokens is not None and 0 < num_queued_tokens and num_queued_tokens + num_prompt_tokens"
       " > max_num_queued_tokens:\n        return \"max_num_queued_tokens\"\n"
       "    if max_num_queued_reqs is not None and num_requests >= max_num_queued_reqs:\n",
       "queue_cap_names_the_request_cap_first_and_none_is_no_cap"),
    _m("ch10", "queue_cap_rejection", "a cap of None compared as a number", "max_num_queued_reqs is not None and ", "",
       "queue_cap_names_the_request_cap_first_and_none_is_no_cap"),
    _m("ch10", "max_num_queued_tokens_for", "the target in milliseconds", "ttft_target_s * prefill_tokens_per_s)",
       "ttft_target_s * 1000 * prefill_tokens_per_s)", "queued_tokens_cap_is_ttft_target_times_prefill_throughput"),
    _m("ch10", "max_num_queued_tokens_for", "divides instead of multiplying", "ttft_target_s * prefill_tokens_per_s)",
       "ttft_target_s / prefill_tokens_per_s)", "queued_tokens_cap_is_ttft_target_times_prefill_throughput"),
    _m("ch10", "max_num_queued_tokens_for", "rounds up (one token past the target)", "math.floor(", "math.ceil(",
       "queued_tokens_cap_keeps_the_wait_within_the_target"),
    _m("ch10", "max_num_queued_tokens_for", "rounds to nearest", "math.floor(", "round(",
       "queued_tokens_cap_keeps_the_wait_within_the_target"),
    _m("ch10", "max_num_queued_tokens_for", "a float cap", "max(1, math.floor(ttft_target_s * prefill_tokens_per_s))",
       "max(1, ttft_target_s * prefill_tokens_per_s)", "queued_tokens_cap_is_an_int_the_engine_accepts"),
    _m("ch10", "max_num_queued_tokens_for", "a cap of 0 for a slow prefill",
       "max(1, math.floor(ttft_target_s * prefill_tokens_per_s))", "math.floor(ttft_target_s * prefill_tokens_per_s)",
       "queued_tokens_cap_is_an_int_the_engine_accepts"),
    _m("ch10", "max_num_queued_tokens_for", "no check of the inputs", "if not (math.isfinite(value) and value > 0):",
       "if False:", "queued_tokens_cap_refuses_a_target_or_throughput_that_is_not_positive"),
    _m("ch10", "arrival_halves", "splits by count, not by time",
       "    mid = (splits[0].arrival_time + splits[-1].arrival_time) / 2\n    return [s for s in splits",
       "    mid = len(splits) // 2\n    return splits[:mid], splits[mid:]\n    return [s for s in splits",
       "arrival_halves_split_the_window_by_time_not_by_count"),
    _m("ch10", "arrival_halves", "measures the window from time 0",
       "(splits[0].arrival_time + splits[-1].arrival_time) / 2", "splits[-1].arrival_time / 2",
       "arrival_halves_measure_the_window_from_the_first_arrival"),
    _m("ch10", "arrival_halves", "the middle at the mean arrival time",
       "(splits[0].arrival_time + splits[-1].arrival_time) / 2", "sum(s.arrival_time for s in splits) / len(splits)",
       "arrival_halves_split_the_window_by_time_not_by_count"),
    _m("ch10", "arrival_halves", "a request at the middle goes in the first half",
       "s.arrival_time < mid], [s for s in splits if s.arrival_time >= mid]",
       "s.arrival_time <= mid], [s for s in splits if s.arrival_time > mid]",
       "arrival_halves_put_a_request_at_the_middle_in_the_second_half"),
    _m("ch10", "arrival_halves", "crashes on no requests", "    if not splits:\n        return [], []\n", "",
       "arrival_halves_put_a_request_at_the_middle_in_the_second_half"),
]


def _solution_source(chapter: str) -> str:
    return exercises.exercise_path(chapter, solutions=True).read_text()


def mutated_module(mutant: Mutant) -> types.ModuleType:
    """The chapter's reference solution with the mutant's patch applied, as a fresh module."""
    path = exercises.exercise_path(mutant.chapter, solutions=True)
    source = _solution_source(mutant.chapter)
    function_source = inspect.getsource(getattr(exercises.load_module(mutant.chapter, True), mutant.function))
    assert function_source.count(mutant.old) == 1, (
        f"{mutant.id}: {mutant.old!r} must occur exactly once in {mutant.function}; update the mutant")
    start = source.index(function_source)
    patched = function_source.replace(mutant.old, mutant.new)
    assert patched != function_source, f"{mutant.id}: the patch changes nothing"
    module = types.ModuleType(f"exercises.solutions.{path.stem}_mutant")
    code = compile(source[:start] + patched + source[start + len(function_source):], f"{path} (mutant)", "exec")
    exec(code, module.__dict__)  # noqa: S102 - our own solution file with one line changed
    return module


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.id)
def test_the_named_check_fails_on_the_mutant(mutant):
    checks = dict(exercises.load_checks(mutant.chapter))
    assert mutant.caught_by in checks, f"{mutant.id}: no check named {mutant.caught_by!r}"
    module = mutated_module(mutant)
    try:
        checks[mutant.caught_by](module)
    except Exception:  # noqa: BLE001 - any failure of the check counts as catching the mutant
        return
    pytest.fail(f"{mutant.id}: check {mutant.caught_by!r} passed on a solution that {mutant.mistake}")


# The chapter 06 bug zoo: each stub holds working code with one planted bug behind a `raise
# NotImplementedError(BUG_ZOO)` line. Once a student deletes that line, the bug must bite: these checks fail.
BUG_ZOO_CHECKS = {"plan_prefill": "plan_prefill_recomputes_the_last_token_of_a_fully_cached_prompt",
                  "allocate_block": "allocate_block_drops_the_hash_before_reuse",
                  "request_cache_key": "request_cache_key_keeps_tenants_apart"}


@pytest.mark.parametrize("function", BUG_ZOO_CHECKS)
def test_each_bug_zoo_stub_fails_its_check_once_the_raise_is_deleted(function):
    path = exercises.exercise_path("ch06")
    raise_line = "    raise NotImplementedError(BUG_ZOO)\n"
    source = path.read_text()
    assert source.count(raise_line) == len(BUG_ZOO_CHECKS), "each bug zoo stub starts with the BUG_ZOO raise"
    module = types.ModuleType("exercises.ch06_prefix_cache_unlocked")
    exec(compile(source.replace(raise_line, ""), f"{path} (raise deleted)", "exec"), module.__dict__)  # noqa: S102
    check = dict(exercises.load_checks("ch06"))[BUG_ZOO_CHECKS[function]]
    with pytest.raises(AssertionError):
        check(module)


def all_mutants() -> list[Mutant]:
    """This file's mutants and chapters 12's and 13's (tests/test_exercise_mutants_ch12.py and _ch13.py keep their
    own lists; they import this module, so we import them late)."""
    from test_exercise_mutants_ch12 import MUTANTS as CH12
    from test_exercise_mutants_ch13 import MUTANTS as CH13

    return MUTANTS + CH12 + CH13


@pytest.mark.parametrize("chapter", exercises.list_chapters())
def test_every_solution_function_has_enough_mutants(chapter):
    solutions = exercises.load_module(chapter, solutions=True)
    public = [name for name, value in vars(solutions).items()
              if (inspect.isfunction(value) or inspect.isclass(value)) and not name.startswith("_")
              and value.__module__ == solutions.__name__]
    counts = {name: sum(m.chapter == chapter and m.function == name for m in all_mutants()) for name in public}
    assert all(n >= MIN_MUTANTS_PER_FUNCTION for n in counts.values()), counts


def test_the_readme_table_lists_every_mutant():
    readme = README.read_text()
    missing = [m.id for m in all_mutants() if f"`{m.function}`: {m.mistake}" not in readme]
    assert not missing, f"exercises/README.md lacks these mutants (run python {__file__}): {missing}"


def readme_table() -> str:
    """Markdown: per chapter and check, the mutants it catches (every check that fails on a mutant
    is credited; the one the test above names is in bold)."""
    caught: dict[tuple[str, str], list[str]] = {}
    for m in all_mutants():
        for r in exercises.run_checks(m.chapter, module=mutated_module(m)):
            if not r.passed:
                label = f"`{m.function}`: {m.mistake}"
                caught.setdefault((m.chapter, r.name), []).append(f"**{label}**" if r.name == m.caught_by else label)
    rows = ["| chapter | check | mistakes it catches (mutants) |", "| --- | --- | --- |"]
    for chapter in exercises.list_chapters():
        for name, _ in exercises.load_checks(chapter):
            rows.append(f"| {chapter} | `{name}` | {'; '.join(caught.get((chapter, name), [])) or '-'} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(print(readme_table()))
