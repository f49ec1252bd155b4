"""Look inside a model: where its parameters are,
what shape each stage's output has, how text is cut.

Chapter 00 uses these three views of the same `LlamaModel` and `Tokenizer`:

    parameter_table(model)          one row per component: params, bytes at the model's dtype, share
    trace_shapes(model, input_ids)  (module name, output shape) for every stage of one forward pass
    tokenization_table(tok, text)   one row per token: id, piece, the UTF-8 bytes it covers

Nothing here changes the model: `trace_shapes` attaches forward hooks only inside a `with` block
(`recording_shapes`) and removes them on the way out, even when the forward raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from engine.model import LlamaModel
from engine.tokenizer import Tokenizer

# ---------------------------------------------------------------------------- parameters

# The components of a Llama-family decoder, in the order a token meets them, and how we recognise
# each one's parameters by name (a parameter belongs to the first component whose marker it
# contains).
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("embeddings", "embed_tokens."),
    ("attention q", "self_attn.q_proj."),
    ("attention k", "self_attn.k_proj."),
    ("attention v", "self_attn.v_proj."),
    ("attention o", "self_attn.o_proj."),
    ("MLP gate", "mlp.gate_proj."),
    ("MLP up", "mlp.up_proj."),
    ("MLP down", "mlp.down_proj."),
    ("norms", "norm."),  # input_layernorm, post_attention_layernorm and the final norm
    ("lm_head", "lm_head."),
)
PERCENT = 100.0


def component_of(param_name: str) -> str:
    """`layers.3.self_attn.k_proj.weight` -> "attention k"; "other" for names we do not know."""
    for component, marker in COMPONENTS:
        if marker in f".{param_name}":
            return component
    return "other"


def parameter_table(model: nn.Module) -> list[dict]:
    """Rows of {component, params, bytes, share, tensors, note}, one per component, in model order.

    A tensor shared by two components (tinylab's lm_head *is* its embedding matrix: "tied"
    embeddings) is counted once, under the component that owns it first; the other component's
    row has 0 params and a note saying whose weight it reuses. So the params column sums to the
    number of distinct parameters, which is what a model card's "135M" means. `bytes` is what the
    parameters occupy at the model's own dtype (4 per number in fp32, 2 in bf16), and `share` is
    the component's percentage of all parameters.
    """
    rows = {name: {"component": name, "params": 0, "bytes": 0, "tensors": 0, "note": ""}
            for name, _ in COMPONENTS}
    owner: dict[int, str] = {}  # id(parameter) -> the component that counted it
    for name, p in model.named_parameters(remove_duplicate=False):
        component = component_of(name)
        row = rows.setdefault(component, {"component": component, "params": 0, "bytes": 0,
                                          "tensors": 0, "note": ""})
        if id(p) in owner:
            row["note"] = f"tied to {owner[id(p)]} (the same tensor, counted once)"
            continue
        owner[id(p)] = component
        row["params"] += p.numel()
        row["bytes"] += p.numel() * p.element_size()
        row["tensors"] += 1
    total = sum(r["params"] for r in rows.values())
    table = [r for r in rows.values() if r["tensors"] or r["note"]]
    for r in table:
        r["share"] = PERCENT * r["params"] / total if total else 0.0
    return table


def format_parameter_table(table: list[dict]) -> str:
    """The table as aligned text, with a total line."""
    lines = [f"{'component':<12} {'tensors':>7} {'params':>12} {'bytes':>14} {'share':>7}  note"]
    for r in table:
        lines.append(f"{r['component']:<12} {r['tensors']:>7} {r['params']:>12,} {r['bytes']:>14,} "
                     f"{r['share']:>6.1f}%  {r['note']}")
    tensors, params, nbytes = (sum(r[k] for r in table) for k in ("tensors", "params", "bytes"))
    share = sum(r["share"] for r in table)
    lines.append(f"{'total':<12} {tensors:>7} {params:>12,} {nbytes:>14,} {share:>6.1f}%")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- shapes

# Submodules of one decoder layer whose outputs we record, as they appear in `engine/model.py`.
LAYER_STAGES = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                "self_attn.o_proj", "self_attn", "post_attention_layernorm", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj", "mlp")


def traced_module_names(model: LlamaModel, layers: Iterable[int] | None = None) -> list[str]:
    """The submodules `trace_shapes` listens to: embeddings,
    each chosen layer's stages, norm, lm_head."""
    n_layers = len(model.layers)
    chosen = range(n_layers) if layers is None else list(layers)
    for i in chosen:
        if not 0 <= i < n_layers:
            raise ValueError(f"layers: layer index {i} is out of range [0, {n_layers - 1}]")
    names = ["embed_tokens"]
    for i in chosen:
        names += [f"layers.{i}.{stage}" for stage in LAYER_STAGES] + [f"layers.{i}"]
    return names + ["norm", "lm_head"]


