"""Chapter 00/01 oracle: our one-file model equals Hugging Face `transformers`, logit for logit."""

import pytest
import torch

from engine import load_model
from engine.companions.naive import full_logits
from hf_oracle import ORACLE_CONFIGS, save_tiny_hf_model

# Max |ours - transformers| over all logits. fp32: the bar. Half precisions: one or two bf16/fp16
# rounding steps of logits of magnitude ~1 (bf16 has 8 mantissa bits: a step of 2^-8 ≈ 0.004 near 1).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
BATCH, SEQ_LEN = 2, 40  # longer than the Mistral oracle's sliding window (8), so the window is exercised


@pytest.fixture(scope="module", params=list(ORACLE_CONFIGS))
def saved_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_hf_model(request.param, folder)
    return request.param, folder, hf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_full_logits_match_transformers(saved_model, dtype):
    name, folder, hf = saved_model
    vocab = hf.config.vocab_size
    input_ids = torch.randint(0, vocab, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(7))
    model, _ = load_model(folder, dtype=dtype)
    ours = full_logits(model, input_ids)
    assert ours.shape == (BATCH, SEQ_LEN, vocab) and ours.dtype == dtype
    with torch.no_grad():
        theirs = hf.to(dtype)(input_ids).logits
    hf.float()
    diff = (ours.float() - theirs.float()).abs().max().item()
    print(f"{name} {dtype}: max |diff| = {diff:.3e}")
    assert diff <= TOLERANCE[dtype], f"{name} {dtype}: max |diff| {diff:.3e} > {TOLERANCE[dtype]:.0e}"


def test_sliding_window_changes_logits_beyond_the_window(tmp_path):
    """A guard against an oracle that passes vacuously: without the window, Mistral's logits differ."""
    save_tiny_hf_model("mistral", tmp_path)
    model, _ = load_model(tmp_path)
    ids = torch.randint(0, 128, (1, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    windowed = full_logits(model, ids)
    model.config.sliding_window = None
    unwindowed = full_logits(model, ids)
    window = 8
    assert torch.allclose(windowed[:, :window], unwindowed[:, :window], atol=1e-5)
    assert (windowed[:, window:] - unwindowed[:, window:]).abs().max() > 1e-3
