"""The picture of an outage (spark_sb.report) from hand-made metrics and ledger rows, without Spark: the PNG,
where the outage is shaded, the outage spans, and bad input named."""

from __future__ import annotations

import datetime
import struct
from pathlib import Path
from typing import Any

import pytest

from spark_sb.errors import ConfigError
from spark_sb.report import OutageSpan, draw_outage, outage_spans, save_outage

pytest.importorskip("matplotlib")

T0 = datetime.datetime(2026, 11, 23, 18, 0, tzinfo=datetime.UTC)
QUEUES = ("x-servicebus-transfer/0", "x-servicebus-transfer/1")


def _batch(batch_id: int, *, primary: int = 50, backlog: dict[str, int] | None = None, failovers: int = 0,
           failed_over: tuple[str, ...] = (), at: float | None = None, **extra: Any) -> dict[str, Any]:
    """One metrics row as PairedSink._write_metrics writes it: a batch every 2 s, each taking 0.5 s."""
    return {"batch_id": batch_id, "finished_at": T0 + datetime.timedelta(seconds=at if at is not None else 2 * batch_id),
            "rows": primary + sum((backlog or {}).values()), "sent": primary + sum((backlog or {}).values()),
            "primary": primary, "secondary": 0, "rejected": 0, "failovers": failovers, "failbacks": 0,
            "busy_waits": 0, "assumed_failovers": 0, "swaps": 0, "backlog": backlog or {},
            "failed_over": list(failed_over), "partitions": 2, "seconds": 0.5, **extra}


