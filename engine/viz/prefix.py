"""Figures for chapter 06: the prefix cache, its hash chain, what it saves, and what a hit tells.

    hash_chain_rows        the arithmetic behind the chain picture: each request's blocks, their
                           chained hashes (engine/kv/prefix_cache.py's own), and which blocks an
                           earlier request computed
    render_hash_chain      one row per request, one cell per block: the same colour is the same
                           hash, i.e. one physical block that every request with that colour shares
    render_prefix_sweep    hit rate and median TTFT against the shared fraction of the prompt,
                           cache off vs on
    render_eviction_sweep  hit rate against the KV pool's size, one line per traffic pattern
                           (LRU eviction), and each pattern's best possible hit rate
    render_side_channel    the TTFT of a guessed prefix, with and without another tenant having sent
                           it, under a public scope and a private (per-tenant) scope

How to read the hash chain (BS = 4; the same tokens in blocks 0 and 1 of a and b)::

    a  [ 7 3 9 1 | #5e1c ] -> [ 4 4 8 2 | #a03f ] -> [ 6 6 | partial, no hash ]
    b  [ 7 3 9 1 | #5e1c ] -> [ 4 4 8 2 | #a03f ] -> [ 5 0 1 3 | #c71b ] -> [ 2 | partial ]
          hit (a computed it)     hit
    c  [ 0 0 0 0 | #19d0 ] -> [ 4 4 8 2 | #7b22 ]   same tokens as a's block 1, another parent:
                                                    another hash, no hit

A cell's colour follows its hash: the cells of a and b in blocks 0 and 1 share a colour because they
are one block in the pool. A thick black frame marks a hit, a block some earlier row computed; like
the engine, we never count the block that holds a prompt's last token as a hit (its logits are
needed, so it is fed again).

Artists carry a `gid`: the cell of request r's block j is "chain:r:j".
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from engine.kv.prefix_cache import block_hashes
from engine.viz._figure import fail as _fail
from engine.viz._figure import need_rows as _need
from engine.viz._figure import new_figure as _new_figure

HASH_DIGITS = 6  # hex digits of a hash printed in a cell: enough to tell a handful of blocks apart
CELL_WIDTH, CELL_GAP = 1.0, 0.35  # a cell and the arrow gap to the next one, in axis units
ROW_INCHES = 0.78  # height per request row: two lines of text in a cell
CELL_INCHES = 1.35  # width per block: room for four short tokens
NAME_INCHES = 1.6  # the left margin holding the request names
# tokens printed per cell (what fits its width); a bigger block shows its first ones and "…"
TOKENS_SHOWN = 4
MIN_FIGURE_INCHES = 8.5  # wide enough for the title and long request names
PARTIAL_COLOR, PARTIAL_HATCH = "white", "..."
HIT_EDGE, HIT_WIDTH = "black", 2.6
# Hash colours: tab20's strong shades, then its light ones, without its greys
# (grey reads as "nobody's").
PALETTE = [plt.get_cmap("tab20")(i) for i in (*range(0, 20, 2), *range(1, 20, 2))
           if i not in (14, 15)]
OFF_COLOR, ON_COLOR = "tab:gray", "tab:green"
SCOPE_COLORS = {True: "tab:red", False: "tab:blue"}  # the victim sent the prefix / did not
MS = 1e3  # seconds -> milliseconds
LEGEND_HEADROOM = 1.25  # the y range above the highest dot: room for the legend, clear of the data


@dataclass(frozen=True)
class ChainBlock:
    """One block of one request in the hash-chain picture."""

    index: int  # the logical block: tokens [index * BS, (index + 1) * BS)
    tokens: tuple
    hash: str | None  # None: the partial last block, which is never hashed or shared
    # an earlier request computed this block, and it is not the block of the prompt's last token
    hit: bool




def _keys_of(requests: Mapping, extra_keys) -> dict:
    """Each request's extra keys: one tuple for all, or a mapping name -> tuple."""
    if isinstance(extra_keys, Mapping):
        missing = [name for name in requests if name not in extra_keys]
        if missing:
            _fail("hash_chain_rows", "extra_keys",
                  f"has no key for request(s) {missing}: give one per request")
        return {name: tuple(extra_keys[name]) for name in requests}
    return {name: tuple(extra_keys) for name in requests}


