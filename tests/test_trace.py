"""The stage-2 timeline PNG stays readable: every span label lies inside its own bar and no two labels
overlap, however narrow the spans (lesson 03 at K=3 on the CPU: compute spans of a few µs beside
reduce-scatters of tens of ms); wide spans are named; each micro-step is marked. The overlap it reports counts
each instant once; two CPU ranks at stage 2 show reduce-scatters hidden behind backward (none with --no-overlap)."""
import numpy as np
import pytest

from llmz import trace

BUCKETS = ["lnf", *[f"block{i}" for i in range(7, -1, -1)], "embeddings"]


def fake_events(rng, K: int) -> list[dict]:
    """Rank 0's trace of one step as Tracer.stop writes it: per micro-step, each bucket's backward (compute)
    then its reduce-scatter (comm), with random durations from 2 µs to 40 ms (block 3's reduce-scatter: 60 ms)
    and a forward gap between."""
    events, t = [], 0.0
    for _ in range(K):
        for b in BUCKETS:
            dur = float(np.exp(rng.uniform(np.log(2), np.log(4e4))))
            events.append({"name": b, "ph": "X", "ts": t, "dur": dur, "pid": 0, "tid": "compute"})
            t += dur
            dur = 6e4 if b == "block3" else float(np.exp(rng.uniform(np.log(2), np.log(4e4))))    # one wide span
            events.append({"name": f"reduce-scatter {b}", "ph": "X", "ts": t, "dur": dur, "pid": 0, "tid": "comm"})
            t += dur
        t += float(rng.uniform(1e4, 1e5))                     # the next micro-step's forward (not traced)
    return events


@pytest.mark.parametrize("K", [1, 3])
def test_timeline_labels_sit_inside_their_bars_and_never_overlap(rng, K):
    events = fake_events(rng, K)
    fig = trace.timeline_figure(events, "title")
    ax = fig.axes[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    t0 = events[0]["ts"]
    rows = {"compute": 1, "comm": 0}
    bars = [ax.transData.transform([((e["ts"] - t0) / 1e3, rows[e["tid"]] - 0.4),
                                    ((e["ts"] - t0 + e["dur"]) / 1e3, rows[e["tid"]] + 0.4)]) for e in events]
    labels = [t for t in ax.texts if not t.get_text().startswith(" ")]        # micro-step marks start with " "
    boxes = []
    for t in labels:
        box = t.get_window_extent(renderer)
        x, y = t.get_position()
        i = min(range(len(events)), key=lambda j: abs((events[j]["ts"] - t0 + events[j]["dur"] / 2) / 1e3 - x)
                + abs(rows[events[j]["tid"]] - y))
        (bx0, by0), (bx1, by1) = bars[i]
        assert bx0 <= box.x0 and box.x1 <= bx1 and by0 <= box.y0 and box.y1 <= by1, (t.get_text(), events[i])
        assert trace.short_name(events[i]["name"]) in t.get_text() or t.get_text() in events[i]["name"], \
            (t.get_text(), events[i]["name"])
        boxes.append(box)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), "two labels overlap"
    # every span at least 60 px wide (about 5% of the axis here) carries a name
    wide = sum((x1 - x0) >= 60 for (x0, _), (x1, _) in bars)
    assert wide > 0 and len(labels) >= wide
    # each micro-step: a dotted line, and its name where there is room before the next (else its number)
    assert len(ax.get_lines()) == K
    marks = [t for t in ax.texts if t.get_text().startswith(" ")]
    assert len(marks) == (K if K > 1 else 0)
    for k, t in enumerate(marks, 1):
        assert t.get_text() in (f" micro-step {k}", f" {k}")
    mark_boxes = [t.get_window_extent(renderer) for t in marks]
    assert not any(a.overlaps(b) for i, a in enumerate(mark_boxes) for b in mark_boxes[i + 1:])


def test_micro_steps_start_where_the_first_bucket_comes_back(rng):
    events = fake_events(rng, 3)
    starts = trace.micro_steps(events)
    assert len(starts) == 3 and starts == [e["ts"] for e in events if e["name"] == "lnf"]


