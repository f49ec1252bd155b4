r"""Figures for chapter 13: structured outputs, from a regex's automaton to what a constraint
does to the quality of an answer.

    render_dfa                a DFA as states and edges, exactly the lines `format_dfa` prints:
                              an arrow into the start, accepting states ringed twice, each edge
                              labelled with the bytes it reads
    render_token_walks        tokens read byte by byte from one state: the state after every
                              byte, DEAD where the walk falls off (one token may cross many states)
    render_token_mask         one state's mask over a whole vocabulary (every id a cell, allowed
                              ones lit), beside how many tokens each state of the DFA allows
    render_masked_top_tokens  the model's most likely next tokens before the mask (the forbidden
                              ones red) and after it (the survivors, renormalized by softmax)
    render_mask_cost          compile time and per-step mask time per masker, against one
                              decode step of the model
    render_quality            parse rate, schema-valid rate and field accuracy with and without
                              the constraint, per task and precision

How a token walks (r"\d+(\.\d+)?" from its start, state 0)::

    token "2.5"   0 --2--> 1 --.--> 2 --5--> 3          three states crossed in one step: allowed
    token "1a"    0 --1--> 1 --a--> DEAD                falls off at its second byte: forbidden

Artists carry a `gid`: "state:<s>", "accept:<s>", "edge:<s>:<t>" (its label "label:<s>:<t>")
and "start" in a DFA; "walk:<row>:<j>" (cell j of a row's walk, 0 = the state it starts in);
"allowed:<id>" and "forbidden:<id>" (before the mask), "after:<id>" (after it);
"count:<s>" (allowed tokens per state); "compile:<masker>", "mask:<masker>", "decode_step";
"parse:<task>:<precision>:<constrained|free>" (and "valid:...", "fields:...") in the quality bars.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyArrowPatch, Patch, Rectangle
from torch import Tensor

from engine.structured.regex_dfa import DEAD, DFA, TokenTable, format_dfa
from engine.viz._figure import fail as _fail
from engine.viz._figure import need_rows as _need
from engine.viz._figure import new_figure as _new_figure

MS, US = 1e3, 1e6  # seconds -> milliseconds, microseconds
ALLOWED_COLOR, FORBIDDEN_COLOR = "tab:green", "tab:red"
STATE_COLOR, ACCEPT_COLOR, DEAD_COLOR = "#dbe9f6", "#b7e4b0", "#f4b6b2"
LIBRARY_COLOR, REFERENCE_COLOR, DECODE_COLOR = "tab:blue", "tab:orange", "0.3"
CONSTRAINED_COLOR, FREE_COLOR = "tab:green", "0.65"
# ---- the DFA drawing, in axis units (the axes keep an equal aspect, so a circle stays round)
STATE_R = 0.28  # a state's radius
COL_DX, ROW_DY = 1.9, 1.3  # distance between depth columns, between states of one column
LOOP_W = 0.16  # half the width of a self-loop's foot on its state
CURVED = 0.35  # arc3 radius of an edge that goes back, skips a column, or has a twin the other way
MAX_STATES_DRAWN = 30  # more would be a picture of spaghetti: print format_dfa instead
# ---- the walks and the mask
WALK_CELL_W, WALK_CELL_H = 0.8, 0.8  # one byte's cell in a token walk
MAX_WALK_BYTES = 16  # bytes drawn per token (a longer token's walk is cut, with a note)
MASK_ROW = 256  # ids per row of the vocabulary grid (SmolLM2's 49,152 = 192 rows)
MARKED_ALLOWED = 400  # at most this many allowed ids also get a dot, so a handful stays visible
LISTED_TOKENS = 10  # allowed tokens listed by text under the vocabulary grid
MAX_STATE_TICKS = 24  # state numbers written under the per-state bars (every k-th beyond that)
TOP_SHOWN = 10  # tokens drawn in each panel of the before/after figure
MAX_LABEL_CHARS = 10  # characters of a token's text in a tick label
PRINTABLE, SPACE = (0x21, 0x7E), 0x20  # "!" .. "~" print as themselves; the space as "␣"


def token_label(piece: bytes | None, token_id: int | None = None) -> str:
    """A token's bytes as a short label: spaces as "␣", a newline as "⏎", bytes that are not
    whole UTF-8 as \\xhh, a special token (None) as <id>, cut to MAX_LABEL_CHARS with "…"."""
    if piece is None:
        return f"<{token_id}>" if token_id is not None else "<special>"
    text = piece.decode("utf-8", errors="backslashreplace").replace(" ", "␣").replace("\n", "⏎")
    text = text.replace("\t", "⇥") or "<empty>"
    return text if len(text) <= MAX_LABEL_CHARS else text[:MAX_LABEL_CHARS - 1] + "…"


def _show_byte(b: int) -> str:
    return chr(b) if PRINTABLE[0] <= b <= PRINTABLE[1] else "␣" if b == SPACE else f"\\x{b:02x}"


# ---- the DFA -------------------------------------------------------------------------------------


def dfa_edges(dfa: DFA) -> list[tuple[int, str, int]]:
    """(state, label, next state) for each line of `format_dfa(dfa)`: the edges the figure draws.

    A line reads ``2 (accept) --[0-9]--> 1``; a label never holds a space (format_dfa writes it
    as \\x20), so the last "--> " ends the label and the first " --" starts it."""
    edges = []
    for line in format_dfa(dfa).splitlines():
        if line.endswith("(no way on)"):
            continue
        head, target = line.rsplit("--> ", 1)
        source, label = head.split(" --", 1)
        edges.append((int(source.split()[0]), label, int(target)))
    return edges


def dfa_depths(dfa: DFA) -> dict[int, int]:
    """Each state's column: its distance in bytes from the start (breadth first); a state the
    start cannot reach goes in one column after the last."""
    depth = {dfa.start: 0}
    todo = deque([dfa.start])
    while todo:
        s = todo.popleft()
        for t in dfa.transitions[s]:
            if t != DEAD and t not in depth:
                depth[t] = depth[s] + 1
                todo.append(t)
    last = max(depth.values()) + 1
    return {s: depth.get(s, last) for s in range(dfa.num_states)}


def dfa_layout(dfa: DFA) -> dict[int, tuple[float, float]]:
    """Where each state sits: x by its column (`dfa_depths`), y spread within the column."""
    columns: dict[int, list[int]] = {}
    for s, d in dfa_depths(dfa).items():
        columns.setdefault(d, []).append(s)
    pos = {}
    for d, states in columns.items():
        for i, s in enumerate(states):
            pos[s] = (d * COL_DX, ((len(states) - 1) / 2 - i) * ROW_DY)
    return pos


def _arc_midpoint(p: tuple[float, float], q: tuple[float, float], rad: float):
    """The middle of matplotlib's arc3 curve from p to q (a quadratic Bezier through the control
    point mid + rad * (dy, -dx)): where its label goes."""
    (x1, y1), (x2, y2) = p, q
    return ((x1 + x2) / 2 + rad * (y2 - y1) / 2, (y1 + y2) / 2 - rad * (x2 - x1) / 2)


def _on_rims(p: tuple[float, float], q: tuple[float, float], rad: float):
    """Where an arc3 edge from state p to state q leaves p's circle and meets q's: each end moves
    STATE_R towards the curve's control point, along the curve's tangent there."""
    (x1, y1), (x2, y2) = p, q
    cx, cy = (x1 + x2) / 2 + rad * (y2 - y1), (y1 + y2) / 2 - rad * (x2 - x1)
    ends = []
    for x, y in (p, q):
        norm = math.hypot(cx - x, cy - y) or 1.0
        ends.append((x + STATE_R * (cx - x) / norm, y + STATE_R * (cy - y) / norm))
    return ends[0], ends[1]


def _draw_state(ax, s: int, xy, accepting: bool) -> None:
    ax.add_patch(Circle(xy, STATE_R, facecolor=ACCEPT_COLOR if accepting else STATE_COLOR,
                        edgecolor="0.2", linewidth=1.2, gid=f"state:{s}", zorder=3))
    if accepting:
        ax.add_patch(Circle(xy, STATE_R * 0.8, facecolor="none", edgecolor="0.2",
                            linewidth=1.0, gid=f"accept:{s}", zorder=4))
    ax.text(*xy, str(s), ha="center", va="center", fontsize=10, zorder=5)


def readable_label(label: str) -> str:
    """A format_dfa label as the figure prints it: a lone escaped byte that is a plain character
    outside a set ("\\x2d") as itself ("-"), the space as "␣"; sets ("[0-9]") as they are."""
    if len(label) == 4 and label.startswith("\\x"):
        b = int(label[2:], 16)
        return "␣" if b == SPACE else chr(b) if PRINTABLE[0] <= b <= PRINTABLE[1] else label
    return label


def _edge_label(ax, xy, label: str, gid: str) -> None:
    ax.text(*xy, readable_label(label), ha="center", va="center", fontsize=10, family="monospace",
            gid=gid,
            zorder=6, bbox={"boxstyle": "round,pad=0.15", "facecolor": "white",
                            "edgecolor": "none", "alpha": 0.9})


def _draw_edge(ax, s: int, t: int, label: str, pos, rad: float) -> None:
    (x, y) = pos[s]
    if s == t:  # a loop over the top of the state
        start, end = (x - LOOP_W, y + STATE_R * 0.9), (x + LOOP_W, y + STATE_R * 0.9)
        arrow = FancyArrowPatch(start, end, connectionstyle="arc3,rad=-2.2", arrowstyle="-|>",
                                mutation_scale=10, color="0.25", gid=f"edge:{s}:{t}", zorder=2)
        ax.add_patch(arrow)
        _edge_label(ax, (x, y + STATE_R + 0.5), label, f"label:{s}:{t}")
        return
    start, end = _on_rims(pos[s], pos[t], rad)
    arrow = FancyArrowPatch(start, end, connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>",
                            mutation_scale=12, color="0.25", shrinkA=0, shrinkB=0,
                            gid=f"edge:{s}:{t}", zorder=2)
    ax.add_patch(arrow)
    _edge_label(ax, _arc_midpoint(pos[s], pos[t], rad), label, f"label:{s}:{t}")


def render_dfa(dfa: DFA, title: str | None = None) -> Figure:
    """The DFA as states and edges: the lines of `format_dfa(dfa)`, one arrow each. States stand in
    columns by how many bytes they are from the start; an accepting state has a double ring (EOS
    may come there); a state with no way on is where the text must end."""
    if dfa.num_states > MAX_STATES_DRAWN:
        _fail("render_dfa", "dfa", f"has {dfa.num_states} states, more than the "
              f"{MAX_STATES_DRAWN} a drawing can keep readable; print format_dfa(dfa) instead")
    pos, depth, edges = dfa_layout(dfa), dfa_depths(dfa), dfa_edges(dfa)
    pairs = {(s, t) for s, _, t in edges}
    xs, ys = [p[0] for p in pos.values()], [p[1] for p in pos.values()]
    width = max(xs) - min(xs) + 2 * COL_DX
    fig, axes = _new_figure((min(16.0, 1.6 + 1.3 * width), 1.4 + 1.0 * (max(ys) - min(ys) + 2)))
    ax = axes[0][0]
    for s, xy in pos.items():
        _draw_state(ax, s, xy, dfa.accepting[s])
    for s, label, t in edges:
        forward_by_one = depth[t] == depth[s] + 1
        rad = 0.0 if forward_by_one and (t, s) not in pairs else CURVED
        _draw_edge(ax, s, t, label, pos, rad)
    x0, y0 = pos[dfa.start]
    ax.add_patch(FancyArrowPatch((x0 - 1.1, y0), (x0 - STATE_R, y0), arrowstyle="-|>",
                                 mutation_scale=12, color="0.25", gid="start"))
    ax.text(x0 - 1.1, y0 + 0.12, "start", fontsize=8, ha="left", va="bottom")
    ax.set_xlim(min(xs) - 1.3, max(xs) + 0.9)
    ax.set_ylim(min(ys) - 0.9, max(ys) + 1.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title if title is not None else
                 f"the DFA of  {dfa.pattern}  : {dfa.num_states} states "
                 f"({sum(dfa.accepting)} accepting, ringed twice)", fontsize=10)
    return fig


# ---- tokens that cross states --------------------------------------------------------------------


def walk_states(dfa: DFA, state: int, piece: bytes) -> list[int]:
    """[the state we start in, then the state after each byte]; DEAD from the first byte with no
    edge on (and for every byte after it)."""
    states = [state]
    for b in piece:
        states.append(DEAD if states[-1] == DEAD else dfa.transitions[states[-1]][b])
    return states


def _walk_verdict(dfa: DFA, states: list[int]) -> str:
    if states[-1] == DEAD:
        return f"forbidden: falls off at byte {states.index(DEAD)}"
    crossed = len(states) - 1
    end = states[-1]
    note = ", accepting" if dfa.accepting[end] else ""
    return f"allowed: {crossed} byte{'s' if crossed != 1 else ''}, lands in {end}{note}"


def _draw_walk(ax, dfa: DFA, row: int, states: list[int], piece: bytes, label: str) -> None:
    """One token's row: its label, the cell it starts in, one cell per byte, the verdict."""
    y = -row * (WALK_CELL_H + 0.25)
    for j, s in enumerate(states[: MAX_WALK_BYTES + 1]):
        color = DEAD_COLOR if s == DEAD else ACCEPT_COLOR if dfa.accepting[s] else STATE_COLOR
        ax.add_patch(Rectangle((j * WALK_CELL_W, y), WALK_CELL_W * 0.94, WALK_CELL_H,
                               facecolor=color, edgecolor="0.4", gid=f"walk:{row}:{j}"))
        top = "from" if j == 0 else _show_byte(piece[j - 1])
        ax.text((j + 0.47) * WALK_CELL_W, y + WALK_CELL_H * 0.7, top, ha="center", va="center",
                fontsize=8, family="monospace")
        ax.text((j + 0.47) * WALK_CELL_W, y + WALK_CELL_H * 0.28, "DEAD" if s == DEAD else str(s),
                ha="center", va="center", fontsize=8, weight="bold")
    cut = " (cut)" if len(piece) > MAX_WALK_BYTES else ""
    ax.text(-0.15, y + WALK_CELL_H / 2, repr(label)[1:-1], ha="right", va="center", fontsize=9,
            family="monospace")
    ax.text((min(len(piece), MAX_WALK_BYTES) + 1) * WALK_CELL_W + 0.15, y + WALK_CELL_H / 2,
            _walk_verdict(dfa, states) + cut, ha="left", va="center", fontsize=8)


