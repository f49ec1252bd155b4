"""Chapter 04's figures: the numbers behind them are right, and the pictures draw those numbers."""

import types
import warnings

import matplotlib.colors as mcolors
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from engine.kv.block_manager import BlockManager
from engine.viz.blocks import (
    CELL_FONT_PT,
    FREE_COLOR,
    MIN_CELL_FONT_PT,
    SHARED_HATCH,
    BlockGridSnapshot,
    Cell,
    _draw_block_grid,
    _fit_labels,
    as_snapshot,
    block_grid_player,
    block_size_sweep,
    block_snapshot,
    columns_to_fill,
    distinct_colors,
    grid_cells,
    owner_color,
    render_block_grid,
    render_block_grid_strip,
    render_block_size_sweep,
    render_reservation,
    reservation_summary,
)

# The module docstring's picture: BS 4, a holds 6 tokens in [0, 2], b holds 7 in [1, 3], pool of 8.
DOC_TABLES = {"a": [0, 2], "b": [1, 3]}
DOC_TOKENS = {"a": 6, "b": 7}


def _patches(fig: Figure) -> dict[str, object]:
    return {p.get_gid(): p for ax in fig.axes for p in ax.patches if p.get_gid()}


# ---- reservation -----------------------------------------------------------------------------------


def test_reservation_summary_of_a_hand_worked_batch():
    # max_len 32, BS 16, lengths 1, 16, 17 (34 tokens): contiguous reserves 3 x 32 = 96 and wastes 62;
    # paged reserves 16 + 16 + 32 = 64 and wastes 15 + 0 + 15 = 30; predicted 3 x 7.5 = 22.5.
    s = reservation_summary([1, 16, 17], max_len=32, block_size=16)
    assert s["contiguous"] == {"reserved": 96, "used": 34, "wasted": 62,
                               "waste_pct": pytest.approx(100 * 62 / 96)}
    assert (s["paged"]["reserved"], s["paged"]["wasted"], s["paged"]["predicted_wasted"]) == (64, 30, 22.5)


def test_render_reservation_draws_used_and_wasted_bars_for_both_schemes():
    fig = render_reservation([1, 16, 17], max_len=32, block_size=16)
    totals = fig.axes[1]
    heights = sorted(round(p.get_height()) for p in totals.patches)
    assert heights == [30, 34, 34, 62]  # used 34 twice, wasted 30 (paged) and 62 (contiguous)


@pytest.mark.parametrize("lengths", [[], [0, 5], [33]])
def test_reservation_refuses_lengths_outside_1_to_max_len(lengths):
    with pytest.raises(ValueError, match="lengths"):
        reservation_summary(lengths, max_len=32, block_size=16)


# ---- the block grid --------------------------------------------------------------------------------


def test_grid_cells_of_the_docstring_picture():
    cells = grid_cells(DOC_TABLES, num_blocks=8, num_tokens=DOC_TOKENS, block_size=4)
    assert cells == {0: Cell(("a",), 0, 4), 2: Cell(("a",), 1, 2),
                     1: Cell(("b",), 0, 4), 3: Cell(("b",), 1, 3)}


def test_grid_cells_counts_blocks_as_full_without_token_counts():
    assert grid_cells({7: [5]}, num_blocks=8, block_size=4) == {5: Cell((7,), 0, 4)}


def test_grid_cells_after_a_fork_shows_the_shared_block_and_the_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate(0, 6)  # blocks 0 (full) and 1 (2 tokens)
    bm.fork(0, 1)
    assert bm.append_slots(1, 1).copies == [(1, 2)]  # the child's partly filled last block is copied to 2
    snap = block_snapshot(bm)
    cells = grid_cells(snap.tables, snap.num_blocks, snap.num_tokens, snap.block_size)
    assert cells == {0: Cell((0, 1), 0, 4), 1: Cell((0,), 1, 2), 2: Cell((1,), 1, 3)}


