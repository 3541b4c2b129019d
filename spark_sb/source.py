"""Two Python streaming data sources over Service Bus, one machinery (spark.md, "The syphon"):

* ``servicebus-backlog``: every backlog queue of a primary, each message restored (the syphon reads it);
* ``servicebus``: one queue or topic subscription on the primary, the secondary or both (the receiving side
  of active and passive replication; follow it with :func:`spark_sb.dedupe` to drop the second copy).

A queue is not replayable by itself, so both keep Service Bus as the only store by **deferring**
(:class:`DeferringStreamReader`):

* ``latestOffset`` receives up to ``maxMessagesPerTrigger`` messages in peek-lock from the entities and defers
  them (a deferred message stays in its entity, is never delivered again, and is fetched by sequence number).
  Pings are completed at once: they never become rows. The offset is a JSON dict holding the batch's messages:
  ``{"batch": n, "queues": {queue: [sequence numbers]}}`` (backlog) or ``{"batch": n, "entities":
  {"primary:orders": [...], "secondary:orders": [...]}}`` (servicebus);
* ``partitions`` gives partitions of at most 1,000 sequence numbers of one entity (the backlog source: one per
  backlog queue, so that one task republishes a queue's messages in order); ``read`` (on an executor)
  **peeks** them by sequence number, which neither locks them nor counts a delivery, and turns each into a
  row: a replayed batch reads the same rows, and a reader that dies holds no lock;
* messages are completed only after the batch's sink finished. The syphon's sink
  (:class:`spark_sb.republisher.Republisher`) settles each backlog message itself once the primary accepted
  its restored copy and its ledger recorded the outcome; ``commit`` (Spark calls it after the batch's sink
  finished) completes whatever of the batch is still deferred, which for the ``servicebus`` source is all of
  it. Spark calls ``commit`` only when it plans the next batch; ``latestOffset(start)`` therefore does the
  same for the batch ending at ``start`` (only called once that batch finished), so an idle stream leaves
  nothing deferred behind;
* the first ``latestOffset`` of a reader (a new query, or a restart from a checkpoint) peeks its entities for
  messages left deferred by a run that died between deferring them and Spark recording its offset, or by an
  abandoned checkpoint, and takes them back into its batch. So one query at a time reads an entity: the
  source owns its deferred messages;
* a namespace that does not answer (an outage) is logged and left out of the batch, and tried again at the
  next one: with ``namespaces=primary,secondary`` the stream goes on from the namespace that is up. An entity
  not found or a credential rejected fails the query with a clear error, and so does a namespace host name that
  still does not resolve after ``readRetryTimeout`` (at most 30 s: a DNS blip passes). A backlog queue that does
  not exist yet (the pairing provisions them at the first failover) reads as empty;
* bounded runs end when they have read what was there, never before: ``trigger(availableNow=True)`` counts each
  entity's active messages at the start (a count the administration API does not give is asked again for up
  to ``readRetryTimeout``, then the run fails) and reads them, waiting as long for a namespace that stops
  answering, then failing with :class:`SourceUnavailableError`; ``trigger(once=True)`` (Spark 4.2's
  ``ReadAllAvailable``) reads what each entity holds when its one batch is planned.

Options (case-insensitive): the configuration **by reference**, so that no secret is written into Spark's plan,
progress or event log (:func:`config_options` builds these): ``conf`` (a YAML path) or ``config`` (JSON whose
secrets are ``${ENV_VAR}`` references, resolved where the reader runs), or flat options of
:func:`spark_sb.config.from_options` that hold no literal secret; ``maxMessagesPerTrigger`` (default
``syphon.max_messages_per_trigger`` for the backlog, 1,000 for ``servicebus``); ``receiveTimeout`` (seconds a
receive waits for the first message, default 1); ``reportBacklogDepth`` (default true); ``readRetryTimeout``
(seconds, default 120: how long a ``read`` of a planned batch retries a namespace that does not answer);
``receivesInFlight`` (default 8, for the backlog ``syphon.receives_in_flight``; at most 32: how many entities are
received from at once, each in a thread with its own connection; deferring costs a round trip per message, so
against a far namespace this multiplies the rate by the number of entities read at once). The ``servicebus``
source also takes ``entity`` (required: ``orders``, or ``events/subscriptions/all``) and ``namespaces``
(``primary``, ``secondary`` or ``primary,secondary``; default ``primary``); a batch read takes ``entity``,
``namespaces``, ``readRetryTimeout``, ``fromSequenceNumber``, ``toSequenceNumber`` and ``maxMessages``.

Refused at ``load()``, batch or stream (Spark calls the source's ``schema()`` there, :func:`_check_at_load`), as
the writer refuses them: an option the source does not take, named with a did-you-mean
(:func:`spark_sb.options.check_known`), and an entity that does not exist or needs sessions (a deferred session
message can be fetched only by the holder of its session's lock), asked of the administration API within
``admin_timeout`` (when it does not answer, ``load()`` goes on and the reader checks again when the query runs).
A stream reader that cannot be built fails the query with its own error (:class:`_RefusedStreamReader`).

Columns of ``servicebus`` (:data:`SERVICEBUS_SCHEMA`), in the style of the Kafka and Event Hubs sources:
``namespace`` (primary or secondary), ``entity``, ``message_id``, ``body`` (binary), ``sequence_number``,
``enqueued_time``, ``delivery_count``, ``session_id``, ``partition_key``, ``subject``, ``content_type``,
``correlation_id``, ``reply_to``, ``to``, ``time_to_live_ms``, ``application_properties`` (map of strings: each
value as text, a timestamp as its milliseconds since the epoch, a binary as base64) and
``application_property_types`` (map of strings: each property's AMQP type, ``int``, ``long``, ``double``,
``boolean``, ``timestamp``, ``string``..., as the service sent it, a described value as
``described:<descriptor>:<type>``; nulls left out). The columns are the ``servicebus`` writer's and the sink's
(:mod:`spark_sb.sink`): a row written back is sent with the same fields, TTL and property types. A dead-letter
queue's rows (:data:`DEAD_LETTER_SCHEMA`) add ``dead_letter_reason``, ``dead_letter_error_description`` and
``dead_letter_source``; the reason and description are not among their application properties.

Blips: a ``read`` runs a batch already planned (its sequence numbers are in the checkpoint and cannot change), so
a namespace that times out, drops the connection or is busy is retried with backoff for up to
``readRetryTimeout``, then the task fails with :class:`SourceUnavailableError` naming the namespace, the entity
and how long it tried (in local mode that ends the query: Spark does not retry a task there). A ``commit`` whose
completions fail that way fails nothing: they are retried by each later ``latestOffset`` until they succeed
(:class:`_Completions`; the messages stay deferred meanwhile), as ``latestOffset`` leaves out an entity whose
namespace does not answer.

Receiving ahead: from the second batch on, the next batch is received and deferred in a background thread of
the reader's process while Spark runs the current one (:class:`_Ahead`); ``latestOffset`` then only takes it.

Depth: PySpark 4.2's Python sources have no custom metrics, so the depth (active messages over the entities,
including the batch in flight, from the administration API) is reported through ``reportLatestOffset``, which
Spark shows as the source's ``latestOffset`` in the query progress (``{"backlogDepth": n}`` or
``{"activeMessages": n}``), and logged.

Readers keep no clients in ``self``: their receivers live in the per-process registry
(:mod:`spark_sb.bus`), as the sink's senders do.
"""

from __future__ import annotations

import base64
import datetime
import json
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from .capabilities import admission_control, require_python_data_sources, trigger_available_now