def _outage_run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Batches 0-3 to the primary; 4-7 parked (4 fails over part-way); 8 fails back; 9-11 to the primary; then
    the syphon moves the 190 parked messages home in two batches."""
    metrics = [_batch(b) for b in range(4)]
    metrics.append(_batch(4, primary=10, backlog={QUEUES[0]: 20, QUEUES[1]: 20}, failovers=1,
                          failed_over=("orders",)))
    metrics += [_batch(b, primary=0, backlog={QUEUES[0]: 25, QUEUES[1]: 25}, failed_over=("orders",))
                for b in (5, 6)]
    metrics.append(_batch(7, primary=0, backlog={QUEUES[0]: 25, QUEUES[1]: 25}))  # healed after sending
    metrics += [_batch(b) for b in range(8, 12)]
    ledger = [{"batch_id": 0, "outcome": "delivered", "recorded_time": T0 + datetime.timedelta(seconds=30),
               "message_id": f"m{i}"} for i in range(150)]
    ledger += [{"batch_id": 1, "outcome": outcome, "recorded_time": T0 + datetime.timedelta(seconds=33),
                "message_id": f"n{i}"} for i, outcome in enumerate(["delivered"] * 38 + ["dead_lettered"] * 2)]
    return metrics, ledger


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_the_picture_is_a_png_of_a_readable_size_and_says_what_it_shows(tmp_path: Path) -> None:
    metrics, ledger = _outage_run()
    out = tmp_path / "outage.png"
    summary = save_outage(metrics, ledger, out)
    width, height = _png_size(out)
    assert 1000 <= width <= 1600 and 600 <= height <= 1000
    assert out.stat().st_size > 20_000  # bars, text and a legend, not an empty canvas
    assert (summary.batches, summary.primary, summary.backlog) == (12, 410, 190)
    assert (summary.drained, summary.drain_batches) == (190, 2)
    assert summary.describe() == ("12 sink batches (410 rows to the primary, 190 to backlog queues), outages: "
                                  "batches 4-7; the syphon moved 190 messages in 2 batches")


def test_the_outage_is_shaded_over_its_batches_and_nowhere_else() -> None:
    metrics, ledger = _outage_run()
    figure = draw_outage(metrics, ledger)
    top, bottom = figure.axes[:2]
    shaded = [p for p in top.patches if p.get_alpha() == pytest.approx(0.12) and p.get_height() > 0
              and p.get_facecolor()[0] > 0.8]
    assert len(shaded) == 1
    left, right = shaded[0].get_x(), shaded[0].get_x() + shaded[0].get_width()
    # x is seconds since the first batch began (batch 0 finished at 0 s after 0.5 s): batch b ends at 2b + 0.5
    ends = {b: 2 * b + 0.5 for b in range(12)}
    assert all(left < ends[b] < right for b in (4, 5, 6, 7))
    assert not any(left < ends[b] < right for b in (3, 8))
    assert top.get_xlabel() == "" and "time since the first batch began (s)" in bottom.get_xlabel()
    labels = top.get_legend().get_texts()
    assert [t.get_text() for t in labels] == ["the primary", f"backlog queue {QUEUES[0]}",
                                              f"backlog queue {QUEUES[1]}", "outage (an entity failed over)"]
    assert "outage" in figure.get_suptitle()
    # the drain: delivered and dead-lettered bars, and the backlog level back to 0 at the end
    drain_labels = [t.get_text() for t in bottom.get_legend().get_texts()]
    assert drain_labels == ["waiting in the backlog queues (parked - moved)", "moved to the primary",
                            "dead-lettered"]
    level = bottom.get_lines()[0].get_ydata()
    assert max(level) == 190 and level[-1] == 0


def test_outage_spans_from_the_failover_columns() -> None:
    metrics = [
        _batch(0),
        _batch(1, failovers=1, failed_over=("orders",), primary=5, backlog={QUEUES[0]: 45}),
        _batch(2, primary=0, backlog={QUEUES[0]: 50}, failed_over=("orders",)),
        _batch(3),  # failed back before sending: the primary took every row
        _batch(4),
        _batch(5, primary=50, failovers=1, failed_over=("invoices",)),  # failed over with nothing parked yet
        _batch(6, primary=0, backlog={QUEUES[1]: 50}),  # healed during the batch
        _batch(7, primary=45, backlog={QUEUES[1]: 5}),  # another partition's sender still failed over
        _batch(8),
        _batch(9, assumed_failovers=1, failed_over=("orders",)),
    ]
    spans = outage_spans(list(reversed(metrics)))  # any row order: spans follow the batches' times
    start = T0.timestamp()
    assert spans == [
        OutageSpan(1, 2, start + 1.5, start + 4, ("orders",), 95),
        OutageSpan(5, 7, start + 9.5, start + 14, ("invoices",), 55),
        OutageSpan(9, 9, start + 17.5, start + 18, ("orders",), 0),
    ]
    assert outage_spans([_batch(b) for b in range(3)]) == []


def test_spans_and_the_picture_take_pandas_frames_as_spark_hands_them_over(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    metrics, ledger = _outage_run()
    frame = pd.DataFrame(metrics)
    # toPandas gives a map column as a list of pairs and a timestamp column as naive UTC times
    frame["backlog"] = [list(m["backlog"].items()) for m in metrics]
    frame["finished_at"] = pd.to_datetime([m["finished_at"] for m in metrics]).tz_localize(None)
    assert [(s.first_batch, s.last_batch, s.backlog_rows) for s in outage_spans(frame)] == [(4, 7, 190)]
    counted = pd.DataFrame(ledger).groupby(["batch_id", "outcome"], as_index=False).agg(
        recorded_time=("recorded_time", "max"), messages=("message_id", "count"))
    summary = save_outage(frame, counted, tmp_path / "outage.png")
    assert (summary.drained, summary.drain_batches) == (190, 2)


def test_no_outage_and_no_ledger_still_draw_a_picture_that_says_so(tmp_path: Path) -> None:
    out = tmp_path / "calm.png"
    summary = save_outage([_batch(b) for b in range(5)], [], out)
    assert _png_size(out)[0] >= 1000
    assert summary.spans == () and summary.drained == 0
    figure = draw_outage([_batch(b) for b in range(5)])
    assert figure.get_suptitle() == "No outage: every batch went to the primary"


@pytest.mark.parametrize(("metrics", "ledger", "expected"), [
    ([{k: v for k, v in _batch(0).items() if k != "failed_over"}], [],
     "metrics: misses the column failed_over (it needs batch_id, finished_at, primary, backlog, failovers, "
     "failed_over)"),
    ([{k: v for k, v in _batch(0).items() if k not in ("backlog", "primary")}], [],
     "metrics: misses the columns primary, backlog"),
    ([], [], "metrics: has no rows (no batch wrote a summary)"),
    ([_batch(0)], [{"batch_id": 0, "outcome": "delivered"}], "ledger: misses the column recorded_time"),
    ([_batch(0), _batch(1, finished_at=None)], [], "metrics (batch 1).finished_at: is empty"),
    ([_batch(3, finished_at="yesterday")], [], "metrics (batch 3).finished_at: is not a time, got 'yesterday'"),
    ([_batch(2, primary=-5)], [], "metrics (batch 2).primary: is negative, got -5"),
    ([_batch(0)], [{"batch_id": 0, "outcome": "delivered", "recorded_time": "soon"}],
     "ledger (batch 0).recorded_time: is not a time, got 'soon'"),
    (["batch 0"], [], "metrics: must be a DataFrame or a list of rows (mappings), got a row of type str"),
])
def test_bad_input_is_named(metrics: Any, ledger: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        draw_outage(metrics, ledger)
    assert str(info.value).startswith(expected)


@pytest.mark.parametrize("later", [90, 600, 3000])
def test_a_syphon_that_moves_everything_in_one_batch_long_after_the_outage_shows_its_bar(later: int) -> None:
    """One ledger batch minutes after a run of 1 s sink batches: its bar, as wide as a sink batch's, was a pixel
    or two on the time axis, under the drop of the backlog line (225 of its pixels showed at 10 and 50 minutes,
    1,029 at 90 s). It is at least a visible share of the axis, drawn over the line."""
    np = pytest.importorskip("numpy")
    metrics = ([_batch(b, at=b) for b in range(4)]
               + [_batch(b, at=b, primary=0, backlog={QUEUES[0]: 50}, failed_over=("orders",)) for b in range(4, 40)]
               + [_batch(b, at=b) for b in range(40, 60)])
    ledger = [{"batch_id": 0, "outcome": "delivered", "recorded_time": T0 + datetime.timedelta(seconds=later),
               "messages": 1800}]
    figure = draw_outage(metrics, ledger)
    figure.canvas.draw()
    pixels = np.asarray(figure.canvas.buffer_rgba())[..., :3]
    delivered = int(np.all(pixels == (0x2c, 0xa0, 0x2c), axis=-1).sum())  # the "moved to the primary" colour
    assert delivered > 1500, f"the syphon's bar shows {delivered} pixels"
    bottom = figure.axes[1]
    [bar] = [p for p in bottom.patches if p.get_height() == 1800]
    left, right = bottom.get_xlim()
    assert bar.get_x() + bar.get_width() < right, "the bar ends inside the axis"
