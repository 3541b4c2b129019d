"""The Spark sink: ``df.writeStream.foreachBatch(PairedSink.from_config("conf/local.yaml"))``.

Every batch is sent from the executors, never collected to the driver: the driver checks the batch's schema,
then runs one ``mapInArrow`` over the mapped columns. Each partition sends its rows through the paired sender of
its Python worker process (one per configuration, kept in a process-level registry, reused by
every task and batch that process runs) and returns one small summary row; the driver collects the summaries
only, logs one line per batch, keeps :attr:`PairedSink.latest` and :attr:`PairedSink.totals`, and optionally
appends the summary to a Delta metrics table. ``mapInArrow`` exists under Spark Connect; the RDD API is never
used.

Columns (names configurable with ``sink.columns``; spark.md "Input columns"):

========================== =================================================================================
field                      column type
========================== =================================================================================
body (required)            string or binary
message_id / key_column    string or integer; else derived (below)
entity                     string; null or absent: ``sink.entity``
session_id, partition_key, string
subject, content_type,
correlation_id, to,
reply_to
time_to_live               day-time interval, or a number of seconds (integer or floating point)
time_to_live_ms            integer: milliseconds (the ``servicebus`` source's column; its name is fixed).
                           Not together with time_to_live
scheduled_enqueue_time     timestamp (or timestamp_ntz, read as UTC)
application_properties     map<string, string|integer|floating point|boolean|binary|timestamp>
application_property_types map<string, string>: each property's AMQP type (the ``servicebus`` source's column;
                           its name is fixed), with application_properties as map<string, string>
========================== =================================================================================

A column of another type fails the batch on the driver before anything is sent (:class:`BadInputError` naming
the batch, the column and its type), with or without a reject table.

**Property types**: with ``application_property_types`` (what the ``servicebus`` source reads beside each row's
properties, e.g. ``{"p": "int", "at": "timestamp"}``), each property's text is sent as that type
(:func:`spark_sb.messages.property_value`: ``string``, ``symbol``, ``binary`` (base64), ``boolean``, ``byte``,
``short``, ``int``, ``long``, ``ubyte``, ``ushort``, ``uint``, ``ulong``, ``float``, ``double``, ``decimal128``,
``timestamp`` (milliseconds since the epoch, or ISO 8601), ``uuid``, and ``described:<descriptor>:<one of these>``,
e.g. .NET's DateTimeOffset); a property it does not name is a string. A text that is not of its type (``five`` for
an ``int``), or a type that cannot be sent from text (``list``, ``map``, ``described``...), makes the row a bad row
whose reason names the property: it is never sent as another type. So a row read from a queue or a dead-letter
queue and written back is the message it was: the same fields, TTL (``time_to_live_ms``) and property types.

**Message ids** are the key column's value, else ``<batch id>-<partition>-<hash>-<n>``: a hash of the row's
mapped values, and ``n`` the row's occurrence number among identical rows of its partition. A replayed batch
produces the same ids **provided it has the same partitioning**, which holds for the sources whose batches are
replayed from recorded offsets (rate, Kafka, files, Delta): Spark replays a batch with the same offsets and the
same partitions. (A repartition by a non-deterministic expression in the query breaks it; use a key column
then.) With duplicate detection on the primary entity a replayed row is then dropped there.

**Bad rows** (null body, null key, no entity, a value the SDK cannot encode, a message over the entity's size
limit, an entity that does not exist): without ``sink.reject_table`` the partition raises
:class:`BadInputError` naming the batch, the entity and the message id, and the batch fails; with it, each bad
row goes to that Delta table (batch id, message id, entity, reason, body) and the rest is sent. Rows of a
message over the size limit are found by sending: the paired sender sends nothing of a call that holds one,
so the call is repeated without it. The batch fails whenever a row was neither sent nor rejected, so the
checkpoint never moves past such a row; rows sent before a failure are sent again on replay, with the same
message ids.

**Replication** (``replication.mode: active | passive``): the sink sends through a
:class:`~spark_sb.replication.ReplicatingSender` instead: each summary counts the copies each namespace
accepted (``primary``, ``secondary``; in active mode a row counts on both) and the rows accepted by at least one
(``sent``), and passive mode's role swaps (``swaps``). A batch that neither namespace accepted fails with
:class:`~spark_sb.errors.ReplicationError` and is replayed from the checkpoint; the message ids are the same, so
the receiving side (:func:`spark_sb.dedupe`) drops the copies a replay sends again.

**Health**: every summary carries the state of the entities its partition sent to; an entity that some
partition left failed over, and none left healthy, is passed to the next batch's partitions, whose workers then
start it failed over (:meth:`~spark_sb.bus.health.HealthBoard.assume_failed_over`, with a ping due at once)
instead of each waiting out the failover interval.

Under Spark Connect the callable runs in one server-side Python process for the query's life: ``latest`` and
``totals`` live there, not on the client's object; read the log or the metrics table.

The registry closes its senders at interpreter exit (``atexit``). PySpark's forked Python workers end with
``os._exit``, which skips ``atexit``: their sockets are closed by the operating system when the worker ends.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, wait
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from azure.servicebus import ServiceBusMessage
from azure.servicebus._pyamqp.utils import amqp_long_value
from pyspark.errors import PySparkNotImplementedError
from pyspark.sql import functions as F
from pyspark.sql import types as T

from . import bus, tables, wire
from . import messages as msgs
from .capabilities import warn_if_speculating
from .config import SinkConfig, SparkSbConfig, load_config, unsendable
from .errors import ENCODING_ERRORS, BadInputError, BadMessageError, EntityNotFoundError
from .paired import PRIMARY, PairedSender, SendResult
from .paired.sender import pairing_key
from .replication.sender import SECONDARY, ReplicatingSender, ReplicationResult

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

_LOGGER = logging.getLogger(__name__)

__all__ = ["COUNTERS", "METRICS_SCHEMA", "PARTITION_OUTPUT", "BatchSummary", "PairedSink", "PartitionRun", "check_columns",
           "check_unaccounted", "close_senders", "log_to_stderr_unless_configured", "merge_summaries", "sender_for"]

# --- the per-process registry of paired senders -----------------------------------------------------------

#: the kind of the paired senders in the process registry (:func:`spark_sb.bus.shared`), keyed by pairing
SENDER_KIND = "paired-sender"


def sender_for(config: SparkSbConfig, fingerprint: str | None = None) -> PairedSender | ReplicatingSender:
    """The sender of this process for ``config`` (whose fingerprint is ``fingerprint``): a paired sender
    (``replication.mode: paired``, created on first use, its backlog queues provisioned when the backlog is first
    needed) or a replicating sender (active or passive);
    then reused by every task and batch this process runs; closed at interpreter exit.

    A worker outlives a query: a sender of the same pairing built from an older configuration (other
    intervals) would make the new one refuse to share the pairing's health, so one sender per pairing is kept
    and a new configuration replaces (and closes) the sender of the old one."""
    key = fingerprint or config.fingerprint()

    def build() -> PairedSender | ReplicatingSender:
        if config.replication.replicating:
            replicating = ReplicatingSender(config)
            _LOGGER.info("process %d: %s replicating sender ready", os.getpid(), config.replication.mode)
            return replicating
        # not paired here: a healthy primary never needs the secondary, so a worker starts sending while the
        # secondary is unreachable; the backlog queues are provisioned when the backlog is first needed
        sender = PairedSender(config)
        _LOGGER.info("process %d: paired sender ready (backlog queues provisioned when first needed)", os.getpid())
        return sender

    def outdated(old: PairedSender | ReplicatingSender) -> bool:
        if old.config.fingerprint() == key:
            return False
        _LOGGER.info("process %d: a new configuration of %s replaces the sender of the old one",
                     os.getpid(), old.config.send_availability.backlog_prefix)
        return True

    return bus.shared(SENDER_KIND, pairing_key(config), build, replace_if=outdated)


def close_senders() -> None:
    """Close every sender of the registry (idempotent)."""
    bus.close_all(SENDER_KIND)


# --- summaries ---------------------------------------------------------------------------------------------

#: ``sent``: rows accepted (by the primary or a backlog queue; in active and passive replication, by at least one
#: namespace); ``primary`` and ``secondary``: copies each namespace accepted (``secondary`` only in replication,
#: where an active-mode row counts on both); ``swaps``: passive replication's role swaps
COUNTERS = ("rows", "sent", "primary", "secondary", "rejected", "failovers", "failbacks", "busy_waits",
             "assumed_failovers", "swaps")

#: what each partition returns: one ``summary`` row, and a ``reject`` row per rejected row
PARTITION_OUTPUT = T.StructType(
    [T.StructField("kind", T.StringType()), T.StructField("partition", T.IntegerType())]
    + [T.StructField(name, T.LongType()) for name in COUNTERS]
    + [
        T.StructField("backlog", T.MapType(T.StringType(), T.LongType())),
        T.StructField("health", T.MapType(T.StringType(), T.StringType())),
        T.StructField("seconds", T.DoubleType()),
        T.StructField("message_id", T.StringType()),
        T.StructField("entity", T.StringType()),
        T.StructField("reason", T.StringType()),
        T.StructField("body", T.BinaryType()),
    ]
)
_ARROW_OUTPUT = pa.schema(
    [pa.field("kind", pa.string()), pa.field("partition", pa.int32())]
    + [pa.field(name, pa.int64()) for name in COUNTERS]
    + [
        pa.field("backlog", pa.map_(pa.string(), pa.int64())),
        pa.field("health", pa.map_(pa.string(), pa.string())),
        pa.field("seconds", pa.float64()),
        pa.field("message_id", pa.string()),
        pa.field("entity", pa.string()),
        pa.field("reason", pa.string()),
        pa.field("body", pa.binary()),
    ]
)
METRICS_SCHEMA = T.StructType(
    [T.StructField("batch_id", T.LongType()), T.StructField("finished_at", T.TimestampType())]
    + [T.StructField(name, T.LongType()) for name in COUNTERS]
    + [
        T.StructField("backlog", T.MapType(T.StringType(), T.LongType())),
        T.StructField("failed_over", T.ArrayType(T.StringType())),
        T.StructField("partitions", T.IntegerType()),
        T.StructField("seconds", T.DoubleType()),
    ]
)


@dataclass
class BatchSummary:
    """Where a batch's rows went (or, for :attr:`PairedSink.totals`, every batch's so far).

    :ivar sent: rows accepted (see ``COUNTERS``).
    :ivar primary: copies the primary accepted.
    :ivar secondary: copies the secondary accepted (active and passive replication only).
    :ivar backlog: ``{backlog queue: rows}``.
    :ivar failed_over: entities left failed over after the batch (passed to the next batch).
    :ivar batches: how many batches are summed (1 for one batch).
    """

    batch_id: int | None = None
    rows: int = 0
    sent: int = 0
    primary: int = 0
    secondary: int = 0
    backlog: dict[str, int] = field(default_factory=dict)
    rejected: int = 0
    failovers: int = 0
    failbacks: int = 0
    busy_waits: int = 0
    assumed_failovers: int = 0
    swaps: int = 0
    failed_over: tuple[str, ...] = ()
    partitions: int = 0
    seconds: float = 0.0
    batches: int = 0

    @property
    def backlog_total(self) -> int:
        return sum(self.backlog.values())

    def add(self, other: BatchSummary) -> None:
        """Add ``other``'s counts to these (for running totals)."""
        for name in (*COUNTERS, "partitions", "batches"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for queue, n in other.backlog.items():
            self.backlog[queue] = self.backlog.get(queue, 0) + n
        self.seconds += other.seconds
        self.batch_id = other.batch_id
        self.failed_over = other.failed_over

    def describe(self) -> str:
        """One line: ``120 rows: 80 -> primary, 40 -> backlog (x-servicebus-transfer/1: 40), 0 rejected...``."""
        parts = [f"{self.rows} rows: {self.primary} -> primary"]
        if self.secondary:
            parts.append(f"{self.secondary} -> secondary")
        if self.backlog:
            queues = ", ".join(f"{q}: {n}" for q, n in sorted(self.backlog.items()))
            parts.append(f"{self.backlog_total} -> backlog ({queues})")
        parts.append(f"{self.rejected} rejected")
        parts.append(f"failovers {self.failovers}, failbacks {self.failbacks}, busy waits {self.busy_waits}"
                     if not (self.secondary or self.swaps) else f"swaps {self.swaps}, busy waits {self.busy_waits}")
        if self.failed_over:
            parts.append(f"failed over: {', '.join(self.failed_over)}")
        return ", ".join(parts) + f" [{self.seconds:.1f} s]"


# --- the driver side ---------------------------------------------------------------------------------------

_STRING_FIELDS = ("entity", "session_id", "partition_key", "subject", "content_type", "correlation_id", "to",
                  "reply_to")
_INTEGRAL = (T.ByteType, T.ShortType, T.IntegerType, T.LongType)
_PROPERTY_VALUES = (T.StringType, T.BooleanType, T.FloatType, T.DoubleType, T.BinaryType, T.TimestampType,
                    T.TimestampNTZType, *_INTEGRAL)


#: message fields whose column has the field's own name (not configurable with ``sink.columns``): what the
#: ``servicebus`` source reads beside the fields above, taken when a batch has them
_READ_FIELDS = ("time_to_live_ms", "application_property_types")


def _text_map(data_type: T.DataType) -> bool:
    return (isinstance(data_type, T.MapType) and isinstance(data_type.keyType, T.StringType)
            and isinstance(data_type.valueType, T.StringType))


def _type_ok(name: str, data_type: T.DataType) -> tuple[bool, str]:
    """Whether ``data_type`` fits message field ``name``, and what is expected."""
    if name == "body":
        return isinstance(data_type, T.StringType | T.BinaryType), "string or binary"
    if name == "message_id":
        return isinstance(data_type, (T.StringType, *_INTEGRAL)), "string or an integer type"
    if name in _STRING_FIELDS:
        return isinstance(data_type, T.StringType), "string"
    if name == "time_to_live":
        ok = isinstance(data_type, (T.DayTimeIntervalType, T.FloatType, T.DoubleType, *_INTEGRAL))
        return ok, "a day-time interval or a number of seconds"
    if name == "time_to_live_ms":
        return isinstance(data_type, _INTEGRAL), "an integer number of milliseconds"
    if name == "scheduled_enqueue_time":
        return isinstance(data_type, T.TimestampType | T.TimestampNTZType), "timestamp"
    if name == "application_property_types":
        return _text_map(data_type), "map<string, string>"
    ok = (isinstance(data_type, T.MapType) and isinstance(data_type.keyType, T.StringType)
          and isinstance(data_type.valueType, _PROPERTY_VALUES))
    return ok, "map<string, string|integer|floating point|boolean|binary|timestamp>"


def _typed_column(name: str, found: T.StructField, refuse: Callable[[str | None, str | None, str], Exception]
                  ) -> str:
    """The name of column ``found``, when its type suits message field ``name``; else ``refuse``'s error."""
    ok, expected = _type_ok(name, found.dataType)
    if not ok:
        raise refuse(None, found.name, f"has type {found.dataType.simpleString()}, message field {name} "
                     f"needs {expected}; nothing was sent")
    return found.name


def check_columns(sink: SinkConfig, schema: T.StructType,
                  refuse: Callable[[str | None, str | None, str], Exception]) -> dict[str, str]:
    """``{message field: column}`` for the fields ``schema`` carries under ``sink``'s column mapping, after
    checking their types. A problem raises ``refuse(option, column, problem)``: the option that names the
    missing column (the problem says ``(option)`` where it belongs), the column, and what is wrong; nothing
    has been sent then."""
    by_name = {f.name: f for f in schema.fields}
    by_lower = {name.lower(): f for name, f in by_name.items()}
    explicit = set(sink.columns) | ({"message_id"} if sink.key_column else set())
    present: dict[str, str] = {}
    for name, column in sink.column_map.items():
        found = by_name.get(column) or by_lower.get(column.lower())
        if found is None:
            if name in explicit or name == "body":
                option = "sink.key_column" if name == "message_id" and sink.key_column else f"sink.columns.{name}"
                raise refuse(option, column, f"column not found for message field {name} (option); "
                             f"the batch has {', '.join(by_name) or 'no columns'}")
            continue
        present[name] = _typed_column(name, found, refuse)
    for name in _READ_FIELDS:
        found = by_name.get(name) or by_lower.get(name)
        if found is None or found.name in present.values():  # absent, or mapped to another field by sink.columns
            continue
        present[name] = _typed_column(name, found, refuse)
    if "time_to_live" in present and "time_to_live_ms" in present:
        raise refuse(None, present["time_to_live_ms"], f"and column {present['time_to_live']!r} both give the "
                     "message's TTL (time_to_live_ms in milliseconds, time_to_live in seconds or as an interval): "
                     "keep one; nothing was sent")
    properties = next((f for f in schema.fields if f.name == present.get("application_properties")), None)
    if "application_property_types" in present and properties is not None and not _text_map(properties.dataType):
        raise refuse(None, properties.name, f"has type {properties.dataType.simpleString()}: with column "
                     f"{present['application_property_types']!r} (each property's type) the application "
                     "properties must be their text, map<string, string>; nothing was sent")
    if "entity" not in present and sink.entity is None:
        raise refuse("sink.entity", None, f"no entity: the batch has no entity column ({sink.column_map['entity']!r}) "
                     "and sink.entity is not set")
    return present


def merge_summaries(batch_id: int, rows: Iterable[Any], seconds: float, health: Mapping[str, str] | None = None
                    ) -> tuple[BatchSummary, dict[str, str]]:
    """The batch's :class:`BatchSummary` from its partitions' summary rows (rows or dicts; other kinds are
    skipped), and the entity health after it: ``health`` (the last batch's) updated with what the partitions
    saw. An entity is failed over when some partition left it failed over and none saw it healthy."""
    summary = BatchSummary(batch_id=int(batch_id), seconds=seconds, batches=1)
    states: dict[str, set[str]] = {}
    for row in rows:
        if row["kind"] != "summary":
            continue
        summary.partitions += 1
        for name in COUNTERS:
            setattr(summary, name, getattr(summary, name) + int(row[name] or 0))
        for queue, n in (row["backlog"] or {}).items():
            summary.backlog[queue] = summary.backlog.get(queue, 0) + int(n)
        for entity, state in (row["health"] or {}).items():
            states.setdefault(entity, set()).add(state)
    merged = dict(health or {})
    for entity, seen in states.items():
        if "failed_over" in seen and "healthy" not in seen:
            merged[entity] = "failed_over"
        elif "healthy" in seen:
            merged[entity] = "healthy"
        else:
            merged[entity] = sorted(seen)[0]
    summary.failed_over = tuple(sorted(e for e, state in merged.items() if state == "failed_over"))
    return summary, merged


def check_unaccounted(summary: BatchSummary) -> None:
    """Fail the batch when some of its rows were neither sent nor rejected (the checkpoint must not move past
    them)."""
    unaccounted = summary.rows - summary.sent - summary.rejected
    if unaccounted:
        raise RuntimeError(f"batch {summary.batch_id}: {unaccounted} rows neither sent nor rejected; the batch "
                           "fails and is replayed from the checkpoint")


class PairedSink:
    """The ``foreachBatch`` callable: ``query = df.writeStream.foreachBatch(PairedSink.from_config(conf))``.

    Picklable (it holds the configuration, the latest summary, the running totals and the entity health).

    :ivar latest: the :class:`BatchSummary` of the last batch (``None`` before the first).
    :ivar totals: every batch's counts summed (``batches`` counts them).
    :ivar health: ``{entity: state}`` merged from the last batch's partitions.
    """

    def __init__(self, config: SparkSbConfig) -> None:
        self.config = config
        self.fingerprint = config.fingerprint()
        self.latest: BatchSummary | None = None
        self.totals = BatchSummary()
        self.health: dict[str, str] = {}
        self._speculation_checked = False

    @classmethod
    def from_config(cls, source: str | os.PathLike[str] | Mapping[str, Any] | SparkSbConfig) -> PairedSink:
        """From a YAML path, a dict or a :class:`SparkSbConfig` (the ``sink:`` section configures it)."""
        return cls(load_config(source))

    def __repr__(self) -> str:
        return (f"PairedSink(primary={self.config.primary.fully_qualified_namespace!r}, "
                f"entity={self.config.sink.entity!r}, batches={self.totals.batches})")

    @property
    def failed_over(self) -> tuple[str, ...]:
        return tuple(sorted(e for e, state in self.health.items() if state == "failed_over"))

    def columns(self, batch_df: DataFrame, batch_id: int) -> dict[str, str]:
        """``{message field: column}`` for the fields this batch carries, after checking their types; raises
        :class:`BadInputError` naming the batch, the column and its type."""

        def refuse(option: str | None, column: str | None, problem: str) -> Exception:
            if option is not None:
                problem = problem.replace("(option)", f"({option})")
            return BadInputError(batch_id, problem, column=column)

        return check_columns(self.config.sink, batch_df.schema, refuse)

    def __call__(self, batch_df: DataFrame, batch_id: int) -> None:
        """``foreachBatch``'s function: :meth:`send_batch` (its summary is :attr:`latest`; PySpark's
        ``foreachBatch`` takes a function that returns nothing, so ``foreachBatch(sink)`` type-checks)."""
        self.send_batch(batch_df, batch_id)

    def send_batch(self, batch_df: DataFrame, batch_id: int) -> BatchSummary:
        """Send ``batch_df`` as batch ``batch_id`` from the executors and return what happened to its rows
        (also in :attr:`latest`, and added to :attr:`totals`). Raises when a row could be neither sent nor
        rejected (the batch is then replayed from the checkpoint when the query restarts)."""
        started = time.monotonic()
        sink = self.config.sink
        if type(batch_df).__module__.startswith("pyspark.sql.connect"):
            log_to_stderr_unless_configured()
        present = self.columns(batch_df, batch_id)
        if not self._speculation_checked:
            self._speculation_checked = True
            warn_if_speculating(batch_df.sparkSession)
        selected = batch_df.select(*[F.col(_quote(column)).alias(name) for name, column in present.items()])
        send = _partition_sender(self.config, self.fingerprint, int(batch_id), self.failed_over,
                                 reject=sink.reject_table is not None)
        output = selected.mapInArrow(send, PARTITION_OUTPUT)
        try:
            if sink.reject_table is None:
                rows = output.collect()
                rejected_rows = 0
            else:
                # computed (and so sent) exactly once, then read twice: the summaries and the rejected rows
                try:
                    done = output.localCheckpoint(eager=True)
                except PySparkNotImplementedError:  # Spark Connect 3.5: computed once, held by the driver
                    done = batch_df.sparkSession.createDataFrame(output.collect(), PARTITION_OUTPUT)
                rows = done.filter(F.col("kind") == "summary").collect()
                rejected_rows = self._write_rejects(done, batch_id)
        except Exception:
            _LOGGER.error("batch %s failed; it is replayed from the checkpoint when the query restarts", batch_id)
            raise
        summary = self._merge(batch_id, rows, time.monotonic() - started)
        if summary.rejected != rejected_rows and sink.reject_table is not None:
            raise RuntimeError(f"batch {batch_id}: {summary.rejected} rows rejected but {rejected_rows} written "
                               f"to {sink.reject_table}")
        check_unaccounted(summary)
        self.latest = summary
        self.totals.add(summary)
        _LOGGER.info("batch %s: %s", batch_id, summary.describe())
        if sink.metrics_table is not None:
            self._write_metrics(batch_df, summary)
        return summary

    def _merge(self, batch_id: int, rows: Iterable[Any], seconds: float) -> BatchSummary:
        summary, self.health = merge_summaries(batch_id, rows, seconds, self.health)
        return summary

    def _write_rejects(self, done: DataFrame, batch_id: int) -> int:
        rejects = done.filter(F.col("kind") == "reject").select(
            F.lit(int(batch_id)).cast("long").alias("batch_id"), "partition", "message_id", "entity", "reason",
            "body", F.current_timestamp().alias("rejected_at"))
        count = rejects.count()
        if count:
            location = str(self.config.sink.reject_table)
            tables.append(rejects, location)
            _LOGGER.warning("batch %s: %d rejected rows written to %s", batch_id, count, location)
        return count

    def _write_metrics(self, batch_df: DataFrame, summary: BatchSummary) -> None:
        values = asdict(summary)
        row = [int(summary.batch_id or 0), datetime.datetime.now(datetime.UTC)]
        row += [values[name] for name in COUNTERS]
        row += [dict(summary.backlog), list(summary.failed_over), summary.partitions, summary.seconds]
        spark = batch_df.sparkSession
        tables.append(spark.createDataFrame([tuple(row)], METRICS_SCHEMA), str(self.config.sink.metrics_table),
                      merge_schema=True)


def log_to_stderr_unless_configured() -> None:
    """Under Spark Connect the foreachBatch function runs in a Python process of the server, whose logging the
    user cannot configure: when nothing configured it, spark_sb's INFO lines (the batch summaries) go to its
    stderr, which is the server's log."""
    package = logging.getLogger("spark_sb")
    if logging.getLogger().handlers or package.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)