def test_render_block_grid_draws_every_block_and_fills_held_ones_by_their_tokens():
    fig = render_block_grid(DOC_TABLES, 8, DOC_TOKENS, block_size=4, title="doc")
    patches = _patches(fig)
    assert {g for g in patches if g.startswith("block:")} == {f"block:{b}" for b in range(8)}
    assert {g for g in patches if g.startswith("fill:")} == {"fill:0", "fill:1", "fill:2", "fill:3"}
    assert patches["fill:2"].get_height() == pytest.approx(0.5)  # 2 of 4 slots
    assert patches["fill:3"].get_height() == pytest.approx(0.75)
    assert mcolors.same_color(patches["fill:0"].get_facecolor(), owner_color("a"))
    assert mcolors.same_color(patches["fill:1"].get_facecolor(), owner_color("b"))
    assert mcolors.same_color(patches["block:6"].get_facecolor(), FREE_COLOR)


def test_render_block_grid_hatches_shared_blocks_only():
    fig = render_block_grid({0: [0, 1], 1: [0, 2]}, 4, {0: 8, 1: 5}, block_size=4)
    patches = _patches(fig)
    assert patches["fill:0"].get_hatch() == SHARED_HATCH
    assert patches["fill:1"].get_hatch() is None and patches["fill:2"].get_hatch() is None


def test_owner_colors_are_stable_and_can_be_overridden():
    assert owner_color("req-7") == owner_color("req-7")
    assert len({owner_color(i) for i in range(10)}) == 10  # consecutive int ids never share a colour
    assert owner_color(3, colors={3: "black"}) == "black"


@pytest.mark.parametrize("tables, tokens, field", [
    ({"a": [0, 8]}, None, "block_tables"),  # block 8 in a pool of 8
    ({"a": [1, 1]}, None, "block_tables"),  # the same block twice in one table
    ({"a": [0, 1]}, {"a": 9}, "num_tokens"),  # 9 tokens in 2 blocks of 4
])
def test_render_block_grid_refuses_tables_that_do_not_fit_the_pool(tables, tokens, field):
    with pytest.raises(ValueError, match=field):
        render_block_grid(tables, 8, tokens, block_size=4)


def test_a_snapshot_is_a_copy_of_the_manager_at_that_moment():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 3)
    snap = block_snapshot(bm, "after a")
    bm.append_slots("a", 4)
    bm.allocate("b", 1)
    assert (snap.tables, snap.num_tokens, snap.label) == ({"a": [0]}, {"a": 3}, "after a")


def test_as_snapshot_reads_dicts_and_trace_like_objects():
    from_dict = as_snapshot({"tables": DOC_TABLES, "num_tokens": DOC_TOKENS, "total": 8, "block_size": 4})
    trace_like = types.SimpleNamespace(tables=DOC_TABLES, num_tokens=DOC_TOKENS, total=8, block_size=4,
                                       used=4)  # the fields of engine.trace.BlockSnapshot that matter
    expected = BlockGridSnapshot(DOC_TABLES, 8, 4, DOC_TOKENS, "")
    assert from_dict == expected and as_snapshot(trace_like) == expected
    with pytest.raises(ValueError, match="num_blocks"):
        as_snapshot({"tables": DOC_TABLES, "block_size": 4})


def test_the_strip_draws_the_chosen_snapshots_in_order():
    snaps = [BlockGridSnapshot({"a": list(range(i + 1))}, 8, 4, None, f"step {i}") for i in range(6)]
    titles = [ax.get_title() for ax in render_block_grid_strip(snaps, steps=[0, 5]).axes if ax.get_title()]
    assert [t.splitlines()[0] for t in titles] == ["step 0", "step 5"]
    default = [ax.get_title().splitlines()[0] for ax in render_block_grid_strip(snaps).axes if ax.get_title()]
    assert default[0] == "step 0" and default[-1] == "step 5" and len(default) == 4
    with pytest.raises(ValueError, match="steps"):
        render_block_grid_strip(snaps, steps=[6])


