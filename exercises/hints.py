"""The second, fuller hint of every exercise: what `python -m exercises check chNN --hint` adds.

Each exercise has two hints, so that the first one leaves the thinking to you:

    level 1  in your file, in the stub's `raise NotImplementedError("...?")`: a question that
             points at the idea (what to compute, which case to mind), shown in every check table;
    level 2  here, keyed by chapter and function: the recipe, close to the code itself. The check
             table offers it; `--hint` prints it for each function a failing check used.

Try the question first, and come here when it is not enough. The bug-zoo functions of chapter 06
have no recipe: their second hint is a sharper question about where the bug lives.
"""

from __future__ import annotations

FULL_HINTS: dict[str, dict[str, str]] = {
    "ch01": {
        "apply_temperature": (
            "return logits / temperature: a new tensor. Not `logits /= temperature`, which "
            "changes the caller's tensor, and not on probabilities: the temperature divides the "
            "logits before any softmax."),
        "top_k_filter": (
            "kth = torch.topk(logits, k, dim=-1).values[..., -1:] is [..., 1], one value per "
            "row; logits.masked_fill(logits < kth, float('-inf')) drops the rest and keeps every "
            "token tied with the k-th. For k <= 0 or k >= V return logits.clone()."),
        "top_p_filter": (
            "p >= 1: return logits.clone(). Else sort the logits descending, softmax the sorted "
            "row, mass_before = cumsum - the probability itself (the mass of the more likely "
            "tokens); n_keep = (mass_before < p).sum(-1, keepdim=True); boundary = "
            "sorted_logits.gather(-1, n_keep - 1); drop the logits < boundary (comparing values "
            "keeps every tie)."),
        "min_p_filter": (
            "min_p <= 0: return logits.clone(). probs = torch.softmax(logits, dim=-1); threshold "
            "= min_p * probs.amax(dim=-1, keepdim=True) ([..., 1], one per row); drop where "
            "probs < threshold (a probability equal to it stays)."),
        "naive_generate": (
            "ids = list(prompt_ids) (your copy); loop max_new_tokens times: token = "
            "int(torch.argmax(next_token_logits_fn(ids))); append it to ids and to the new "
            "tokens; break AFTER appending when token == eos_id. Return the new tokens only."),
    },
    "ch02": {
        "decode_step_flops": (
            "2 * matmul_params * batch for the matmuls, plus 4 * layers * heads * head_dim * "
            "context_tokens * batch for attention (2 D for q.k and 2 D for the weighted sum of "
            "V, per head, layer, new token and context token)."),
        "decode_step_bytes": (
            "weight_params * weight_bytes once (not once per sequence), plus the KV read for "
            "context_tokens tokens, plus the KV write for 1 token, each KV term being 2 * layers "
            "* batch * tokens * kv_heads * head_dim * kv_bytes."),
        "arithmetic_intensity": "return flops / bytes_moved",
        "classify": (
            "ridge = peak_flops / bandwidth_bytes_per_s (FLOP per byte); return 'compute-bound' "
            "if intensity >= ridge else 'bandwidth-bound'."),
    },
    "ch03": {
        "kv_cache_bytes": (
            "return 2 * layers * batch * tokens * kv_heads * head_dim * dtype_bytes (the 2 is K "
            "and V; keep dtype_bytes as given: int4 is 0.5)."),
        "write_kv": (
            "rows = torch.arange(B)[:, None] is [B, 1] and broadcasts with positions [B, T], so "
            "cache_k[rows, positions] picks the B x T slots, each [Hkv, D]. Assign: "
            "cache_k[rows, positions] = k_new, and the same for V. An indexed assignment changes "
            "the caller's tensor; `cache_k = torch.cat(...)` would only rebind your name."),
        "max_sequences": (
            "free = (gpu_gb - weights_gb) * 10**9; per_sequence = kv_bytes_per_token * "
            "context_tokens; return max(0, math.floor(free / per_sequence))."),
    },
    "ch04": {
        "BlockAllocator.__init__": (
            "ValueError naming num_blocks when it is < 1; self.num_blocks = num_blocks; "
            "self._free = collections.deque(range(num_blocks)) (popleft takes from the front, "
            "append gives back at the back); self._refcount = [0] * num_blocks."),
        "BlockAllocator.num_free": "return len(self._free)",
        "BlockAllocator.num_used": "return self.num_blocks - len(self._free)",
        "BlockAllocator.refcount": (
            "if not 0 <= block < self.num_blocks: raise a ValueError naming the block and the "
            "valid range (a -1 would silently read the last entry); return "
            "self._refcount[block]."),
        "BlockAllocator.allocate": (
            "if not self._free: raise NoFreeBlocksError(needed=1, free=0) (from "
            "engine.kv.block_manager); block = self._free.popleft(); self._refcount[block] = 1; "
            "return block."),
        "BlockAllocator.allocate_many": (
            "if n > len(self._free): raise NoFreeBlocksError(needed=n, free=len(self._free)), "
            "before taking anything; then return [self.allocate() for _ in range(n)]."),
        "BlockAllocator.incref": (
            "check the id as refcount does, and that its refcount is >= 1 (else a ValueError: "
            "the block is free); then self._refcount[block] += 1."),
        "BlockAllocator.free": (
            "ValueError for an unknown id or a refcount of 0 (a double free); decrement; at 0 "
            "append the block to the BACK of the free list and return True, else return False."),
        "slot_mapping": (
            "[block_table[p // block_size] * block_size + p % block_size for p in positions]"),
        "append_tokens": (
            "needed = math.ceil((num_tokens + new_tokens) / block_size) - len(block_table); "
            "return [*block_table, *(allocate_fn() for _ in range(needed))] (a new list; needed "
            "may be 0)."),
        "fork_copy_on_write": (
            "child = list(block_table); allocator.incref(b) for every block (the fork). If "
            "new_tokens and num_tokens % block_size: copy = allocator.allocate(); "
            "allocator.free(child[-1]) (the child lets go of the shared block, the parent keeps "
            "it); copies = [(child[-1], copy)]; child[-1] = copy. Then grow the child: "
            "append_tokens(child, num_tokens, new_tokens, block_size, allocator.allocate)."),
        "expected_waste_slots": (
            "the empty slots are BS - 1, BS - 2, ..., 0, each equally often: their mean is "
            "(block_size - 1) / 2."),
        "contiguous_waste": "sum(max_len - n for n in lengths)",
        "paged_waste": "sum(math.ceil(n / block_size) * block_size - n for n in lengths)",
        "concurrency_gain": (
            "a reservation costs max_len slots; a paged sequence mean_len + "
            "expected_waste_slots(block_size) on average: return max_len / (mean_len + "
            "expected_waste_slots(block_size))."),
    },
    "ch05": {
        "schedule_step": (
            "budget, blocks = token_budget, free_blocks. For each running (rid, tokens, need): "
            "if tokens <= budget and need <= blocks, it runs and both shrink; else it sits out. "
            "Then for each waiting one: break as soon as len(running) + len(admitted) >= "
            "max_num_seqs or it does not fit; else admit it and shrink both."),
        "choose_victim": (
            "ValueError for no candidates; i = max(range(len(candidates)), key=lambda i: "
            "(candidates[i][1], candidates[i][2], i)) (the largest priority number, then the "
            "latest arrival, then the last place); return candidates[i][0]."),
        "ttft_and_tpot": (
            "steps = [s.to_dict() for s in trace.steps] for a Trace. One pass: an 'arrived' "
            "event gives arrival_time, a 'finished' event the step's end_time; a scheduled entry "
            "with tokens_out > 0 gives the first-token time (the first one seen) and adds to the "
            "token count. Then TTFT = first - arrival; TPOT = (finish - first) / (tokens - 1), "
            "or math.nan if unfinished or under 2 tokens."),
        "static_idle_fraction": (
            "ValueError for no lengths, a length < 1 or max_num_seqs < 1; over the chunks "
            "lengths[i:i + max_num_seqs]: held = sum(max_num_seqs * max(chunk)), used = "
            "sum(lengths); return 1 - used / held."),
    },
    "ch06": {
        "block_hash": (
            "start = bytes.fromhex(parent if parent is not None else root_hash(extra_keys)) (32 "
            "raw bytes); ids = struct.pack(f\"<{len(token_ids)}q\", *(int(t) for t in token_ids)) "
            "(little-endian int64; int() takes numpy and torch ids too); return "
            "hashlib.sha256(start + ids).hexdigest()."),
        "block_hashes": (
            "out = []; for i in range(start, len(token_ids) // block_size): parent = "
            "block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys); "
            "out.append(parent). Return out."),
        "find_cached_prefix": (
            "for h in block_hashes(token_ids[:max_tokens], block_size, extra_keys): break at the "
            "first h not in cached, else collect cached[h]."),
        "cached_prefix_tokens": (
            "ValueError unless 1 <= prompt_len, 0 <= shared_len <= prompt_len and block_size >= "
            "1; return min(shared_len, prompt_len - 1) // block_size * block_size."),
        "plan_prefill": (
            "When every block of the prompt is cached, what does it return as the first position "
            "to compute, and which token would then give the logits the engine samples from? "
            "Which tokens should be hashed at all?"),
        "allocate_block": (
            "The evicted block is about to hold other tokens: under its old hash, can block_of "
            "and hash_of still lead a later request to it? What must happen to both maps?"),
        "request_cache_key": (
            "Two tenants, both private: do their keys differ? Compare the last element returned "
            "with the docstring's \"tenant:<tenant>\"."),
    },
    "ch07": {
        "int4_scale_and_zero": (
            "lo, hi = lo.clamp(max=0), hi.clamp(min=0); scale = ((hi - lo) / "
            "15).clamp(min=1e-12); zero = (-lo / scale).round().clamp(0, 15)."),
        "quantize_int4": (
            "ValueError naming group_size unless it is even and divides K; groups = "
            "weight.float().reshape(N, K // G, G); scale, zero = "
            "int4_scale_and_zero(groups.amin(-1), groups.amax(-1)); q = (groups / scale[..., "
            "None] + zero[..., None]).round().clamp(0, 15).reshape(N, K).to(torch.uint8); packed "
            "= q[:, 0::2] | (q[:, 1::2] << 4)."),
        "quant_matmul_ref": (
            "int8: q = qw.qweight.float(). int4: low = b & 0xF (input 2j), high = b >> 4 (input "
            "2j + 1), torch.stack((low, high), -1).reshape(N, K). Expand scales (and zeros) to "
            "[N, K] with .expand(N, -1).repeat_interleave(K // groups, dim=1); w = (q - z) * s; "
            "y = x.float() @ w.T (+ bias.float()); return y.to(x.dtype)."),
        "pick_granularity": (
            "for each candidate in order: 'per-tensor' -> quantize(w, bits, per_tensor=True), "
            "'per-channel' -> quantize(w, bits), a group size g -> quantize(w, bits, g) (skip it "
            "when K % g); error = (dequantize(qw) - w.float()).norm() / w.float().norm(); return "
            "the first within max_error, else a ValueError naming max_error."),
        "quantized_bytes": (
            "n * k * bits // 8 for the codes, + n * (k // group_size) groups x (4 bytes of "
            "scale, + 4 of zero point for int4)."),
        "gemv_bytes_per_output": (
            "fp32 K * 4, bf16 K * 2; fused: codes K * bits // 8 + metadata (K // group_size) * "
            "(8 for int4, 4 for int8); naive: fused + 2 * K * 4 (write the fp32 row, read it "
            "back)."),
    },
    "ch08": {
        "column_shard": (
            "outputs are dim 0 of [out, in]. base, extra = divmod(out, world); start = rank * "
            "base + min(rank, extra); stop = start + base + (rank < extra); return "
            "weight[start:stop], and bias[start:stop] (or None)."),
        "row_shard": (
            "the same start and stop as column_shard, over weight.shape[1]: return weight[:, "
            "start:stop]."),
        "tensor_parallel_linear": (
            "column: torch.cat([F.linear(x, *column_shard(weight, bias, r, world)) for r in "
            "range(world)], dim=-1). row: the sum over ranks of F.linear(x[..., rank r's input "
            "columns], row_shard(weight, r, world)), then + bias once. Any other kind: a "
            "ValueError naming kind."),
        "allreduce_bytes_per_token": (
            "model.num_hidden_layers * 2 (all-reduces a layer) * 2 * (tp - 1) / tp * "
            "model.hidden_size * dtype_bytes(dtype)."),
        "pipeline_bubble": (
            "ValueError naming the field unless each is an int >= 1 (a bool is not); the "
            "schedule takes M + P - 1 slots, so P x (M + P - 1) stage-slots of which M x P are "
            "busy: return (P - 1) / (M + P - 1)."),
        "pick_layout": (
            "for tp in 1..num_devices: skip it if H % tp or I % tp or (Hkv % tp and tp % Hkv); "
            "shard = dataclasses.replace(model, num_attention_heads=H // tp, "
            "num_key_value_heads=max(1, Hkv // tp), intermediate_size=I // tp, vocab_size=ceil(V "
            "/ tp)); fits when ceil(shard.num_params() * dtype_bytes(dtype)) + "
            "ceil(device_memory_bytes * RESERVE_FRACTION) + context_tokens * "
            "kv_bytes_per_token(shard, dtype) <= device_memory_bytes: return (tp, num_devices // "
            "tp). None fits: a ValueError naming num_devices."),
    },
    "ch09": {
        "inter_token_latencies": (
            "[later - earlier for earlier, later in zip(token_times, token_times[1:])]"),
        "time_per_output_token": (
            "math.nan for fewer than 2 tokens; else (token_times[-1] - token_times[0]) / (n - "
            "1)."),
        "nearest_rank": (
            "ValueError naming q unless 0 < q <= 100; math.nan for no values; ordered = "
            "sorted(values); return ordered[max(math.ceil(q / 100 * len(ordered)), 1) - 1] (the "
            "1-based rank minus 1)."),
        "goodput": (
            "ValueError naming duration_s unless it is > 0; count the requests with "
            "finish_reason != 'abort', ttft_ms <= ttft_slo_ms and (tpot_ms is None or tpot_ms <= "
            "tpot_slo_ms); return the count / duration_s."),
    },
    "ch10": {
        "TokenBucket.__init__": (
            "a ValueError naming the field unless math.isfinite(value) and value > 0, for both; "
            "keep rate_per_s and burst; self.level = burst (full); self.updated = None (no "
            "reading yet)."),
        "TokenBucket.refill": (
            "if self.updated is not None and now > self.updated: self.level = min(self.burst, "
            "self.level + (now - self.updated) * self.rate_per_s); then self.updated = now if it "
            "was None, else max(self.updated, now)."),
        "TokenBucket.wait_s": (
            "self.refill(now); return math.inf if amount > self.burst, else max(0.0, (amount - "
            "self.level) / self.rate_per_s)."),
        "TokenBucket.take": "self.refill(now); self.level -= amount",
        "retry_after_header": (
            "None when retry_after_s is None or math.isinf(retry_after_s); else str(max(1, "
            "math.ceil(retry_after_s)))."),
        "queue_cap_rejection": (
            "'max_num_queued_reqs' if that cap is not None and num_requests >= it; "
            "'max_num_queued_tokens' if that cap is not None, num_queued_tokens > 0 and "
            "num_queued_tokens + num_prompt_tokens > it; else None."),
        "max_num_queued_tokens_for": (
            "a ValueError naming the field unless math.isfinite(value) and value > 0, for both; "
            "return max(1, math.floor(ttft_target_s * prefill_tokens_per_s))."),
        "arrival_halves": (
            "([], []) for no splits; mid = (splits[0].arrival_time + splits[-1].arrival_time) / "
            "2; the first half has arrival_time < mid, the second arrival_time >= mid."),
    },
    "ch12": {
        "accept_guess": (
            "return u * q_guess < p_guess: the same as u < p / q without dividing. Strictly "
            "less, so p = 0 is never kept (not even at u = 0); for p >= q it is always true. No "
            "comparison of p with q alone: the draw u is what makes the rule exact."),
        "residual_distribution": (
            "rest = torch.clamp(p - q, min=0.0) (a new tensor, p and q untouched); total = "
            "rest.sum(); raise a ValueError naming p and q if total <= 0; return rest / total."),
        "greedy_verify": (
            "ValueError naming target_argmax unless len(target_argmax) == len(guesses) + 1. Walk "
            "zip(guesses, target_argmax): append the target's token; if it differs from the "
            "guess, return at once. After the loop (every guess kept), append target_argmax[-1], "
            "the bonus."),
        "expected_tokens_per_step": (
            "ValueError naming alpha unless 0 <= alpha <= 1 (that also refuses nan), one naming k "
            "unless it is an int >= 0; at alpha == 1 return float(k + 1); else (1 - alpha ** (k + "
            "1)) / (1 - alpha), the sum 1 + alpha + ... + alpha^k."),
        "best_k": (
            "ValueError naming cost_of_k if it is empty or a cost is <= 0. For k in "
            "sorted(cost_of_k): rate = expected_tokens_per_step(alpha, k) / cost_of_k[k]; keep "
            "the k whose rate is strictly larger than the best so far (a tie keeps the smaller)."),
        "rollback_block_table": (
            "ValueError naming n unless 0 <= n <= num_tokens; keep = ceil((num_tokens - n) / "
            "block_size) blocks, in integers (num_tokens - n + block_size - 1) // block_size. For "
            "each block in table[keep:]: refcounts[block] -= 1, and it is freed only if that "
            "leaves 0. Return (list(table[:keep]), the freed blocks in table order)."),
    },
    "ch13": {
        "dfa_step": (
            "for char in text: next_state = transitions.get(state, {}).get(char) (a state with "
            "no way on has no row, so no transitions[state][char]: that raises KeyError); if "
            "next_state is None, return None at once; else state = next_state. After the loop, "
            "return state (the state itself for the empty text)."),
        "accepts": (
            "end = dfa_step(transitions, START, text); return end is not None and end in "
            "accepting. The end of the walk decides, not a state passed on the way, and there is "
            "no special case for \"\": it matches exactly when the start state accepts."),
        "token_mask": (
            "One bool per token_id, text in enumerate(vocab): for eos_id, state in accepting "
            "(its text plays no part); for the others, text != \"\" and dfa_step(transitions, "
            "state, text) is not None: every character read, the landing state accepting or "
            "not."),
        "constrain": (
            "mask = torch.tensor(allowed, dtype=torch.bool); a ValueError naming allowed unless "
            "mask.shape == logits.shape[-1:] and mask.any(); return logits.masked_fill(~mask, "
            "float(\"-inf\")): a new tensor, the [V] mask broadcast over the rows. Not 0: "
            "softmax gives a logit of 0 a real chance."),
        "apply_temperature_then_mask": (
            "A ValueError naming temperature unless temperature > 0; probs = "
            "torch.softmax(logits / temperature, dim=-1); kept = probs * mask (mask a BoolTensor "
            "of allowed); return kept / kept.sum(dim=-1, keepdim=True): divide by the mass that "
            "is left, not by 1 or by the number of allowed tokens."),
        "logit_bias": (
            "out = logits.clone(); for token, value in bias.items(): out[token] += value; return "
            "out. Added to the logit (not multiplied, not on a probability, not a replacement), "
            "and -100 stays the number -100, not -inf."),
    },
}
