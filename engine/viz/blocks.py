"""Figures for chapter 04 (and the block grid of chapter 05): where the KV slots go, block by block.

    render_reservation        contiguous max-length reservation vs paging: reserved, used, wasted
    render_block_grid         the physical pool as a grid of cells,
                              coloured by the sequence that owns them
    render_block_grid_strip   a few snapshots of that grid, one under the other
                              (the player without widgets)
    block_grid_player         ipywidgets Play + slider over snapshots, redrawing render_block_grid
    render_block_size_sweep   the block size trade-off: waste, block table size, kernel work

Everything takes plain data (lists and dicts of ints), so a figure can be drawn from a live
`BlockManager` (`block_snapshot(bm)`), from a trace's per-step block tables (a dict with keys
`tables`, `num_tokens`, `total` or `num_blocks`, `block_size`, or an object with those attributes),
or from numbers typed by hand. The arithmetic behind the pictures (`reservation_summary`,
`grid_cells`, `block_size_sweep`) is public, so a test or a reader can check it without a figure.

How to read the block grid (BS = 4, pool of 8 blocks, two sequences)::

    +--------+--------+--------+--------+
    | 0 a[0] | 1 b[0] | 2 a[1] | 3 b[1] |     a: 6 tokens, table [0, 2]  -> block 2 is half full
    | ██████ | ▒▒▒▒▒▒ | ██░░░░ | ▒▒▒░░░ |     b: 7 tokens, table [1, 3]  -> block 3 is 3/4 full
    +--------+--------+--------+--------+
    | 4      | 5      | 6      | 7      |     free blocks are white
    +--------+--------+--------+--------+

Each cell says its physical id and `owner[logical index]`; the coloured part of a cell is the
fraction of its BS slots that hold tokens (the empty rest is the waste paging leaves). A block
that several sequences share (after `fork`) is hatched and says how many hold it ("x3 [0]").
With prefix caching (chapter 06), a block nobody holds whose K/V is still cached (free but
cached: the next request with the same prefix reuses it, or the evictor reclaims it) is pale
green and says "cached". With a sliding window, a table entry of -1 (``NULL_BLOCK``) is a logical
block the window freed: it holds no physical block, so nothing is drawn for it.

Labels are sized to fit inside their cells, after the figure's layout is known (`_fit_labels`):
"batch-1[0]" on one line when the cell is wide enough, "batch-1" over "[0]" when it is not, and no
text at all when even that would be smaller than MIN_CELL_FONT_PT.

Artists carry a `gid`: the cell of block b is "block:b", its filled part "fill:b", its label
"label:b".
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from engine.kv.block_manager import BlockManager
from engine.viz.widgets import interactive_figure
from kernels.paged_attention.reference import NULL_BLOCK

# cells per row: a pool of 64 blocks is a 4 x 16 grid, still readable at notebook width
GRID_COLUMNS = 16
# for pools above 16 x 16 blocks (an engine's default pool): the grid stays short
WIDE_GRID_COLUMNS = 64
CELL_INCHES = 0.62  # one cell of a small grid: room for a two-line label
MAX_GRID_INCHES = 7.0  # the tallest one grid may get; its cells shrink beyond that
LEGEND_INCHES = 2.6  # room on the right for the owners' legend
CELL_TEXT_MAX_BLOCKS = 128  # above this many cells the labels would overlap: we draw colours only
CELL_FONT_PT = 6.5  # a cell label's size when its cell has room for it
# smaller is unreadable: such a grid shows colours only (the legend names the owners)
MIN_CELL_FONT_PT = 4.0
# A label must fit inside its cell, so labels never overprint each other. We size it from its
# longest line: a character of matplotlib's default font is at most about 0.62 of the font size
# wide, a line about 1.25 font sizes tall, and a label may fill 90% of its cell either way.
CHAR_EM, LINE_EM, CELL_TEXT_FILL = 0.62, 1.25, 0.9
LEGEND_MAX_OWNERS = 12  # a longer legend hides the grid; the cells still say their owner
LEGEND_ROW_INCHES = 0.17  # one legend entry at 7 pt with its spacing: a panel is at least this tall
TITLE_INCHES = 0.9  # a grid's two-line title
GRID_EDGE = 0.03  # a margin around the grid, in cells, so that the outer cells' frames are not cut
STRIP_DEFAULT_PANELS = 4  # snapshots in a static strip when the caller does not pick them
STRIP_SHRINK = 0.8  # a strip's grids are drawn a little smaller than a single grid
REQUESTS_DRAWN = 24  # rows in the per-request panel of render_reservation: enough to see the spread
EMPTY_ALPHA = 0.22  # the empty part of an owned cell: its owner's colour, faded
FREE_COLOR, EDGE_COLOR = "white", "0.55"
# free but cached (prefix cache): a pale green, unlike any owner's strong colour
CACHED_COLOR = "#c7e9c0"
USED_COLOR, WASTED_COLOR = "tab:blue", "tab:red"
SHARED_HATCH = "///"
# 18 distinct colours: tab20's strong shades first, then its light ones, so neighbours differ; its
# two greys (14, 15) are left out, because grey reads as "nobody's".
PALETTE = [plt.get_cmap("tab20")(i) for i in (*range(0, 20, 2), *range(1, 20, 2))
           if i not in (14, 15)]
# A half-transparent white box behind a shared cell's text, so it stays readable on the hatching.
LABEL_BOX = {"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 0.6}
SWEEP_KEYS = ("block_size", "waste_pct", "table_entries_per_seq", "block_loads", "slots_loaded",
              "useful_slots")


def _new_figure(nrows: int = 1, ncols: int = 1, figsize=(8.0, 4.5)):
    """A figure pyplot does not keep: we return it and the notebook displays it once."""
    fig, axes = plt.subplots(nrows, ncols, figsize=figsize, squeeze=False, layout="constrained")
    plt.close(fig)
    return fig, axes


def _fail(func: str, field: str, message: str):
    raise ValueError(f"{func}: {field} {message}")


# ---- contiguous reservation vs paging ------------------------------------------------------------


def reservation_summary(lengths: Sequence[int], max_len: int,
                        block_size: int) -> dict[str, dict[str, float]]:
    """Slots reserved, used and wasted by both schemes, for sequences of the given final lengths.

    contiguous: every sequence reserves ``max_len`` slots, so it wastes ``max_len - len``.
    paged:      a sequence holds ``ceil(len / BS)`` blocks, so it wastes
                ``ceil(len / BS) * BS - len`` (at most BS - 1; about (BS - 1) / 2 on average,
                ``predicted_wasted``).
    """
    if not lengths:
        _fail("reservation_summary", "lengths", "is empty: give at least one sequence length")
    if block_size < 1:
        _fail("reservation_summary", "block_size", f"must be >= 1, got {block_size}")
    bad = [n for n in lengths if not 1 <= n <= max_len]
    if bad:
        _fail("reservation_summary", "lengths",
              f"must each be in 1..max_len = {max_len}, got {bad[0]}")
    used = sum(lengths)
    paged_reserved = sum(math.ceil(n / block_size) * block_size for n in lengths)
    out = {}
    for scheme, reserved in (("contiguous", len(lengths) * max_len), ("paged", paged_reserved)):
        out[scheme] = {"reserved": reserved, "used": used, "wasted": reserved - used,
                       "waste_pct": 100 * (reserved - used) / reserved}
    out["paged"]["predicted_wasted"] = len(lengths) * (block_size - 1) / 2
    return out


def _draw_request_bars(ax, lengths: Sequence[int], max_len: int, block_size: int) -> None:
    """Two bars per request: contiguous (top) and paged (below), each used + wasted."""
    shown = list(lengths[:REQUESTS_DRAWN])
    for i, n in enumerate(shown):
        paged_end = math.ceil(n / block_size) * block_size
        for dy, end in ((-0.2, max_len), (0.2, paged_end)):
            ax.barh(i + dy, n, height=0.38, color=USED_COLOR)
            ax.barh(i + dy, end - n, left=n, height=0.38, color=WASTED_COLOR, alpha=0.55)
    ax.set_yticks(range(len(shown)), [f"req {i}: {n}" for i, n in enumerate(shown)], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(max_len, color="black", linewidth=1, linestyle=":")
    ax.set_xlabel("KV slots (tokens)")
    ax.set_title(f"Per request (first {len(shown)}): upper bar contiguous, lower bar paged "
                 f"(BS={block_size})")


def render_reservation(lengths: Sequence[int], max_len: int, block_size: int) -> Figure:
    """Contiguous max-length reservation vs paging, for sequences of the given final lengths.

    Left: one pair of bars per request (blue: slots holding tokens; red: reserved but empty).
    Right: the totals over all requests, with the waste as a percentage of what was reserved.
    """
    summary = reservation_summary(lengths, max_len, block_size)
    fig, axes = _new_figure(1, 2, figsize=(12.0, 5.0))
    _draw_request_bars(axes[0][0], lengths, max_len, block_size)
    ax = axes[0][1]
    names = ["contiguous\n(reserve max_len)", f"paged\n(BS = {block_size})"]
    for x, scheme in enumerate(("contiguous", "paged")):
        s = summary[scheme]
        ax.bar(x, s["used"], color=USED_COLOR, label="used" if x == 0 else None)
        ax.bar(x, s["wasted"], bottom=s["used"], color=WASTED_COLOR, alpha=0.55,
               label="reserved, empty" if x == 0 else None)
        ax.text(x, s["reserved"], f"{s['waste_pct']:.1f}% wasted", ha="center", va="bottom")
    ax.set_xticks([0, 1], names)
    ax.set_ylabel(f"KV slots, all {len(lengths)} requests")
    ax.set_title("Totals")
    ax.legend(loc="upper right")
    fig.suptitle(f"{len(lengths)} requests, max_len = {max_len}: what a contiguous cache reserves "
                 "vs what paging reserves")
    return fig


# ---- the block grid ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockGridSnapshot:
    """The pool at one moment: who holds which physical blocks, and how many tokens each holds."""

    tables: dict  # seq id -> physical block ids, in logical order
    num_blocks: int
    block_size: int
    num_tokens: dict | None = None  # seq id -> tokens; None: every block counts as full
    label: str = ""
    cached_block_ids: tuple = ()  # free-but-cached blocks (prefix caching): held by no table


def block_snapshot(manager: BlockManager, label: str = "") -> BlockGridSnapshot:
    """A copy of a live BlockManager's tables and token counts, for drawing now or later."""
    ids = manager.seq_ids()
    return BlockGridSnapshot(tables={s: manager.block_table(s) for s in ids},
                             num_blocks=manager.allocator.num_blocks, block_size=manager.block_size,
                             num_tokens={s: manager.num_tokens(s) for s in ids}, label=label,
                             cached_block_ids=tuple(manager.cached_block_ids()))


