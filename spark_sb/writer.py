"""Service Bus in Spark's own terms, writing: ``df.writeStream.format("servicebus")`` and
``df.write.format("servicebus").mode("append").save()`` (Spark allows a Python data source the append and
overwrite modes only; overwrite is refused: an entity is never overwritten).

The ``servicebus`` data source writes through the same machinery as ``foreachBatch(PairedSink)``: each partition
is sent from its executor by the sender of its Python worker process (:func:`spark_sb.sink.sender_for`; paired
with backlog failover, or active or passive replication, as the configuration says), with the same columns,
message ids, chunks, sends in flight and checks. What differs is who drives it: Spark calls the writer's
``write`` on each partition and its ``commit`` (or ``abort``) with what every partition reported.

Options (case-insensitive), as the ``servicebus`` source takes them: the configuration by reference (``conf``: a
YAML path; ``config``: JSON whose secrets are ``${ENV_VAR}`` references; or flat options holding no literal
secret, see :func:`spark_sb.options.config_options`); ``entity`` (the default entity, over ``sink.entity``; a
row's ``entity`` column still wins) and ``keyColumn`` (over ``sink.key_column``). Any other option is refused
naming it (:func:`spark_sb.options.check_known`), and so is a flat configuration option next to ``conf`` or
``config``. Checked before anything is sent: the options, the columns (names and types, as the sink checks them),
that the ``entity`` is a queue or a topic (never a subscription or a dead-letter queue) and that it exists on
the primary (asked within the primary's ``admin_timeout``, remembered by the process for a while; when the
primary does not answer, the check is left to the sends, which fail over). A stream in complete mode is refused.

**Message ids**: the key column's value; else, in a stream, ``q<query>-<batch id>-<partition>-<hash>-<n>``
(``<query>``: 16 hex digits of the query's id, which Spark keeps in the checkpoint; the rest as the sink derives
them, with Spark's batch id read from the task's local property ``streaming.sql.batchId``): a replayed batch
sends the same ids, and an entity with duplicate detection keeps one copy; another query writing the same rows
sends other ids. A batch write
(``df.write``) has no batch id: its ids start with a write id drawn when the write is planned (``w<hex>``), the
same for every task retry of that write and new for the next write. Give a key column to make a second run of
the same write a duplicate.

**What each batch did**: ``commit`` merges the partitions' summaries (rows, primary, backlog per queue,
rejected, failovers...) and logs one line (``servicebus writer batch 7: 120 rows: 80 -> primary...``), in the
driver's log (Spark runs ``commit`` in a Python worker of its own: when nothing configured its logging,
spark_sb's lines go to its stderr, which Spark passes to the driver's); ``abort`` logs what the partitions that
finished had sent (sent again, with the same ids, when the batch is replayed).

**Bad rows** are handled as the sink handles them: with ``sink.reject_table`` each goes there (batch id, partition,
message id, entity, reason, body, time), appended by its partition once per batch (only the count travels to the
driver), and the rest is sent; without it the batch fails with the sink's
:class:`~spark_sb.errors.BadInputError` (batch, entity, message id, reason). ``sink.metrics_table`` gets one row
per batch, as the sink writes it, once per batch. Spark runs a Python writer's ``commit`` in a worker process
without a SparkSession, so the writer appends to these Delta tables with delta-rs (the ``deltalake`` package, extra
``delta-rs``), by local path only (``/Volumes/...`` on Databricks, ``data/x``): a catalog table name or a remote
path (``abfss://``) is refused when the write is planned (``foreachBatch(PairedSink)`` writes those). A batch
write's rows there have a null batch id.

Entity health is not carried from batch to batch as the ``foreachBatch`` sink carries it (Spark builds a new
writer for each commit): each worker's sender keeps its own across batches, and a worker new to a failed-over
entity waits out the failover interval once.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .capabilities import require_python_data_sources

require_python_data_sources("spark_sb.writer (the servicebus format's writers)")

import pyarrow as pa  # noqa: E402
from pyspark.sql.datasource import (  # noqa: E402
    DataSourceArrowWriter,
    DataSourceStreamWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import MapType, StructType, TimestampType  # noqa: E402

from .bus import admin_client  # noqa: E402
from .config import SinkConfig, SparkSbConfig, unsendable  # noqa: E402
from .errors import ConfigError, ErrorClass, classify, raise_if_refused, redact  # noqa: E402
from .options import check_known as _check_known  # noqa: E402
from .options import option as _option  # noqa: E402
from .options import options_config as _options_config  # noqa: E402
from .sink import (  # noqa: E402
    COUNTERS,
    BatchSummary,
    PartitionRun,
    check_columns,
    check_unaccounted,
    log_to_stderr_unless_configured,
    merge_summaries,
)
from .tables import append_once, append_without_spark, local_path  # noqa: E402

try:  # Spark 4.1 and later: a streaming writer takes Arrow batches
    from pyspark.sql.datasource import DataSourceStreamArrowWriter
except ImportError:  # Spark 4.0: rows
    DataSourceStreamArrowWriter = None  # type: ignore[assignment,misc]

_LOGGER = logging.getLogger(__name__)

__all__ = ["PartitionSent", "ServiceBusBatchWriter", "stream_writer"]

#: the local property in which Spark's micro-batch execution hands each task its batch id
BATCH_ID_PROPERTY = "streaming.sql.batchId"
#: the local property holding the streaming query's id (kept in its checkpoint, the same across restarts)
QUERY_ID_PROPERTY = "sql.streaming.queryId"
#: the modules in which Spark's Python worker commits or aborts a streaming write
_COMMIT_RUNNERS = (os.path.join("sql", "worker", "python_streaming_sink_runner.py"),)
#: seconds an entity found on the primary is not asked about again (Spark builds the writer for every batch)
_FOUND_FOR = 300.0
#: seconds a primary that did not answer is not asked again: a management plane that is down costs a query one
#: ``admin_timeout`` a minute, not one per batch
_UNANSWERED_FOR = 60.0
#: (configuration fingerprint, entity) -> when it was checked (time.monotonic()) and whether it was found
_CHECKED: dict[tuple[str, str], tuple[float, bool]] = {}
_CHECKED_LOCK = threading.Lock()


@dataclass
class PartitionSent(WriterCommitMessage):
    """What one partition did: a summary row of :data:`spark_sb.sink.PARTITION_OUTPUT` as a dict."""

    summary: dict[str, Any] = field(default_factory=dict)
    #: the rows this partition rejected that are in the reject table (it appends them itself: only this count
    #: travels to the driver, whatever the rows' size)
    rejects_written: int = 0
    #: the write's key in the tables' logs: the query's id (a stream) or the write id (a batch write)
    run_key: str = ""


class _Writing:
    """What the batch and the streaming writers share: the options parsed and checked once, on the driver when
    Spark plans the write, and the partition run on the executors."""

    WHAT = "servicebus writer"

    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        _check_known(options, ("entity", "keyColumn"), self.WHAT)
        self.config: SparkSbConfig = _options_config(options)
        self.sink = _sink_options(self.config.sink, options)
        #: ``{option: local path}`` of the Delta tables configured (sink.reject_table, sink.metrics_table)
        self.tables = {option: _table_path(option, getattr(self.sink, option))
                       for option in ("reject_table", "metrics_table") if getattr(self.sink, option) is not None}

        def refuse(option: str | None, column: str | None, problem: str) -> Exception:
            if option is None:
                return ConfigError(f"column {column!r}", problem)
            spelled = {"sink.key_column": "keyColumn", "sink.entity": "entity"}.get(option, option)
            return ConfigError(spelled, problem.replace("(option)", f"(option {spelled})"), column)

        self.fields = {column: name for name, column in check_columns(self.sink, schema, refuse).items()}
        self.local_timestamps = _local_timestamp_fields(schema, self.fields)
        self.fingerprint = self.config.fingerprint()
        if self.sink.entity is not None:
            entity = str(self.sink.entity)
            problem = unsendable(entity)
            if problem is not None:
                raise ConfigError("entity" if _option(options, "entity") is not None else "sink.entity", problem,
                                  entity)
            if not _committing():
                _check_entity(self.config, entity)

    def _run(self, batch_id: int | str) -> PartitionRun:
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        return PartitionRun(self.config, self.fingerprint, batch_id, partition, (),
                             reject="reject_table" in self.tables, sink=self.sink, id_prefix=self._id_prefix())

    def _id_prefix(self) -> str:
        """What derived message ids start with before the batch id (see the module docstring)."""
        return ""

    def _send_batches(self, batch_id: int | str, batches: Iterator[pa.RecordBatch]) -> PartitionSent:
        return self._sent(self._run(batch_id).run(batches, self.fields), batch_id)

    def _send_rows(self, batch_id: int | str, rows: Iterable[Any]) -> PartitionSent:
        fields, local = self.fields, self.local_timestamps
        mapped = ({fields[column]: _utc_row_value(value, fields[column] in local)
                   for column, value in row.asDict(recursive=False).items() if column in fields} for row in rows)
        return self._sent(self._run(batch_id).run_rows(mapped), batch_id)

    def _run_key(self) -> str:
        """The write's key in the tables' logs (see :attr:`PartitionSent.run_key`)."""
        raise NotImplementedError

    def _sent(self, output: Iterator[pa.RecordBatch], batch_id: int | str) -> PartitionSent:
        """What a partition run yielded, as its commit message: the summary, and how many rejected rows this
        partition appended to the reject table (once per batch and partition: a retried task or a replayed
        batch finds its rows there and appends nothing, :func:`spark_sb.tables.append_once`)."""
        sent = PartitionSent(run_key=self._run_key())
        rejects: list[tuple[Any, ...]] = []
        for batch in output:
            for row in batch.to_pylist():
                if row["kind"] == "reject":
                    rejects.append((row["partition"], row["message_id"], row["entity"], row["reason"], row["body"]))
                else:
                    sent.summary = {**row, "backlog": dict(row["backlog"]), "health": dict(row["health"])}
        if rejects:
            partition = rejects[0][0]
            version = batch_id if isinstance(batch_id, int) else 0
            appended = append_once(self.tables["reject_table"],
                                   _rejects_table(batch_id if isinstance(batch_id, int) else None, rejects),
                                   f"spark-sb-rejects-{sent.run_key}-{partition}", version)
            _LOGGER.warning("%s batch %s partition %s: %d rejected rows %s %s", self.WHAT, batch_id, partition,
                            len(rejects), "written to" if appended else "already in", self.sink.reject_table)
            sent.rejects_written = len(rejects)
        return sent

    def _summary(self, messages: Iterable[WriterCommitMessage | None], batch_id: int) -> BatchSummary:
        """The partitions' summaries merged (:func:`spark_sb.sink.merge_summaries`)."""
        return merge_summaries(batch_id, [m.summary for m in messages if isinstance(m, PartitionSent)], 0.0)[0]

    def _commit(self, messages: list[WriterCommitMessage | None], label: str, batch_id: int | None
                ) -> BatchSummary:
        """Merge the partitions' summaries, append their rejected rows to the reject table, check that every row
        was sent or rejected, log the summary and append it to the metrics table. ``batch_id`` is None for a
        batch write (its rows in the tables have a null batch id)."""
        log_to_stderr_unless_configured()  # a worker process of its own, whose logging nobody configured
        done = [m for m in messages if isinstance(m, PartitionSent)]
        summary = self._summary(done, batch_id or 0)
        summary.batch_id = batch_id
        summary.seconds = max((m.summary["seconds"] for m in done), default=0.0)
        written = sum(m.rejects_written for m in done)
        if summary.rejected != written:
            raise RuntimeError(f"{self.WHAT} {label}: {summary.rejected} rows rejected but {written} "
                               "written to the reject table")
        check_unaccounted(summary)
        _LOGGER.info("%s %s: %s", self.WHAT, label, summary.describe())
        if "metrics_table" in self.tables:
            run_key = next((m.run_key for m in done if m.run_key), None)
            if run_key is None:  # no partition reported: nothing to key the row by
                append_without_spark(self.tables["metrics_table"], _metrics_table(summary))
            else:  # once per batch: a commit that failed after appending and ran again appends nothing
                append_once(self.tables["metrics_table"], _metrics_table(summary), f"spark-sb-metrics-{run_key}",
                            batch_id or 0)
        return summary

    def _abort(self, messages: Iterable[WriterCommitMessage | None], label: str, batch_id: int) -> None:
        log_to_stderr_unless_configured()
        done = [m for m in messages if isinstance(m, PartitionSent)]
        summary = self._summary(done, batch_id)
        _LOGGER.error("%s %s failed: the %d partitions that finished sent %d of their %d rows (%d -> primary, %d -> "
                      "backlog); a replay sends them again with the same message ids", self.WHAT, label, len(done),
                      summary.sent, summary.rows, summary.primary, summary.backlog_total)


