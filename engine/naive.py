"""Chapter 01: the generation loop with no cache, exactly the loop a reader first imagines.

    ids = prompt
    repeat:
        logits = model(ids)            # the FULL sequence, every step: nothing is remembered
        next = sample(logits[-1])      # only the last position predicts the next token
        ids.append(next)
        stop on EOS, a stop string/id, or max_tokens

Every step recomputes the keys and values of every earlier token, so step t costs O(t) work
(and attention O(t^2)): chapter 03's KV cache exists to remove exactly that waste.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.model import LlamaModel


@torch.inference_mode()
def full_logits(model: LlamaModel, input_ids: Tensor) -> Tensor:
    """Logits at every position, no cache: input_ids [B, T] -> [B, T, V]."""
    return model(input_ids)