def as_snapshot(data) -> BlockGridSnapshot:
    """A BlockGridSnapshot from a snapshot, a dict, or an object (e.g. a trace's BlockSnapshot) with
    `tables`, `block_size`, `num_blocks` (or `total`), and optionally `num_tokens`, `label` and
    `cached_block_ids`."""
    if isinstance(data, BlockGridSnapshot):
        return data
    get = (data.get if isinstance(data, Mapping)
           else lambda key, default=None: getattr(data, key, default))
    num_blocks = get("num_blocks", None)
    num_blocks = get("total", None) if num_blocks is None else num_blocks
    if get("tables", None) is None or num_blocks is None or get("block_size", None) is None:
        raise ValueError("as_snapshot: data needs `tables`, `block_size` and `num_blocks` "
                         f"(or `total`), got {type(data).__name__}")
    return BlockGridSnapshot(tables=dict(get("tables")), num_blocks=int(num_blocks),
                             block_size=int(get("block_size")),
                             num_tokens=get("num_tokens", None) or None,
                             label=str(get("label", "") or ""),
                             cached_block_ids=tuple(get("cached_block_ids", None) or ()))


@dataclass(frozen=True)
class Cell:
    """What one physical block holds: its owners (in table order), logical index,
    and tokens in it."""

    owners: tuple
    logical: int
    tokens: int


