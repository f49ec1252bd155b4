"""The fast decode path computes the same function as the readable model: same greedy tokens as the
naive loop, and logits close to the reference model's at every prefill and decode step."""

import pytest
import torch
from hf_oracle import ORACLE_CONFIGS, save_tiny_hf_model

from engine import load_model
from engine.config import ModelConfig
from engine.fast_decode import FastDecoder
from engine.model import LlamaModel, apply_rope
from engine.naive import full_logits, generate_naive
from engine.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

# |fast - reference| over the logits of every step, both models in the same dtype: (mean, max).
# fp32: only the order of floating-point sums differs (seen on tinylab: mean 3e-6, max 2e-5).
# Half precisions round at different places (fused matmuls and residual adds that round once,
# RoPE and attention in fp32), so single logits differ by a few rounding steps of tinylab's residual
# stream, which reaches |x| ~ 65 where a bf16 step is 0.5 and an fp16 step 0.03 (seen: bf16 mean
# 0.017, max 0.22; fp16 mean 0.002, max 0.03). About 2x headroom over what we saw; and
# test_half_precision_fast_path_is_as_accurate_as_the_reference checks both paths against fp32.
# dtype: (mean, max) of |fast - reference|. The mean tolerance is per unit of the logits' mean size once that
# exceeds 1: bf16 keeps 8 bits of mantissa whatever the size, so a model with larger logits (the retrained
# tinylab: mean |logit| ~6) has proportionally larger absolute rounding differences.
TOLERANCE = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (5e-3, 0.1),
    torch.bfloat16: (8e-3, 0.5),
}


def random_model(kv_heads: int, tied: bool = False, qkv_bias: bool = False, window=None, seed: int = 0):
    """A small random model with sharp logits (far from ties), so greedy tokens are well defined."""
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                      qkv_bias=qkv_bias, tie_word_embeddings=tied, sliding_window=window, eos_token_id=1)
    torch.manual_seed(seed)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:  # biases too, so a dropped or misplaced bias changes the output
                p.normal_(0, 0.2)
    return model.eval()