def labels_outside_their_cells(fig: Figure) -> list[str]:
    """Every visible cell label whose drawn text leaves its own cell (so it could overprint a
    neighbour's), after a real draw; also the labels drawn smaller than MIN_CELL_FONT_PT."""
    canvas = FigureCanvasAgg(fig)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "constrained_layout not applied": panels would overlap
        canvas.draw()
    renderer = canvas.get_renderer()
    bad = []
    for ax in fig.axes:
        cells = {p.get_gid().split(":")[1]: p.get_window_extent(renderer)
                 for p in ax.patches if (p.get_gid() or "").startswith("block:")}
        for t in ax.texts:
            if not (t.get_gid() or "").startswith("label:") or not t.get_visible():
                continue
            text, cell = t.get_window_extent(renderer), cells[t.get_gid().split(":")[1]]
            inside = (text.x0 >= cell.x0 and text.x1 <= cell.x1 and text.y0 >= cell.y0
                      and text.y1 <= cell.y1)
            if not inside or t.get_fontsize() < MIN_CELL_FONT_PT:
                bad.append(f"{t.get_text()!r} at {t.get_fontsize():.1f} pt")
    return bad


LONG_NAMES = {f"batch-{k}": [2 * k, 2 * k + 1] for k in range(12)}  # 24 blocks held, 2 each


@pytest.mark.parametrize("num_blocks", [24, 48, 128])
def test_no_cell_label_leaves_its_cell_in_a_grid_or_a_strip(num_blocks):
    tokens = {s: 7 for s in LONG_NAMES}
    cached = [num_blocks - 1] if num_blocks > len(LONG_NAMES) * 2 else []
    grid = render_block_grid(LONG_NAMES, num_blocks, tokens, block_size=4, cached_block_ids=cached)
    assert labels_outside_their_cells(grid) == []
    snaps = [BlockGridSnapshot(LONG_NAMES, num_blocks, 4, tokens, f"step {i}") for i in range(3)]
    assert labels_outside_their_cells(render_block_grid_strip(snaps)) == []


def test_a_grid_with_room_labels_every_block_and_keeps_owner_and_index_together():
    fig = render_block_grid(DOC_TABLES, 8, DOC_TOKENS, block_size=4)
    FigureCanvasAgg(fig).draw()
    labels = {t.get_gid(): t for t in fig.axes[0].texts if (t.get_gid() or "").startswith("label:")}
    assert len(labels) == 8 and all(t.get_visible() for t in labels.values())
    assert labels["label:2"].get_text() == "2\na[1]" and labels["label:2"].get_fontsize() == CELL_FONT_PT


def test_labels_too_small_to_read_are_left_out_not_shrunk_to_dots():
    # 128 blocks in a panel of 2 x 1 inches: cells of about 1/8 inch, far too small for "batch-3[1]"
    fig = Figure(figsize=(2.0, 1.0), layout="constrained")
    ax = fig.add_subplot()
    grid = _draw_block_grid(ax, BlockGridSnapshot(LONG_NAMES, 128, 4, None), legend=False)
    _fit_labels(fig, [grid])
    assert grid.labels and not any(t.get_visible() for t, _, _ in grid.labels)


def test_columns_to_fill_picks_the_biggest_square_cells_for_the_panel():
    assert columns_to_fill(24, 4.0, 3.0) == 6  # 6 x 4 cells of 2/3 inch (8 x 3: 1/2 inch)
    assert columns_to_fill(24, 13.0, 1.0) == 24  # a wide strip: one row
    assert columns_to_fill(3, 1.0, 9.0) == 1  # a tall column


def test_owners_of_one_grid_never_share_a_colour_even_when_their_ids_hash_alike():
    ids = ["vip-4", "batch-5", "batch-7", "vip-0"]  # crc32 sends the first three to one colour
    assert owner_color("vip-4") == owner_color("batch-5") == owner_color("batch-7")
    fig = render_block_grid({s: [k] for k, s in enumerate(ids)}, 8, block_size=4)
    fills = [_patches(fig)[f"fill:{k}"].get_facecolor() for k in range(len(ids))]
    assert len(set(fills)) == len(ids)
    assert fills[0] == mcolors.to_rgba(owner_color("vip-4"))  # the first keeps its own colour
    assert distinct_colors(ids)["vip-0"] == owner_color("vip-0")  # and so does one that did not collide


