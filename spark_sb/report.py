"""The picture of an outage: where each batch of the paired sink sent its rows (the primary or a backlog queue),
the outage shaded, and the syphon moving the parked messages home, on one time axis (a PNG).

Two inputs, both Delta tables a real run writes:

* the sink's metrics table (``sink.metrics_table``, one row per batch, :data:`spark_sb.sink.METRICS_SCHEMA`):
  ``batch_id``, ``finished_at``, ``primary``, ``backlog`` (``{backlog queue: rows}``), ``failovers`` and
  ``failed_over`` (the entities left failed over after the batch); ``seconds``, ``rejected`` and
  ``assumed_failovers`` are used when present;
* the syphon's ledger (``syphon.ledger``, one row per settled backlog message,
  :data:`spark_sb.republisher.LEDGER_DDL`): ``batch_id``, ``outcome`` and ``recorded_time``; a ``messages``
  column, when present, is the number of messages a row stands for (the Spark reader sends one row per ledger
  batch and outcome rather than one per message).

:func:`draw_outage` and :func:`save_outage` are pure: they take pandas DataFrames or lists of dicts, so they run
without Spark. :func:`read_delta` and :func:`write_report` are the Spark edge (``spark-sb report`` and the
demo): they read the tables as Delta (a path, with ``/`` or a scheme) or as catalog tables (a name), and import
pyspark only when called. matplotlib (the ``[spark]`` extra) is imported when drawing, with its ``Agg``
canvas (no display, no pyplot state).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .errors import ConfigError

_LOGGER = logging.getLogger(__name__)

__all__ = ["LEDGER_COLUMNS", "METRICS_COLUMNS", "OutageSpan", "ReportSummary", "draw_outage", "outage_spans",
           "read_delta", "save_outage", "write_report"]

#: the metrics table's columns the picture needs (the sink writes them all)
METRICS_COLUMNS = ("batch_id", "finished_at", "primary", "backlog", "failovers", "failed_over")
#: the ledger's columns the picture needs (the republisher writes them all)
LEDGER_COLUMNS = ("batch_id", "outcome", "recorded_time")

#: the ledger's outcomes, in stacking order, with their legend text and colour
_OUTCOMES = (
    ("delivered", "moved to the primary", "#2ca02c"),
    ("reparked", "re-parked (a copy back to the backlog)", "#9467bd"),
    ("dead_lettered", "dead-lettered", "#d62728"),
    ("left", "left for a later batch", "#bbbbbb"),
)
_PRIMARY_COLOUR = "#1f77b4"
_REJECTED_COLOUR = "#7f7f7f"
_OUTAGE_COLOUR = "#d62728"
#: the narrowest syphon bar, as a share of the time axis
_MIN_BAR = 0.012


# --- the inputs, as plain values ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Batch:
    """One row of the metrics table (times in epoch seconds)."""

    batch_id: int
    start: float
    end: float
    primary: int
    backlog: dict[str, int]
    rejected: int
    failovers: int
    failed_over: tuple[str, ...]

    @property
    def backlog_total(self) -> int:
        return sum(self.backlog.values())


@dataclasses.dataclass(frozen=True)
class _Drain:
    """One batch of the ledger: when it was recorded and its messages by outcome."""

    batch_id: int
    time: float
    outcomes: dict[str, int]

    @property
    def moved(self) -> int:
        """Messages that left the backlog queues for good (delivered or dead-lettered)."""
        return self.outcomes.get("delivered", 0) + self.outcomes.get("dead_lettered", 0)


@dataclasses.dataclass(frozen=True)
class OutageSpan:
    """Consecutive sink batches of one outage.

    A batch belongs to an outage when it failed over an entity (``failovers`` or ``assumed_failovers``), left
    one failed over (``failed_over``), or sent rows to a backlog queue. The batch that fails back belongs to it
    only when it still parked rows (its ``backlog``): once the entity is back, its rows went to the primary.

    :ivar first_batch: the outage's first batch id.
    :ivar last_batch: its last batch id.
    :ivar start: when the first batch began (its ``finished_at`` minus its ``seconds``), epoch seconds.
    :ivar end: when the last batch finished, epoch seconds.
    :ivar entities: the entities failed over during the span.
    :ivar backlog_rows: rows the span's batches sent to backlog queues.
    """

    first_batch: int
    last_batch: int
    start: float
    end: float
    entities: tuple[str, ...]
    backlog_rows: int


@dataclasses.dataclass(frozen=True)
class ReportSummary:
    """What a picture shows, in numbers (for the line that says where it was written)."""

    batches: int
    primary: int
    backlog: int
    drained: int
    drain_batches: int
    spans: tuple[OutageSpan, ...]

    def describe(self) -> str:
        outages = "; ".join(f"batch {s.first_batch}" if s.first_batch == s.last_batch
                            else f"batches {s.first_batch}-{s.last_batch}" for s in self.spans) or "none"
        return (f"{_plural(self.batches, 'sink batch', 'sink batches')} ({self.primary} rows to the primary, "
                f"{self.backlog} to backlog queues), outages: {outages}; the syphon moved "
                f"{_plural(self.drained, 'message', 'messages')} in {_plural(self.drain_batches, 'batch', 'batches')}")


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _records(frame: Any, name: str, required: tuple[str, ...]) -> list[dict[str, Any]]:
    """The rows of a pandas DataFrame or an iterable of mappings, as dicts; a clear error naming ``name`` and
    the missing columns."""
    if frame is None:
        raise ConfigError(name, "is required (a DataFrame or a list of rows)")
    if hasattr(frame, "to_dict") and hasattr(frame, "columns"):  # a pandas DataFrame
        rows = [dict(r) for r in frame.to_dict("records")]
        columns = {str(c) for c in frame.columns}
    else:
        rows = []
        for row in frame:
            if not isinstance(row, Mapping):
                raise ConfigError(name, "must be a DataFrame or a list of rows (mappings)",
                                  f"a row of type {type(row).__name__}")
            rows.append(dict(row))
        columns = set.intersection(*(set(r) for r in rows)) if rows else set(required)
    missing = [c for c in required if c not in columns]
    if missing:
        raise ConfigError(name, f"misses the column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                                f"(it needs {', '.join(required)})")
    return rows


def _empty(value: Any) -> bool:
    if value is None:
        return True
    try:
        return bool(value != value)  # NaN, NaT
    except (TypeError, ValueError):  # an array compares element by element
        return False


def _epoch(value: Any, where: str) -> float:
    """Epoch seconds of a time: a datetime (naive ones are UTC), an ISO string, or a number of seconds."""
    if _empty(value):
        raise ConfigError(where, "is empty")
    if isinstance(value, datetime.datetime):
        return (value if value.tzinfo else value.replace(tzinfo=datetime.UTC)).timestamp()
    if isinstance(value, str):
        try:
            return _epoch(datetime.datetime.fromisoformat(value), where)
        except ValueError:
            raise ConfigError(where, "is not a time", repr(value)) from None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(where, "is not a time", repr(value)) from None
    if not math.isfinite(seconds):
        raise ConfigError(where, "is not a time", repr(value))
    return seconds


def _count(value: Any, where: str) -> int:
    if _empty(value):
        return 0
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise ConfigError(where, "is not a count", repr(value)) from None
    if count < 0:
        raise ConfigError(where, "is negative", count)
    return count


def _backlog(value: Any, where: str) -> dict[str, int]:
    """``{queue: rows}`` from a map column (a dict, or the list of pairs Arrow gives)."""
    if isinstance(value, Mapping):
        pairs: Iterable[Any] = value.items()
    elif _empty(value):
        return {}
    else:
        pairs = value
    try:
        return {str(q): _count(n, where) for q, n in pairs if _count(n, where)}
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(where, "is not a map of backlog queue to rows", repr(value)) from None


def _entities(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,) if value else ()
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ()
    return tuple(str(e) for e in value)


def _batches(metrics: Any) -> list[_Batch]:
    rows = _records(metrics, "metrics", METRICS_COLUMNS)
    if not rows:
        raise ConfigError("metrics", "has no rows (no batch wrote a summary)")
    out = []
    for row in rows:
        batch_id = _count(row["batch_id"], "metrics.batch_id")
        where = f"metrics (batch {batch_id})"
        end = _epoch(row["finished_at"], f"{where}.finished_at")
        seconds = float(row.get("seconds") or 0.0) if not _empty(row.get("seconds")) else 0.0
        out.append(_Batch(
            batch_id=batch_id, start=end - max(0.0, seconds), end=end,
            primary=_count(row["primary"], f"{where}.primary"),
            backlog=_backlog(row["backlog"], f"{where}.backlog"),
            rejected=_count(row.get("rejected"), f"{where}.rejected"),
            failovers=_count(row["failovers"], f"{where}.failovers")
            + _count(row.get("assumed_failovers"), f"{where}.assumed_failovers"),
            failed_over=_entities(row["failed_over"])))
    out.sort(key=lambda b: (b.end, b.batch_id))
    return out


def _drains(ledger: Any) -> list[_Drain]:
    rows = _records(ledger, "ledger", LEDGER_COLUMNS)
    times: dict[int, float] = {}
    outcomes: dict[int, dict[str, int]] = {}
    for row in rows:
        batch_id = _count(row["batch_id"], "ledger.batch_id")
        where = f"ledger (batch {batch_id})"
        at = _epoch(row["recorded_time"], f"{where}.recorded_time")
        times[batch_id] = max(times.get(batch_id, at), at)
        n = _count(row["messages"], f"{where}.messages") if "messages" in row else 1
        counts = outcomes.setdefault(batch_id, {})
        outcome = str(row["outcome"])
        counts[outcome] = counts.get(outcome, 0) + n
    return sorted((_Drain(b, times[b], outcomes[b]) for b in times), key=lambda d: (d.time, d.batch_id))


def _spans(batches: list[_Batch]) -> list[OutageSpan]:
    spans: list[OutageSpan] = []
    current: list[_Batch] = []
    entities: dict[str, None] = {}

    def close() -> None:
        if current:
            spans.append(OutageSpan(current[0].batch_id, current[-1].batch_id, current[0].start, current[-1].end,
                                    tuple(entities), sum(b.backlog_total for b in current)))
            current.clear()
            entities.clear()

    for batch in batches:
        if batch.failovers or batch.failed_over or batch.backlog_total:
            current.append(batch)
            entities.update(dict.fromkeys(batch.failed_over))
        else:
            close()
    close()
    return spans


def outage_spans(metrics: Any) -> list[OutageSpan]:
    """The outages the metrics table records, in time order (see :class:`OutageSpan` for which batches count).
    ``metrics``: a pandas DataFrame or a list of dicts with the metrics table's columns."""
    return _spans(_batches(metrics))