def _check_tables(tables: Mapping, num_blocks: int, num_tokens: Mapping | None,
                  block_size: int) -> None:
    func = "render_block_grid"
    if num_blocks < 1:
        _fail(func, "num_blocks", f"must be >= 1, got {num_blocks}")
    if block_size < 1:
        _fail(func, "block_size", f"must be >= 1, got {block_size}")
    for seq, table in tables.items():
        table = [b for b in table if b != NULL_BLOCK]  # freed by a sliding window
        for b in table:
            if not 0 <= b < num_blocks:
                _fail(func, "block_tables",
                      f"of sequence {seq!r} holds block {b}, outside 0..{num_blocks - 1}")
        if len(set(table)) != len(table):
            _fail(func, "block_tables", f"of sequence {seq!r} lists a block twice: {list(table)}")
        n = None if num_tokens is None else num_tokens.get(seq)
        logical = len(tables[seq])
        if n is not None and not 0 <= n <= logical * block_size:
            _fail(func, "num_tokens", f"[{seq!r}] = {n} is outside 0..{logical * block_size} "
                                      f"({logical} blocks x BS {block_size})")


def grid_cells(block_tables: Mapping, num_blocks: int, num_tokens: Mapping | None = None,
               block_size: int = 16) -> dict[int, Cell]:
    """{physical block: Cell} for every held block; free blocks are absent.

    Tokens in logical block i of a sequence of n tokens: min(BS, n - i * BS). A shared block holds
    the most any of its owners put there (its owners agree on the shared part).
    """
    _check_tables(block_tables, num_blocks, num_tokens, block_size)
    cells: dict[int, Cell] = {}
    for seq, table in block_tables.items():
        n = (len(table) * block_size if num_tokens is None or seq not in num_tokens
             else num_tokens[seq])
        for i, b in enumerate(table):
            if b == NULL_BLOCK:
                continue  # freed by the sliding window
            tokens = max(0, min(block_size, n - i * block_size))
            old = cells.get(b)
            owners = (seq,) if old is None else (*old.owners, seq)
            cells[b] = Cell(owners, i if old is None else old.logical,
                            max(tokens, old.tokens if old else 0))
    return cells


