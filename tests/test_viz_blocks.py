"""Chapter 04's figures: the numbers behind them are right, and the pictures draw those numbers."""

import types

import matplotlib.colors as mcolors
import pytest
from matplotlib.figure import Figure

from engine.kv.block_manager import BlockManager
from engine.viz.blocks import (
    FREE_COLOR,
    SHARED_HATCH,
    BlockGridSnapshot,
    Cell,
    as_snapshot,
    block_grid_player,
    block_size_sweep,
    block_snapshot,
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


def test_the_player_has_a_play_button_and_a_slider_over_every_snapshot():
    widgets = pytest.importorskip("ipywidgets")
    snaps = [BlockGridSnapshot({"a": [0]}, 4, 4, {"a": n}, "") for n in (1, 2, 3)]
    player = block_grid_player(snaps)
    play, slider = player.children[0].children
    assert isinstance(play, widgets.Play) and isinstance(slider, widgets.IntSlider)
    assert (play.max, slider.max) == (2, 2)


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
