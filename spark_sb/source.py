"""``servicebus-backlog``: a Python streaming data source over every backlog queue of a primary (spark.md,
"The syphon").

A queue is not replayable by itself, so the source keeps Service Bus as the only store by **deferring**:

* :meth:`BacklogStreamReader.latestOffset` receives up to ``maxMessagesPerTrigger`` messages in peek-lock
  from the backlog queues and defers them (a deferred message stays in its queue, is never delivered again,
  and is fetched by sequence number). Pings are completed at once (every reader drops them). The offset is a
  JSON dict: ``{"batch": n, "queues": {queue: [sequence numbers]}}`` holding the batch's messages;
* :meth:`~BacklogStreamReader.partitions` gives one partition per queue with its sequence numbers;
  :meth:`~BacklogStreamReader.read` (on an executor) **peeks** them by sequence number, which neither locks
  them nor counts a delivery, and turns each into a row: a replayed batch reads the same rows, and a reader
  that dies holds no lock;
* the sink settles the messages. The syphon's sink (:class:`spark_sb.syphon.Republisher`) completes or
  dead-letters each one only after the primary accepted its restored copy and its ledger recorded the
  outcome. :meth:`~BacklogStreamReader.commit` (Spark calls it after the batch's sink finished) completes
  whatever of the batch the sink left deferred, so that another sink reads the backlog at least once. Spark
  calls ``commit`` only when it plans the next batch; ``latestOffset(start)`` therefore does the same for the
  batch ending at ``start`` (it is only called once that batch finished), so an idle stream leaves nothing
  deferred behind;
* the first ``latestOffset`` of a reader (a new query, or a restart from a checkpoint) peeks the queues for
  messages left deferred by a run that died between deferring them and Spark recording its offset, or by an
  abandoned checkpoint, and takes them back into its batch. Only one syphon may read a primary's backlog
  queues at a time.

Options (case-insensitive): the configuration **by reference**, so that no secret is written into Spark's plan,
progress or event log (:func:`config_options` builds these): ``conf`` (a YAML path) or ``config`` (JSON whose
secrets are ``${ENV_VAR}`` references, resolved where the reader runs), or flat options of
:func:`spark_sb.config.from_options` that hold no literal secret; ``maxMessagesPerTrigger`` (default
``syphon.max_messages_per_trigger``); ``receiveTimeout`` (seconds a receive waits for the first message, default
1); ``reportBacklogDepth`` (default true).

Receiving ahead: from the second batch on, the next batch is received and deferred in a background thread of
the reader's process while Spark runs the current one (:class:`_Ahead`); ``latestOffset`` then only takes it.

Backlog depth: PySpark 4.2's Python sources have no custom metrics, so the depth (active messages over the
backlog queues, including the batch in flight, from the administration API) is reported through
:meth:`reportLatestOffset`, which Spark shows as the source's ``latestOffset`` in the query progress
(``{"backlogDepth": n}``), and logged.

Readers keep no clients in ``self``: their receivers live in the per-process registry
(:mod:`spark_sb.bus`), as the sink's senders do.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
from pyspark.sql.types import (
    BinaryType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from . import messages as msgs
from .bus import admin_client, shared_namespace
from .bus.deferred import PAGE, complete_deferred, deferred_numbers, peek_deferred
from .config import (
    MAX_RECEIVE_BATCH,
    SparkSbConfig,
    from_options,
    is_literal_secret,
    load_config,
    load_reference,
)
from .errors import ConfigError, redact

_LOGGER = logging.getLogger(__name__)

__all__ = ["SCHEMA", "BacklogDataSource", "BacklogPartition", "BacklogStreamReader", "backlog_row", "config_options",
           "register"]

FORMAT = "servicebus-backlog"
SCHEMA = StructType([
    StructField("destination", StringType()),
    StructField("message_id", StringType()),
    StructField("body", BinaryType()),
    StructField("session_id", StringType()),
    StructField("partition_key", StringType()),
    StructField("correlation_id", StringType()),
    StructField("subject", StringType()),
    StructField("content_type", StringType()),
    StructField("to", StringType()),
    StructField("reply_to", StringType()),
    StructField("reply_to_session_id", StringType()),
    StructField("time_to_live_ms", LongType()),
    StructField("scheduled_enqueue_time", TimestampType()),
    StructField("application_properties", MapType(StringType(), StringType())),
    StructField("backlog_queue", StringType(), False),
    StructField("sequence_number", LongType(), False),
    StructField("enqueued_time", TimestampType()),
    StructField("status", StringType(), False),
    StructField("reason", StringType()),
    StructField("backlog_message", BinaryType()),
])
#: at most this many messages per input partition: a batch from one queue still runs on several cores
_PARTITION = 1000


def register(spark: Any) -> None:
    """Register the ``servicebus-backlog`` format with ``spark``."""
    spark.dataSource.register(BacklogDataSource)


def _options_config(options: Mapping[str, str]) -> SparkSbConfig:
    """The configuration the options hand over by reference (see :func:`config_options`)."""
    path = _option(options, "conf")
    if path is not None:
        return load_config(path)
    reference = _option(options, "config")
    if reference is not None:
        return load_reference(reference)
    config = from_options(options)
    if config.reference() is None:
        secret = next((str(k) for k, v in options.items() if is_literal_secret(str(k).rsplit(".", 1)[-1], v)), "options")
        raise ConfigError(secret, "holds a literal secret, which Spark would write into its plan and event log: pass "
                          "the configuration by reference (option conf: a YAML path; or option config: JSON whose "
                          "secrets are ${ENV_VAR} references; spark_sb.source.config_options builds them)")
    return config


def config_options(conf: str | os.PathLike[str] | Mapping[str, Any] | SparkSbConfig) -> dict[str, str]:
    """The source options that hand ``conf`` to the readers by reference, so that no secret is written into
    Spark's plan, its progress reports or its event log:

    * ``conf``: a YAML path: the path given, or the file the configuration was loaded from;
    * else ``config``: the configuration as JSON, when every secret in it is a ``${ENV_VAR}`` reference
      (resolved where the reader runs: set the variable on the driver and the executors);
    * else (literal secrets, e.g. a dict built in code) ``conf``: a YAML file this process writes, readable by
      its user only and removed at exit. Executors must read it: this works on one machine (local mode); on a
      cluster give a path every node reads, or references.
    """
    if isinstance(conf, str | os.PathLike):
        return {"conf": str(Path(conf).resolve())}
    config = load_config(conf)
    if config.origin_path is not None:
        return {"conf": config.origin_path}
    reference = config.reference()
    if reference is not None:
        return {"config": json.dumps(reference)}
    return {"conf": _private_file(config)}


_PRIVATE_FILES: dict[str, str] = {}


def _private_file(config: SparkSbConfig) -> str:
    """A YAML file holding ``config`` with its secrets, readable by this user only, removed at exit."""
    import atexit
    import tempfile

    import yaml

    fingerprint = config.fingerprint()
    path = _PRIVATE_FILES.get(fingerprint)
    if path is None or not os.path.exists(path):
        handle, path = tempfile.mkstemp(prefix="spark-sb-", suffix=".yaml")  # mode 0600
        with os.fdopen(handle, "w") as out:
            yaml.safe_dump(config.to_dict(secrets=True), out)
        atexit.register(Path(path).unlink, missing_ok=True)
        _PRIVATE_FILES[fingerprint] = path
        _LOGGER.info("the configuration holds literal secrets: the source reads it from %s (this user only)", path)
    return path


def _option(options: Mapping[str, str], name: str) -> str | None:
    for key, value in options.items():
        if str(key).lower() == name.lower() and value not in (None, ""):
            return str(value)
    return None


def _positive(options: Mapping[str, str], name: str, default: float, kind: type = int, most: float | None = None
              ) -> Any:
    text = _option(options, name)
    if text is None:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(name, f"must be a positive {'integer' if kind is int else 'number'}", text) from None
    if value <= 0 or value != value:
        raise ConfigError(name, "must be positive", text)
    if most is not None and value > most:
        raise ConfigError(name, f"must be at most {most:g}", text)
    return value


class BacklogDataSource(DataSource):
    """``spark.readStream.format("servicebus-backlog")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        return SCHEMA

    def streamReader(self, schema: StructType) -> BacklogStreamReader:
        return BacklogStreamReader(self.options)