def render_token_walks(dfa: DFA, pieces: Sequence[bytes], state: int | None = None,
                       labels: Sequence[str] | None = None, title: str | None = None,
                       chain: bool = False) -> Figure:
    """Each token of `pieces` (its bytes) read from `state` (default: the start), one row each:
    the first cell is the state we start in, then one cell per byte with the byte on top and the
    state after it below (green where that state accepts, red once the walk is DEAD). A token is
    allowed when its walk never falls off: the mask asks exactly that of every token.

    chain: read each token from where the one before it landed instead (the tokens of one output,
    step by step); only the last may fall off, since nothing can be read on from DEAD."""
    state = dfa.start if state is None else state
    if not 0 <= state < dfa.num_states:
        _fail("render_token_walks", "state", f"{state} is outside 0..{dfa.num_states - 1}")
    if not pieces or any(not isinstance(p, bytes) or not p for p in pieces):
        _fail("render_token_walks", "pieces", "must be non-empty bytes, one per token "
              "(vocab_bytes(tokenizer)[id]; a special token has none)")
    labels = list(labels) if labels is not None else [token_label(p) for p in pieces]
    widest = min(MAX_WALK_BYTES, max(len(p) for p in pieces))
    fig, axes = _new_figure((min(16.0, max(7.5, 4.5 + 0.62 * widest)), 0.9 + 0.55 * len(pieces)))
    ax, here = axes[0][0], state
    for row, piece in enumerate(pieces):
        states = walk_states(dfa, here, piece)
        if chain and states[-1] == DEAD and row < len(pieces) - 1:
            _fail("render_token_walks", "pieces", f"[{row}] falls off the DFA, so the chain "
                  "cannot go on; end pieces there or use chain=False")
        here = states[-1] if chain else here
        _draw_walk(ax, dfa, row, states, piece, labels[row])
    ax.set_xlim(-2.6, (widest + 1) * WALK_CELL_W + 4.2)
    ax.set_ylim(-(len(pieces) - 1) * (WALK_CELL_H + 0.25) - 0.2, WALK_CELL_H + 0.2)
    ax.axis("off")
    start = "one after the other, from" if chain else "each from"
    ax.set_title(title if title is not None else f"tokens read byte by byte, {start} state "
                 f"{state}\nof the DFA of  {dfa.pattern}", fontsize=10)
    ax.legend(handles=[Patch(facecolor=STATE_COLOR, edgecolor="0.4", label="a state on the way"),
                       Patch(facecolor=ACCEPT_COLOR, edgecolor="0.4", label="accepting"),
                       Patch(facecolor=DEAD_COLOR, edgecolor="0.4", label="DEAD: no way on")],
              loc="upper left", bbox_to_anchor=(0.0, 0.0), ncol=3, fontsize=8, frameon=False)
    return fig