def test_an_empty_trace_says_so_in_the_png(tmp_path):
    fig = trace.timeline_figure([], "title")
    assert any("no spans recorded" in t.get_text() for t in fig.axes[0].texts)
    png = tmp_path / "t.png"
    trace.plot_png([], str(png), "title")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_overlap_counts_each_instant_once_and_only_where_a_layer_computes(rng):
    """Random spans on whole microseconds, collectives in flight together as on CPU ranks: the overlap equals a
    count, microsecond by microsecond, of the instants some collective is in flight (and some layer computes)."""
    for _ in range(20):
        events, comp, comm = [], np.zeros(2000, bool), np.zeros(2000, bool)
        for tid, covered in (("compute", comp), ("comm", comm)):
            for _ in range(int(rng.integers(0, 8))):
                ts, dur = int(rng.integers(0, 1800)), int(rng.integers(0, 200))
                events.append({"name": f"reduce-scatter block{len(events)}" if tid == "comm" else "block0",
                               "ts": float(ts), "dur": float(dur), "tid": tid})
                covered[ts:ts + dur] = True
        got = trace.overlap(events)
        assert got.comm_ms * 1e3 == pytest.approx(comm.sum(), abs=1e-9)
        assert got.hidden_ms * 1e3 == pytest.approx((comm & comp).sum(), abs=1e-9)
        assert 0 <= got.share <= 1 and (got.share > 0) == bool((comm & comp).any())
    assert trace.overlap([]).share == 0 and "0% hidden" in str(trace.overlap([]))


def test_legend_names_only_the_kinds_of_span_present(rng):
    stage2 = fake_events(rng, 1)
    assert trace.legend(stage2) == "RS reduce-scatter"
    stage3 = stage2 + [{"name": "forward block0", "ts": 0.0, "dur": 1.0, "tid": "compute"},
                       {"name": "all-gather block0", "ts": 0.0, "dur": 1.0, "tid": "comm"}]
    assert trace.legend(stage3) == "F forward, RS reduce-scatter, AG all-gather"


def test_collectives_in_flight_together_are_stacked_in_lanes():
    spans = [{"ts": 0.0, "dur": 10.0}, {"ts": 5.0, "dur": 10.0}, {"ts": 10.0, "dur": 2.0}, {"ts": 20.0, "dur": 1.0}]
    lane = trace.lanes(spans)
    # the second starts while the first is in flight; the third reuses the first's lane once that has ended
    assert [lane[id(s)] for s in spans] == [(0, 2), (1, 2), (0, 2), (0, 2)]
    fig = trace.timeline_figure([{**s, "name": f"reduce-scatter block{i}", "tid": "comm"} for i, s in enumerate(spans)],
                                "title", streams=False)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["collectives\nin flight", "layers\ncomputing"]


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [True, False])
def test_two_cpu_ranks_at_stage_2_hide_reduce_scatters_behind_backward_unless_told_not_to(tmp_path, overlap):
    """`llmz.train --trace` on 2 CPU ranks at stage 2: the traced step's line and the JSON both give overlap > 0;
    with --no-overlap (each reduce-scatter waited for where it starts) exactly 0. The first cannot flake on a
    loaded machine: MPICH finishes a started collective only after two or more MPI calls (measured: 2 for 2 KB,
    3 from 64 KB, whenever the other rank started it), and backward makes one between done(b), which starts
    block b's reduce-scatter, and the next block's first kernel, so each one but the embeddings' (the last) is
    still in flight when that block computes; load only makes it longer."""
    import json
    import re

    from mpirun import run_mpi
    t = tmp_path / "t.json"
    p = run_mpi(2, ["-m", "llmz.train", "--device", "cpu", "--model", "tiny", "-b", "2", "-t", "16", "--steps", "2",
                    "--zero-stage", "2", "--comm", "mpi", "--val-data", "", "--sample-tokens", "0", "--trace",
                    str(t), *([] if overlap else ["--no-overlap"])], timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    said = re.search(r"^timeline .* step 1: collectives in flight ([\d.]+) ms, ([\d.]+) ms of it behind compute",
                     p.stdout, re.MULTILINE)
    assert said and float(said.group(1)) > 0, p.stdout
    events = json.loads(t.read_text())["traceEvents"]
    measured = trace.overlap(events)
    assert f"{measured.comm_ms:.2f} {measured.hidden_ms:.2f}" == f"{said.group(1)} {said.group(2)}"
    assert measured.hidden_ms > 0 if overlap else measured.hidden_ms == 0
    assert trace.legend(events) == "RS reduce-scatter"          # stage 2 traces no forward, gathers nothing
    assert t.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
