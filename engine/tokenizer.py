"""A thin wrapper over the `tokenizers` library: encode, decode, and streaming detokenization.

Why streaming needs care: one character can span several byte-level tokens (a Chinese character is
three bytes, often two or three tokens). Decoding token by token would print broken characters
("\ufffd"), so `IncrementalDetokenizer` only releases text once it decodes cleanly.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

REPLACEMENT_CHAR = "\ufffd"  # what a decoder prints for an incomplete UTF-8 sequence


class Tokenizer:
    def __init__(self, tk: HFTokenizer, bos_token_id: int | None, eos_token_ids: list[int],
                 pad_token_id: int | None = None):
        self.tk = tk
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id

    @classmethod
    def from_dir(cls, path: Path, model_config=None) -> Tokenizer:
        tk = HFTokenizer.from_file(str(path / "tokenizer.json"))
        special = _special_tokens(path)
        bos = _token_id(tk, special.get("bos_token"))
        eos = _token_id(tk, special.get("eos_token"))
        pad = _token_id(tk, special.get("pad_token"))
        if model_config is not None:
            bos = bos if bos is not None else model_config.bos_token_id
            eos_ids = model_config.eos_token_ids or ([eos] if eos is not None else [])
        else:
            eos_ids = [eos] if eos is not None else []
        return cls(tk, bos, eos_ids, pad)

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size()

    @property
    def adds_bos(self) -> bool:
        """Does encoding an empty string still give a token (a BOS added by the post-processor)?"""
        return len(self.tk.encode("").ids) > 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id's own piece, for showing how text was cut (byte-level pieces may be partial characters)."""
        return [self.tk.id_to_token(i) for i in ids]

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never emitting half a character.

    We keep two offsets into the ids: text before `prefix` is already emitted and stable;
    decoding ids[prefix:] and subtracting the decoding of ids[prefix:read] gives the new text.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the newly printable text (possibly "")."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read])
        after = decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT_CHAR):
            delta = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += delta
            return delta
        return ""


def _special_tokens(path: Path) -> dict:
    cfg_file = path / "tokenizer_config.json"
    if not cfg_file.exists():
        return {}
    cfg = json.loads(cfg_file.read_text())
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = cfg.get(key)
        out[key] = value.get("content") if isinstance(value, dict) else value
    return out


def _token_id(tk: HFTokenizer, token: str | None) -> int | None:
    return None if token is None else tk.token_to_id(token)
