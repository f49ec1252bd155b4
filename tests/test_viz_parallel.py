"""Chapter 08's figures: each draws real inputs (placement layouts, tinylab's config, a real pipelined step on two
gloo ranks, a real replica pool) and exactly the numbers it is given; bad input is a clear error."""

import dataclasses

import pytest
from matplotlib.figure import Figure

from engine.companions.placement import INTERCONNECT_PRESETS, plan_layout
from engine.config import MODEL_PRESETS
from engine.llm import LLM
from engine.loading.loader import load_model
from engine.replicas.replicas import ReplicaPool
from engine.sampling import SamplingParams
from engine.viz.parallel import (
    render_comm_per_token,
    render_layout_memory,
    render_pipeline_timeline,
    render_routing,
    render_step_breakdown,
    render_tensor_parallel_layer,
)

GB, MS, US = 1e9, 1e3, 1e6


def patches(fig, prefix: str) -> dict:
    return {p.get_gid(): p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").startswith(prefix)}


def patch(fig, gid: str):
    """The one patch with this gid."""
    found = [p for ax in fig.axes for p in ax.patches if p.get_gid() == gid]
    assert len(found) == 1, f"{len(found)} patches with gid {gid!r}"
    return found[0]


def texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [ax.get_title() for ax in fig.axes]


@pytest.fixture(scope="module")
def tinylab_config():
    model, _ = load_model("tinylab")
    return dataclasses.replace(model.config, name="tinylab")


@pytest.fixture(scope="module")
def pipelined_steps():
    """A real pipeline-parallel engine (2 ranks, 2 micro-batches): one prefill-heavy step and a few decode
    steps, each with its StageTimeline spans, step time and rank 0's seconds inside collectives."""
    llm = LLM("tinylab", pipeline_parallel_size=2, num_micro_batches=2)
    try:
        engine, steps = llm.engine, []
        for i in range(4):
            engine.add_request(list(range(3 + i, 3 + i + 24)), SamplingParams(temperature=0, max_tokens=3,
                                                                              ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.runner.comm_stats.reset()
            report = engine.step()
            steps.append({"spans": list(engine.runner.timeline.spans), "kind": "prefill" if report.num_prefill_tokens
                          else "decode", "step_s": report.end_time - report.start_time,
                          "comm_s": engine.runner.comm_stats.total_seconds(),
                          "bubble": engine.runner.timeline.bubble_fraction()})
        return steps
    finally:
        llm.engine.shutdown()


# ---- placement: memory per GPU ---------------------------------------------------------------------------------


def test_the_memory_figure_stacks_each_layouts_weights_reserve_and_kv_under_the_cards_memory():
    layouts = [plan_layout("Llama-3-70B", "H100-SXM-80GB", 8, "NVLink4", tp, pp) for tp, pp in ((1, 1), (4, 1), (2, 2))]
    assert not layouts[0].fits and layouts[1].fits  # 141 GB of bf16 weights cannot fit one 80 GB card
    fig = render_layout_memory(layouts)
    assert isinstance(fig, Figure)
    for x in layouts:
        label = f"TP={x.tp} PP={x.pp}"
        weights, reserve = patch(fig, f"weights:{label}"), patch(fig, f"reserve:{label}")
        assert weights.get_height() == pytest.approx(x.weight_bytes_per_device / GB)
        assert reserve.get_y() == pytest.approx(x.weight_bytes_per_device / GB)
    over = patch(fig, "weights:TP=1 PP=1")
    assert over.get_height() > 80  # the overflow shows above the card
    memory = [line for line in fig.axes[0].lines if line.get_gid() == "memory"]
    assert len(memory) == 3 and all(list(line.get_ydata()) == pytest.approx([80.0, 80.0]) for line in memory)
    shown = texts(fig)
    assert "does not\nfit" in shown and f"{layouts[1].sequences:,} seq" in shown
    assert "sequences of 8,192 tokens" in fig.axes[0].get_title()


def test_an_impossible_split_is_named_not_drawn_and_bad_layouts_are_refused():
    impossible = plan_layout("SmolLM2-135M", "L4-24GB", 2, "PCIe4-x16", 2)  # 9 query heads: TP=2 cannot split
    fig = render_layout_memory([impossible])
    assert "split\nimpossible" in texts(fig) and not patches(fig, "weights:")
    with pytest.raises(ValueError, match="render_layout_memory: layouts is empty"):
        render_layout_memory([])
    with pytest.raises(ValueError, match="render_layout_memory: layouts holds dict"):
        render_layout_memory([{"tp": 1}])


# ---- tensor parallel: one layer -------------------------------------------------------------------------------


def test_the_tensor_parallel_layer_fills_each_ranks_columns_then_its_rows(tinylab_config):
    """Column-parallel matrices: rank r holds the r-th vertical strip; row-parallel: the r-th horizontal strip
    from the top. Two all-reduces, each spanning every rank."""
    tp = 2
    fig = render_tensor_parallel_layer(tinylab_config, tp)
    strips = patches(fig, "slice:")
    assert sorted(strips) == sorted(f"slice:{m}:{r}" for m in ("qkv", "o", "gate_up", "down") for r in range(tp))
    for matrix in ("qkv", "gate_up"):  # columns: same height, rank 1 to the right of rank 0
        s0, s1 = strips[f"slice:{matrix}:0"], strips[f"slice:{matrix}:1"]
        assert s1.get_x() == pytest.approx(s0.get_x() + s0.get_width()) and s0.get_height() > s0.get_width()
    for matrix in ("o", "down"):  # rows: full width, each rank's strip at the same place inside its own box
        s0, s1 = strips[f"slice:{matrix}:0"], strips[f"slice:{matrix}:1"]
        box0, box1 = patch(fig, f"row:{matrix}:0"), patch(fig, f"row:{matrix}:1")
        assert s0.get_width() > s0.get_height()
        assert (s0.get_y() - box0.get_y()) == pytest.approx(s1.get_y() - box1.get_y() + s1.get_height())
    reduces = patches(fig, "allreduce:")
    ranks = [patch(fig, f"attention:{r}") for r in range(tp)]
    assert sorted(reduces) == ["allreduce:1", "allreduce:2"]
    for box in reduces.values():  # spans from the lowest rank's box to the highest's
        assert box.get_y() == pytest.approx(min(r.get_y() for r in ranks))
        assert box.get_y() + box.get_height() == pytest.approx(max(r.get_y() + r.get_height() for r in ranks))
    c = tinylab_config
    E, D, H, Hkv, I = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    shown = "\n".join(texts(fig))
    assert f"[{E}, {H * D // tp}+{2 * Hkv * D // tp}]" in shown  # this rank's q + k + v outputs
    assert f"[{H * D // tp}, {E}]" in shown and f"[{I // tp}, {E}]" in shown
    assert f"q heads\n{H // tp}-{H - 1}\nKV head 1" in shown and f"channels\n{I // tp}-{I - 1}" in shown


def test_the_tensor_parallel_layer_refuses_a_split_the_engine_refuses(tinylab_config):
    with pytest.raises(ValueError, match="render_tensor_parallel_layer: tp cannot split this model: "
                                         "tensor_parallel_size=3"):
        render_tensor_parallel_layer(tinylab_config, 3)
    with pytest.raises(ValueError, match=r"render_tensor_parallel_layer: tp must be an integer in \[2, 8\]"):
        render_tensor_parallel_layer(tinylab_config, 1)
    with pytest.raises(ValueError, match="render_tensor_parallel_layer: config must be a ModelConfig"):
        render_tensor_parallel_layer("tinylab", 2)
    assert isinstance(render_tensor_parallel_layer(MODEL_PRESETS["Llama-3-70B"], 8), Figure)


# ---- pipeline parallel -----------------------------------------------------------------------------------------


def test_the_pipeline_timeline_draws_every_span_and_hatches_exactly_the_idle_time(pipelined_steps):
    prefill = next(s for s in pipelined_steps if s["kind"] == "prefill")
    spans = prefill["spans"]
    assert {s[0] for s in spans} == {0, 1} and {s[1] for s in spans} == {0, 1}  # 2 stages x 2 micro-batches
    fig = render_pipeline_timeline({"M = 2": spans})
    start, end = min(s[2] for s in spans), max(s[3] for s in spans)
    boxes = patches(fig, "mb:M = 2:")
    assert len(boxes) == len(spans)
    for stage, mb, a, b in spans:
        box = boxes[f"mb:M = 2:{stage}:{mb}"]
        assert box.get_x() == pytest.approx((a - start) * MS) and box.get_width() == pytest.approx((b - a) * MS)
    for stage in (0, 1):  # busy + idle = the whole step, on every stage
        busy = sum(b - a for s, _, a, b in spans if s == stage) * MS
        idle = sum(p.get_width() for p in fig.axes[0].patches if p.get_gid() == f"bubble:M = 2:{stage}")
        assert busy + idle == pytest.approx((end - start) * MS)
    title = fig.axes[0].get_title()
    assert f"bubble {prefill['bubble']:.0%} (formula" in title and "(P-1)/(M+P-1) = 33%" in title
    assert f"step {(end - start) * MS:.0f} ms" in title  # the span from the first start to the last end


def test_the_pipeline_panels_share_one_axis_so_the_shorter_step_ends_left():
    long_step = [(0, 0, 0.0, 0.030), (1, 0, 0.030, 0.060)]  # M = 1: 60 ms, the stages take turns
    short_step = [(0, m, 0.0075 * m, 0.0075 * (m + 1)) for m in range(4)] + \
                 [(1, m, 0.0075 * (m + 1), 0.0075 * (m + 2)) for m in range(4)]  # M = 4: 37.5 ms
    fig = render_pipeline_timeline({"M = 1": long_step, "M = 4": short_step})
    assert fig.axes[0].get_xlim() == fig.axes[1].get_xlim() and fig.axes[1].get_xlim()[1] >= 60
    assert "step 60 ms, bubble 50%" in fig.axes[0].get_title()
    assert "step 38 ms, bubble 20%" in fig.axes[1].get_title()  # the ideal schedule: the formula's bubble
    ends = [p.get_x() + p.get_width() for p in patches(fig, "mb:M = 4:").values()]
    assert max(ends) == pytest.approx(37.5)


def test_the_pipeline_timeline_refuses_empty_or_backwards_spans():
    with pytest.raises(ValueError, match="render_pipeline_timeline: timelines is empty"):
        render_pipeline_timeline({})
    with pytest.raises(ValueError, match=r"render_pipeline_timeline: timelines\['x'\] has no spans"):
        render_pipeline_timeline({"x": []})
    with pytest.raises(ValueError, match="end_s >= start_s"):
        render_pipeline_timeline({"x": [(0, 0, 2.0, 1.0)]})


# ---- communication per token -----------------------------------------------------------------------------------


def test_the_comm_figure_draws_each_links_time_per_token_against_the_weight_read():
    cfg = MODEL_PRESETS["Llama-3-70B"]
    layouts = {name: plan_layout(cfg, "H100-SXM-80GB", 8, name, 8) for name in ("NVLink4", "PCIe4-x16", "100GbE")}
    comm = {name: x.comm_s_per_token for name, x in layouts.items()}
    bytes_per_token = cfg.num_hidden_layers * 2 * 2 * 7 / 8 * cfg.hidden_size * 2  # L x 2 ring all-reduces, bf16
    for name, seconds in comm.items():
        assert seconds == pytest.approx(bytes_per_token / INTERCONNECT_PRESETS[name].bytes_per_s)
    read = layouts["NVLink4"].weight_read_s_per_token
    fig = render_comm_per_token(comm, read)
    bars = patches(fig, "comm:")
    for name, seconds in comm.items():
        assert bars[f"comm:{name}"].get_width() == pytest.approx(seconds * US)
    line = next(x for x in fig.axes[0].lines if x.get_gid() == "weight_read")
    assert list(line.get_xdata()) == pytest.approx([read * US] * 2)
    slow = render_comm_per_token({"slow link": read * 3}, read)  # slower than the weight read: red
    assert patch(slow, "comm:slow link").get_facecolor()[:3] != bars["comm:NVLink4"].get_facecolor()[:3]
    assert any("(3x the weight read)" in t for t in texts(slow))
    with pytest.raises(ValueError, match=r"render_comm_per_token: comm_s_per_token\['x'\] must be > 0"):
        render_comm_per_token({"x": 0.0}, read)
    with pytest.raises(ValueError, match="render_comm_per_token: weight_read_s_per_token must be > 0"):
        render_comm_per_token(comm, 0)


# ---- measured step times ---------------------------------------------------------------------------------------


def test_the_step_breakdown_stacks_time_in_collectives_on_the_rest(pipelined_steps):
    rows = [{"config": f"PP=2 step {i}", **{k: s[k] for k in ("kind", "step_s", "comm_s")}}
            for i, s in enumerate(pipelined_steps)]
    assert all(0 < r["comm_s"] < r["step_s"] for r in rows)  # a pipelined step waits on sends and receives
    fig = render_step_breakdown(rows)
    assert [ax.get_title() for ax in fig.axes] == ["prefill steps", "decode steps"]
    for r in rows:
        rest = patch(fig, f"compute:{r['kind']}:{r['config']}")
        comm = patch(fig, f"comm:{r['kind']}:{r['config']}")
        assert rest.get_height() + comm.get_height() == pytest.approx(r["step_s"] * MS)
        assert comm.get_y() == pytest.approx(rest.get_height()) and comm.get_height() == pytest.approx(r["comm_s"] * MS)
        assert f"{r['comm_s'] / r['step_s']:.0%} comm" in "\n".join(texts(fig))
    with pytest.raises(ValueError, match="render_step_breakdown: rows entry 'x'/'decode': comm_s=2"):
        render_step_breakdown([{"config": "x", "kind": "decode", "step_s": 1.0, "comm_s": 2.0}])
    with pytest.raises(ValueError, match=r"lacks \['comm_s'\]"):
        render_step_breakdown([{"config": "x", "kind": "decode", "step_s": 1.0}])


# ---- replicas and routing --------------------------------------------------------------------------------------


def test_the_routing_figure_draws_each_policys_hits_and_each_replicas_work():
    """Two documents, each asked about four times, in pairs (0, 0, 1, 1, ...): round robin sends each document
    to both replicas (each prefills it once), prefix-aware keeps each on one replica (prefilled once in all)."""
    docs = [list(range(10 + 100 * d, 10 + 100 * d + 32)) for d in range(2)]
    prompts = [docs[k // 2 % 2] + [500 + k] for k in range(8)]
    results = {}
    for policy in ("round_robin", "prefix_aware"):
        with ReplicaPool("tinylab", 2, router=policy, in_process=True, block_size=16,
                         enable_prefix_caching=True) as pool:
            for p in prompts:  # one at a time: each lookup sees what the earlier requests cached
                pool.generate([p], SamplingParams(temperature=0, max_tokens=2))
            stats = pool.stats()
        results[policy] = {"hit_rate": sum(s.prefix_cache_hits for s in stats) / sum(s.prefix_cache_queries
                                                                                    for s in stats),
                           "load": [s.prompt_tokens - s.prefix_cache_hits for s in stats]}
    assert results["prefix_aware"]["hit_rate"] > results["round_robin"]["hit_rate"]
    fig = render_routing(results, load_label="prompt tokens prefilled")
    for policy, r in results.items():
        assert patch(fig, f"hit:{policy}").get_height() == pytest.approx(100 * r["hit_rate"])
        for k, work in enumerate(r["load"]):
            assert patch(fig, f"load:{policy}:{k}").get_height() == work
        assert f"{max(r['load']) / sum(r['load']):.0%}" in texts(fig)
    assert fig.axes[1].get_ylabel() == "prompt tokens prefilled"
    with pytest.raises(ValueError, match=r"render_routing: results\['a'\]\['hit_rate'\] must be a share in \[0, 1\]"):
        render_routing({"a": {"hit_rate": 1.5, "load": [1, 2]}})
    with pytest.raises(ValueError, match="different replica counts"):
        render_routing({"a": {"hit_rate": 0.5, "load": [1, 2]}, "b": {"hit_rate": 0.5, "load": [1, 2, 3]}})