def owner_color(seq_id, colors: Mapping | None = None):
    """A sequence's colour: the same id gets the same colour in every figure (ints cycle the
    palette, other ids are hashed with crc32, which, unlike hash(), does not change between
    runs)."""
    if colors is not None and seq_id in colors:
        return colors[seq_id]
    return PALETTE[_palette_index(seq_id)]


def _palette_index(seq_id) -> int:
    index = seq_id if isinstance(seq_id, int) else zlib.crc32(str(seq_id).encode())
    return index % len(PALETTE)


def distinct_colors(seq_ids: Sequence, colors: Mapping | None = None) -> dict:
    """{seq id: colour} in which no two of ``seq_ids`` share a colour (while the palette lasts).

    Each id keeps `owner_color`'s colour unless an earlier id in the list already has it; then it
    takes the next free one (crc32 sends "vip-4", "batch-5" and "batch-7" to the same colour).
    Colours given in ``colors`` are kept as they are."""
    out = dict(colors or {})
    used = {i for i, color in enumerate(PALETTE) if color in out.values()}
    for seq in seq_ids:
        if seq in out:
            continue
        index = _palette_index(seq)
        while index in used and len(used) < len(PALETTE):
            index = (index + 1) % len(PALETTE)
        used.add(index)
        out[seq] = PALETTE[index]
    return out


def _check_cached(cached: Sequence[int], tables: Mapping, num_blocks: int) -> None:
    held = {b for table in tables.values() for b in table if b != NULL_BLOCK}
    for b in cached:
        if not 0 <= b < num_blocks or b in held:
            _fail("render_block_grid", "cached_block_ids",
                  f"holds block {b}: a free-but-cached block must be in 0..{num_blocks - 1} "
                  "and in no table")


