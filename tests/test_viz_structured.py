"""Chapter 13's figures draw exactly what they are given: every edge of the DFA once, with its bytes; a
token's walk state by state, red from the byte where it falls off; the mask's lit cells are the allowed
ids; the distribution after the mask is the allowed part of the one before, renormalized."""

import matplotlib.colors as mcolors
import pytest
import torch

from engine.structured.regex_dfa import DEAD, TokenTable, compile_regex
from engine.viz.structured import (
    ACCEPT_COLOR,
    ALLOWED_COLOR,
    CONSTRAINED_COLOR,
    DEAD_COLOR,
    FORBIDDEN_COLOR,
    FREE_COLOR,
    MAX_STATES_DRAWN,
    STATE_COLOR,
    dfa_edges,
    render_dfa,
    render_mask_cost,
    render_masked_top_tokens,
    render_quality,
    render_token_mask,
    render_token_walks,
    token_label,
)

NUMBER = r"-?\d+(\.\d+)?"


def _patches(fig, prefix):
    return {p.get_gid(): p for ax in fig.axes for p in ax.patches
            if p.get_gid() and p.get_gid().startswith(prefix)}


def _texts(fig, prefix):
    return {t.get_gid(): t.get_text() for ax in fig.axes for t in ax.texts
            if t.get_gid() and t.get_gid().startswith(prefix)}


def _hex(patch):
    return mcolors.to_hex(patch.get_facecolor())


def test_the_dfa_figure_draws_every_transition_once_with_its_bytes():
    dfa = compile_regex(NUMBER)
    fig = render_dfa(dfa)
    # the oracle: the transition table itself, not format_dfa's text
    pairs = {(s, t) for s, row in enumerate(dfa.transitions) for t in row if t != DEAD}
    assert set(_patches(fig, "edge:")) == {f"edge:{s}:{t}" for s, t in pairs}
    assert set(_patches(fig, "state:")) == {f"state:{s}" for s in range(dfa.num_states)}
    assert set(_patches(fig, "accept:")) == {f"accept:{s}" for s in range(dfa.num_states)
                                             if dfa.accepting[s]}
    assert "start" in {p.get_gid() for p in fig.axes[0].patches}
    labels = _texts(fig, "label:")
    minus = next(t for t in range(dfa.num_states) if dfa.transitions[0][ord("-")] == t)
    assert labels[f"label:0:{minus}"] == "-"  # format_dfa's "\x2d", drawn as the character
    digit_edges = {(s, dfa.transitions[s][ord("5")]) for s in range(dfa.num_states)
                   if dfa.transitions[s][ord("5")] != DEAD}
    assert digit_edges and all(labels[f"label:{s}:{t}"] == "[0-9]" for s, t in digit_edges)
    assert [(s, t) for s, _, t in dfa_edges(dfa)] and {(s, t) for s, _, t in dfa_edges(dfa)} == pairs


def test_the_dfa_figure_refuses_a_dfa_too_big_to_read():
    dfa = compile_regex("a" * MAX_STATES_DRAWN)  # one state per byte, plus the last
    with pytest.raises(ValueError, match="render_dfa: dfa has 31 states.*print format_dfa"):
        render_dfa(dfa)


def test_a_token_walk_crosses_states_and_turns_red_where_it_falls_off():
    dfa = compile_regex(r"\d+(\.\d+)?")  # 0 -digit-> 1 (accept) -.-> 2 -digit-> 3 (accept)
    fig = render_token_walks(dfa, [b"2.5", b"1a5", b"."])
    cells = _patches(fig, "walk:")
    colors = {gid: _hex(p) for gid, p in cells.items()}
    state, accept, dead = (mcolors.to_hex(c) for c in (STATE_COLOR, ACCEPT_COLOR, DEAD_COLOR))
    assert [colors[f"walk:0:{j}"] for j in range(4)] == [state, accept, state, accept]
    assert [colors[f"walk:1:{j}"] for j in range(4)] == [state, accept, dead, dead]  # dead stays dead
    assert [colors[f"walk:2:{j}"] for j in range(2)] == [state, dead]
    assert len(cells) == 4 + 4 + 2  # the start cell and one per byte
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "allowed: 3 bytes, lands in 3, accepting" in texts
    assert "forbidden: falls off at byte 2" in texts and "forbidden: falls off at byte 1" in texts


def test_a_chained_walk_starts_each_token_where_the_one_before_landed():
    dfa = compile_regex(r"\d+(\.\d+)?")
    fig = render_token_walks(dfa, [b"1", b"2.", b"5"], chain=True)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts.count("from") == 3
    assert "allowed: 1 byte, lands in 1, accepting" in texts  # "1" from 0
    assert "allowed: 2 bytes, lands in 2" in texts  # "2." from 1
    assert "allowed: 1 byte, lands in 3, accepting" in texts  # "5" from 2, not from 0
    with pytest.raises(ValueError, match=r"render_token_walks: pieces \[0\] falls off"):
        render_token_walks(dfa, [b"x", b"1"], chain=True)
    with pytest.raises(ValueError, match="render_token_walks: pieces must be non-empty bytes"):
        render_token_walks(dfa, [b""])


VOCAB = [b"a", b"ab", b"ac", b"b", b"c", b"abc", None]  # id 6: EOS (no text)


