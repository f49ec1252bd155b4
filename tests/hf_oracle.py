"""Tiny random `transformers` models saved to disk: the oracle every model test compares against."""

from __future__ import annotations

from pathlib import Path

import torch

# Each entry: (transformers config class name, kwargs). Small enough to build in milliseconds.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5)
ORACLE_CONFIGS = {
    "llama_gqa": ("LlamaConfig", dict(TINY, num_key_value_heads=2)),
    "llama3_rope_scaling": ("LlamaConfig", dict(
        TINY, num_key_value_heads=1, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral": ("MistralConfig", dict(TINY, num_key_value_heads=2, sliding_window=8)),
    "qwen2_qkv_bias_untied": ("Qwen2Config", dict(TINY, num_key_value_heads=2, tie_word_embeddings=False)),
    "smollm_tied_head_dim": ("LlamaConfig", dict(TINY, num_key_value_heads=2, head_dim=24,
                                                  tie_word_embeddings=True)),
}


def save_tiny_hf_model(name: str, folder: Path, seed: int = 0):
    """Build a random transformers model for `name`, save it with save_pretrained, return it (fp32, eval)."""
    import transformers

    cls_name, kwargs = ORACLE_CONFIGS[name]
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # random biases too (they are zero-initialised), so the bias path is tested
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model.eval()