# ---- one state's mask over the vocabulary --------------------------------------------------------


def _vocab_grid(ax, allowed: Tensor, row: int) -> None:
    """The V ids as a grid of `row` columns, allowed cells lit (ids past V stay blank)."""
    V = allowed.numel()
    rows = math.ceil(V / row)
    grid = np.full(rows * row, np.nan)
    grid[:V] = allowed.numpy().astype(float)
    ax.imshow(grid.reshape(rows, row), cmap=ListedColormap(["0.92", ALLOWED_COLOR]),
              vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    ids = allowed.nonzero().flatten()
    if 0 < ids.numel() <= MARKED_ALLOWED:  # a few lit cells vanish in 49k: ring them too
        ax.scatter((ids % row).numpy(), (ids // row).numpy(), s=40, facecolors="none",
                   edgecolors=ALLOWED_COLOR, linewidths=1.2, gid="marked")
    ax.set(xlabel=f"token id mod {row}", ylabel=f"token id // {row}")


def render_token_mask(table: TokenTable, state: int, vocab: Sequence[bytes | None] | None = None,
                      title: str | None = None) -> Figure:
    """Left: `table.mask(state)` over the whole vocabulary, one cell per token id, the allowed ones
    lit (and ringed when they are few), with some allowed tokens listed by text. Right: how many
    tokens each state of the DFA allows (this one highlighted): a few where the grammar forces a
    literal, thousands where it leaves a choice open.

    vocab: each id's bytes (`vocab_bytes(tokenizer)`), for the listed tokens' text."""
    if not 0 <= state < table.dfa.num_states:
        _fail("render_token_mask", "state", f"{state} is outside 0..{table.dfa.num_states - 1}")
    allowed = table.mask(state)  # [V]
    counts = [int(table.mask(s).sum()) for s in range(table.dfa.num_states)]  # [S]
    fig, axes = _new_figure((12.5, 4.8), 1, 2, gridspec_kw={"width_ratios": [1.5, 1]})
    _vocab_grid(axes[0][0], allowed, MASK_ROW)
    ids = allowed.nonzero().flatten().tolist()
    listed = ids[::max(1, len(ids) // LISTED_TOKENS)][:LISTED_TOKENS]  # spread over the ids
    shown = [token_label(vocab[i], i) if vocab is not None else str(i) for i in listed]
    more = f"  … ({len(ids) - len(listed):,} more)" if len(ids) > len(listed) else ""
    axes[0][0].set_title(title if title is not None else
                         f"state {state}: {len(ids):,} of {allowed.numel():,} tokens allowed",
                         fontsize=10)
    axes[0][0].text(0, -0.13, "allowed: " + "  ".join(shown) + more, transform=axes[0][0].transAxes,
                    fontsize=8, family="monospace", va="top", gid="listed")
    ax = axes[0][1]
    for s, n in enumerate(counts):
        ax.bar(s, max(n, 0.8), color=ALLOWED_COLOR if s == state else "0.7",
               edgecolor="0.3" if table.dfa.accepting[s] else "none", gid=f"count:{s}")
    ax.set_yscale("log")
    ax.set(xlabel="DFA state (outlined: accepting, EOS counted)", ylabel="tokens allowed",
           title=f"allowed tokens in each of the {len(counts)} states")
    ax.set_xticks(range(0, len(counts), max(1, math.ceil(len(counts) / MAX_STATE_TICKS))))
    ax.tick_params(axis="x", labelsize=8)
    return fig


# ---- what the mask does to the model's choice ----------------------------------------------------


def render_masked_top_tokens(logits: Tensor, allowed: Tensor,
                             vocab: Sequence[bytes | None] | None = None, top: int = TOP_SHOWN,
                             title: str = "") -> Figure:
    """Left: the model's `top` most likely next tokens, green where the mask allows them, red where
    it forbids them. Right: the distribution after the mask (-inf on the forbidden logits, then
    softmax): the allowed tokens keep their ratios, renormalized by the mass they held together.

    logits [V], allowed BoolTensor [V]; vocab: each id's bytes, for the tick labels."""
    logits, allowed = logits.detach().float().cpu().reshape(-1), allowed.cpu().reshape(-1)
    if allowed.shape != logits.shape or allowed.dtype != torch.bool:
        _fail("render_masked_top_tokens", "allowed", f"must be a bool tensor of the logits' "
              f"shape {tuple(logits.shape)}, got {allowed.dtype} {tuple(allowed.shape)}")
    if not allowed.any():
        _fail("render_masked_top_tokens", "allowed", "allows no token: nothing could be sampled")
    p = torch.softmax(logits, dim=-1)  # [V]
    after = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)  # [V]
    kept = float(p[allowed].sum())
    fig, axes = _new_figure((12.0, 4.2), 1, 2)
    n = int(allowed.sum())
    panels = ((axes[0][0], p, "before the mask: the model's top tokens"),
              (axes[0][1], after, f"after the mask: renormalized over {n:,} allowed "
                                  f"token{'s' if n != 1 else ''}"))
    for ax, probs, name in panels:
        ids = torch.topk(probs, min(top, int((probs > 0).sum()))).indices.tolist()
        for x, i in enumerate(ids):
            ok = bool(allowed[i])
            gid = ("after" if probs is after else "allowed" if ok else "forbidden") + f":{i}"
            ax.bar(x, float(probs[i]), color=ALLOWED_COLOR if ok else FORBIDDEN_COLOR, gid=gid)
        ax.set_xticks(range(len(ids)),
                      [token_label(vocab[i], i) if vocab is not None else str(i) for i in ids],
                      rotation=45, ha="right", family="monospace", fontsize=8)
        for tick, i in zip(ax.get_xticklabels(), ids, strict=True):  # a bar too thin to see
            tick.set_color(ALLOWED_COLOR if allowed[i] else FORBIDDEN_COLOR)  # keeps its colour
        ax.set(ylabel="probability", ylim=(0, 1.05), title=name)
    axes[0][0].legend(handles=[Patch(color=ALLOWED_COLOR, label="allowed"),
                               Patch(color=FORBIDDEN_COLOR, label="forbidden (-inf)")],
                      fontsize=8, loc="upper right")
    fig.suptitle((title + "\n" if title else "")
                 + f"the allowed tokens held {_percent(kept)} of the model's probability",
                 fontsize=10)
    return fig


def _percent(share: float) -> str:
    """12.3%, or two significant digits for a sliver (0.0042%) that .1% would show as 0.0%."""
    return f"{share:.1%}" if share >= 1e-3 else f"{share * 100:.2g}%"


def _short(value: float) -> str:
    """1,382 or 1.63: whole numbers from 100 on, three significant digits below."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


# ---- what it costs -------------------------------------------------------------------------------


def render_mask_cost(rows: Sequence[Mapping], decode_step_s: float | None = None,
                     threads: int | None = None) -> Figure:
    """Left: compiling the constraint once (ms). Right: one step's logits-processor call (µs:
    catch up with the new token, compute the mask, -inf on the logits), beside one decode step of
    the model (the line): what the mask adds to every token. Log scales, so that a microsecond and
    a second both show.

    rows: {"masker": name, "compile_s": seconds, "mask_s": seconds per step} each; a masker whose
    name starts with "reference" is drawn in the reference's colour."""
    _need("render_mask_cost", rows, ("masker", "compile_s", "mask_s"))
    fig, axes = _new_figure((11.0, 4.0), 1, 2)
    names = [r["masker"] for r in rows]
    colors = [REFERENCE_COLOR if n.startswith("reference") else LIBRARY_COLOR for n in names]
    panels = ((axes[0][0], "compile_s", "ms", MS), (axes[0][1], "mask_s", "µs", US))
    for ax, key, unit, scale in panels:
        for x, (r, color) in enumerate(zip(rows, colors, strict=True)):
            value = r[key] * scale
            ax.bar(x, value, color=color, gid=f"{key.split('_')[0]}:{r['masker']}")
            ax.text(x, value, f"{_short(value)} {unit}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), names, rotation=15, ha="right", fontsize=8)
        ax.set_yscale("log")
    axes[0][0].set(ylabel="ms", title="compile once per constraint")
    axes[0][1].set(ylabel="µs", title="the logits processor, every step (mask, then -inf)")
    if decode_step_s is not None:
        axes[0][1].axhline(decode_step_s * US, color=DECODE_COLOR, linestyle="--",
                           gid="decode_step", label=f"one decode step: {decode_step_s * MS:.1f} ms")
        axes[0][1].legend(fontsize=8, loc="center right")
    note = f" ({threads} torch thread{'s' if threads != 1 else ''})" if threads else ""
    fig.suptitle("What a constraint costs" + note, fontsize=11)
    return fig


# ---- what it does to quality ---------------------------------------------------------------------


QUALITY_METRICS = (("parse_rate", "parse", "parses (json.loads of the whole reply)"),
                   ("schema_valid_rate", "valid", "fits the schema (jsonschema)"),
                   ("field_accuracy", "fields", "fields right"))


def render_quality(rows: Sequence[Mapping]) -> Figure:
    """Three panels, parse rate, schema-valid rate and field accuracy: one group of bars per
    (task, precision), a grey bar without the constraint and a green one with it, each labelled
    with its value.

    rows: `engine.lab.structured.quality_rows` rows ("task", "constrained", "parse_rate",
    "schema_valid_rate", "field_accuracy", "n"), each with a "precision" added ("fp32", "int4")
    and, if you like, a "model" for the labels."""
    _need("render_quality", rows, ("task", "precision", "constrained", "parse_rate",
                                   "schema_valid_rate", "field_accuracy"))
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    present = {(r["task"], r["precision"]) for r in rows}
    groups = [(t, p) for t in tasks for p in precisions if (t, p) in present]  # task, precision
    label = {(r["task"], r["precision"]): (f"{r['model']}\n" if "model" in r else "")
             + f"{r['task']} · {r['precision']}" + (f"\nn = {r['n']}" if "n" in r else "")
             for r in rows}
    width = 0.38
    fig, axes = _new_figure((min(14.0, 3.0 + 2.4 * len(groups)), 4.2), 1, len(QUALITY_METRICS),
                            sharey=True)
    for ax, (key, gid, name) in zip(axes[0], QUALITY_METRICS, strict=True):
        for r in rows:
            g = groups.index((r["task"], r["precision"]))
            x = g + (width / 2 if r["constrained"] else -width / 2)
            ax.bar(x, r[key], width * 0.95, color=CONSTRAINED_COLOR if r["constrained"]
                   else FREE_COLOR, gid=f"{gid}:{r['task']}:{r['precision']}:"
                   f"{'constrained' if r['constrained'] else 'free'}")
            ax.text(x, r[key] + 0.01, f"{r[key]:.0%}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(groups)), [label[g] for g in groups], fontsize=8)
        ax.set(ylim=(0, 1.15), title=name)
    axes[0][0].set_ylabel("share of replies (fields, for the last panel)")
    fig.legend(handles=[Patch(color=FREE_COLOR, label="without the constraint"),
                        Patch(color=CONSTRAINED_COLOR, label="with the JSON schema")],
               fontsize=8, loc="outside lower center", ncol=2)
    fig.suptitle("Greedy replies, graded (n: prompts per bar)", fontsize=10)
    return fig
