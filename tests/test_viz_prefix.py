"""Chapter 06's figures: the hash chain is the engine's own, hits are the blocks the engine would share, and
the measurement figures draw the numbers they are given."""

import matplotlib.colors as mcolors
import pytest

from engine.kv.block_manager import BlockManager
from engine.kv.prefix_cache import block_hashes, cache_key
from engine.viz.prefix import (
    HIT_WIDTH,
    PARTIAL_COLOR,
    hash_chain_rows,
    render_eviction_sweep,
    render_hash_chain,
    render_prefix_sweep,
    render_side_channel,
)

BS = 4
SYSTEM = [7, 3, 9, 1, 4, 4, 8, 2]  # two full blocks every request below starts with (except c)
REQUESTS = {"a": SYSTEM + [6, 6], "b": SYSTEM + [5, 0, 1, 3, 2], "c": [0, 0, 0, 0] + SYSTEM[4:]}
KEY = cache_key("m:1", None, None)


def _cells(fig) -> dict:
    return {p.get_gid(): p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith("chain:")}


def test_the_chain_rows_carry_the_engines_hashes_and_no_hash_for_a_partial_block():
    rows = hash_chain_rows(REQUESTS, BS, KEY)
    for name, ids in REQUESTS.items():
        assert [b.hash for b in rows[name] if b.hash] == block_hashes(ids, BS, KEY)
    assert [b.hash is None for b in rows["a"]] == [False, False, True]  # 10 tokens: 2 full blocks + 2 tokens
    assert rows["b"][2].tokens == (5, 0, 1, 3)


def test_hits_are_exactly_the_blocks_the_engine_finds_after_the_earlier_requests():
    """The engine as the oracle: register each request's full blocks in a real BlockManager, in order; the
    next request's hit is find_cached_prefix capped at its length - 1 (what the scheduler asks for)."""
    rows = hash_chain_rows(REQUESTS, BS, KEY)
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    for seq, (name, ids) in enumerate(REQUESTS.items()):
        found = bm.find_cached_prefix(ids, KEY, len(ids) - 1)
        assert sum(b.hit for b in rows[name]) == len(found), name
        bm.allocate(seq, len(ids), found)
        bm.cache_blocks(seq, ids, KEY, len(ids))
    assert [b.hit for b in rows["b"]] == [True, True, False, False]
    assert not any(b.hit for b in rows["c"])  # the same 4 tokens after another first block: another hash


def test_a_fully_cached_prompt_does_not_count_the_block_of_its_last_token_as_a_hit():
    rows = hash_chain_rows({"first": SYSTEM, "again": SYSTEM}, BS, KEY)
    assert [b.hit for b in rows["again"]] == [True, False]


def test_another_key_gives_other_hashes_and_no_hit():
    keys = {"a": KEY, "b": cache_key("m:1", None, "acme")}
    rows = hash_chain_rows({"a": SYSTEM + [1], "b": SYSTEM + [1]}, BS, keys)
    assert not any(b.hit for b in rows["b"])
    assert {b.hash for b in rows["a"]} & {b.hash for b in rows["b"]} == {None}


def test_the_chain_figure_colours_cells_by_hash_and_frames_the_hits():
    cells = _cells(render_hash_chain(REQUESTS, BS, KEY))
    assert len(cells) == 3 + 4 + 2
    color = {gid: mcolors.to_hex(p.get_facecolor()) for gid, p in cells.items()}
    assert color["chain:a:0"] == color["chain:b:0"] and color["chain:a:1"] == color["chain:b:1"]
    assert color["chain:a:1"] != color["chain:c:1"] and color["chain:a:0"] != color["chain:a:1"]
    assert color["chain:a:2"] == mcolors.to_hex(PARTIAL_COLOR) and cells["chain:a:2"].get_hatch()
    assert cells["chain:b:0"].get_linewidth() == HIT_WIDTH and cells["chain:a:0"].get_linewidth() != HIT_WIDTH


def test_the_chain_figure_prints_words_when_given_and_refuses_a_wrong_count():
    words = {"a": [f"w{i}" for i in range(10)]}
    fig = render_hash_chain({"a": REQUESTS["a"]}, BS, KEY, labels=words)
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "w0 w1 w2 w3" in texts and "partial" in texts
    with pytest.raises(ValueError, match=r"labels.*'a'.*9 strings for 10 tokens"):
        render_hash_chain({"a": REQUESTS["a"]}, BS, KEY, labels={"a": words["a"][:9]})