@dataclass(frozen=True)
class BacklogPartition(InputPartition):
    """One backlog queue's deferred messages of a batch."""

    queue: str
    sequence_numbers: tuple[int, ...]


def _json_value(value: Any) -> Any:
    """``value`` as JSON can hold it; raises ``TypeError`` for a map key JSON cannot hold (binary, uuid...)."""
    if isinstance(value, dict):
        if set(value) == {"TYPE", "VALUE"}:  # a pyamqp typed value (a restored long, symbol, timestamp...)
            return _json_value(value["VALUE"])
        out = {}
        for key, item in value.items():
            if not isinstance(key, str | int | float | bool) and key is not None:
                raise TypeError(f"a {type(key).__name__} map key")
            out[key] = _json_value(item)
        return out
    if isinstance(value, list | tuple):
        return [_json_value(item) for item in value]
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, bytes | bytearray | memoryview):
        return msgs.text(bytes(value))
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)  # uuid, decimal


def _body(message: Any) -> bytes:
    """The body as bytes: a data body's sections joined; a value or sequence body as JSON when JSON can hold
    it, else as the SDK encodes the body section(s) (AMQP). Never raises: a foreign shape is still a row."""
    from azure.servicebus.amqp import AmqpMessageBodyType

    try:
        raw = message.raw_amqp_message
        if raw.body_type == AmqpMessageBodyType.DATA:
            return b"".join(bytes(section) for section in raw.body)
        body = raw.body if raw.body_type == AmqpMessageBodyType.VALUE else list(raw.body)
    except Exception as exc:  # not a message the SDK could read: an empty body, the status says why
        _LOGGER.warning("backlog message body unreadable: %s: %s", type(exc).__name__, exc)
        return b""
    try:
        return json.dumps(_json_value(body)).encode("utf-8")
    except (TypeError, ValueError, RecursionError):
        pass
    try:
        return msgs.encoded_body(message)
    except Exception as exc:  # nothing encodes it: an empty body, never a failed batch
        _LOGGER.warning("backlog message body not encodable: %s: %s", type(exc).__name__, exc)
        return b""