def hash_chain_rows(requests: Mapping[str, Sequence[int]], block_size: int,
                    extra_keys: Sequence | Mapping[str, Sequence] = ()
                    ) -> dict[str, list[ChainBlock]]:
    """Every request's blocks, in the order given: tokens, chained hash
    (engine.kv.prefix_cache.block_hashes, so exactly the engine's), and whether an earlier request
    had computed the block (a hit).

    extra_keys: one tuple for all requests, or {name: tuple} (e.g.
    `engine.kv.prefix_cache.cache_key(...)`).
    """
    if block_size < 1:
        _fail("hash_chain_rows", "block_size", f"must be >= 1 token, got {block_size}")
    if not requests:
        _fail("hash_chain_rows", "requests", "is empty: give at least one request's token ids")
    keys, seen, out = _keys_of(requests, extra_keys), set(), {}
    for name, ids in requests.items():
        ids = [int(t) for t in ids]
        if not ids:
            _fail("hash_chain_rows", "requests",
                  f"[{name!r}] is empty: a prompt has at least one token")
        hashes = block_hashes(ids, block_size, keys[name])
        # blocks before the one holding the last token's K/V
        last_hittable = (len(ids) - 1) // block_size
        row = []
        for j in range(-(-len(ids) // block_size)):
            h = hashes[j] if j < len(hashes) else None
            row.append(ChainBlock(j, tuple(ids[j * block_size:(j + 1) * block_size]), h,
                                  h is not None and h in seen and j < last_hittable))
        seen.update(hashes)
        out[name] = row
    return out


def _cell_label(block: ChainBlock, labels: Sequence[str] | None, block_size: int) -> str:
    start = block.index * block_size
    words = ([labels[start + k] for k in range(len(block.tokens))] if labels
             else [str(t) for t in block.tokens])
    shown = " ".join(words[:TOKENS_SHOWN]) + (" …" if len(words) > TOKENS_SHOWN else "")
    tag = f"#{block.hash[:HASH_DIGITS]}" if block.hash else "partial: no hash"
    return f"{shown}\n{tag}"


def _draw_chain_row(ax, y: float, name: str, row: list[ChainBlock], colors: dict, labels,
                    block_size: int) -> None:
    for block in row:
        x = block.index * (CELL_WIDTH + CELL_GAP)
        face = colors[block.hash] if block.hash else PARTIAL_COLOR
        ax.add_patch(Rectangle((x, y), CELL_WIDTH, 0.8, facecolor=face, alpha=1.0,
                               edgecolor=HIT_EDGE if block.hit else "0.45",
                               linewidth=HIT_WIDTH if block.hit else 1,
                               hatch=None if block.hash else PARTIAL_HATCH,
                               gid=f"chain:{name}:{block.index}"))
        ax.text(x + CELL_WIDTH / 2, y + 0.4, _cell_label(block, labels, block_size), ha="center",
                va="center", fontsize=7,
                bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 0.8})
        if block.index:  # the arrow from the parent: this block's hash includes the parent's
            ax.annotate("", xy=(x, y + 0.4), xytext=(x - CELL_GAP, y + 0.4),
                        arrowprops={"arrowstyle": "->", "color": "0.3", "lw": 1})


def render_hash_chain(requests: Mapping[str, Sequence[int]], block_size: int,
                      extra_keys: Sequence | Mapping[str, Sequence] = (),
                      labels: Mapping[str, Sequence[str]] | None = None, title: str = "") -> Figure:
    """One row per request (top to bottom, in order), one cell per block: its tokens and its hash.

    The same hash gets the same colour wherever it appears, so shared blocks line up in colour; a
    thick frame marks a hit. labels: {name: one string per token} to print words instead of token
    ids.
    """
    rows = hash_chain_rows(requests, block_size, extra_keys)
    for name, words in (labels or {}).items():
        if name in requests and len(words) != len(requests[name]):
            _fail("render_hash_chain", "labels", f"[{name!r}] has {len(words)} strings for "
                  f"{len(requests[name])} tokens: give one per token")
    colors: dict[str, tuple] = {}
    for row in rows.values():
        for block in row:
            if block.hash and block.hash not in colors:
                colors[block.hash] = PALETTE[len(colors) % len(PALETTE)]
    width = max(len(r) for r in rows.values())
    fig, axes = _new_figure((max(MIN_FIGURE_INCHES, NAME_INCHES + CELL_INCHES * width),
                             1.2 + ROW_INCHES * len(rows)))
    ax = axes[0][0]
    for i, (name, row) in enumerate(rows.items()):
        _draw_chain_row(ax, -i, name, row, colors, (labels or {}).get(name), block_size)
    ax.set_yticks([-i + 0.4 for i in range(len(rows))], list(rows))
    ax.set_xticks([])
    ax.set_xlim(-0.1, width * (CELL_WIDTH + CELL_GAP))
    ax.set_ylim(-len(rows) + 0.9, 0.9)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.legend(handles=[Patch(facecolor="white", edgecolor=HIT_EDGE, linewidth=HIT_WIDTH,
                             label="hit: an earlier row computed this block"),
                       Patch(facecolor=PARTIAL_COLOR, edgecolor="0.45", hatch=PARTIAL_HATCH,
                             label="partial last block: never hashed")],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=8, frameon=False)
    ax.set_title(title or f"Chained block hashes (BS = {block_size}): same colour = same hash = "
                          "one shared block",
                 fontsize=10)
    return fig


# ---- measurements --------------------------------------------------------------------------------


def render_prefix_sweep(rows: Sequence[Mapping], threads: int | None = None) -> Figure:
    """Left: the measured hit rate (cached prompt tokens / prompt tokens) against the shared
    fraction of each prompt. Right: the median TTFT with the cache off and on, and the change the
    cache made under each fraction's tick (-68%: faster); a dashed line at TTFT off x (1 - hit
    rate), what TTFT would be if it were all prefill of the tokens the cache missed (TTFT off is
    the median over every fraction: without a cache it does not depend on what is shared). The
    gap between that line and "cache on" is the cost a hit does not remove (the step's fixed
    work, the last token, sampling).

    rows: {"shared_fraction", "hit_rate", "ttft_p50_off_s", "ttft_p50_on_s"} per fraction.
    """
    _need("render_prefix_sweep", rows,
          ("shared_fraction", "hit_rate", "ttft_p50_off_s", "ttft_p50_on_s"))
    x = [r["shared_fraction"] for r in rows]
    fig, axes = _new_figure((11.0, 4.2), 1, 2)
    ax = axes[0][0]
    ax.plot([0, 1], [0, 1], ":", color="0.5", label="every shared token a hit")
    ax.plot(x, [r["hit_rate"] for r in rows], "o-", color=ON_COLOR, label="measured hit rate",
            gid="hit_rate")
    ax.set(xlabel="shared fraction of each prompt", ylabel="prompt tokens found in the cache",
           xlim=(-0.03, 1.03), ylim=(-0.03, 1.03), title="Hit rate")
    ax.legend(loc="upper left", fontsize=8)
    ax = axes[0][1]
    off = [r["ttft_p50_off_s"] * MS for r in rows]
    on = [r["ttft_p50_on_s"] * MS for r in rows]
    ax.plot(x, off, "s-", color=OFF_COLOR, label="cache off", gid="ttft_off")
    ax.plot(x, on, "o-", color=ON_COLOR, label="cache on", gid="ttft_on")
    full_prefill = statistics.median(off)
    ax.plot(x, [full_prefill * (1 - r["hit_rate"]) for r in rows], "--", color=ON_COLOR,
            alpha=0.55, label="off x (1 - hit rate): if only the misses cost",
            gid="ttft_proportional")
    # the change under each tick, where no line can cross it
    ax.set_xticks(x, [f"{xi:.0%}\n{100 * (b / a - 1):+.0f}%"
                      for xi, a, b in zip(x, off, on, strict=True)], fontsize=8)
    ax.set(xlabel="shared fraction of each prompt, and the TTFT change the cache made",
           ylabel="median TTFT (ms)",
           ylim=(0, max(off + on) * 1.12),
           title="Time to first token" + (f" ({threads} torch thread{'s' if threads != 1 else ''})"
                                          if threads else ""))
    # lower left stays empty: every line starts at the full TTFT when nothing is shared
    ax.legend(loc="lower left", fontsize=8)
    return fig


def render_eviction_sweep(rows: Sequence[Mapping], working_set_blocks: int | None = None,
                          best_hit_rates: Mapping[str, float] | None = None) -> Figure:
    """Hit rate against the KV pool's size (blocks), one line per traffic pattern.

    rows: {"pattern", "num_blocks", "hit_rate"}; working_set_blocks: where a dotted line marks the
    blocks that every distinct prefix together needs (below it, LRU must evict something that comes
    back); best_hit_rates: {pattern: the best hit rate its workload allows}, drawn as a dashed line
    in the pattern's colour (patterns differ: the more requests per document, the higher it is).
    """
    _need("render_eviction_sweep", rows, ("pattern", "num_blocks", "hit_rate"))
    patterns = list(dict.fromkeys(r["pattern"] for r in rows))
    unknown = sorted(set(best_hit_rates or {}) - set(patterns))
    if unknown:
        _fail("render_eviction_sweep", "best_hit_rates",
              f"names pattern(s) {unknown} that no row has: use the rows' pattern names")
    fig, axes = _new_figure((7.5, 4.2))
    ax = axes[0][0]
    for k, pattern in enumerate(patterns):
        mine = sorted((r for r in rows if r["pattern"] == pattern), key=lambda r: r["num_blocks"])
        ax.plot([r["num_blocks"] for r in mine], [r["hit_rate"] for r in mine], "o-",
                color=PALETTE[k], label=pattern, gid=f"pattern:{pattern}")
        if best_hit_rates and pattern in best_hit_rates:
            ax.axhline(best_hit_rates[pattern], color=PALETTE[k], linestyle="--", linewidth=1,
                       alpha=0.7, gid=f"best:{pattern}",
                       label=f"best possible: {best_hit_rates[pattern]:.0%}")
    if working_set_blocks is not None:
        ax.axvline(working_set_blocks, color="0.4", linestyle=":", label="every prefix fits")
    ax.set(xlabel="KV pool size (blocks)", ylabel="prompt tokens found in the cache",
           ylim=(-0.03, 1.03), title="Hit rate under memory pressure (LRU eviction)")
    ax.legend(loc="upper left", fontsize=8)  # the top left stays empty: small pools hit little
    return fig


def render_side_channel(rows: Sequence[Mapping], threads: int | None = None) -> Figure:
    """The attacker's view: TTFT of its request starting with a guessed prefix, one dot per repeat
    and a bar at the median, when the victim sent that prefix just before (red) or not (blue), per
    cache scope.

    rows: {"scope": a label, "victim_sent": bool, "ttft_s": [one TTFT per repeat]}.
    """
    _need("render_side_channel", rows, ("scope", "victim_sent", "ttft_s"))
    scopes = list(dict.fromkeys(r["scope"] for r in rows))
    fig, axes = _new_figure((8.0, 4.4))
    ax = axes[0][0]
    for r in rows:
        x = scopes.index(r["scope"]) * 3 + (0 if r["victim_sent"] else 1)
        ms = sorted(t * MS for t in r["ttft_s"])
        if not ms:
            _fail("render_side_channel", "rows", f"scope {r['scope']!r}: ttft_s is empty")
        spread = [x + 0.25 * (k / max(1, len(ms) - 1) - 0.5) for k in range(len(ms))]
        color = SCOPE_COLORS[bool(r["victim_sent"])]
        ax.plot(spread, ms, "o", color=color, alpha=0.6,
                gid=f"dots:{r['scope']}:{r['victim_sent']}")
        median = ms[(len(ms) - 1) // 2]
        ax.hlines(median, x - 0.3, x + 0.3, color=color, linewidth=3,
                  gid=f"median:{r['scope']}:{r['victim_sent']}")
        ax.annotate(f"{median:.0f} ms", (x + 0.32, median), va="center", fontsize=8)
    ax.set_xticks([3 * i + 0.5 for i in range(len(scopes))], scopes)
    ax.set_xlim(-0.7, 3 * len(scopes) - 1.0)
    highest = max(t for r in rows for t in r["ttft_s"]) * MS
    ax.set_ylim(0, highest * LEGEND_HEADROOM)
    ax.set_ylabel("attacker's TTFT (ms)")
    ax.legend(handles=[Patch(color=SCOPE_COLORS[True], label="victim sent the prefix before"),
                       Patch(color=SCOPE_COLORS[False], label="nobody sent it")],
              loc="upper center", ncol=2, fontsize=8)
    ax.set_title("What a hit tells: the TTFT of a guessed prefix"
                 + (f" ({threads} torch thread{'s' if threads != 1 else ''})" if threads else ""))
    return fig