def _owner_label(seq, table) -> str:
    """"a: 3 blocks", or with a sliding window "a: 3 blocks (+2 freed)"
    (NULL_BLOCK entries hold none)."""
    freed = sum(1 for b in table if b == NULL_BLOCK)
    held = len(table) - freed
    return f"{seq}: {held} block{'s' * (held != 1)}" + (f" (+{freed} freed)" if freed else "")


def _cell_text(b: int, cell: Cell | None, cached: bool = False, narrow: bool = False) -> str:
    """The label of block b: its id, then "a[1]" (logical block 1 of sequence a) or "x3 [0]"
    (logical block 0 of three tables that share it); ``narrow`` puts "[1]" on a line of its own."""
    if cell is None:
        return f"{b}\ncached" if cached else f"{b}"
    who = f"{cell.owners[0]}" if len(cell.owners) == 1 else f"x{len(cell.owners)} "
    return f"{b}\n{who}" + ("\n" if narrow else "") + f"[{cell.logical}]"


@dataclass
class _GridLabels:
    """The labels of one drawn grid, in both layouts, to be sized once the layout is known."""

    ax: object
    columns: int
    rows: int
    labels: list  # (text artist, wide text, narrow text)


def _label_size(cell_pt: float, texts: Sequence[str]) -> float:
    """The largest font size (at most CELL_FONT_PT) at which every text fits in a cell of
    ``cell_pt`` points."""
    lines = [line for t in texts for line in t.split("\n")]
    chars = max(len(line) for line in lines)
    height = max(t.count("\n") + 1 for t in texts)
    room = CELL_TEXT_FILL * cell_pt
    return min(CELL_FONT_PT, room / (chars * CHAR_EM), room / (height * LINE_EM))


def _fit_labels(fig: Figure, grids: Sequence[_GridLabels]) -> None:
    """Size every grid's labels to its cells as laid out (wide layout first, narrow if it reads
    larger); hide them where even that is below MIN_CELL_FONT_PT."""
    fig.get_layout_engine().execute(fig)  # constrained layout: the axes' final boxes
    for grid in grids:
        if not grid.labels:
            continue
        grid.ax.apply_aspect()  # square cells: the box the axes is really drawn in
        box = grid.ax.get_position()
        cell_pt = 72 * min(box.width * fig.get_figwidth() / (grid.columns + 2 * GRID_EDGE),
                           box.height * fig.get_figheight() / (grid.rows + 2 * GRID_EDGE))
        wide = _label_size(cell_pt, [w for _, w, _ in grid.labels])
        narrow = _label_size(cell_pt, [n for _, _, n in grid.labels])
        size, pick = (wide, 1) if wide >= narrow else (narrow, 2)
        for entry in grid.labels:
            entry[0].set_text(entry[pick])
            entry[0].set_fontsize(size)
            entry[0].set_visible(size >= MIN_CELL_FONT_PT)


def _draw_cell(ax, b: int, cell: Cell | None, block_size: int, columns: int, colors, labels: bool,
               cached: bool = False):
    """One block: a frame faded in its owner's colour, the filled part solid
    (hatched when shared), a label.

    We add the artists with `add_artist` and keep them out of the layout: the axes limits are set
    once for the whole grid, and a pool of 48 cells then draws several times faster. Returns the
    label as (artist, wide text, narrow text), or None without labels."""
    x, y = b % columns, b // columns
    color = ((CACHED_COLOR if cached else FREE_COLOR) if cell is None
             else owner_color(cell.owners[0], colors))
    shared = cell is not None and len(cell.owners) > 1
    face = mcolors.to_rgba(color, 1.0 if cell is None else EMPTY_ALPHA)
    artists = [Rectangle((x, y), 1, 1, facecolor=face, edgecolor=EDGE_COLOR, linewidth=1,
                         gid=f"block:{b}")]
    if cell is not None:
        fill = cell.tokens / block_size
        hatch, edge = (SHARED_HATCH, "black") if shared else (None, "none")
        artists.append(Rectangle((x, y + 1 - fill), 1, fill, facecolor=color, edgecolor=edge,
                                 hatch=hatch, linewidth=0.5, gid=f"fill:{b}"))
    label = None
    if labels:
        wide = _cell_text(b, cell, cached)
        label = (ax.text(x + 0.5, y + 0.5, wide, ha="center", va="center", fontsize=CELL_FONT_PT,
                         bbox=LABEL_BOX if shared else None, gid=f"label:{b}"),
                 wide, _cell_text(b, cell, cached, narrow=True))
        artists.append(label[0])
    for artist in artists:
        artist.set_in_layout(False)
        if artist.axes is None:
            ax.add_artist(artist)
    return label