@contextmanager
def recording_shapes(model: nn.Module, names: Iterable[str]) -> Iterator[list[tuple[str, tuple]]]:
    """Inside the block, every forward of the named submodules appends (name, output shape).

    A module's hook fires when its forward *returns*, so a parent (`layers.0.self_attn`) is
    recorded after its children (`layers.0.self_attn.q_proj`, ...). The hooks are removed when
    the block ends, however it ends.
    """
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise KeyError(f"names: the model has no submodule(s) {missing}")
    records: list[tuple[str, tuple]] = []
    handles = []
    try:
        for name in names:
            def hook(module, args, output, name=name):
                records.append((name, tuple(output.shape)))
            handles.append(modules[name].register_forward_hook(hook))
        yield records
    finally:
        for handle in handles:
            handle.remove()


def trace_shapes(model: LlamaModel, input_ids: Tensor,
                 layers: Iterable[int] | None = None) -> list[tuple[str, tuple]]:
    """Run one forward pass over `input_ids` [B, T]
    and return each stage's (name, output shape), in order.

    `layers` picks which decoder layers to list (None: all of them; every layer has the same
    shapes). For tinylab and 5 tokens the list starts `("embed_tokens", (1, 5, 256))` and ends
    `("lm_head", (1, 5, 1024))`: one row of logits over the vocabulary per position.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    with (recording_shapes(model, traced_module_names(model, layers)) as records,
          torch.inference_mode()):
        model(input_ids)
    return records


# ---------------------------------------------------------------------------- tokens


def _byte_level_alphabet() -> dict[str, int]:
    """The printable stand-in of each byte in byte-level BPE (GPT-2's table),
    inverted: char -> byte.

    Printable bytes stand for themselves; the other 68 (controls, space, ...) are shifted to
    code points 256 and up, which is why a space shows up as "Ġ" (256 + 32) in a piece.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


def piece_bytes(piece: str, alphabet: dict[str, int] | None = None) -> bytes:
    """The bytes a byte-level piece stands for ("Ġcat" -> b" cat"; "æ" -> b"\\xe6")."""
    alphabet = alphabet or _byte_level_alphabet()
    try:
        return bytes(alphabet[c] for c in piece)
    except KeyError as e:
        raise ValueError(f"piece {piece!r} is not a byte-level BPE piece (character {e} has no "
                         "byte); tokenization_table needs a byte-level tokenizer") from None


def tokenization_table(tokenizer: Tokenizer, text: str,
                       add_special_tokens: bool = False) -> list[dict]:
    """One row per token of `text`: {id, piece, bytes, hex, chars, whole}.

    `bytes` is the UTF-8 the token covers (special tokens such as BOS cover none); `chars` is the
    text those bytes belong to, and `whole` says whether the token holds complete characters. A
    Chinese character is three UTF-8 bytes; a small vocabulary rarely has a token for all three,
    so the character spans several tokens, each `whole=False`:

        推 = e6 8e a8   ->   tokens "æ" (e6) + "İ" (8e) + "¨" (a8)
    """
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    special = {i for i, t in tokenizer.tk.get_added_tokens_decoder().items() if t.special}
    alphabet = _byte_level_alphabet()
    pieces = tokenizer.token_strings(ids)
    covered = [b"" if i in special else piece_bytes(p, alphabet)
               for i, p in zip(ids, pieces, strict=True)]
    stream = b"".join(covered)
    starts = _char_starts(stream)
    rows, offset = [], 0
    for token_id, piece, b in zip(ids, pieces, covered, strict=True):
        lo, hi = offset, offset + len(b)
        # start of the character holding byte lo
        first = max((s for s in starts if s <= lo), default=0)
        # end of the one holding byte hi-1
        last = min((s for s in starts if s >= hi), default=len(stream))
        rows.append({"id": token_id, "piece": piece, "bytes": b, "hex": b.hex(" "),
                     "chars": stream[first:last].decode("utf-8", errors="replace") if b else "",
                     "whole": bool(b) and lo in starts and hi in starts})
        offset = hi
    return rows


def _char_starts(data: bytes) -> set[int]:
    """Byte offsets where a UTF-8 character starts
    (a continuation byte is 0b10xxxxxx), plus the end."""
    CONTINUATION_MASK, CONTINUATION = 0b1100_0000, 0b1000_0000
    return {i for i, b in enumerate(data) if b & CONTINUATION_MASK != CONTINUATION} | {len(data)}


def format_tokenization_table(rows: list[dict]) -> str:
    """The tokenization table as aligned text (spaces and newlines made visible in `chars`)."""
    lines = [f"{'id':>5}  {'piece':<10} {'bytes':<12} {'chars':<8} whole"]
    for r in rows:
        chars = r["chars"].replace(" ", "\u2423").replace("\n", "\u21b5")
        whole = "yes" if r["whole"] else "part"
        lines.append(f"{r['id']:>5}  {r['piece']:<10} {r['hex']:<12} {chars:<8} {whole}")
    return "\n".join(lines)