@pytest.mark.parametrize("requests, block_size, field", [({}, BS, "requests"), ({"a": []}, BS, "requests"),
                                                         ({"a": [1]}, 0, "block_size")])
def test_bad_chain_input_names_the_field(requests, block_size, field):
    with pytest.raises(ValueError, match=f"hash_chain_rows: {field}"):
        hash_chain_rows(requests, block_size, KEY)


def test_a_key_mapping_must_name_every_request():
    with pytest.raises(ValueError, match=r"extra_keys has no key for request\(s\) \['b'\]"):
        hash_chain_rows({"a": [1], "b": [2]}, BS, {"a": KEY})


def _line(fig, gid):
    return next(line for ax in fig.axes for line in ax.lines if line.get_gid() == gid)


def test_the_sweep_figure_draws_hit_rates_and_ttfts_in_milliseconds():
    rows = [{"shared_fraction": 0.0, "hit_rate": 0.0, "ttft_p50_off_s": 0.2, "ttft_p50_on_s": 0.21},
            {"shared_fraction": 0.5, "hit_rate": 0.45, "ttft_p50_off_s": 0.2, "ttft_p50_on_s": 0.1}]
    fig = render_prefix_sweep(rows, threads=1)
    assert list(_line(fig, "hit_rate").get_ydata()) == [0.0, 0.45]
    assert list(_line(fig, "ttft_off").get_ydata()) == [200.0, 200.0]
    assert list(_line(fig, "ttft_on").get_ydata()) == pytest.approx([210.0, 100.0])
    assert [t.get_text() for t in fig.axes[1].get_xticklabels()] == ["0%\n+5%", "50%\n-50%"]
    # the proportional line: the median cache-off TTFT times the share the cache missed
    assert list(_line(fig, "ttft_proportional").get_ydata()) == pytest.approx([200.0, 110.0])
    noisy_off = [dict(rows[0], ttft_p50_off_s=0.1), dict(rows[1], ttft_p50_off_s=0.3)]
    assert list(_line(render_prefix_sweep(noisy_off), "ttft_proportional").get_ydata()) == pytest.approx([200.0, 110.0])
    with pytest.raises(ValueError, match="render_prefix_sweep: rows lack the key"):
        render_prefix_sweep([{"shared_fraction": 0.0}])


def test_the_eviction_figure_draws_one_line_per_pattern_in_pool_order():
    rows = [{"pattern": "cyclic", "num_blocks": 20, "hit_rate": 0.8}, {"pattern": "cyclic", "num_blocks": 8,
                                                                       "hit_rate": 0.0},
            {"pattern": "hot", "num_blocks": 8, "hit_rate": 0.4}]
    fig = render_eviction_sweep(rows, working_set_blocks=16)
    line = _line(fig, "pattern:cyclic")
    assert list(line.get_xdata()) == [8, 20] and list(line.get_ydata()) == [0.0, 0.8]
    assert list(_line(fig, "pattern:hot").get_ydata()) == [0.4]


def test_the_side_channel_figure_marks_the_median_of_each_condition():
    rows = [{"scope": "public", "victim_sent": True, "ttft_s": [0.05, 0.01, 0.02]},
            {"scope": "public", "victim_sent": False, "ttft_s": [0.3, 0.2, 0.4]}]
    fig = render_side_channel(rows)
    medians = {c.get_gid(): c.get_segments()[0][0][1] for c in fig.axes[0].collections if c.get_gid()}
    assert medians == {"median:public:True": pytest.approx(20.0), "median:public:False": pytest.approx(300.0)}


def test_the_eviction_figure_draws_each_patterns_own_best_hit_rate_in_its_colour():
    rows = [{"pattern": "cyclic", "num_blocks": 8, "hit_rate": 0.0}, {"pattern": "hot", "num_blocks": 8,
                                                                      "hit_rate": 0.4}]
    fig = render_eviction_sweep(rows, best_hit_rates={"cyclic": 0.59, "hot": 0.69})
    for pattern, best in (("cyclic", 0.59), ("hot", 0.69)):
        line = _line(fig, f"best:{pattern}")
        assert set(line.get_ydata()) == {best}
        assert line.get_color() == _line(fig, f"pattern:{pattern}").get_color()
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "best possible: 59%" in labels and "best possible: 69%" in labels
    with pytest.raises(ValueError, match=r"best_hit_rates names pattern\(s\) \['other'\]"):
        render_eviction_sweep(rows, best_hit_rates={"other": 0.5})