def test_a_strip_gives_each_owner_one_colour_in_every_panel():
    snaps = [BlockGridSnapshot({"vip-4": [0], "batch-5": [1]}, 4, 4, None, "a"),
             BlockGridSnapshot({"batch-5": [1]}, 4, 4, None, "b")]  # alone, batch-5 would keep its own
    fig = render_block_grid_strip(snaps)
    first, second = (p.get_facecolor() for p in fig.axes[0].patches + fig.axes[1].patches
                     if p.get_gid() == "fill:1")
    assert first == second != mcolors.to_rgba(owner_color("batch-5"))


def test_the_player_has_a_play_button_and_a_slider_over_every_snapshot():
    widgets = pytest.importorskip("ipywidgets")
    snaps = [BlockGridSnapshot({"a": [0]}, 4, 4, {"a": n}, "") for n in (1, 2, 3)]
    player = block_grid_player(snaps)
    play, slider = player.children[0].children
    assert isinstance(play, widgets.Play) and isinstance(slider, widgets.IntSlider)
    assert (play.max, slider.max) == (2, 2)


def _all_widgets(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _all_widgets(child)


def test_the_player_redraws_the_grid_of_the_chosen_snapshot_without_an_output_widget():
    # an Output widget is what nbconvert/nbmake answer back, and can stall on (engine/viz/widgets.py)
    widgets = pytest.importorskip("ipywidgets")
    from engine.viz.widgets import figure_png

    snaps = [BlockGridSnapshot({"a": [0]}, 4, 4, {"a": n}, f"step {n}") for n in (1, 2, 3)]
    player = block_grid_player(snaps)
    slider = player.children[0].children[1]
    image = next(w for w in _all_widgets(player) if isinstance(w, widgets.Image))
    assert not any(isinstance(w, widgets.Output) for w in _all_widgets(player))
    assert image.value == figure_png(render_block_grid({"a": [0]}, 4, {"a": 1}, 4, "step 1"))
    slider.value = 2
    assert image.value == figure_png(render_block_grid({"a": [0]}, 4, {"a": 3}, 4, "step 3"))


# ---- the block size sweep --------------------------------------------------------------------------


def test_block_size_sweep_of_a_hand_worked_batch():
    # lengths 1, 16, 17 (34 tokens). BS 1: 34 blocks, no waste. BS 16: 1 + 1 + 2 = 4 blocks, 64 slots,
    # 30 empty (46.875%); predicted 3 x 7.5 = 22.5 empty of 34 + 22.5.
    bs1, bs16 = block_size_sweep([1, 16, 17], [1, 16])
    assert (bs1["waste_pct"], bs1["block_loads"]) == (0.0, 34)
    assert bs1["table_entries_per_seq"] == pytest.approx(34 / 3)
    assert (bs16["block_loads"], bs16["slots_loaded"], bs16["useful_slots"]) == (4, 64, 34)
    assert bs16["waste_pct"] == pytest.approx(46.875)
    assert bs16["predicted_waste_pct"] == pytest.approx(100 * 22.5 / 56.5)


def test_render_block_size_sweep_plots_each_row_and_refuses_missing_keys():
    rows = block_size_sweep([1, 16, 17, 300], [1, 4, 16, 64])
    fig = render_block_size_sweep(rows)
    waste_line = fig.axes[0].lines[0]
    assert list(waste_line.get_xdata()) == [1, 4, 16, 64]
    assert list(waste_line.get_ydata()) == [r["waste_pct"] for r in rows]
    with pytest.raises(ValueError, match="block_loads"):
        render_block_size_sweep([{"block_size": 16, "waste_pct": 1.0}])


def test_a_sliding_windows_freed_entries_are_not_drawn_and_the_legend_counts_only_held_blocks():
    fig = render_block_grid({"a": [-1, -1, 5, 2]}, 8, {"a": 14}, block_size=4)
    cells = grid_cells({"a": [-1, -1, 5, 2]}, 8, {"a": 14}, block_size=4)
    assert sorted(cells) == [2, 5] and cells[2].tokens == 2 and cells[5].logical == 2
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["a: 2 blocks (+2 freed)"]
    one = render_block_grid({"b": [-1, 3]}, 8, {"b": 5}, block_size=4).axes[0].get_legend().get_texts()
    assert [t.get_text() for t in one] == ["b: 1 block (+1 freed)"]