def _grid_shape(num_blocks: int) -> tuple[int, int, float]:
    """(columns, rows, inches per cell) of the grid drawn for a pool of ``num_blocks`` blocks."""
    columns = min(num_blocks, GRID_COLUMNS if num_blocks <= GRID_COLUMNS**2 else WIDE_GRID_COLUMNS)
    rows = math.ceil(num_blocks / columns)
    return columns, rows, min(CELL_INCHES, MAX_GRID_INCHES / rows, 2 * MAX_GRID_INCHES / columns)


def columns_to_fill(num_blocks: int, width: float, height: float) -> int:
    """How many columns give a pool of ``num_blocks`` square cells the biggest cells in a
    ``width`` x ``height`` box (a grid drawn into a panel of a given shape)."""
    return max(range(1, num_blocks + 1),
               key=lambda c: min(width / c, height / math.ceil(num_blocks / c)))


def _draw_block_grid(ax, snap: BlockGridSnapshot, colors=None, legend: bool = True,
                     columns: int | None = None) -> _GridLabels:
    """Draw the grid into ``ax`` (``columns`` cells per row: by default `_grid_shape`'s); returns
    its labels, which the caller sizes with `_fit_labels` once the figure is laid out."""
    cells = grid_cells(snap.tables, snap.num_blocks, snap.num_tokens, snap.block_size)
    _check_cached(snap.cached_block_ids, snap.tables, snap.num_blocks)
    cached = set(snap.cached_block_ids)
    colors = distinct_colors(list(snap.tables), colors)
    columns = columns or _grid_shape(snap.num_blocks)[0]
    rows = math.ceil(snap.num_blocks / columns)
    labels = snap.num_blocks <= CELL_TEXT_MAX_BLOCKS
    drawn = [_draw_cell(ax, b, cells.get(b), snap.block_size, columns, colors, labels, b in cached)
             for b in range(snap.num_blocks)]
    ax.set_xlim(-GRID_EDGE, columns + GRID_EDGE)
    ax.set_ylim(rows + GRID_EDGE, -GRID_EDGE)  # block 0 top left, ids grow left to right, then down
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.spines[:].set_visible(False)  # each cell has its own frame; the last row may be short
    held = sum(c.tokens for c in cells.values())
    wasted = len(cells) * snap.block_size - held
    title = (f"{len(cells)}/{snap.num_blocks} blocks used, {wasted} slots wasted "
             f"(BS={snap.block_size})")
    if cached:
        title += f", {len(cached)} free but cached"
    ax.set_title(f"{snap.label}\n{title}" if snap.label else title, fontsize=9)
    if legend and (snap.tables or cached):
        owners = list(snap.tables)[:LEGEND_MAX_OWNERS]
        handles = [Patch(facecolor=owner_color(s, colors),
                         label=_owner_label(s, snap.tables[s])) for s in owners]
        if len(snap.tables) > len(owners):
            handles.append(Patch(facecolor="none", edgecolor="none",
                                 label=f"... and {len(snap.tables) - len(owners)} more"))
        if any(len(c.owners) > 1 for c in cells.values()):
            handles.append(Patch(facecolor="white", edgecolor="black", hatch=SHARED_HATCH,
                                 label="shared"))
        if cached:
            handles.append(Patch(facecolor=CACHED_COLOR, edgecolor=EDGE_COLOR,
                                 label="free but cached"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7,
                  frameon=False)
    return _GridLabels(ax, columns, rows, [label for label in drawn if label is not None])


def _panel_inches(snap: BlockGridSnapshot, cell: float, rows: int) -> float:
    """The height one grid needs: its cells and title, or its legend if that is taller
    (owners, "... and N more", shared, cached)."""
    entries = min(len(snap.tables), LEGEND_MAX_OWNERS) + 3
    return max(cell * rows, LEGEND_ROW_INCHES * entries) + TITLE_INCHES


def render_block_grid(block_tables: Mapping, num_blocks: int, num_tokens: Mapping | None = None,
                      block_size: int = 16, title: str = "", colors: Mapping | None = None,
                      cached_block_ids: Sequence[int] = ()) -> Figure:
    """The physical KV pool as a grid: one cell per block, coloured by its owner
    (see the module doc).

    block_tables: {seq id: [physical block, ...]}; num_tokens: {seq id: tokens} (None: all full);
    colors: optional {seq id: colour}, to keep colours fixed across a series of figures;
    cached_block_ids: free-but-cached blocks (prefix caching), drawn pale green.
    """
    snap = BlockGridSnapshot(dict(block_tables), num_blocks, block_size, num_tokens, title,
                             tuple(cached_block_ids))
    columns, rows, cell = _grid_shape(num_blocks)
    fig, axes = _new_figure(figsize=(cell * columns + LEGEND_INCHES,
                                     _panel_inches(snap, cell, rows)))
    _fit_labels(fig, [_draw_block_grid(axes[0][0], snap, colors)])
    return fig


def _evenly_spaced(count: int, panels: int) -> list[int]:
    return sorted({round(i) for i in np.linspace(0, count - 1, min(panels, count))})


def _colors_of(snaps: Sequence[BlockGridSnapshot]) -> dict:
    """Distinct colours for every owner of a series of snapshots, the same in each of them."""
    return distinct_colors(list(dict.fromkeys(seq for snap in snaps for seq in snap.tables)))


def render_block_grid_strip(snapshots: Sequence, steps: Sequence[int] | None = None) -> Figure:
    """A few snapshots of the pool, one under the other: the player's picture without widgets.

    snapshots: a list of BlockGridSnapshot (or dicts / objects `as_snapshot` accepts);
    steps: which indices to draw (default: four spread from the first to the last).
    """
    if not snapshots:
        _fail("render_block_grid_strip", "snapshots", "is empty: give at least one")
    snaps = [as_snapshot(s) for s in snapshots]
    steps = _evenly_spaced(len(snaps), STRIP_DEFAULT_PANELS) if steps is None else list(steps)
    bad = [i for i in steps if not -len(snaps) <= i < len(snaps)]
    if bad or not steps:
        _fail("render_block_grid_strip", "steps",
              f"must be indices in 0..{len(snaps) - 1}, got {list(steps)}")
    columns, rows, cell = _grid_shape(max(s.num_blocks for s in snaps))
    cell *= STRIP_SHRINK
    height = sum(_panel_inches(snaps[i], cell, rows) for i in steps)
    fig, axes = _new_figure(len(steps), 1, figsize=(cell * columns + LEGEND_INCHES, height))
    grids, colors = [], _colors_of(snaps)
    for ax, i in zip(axes[:, 0], steps, strict=True):
        snap = snaps[i]
        label = snap.label or f"snapshot {i}"
        grids.append(_draw_block_grid(ax, BlockGridSnapshot(snap.tables, snap.num_blocks,
                                                            snap.block_size, snap.num_tokens,
                                                            label, snap.cached_block_ids), colors))
    _fit_labels(fig, grids)
    return fig


def block_grid_player(snapshots: Sequence, interval_ms: int = 700):
    """A Play button and a slider that step through snapshots, redrawing `render_block_grid`.

    Needs ipywidgets (imported here, so the rest of the module works without it); a notebook shows
    the returned widget with `display(...)`. Without widgets, use `render_block_grid_strip`. The
    picture is an Image widget, not an Output widget, so `nbconvert --execute` and nbmake never
    stall on it (engine/viz/widgets.py says why).
    """
    import ipywidgets as widgets

    snaps = [as_snapshot(s) for s in snapshots]
    if not snaps:
        _fail("block_grid_player", "snapshots", "is empty: give at least one")
    play = widgets.Play(value=0, min=0, max=len(snaps) - 1, step=1, interval=interval_ms,
                        description="play")
    slider = widgets.IntSlider(value=0, min=0, max=len(snaps) - 1, description="snapshot")
    widgets.jslink((play, "value"), (slider, "value"))
    colors = _colors_of(snaps)

    def render(i: int) -> Figure:
        s = snaps[i]
        label = s.label or f"snapshot {i}"
        return render_block_grid(s.tables, s.num_blocks, s.num_tokens, s.block_size, label,
                                 colors, s.cached_block_ids)

    return widgets.VBox([widgets.HBox([play, slider]), interactive_figure(render, {"i": slider})])


# ---- the block size trade-off --------------------------------------------------------------------


def block_size_sweep(lengths: Sequence[int], block_sizes: Sequence[int]) -> list[dict]:
    """For each block size: put every sequence in a real BlockManager at its final length and count.

    waste_pct               empty slots / reserved slots (from `BlockManager.usage()`)
    predicted_waste_pct     the same with (BS - 1) / 2 empty slots per sequence
    table_entries_per_seq   block table length, averaged: the metadata the scheduler keeps and
                            ships to the kernel every step
    block_loads             blocks a decode kernel walks for the whole batch (its loop trips)
    slots_loaded            slots those blocks hold, read even where masked; useful_slots = tokens
    """
    if not lengths:
        _fail("block_size_sweep", "lengths", "is empty: give at least one sequence length")
    rows = []
    for bs in block_sizes:
        manager = BlockManager(num_blocks=sum(math.ceil(n / bs) for n in lengths), block_size=bs)
        for seq_id, n in enumerate(lengths):
            manager.allocate(seq_id, n)
        u = manager.usage()
        predicted = len(lengths) * (bs - 1) / 2
        rows.append({"block_size": bs, "waste_pct": 100 * u.waste_fraction,
                     "predicted_waste_pct": 100 * predicted / (u.used_slots + predicted),
                     "table_entries_per_seq": u.used_blocks / len(lengths),
                     "block_loads": u.used_blocks,
                     "slots_loaded": u.reserved_slots, "useful_slots": u.used_slots})
    return rows


def render_block_size_sweep(rows: Sequence[Mapping]) -> Figure:
    """Three panels against block size: KV waste, block table entries, and the decode kernel's work.

    rows: dicts with the keys of `block_size_sweep` (predicted_waste_pct optional).
    """
    missing = [k for k in SWEEP_KEYS if rows and k not in rows[0]]
    if not rows or missing:
        _fail("render_block_size_sweep", "rows",
              f"need dicts with keys {SWEEP_KEYS}; missing {missing or 'every row'}")
    rows = sorted(rows, key=lambda r: r["block_size"])
    bs = [r["block_size"] for r in rows]
    fig, axes = _new_figure(1, 3, figsize=(14.0, 4.2))
    waste, table, kernel = axes[0]
    waste.plot(bs, [r["waste_pct"] for r in rows], "o-", color=WASTED_COLOR, label="measured")
    if all("predicted_waste_pct" in r for r in rows):
        waste.plot(bs, [r["predicted_waste_pct"] for r in rows], "--", color="black",
                   label="(BS-1)/2 per sequence")
    waste.set(ylabel="KV slots wasted (% of reserved)", title="Waste grows with BS")
    waste.legend()
    table.plot(bs, [r["table_entries_per_seq"] for r in rows], "o-", color="tab:green")
    table.set(ylabel="block table entries per sequence", yscale="log",
              title="The table shrinks as 1/BS")
    kernel.plot(bs, [r["block_loads"] for r in rows], "o-", color="tab:purple",
                label="block loads (loop trips)")
    kernel.set(ylabel="blocks walked per decode step (batch)", yscale="log",
               title="Kernel work per decode step")
    extra = kernel.twinx()
    extra.plot(bs, [r["slots_loaded"] / r["useful_slots"] for r in rows], "s--", color="tab:orange",
               label="slots read / tokens held")
    extra.set_ylabel("slots read per useful token")
    kernel.legend(handles=kernel.lines + extra.lines, loc="upper center", fontsize=8)
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.set_xlabel("block size BS (tokens)")
    return fig