require_python_data_sources("spark_sb.source (the servicebus and servicebus-backlog sources, the syphon job)")

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition  # noqa: E402
from pyspark.sql.types import (  # noqa: E402
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from . import messages as msgs  # noqa: E402
from .bus import admin_client, shared_namespace  # noqa: E402
from .bus.deferred import PAGE, complete_deferred, deferred_numbers, peek_deferred  # noqa: E402
from .config import (  # noqa: E402
    DEAD_LETTER_SUFFIX,
    MAX_RECEIVE_BATCH,
    SparkSbConfig,
    entity_path,
    positive_duration,
    split_dead_letter,
)
from .errors import (  # noqa: E402
    ConfigError,
    EntityNotFoundError,
    ErrorClass,
    SourceUnavailableError,
    as_spark_sb_error,
    classify,
    is_blip,
    raise_if_refused,
    redact,
    unreachable_reason,
)
from .lifeline import watch_parent  # noqa: E402
from .options import check_known as _check_known  # noqa: E402
from .options import config_options  # noqa: E402
from .options import option as _option  # noqa: E402
from .options import options_config as _options_config  # noqa: E402
from .options import positive as _positive  # noqa: E402
from .paired.retry import ExponentialBackoff, RetryFor  # noqa: E402

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.connect.session import SparkSession as ConnectSession

if admission_control():  # Spark 4.2 and later
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
else:  # Spark 4.0 and 4.1: latestOffset() has no arguments, the reader applies its cap itself
    ReadAllAvailable = ReadLimit = ReadMaxRows = None  # type: ignore[assignment,misc]
if trigger_available_now():
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
    _AVAILABLE_NOW: tuple[type, ...] = (SupportsTriggerAvailableNow,)
else:
    _AVAILABLE_NOW = ()

_LOGGER = logging.getLogger(__name__)

__all__ = ["DEAD_LETTER_PROPERTIES", "DEAD_LETTER_SCHEMA", "SCHEMA", "SERVICEBUS_SCHEMA", "BacklogDataSource",
           "BacklogStreamReader", "DeferredPartition", "DeferringStreamReader", "Entity", "PeekPartition",
           "ServiceBusBatchReader", "ServiceBusDataSource", "ServiceBusStreamReader", "backlog_row", "config_options",
           "dead_letter_row", "dedupe", "register", "servicebus_row"]

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
SERVICEBUS_FORMAT = "servicebus"
#: the ``servicebus`` source's columns, in the style of the Kafka and Event Hubs sources
SERVICEBUS_SCHEMA = StructType([
    StructField("namespace", StringType(), False),  # primary or secondary
    StructField("entity", StringType(), False),
    StructField("message_id", StringType()),
    StructField("body", BinaryType()),
    StructField("sequence_number", LongType(), False),
    StructField("enqueued_time", TimestampType()),
    StructField("delivery_count", IntegerType()),
    StructField("session_id", StringType()),
    StructField("partition_key", StringType()),
    StructField("subject", StringType()),
    StructField("content_type", StringType()),
    StructField("correlation_id", StringType()),
    StructField("reply_to", StringType()),
    StructField("to", StringType()),
    StructField("time_to_live_ms", LongType()),
    StructField("application_properties", MapType(StringType(), StringType())),
    # each application property's AMQP type ("int", "timestamp", ...): the sink sends the text back as that type
    StructField("application_property_types", MapType(StringType(), StringType())),
])
#: the application properties in which the service hands a dead-lettered message's reason and description over
#: (a dead-letter row has them as ``dead_letter_reason`` and ``dead_letter_error_description``)
DEAD_LETTER_PROPERTIES = ("DeadLetterReason", "DeadLetterErrorDescription")
#: a batch read of a dead-letter queue: the ``servicebus`` columns (``entity`` names the queue or subscription the
#: dead-letter queue belongs to) and why the message was dead-lettered
DEAD_LETTER_SCHEMA = StructType([
    *SERVICEBUS_SCHEMA.fields,
    StructField("dead_letter_reason", StringType()),
    StructField("dead_letter_error_description", StringType()),
    StructField("dead_letter_source", StringType()),
])
#: guards the ``found`` dicts the receivers fill (module-level: Spark pickles the reader)
_FOUND_LOCK = threading.Lock()
#: at most this many messages per input partition: a batch from one queue still runs on several cores
_PARTITION = 1000
#: receives in flight by default (option ``receivesInFlight``; the backlog source's default is
#: ``syphon.receives_in_flight``): lanes, each a thread with its own connection, one per entity
RECEIVES_IN_FLIGHT = 8

#: the longest a namespace host name that does not resolve is taken for a DNS blip before it fails the query
RESOLVE_RETRY_SECONDS = 30.0

#: the options of a stream of either source, besides the configuration's (``conf``, ``config`` or flat options)
_STREAM_OPTIONS = ("maxMessagesPerTrigger", "receiveTimeout", "reportBacklogDepth", "readRetryTimeout",
                   "receivesInFlight")
#: the ``servicebus`` source's options in a stream, and in a batch read
_SERVICEBUS_STREAM_OPTIONS = ("entity", "namespaces", *_STREAM_OPTIONS)
_SERVICEBUS_BATCH_OPTIONS = ("entity", "namespaces", "readRetryTimeout", "fromSequenceNumber", "toSequenceNumber",
                             "maxMessages")


def register(spark: SparkSession | ConnectSession) -> None:
    """Register the ``servicebus`` and ``servicebus-backlog`` formats with ``spark``."""
    spark.dataSource.register(ServiceBusDataSource)
    spark.dataSource.register(BacklogDataSource)


def dedupe(df: DataFrame, window: str | float | datetime.timedelta = "10 minutes", *, id_column: str = "message_id",
           time_column: str = "enqueued_time") -> DataFrame:
    """Drop the second copy of each message of a streaming DataFrame (the ``servicebus`` source over both
    namespaces in active or passive replication): Spark's ``withWatermark(time_column, window)`` followed by
    ``dropDuplicatesWithinWatermark([id_column])``. Spark keeps each id in the query's state store (in its
    checkpoint, so a restart remembers it) until the watermark passes its first copy's time by ``window``: a
    copy that arrives later than that is kept. Choose ``window`` longer than the longest time between the two
    copies (for passive replication, the longest outage); a longer window keeps more state.

    ``window``: a duration as Spark writes it (``"10 minutes"``) or as the configuration does (``"10m"``,
    seconds, a ``timedelta``). A bad window or a missing column raises :class:`~spark_sb.errors.ConfigError`
    naming it."""
    span = positive_duration(window, "window")
    for option, column in (("id_column", id_column), ("time_column", time_column)):
        if column not in df.columns:
            raise ConfigError(option, f"is not a column of the DataFrame (columns: {', '.join(df.columns)})", column)
    milliseconds = max(1, round(span.total_seconds() * 1000))
    return df.withWatermark(time_column, f"{milliseconds} milliseconds").dropDuplicatesWithinWatermark([id_column])


class BacklogDataSource(DataSource):
    """``spark.readStream.format("servicebus-backlog")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        """Spark calls this at ``load()``, before the query starts: an option the source does not take, or a
        configuration that does not load, is refused there."""
        _check_known(self.options, _STREAM_OPTIONS, f"{FORMAT} source")
        _options_config(self.options)
        return SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return _stream_reader(lambda: BacklogStreamReader(self.options))


class ServiceBusDataSource(DataSource):
    """``spark.readStream.format("servicebus")``: a queue or topic subscription of one or both namespaces;
    ``spark.read.format("servicebus")``: a peek of one, or of its dead-letter queue. See the module docstring."""

    @classmethod
    def name(cls) -> str:
        return SERVICEBUS_FORMAT

    def schema(self) -> StructType:
        """Spark calls this at ``load()``, batch or stream alike, before anything runs: what the source cannot do is
        refused there (:func:`_check_at_load`)."""
        path = _check_at_load(self.options)
        return DEAD_LETTER_SCHEMA if split_dead_letter(path)[1] else SERVICEBUS_SCHEMA

    def reader(self, schema: StructType) -> ServiceBusBatchReader:
        return ServiceBusBatchReader(self.options)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return _stream_reader(lambda: ServiceBusStreamReader(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> Any:
        """``df.write.format("servicebus").save()``: see :mod:`spark_sb.writer`."""
        from .writer import ServiceBusBatchWriter

        return ServiceBusBatchWriter(self.options, schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> Any:
        """``df.writeStream.format("servicebus")``: see :mod:`spark_sb.writer`."""
        from .writer import stream_writer

        return stream_writer(self.options, schema, overwrite)


@dataclass(frozen=True)
class Entity:
    """An entity a reader reads: ``path`` (a queue, or ``topic/subscriptions/name``) on ``side``'s namespace;
    ``key`` names it in the offsets."""

    key: str
    side: Literal["primary", "secondary"]
    path: str


def _check_at_load(options: Mapping[str, str]) -> str:
    """What ``load()`` refuses, batch or stream alike, and the entity's path. Spark calls a Python data source's
    ``schema()`` there (unless the user gave a schema); ``reader()`` only when a batch read runs and
    ``streamReader()`` only once the stream has started, in its own thread, and both check again: an option
    neither reading takes (with a did-you-mean), a bad ``entity`` or ``namespaces``, a configuration that does not
    load, an entity that does not exist or requires sessions, a credential the namespace refuses (a wrong key or
    token; one that lacks only the Manage right may still read). The entity is asked about through each namespace's
    administration API (:func:`_ask_admin`: one request within its ``admin_timeout``); a namespace whose API does
    not answer delays ``load()`` by that much and refuses nothing: the reader checks again when the query runs."""
    _check_known(options, dict.fromkeys((*_SERVICEBUS_STREAM_OPTIONS, *_SERVICEBUS_BATCH_OPTIONS)),
                 f"{SERVICEBUS_FORMAT} source")
    path = _entity_option(options)
    sides = _namespaces_option(options)
    config = _options_config(options)
    for side in sides:
        unanswered = _ask_admin(config, Entity(f"{side}:{path}", side, path))
        if unanswered is not None:
            _LOGGER.warning("%s %r: the administration API of the %s did not answer (%s: %s); the entity is checked "
                            "again when the query runs", SERVICEBUS_FORMAT, path, side, type(unanswered).__name__,
                            redact(str(unanswered))[:200])
    return path


def _lacks_manage_right(exc: BaseException) -> bool:
    """The administration API refused a valid credential that lacks the Manage right (``'Manage' claim(s) are
    required``): reading needs only Listen, so the check falls back to a peek instead of refusing."""
    return "claim" in str(exc).lower() and "required" in str(exc).lower()


def _ask_admin(config: SparkSbConfig, entity: Entity) -> Exception | None:
    """Check ``entity`` through its namespace's administration API (one request, bounded by the namespace's
    ``admin_timeout``): :class:`EntityNotFoundError` when it does not exist, :class:`ConfigError` when it requires
    sessions (its dead-letter queue never does). Returns what failed when the API did not answer (an outage, or a
    credential without the Manage right, which reading does not need), else None."""
    namespace = getattr(config, entity.side)
    base, dead_letter = split_dead_letter(entity.path)
    topic, marker, subscription = base.partition("/subscriptions/")
    try:
        with admin_client(namespace, retry_total=0) as admin:
            found = admin.get_subscription(topic, subscription) if marker else admin.get_queue(base)
    except Exception as exc:
        if not _lacks_manage_right(exc):  # a wrong key or token is raised at once, never taken for an outage
            raise_if_refused(exc, f"{entity.side} {namespace.fully_qualified_namespace}", entity=entity.path)
        if classify(exc) is not ErrorClass.CONFIGURATION_NOT_FOUND:
            return exc
        raise EntityNotFoundError(f"{entity.side} {namespace.fully_qualified_namespace}", base, "the servicebus "
                                  "source reads a queue or a topic subscription (topic/subscriptions/name), or its "
                                  "dead-letter queue (.../$DeadLetterQueue)") from exc
    if found.requires_session and not dead_letter:
        instead = (f"a subscription of {topic} without sessions" if marker else "a queue without sessions")
        raise ConfigError("entity", f"requires sessions on the {entity.side} ({namespace.fully_qualified_namespace}): "
                          "the servicebus source cannot read it (it defers each batch's messages and reads them back "
                          "by sequence number, which a session entity allows only to the holder of each session's "
                          f"lock); read {instead}, or receive this one with the SDK's session receiver", entity.path)
    return None


class _RefusedStreamReader(DataSourceStreamReader, *_AVAILABLE_NOW):  # type: ignore[misc]
    """What ``streamReader()`` returns when the reader could not be built: each call Spark makes raises that
    error, and ``stop`` does nothing. PySpark's streaming source runner (4.2; Apache Spark's 4.1 source reads the
    same) builds the reader inside a ``try`` whose ``finally`` stops it, so an error raised by ``streamReader()``
    itself reaches the user as ``UnboundLocalError: cannot access local variable 'reader'``, the real error only
    in its context (and not at all with ``SPARK_HIDE_TRACEBACK``); raised by the first call instead, it is what the
    query fails with."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error

    initialOffset = latestOffset = partitions = read = commit = getDefaultReadLimit = _refuse
    prepareForTriggerAvailableNow = reportLatestOffset = _refuse

    def stop(self) -> None:
        pass


