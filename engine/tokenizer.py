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
                 pad_token_id: int | None = None, chat_template: str | None = None):
        self.tk = tk
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template  # jinja2 source; None: PLAIN_CHAT_TEMPLATE (see below)

    @classmethod
    def from_dir(cls, path: Path, model_config=None) -> Tokenizer:
        file = path / "tokenizer.json"
        try:
            tk = HFTokenizer.from_file(str(file))
        except Exception as e:
            # the tokenizers library raises a bare Exception for a malformed file
            raise ValueError(f"{file} is not a readable tokenizer.json ({e}); re-save it with the "
                             "`tokenizers` library or re-download it") from None
        special = _special_tokens(path)
        bos = _token_id(tk, special.get("bos_token"))
        eos = _token_id(tk, special.get("eos_token"))
        pad = _token_id(tk, special.get("pad_token"))
        if model_config is not None:
            bos = bos if bos is not None else model_config.bos_token_id
            eos_ids = model_config.eos_token_ids or ([eos] if eos is not None else [])
        else:
            eos_ids = [eos] if eos is not None else []
        return cls(tk, bos, eos_ids, pad, _chat_template(path))

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
        """Each id's own piece, for showing how text was cut (byte-level pieces may be partial
        characters)."""
        return [self.tk.id_to_token(i) for i in ids]

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """A conversation ([{"role": ..., "content": ...}, ...]) as the prompt text the model was
        tuned on, rendered from the model's own template (or PLAIN_CHAT_TEMPLATE); see
        `render_chat_template`."""
        special = {"bos_token": self._token_text(self.bos_token_id),
                   "eos_token": self._token_text(self.eos_token_ids[0] if self.eos_token_ids
                                                 else None),
                   "pad_token": self._token_text(self.pad_token_id)}
        return render_chat_template(self.chat_template or PLAIN_CHAT_TEMPLATE, messages,
                                    add_generation_prompt, **special)

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.tk.id_to_token(token_id)


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
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is not valid JSON ({e}); fix the file or delete it") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file} must hold a JSON object, found a {type(cfg).__name__}")
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = cfg.get(key)
        out[key] = value.get("content") if isinstance(value, dict) else value
    return out


def _chat_template(path: Path) -> str | None:
    cfg_file = path / "tokenizer_config.json"
    return json.loads(cfg_file.read_text()).get("chat_template") if cfg_file.exists() else None


def _token_id(tk: HFTokenizer, token: str | None) -> int | None:
    return None if token is None else tk.token_to_id(token)


# ---- prompts in, stops out: the token ids a generation loop starts from and stops at -------------


def encode_prompt(prompt: str | list[int], tokenizer: Tokenizer | None, max_len: int) -> list[int]:
    """Token ids of a prompt, with clear errors for an empty or too long one."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt is text but the model has no tokenizer; "
                             "pass token ids instead")
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(i) for i in prompt]
    if not ids:
        raise ValueError("prompt is empty (and the tokenizer adds no BOS token); "
                         "give at least one token")
    if len(ids) >= max_len:
        raise ValueError(f"prompt has {len(ids)} tokens but the model's context is {max_len}; "
                         f"shorten it to at most {max_len - 1} tokens")
    return ids


def eos_ids(model, tokenizer: Tokenizer | None) -> list[int]:
    """ALL end-of-sequence ids: the tokenizer's when it knows them, else the model config's.
    `model` is anything with `.config.eos_token_ids` (a LlamaModel; we do not import the model
    here)."""
    if tokenizer is not None and tokenizer.eos_token_ids:
        return tokenizer.eos_token_ids
    return model.config.eos_token_ids


# ---- chat templates: a conversation -> the prompt text an instruction-tuned model expects --------

# For models that ship no template (tinylab, tiny test models): the "User: ...\nAssistant:" shape
# tinylab's `refuse` task was trained on, after the BOS token.
PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] | capitalize }}: "
    "{{ m['content'] }}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
CHAT_ROLES = ("system", "user", "assistant", "tool")


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         **special_tokens: str) -> str:
    """Render a chat template the way `transformers` does.

    A template is a small jinja2 program that ships with the model (SmolLM2's wraps every turn in
    `<|im_start|>role ... <|im_end|>`). It is code from a file, so we run it in jinja2's immutable
    sandbox, with transformers' settings (trim_blocks, lstrip_blocks) and helpers (raise_exception,
    a tojson that keeps non-ASCII text): the same template gives the same text in both.
    """
    _check_messages(messages)
    return _compile_chat_template(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens)


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, "
                         f"got {messages!r}")
    for i, m in enumerate(messages):
        if (not isinstance(m, dict) or not isinstance(m.get("content"), str)
                or m.get("role") not in CHAT_ROLES):
            raise ValueError(f"messages[{i}] = {m!r}: each message needs a 'role' in {CHAT_ROLES} "
                             "and a 'content' string")


def _compile_chat_template(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)