class ServiceBusBatchWriter(_Writing, DataSourceArrowWriter):
    """``df.write.format("servicebus").save()``: one-off sends (backfills, resends). See the module docstring."""

    def __init__(self, options: Mapping[str, str], schema: StructType, overwrite: bool = False) -> None:
        if overwrite:
            raise ConfigError("mode", "a Service Bus entity cannot be overwritten: messages are only ever added; "
                              "write with .mode(\"append\")", "overwrite")
        super().__init__(options, schema)
        self.write_id = "w" + secrets.token_hex(6)

    def _run_key(self) -> str:
        return self.write_id

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PartitionSent:
        return self._send_batches(self.write_id, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        self._commit(messages, f"write {self.write_id}", None)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        self._abort(messages, f"write {self.write_id}", 0)


class _StreamWriting(_Writing):
    def __init__(self, options: Mapping[str, str], schema: StructType, overwrite: bool = False) -> None:
        if overwrite:
            raise ConfigError("outputMode", "a Service Bus entity cannot be overwritten (complete mode would send "
                              "the whole result again each batch): write with outputMode(\"append\") or "
                              "\"update\"", "complete")
        super().__init__(options, schema)

    def _id_prefix(self) -> str:
        """``q`` and the first 16 hex digits of the query's id (Spark keeps it in the checkpoint: the same across
        restarts, another for another query or a new checkpoint), then ``-``."""
        return "q" + self._run_key().replace("-", "")[:16] + "-"

    def _run_key(self) -> str:
        """The query's id, which Spark hands each task."""
        from pyspark import TaskContext

        context = TaskContext.get()
        query = context.getLocalProperty(QUERY_ID_PROPERTY) if context is not None else None
        if not query:
            raise RuntimeError(f"{self.WHAT}: Spark gave the task no query id (local property {QUERY_ID_PROPERTY}); "
                               "message ids cannot be derived without it")
        return str(query)

    def _batch_id(self) -> int:
        from pyspark import TaskContext

        context = TaskContext.get()
        value = context.getLocalProperty(BATCH_ID_PROPERTY) if context is not None else None
        if value is None:
            raise RuntimeError(f"{self.WHAT}: Spark gave the task no batch id (local property {BATCH_ID_PROPERTY}); "
                               "message ids cannot be derived without it")
        return int(value)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        self._commit(messages, f"batch {batchId}", batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        self._abort(messages, f"batch {batchId}", batchId)


if DataSourceStreamArrowWriter is not None:

    class ServiceBusStreamWriter(_StreamWriting, DataSourceStreamArrowWriter):
        """``df.writeStream.format("servicebus")`` (Arrow batches: Spark 4.1 and later)."""

        def write(self, iterator: Iterator[pa.RecordBatch]) -> PartitionSent:
            return self._send_batches(self._batch_id(), iterator)

else:

    class ServiceBusStreamWriter(_StreamWriting, DataSourceStreamWriter):  # type: ignore[no-redef]
        """``df.writeStream.format("servicebus")`` (rows: Spark 4.0)."""

        def write(self, iterator: Iterator[Any]) -> PartitionSent:
            return self._send_rows(self._batch_id(), iterator)


def stream_writer(options: Mapping[str, str], schema: StructType, overwrite: bool = False) -> ServiceBusStreamWriter:
    return ServiceBusStreamWriter(options, schema, overwrite)


def _committing() -> bool:
    """Whether Spark builds this writer to commit or abort a streaming batch (its runner builds the writer again
    for that): the entity was checked when the batch was planned, and an abort must log what was sent even when
    the entity has been deleted since."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_COMMIT_RUNNERS):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _sink_options(sink: SinkConfig, options: Mapping[str, str]) -> SinkConfig:
    """``sink`` with the writer's own options over it: ``entity`` and ``keyColumn``."""
    update: dict[str, Any] = {}
    entity = _option(options, "entity")
    if entity is not None:
        update["entity"] = entity.strip()
    key = _option(options, "keyColumn")
    if key is not None:
        if "message_id" in sink.columns:
            raise ConfigError("keyColumn", "conflicts with sink.columns.message_id of the configuration", key)
        update["key_column"] = key.strip()
    if not update:
        return sink
    try:
        return SinkConfig.model_validate({**sink.model_dump(), **update})
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError("entity" if "entity" in update else "keyColumn", redact(str(err))[:300]) from None


def _check_entity(config: SparkSbConfig, entity: str) -> None:
    """The default entity exists on the primary as a queue or a topic; raises :class:`ConfigError` naming the
    ``entity`` option when it does not. A primary that does not answer within its ``admin_timeout`` is logged: the
    sends fail over. What the primary answered is remembered by the process for a while (:data:`_FOUND_FOR`,
    :data:`_UNANSWERED_FOR`): Spark builds the writer again for every batch."""
    key = (config.fingerprint(), entity)
    with _CHECKED_LOCK:
        checked = _CHECKED.get(key)
    if checked is not None and time.monotonic() - checked[0] < (_FOUND_FOR if checked[1] else _UNANSWERED_FOR):
        return
    found = _ask_primary(config, entity)
    with _CHECKED_LOCK:
        _CHECKED[key] = (time.monotonic(), found)


def _ask_primary(config: SparkSbConfig, entity: str) -> bool:
    """:func:`_check_entity`'s question: True when the entity was found, False when the primary did not answer."""
    namespace = config.primary
    try:
        with admin_client(namespace, retry_total=0) as admin:
            for kind, get in (("queue", admin.get_queue), ("topic", admin.get_topic)):
                try:
                    get(entity)
                    return True
                except Exception as exc:
                    if classify(exc) is not ErrorClass.CONFIGURATION_NOT_FOUND:
                        raise
                    _LOGGER.debug("%r is not a %s on the primary", entity, kind)
    except Exception as exc:
        raise_if_refused(exc, f"primary {namespace.fully_qualified_namespace}")
        _LOGGER.warning("the primary %s did not answer whether %r exists within %g s (%s); the sends will tell",
                        namespace.fully_qualified_namespace, entity, namespace.admin_timeout_seconds,
                        type(exc).__name__)
        return False
    raise ConfigError("entity", f"is neither a queue nor a topic on the primary {namespace.fully_qualified_namespace}",
                      entity)


def _local_timestamp_fields(schema: StructType, fields: Mapping[str, str]) -> frozenset[str]:
    """The message fields whose column is a (session-zoned) timestamp, or a map of them."""
    found = set()
    for column in schema.fields:
        name = fields.get(column.name)
        data_type = column.dataType
        if name is not None and (isinstance(data_type, TimestampType)
                                 or isinstance(data_type, MapType) and isinstance(data_type.valueType, TimestampType)):
            found.add(name)
    return frozenset(found)


def _utc_row_value(value: Any, local: bool) -> Any:
    """A value of a :class:`~pyspark.sql.Row`: a ``TimestampType`` value comes as a naive local time (pyspark
    converts it so), here made an aware UTC one; maps become their items."""
    if isinstance(value, dict):
        return {k: _utc_row_value(v, local) for k, v in value.items()}
    if local and isinstance(value, datetime.datetime) and value.tzinfo is None:
        return value.astimezone(datetime.UTC)
    return value


_REJECTS = pa.schema([
    pa.field("batch_id", pa.int64()), pa.field("partition", pa.int32()), pa.field("message_id", pa.string()),
    pa.field("entity", pa.string()), pa.field("reason", pa.string()), pa.field("body", pa.binary()),
    pa.field("rejected_at", pa.timestamp("us", tz="UTC")),
])
#: :data:`spark_sb.sink.METRICS_SCHEMA` in Arrow
_METRICS = pa.schema(
    [pa.field("batch_id", pa.int64()), pa.field("finished_at", pa.timestamp("us", tz="UTC"))]
    + [pa.field(name, pa.int64()) for name in COUNTERS]
    + [pa.field("backlog", pa.map_(pa.string(), pa.int64())), pa.field("failed_over", pa.list_(pa.string())),
       pa.field("partitions", pa.int32()), pa.field("seconds", pa.float64())])


def _rejects_table(batch_id: int | None, rejects: list[tuple[Any, ...]]) -> pa.Table:
    """The reject table's rows (the columns the sink writes)."""
    now = datetime.datetime.now(datetime.UTC)
    return pa.Table.from_pylist([
        {"batch_id": batch_id, "partition": partition, "message_id": message_id, "entity": entity, "reason": reason,
         "body": body, "rejected_at": now} for partition, message_id, entity, reason, body in rejects],
        schema=_REJECTS)


def _metrics_table(summary: BatchSummary) -> pa.Table:
    """The metrics table's row for ``summary`` (the columns the sink writes)."""
    row = {"batch_id": summary.batch_id, "finished_at": datetime.datetime.now(datetime.UTC),
           **{name: getattr(summary, name) for name in COUNTERS}, "backlog": list(summary.backlog.items()),
           "failed_over": list(summary.failed_over), "partitions": summary.partitions, "seconds": summary.seconds}
    return pa.Table.from_pylist([row], schema=_METRICS)


def _table_path(option: str, location: str) -> str:
    """The local path of the Delta table ``sink.<option>`` names; a catalog table or a remote path is refused,
    and so is a missing delta-rs (the writer appends without a SparkSession)."""
    path = local_path(location)
    if path is None:
        raise ConfigError(f"sink.{option}", "the servicebus format's writer appends to a Delta table by local path "
                          "only (Spark commits a Python writer without a SparkSession, so it writes with delta-rs): "
                          "give a path such as /Volumes/... or data/x, or send with foreachBatch(PairedSink), which "
                          "writes catalog tables and remote paths", location)
    try:
        import deltalake  # noqa: F401
    except ImportError:
        raise ConfigError(f"sink.{option}", "the servicebus format's writer appends to Delta tables with delta-rs: "
                          "install it (pip install 'spark-sb[delta-rs]')", location) from None
    return path