def _stream_reader(build: Callable[[], DataSourceStreamReader]) -> DataSourceStreamReader:
    """``build()``, or a reader raising its error from Spark's first call (see :class:`_RefusedStreamReader`)."""
    try:
        return build()
    except Exception as exc:
        return _RefusedStreamReader(exc)


@dataclass(frozen=True)
class DeferredPartition(InputPartition):
    """Some of one entity's deferred messages of a batch (at most ``_PARTITION``; the backlog source's: all)."""

    key: str
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
    utc: datetime.datetime = value.astimezone(datetime.UTC)
    return utc


def backlog_row(received: Any, queue: str, now: datetime.datetime) -> tuple[Any, ...]:
    """The row of one received backlog message (see :data:`SCHEMA`)."""
    text = msgs.text
    enqueued = _utc(received.enqueued_time_utc)
    try:
        restored = msgs.from_backlog(received, now, fast=False)  # a row reads every field: the SDK's message
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


def servicebus_row(received: Any, entity: Entity, now: datetime.datetime, *, leave_out: Collection[str] = ()
                   ) -> tuple[Any, ...]:
    """The row of one message of the ``servicebus`` source (see :data:`SERVICEBUS_SCHEMA`), without the application
    properties named in ``leave_out``. Each property's text is what :func:`_property_text` makes of it (a binary
    as base64), and its AMQP type is in ``application_property_types`` (:func:`spark_sb.messages.property_types`),
    so that the sink sends it back as it was."""
    text = msgs.text
    ttl = received.time_to_live
    types = msgs.property_types(received)
    properties: dict[str, str | None] = {}
    for key, value in (received.application_properties or {}).items():
        name = text(key) or ""  # a name is never null on the wire
        if name in leave_out:
            continue
        # a binary, or a described binary (described:<descriptor>:binary)
        binary = types.get(name, "").rpartition(":")[2] == "binary" and isinstance(value, bytes | bytearray)
        properties[name] = base64.b64encode(value).decode("ascii") if binary else _property_text(value)
    kept_types = {name: kind for name, kind in types.items() if name in properties}
    return (entity.side, entity.path, text(received.message_id), _body(received), int(received.sequence_number),
            _utc(received.enqueued_time_utc), received.delivery_count, text(received.session_id),
            text(received.partition_key), text(received.subject), text(received.content_type),
            text(received.correlation_id), text(received.reply_to), text(received.to),
            None if ttl is None else ttl // datetime.timedelta(milliseconds=1), properties or None, kept_types or None)


class _EntityAccess:
    """What every reader of entities shares: the namespaces through the process's registry (no client is kept in
    the reader), where an entity lives for messages, blips retried within ``readRetryTimeout``, and the check
    made before anything starts."""

    config: SparkSbConfig
    read_retry_timeout: float
    #: what the log lines and errors call the reader
    WHAT = "servicebus"
    #: whether an entity that does not exist is read as empty (a backlog queue not provisioned yet) rather than
    #: failing the query (the entity a user named)
    MISSING_IS_EMPTY = False
    #: entity key -> when its namespace first failed to answer since it last answered
    _failing: dict[str, float]
    #: time for the retries of a read (injectable: tests run the bound in milliseconds)
    _clock: Any = staticmethod(time.monotonic)
    _sleep: Any = staticmethod(time.sleep)
    _read_backoff = ExponentialBackoff(0.5, 8.0, jitter=True)

    def _namespace(self, entity: Entity, *, retries: bool = True, lane: int = 0) -> Any:
        return shared_namespace(self.config, entity.side, retries=retries, lane=lane)

    def _where(self, entity: Entity) -> str:
        return f"{entity.side} {getattr(self.config, entity.side).fully_qualified_namespace}"

    def _unavailable(self, entity: Entity, what: str, exc: Exception) -> None:
        """An entity failed ``what``: a configuration error is raised; anything else (an outage) is logged and
        the entity is left for the next batch. A host name that does not resolve is an outage only for a short
        while (DNS can blip): once its namespace has failed that way for :meth:`_resolve_bound` seconds since it
        last answered, it is a configuration error naming the host."""
        converted = as_spark_sb_error(exc, namespace=self._where(entity), entity=entity.path)
        if converted is not None and classify(converted) is not ErrorClass.BAD_MESSAGE:
            if self.MISSING_IS_EMPTY and classify(converted) is ErrorClass.CONFIGURATION_NOT_FOUND:
                _LOGGER.debug("%s %r on the %s does not exist (yet): nothing to read there", self.WHAT, entity.path,
                              entity.side)
                return
            raise converted from exc
        with _FOUND_LOCK:
            since = self._failing.setdefault(entity.key, self._clock())
        failed_for = self._clock() - since
        if unreachable_reason(exc) == "host not found" and failed_for >= self._resolve_bound():
            namespace = getattr(self.config, entity.side)
            raise ConfigError(f"{entity.side}.fully_qualified_namespace", f"the host name does not resolve (tried "
                              f"for {failed_for:.0f} s: {type(exc).__name__}: {redact(str(exc))[:200]}); check the "
                              f"namespace's name (its connection string's Endpoint) and the cluster's DNS; nothing "
                              f"was read from it", namespace.fully_qualified_namespace) from exc
        _LOGGER.warning("%s %r on the %s: %s failed (%s: %s); trying again next batch", self.WHAT, entity.path,
                        entity.side, what, type(exc).__name__, redact(str(exc))[:200])

    def _answered(self, entity: Entity) -> None:
        """The entity's namespace answered: it is failing no more."""
        with _FOUND_LOCK:
            self._failing.pop(entity.key, None)

    def _resolve_bound(self) -> float:
        """How long a host name that does not resolve is taken for a blip: ``readRetryTimeout``, at most 30 s."""
        return min(self.read_retry_timeout, RESOLVE_RETRY_SECONDS)

    def _retrying(self, entity: Entity, what: str, attempt: Any) -> Any:
        """``attempt()``, again with backoff while it fails with a blip (a timeout, a lost connection, a busy
        namespace) for up to ``readRetryTimeout``; then :class:`SourceUnavailableError`, which says what it tried
        for how long and that nothing was lost. Anything else (a configuration error) is raised at once,
        converted as the sink converts it."""
        started = self._clock()

        def give_up(exc: Exception, failures: int, elapsed: float) -> SourceUnavailableError:
            return SourceUnavailableError(
                f"{self.WHAT} {entity.path!r} on the {self._where(entity)}: {what} failed for "
                f"{self._clock() - started:.0f} s ({failures} attempts, within readRetryTimeout "
                f"{self.read_retry_timeout:g} s); the last error: {type(exc).__name__}: {redact(str(exc))[:300]}. "
                "Nothing was lost: the batch's messages stay deferred in their entity, and a restarted query reads "
                "the same batch again from its checkpoint (raise the readRetryTimeout option to ride out longer "
                "outages)")

        retry = RetryFor(self.read_retry_timeout, self._read_backoff, clock=self._clock, sleep=self._sleep)
        try:
            return retry.call(attempt, is_blip, what=f"{self.WHAT} {entity.path!r} on the {entity.side}: {what}",
                              give_up=give_up)
        except SourceUnavailableError:
            raise
        except Exception as exc:
            converted = as_spark_sb_error(exc, namespace=self._where(entity), entity=entity.path)
            if converted is None:
                raise
            raise converted from exc

    def _check(self, entity: Entity) -> None:
        """Before anything starts: the entity exists and needs no session (the administration API says,
        :func:`_ask_admin`; when it cannot answer, a peek shows at least that the entity exists). An outage is
        logged, not raised."""
        unanswered = _ask_admin(self.config, entity)
        if unanswered is None:
            return
        _LOGGER.info("the administration API of the %s did not answer (%s); checking %r by a peek", entity.side,
                     type(unanswered).__name__, entity.path)
        try:
            with self._namespace(entity).receiver(entity.path) as receiver:
                receiver.peek_messages(max_message_count=1)
        except Exception as peek_error:
            self._unavailable(entity, "checking the entity", peek_error)


def _in_session(message: Any) -> bool:
    """Whether a backlog message carries ``x-ms-sessionid`` (it was parked from a session)."""
    return any(msgs.text(key) == msgs.X_MS_SESSION_ID for key in (message.application_properties or {}))


class _CountUnknown(Exception):
    """The administration API gave no active message count for some entities (retried, then a
    :class:`SourceUnavailableError`)."""


class _Completions:
    """The completions a reader owes. A batch's messages are completed once its sink finished (``commit``, or
    the next ``latestOffset``); a batch whose completion failed (a namespace's blip) stays pending and is tried
    again at each later ``latestOffset`` until it succeeds, whatever batches complete after it. Completing a
    batch twice is harmless (its messages are gone), so the batches done are remembered only to spare a second
    attempt's requests."""

    #: how many completed batch numbers are remembered
    REMEMBERED = 1024

    def __init__(self, complete: Callable[[dict[str, Any]], None], field: str, what: str) -> None:
        self._complete = complete
        self._field = field
        self._what = what
        self.pending: list[dict[str, Any]] = []
        self._done: dict[int, None] = {}  # insertion-ordered: the oldest is forgotten first

    def numbers(self) -> dict[str, set[int]]:
        """The sequence numbers of the batches whose completion is pending, by entity key."""
        numbers: dict[str, set[int]] = {}
        for offset in self.pending:
            for key, batch in (offset.get(self._field) or {}).items():
                numbers.setdefault(key, set()).update(batch)
        return numbers

    def complete(self, offset: dict[str, Any]) -> None:
        """Complete ``offset``'s batch unless done already; when that fails, it is pending and the error raised."""
        number = int(offset.get("batch", 0))
        if number in self._done or not offset.get(self._field):
            return
        try:
            self._complete(offset)
        except Exception:
            if offset not in self.pending:
                self.pending.append(offset)
            raise
        if offset in self.pending:
            self.pending.remove(offset)
        self._done[number] = None
        while len(self._done) > self.REMEMBERED:
            del self._done[next(iter(self._done))]

    def retry(self, latest: dict[str, Any]) -> None:
        """Complete every pending batch, then ``latest``; a failure is logged and its batch stays pending."""
        for offset in [*self.pending, latest]:
            try:
                self.complete(offset)
            except Exception as exc:  # its messages stay deferred meanwhile (out of every batch)
                _LOGGER.warning("completing %s batch %s failed (%s: %s); trying again with the next batch",
                                self._what, offset.get("batch"), type(exc).__name__, redact(str(exc))[:200])


# mypy cannot follow a starred base: SupportsTriggerAvailableNow where pyspark has it (4.2), else none
class DeferringStreamReader(_EntityAccess, DataSourceStreamReader, *_AVAILABLE_NOW):  # type: ignore[misc]
    """The machinery both sources share (see the module docstring): deferring in ``latestOffset``, peeking by
    sequence number in ``read``, completing in ``commit``, taking back what a dead run left deferred, receiving
    ahead. A subclass names its entities and turns a peeked message into a row (:meth:`row`).

    An entity whose namespace fails to answer (an outage) is logged and left out of the batch; the next batch
    tries it again, so one namespace down never stops the stream. A configuration error (an entity not found, a
    credential rejected) fails the query: it needs a person.

    Spark 4.2 passes ``latestOffset`` the batch that just finished and a read limit (admission control); Spark 4.0
    and 4.1 pass neither: the reader then starts from the newest offset it returned or that Spark planned
    (``partitions`` names the checkpoint's last batch when a query restarts) and caps each batch at
    ``maxMessagesPerTrigger`` itself. Where Spark offers ``Trigger.AvailableNow`` (4.2), the reader supports it:
    it reads what its entities held when the query started, and stops."""

    #: the offsets' field holding ``{entity key: [sequence numbers]}``
    OFFSET_FIELD = "queues"
    #: the field of :meth:`reportLatestOffset` holding the entities' active message count
    DEPTH_FIELD = "backlogDepth"
    #: what the log lines call a batch
    WHAT = "backlog"
    #: whether the sink settles the batch's messages itself (the syphon's republisher does): the commit then
    #: peeks for what is left before completing it; else it completes the whole batch in bulk at once
    SINK_SETTLES = True
    #: at most this many sequence numbers per input partition (None: one partition per entity)
    PARTITION_SIZE: int | None = _PARTITION

    def __init__(self, options: Mapping[str, str], config: SparkSbConfig, entities: Sequence[Entity],
                 default_max: int, default_lanes: int = 0) -> None:
        watch_parent()  # a Spark-started reader process ends with its driver (spark_sb.lifeline)
        self.options = dict(options)
        self.config = config
        self.entities = tuple(entities)
        self._by_key = {e.key: e for e in self.entities}
        self.max_per_trigger = int(_positive(self.options, "maxMessagesPerTrigger", default_max,
                                             most=MAX_RECEIVE_BATCH))
        self.receive_timeout = float(_positive(self.options, "receiveTimeout", 1.0, float, most=300))
        self.read_retry_timeout = float(_positive(self.options, "readRetryTimeout", 120.0, float, most=3600))
        self.receives_in_flight = int(_positive(self.options, "receivesInFlight", default_lanes or RECEIVES_IN_FLIGHT,
                                                most=32))
        depth = (_option(self.options, "reportBacklogDepth") or "true").lower()
        self.report_depth = depth in ("true", "1", "yes")
        self._taken_back: dict[str, list[int]] = {}
        #: backlog messages of a session its sink left (destination down): kept deferred, offered again first
        self._held: dict[str, list[int]] = {}
        self._unswept = [e.key for e in self.entities]  # not received from until swept (see _sweep)
        self._completions = _Completions(self._complete, self.OFFSET_FIELD, self.WHAT)
        #: entity key -> when its namespace first failed to answer, since it last answered (see _unavailable)
        self._failing: dict[str, float] = {}
        self._depth: int | None = None
        self._ahead: _Ahead | None = None
        self._started_ahead = False  # batches after the first are received ahead, in the background
        self._last: dict[str, Any] | None = None  # the newest offset returned or planned (the start on Spark 4.0 and 4.1)
        #: Trigger.AvailableNow: per entity key, how many of the messages it held at the start are still to read
        self._available_now: dict[str, int] | None = None

    def row(self, received: Any, entity: Entity, now: datetime.datetime) -> tuple[Any, ...]:
        raise NotImplementedError

    # --- offsets -------------------------------------------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:
        """A fresh checkpoint starts at batch 0; messages an abandoned run left deferred are taken back by the
        first :meth:`latestOffset`."""
        return {"batch": 0, self.OFFSET_FIELD: {}}

    def _sweep(self) -> None:
        """Take back every deferred message of the entities not swept yet (but those this reader knows: of
        batches whose completion is pending, or deferred and not yet in a batch): left by a run that died, or by
        a receive of this reader that failed part way (a message deferred at the broker whose answer was lost).
        An entity is received from only once swept, so that a sweep never races a receive of this reader."""
        exclude: dict[str, set[int]] = {key: set(numbers) for key, numbers in self._taken_back.items()}
        for key, numbers in self._held.items():
            exclude.setdefault(key, set()).update(numbers)
        for key, pending in self._completions.numbers().items():
            exclude.setdefault(key, set()).update(pending)
        taken: dict[str, int] = {}
        for key in list(self._unswept):
            entity = self._by_key[key]
            try:
                with self._namespace(entity).receiver(entity.path) as receiver:
                    numbers = [n for n in deferred_numbers(receiver) if n not in exclude.get(key, set())]
            except Exception as exc:
                self._unavailable(entity, "taking back what an earlier run left deferred", exc)
                continue
            self._answered(entity)
            self._unswept.remove(key)
            if numbers:
                self._taken_back.setdefault(key, []).extend(numbers)
                taken[key] = len(numbers)
        if taken:
            _LOGGER.warning("taking back %d %s messages left deferred by an earlier run: %s", sum(taken.values()),
                            self.WHAT, taken)

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        """``trigger(availableNow=True)``: read the messages the entities hold now (their active message count,
        from the administration API, plus what earlier runs left deferred) and stop; messages sent after this
        wait for the next run. A count the administration API does not give is asked again for up to
        ``readRetryTimeout``, then the run fails (:class:`SourceUnavailableError`): it never ends short and
        calls it done. What happens when an entity still owes messages but gives none: :meth:`_await_owed`."""
        self._available_now = self._known_counts(self.entities, "Trigger.AvailableNow")
        _LOGGER.info("%s: Trigger.AvailableNow: reading the messages there now: %s", self.WHAT, self._available_now)

    def _known_counts(self, entities: Sequence[Entity], doing: str) -> dict[str, int]:
        """The active message count of each of ``entities`` (by key); an entity whose administration API does not
        answer is asked again with backoff for up to ``readRetryTimeout``, then :class:`SourceUnavailableError`
        names it."""
        counts: dict[str, int] = {}
        started = self._clock()

        def attempt() -> dict[str, int]:
            counts.update(self._active_counts([e for e in entities if e.key not in counts]))
            unknown = [e.key for e in entities if e.key not in counts]
            if unknown:
                raise _CountUnknown(f"no active message count for {', '.join(unknown)}")
            return counts

        def give_up(exc: Exception, failures: int, elapsed: float) -> SourceUnavailableError:
            return SourceUnavailableError(
                f"{self.WHAT}: {doing}: {exc} from the administration API for {self._clock() - started:.0f} s "
                f"({failures} attempts, within readRetryTimeout {self.read_retry_timeout:g} s), so what to read "
                "is not known: the run stops here rather than end short. Nothing was read or lost; run it again "
                "once the namespace's administration endpoint answers")

        retry = RetryFor(self.read_retry_timeout, self._read_backoff, clock=self._clock, sleep=self._sleep)
        return retry.call(attempt, lambda exc: isinstance(exc, _CountUnknown), what=f"{self.WHAT}: {doing}",
                          give_up=give_up)

    def latestOffset(self, start: dict[str, Any] | None = None, limit: ReadLimit | None = None) -> dict[str, Any]:
        if start is None:  # Spark 4.0 and 4.1: no admission control, the reader keeps its start and its cap
            start = self._last if self._last is not None else self.initialOffset()
        offset = self._next_offset(start, limit)
        self._last = offset
        return offset

    def _next_offset(self, start: dict[str, Any], limit: ReadLimit | None) -> dict[str, Any]:
        # the batch ending at ``start`` finished: complete what its sink left deferred, and every earlier batch
        # whose completion failed
        self._completions.retry(start)
        if self._ahead is not None:  # what the background receive deferred while the last batch ran
            ahead, self._ahead = self._ahead, None
            for key, numbers in ahead.take().items():
                self._taken_back.setdefault(key, []).extend(numbers)
        once: dict[str, int] | None = None
        if limit is None:
            cap = self.max_per_trigger
        elif isinstance(limit, ReadAllAvailable):  # Trigger.Once: what is there now, not what keeps arriving
            once = self._read_all_available()
            cap = sum(len(v) for v in self._taken_back.values()) + sum(once.values())
        else:
            cap = int(getattr(limit, "max_rows", self.max_per_trigger))
        batch, count = self._gather(cap, once)
        if self._available_now is not None and not count:
            batch, count = self._await_owed(cap)
        if self._held and (count or (self._available_now is None and once is None)):
            # the sessions' messages the sink left come again first, ahead of their sessions' later ones, and
            # outside the cap (a destination that stays down never crowds the others out); a bounded run
            # (availableNow, once) offers them only with new messages, and leaves them for the next run
            held, self._held = self._held, {}
            for key, numbers in held.items():
                batch.setdefault(key, []).extend(numbers)
        left = sum(len(v) for v in self._taken_back.values())
        if self.report_depth:
            counts = self._active_counts()
            self._depth = sum(counts.values()) + left if counts else None
        if cap > left and self._available_now is None and once is None:  # receive the next batch meanwhile
            self._ahead = _Ahead(self._defer, cap - left, self.WHAT)
            self._started_ahead = True
        batch = {k: sorted(set(v)) for k, v in batch.items() if v}
        if not batch:
            return start
        offset = {"batch": int(start.get("batch", 0)) + 1, self.OFFSET_FIELD: batch}
        _LOGGER.info("%s batch %d: %d messages deferred (depth %s)", self.WHAT, offset["batch"], count, self._depth)
        return offset

    def _read_all_available(self) -> dict[str, int]:
        """``ReadAllAvailable`` (``trigger(once=True)``): per entity key, the messages it holds now (its active
        count; ``maxMessagesPerTrigger`` for an entity whose administration API does not answer), so that a run
        reads what was there when it started and ends, however fast messages keep arriving."""
        counts = self._active_counts()
        unknown = [e.key for e in self.entities if e.key not in counts]
        if unknown:
            _LOGGER.warning("%s: no active message count for %s: reading at most maxMessagesPerTrigger (%d) of each",
                            self.WHAT, unknown, self.max_per_trigger)
        return {e.key: counts.get(e.key, self.max_per_trigger) for e in self.entities}

    def _gather(self, cap: int, owed: dict[str, int] | None = None) -> tuple[dict[str, list[int]], int]:
        """Up to ``cap`` messages for the next batch: first those taken back (left deferred by an earlier run or
        received ahead), then received and deferred now (but once receiving ahead took over)."""
        if self._unswept:  # the first call of this reader, an entity unreachable until now, or a receive failed
            self._sweep()
        batch: dict[str, list[int]] = {}
        count = 0
        for key in list(self._taken_back):
            numbers = sorted(self._taken_back.pop(key))  # the oldest first: the rest waits behind them
            room = max(0, cap - count)
            batch[key] = numbers[:room]
            count += len(batch[key])
            if numbers[room:]:
                self._taken_back[key] = numbers[room:]
        if count < cap and not self._started_ahead:
            for key, numbers in self._defer(cap - count, owed=owed).items():
                batch.setdefault(key, []).extend(numbers)
                count += len(numbers)
        return batch, count

    def _defer(self, cap: int, found: dict[str, list[int]] | None = None, owed: dict[str, int] | None = None
               ) -> dict[str, list[int]]:
        """Receive up to ``cap`` messages from the swept entities in peek-lock and defer them; pings are
        completed. Returns (and records in ``found``) the deferred sequence numbers by entity key. ``owed`` (by
        default Trigger.AvailableNow's) bounds what each entity gives, and is decremented by what it gave.

        Deferring costs a round trip per message (the SDK settles one message at a time), so against a far
        namespace one receiver defers at most one message per round trip. The receives therefore run on up to
        ``receivesInFlight`` **lanes** at once (:meth:`_lanes`): a lane is one thread with its own receivers
        (its own connections), for one entity or, when there are more entities than lanes, a few entities one
        after the other. The entities share ``cap`` evenly, and an entity's lanes its share; one that gives fewer
        than its share (it has no more for now) leaves the rest to the others in another round. Lanes number
        from 1: lane 0 is the reader's own (sweeps, completions), so that no two threads ever pump one
        receiver."""
        found = {} if found is None else found
        owed = self._available_now if owed is None else owed
        ready = [e for e in self.entities if e.key not in self._unswept and (owed is None or owed[e.key] > 0)]
        if not ready or cap <= 0:
            return found
        open_work = self._lanes(ready)
        count = 0
        threads = list(dict.fromkeys((entity.side, lane) for entity, lane in open_work))
        with ThreadPoolExecutor(len(threads), thread_name_prefix=f"spark-sb-{self.WHAT}-receive") as pool:
            while open_work and count < cap:
                shares = self._shares(open_work, cap - count, owed)
                open_work = [unit for unit in open_work if shares[unit] > 0]
                futures = [pool.submit(self._defer_lane, [u for u in open_work if (u[0].side, u[1]) == thread],
                                       shares, found) for thread in threads]
                for future in futures:
                    for unit, got in future.result():
                        count += got
                        if owed is not None and owed[unit[0].key] > 0:
                            owed[unit[0].key] -= got
                        if got < shares[unit]:  # this entity has no more for now (or did not answer)
                            open_work.remove(unit)
        return found

    def _lanes(self, ready: Sequence[Entity]) -> list[tuple[Entity, int]]:
        """The (entity, lane) units of a receive: a lane per entity (two for an entity read alone), at most
        ``receivesInFlight`` lanes (they wrap round when there are more entities). One receiver per entity: with
        four per queue, bench/syphon.py's job on loopback fell to 0.76 of the raw loop (0.92 with one), and one
        run of three stalled for about a lock duration (the SDK's two listening threads, since serialised:
        :func:`spark_sb.bus._namespace._one_listener`)."""
        per = 2 if len(ready) == 1 else 1
        units = [entity for entity in ready for _ in range(per)]
        return [(entity, 1 + i % self.receives_in_flight) for i, entity in enumerate(units)]

    @staticmethod
    def _shares(units: Sequence[tuple[Entity, int]], left: int, owed: Mapping[str, int] | None
                ) -> dict[tuple[Entity, int], int]:
        """``left`` messages shared out evenly over ``units``; under Trigger.AvailableNow no entity's lanes
        together take more than the entity still owes."""
        shares = {unit: left // len(units) + (1 if i < left % len(units) else 0) for i, unit in enumerate(units)}
        if owed is not None:
            room = {key: n for key, n in owed.items() if n >= 0}
            for unit in units:
                key = unit[0].key
                if key in room:
                    shares[unit] = min(shares[unit], room[key])
                    room[key] -= shares[unit]
        return shares

    def _defer_lane(self, units: Sequence[tuple[Entity, int]], shares: Mapping[tuple[Entity, int], int],
                    found: dict[str, list[int]]) -> list[tuple[tuple[Entity, int], int]]:
        """One connection's part of a round of :meth:`_defer`: its entities one after the other."""
        return [(unit, self._defer_entity(unit[0], shares[unit], found, unit[1])) for unit in units if shares[unit] > 0]

    def _defer_entity(self, entity: Entity, cap: int, found: dict[str, list[int]], lane: int = 0) -> int:
        """Receive and defer up to ``cap`` messages of one entity through the connection ``lane``; returns how
        many were deferred (those deferred before a failure are kept in ``found``)."""
        count = 0
        numbers: list[int] = []
        try:
            with self._namespace(entity, lane=lane).receiver(entity.path) as receiver:
                wait = self.receive_timeout
                while count < cap:
                    want = min(PAGE, cap - count)
                    page = receiver.receive_messages(max_message_count=want, max_wait_time=wait)
                    if not page:
                        break
                    wait = min(wait, 0.2)
                    failed: Exception | None = None
                    for message in page:
                        try:
                            if msgs.is_ping(message):
                                receiver.complete_message(message)
                                continue
                            receiver.defer_message(message)
                        except Exception as exc:  # one settlement failed: go on with the page (its locks)
                            if failed is not None:  # twice: the link is broken, the rest waits for lock expiry
                                raise
                            failed = exc
                            self._resweep(entity)  # it may be deferred at the broker yet in no batch
                            _LOGGER.warning("%s %r: settling message %s failed (%s); it is swept again",
                                            self.WHAT, entity.path, message.sequence_number, type(exc).__name__)
                            continue
                        numbers.append(int(message.sequence_number or 0))
                        count += 1
            self._answered(entity)
        except Exception as exc:
            self._resweep(entity)
            self._unavailable(entity, "receiving", exc)
        finally:
            with _FOUND_LOCK:
                found.setdefault(entity.key, []).extend(numbers)
        return count

    def _resweep(self, entity: Entity) -> None:
        """A receive of ``entity`` failed part way: a defer whose answer was lost may have deferred a message
        that is in no batch, so the entity is swept again (and received from once swept)."""
        with _FOUND_LOCK:
            if entity.key not in self._unswept:
                self._unswept.append(entity.key)

    def reportLatestOffset(self) -> dict[str, Any] | None:
        if self._depth is None:
            return None
        return {self.DEPTH_FIELD: self._depth}

    def _active_counts(self, entities: Sequence[Entity] | None = None) -> dict[str, int]:
        """Active messages per entity key (including the batch in flight), from the administration API of each
        namespace that answers (an entity of a namespace that does not is left out)."""
        return active_counts(self.config, self.entities if entities is None else entities, self.WHAT,
                             missing_is_empty=self.MISSING_IS_EMPTY)

    def _await_owed(self, cap: int) -> tuple[dict[str, list[int]], int]:
        """Trigger.AvailableNow, and a batch found nothing while entities still owe messages they held at the
        start; returns the next batch (and its size) once one gives, or an empty one when nothing is owed.

        * An entity whose active count is now 0 owes nothing more (its messages expired, or another receiver
          completed them).
        * An entity whose namespace does not answer (its count or its receive fails) is waited for, receiving
          again each ``receiveTimeout``, up to ``readRetryTimeout``; then the run fails with
          :class:`SourceUnavailableError` naming what it still owed, rather than end short and call it done.
        * An entity that answers with messages it does not give has them locked by another receiver (a run that
          died): they come back when the lock expires, so they are waited for up to the entity's lock duration,
          then left for the next run with a warning naming them."""
        owed = self._available_now or {}
        locked_until: float | None = None
        unanswered_since: float | None = None
        while True:
            owing = [e for e in self.entities if owed.get(e.key, 0) > 0]
            counts = self._active_counts(owing) if owing else {}
            for entity in owing:
                if counts.get(entity.key) == 0 and entity.key not in self._failing:
                    owed[entity.key] = 0
            owing = [e for e in owing if owed[e.key] > 0]
            if not owing:
                return {}, 0
            now = self._clock()
            unanswered = {e.key: owed[e.key] for e in owing if e.key not in counts or e.key in self._failing}
            if unanswered:
                unanswered_since = now if unanswered_since is None else unanswered_since
                if now - unanswered_since >= self.read_retry_timeout:
                    raise SourceUnavailableError(
                        f"{self.WHAT}: Trigger.AvailableNow: {unanswered} of the messages there at the start are "
                        f"still to read, and their namespace has not answered for {now - unanswered_since:.0f} s "
                        f"(readRetryTimeout {self.read_retry_timeout:g} s): the run stops here rather than end "
                        "short. Nothing was lost: what it read is committed, the rest is still in its entity for "
                        "the next run")
                _LOGGER.info("%s: Trigger.AvailableNow: waiting for %s, whose namespace does not answer",
                             self.WHAT, unanswered)
            else:
                unanswered_since = None
                if locked_until is None:
                    locked_until = now + max(self._lock_duration(e) for e in owing) + self.receive_timeout
                    _LOGGER.info("%s: Trigger.AvailableNow: waiting up to %.0f s for %s, locked by another receiver",
                                 self.WHAT, locked_until - now, {e.key: owed[e.key] for e in owing})
                elif now > locked_until:
                    _LOGGER.warning("%s: Trigger.AvailableNow: %s still locked by another receiver; left for the "
                                    "next run", self.WHAT, {e.key: owed[e.key] for e in owing})
                    for entity in owing:
                        owed[entity.key] = 0
                    return {}, 0
            self._sleep(self.receive_timeout)
            batch, count = self._gather(cap)
            if count:
                return batch, count

    def _lock_duration(self, entity: Entity) -> float:
        """The entity's lock duration in seconds (60 s, Service Bus's default, when the API does not answer)."""
        topic, marker, subscription = entity.path.partition("/subscriptions/")
        try:
            with admin_client(getattr(self.config, entity.side), retry_total=0) as admin:
                found = admin.get_subscription(topic, subscription) if marker else admin.get_queue(entity.path)
            lock = found.lock_duration  # the SDK types it timedelta | str | None: the last two take the default
            return float(lock.total_seconds()) if isinstance(lock, datetime.timedelta) else 60.0
        except Exception:  # noqa: BLE001 - a bound on a wait, not the batch
            return 60.0

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        self._last = end  # on a restart, Spark plans the checkpoint's last batch before asking for the next
        if end == start:
            return []
        size = self.PARTITION_SIZE
        return [DeferredPartition(key, tuple(numbers[i:i + size] if size else numbers))
                for key, numbers in sorted(end.get(self.OFFSET_FIELD, {}).items())
                for i in range(0, len(numbers), size or max(len(numbers), 1))]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, DeferredPartition)
        entity = self._by_key[partition.key]
        now = datetime.datetime.now(datetime.UTC)

        def peek() -> list[Any]:
            with self._namespace(entity).receiver(entity.path) as receiver, msgs.keeping_property_types(receiver):
                return peek_deferred(receiver, partition.sequence_numbers)

        found = self._retrying(entity, "reading a planned batch", peek)
        yield from (self.row(m, entity, now) for m in found)

    def commit(self, end: dict[str, Any]) -> None:
        """Complete what the batch's sink left deferred (the syphon's sink leaves nothing). A namespace that does
        not answer fails nothing: the completion is retried by each later ``latestOffset`` until it succeeds."""
        try:
            self._completions.complete(end)
        except Exception as exc:
            if not is_blip(exc):
                raise
            _LOGGER.warning("completing %s batch %s failed (%s: %s); trying again with the next batch", self.WHAT,
                            end.get("batch"), type(exc).__name__, redact(str(exc))[:200])

    def _complete(self, offset: dict[str, Any]) -> None:
        """Complete the messages of the batch ending at ``offset`` that are still deferred."""
        number = int(offset.get("batch", 0))
        done = 0
        for key, numbers in (offset.get(self.OFFSET_FIELD) or {}).items():
            entity = self._by_key.get(key)
            if entity is None:  # the checkpoint names an entity this query no longer reads
                _LOGGER.warning("%s batch %d names %r, which this query does not read: left deferred", self.WHAT,
                                number, key)
                continue
            namespace = self._namespace(entity, retries=False)
            if self.SINK_SETTLES:
                numbers = self._hold(namespace, entity, numbers)
            # what _hold found is there: fetched at once (a page with one gone is peeked again)
            done += len(complete_deferred(namespace, entity.path, numbers, bulk_first=True))
        _LOGGER.log(logging.INFO if done else logging.DEBUG, "%s batch %d committed: %d messages its sink left "
                    "deferred completed", self.WHAT, number, done)

    def _hold(self, namespace: Any, entity: Entity, numbers: Sequence[int]) -> list[int]:
        """Of a batch's messages its sink left deferred, keep those of a session (``x-ms-sessionid``: the syphon
        left them, their destination being down, and never re-parks them) for the next batch, which offers them
        first; returns the others' sequence numbers, to complete."""
        with namespace.receiver(entity.path) as receiver:
            left = peek_deferred(receiver, numbers)
        held = {int(m.sequence_number) for m in left if _in_session(m)}
        if held:
            with _FOUND_LOCK:
                self._held[entity.key] = sorted(set(self._held.get(entity.key, [])) | held)
            _LOGGER.info("%s %r: %d messages of sessions left by the sink (destination down) are offered again",
                         self.WHAT, entity.path, len(held))
        return [int(m.sequence_number) for m in left if int(m.sequence_number) not in held]

    def stop(self) -> None:
        """Wait for a receive ahead to end; what it deferred is taken back by the next run's first batch."""
        if self._ahead is not None:
            self._ahead.thread.join(self.receive_timeout * len(self.entities) + 30)
        _LOGGER.debug("%s source stopped", self.WHAT)


def active_counts(config: SparkSbConfig, entities: Sequence[Entity], what: str = "servicebus", *,
                  missing_is_empty: bool = False) -> dict[str, int]:
    """Active messages per entity key, from the administration API of each namespace that answers (each request
    bounded by the namespace's ``admin_timeout``). An entity is left out, with a warning, when its namespace
    does not answer (the rest of that namespace too: its endpoint is not tried again for each) or when it does
    not exist, unless ``missing_is_empty`` (a backlog queue not provisioned yet holds nothing). A namespace that
    refuses the credential raises :class:`~spark_sb.errors.CredentialRejectedError` at once: no retry helps."""
    counts: dict[str, int] = {}
    for side in dict.fromkeys(e.side for e in entities):
        try:
            with admin_client(getattr(config, side), retry_total=0) as admin:
                for entity in (e for e in entities if e.side == side):
                    try:
                        counts[entity.key] = _active_messages(admin, entity.path)
                    except Exception as exc:
                        if classify(exc) is not ErrorClass.CONFIGURATION_NOT_FOUND:
                            raise
                        if missing_is_empty:
                            counts[entity.key] = 0
                        else:
                            _LOGGER.warning("%s depth: %r not found on the %s", what, entity.path, side)
        except Exception as exc:  # the callers say what an unknown count means to them; never for a refusal
            raise_if_refused(exc, f"{side} {getattr(config, side).fully_qualified_namespace}")
            _LOGGER.warning("%s depth on the %s unavailable: %s: %s", what, side, type(exc).__name__,
                            redact(str(exc))[:200])
    return counts


def backlog_depth(config: SparkSbConfig) -> int | None:
    """Active messages over the backlog queues of ``config``'s pairing (a queue not provisioned yet holds 0;
    None when the secondary's administration API does not answer): what ``--until-empty`` waits to see at 0
    where Spark has no ``reportLatestOffset``."""
    queues = config.send_availability.backlog_queue_names()
    counts = active_counts(config, [Entity(q, "secondary", q) for q in queues], "backlog", missing_is_empty=True)
    return sum(counts.values()) if len(counts) == len(queues) else None


def _active_messages(admin: Any, path: str) -> int:
    topic, marker, subscription = path.partition("/subscriptions/")
    if marker:
        return int(admin.get_subscription_runtime_properties(topic, subscription).active_message_count or 0)
    return int(admin.get_queue_runtime_properties(path).active_message_count or 0)


class BacklogStreamReader(DeferringStreamReader):
    """The ``servicebus-backlog`` reader: every backlog queue of the secondary; rows restored by
    :func:`backlog_row`. Offsets: ``{"batch": n, "queues": {backlog queue: [sequence numbers]}}``. A backlog
    queue that does not exist yet (the pairing provisions them at the first failover) is read as empty."""

    MISSING_IS_EMPTY = True
    #: one partition per backlog queue: one task reads it (paging anyway) and republishes its messages in
    #: sequence order; a session's messages in two partitions, run at once, could overtake each other
    PARTITION_SIZE = None

    def __init__(self, options: Mapping[str, str]) -> None:
        _check_known(options, _STREAM_OPTIONS, f"{FORMAT} source")
        config = _options_config(options)
        queues = config.send_availability.backlog_queue_names()
        super().__init__(options, config, [Entity(q, "secondary", q) for q in queues],
                         config.syphon.max_messages_per_trigger, config.syphon.receives_in_flight)
        self.queues = queues

    def row(self, received: Any, entity: Entity, now: datetime.datetime) -> tuple[Any, ...]:
        return backlog_row(received, entity.path, now)


#: the ``servicebus`` source's default ``maxMessagesPerTrigger``
DEFAULT_MAX_PER_TRIGGER = 1000


class ServiceBusStreamReader(DeferringStreamReader):
    """The ``servicebus`` reader: one queue or topic subscription on the namespaces of the ``namespaces`` option.
    Offsets: ``{"batch": n, "entities": {"primary:orders": [sequence numbers], ...}}``."""

    OFFSET_FIELD = "entities"
    DEPTH_FIELD = "activeMessages"
    WHAT = "servicebus"
    SINK_SETTLES = False

    def __init__(self, options: Mapping[str, str]) -> None:
        _check_known(options, _SERVICEBUS_STREAM_OPTIONS, f"{SERVICEBUS_FORMAT} source in a stream (spark.readStream)")
        path = _entity_option(options)
        if split_dead_letter(path)[1]:
            raise ConfigError("entity", "is a dead-letter queue, which the servicebus source reads in batch only: "
                              "spark.read.format(\"servicebus\") peeks it without taking anything away", path)
        sides = _namespaces_option(options)
        config = _options_config(options)
        super().__init__(options, config, [Entity(f"{side}:{path}", side, path) for side in sides],
                         DEFAULT_MAX_PER_TRIGGER)
        for entity in self.entities:
            self._check(entity)

    def row(self, received: Any, entity: Entity, now: datetime.datetime) -> tuple[Any, ...]:
        return servicebus_row(received, entity, now)

def _entity_option(options: Mapping[str, str]) -> str:
    path = _option(options, "entity")
    if path is None:
        raise ConfigError("entity", "required: the queue, or topic/subscriptions/name, to read")
    base, dead_letter = split_dead_letter(path.strip())
    return entity_path(base) + (DEAD_LETTER_SUFFIX if dead_letter else "")


def _sequence_option(options: Mapping[str, str], name: str) -> int | None:
    text = _option(options, name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(name, "must be a sequence number (an integer, 0 or more)", text) from None
    if value < 0:
        raise ConfigError(name, "must be a sequence number (an integer, 0 or more)", text)
    return value


def _namespaces_option(options: Mapping[str, str]) -> tuple[Literal["primary", "secondary"], ...]:
    text = _option(options, "namespaces") or "primary"
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    sides: list[Literal["primary", "secondary"]] = []
    for name in names:
        if name in ("primary", "secondary"):
            if name not in sides:
                sides.append(cast(Literal["primary", "secondary"], name))
        else:
            raise ConfigError("namespaces", f"{name!r} is not a namespace: write primary, secondary or "
                              "primary,secondary", text)
    if not sides:
        raise ConfigError("namespaces", "names no namespace: write primary, secondary or primary,secondary", text)
    return tuple(sides)


# --- the batch read: a peek --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeekPartition(InputPartition):
    """One entity of a batch read, on one namespace."""

    key: str


def dead_letter_row(received: Any, entity: Entity, now: datetime.datetime) -> tuple[Any, ...]:
    """The row of one message of a dead-letter queue (see :data:`DEAD_LETTER_SCHEMA`): ``entity`` is the queue or
    subscription the dead-letter queue belongs to. The reason and the description the service keeps among the
    message's application properties (:data:`DEAD_LETTER_PROPERTIES`) are in their own columns only, so that a row
    written back carries the properties the message had."""
    owner = Entity(entity.key, entity.side, split_dead_letter(entity.path)[0])
    text = msgs.text
    return (*servicebus_row(received, owner, now, leave_out=DEAD_LETTER_PROPERTIES), text(received.dead_letter_reason),
            text(received.dead_letter_error_description), text(received.dead_letter_source))


class ServiceBusBatchReader(_EntityAccess, DataSourceReader):
    """``spark.read.format("servicebus")``: the messages of a queue, a topic subscription or a dead-letter queue
    (``entity: orders/$DeadLetterQueue``), **peeked**: nothing is locked, received or removed, and no delivery is
    counted, so a read can be repeated and a notebook can look at a live entity. One partition per namespace
    (``namespaces``), read in pages of 250 in sequence-number order from ``fromSequenceNumber`` up to
    ``toSequenceNumber`` (both inclusive; default: from the first to the last), at most ``maxMessages`` per
    namespace. What the entity holds is read as it is when the partition runs: active, deferred and scheduled
    messages alike (the paired sender's pings are left out). A page that fails with a blip is retried within
    ``readRetryTimeout``, then :class:`SourceUnavailableError` names the namespace and the entity."""

    def __init__(self, options: Mapping[str, str]) -> None:
        _check_known(options, _SERVICEBUS_BATCH_OPTIONS, f"{SERVICEBUS_FORMAT} source in a batch read (spark.read)")
        self.options = dict(options)
        path = _entity_option(self.options)
        self.dead_letter = split_dead_letter(path)[1]
        self.config = _options_config(self.options)
        self.entities = tuple(Entity(f"{side}:{path}", side, path) for side in _namespaces_option(self.options))
        self.read_retry_timeout = float(_positive(self.options, "readRetryTimeout", 120.0, float, most=3600))
        self._failing = {}
        self.first = _sequence_option(self.options, "fromSequenceNumber") or 0
        self.last = _sequence_option(self.options, "toSequenceNumber")
        if self.last is not None and self.last < self.first:
            raise ConfigError("toSequenceNumber", f"must not be below fromSequenceNumber ({self.first})", self.last)
        most = _option(self.options, "maxMessages")
        self.max_messages = None if most is None else int(_positive(self.options, "maxMessages", 1))
        for entity in self.entities:
            self._check(entity)

    def partitions(self) -> Sequence[InputPartition]:
        return [PeekPartition(entity.key) for entity in self.entities]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, PeekPartition)
        entity = next(e for e in self.entities if e.key == partition.key)
        row = dead_letter_row if self.dead_letter else servicebus_row
        now = datetime.datetime.now(datetime.UTC)
        # sequence numbers start at 1; the SDK reads 0 as "after this receiver's last peek" (a shared receiver)
        start, left = max(self.first, 1), self.max_messages
        while left is None or left > 0:
            count = PAGE if left is None else min(PAGE, left)

            def peek(start: int = start, count: int = count) -> list[Any]:
                with self._namespace(entity).receiver(entity.path) as receiver, msgs.keeping_property_types(receiver):
                    return list(receiver.peek_messages(max_message_count=count, sequence_number=start))

            page = self._retrying(entity, f"peeking from sequence number {start}", peek)
            if not page:
                return
            start = int(page[-1].sequence_number) + 1
            for message in page:
                if self.last is not None and int(message.sequence_number) > self.last:
                    return
                if msgs.is_ping(message):
                    continue
                if left is not None:
                    left -= 1
                yield row(message, entity, now)


class _Ahead:
    """The next batch's receive, run in a background thread of the reader's process while Spark runs the
    current batch, so that deferring a batch does not add to its time. What it deferred is recorded as it
    goes: :meth:`take` returns it even when the receive failed half-way (the error is logged, and the next
    batch receives again). A reader that dies leaves these messages deferred, and the next run's first batch
    takes them back, as any deferred message of a dead run."""

    def __init__(self, defer: Any, cap: int, what: str) -> None:
        self.found: dict[str, list[int]] = {}
        self.what = what
        self.thread = threading.Thread(target=self._run, args=(defer, cap), name=f"spark-sb-{what}-ahead",
                                       daemon=True)
        self.thread.start()

    def _run(self, defer: Any, cap: int) -> None:
        try:
            defer(cap, self.found)
        except Exception as exc:  # the messages deferred so far are kept; the next batch receives again
            _LOGGER.warning("receiving the next %s batch ahead failed (%s); receiving it in the next batch", self.what,
                            redact(str(exc))[:200])

    def take(self) -> dict[str, list[int]]:
        self.thread.join()
        return self.found