def _property_text(value: Any) -> str | None:
    if isinstance(value, dict) and set(value) == {"TYPE", "VALUE"}:  # a pyamqp typed value
        inner = value["VALUE"]
        if value["TYPE"] == "TIMESTAMP" and isinstance(inner, int):
            try:
                return (datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
                        + datetime.timedelta(milliseconds=inner)).isoformat()
            except OverflowError:
                return str(inner)
        return _property_text(inner)
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    return msgs.text(value)


def _utc(value: Any) -> datetime.datetime | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.UTC)
    return value.astimezone(datetime.UTC)


def backlog_row(received: Any, queue: str, now: datetime.datetime) -> tuple:
    """The row of one received backlog message (see :data:`SCHEMA`)."""
    text = msgs.text
    enqueued = _utc(received.enqueued_time_utc)
    try:
        restored = msgs.from_backlog(received, now)
    except Exception as exc:  # a shape from_backlog did not foresee: an invalid row, never a crash
        restored = msgs.Restored(msgs.RestoreStatus.INVALID, reason="unreadable message",
                                 description=f"{type(exc).__name__}: {exc}")
    coordinates = (queue, int(received.sequence_number), enqueued)
    try:
        encoded: bytes | None = msgs.received_bytes(received)
    except Exception as exc:  # the republisher then fetches it again; never a failed batch
        _LOGGER.warning("backlog message %s of %r not re-encodable (%s); it will be peeked again",
                        received.sequence_number, queue, type(exc).__name__)
        encoded = None
    if not restored.ok or restored.message is None:
        return (restored.entity, text(received.message_id), _body(received), None, None, None, None, None, None,
                None, None, None, None, None, *coordinates, restored.status.value, restored.reason, encoded)
    m = restored.message
    ttl = m.time_to_live
    properties = {text(k): _property_text(v) for k, v in (m.application_properties or {}).items()}
    return (restored.entity, text(m.message_id), _body(m), text(m.session_id), text(m.partition_key),
            text(m.correlation_id), text(m.subject), text(m.content_type), text(m.to), text(m.reply_to),
            text(m.reply_to_session_id), None if ttl is None else int(ttl.total_seconds() * 1000),
            _utc(m.scheduled_enqueue_time_utc), properties or None, *coordinates, restored.status.value, None,
            encoded)