def _quote(column: str) -> str:
    return "`" + column.replace("`", "``") + "`"


# --- the executor side -------------------------------------------------------------------------------------

_REJECT_FLUSH = 1000
#: the sender counters each worker's last partition summary reported (per sender of the registry)
_REPORTED: weakref.WeakKeyDictionary[PairedSender | ReplicatingSender, dict[str, int]] = weakref.WeakKeyDictionary()


class _Rejected(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _partition_sender(config: SparkSbConfig, fingerprint: str, batch_id: int, failed_over: tuple[str, ...],
                      reject: bool) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The function ``mapInArrow`` runs on each partition (pickled with these arguments only)."""

    def send_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        yield from PartitionRun(config, fingerprint, batch_id, partition, failed_over, reject).run(batches)

    return send_partition


_UNKNOWN = object()


class PartitionRun:
    """Sends one partition's rows; yields the reject rows (when rejecting) and then one summary row."""

    def __init__(self, config: SparkSbConfig, fingerprint: str, batch_id: int | str, partition: int,
                 failed_over: tuple[str, ...], reject: bool, sink: SinkConfig | None = None, id_prefix: str = ""
                 ) -> None:
        self.sink = sink or config.sink
        self.batch_id = batch_id
        #: what derived message ids start with (the servicebus writer's: the query's)
        self.id_prefix = id_prefix
        self.partition = partition
        self.reject = reject
        self.fast = self.sink.encoder == "fast"
        self.sender = sender_for(config, fingerprint)
        # counted from this worker's last summary, so that what happened between two tasks (a failback by the
        # background ping task) is reported by the next one
        self.before = _REPORTED.get(self.sender, {})
        if isinstance(self.sender, PairedSender):
            for entity in failed_over:
                self.sender.board.assume_failed_over(entity)
            # another executor may have parked a session's messages in an earlier batch: ask the backlog again
            self.sender.new_batch()
        self.started = time.monotonic()
        self.rows = 0
        self.sent = 0
        self.primary = 0
        self.secondary = 0
        self.backlog: dict[str, int] = {}
        self.entities: set[str] = set()
        self.pending: dict[str, list[tuple[ServiceBusMessage, Any]]] = {}
        #: entity_key -> the entity as first spelled in the partition (its chunks, counts and summary use it)
        self.spelled: dict[str, str] = {}
        #: entity -> why nothing can be sent to it (None: it can), as config.unsendable says, asked once each
        self.problems: dict[str, Any] = {}
        #: chunks submitted and not yet accounted for, oldest first: (entity, items, future)
        self.in_flight: collections.deque[tuple[str, list[tuple[ServiceBusMessage, Any]], Future[Any]]] = \
            collections.deque()
        self.rejects: list[tuple[str | None, str | None, str, bytes | None]] = []
        self.rejected = 0
        self.occurrences: dict[bytes, int] = {}

    def run(self, batches: Iterator[pa.RecordBatch], fields: Mapping[str, str] | None = None
            ) -> Iterator[pa.RecordBatch]:
        """Send the rows of ``batches``, whose columns are named by their message fields, or mapped to them by
        ``fields`` (``{column: field}``; other columns are left out); yield the reject rows (when rejecting)
        and then the summary row."""
        for batch in batches:
            names = batch.schema.names
            columns = ({name: batch.column(name).to_pylist() for name in names} if fields is None else
                       {fields[name]: batch.column(name).to_pylist() for name in names if name in fields})
            yield from self._rows(dict(zip(columns, values, strict=True))
                                  for values in zip(*columns.values(), strict=True))
        yield from self._finish()
        yield self._summary()

    def run_rows(self, rows: Iterable[dict[str, Any]]) -> Iterator[pa.RecordBatch]:
        """:meth:`run` over rows given as dicts of message fields."""
        yield from self._rows(rows)
        yield from self._finish()
        yield self._summary()

    def _rows(self, rows: Iterable[dict[str, Any]]) -> Iterator[pa.RecordBatch]:
        for row in rows:
            self.rows += 1
            self._row(row)
            if len(self.rejects) >= _REJECT_FLUSH:
                yield self._reject_batch()

    def _finish(self) -> Iterator[pa.RecordBatch]:
        for entity in list(self.pending):
            self._flush(entity)
        self._settle_all()  # every acknowledgement, before the partition reports
        if self.rejects:
            yield self._reject_batch()

    # rows -> messages

    def _message_id(self, row: dict[str, Any]) -> str:
        if "message_id" in row:
            value = row["message_id"]
            if value is None:
                raise _Rejected(f"the message id column ({self.sink.column_map['message_id']!r}) is null")
            return str(value)
        content = repr((self.batch_id, self.partition, sorted(row.items()))).encode("utf-8", "backslashreplace")
        digest = hashlib.blake2b(content, digest_size=16).digest()
        occurrence = self.occurrences.get(digest, 0)
        self.occurrences[digest] = occurrence + 1
        return f"{self.id_prefix}{self.batch_id}-{self.partition}-{digest.hex()}-{occurrence}"

    def _row(self, row: dict[str, Any]) -> None:
        entity = row.get("entity") or self.sink.entity
        body = row.get("body")
        try:
            message_id = self._message_id(row)
        except _Rejected as rejected:
            self._reject(None, entity, rejected.reason, body)
            return
        if entity is None:
            self._reject(message_id, None, "no entity: the entity column is null and sink.entity is not set", body)
            return
        problem = self.problems.get(entity, _UNKNOWN)
        if problem is _UNKNOWN:
            problem = self.problems[entity] = unsendable(entity)
        if problem is not None:
            self._reject(message_id, entity, f"the entity {problem}", body)
            return
        if body is None:
            self._reject(message_id, entity, "body is null", body)
            return
        try:
            message = _to_message(row, message_id, fast=self.fast)
        except ENCODING_ERRORS as err:
            self._reject(message_id, entity, f"cannot build the message: {err}", body)
            return
        # one chunk per entity whatever the spellings (Service Bus entity names are case-insensitive): a session's
        # rows under two spellings stay in one chunk, in order
        entity = self.spelled.setdefault(bus.entity_key(entity), entity)
        pending = self.pending.setdefault(entity, [])
        pending.append((message, body))
        if len(pending) >= self.sink.chunk_size:
            self._flush(entity)

    def _reject(self, message_id: str | None, entity: str | None, reason: str, body: Any) -> None:
        if not self.reject:
            raise BadInputError(self.batch_id, reason, entity=entity, message_id=message_id)
        self.rejected += 1
        raw = body.encode("utf-8") if isinstance(body, str) else body
        self.rejects.append((message_id, entity, reason, raw))

    # sending

    def _flush(self, entity: str) -> None:
        """Send the pending chunk of ``entity``: submitted, with at most ``sink.sends_in_flight`` chunks in flight
        (the oldest is settled first when that many are); sent at once, after every chunk in flight, when one
        at a time is asked for or a message has a session id (a session's messages keep their order)."""
        items = self.pending.pop(entity, [])
        if not items:
            return
        self.entities.add(entity)
        messages = [message for message, _ in items]
        if self.sink.sends_in_flight == 1 or any(message.session_id for message in messages):
            self._settle_all()
            self._send(entity, items)
            return
        while len(self.in_flight) >= self.sink.sends_in_flight:
            self._settle_oldest()
        self.in_flight.append((entity, items, self.sender.submit(entity, messages)))

    def _settle_oldest(self) -> None:
        """Account for the oldest chunk in flight (waiting for it). When it failed, wait for the others too (none
        keeps sending after the task failed), then raise its error."""
        entity, items, future = self.in_flight.popleft()
        try:
            self._send(entity, items, future.result)
        except BaseException:
            for _, _, other in self.in_flight:
                other.cancel()
            wait([other for _, _, other in self.in_flight])
            self.in_flight.clear()
            raise

    def _settle_all(self) -> None:
        while self.in_flight:
            self._settle_oldest()

    def _send(self, entity: str, items: list[tuple[ServiceBusMessage, Any]],
              outcome: Callable[[], SendResult | ReplicationResult] | None = None) -> None:
        """Send ``items`` to ``entity`` now, or account for the send already made (``outcome()`` returns its
        result or raises its error), and record where they went or what was rejected."""
        self.entities.add(entity)
        try:
            result = outcome() if outcome is not None else self.sender.send(entity, [m for m, _ in items])
        except BadMessageError as err:
            bad = [i for i, (message, _) in enumerate(items) if message.message_id == err.message_id]
            if err.message_id is None or not bad:
                if len(items) == 1:
                    message, body = items[0]
                    self._reject(message.message_id, entity, err.reason, body)
                    return
                for item in items:  # find it: one by one (nothing of the call was sent)
                    self._send(entity, [item])
                return
            message, body = items[bad[0]]
            self._reject(message.message_id, entity, err.reason, body)
            rest = items[: bad[0]] + items[bad[0] + 1:]
            if rest:
                self._send(entity, rest)
            return
        except EntityNotFoundError as err:
            for message, body in items:
                self._reject(message.message_id, entity, f"entity not found on the primary ({err})", body)
            return
        self.sent += result.sent
        for destination, n in result.destinations.items():
            if destination == PRIMARY:
                self.primary += n
            elif destination == SECONDARY:
                self.secondary += n
            else:
                self.backlog[destination] = self.backlog.get(destination, 0) + n

    # output

    def _reject_batch(self) -> pa.RecordBatch:
        rows = self.rejects
        self.rejects = []
        n = len(rows)
        data: dict[str, Any] = {"kind": ["reject"] * n, "partition": [self.partition] * n}
        for name in COUNTERS:
            data[name] = [None] * n
        data.update(backlog=[None] * n, health=[None] * n, seconds=[None] * n,
                    message_id=[r[0] for r in rows], entity=[r[1] for r in rows], reason=[r[2] for r in rows],
                    body=[r[3] for r in rows])
        return pa.RecordBatch.from_pydict(data, schema=_ARROW_OUTPUT)

    def counts(self) -> dict[str, Any]:
        """The partition's summary: ``kind``, ``partition``, the counters, ``backlog`` and ``health`` (dicts) and
        ``seconds`` (the keys of a summary row of :data:`PARTITION_OUTPUT`)."""
        after = self.sender.stats()
        _REPORTED[self.sender] = after
        delta = {name: after.get(name, 0) - self.before.get(name, 0) for name in after}
        counts = {"rows": self.rows, "sent": self.sent, "primary": self.primary, "secondary": self.secondary,
                  "rejected": self.rejected, **{name: delta.get(name, 0) for name in (
                      "failovers", "failbacks", "busy_waits", "assumed_failovers", "swaps")}}
        return {"kind": "summary", "partition": self.partition, **{name: counts[name] for name in COUNTERS},
                "backlog": dict(self.backlog),
                "health": {entity: self.sender.state(entity) for entity in sorted(self.entities)},
                "seconds": time.monotonic() - self.started}

    def _summary(self) -> pa.RecordBatch:
        counts = self.counts()
        data: dict[str, Any] = {name: [value] for name, value in counts.items()}
        data.update(backlog=[list(counts["backlog"].items())], health=[list(counts["health"].items())],
                    message_id=[None], entity=[None], reason=[None], body=[None])
        return pa.RecordBatch.from_pydict(data, schema=_ARROW_OUTPUT)


def _utc(value: datetime.datetime) -> datetime.datetime:
    return value.replace(tzinfo=datetime.UTC) if value.tzinfo is None else value


_INT32 = range(-(2**31), 2**31)


def _property_value(value: Any) -> Any:
    """An application property value as the SDK must send it: timestamps as UTC; a Spark ``bigint`` outside
    the 32-bit range as an AMQP long (the SDK's encoder sends a Python ``int`` as a 32-bit int and refuses a
    larger one); a null as a null."""
    if isinstance(value, datetime.datetime):
        return _utc(value)
    if isinstance(value, int) and not isinstance(value, bool) and value not in _INT32:
        return amqp_long_value(value)
    return value


_FIELDS = ("session_id", "partition_key", "subject", "content_type", "correlation_id", "to", "reply_to")


def _to_message(row: Mapping[str, Any], message_id: str, *, fast: bool = False) -> ServiceBusMessage:
    """The message for one row (values as pyarrow hands them over). ``fast``: its bytes built at once
    (:func:`spark_sb.wire.encoded_message`) when the row has no TTL nor schedule and the module covers its values,
    else the SDK's message."""
    kwargs: dict[str, Any] = {"message_id": message_id}
    for name in _FIELDS:
        value = row.get(name)
        if value is not None:
            kwargs[name] = value
    ttl = _time_to_live(row)
    scheduled = row.get("scheduled_enqueue_time")
    if scheduled is not None:
        kwargs["scheduled_enqueue_time_utc"] = _utc(scheduled)
    _properties(row, kwargs)
    if fast:
        if ttl is None and scheduled is None:
            encoded = wire.encoded_message(row["body"], **kwargs, lazy=True)
            if encoded is not None:
                return encoded
        else:
            wire.not_covered("a time to live or a scheduled enqueue time")
    message = ServiceBusMessage(row["body"], **kwargs)
    if ttl is not None:  # in milliseconds: the SDK's own setter keeps whole seconds only
        msgs.set_time_to_live(message, ttl)
    return message


def _properties(row: Mapping[str, Any], kwargs: dict[str, Any]) -> None:
    """The row's application properties, as ``kwargs["application_properties"]``."""
    properties = row.get("application_properties")
    if properties is not None:
        types = row.get("application_property_types")
        if types is None:
            kwargs["application_properties"] = {str(k): _property_value(v) for k, v in _items(properties)}
        else:
            readers = _readers(types)
            values: dict[str, Any] = {}
            for k, v in _items(properties):
                name = k if type(k) is str else str(k)
                values[name] = readers.get(name, _read_text)(name, v)
            kwargs["application_properties"] = values


_read_text = msgs.property_reader("string")
#: a row's application_property_types (as pyarrow hands it over) -> {property: its reader}
_READERS: dict[Any, dict[str, Callable[[str, Any], Any]]] = {}


def _readers(types: Any) -> dict[str, Callable[[str, Any], Any]]:
    """``{property: reader}`` (:func:`spark_sb.messages.property_reader`) of an ``application_property_types``
    value, remembered: most rows of a job repeat one (bounded: forgotten when full)."""
    key = tuple(types) if isinstance(types, list) else None  # pyarrow's list of pairs; a Row's dict is not kept
    readers = _READERS.get(key) if key is not None else None
    if readers is None:
        readers = {str(k): msgs.property_reader(v) for k, v in _items(types) if v is not None}
        if key is not None:
            if len(_READERS) >= 256:
                _READERS.clear()
            _READERS[key] = readers
    return readers


def _items(value: Any) -> Iterable[tuple[Any, Any]]:
    """A map column's entries: pyarrow hands a map over as a list of pairs, a Row as a dict."""
    return value.items() if isinstance(value, Mapping) else value


def _time_to_live(row: Mapping[str, Any]) -> datetime.timedelta | None:
    """The row's TTL: ``time_to_live`` (an interval or seconds) or ``time_to_live_ms`` (milliseconds)."""
    ttl, ttl_ms = row.get("time_to_live"), row.get("time_to_live_ms")
    if ttl is not None and ttl_ms is not None:
        raise ValueError(f"time_to_live ({ttl}) and time_to_live_ms ({ttl_ms}) both give the TTL: keep one")
    if ttl_ms is not None:
        if not 0 < ttl_ms <= _MAX_TTL_MS:
            raise ValueError(f"time_to_live_ms: {ttl_ms} ms is not between 1 and {_MAX_TTL_MS} (about 49.7 days, "
                             "what the AMQP header can carry)")
        return datetime.timedelta(milliseconds=ttl_ms)
    if ttl is None or isinstance(ttl, datetime.timedelta):
        return ttl
    try:
        return datetime.timedelta(seconds=ttl)
    except OverflowError:
        raise ValueError(f"time_to_live: {ttl} s is out of range") from None


_MAX_TTL_MS = 0xFFFFFFFF  # the AMQP header's ttl is a uint



def message_for_row(row: Mapping[str, Any]) -> ServiceBusMessage:
    """The message the ``servicebus`` writer would send for ``row``, whose keys are message fields (the columns of
    a batch read: ``body``, ``message_id``, ``application_properties``...); ``body`` and ``message_id`` must be
    set. Raises ``ValueError`` (or ``TypeError``) naming the field."""
    if row.get("body") is None:
        raise ValueError("body is null")
    if row.get("message_id") is None:
        raise ValueError("message_id is null: give the row a message id")
    return _to_message(row, str(row["message_id"]))