def prompts(n: int, vocab: int = 97, seed: int = 0, max_len: int = 30):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(1, max_len, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def step_logits(fast: FastDecoder, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits [1 + len(continuation), V]: the prefill's, then one per decode step (teacher forced)."""
    cache = fast.new_cache(len(prompt) + len(continuation))
    out = [fast.prefill(cache, prompt)]
    out += [fast.decode(cache, t) for t in continuation]
    return torch.stack(out)


def reference_logits(model: LlamaModel, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """The readable model, no cache, over the whole sequence: the logits of the same positions."""
    ids = torch.tensor([prompt + continuation])
    return full_logits(model, ids)[0, len(prompt) - 1:]  # [1 + len(continuation), V]


def assert_close_per_dtype(fast: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    mean_tol, max_tol = TOLERANCE[ref.dtype]
    assert fast.dtype == ref.dtype, f"{what}: fast logits are {fast.dtype}, reference {ref.dtype}"
    diff = (fast.float() - ref.float()).abs()  # [steps, V]
    mean, worst = diff.mean().item(), diff.max().item()
    mean_tol *= max(1.0, ref.float().abs().mean().item())  # relative to the logits' size once they exceed 1
    step = divmod(diff.argmax().item(), diff.shape[-1])[0]
    assert mean <= mean_tol and worst <= max_tol, (
        f"{what}: |fast - reference| mean {mean:.2e} (tolerance {mean_tol:.0e}), "
        f"max {worst:.2e} at step {step} (tolerance {max_tol:.0e})")


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["no_bias", "qkv_bias"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_greedy_tokens_equal_the_naive_loop(kv_heads, tied, qkv_bias):
    model = random_model(kv_heads, tied=tied, qkv_bias=qkv_bias, seed=kv_heads)
    fast = FastDecoder(model)
    for p in prompts(8, seed=10 * kv_heads + 2 * tied + qkv_bias):
        naive = generate_naive(model, None, p, GREEDY)
        assert fast.generate(p, GREEDY).token_ids == naive.token_ids, f"prompt {p}"


def test_greedy_tokens_equal_the_naive_loop_under_a_sliding_window():
    """Sequences grow to 3-7x the window, so decode must attend over only the last W keys."""
    model = random_model(2, window=8, seed=3)
    fast = FastDecoder(model)
    for p in prompts(6, seed=5):
        naive = generate_naive(model, None, p, GREEDY)
        assert fast.generate(p, GREEDY).token_ids == naive.token_ids, f"prompt {p}"


@pytest.fixture(scope="module")
def tinylab():
    return load_model("tinylab")


TINYLAB_PROMPTS = ["Q: 12+35= A:", "Once upon a time", "Q: 907-45= A:", "JSON: name Ada, city Paris",
                   "k3=v9; k7=v2; k1=v5; Q: k7?", "Tell me a story about a cat"]


def test_tinylab_greedy_text_equals_the_naive_loop(tinylab):
    model, tok = tinylab
    fast = FastDecoder(model)
    params = SamplingParams(temperature=0.0, max_tokens=32, stop=["\n"])  # EOS and a stop string can end it
    for prompt in TINYLAB_PROMPTS:
        naive = generate_naive(model, tok, prompt, params)
        ours = fast.generate(prompt, params, tokenizer=tok)
        assert (ours.token_ids, ours.text, ours.finish_reason) == (naive.token_ids, naive.text,
                                                                   naive.finish_reason), prompt


LAYOUTS = {"NK_view": dict(kn_layout=False), "KN_copy": dict(kn_layout=True, kn_blocks=1),
           "KN_2_blocks": dict(kn_layout=True, kn_blocks=2), "KN_3_blocks": dict(kn_layout=True, kn_blocks=3)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_tinylab_step_logits_match_the_reference_model(tinylab, dtype, layout):
    """Every weight layout, in every dtype: a view of nn.Linear's (N, K), or a (K, N) copy in one or
    several column blocks (3 blocks do not divide tinylab's 704-wide MLP: those fall back to one)."""
    _, tok = tinylab
    model, _ = load_model("tinylab", dtype=dtype)
    fast = FastDecoder(model, **LAYOUTS[layout])
    for prompt in TINYLAB_PROMPTS[:3]:
        ids = tok.encode(prompt)
        continuation = generate_naive(model, None, ids, GREEDY).token_ids
        assert_close_per_dtype(step_logits(fast, ids, continuation),
                               reference_logits(model, ids, continuation), f"tinylab {dtype} {prompt!r}")


@pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")  # random checkpoints: token ids only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(ORACLE_CONFIGS))
def test_step_logits_match_the_reference_model_on_oracle_checkpoints(name, dtype, tmp_path):
    """The transformers-made checkpoints: GQA/MQA, Llama 3.1 RoPE scaling, Mistral's window (8 here,
    sequences up to 40), Qwen2's qkv bias, a tied head with head_dim != hidden/heads."""
    save_tiny_hf_model(name, tmp_path)
    model, _ = load_model(tmp_path, dtype=dtype)
    fast = FastDecoder(model)
    for p in prompts(2, vocab=128, seed=1, max_len=16):
        continuation = prompts(1, vocab=128, seed=len(p), max_len=25)[0]
        assert_close_per_dtype(step_logits(fast, p, continuation),
                               reference_logits(model, p, continuation), f"{name} {dtype}")


def test_bf16_fast_argmax_agrees_wherever_the_reference_is_decisive(tinylab):
    """In bf16 a near-tie may flip either way; wherever the reference's top two logits are further
    apart than twice the largest difference we tolerate, the fast path must pick the same token."""
    _, tok = tinylab
    model, _ = load_model("tinylab", dtype=torch.bfloat16)
    fast, max_tol = FastDecoder(model), TOLERANCE[torch.bfloat16][1]
    decisive_steps = 0
    for prompt in TINYLAB_PROMPTS:
        ids = tok.encode(prompt)
        continuation = generate_naive(model, None, ids, GREEDY).token_ids
        ref = reference_logits(model, ids, continuation).float()
        ours = step_logits(fast, ids, continuation).float()
        top2 = ref.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 2 * max_tol
        decisive_steps += int(decisive.sum())
        assert torch.equal(ours.argmax(-1)[decisive], ref.argmax(-1)[decisive]), prompt
    assert decisive_steps >= 30, f"only {decisive_steps} decisive steps: too few for the test to mean much"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_fast_path_is_as_accurate_as_the_reference(tinylab, dtype):
    """Measured against the fp32 model, the fast path's mean logit error in bf16/fp16 is no worse
    than the readable model's own error in the same dtype (with 25% slack)."""
    model32, tok = tinylab
    model, _ = load_model("tinylab", dtype=dtype)
    fast, ref_err, fast_err = FastDecoder(model), [], []
    for prompt in TINYLAB_PROMPTS:
        ids = tok.encode(prompt)
        continuation = generate_naive(model32, None, ids, GREEDY).token_ids
        truth = reference_logits(model32, ids, continuation)
        ref_err.append((reference_logits(model, ids, continuation).float() - truth).abs().mean())
        fast_err.append((step_logits(fast, ids, continuation).float() - truth).abs().mean())
    ref_mean, fast_mean = torch.stack(ref_err).mean().item(), torch.stack(fast_err).mean().item()
    assert fast_mean <= 1.25 * ref_mean, f"{dtype}: fast error {fast_mean:.2e} vs reference {ref_mean:.2e}"


def test_rope_as_one_matrix_equals_apply_rope():
    model = random_model(2)
    fast = FastDecoder(model)
    start, T, D = 5, 7, model.config.head_dim
    x = torch.randn(T, 6, D)  # [T, heads, D]
    positions = torch.arange(start, start + T)[None]  # [1, T]
    cos, sin = model.rope(positions, x.dtype)  # [1, T, 1, D]
    expected = apply_rope(x[None], cos, sin)[0]
    torch.testing.assert_close(torch.bmm(x, fast.rope_matrices(start, T)), expected, atol=1e-6, rtol=1e-6)


def test_prefill_in_chunks_equals_one_prefill():
    model = random_model(2, qkv_bias=True)
    fast = FastDecoder(model)
    ids = prompts(1, seed=4)[0] + [7] * 12
    whole = fast.prefill(fast.new_cache(64), ids)
    cache = fast.new_cache(64)
    fast.prefill(cache, ids[:9])
    chunked = fast.prefill(cache, ids[9:])
    assert cache.length == len(ids)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def test_a_full_cache_raises_instead_of_writing_past_its_end():
    fast = FastDecoder(random_model(2))
    cache = fast.new_cache(capacity=5)
    fast.prefill(cache, [3, 4, 5, 6])
    fast.decode(cache, 7)
    before = cache.kv.clone()
    with pytest.raises(ValueError, match="capacity=5"):
        fast.decode(cache, 8)
    assert cache.length == 5 and torch.equal(cache.kv, before)


@pytest.mark.parametrize("capacity", [0, 129], ids=["zero", "beyond_context"])
def test_a_cache_capacity_outside_the_model_context_is_refused(capacity):
    fast = FastDecoder(random_model(2))
    with pytest.raises(ValueError, match=r"capacity=.* must be in \[1, max_position_embeddings=128\]"):
        fast.new_cache(capacity)


def test_empty_input_is_refused_with_a_clear_message():
    fast = FastDecoder(random_model(2))
    with pytest.raises(ValueError, match="empty"):
        fast.prefill(fast.new_cache(8), [])
    with pytest.raises(ValueError, match="empty"):
        fast.generate([], GREEDY)