def test_the_mask_figure_lights_exactly_the_allowed_ids_and_counts_every_state():
    table = TokenTable.build(compile_regex("ab|ac"), VOCAB, [6])
    after_a = table.advance(table.start, 0)
    fig = render_token_mask(table, after_a, VOCAB)
    grid = fig.axes[0].images[0].get_array()
    lit = [i for i in range(len(VOCAB)) if grid.flat[i] == 1]
    assert lit == [3, 4]  # after "a": "b" or "c", nothing else
    # by hand: the start allows "a", "ab", "ac"; after "a", "b" and "c"; at the end only EOS
    counts = {gid: p.get_height() for gid, p in _patches(fig, "count:").items()}
    assert sorted(counts.values()) == [1, 2, 3]
    assert counts[f"count:{table.start}"] == 3 and counts[f"count:{after_a}"] == 2
    assert mcolors.to_hex(_patches(fig, f"count:{after_a}")[f"count:{after_a}"].get_facecolor()) \
        == mcolors.to_hex(ALLOWED_COLOR)
    assert "2 of 7 tokens allowed" in fig.axes[0].get_title()
    listed = _texts(fig, "listed")["listed"]
    assert listed.startswith("allowed: b  c")


def test_the_after_panel_is_the_allowed_part_of_the_before_panel_renormalized():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.5, -1.0])
    allowed = torch.tensor([False, True, True, False, True])
    fig = render_masked_top_tokens(logits, allowed, top=5)
    p = torch.softmax(logits, dim=0)
    before = {**_patches(fig, "allowed:"), **_patches(fig, "forbidden:")}
    assert {gid: b.get_height() for gid, b in before.items()} == pytest.approx(
        {f"{'allowed' if allowed[i] else 'forbidden'}:{i}": float(p[i]) for i in range(5)})
    assert all(_hex(b) == mcolors.to_hex(FORBIDDEN_COLOR) for b in _patches(fig, "forbidden:").values())
    mass = float(p[allowed].sum())
    after = {gid: b.get_height() for gid, b in _patches(fig, "after:").items()}
    assert after == pytest.approx({f"after:{i}": float(p[i]) / mass for i in (1, 2, 4)})
    assert f"{mass:.1%}" in fig._suptitle.get_text()
    ticks = [mcolors.to_hex(t.get_color()) for t in fig.axes[0].get_xticklabels()]  # ranked 0, 1, 2, 3, 4
    assert ticks == [mcolors.to_hex(ALLOWED_COLOR if ok else FORBIDDEN_COLOR) for ok in allowed.tolist()]
    sliver = render_masked_top_tokens(torch.tensor([12.0, 0.0]), torch.tensor([False, True]), top=2)
    assert "held 0.00061% of" in sliver._suptitle.get_text()  # e^-12 / (1 + e^-12), not "0.0%"
    with pytest.raises(ValueError, match="render_masked_top_tokens: allowed allows no token"):
        render_masked_top_tokens(logits, torch.zeros(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="allowed must be a bool tensor"):
        render_masked_top_tokens(logits, torch.ones(4, dtype=torch.bool))


def test_the_cost_figure_draws_compile_in_ms_and_mask_in_us_beside_the_decode_step():
    rows = [{"masker": "reference table", "compile_s": 0.5, "mask_s": 2e-4},
            {"masker": "llguidance", "compile_s": 0.002, "mask_s": 5e-5}]
    fig = render_mask_cost(rows, decode_step_s=0.03)
    bars = {gid: b.get_height() for gid, b in _patches(fig, "").items()}
    assert bars["compile:reference table"] == pytest.approx(500) and bars["compile:llguidance"] == pytest.approx(2)
    assert bars["mask:reference table"] == pytest.approx(200) and bars["mask:llguidance"] == pytest.approx(50)
    line = next(ln for ln in fig.axes[1].lines if ln.get_gid() == "decode_step")
    assert list(line.get_ydata()) == pytest.approx([30_000, 30_000])
    with pytest.raises(ValueError, match=r"render_mask_cost: rows lack the key\(s\) \['mask_s'\]"):
        render_mask_cost([{"masker": "x", "compile_s": 1.0}])


def test_the_quality_figure_draws_each_rate_of_each_row_in_its_colour():
    rows = [{"task": "extract", "precision": p, "constrained": c, "n": 4, "parse_rate": pr,
             "schema_valid_rate": v, "field_accuracy": f}
            for p, c, pr, v, f in (("fp32", False, 0.25, 0.25, 0.9), ("fp32", True, 1.0, 1.0, 0.8),
                                   ("int4", False, 0.0, 0.0, 0.5), ("int4", True, 1.0, 0.75, 0.6))]
    tinylab = [{**r, "task": "json", "model": "tinylab", "n": 16} for r in rows[:2]]
    fig = render_quality([rows[0], tinylab[0], rows[2], tinylab[1], rows[1], rows[3]])
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [  # by task, then precision
        "extract · fp32\nn = 4", "extract · int4\nn = 4", "tinylab\njson · fp32\nn = 16"]
    for r in rows:
        which = "constrained" if r["constrained"] else "free"
        for gid, key in (("parse", "parse_rate"), ("valid", "schema_valid_rate"), ("fields", "field_accuracy")):
            bar = _patches(fig, f"{gid}:extract:{r['precision']}:{which}")
            (patch,) = bar.values()
            assert patch.get_height() == pytest.approx(r[key])
            assert _hex(patch) == mcolors.to_hex(CONSTRAINED_COLOR if r["constrained"] else FREE_COLOR)
    with pytest.raises(ValueError, match=r"render_quality: rows lack the key\(s\) \['precision'\]"):
        render_quality([{k: v for k, v in rows[0].items() if k != "precision"}])


def test_token_labels_show_spaces_newlines_half_characters_and_special_tokens():
    assert token_label(b" {\"") == "␣{\""
    assert token_label(b"\n\n") == "⏎⏎"
    assert token_label("é".encode()[:1]) == "\\xc3"  # half of a two-byte character
    assert token_label(None, 2) == "<2>"
    assert token_label(b"abcdefghijklmnop") == "abcdefghi…"