# --- the drawing -------------------------------------------------------------------------------------------


def _unit(span_seconds: float) -> tuple[float, str]:
    if span_seconds <= 300:
        return 1.0, "s"
    if span_seconds <= 300 * 60:
        return 60.0, "min"
    return 3600.0, "h"


def _width(times: list[float], scale: float) -> float:
    """A bar width: 0.75 of a short gap between consecutive batches (the fifth of the gaps that is shortest: a
    run of fast batches stays bars apart), 1 s when there is one batch."""
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False) if b > a)
    return 0.75 * (gaps[len(gaps) // 5] if gaps else 1.0) / scale


def _queue_label(queue: str) -> str:
    return f"backlog queue {queue}"


def draw_outage(metrics: Any, ledger: Any = (), *, title: str | None = None) -> Any:
    """The picture (a matplotlib ``Figure`` on the Agg canvas) of ``metrics`` (the sink's metrics table) and
    ``ledger`` (the syphon's ledger; empty when nothing was parked): pandas DataFrames or lists of dicts (see
    the module docstring for the columns). Raises :class:`~spark_sb.errors.ConfigError` naming ``metrics`` or
    ``ledger`` and the missing column or bad value."""
    figure, _ = _draw(_batches(metrics), _drains(ledger), title)
    return figure


def save_outage(metrics: Any, ledger: Any, out: str | Path, *, title: str | None = None) -> ReportSummary:
    """Draw :func:`draw_outage` into the PNG file ``out`` and say what it shows."""
    batches, drains = _batches(metrics), _drains(ledger)
    figure, summary = _draw(batches, drains, title)
    figure.savefig(str(out), format="png", dpi=110)
    _LOGGER.info("wrote %s: %s", out, summary.describe())
    return summary


def _draw(batches: list[_Batch], drains: list[_Drain], title: str | None) -> tuple[Any, ReportSummary]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    spans = _spans(batches)
    t0 = min([b.start for b in batches] + [d.time for d in drains])
    t_end = max([b.end for b in batches] + [d.time for d in drains])
    scale, unit = _unit(t_end - t0)

    def x(t: float) -> float:
        return (t - t0) / scale

    figure = Figure(figsize=(11, 7.5), layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2))

    # the sink: one stacked bar per batch, ending when the batch finished
    width = _width([b.end for b in batches], scale)
    # the syphon's bars: as wide as the sink's, or as a short gap between its own batches, and never narrower than
    # a visible share of the axis (one drain minutes after a run of 1 s batches would be a pixel wide)
    axis = x(t_end) - x(min([b.end for b in batches] + [d.time for d in drains])) + 4 * width
    dwidth = width if len(drains) < 2 else min(width, _width([d.time for d in drains], scale))
    if drains and dwidth < _MIN_BAR * axis:
        drain_times = sorted(x(d.time) for d in drains)
        room = min((b - a for a, b in zip(drain_times, drain_times[1:], strict=False) if b > a), default=axis)
        dwidth = max(dwidth, min(_MIN_BAR * axis, 0.75 * room))
    xmin = x(min([b.end for b in batches] + [d.time for d in drains])) - 1.5 * width
    # room to see the backlog back at 0 after the last drain
    xmax = x(t_end) + max(2.5 * width, 1.5 * dwidth if drains else 0.0)
    xs = [x(b.end) - width for b in batches]
    queues = sorted({q for b in batches for q in b.backlog})
    bottoms = [0.0] * len(batches)
    layers: list[tuple[str, Any, list[int]]] = [("the primary", _PRIMARY_COLOUR, [b.primary for b in batches])]
    from matplotlib import colormaps

    oranges = colormaps["Oranges"]
    for i, queue in enumerate(queues):
        shade = oranges(0.45 + 0.4 * (i / max(1, len(queues) - 1)))
        layers.append((_queue_label(queue), shade, [b.backlog.get(queue, 0) for b in batches]))
    if any(b.rejected for b in batches):
        layers.append(("rejected (reject_table)", _REJECTED_COLOUR, [b.rejected for b in batches]))
    for label, colour, heights in layers:
        top.bar(xs, heights, width=width, bottom=bottoms, color=colour, label=label, align="edge")
        bottoms = [a + h for a, h in zip(bottoms, heights, strict=True)]

    # the outage, shaded over both panels from its first bar to its last
    by_id = {b.batch_id: b for b in batches}
    for span in spans:
        left = min(x(span.start), x(by_id[span.first_batch].end) - width) - 0.1 * width
        right = max(x(span.end), x(by_id[span.last_batch].end)) + 0.1 * width
        for axes in (top, bottom):
            axes.axvspan(left, right, color=_OUTAGE_COLOUR, alpha=0.12, linewidth=0)
        what = ", ".join(span.entities) or "the primary"
        # the label over the span's middle, or along its inner edge when the span is near an end of the axis
        middle = ((left + right) / 2 - xmin) / (xmax - xmin)
        anchor, align = ((left, "left") if middle < 0.15 else (right, "right") if middle > 0.85
                         else ((left + right) / 2, "center"))
        span_batches = (f"batch {span.first_batch}" if span.first_batch == span.last_batch
                        else f"batches {span.first_batch}-{span.last_batch}")
        top.annotate(f"outage: {span_batches}\n{what} failed over\n"
                     f"{span.backlog_rows} rows parked", xy=(anchor, 1.0), xycoords=("data", "axes fraction"),
                     xytext=(0, -6), textcoords="offset points", ha=align, va="top", fontsize=9,
                     color="#8b0000")
    top.set_ylim(0, max(bottoms + [1]) * 1.3)
    top.set_ylabel("rows per batch (messages)")
    top.set_title("The paired sink: where each batch's rows went", loc="left", fontsize=11)
    handles, labels = top.get_legend_handles_labels()
    if spans:
        handles.append(Patch(color=_OUTAGE_COLOUR, alpha=0.12, label="outage (an entity failed over)"))
        labels.append("outage (an entity failed over)")
    top.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    top.grid(axis="y", alpha=0.3)

    # the syphon: messages per ledger batch by outcome, and what is still parked
    if drains:
        dxs = [x(d.time) - dwidth for d in drains]
        dbottoms = [0.0] * len(drains)
        known = [o for o, _, _ in _OUTCOMES]
        others = sorted({o for d in drains for o in d.outcomes} - set(known))
        for outcome, label, colour in [*_OUTCOMES, *((o, o, "#444444") for o in others)]:
            heights = [d.outcomes.get(outcome, 0) for d in drains]
            if any(heights):
                # over the backlog line, whose drop at the drain's time would otherwise hide a narrow bar
                bottom.bar(dxs, heights, width=dwidth, bottom=dbottoms, color=colour, label=label, align="edge",
                           zorder=2.5)
                dbottoms = [a + h for a, h in zip(dbottoms, heights, strict=True)]
    else:
        bottom.text(0.5, 0.5, "the ledger records no messages (nothing was parked, or the syphon has not run)",
                    transform=bottom.transAxes, ha="center", va="center", color="#555555")
    # waiting in the backlog queues: rows the sink parked minus messages the syphon moved, over time
    events = sorted([(b.end, b.backlog_total) for b in batches if b.backlog_total]
                    + [(d.time, -d.moved) for d in drains if d.moved])
    if events:
        level, steps_x, steps_y = 0, [0.0], [0]
        for at, delta in events:
            level = max(0, level + delta)
            steps_x.append(x(at))
            steps_y.append(level)
        steps_x.append(xmax)
        steps_y.append(level)
        bottom.step(steps_x, steps_y, where="post", color="#ff7f0e", linewidth=2,
                    label="waiting in the backlog queues (parked - moved)")
    bottom.set_ylabel("messages")
    bottom.set_title("The syphon: backlog messages moved home, per syphon batch", loc="left", fontsize=11)
    if drains or events:
        bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
        bottom.set_ylim(0, bottom.get_ylim()[1] * 1.1)
    bottom.grid(axis="y", alpha=0.3)
    start = datetime.datetime.fromtimestamp(t0, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    bottom.set_xlabel(f"time since the first batch began ({unit}); it began at {start}")
    bottom.set_xlim(xmin, xmax)

    summary = ReportSummary(
        batches=len(batches), primary=sum(b.primary for b in batches),
        backlog=sum(b.backlog_total for b in batches), drained=sum(d.moved for d in drains),
        drain_batches=len(drains), spans=tuple(spans))
    if title is None:
        title = ("An outage: rows parked in backlog queues while the primary was failed over, then moved home"
                 if spans else "No outage: every batch went to the primary")
    figure.suptitle(title, fontsize=13, fontweight="bold")
    return figure, summary


# --- the Spark edge ----------------------------------------------------------------------------------------


def read_delta(spark: Any, value: str, option: str) -> Any:
    """The DataFrame of ``value``: a Delta table at a path (``value`` has a ``/`` or a scheme) or a catalog
    table (a name). A clear :class:`~spark_sb.errors.ConfigError` naming ``option`` when there is none."""
    from . import tables

    try:
        df = tables.read(spark, value)
    except Exception as err:  # a name Spark cannot parse
        raise ConfigError(option, "is not a table name (a path needs a '/' or a scheme)", repr(value)) from err
    if df is None and tables.is_path(value):
        raise ConfigError(option, "no Delta table at this path", value)
    if df is None:
        raise ConfigError(option, "no such table (a path needs a '/' or a scheme)", value)
    return df


def _check_columns(df: Any, required: tuple[str, ...], option: str, value: str, what: str) -> None:
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise ConfigError(option, f"{value} is not {what}: it misses the column{'s' if len(missing) > 1 else ''} "
                                  f"{', '.join(missing)}")


def write_report(spark: Any, metrics: str, ledger: str, out: str | Path, *, title: str | None = None,
                 options: tuple[str, str] = ("--metrics", "--ledger")) -> ReportSummary:
    """Read the metrics table and the ledger (paths or table names) with ``spark`` and draw the PNG ``out``.
    Errors name ``options`` (the command line's, by default) and the value."""
    from pyspark.sql import functions as F

    metrics_df = read_delta(spark, metrics, options[0])
    _check_columns(metrics_df, METRICS_COLUMNS, options[0], metrics, "a metrics table (sink.metrics_table)")
    ledger_df = read_delta(spark, ledger, options[1])
    _check_columns(ledger_df, LEDGER_COLUMNS, options[1], ledger, "a syphon ledger (syphon.ledger)")
    # times as epoch seconds: no session time zone between the table and the picture
    wanted = [c for c in ("seconds", "rejected", "assumed_failovers") if c in metrics_df.columns]
    metric_rows = [r.asDict() for r in metrics_df.select(
        *[F.col(c) for c in METRICS_COLUMNS if c != "finished_at"], *wanted,
        F.col("finished_at").cast("double").alias("finished_at")).collect()]
    if not metric_rows:
        raise ConfigError(options[0], "the metrics table has no rows", metrics)
    ledger_rows = [r.asDict() for r in ledger_df.groupBy("batch_id", "outcome").agg(
        F.max(F.col("recorded_time").cast("double")).alias("recorded_time"),
        F.count(F.lit(1)).alias("messages")).collect()]
    try:
        return save_outage(metric_rows, ledger_rows, out, title=title)
    except ConfigError as err:
        option, value = (options[0], metrics) if err.option.startswith("metrics") else (options[1], ledger)
        raise ConfigError(option, f"{value}: {err}") from err