class BacklogStreamReader(DataSourceStreamReader):
    """The driver-side reader; see the module docstring."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.options = dict(options)
        self.config = _options_config(self.options)
        self.max_per_trigger = int(_positive(self.options, "maxMessagesPerTrigger",
                                             self.config.syphon.max_messages_per_trigger,
                                             most=MAX_RECEIVE_BATCH))
        self.receive_timeout = float(_positive(self.options, "receiveTimeout", 1.0, float, most=300))
        depth = (_option(self.options, "reportBacklogDepth") or "true").lower()
        self.report_depth = depth in ("true", "1", "yes")
        self.queues = self.config.send_availability.backlog_queue_names()
        self._taken_back: dict[str, list[int]] = {}
        self._swept = False
        self._completed_batch = -1
        self._uncompleted: list[dict] = []  # batches whose completion failed: retried on the next call
        self._depth: int | None = None
        self._ahead: _Ahead | None = None
        self._started_ahead = False  # batches after the first are received ahead, in the background

    # --- offsets -------------------------------------------------------------------------------------------

    def initialOffset(self) -> dict:
        """A fresh checkpoint starts at batch 0; messages an abandoned run left deferred are taken back by the
        first :meth:`latestOffset`."""
        return {"batch": 0, "queues": {}}

    def _sweep(self, exclude: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
        """Every deferred message of the backlog queues (but ``exclude``): left by a run that died."""
        taken: dict[str, list[int]] = {}
        for queue in self.queues:
            with shared_namespace(self.config, "secondary").receiver(queue) as receiver:
                skip = set(exclude.get(queue, ()))
                numbers = [n for n in deferred_numbers(receiver) if n not in skip]
            if numbers:
                taken[queue] = numbers
        if taken:
            _LOGGER.warning("taking back %d backlog messages left deferred by an earlier run: %s",
                            sum(len(v) for v in taken.values()), {q: len(v) for q, v in taken.items()})
        return taken

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_per_trigger)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        # the batch ending at ``start`` finished: complete what its sink left deferred (and retry earlier
        # completions that failed)
        for pending in [*self._uncompleted, start]:
            try:
                self._complete(pending)
            except Exception as exc:  # retried on the next call; they stay deferred meanwhile
                _LOGGER.warning("completing backlog batch %s failed (%s); retrying later", pending.get("batch"),
                                type(exc).__name__)
                if pending not in self._uncompleted:
                    self._uncompleted.append(pending)
            else:
                if pending in self._uncompleted:
                    self._uncompleted.remove(pending)
        if not self._swept:  # the first call of this reader: take back what a dead run left deferred
            exclude: dict[str, list[int]] = {}
            for pending in self._uncompleted:
                for queue, numbers in (pending.get("queues") or {}).items():
                    exclude.setdefault(queue, []).extend(numbers)
            self._taken_back = self._sweep(exclude)
            self._swept = True
        cap = None if isinstance(limit, ReadAllAvailable) else getattr(limit, "max_rows", self.max_per_trigger)
        batch: dict[str, list[int]] = {}
        if self._ahead is not None:  # what the background receive deferred while the last batch ran
            ahead, self._ahead = self._ahead, None
            for queue, numbers in ahead.take().items():
                self._taken_back.setdefault(queue, []).extend(numbers)
        count = 0
        for queue in list(self._taken_back):
            numbers = self._taken_back.pop(queue)
            room = len(numbers) if cap is None else max(0, cap - count)
            batch[queue] = numbers[:room]
            count += len(batch[queue])
            if numbers[room:]:
                self._taken_back[queue] = numbers[room:]
        if cap is None or (count < cap and not self._started_ahead):
            for queue, numbers in self._defer(None if cap is None else cap - count).items():
                batch.setdefault(queue, []).extend(numbers)
                count += len(numbers)
        left = sum(len(v) for v in self._taken_back.values())
        if self.report_depth:
            depth = self._backlog_depth()
            self._depth = None if depth is None else depth + left
        if cap is not None and cap > left:  # receive the next batch while Spark runs this one
            self._ahead = _Ahead(self._defer, cap - left)
            self._started_ahead = True
        batch = {q: sorted(v) for q, v in batch.items() if v}
        if not batch:
            return start
        offset = {"batch": int(start.get("batch", 0)) + 1, "queues": batch}
        _LOGGER.info("backlog batch %d: %d messages deferred (backlog depth %s)", offset["batch"], count,
                     self._depth)
        return offset

    def _defer(self, cap: int | None, found: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
        """Receive up to ``cap`` messages (None: all there are) from the backlog queues in peek-lock and defer
        them; pings are completed. The queues share ``cap`` evenly (a queue with fewer leaves its share to the
        others), so that a batch's partitions (one per queue) run side by side. Returns (and records in
        ``found`` as it goes) the deferred sequence numbers by queue."""
        found = {} if found is None else found
        if cap is None:
            for queue in self.queues:
                self._defer_queue(queue, None, found)
            return found
        open_queues = list(self.queues)
        count = 0
        while open_queues and count < cap:
            round_queues = list(open_queues)
            for index, queue in enumerate(round_queues):
                share = -(-(cap - count) // (len(round_queues) - index))  # ceil: the rest goes to the queues left
                got = self._defer_queue(queue, share, found) if share > 0 else 0
                count += got
                if got < share:  # this queue has no more for now
                    open_queues.remove(queue)
        return found

    def _defer_queue(self, queue: str, cap: int | None, found: dict[str, list[int]]) -> int:
        """Receive and defer up to ``cap`` messages of one backlog queue; returns how many were deferred."""
        count = 0
        with shared_namespace(self.config, "secondary").receiver(queue) as receiver:
            wait = self.receive_timeout
            while cap is None or count < cap:
                want = PAGE if cap is None else min(PAGE, cap - count)
                page = receiver.receive_messages(max_message_count=want, max_wait_time=wait)
                if not page:
                    break
                wait = min(wait, 0.2)
                for message in page:
                    if msgs.is_ping(message):
                        receiver.complete_message(message)
                        continue
                    receiver.defer_message(message)
                    found.setdefault(queue, []).append(int(message.sequence_number or 0))
                    count += 1
        return count

    def reportLatestOffset(self) -> dict | None:
        if self._depth is None:
            return None
        return {"backlogDepth": self._depth}

    def _backlog_depth(self) -> int | None:
        try:
            with admin_client(self.config.secondary, retry_total=0) as admin:
                return sum(int(admin.get_queue_runtime_properties(q).active_message_count or 0) for q in self.queues)
        except Exception as exc:  # monitoring only: the batch does not depend on it
            _LOGGER.warning("backlog depth unavailable: %s", redact(str(exc))[:200])
            return None

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        if end == start:
            return []
        return [BacklogPartition(queue, tuple(numbers[i:i + _PARTITION]))
                for queue, numbers in sorted(end.get("queues", {}).items()) for i in range(0, len(numbers), _PARTITION)]

    def read(self, partition: InputPartition) -> Iterator[tuple]:
        assert isinstance(partition, BacklogPartition)
        now = datetime.datetime.now(datetime.UTC)
        with shared_namespace(self.config, "secondary").receiver(partition.queue) as receiver:
            found = peek_deferred(receiver, partition.sequence_numbers)
        yield from (backlog_row(m, partition.queue, now) for m in found)

    def commit(self, end: dict) -> None:
        """Complete what the batch's sink left deferred (the syphon's sink leaves nothing)."""
        self._complete(end)

    def _complete(self, offset: dict) -> None:
        """Complete the messages of the batch ending at ``offset`` that are still deferred (once)."""
        number = int(offset.get("batch", 0))
        queues = offset.get("queues") or {}
        if number <= self._completed_batch or not queues:
            return
        done = sum(len(complete_deferred(shared_namespace(self.config, "secondary", retries=False), queue, numbers))
                   for queue, numbers in queues.items())
        self._completed_batch = max(self._completed_batch, number)
        _LOGGER.log(logging.INFO if done else logging.DEBUG, "backlog batch %d committed: %d messages its sink "
                    "left deferred completed", number, done)

    def stop(self) -> None:
        """Wait for a receive ahead to end; what it deferred is taken back by the next run's first batch."""
        if self._ahead is not None:
            self._ahead.thread.join(self.receive_timeout * len(self.queues) + 30)
        _LOGGER.debug("backlog source stopped")


class _Ahead:
    """The next batch's receive, run in a background thread of the reader's process while Spark runs the
    current batch, so that deferring a batch does not add to its time. What it deferred is recorded as it
    goes: :meth:`take` returns it even when the receive failed half-way (the error is logged, and the next
    batch receives again). A reader that dies leaves these messages deferred, and the next run's first batch
    takes them back, as any deferred message of a dead run."""

    def __init__(self, defer: Any, cap: int) -> None:
        self.found: dict[str, list[int]] = {}
        self.thread = threading.Thread(target=self._run, args=(defer, cap), name="spark-sb-backlog-ahead",
                                       daemon=True)
        self.thread.start()

    def _run(self, defer: Any, cap: int) -> None:
        try:
            defer(cap, self.found)
        except Exception as exc:  # the messages deferred so far are kept; the next batch receives again
            _LOGGER.warning("receiving the next backlog batch ahead failed (%s); receiving it in the next batch",
                            redact(str(exc))[:200])

    def take(self) -> dict[str, list[int]]:
        self.thread.join()
        return self.found
