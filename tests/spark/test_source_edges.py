"""The streaming sources at their edges (issue 34): a completion that failed is retried whatever completes after
it, a bounded run never ends short and calls it done, ``trigger(once=True)`` ends while messages keep arriving,
a host that does not resolve fails the query, an administration endpoint that never answers bounds every wait,
a backlog queue not provisioned yet reads as empty, and Spark 4.0 and 4.1's ``latestOffset()`` convention. The
readers run on the emulator pair without a Spark session, except the ``Trigger.AvailableNow`` queries."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from pairing import peek_all, within

from spark_sb.bus import close_all
from spark_sb.capabilities import admission_control, trigger_available_now
from spark_sb.config import load_config
from spark_sb.errors import ConfigError, SourceUnavailableError
from spark_sb.source import (
    SERVICEBUS_SCHEMA,
    BacklogStreamReader,
    ServiceBusStreamReader,
    backlog_depth,
    config_options,
)

from .conftest import read_limit, sink_config
from .test_servicebus_source import _send, create, unique_name

#: run on every Spark version make test tries (Makefile, EVERY_SPARK)
pytestmark = pytest.mark.every_spark

needs_available_now = pytest.mark.skipif(not trigger_available_now(),
                                         reason="Trigger.AvailableNow for Python sources needs Spark 4.2")


@pytest.fixture
def queue(emulator: Any, request: pytest.FixtureRequest) -> str:
    """A queue of one name on both namespaces."""
    from spark_sb.emulator.model import QueueSpec

    name = unique_name(request, "eq-")
    for namespace in ("primary", "secondary"):
        create(emulator, namespace, QueueSpec(name=name))
    return name


def _reader(conf: dict, queue: str, **options: str) -> ServiceBusStreamReader:
    return ServiceBusStreamReader({**config_options(conf), "entity": queue, "receiveTimeout": "0.5", **options})


def _ids(reader: Any, start: dict, end: dict, schema: Any = SERVICEBUS_SCHEMA) -> list[str]:
    at = schema.names.index("message_id")
    return sorted(row[at] for partition in reader.partitions(start, end) for row in reader.read(partition))


def _messages(prefix: str, count: int) -> list[ServiceBusMessage]:
    return [ServiceBusMessage(f"{prefix}{i}", message_id=f"{prefix}{i}") for i in range(count)]


def test_a_failed_completion_is_retried_after_a_later_batch_completes(conf, emulator, primary, secondary,
                                                                      queue) -> None:
    """Batch 1 reads from both namespaces; its completion fails on the secondary (down); batch 2 (the primary's
    only) completes first. Once the secondary is back, the next batch completes batch 1's message there: it is
    not read a second time by a later run, nor left deferred. (Before: batch 2's completion made the reader drop
    batch 1's, and its secondary message stayed deferred, to be read again by the next run.)"""
    _send(primary, queue, _messages("p", 4))
    _send(secondary, queue, _messages("s", 1))
    reader = _reader(conf, queue, namespaces="primary,secondary", maxMessagesPerTrigger="3")
    start = reader.initialOffset()
    end1 = reader.latestOffset(start, read_limit(3))
    assert sorted(end1["entities"]) == [f"primary:{queue}", f"secondary:{queue}"]
    first = _ids(reader, start, end1)
    assert reader._ahead is not None
    reader._ahead.thread.join(60)  # the primary's other two, received ahead before the secondary goes down
    emulator.fault("secondary", "down")
    try:
        reader.commit(end1)  # the secondary's part fails: logged, pending
        end2 = reader.latestOffset(end1, read_limit(3))
        assert list(end2["entities"]) == [f"primary:{queue}"]
        second = _ids(reader, end1, end2)
        reader.commit(end2)  # completes first
    finally:
        emulator.heal("secondary")
    assert sorted(first + second) == ["p0", "p1", "p2", "p3", "s0"]
    close_all()
    reader.latestOffset(end2, read_limit(3))  # batch 1's completion, retried
    assert peek_all(secondary.connection_string, queue) == []  # not left deferred
    assert peek_all(primary.connection_string, queue) == []
    fresh = _reader(conf, queue, namespaces="primary,secondary")
    assert fresh.latestOffset(fresh.initialOffset(), read_limit(10)) == fresh.initialOffset()  # nothing read twice


def test_spark_4_0_latest_offset_without_arguments_caps_chains_and_restarts(conf, primary, queue) -> None:
    """Spark 4.0 and 4.1 call ``latestOffset()`` with no start and no limit: the reader caps each batch at
    ``maxMessagesPerTrigger`` itself, starts each batch where its last one ended (completing that one), and a
    restarted reader starts from the checkpoint's last batch, which Spark plans (``partitions``) first."""
    _send(primary, queue, _messages("m", 7))
    reader = _reader(conf, queue, maxMessagesPerTrigger="3")
    start = reader.initialOffset()
    end1 = reader.latestOffset()
    assert end1["batch"] == 1 and len(end1["entities"][f"primary:{queue}"]) == 3
    first = _ids(reader, start, end1)
    end2 = reader.latestOffset()  # completes batch 1
    assert end2["batch"] == 2 and len(end2["entities"][f"primary:{queue}"]) == 3
    assert len(peek_all(primary.connection_string, queue)) == 4  # batch 1's three completed
    second = _ids(reader, end1, end2)
    reader.stop()
    close_all()
    restarted = _reader(conf, queue, maxMessagesPerTrigger="3")
    assert restarted.partitions(end1, end2)  # Spark replays the checkpoint's last batch, unfinished
    assert _ids(restarted, end1, end2) == second
    end3 = restarted.latestOffset()  # from batch 2: completes it, takes back what the dead reader deferred ahead
    assert end3["batch"] == 3
    third = _ids(restarted, end2, end3)
    restarted.commit(end3)
    assert sorted(first + second + third) == [f"m{i}" for i in range(7)]  # each once, besides batch 2's replay
    assert peek_all(primary.connection_string, queue) == []


@pytest.mark.skipif(not admission_control(), reason="Spark 4.0 and 4.1 pass no read limit (trigger once reads one "
                    "batch of maxMessagesPerTrigger there)")
def test_trigger_once_reads_what_was_there_and_ends_while_messages_keep_arriving(conf, primary, queue) -> None:
    """``ReadAllAvailable`` (``trigger(once=True)``) with 20 messages a second arriving: the batch holds about what
    was there when it started, and it ends. (Before: it received until a 0.2 s gap, which never came.)"""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    _send(primary, queue, _messages("before", 30))
    stop = threading.Event()

    def keep_sending() -> None:
        with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as client, \
                client.get_queue_sender(queue) as sender:
            while not stop.is_set():
                sender.send_messages(ServiceBusMessage("late", message_id=f"late-{uuid.uuid4().hex[:8]}"))
                stop.wait(0.05)

    sending = threading.Thread(target=keep_sending, daemon=True)
    sending.start()
    try:
        time.sleep(0.5)
        reader = _reader(conf, queue)
        start = reader.initialOffset()
        end = within(60, lambda: reader.latestOffset(start, ReadAllAvailable()))
    finally:
        stop.set()
        sending.join(10)
    ids = _ids(reader, start, end)
    assert {f"before{i}" for i in range(30)} <= set(ids)
    assert len(ids) < 30 + 40  # what was there at the start (and the few sent while the count was taken)
    assert reader._ahead is None  # the one batch of the run: nothing received ahead to be left deferred


def _unresolvable(conf: dict, side: str) -> dict:
    host = conf[side]["connection_string"].split("sb://", 1)[1].split("/", 1)[0].split(":", 1)[0]
    section = {"connection_string": conf[side]["connection_string"].replace(host, "spark-sb-nowhere.invalid"),
               "admin_endpoint": "http://spark-sb-nowhere.invalid:9"}
    return {**conf, side: section}


@pytest.mark.spark_independent
def test_a_namespace_host_that_does_not_resolve_fails_the_query_naming_it(conf, primary, queue) -> None:
    """The secondary's host does not resolve: after a short bounded retry (a DNS blip passes) the reader fails with
    a configuration error naming the host, instead of logging "trying again next batch" for ever. The primary's
    messages are not lost: a reader of the primary alone reads them, once."""
    _send(primary, queue, _messages("m", 2))
    reader = _reader(_unresolvable(conf, "secondary"), queue, namespaces="primary,secondary",
                     readRetryTimeout="2")

    def until_refused() -> ConfigError:
        last = reader.initialOffset()
        while True:
            try:
                last = reader.latestOffset(last, read_limit(10))
            except ConfigError as exc:
                return exc
            time.sleep(0.5)

    error = within(60, until_refused)
    assert error.option == "secondary.fully_qualified_namespace"
    assert "spark-sb-nowhere.invalid" in str(error) and "does not resolve" in str(error)
    close_all()
    fresh = _reader(conf, queue)
    start = fresh.initialOffset()
    end = fresh.latestOffset(start, read_limit(10))
    assert _ids(fresh, start, end) == ["m0", "m1"]


@pytest.mark.spark_independent
def test_a_hung_administration_endpoint_bounds_every_wait(conf, primary, queue, silent_endpoint) -> None:
    """The primary's administration endpoint accepts and never answers: the reader starts (its entity checked by a
    peek), each batch's depth call gives up after ``admin_timeout``, and a Trigger.AvailableNow run that cannot
    learn what to read fails within ``readRetryTimeout`` plus a request, saying nothing was read."""
    hung = {**conf, "primary": {**conf["primary"], "admin_endpoint": silent_endpoint, "admin_timeout": "1s"}}
    _send(primary, queue, _messages("m", 3))

    def read_one_batch() -> list[str]:
        reader = _reader(hung, queue)
        start = reader.initialOffset()
        end = reader.latestOffset(start, read_limit(10))
        assert reader.reportLatestOffset() is None  # the depth is unknown, not 0
        return _ids(reader, start, end)

    assert within(30, read_one_batch) == ["m0", "m1", "m2"]
    if trigger_available_now():
        reader = _reader(hung, queue, readRetryTimeout="3")
        with pytest.raises(SourceUnavailableError, match="Nothing was read or lost"):
            within(30, reader.prepareForTriggerAvailableNow)


@pytest.mark.spark_independent
def test_a_backlog_queue_not_provisioned_yet_reads_as_empty(primary, secondary) -> None:
    """No failover happened yet, so the pairing made no backlog queue: the backlog source reads nothing, fails
    nothing, and the backlog's depth is 0 (not unknown). (Before: the query failed with the entity not found.)"""
    conf = sink_config(primary, secondary)
    reader = BacklogStreamReader({**config_options(conf), "receiveTimeout": "0.5"})
    start = reader.initialOffset()
    assert reader.latestOffset(start, read_limit(10)) == start
    assert reader.reportLatestOffset() == {"backlogDepth": 0}
    assert backlog_depth(load_config(conf)) == 0


# --- Trigger.AvailableNow queries (Spark 4.2) ------------------------------------------------------------


@pytest.fixture
def available_now(spark: Any, tmp_path: Any) -> Iterator[Any]:
    """Run a Trigger.AvailableNow query of the servicebus source to its end; returns (the ids read, its error)."""
    from pyspark.errors import StreamingQueryException

    from spark_sb import register

    register(spark)

    def run(conf: dict, queue: str, on_batch: Any = None, **options: str) -> tuple[list[str], Any]:
        seen: list[str] = []

        def collect(df: Any, batch_id: int) -> None:
            seen.extend(r.message_id for r in df.select("message_id").collect())
            if on_batch is not None:
                on_batch(batch_id)

        query = (spark.readStream.format("servicebus")
                 .options(**config_options(conf), entity=queue, receiveTimeout="0.5", **options).load()
                 .writeStream.foreachBatch(collect).option("checkpointLocation", str(tmp_path / "ck"))
                 .trigger(availableNow=True).start())
        try:
            assert query.awaitTermination(180), "the availableNow query did not stop by itself"
        except StreamingQueryException:  # its error, returned below
            pass
        return seen, query.exception()

    yield run
    close_all()


@needs_available_now
def test_available_now_rides_out_a_blip_after_its_first_batch(available_now, conf, emulator, primary,
                                                              queue) -> None:
    """A 3 s blip of the primary after the first of ten batches: the run waits for it and reads all 200, once.
    (Before: it ended after the first batch, 20 of 200, and reported success.)"""
    _send(primary, queue, _messages("m", 200))
    seen, error = available_now(conf, queue, lambda batch: batch == 0 and emulator.fault("primary", "down",
                                                                                         duration=3),
                                maxMessagesPerTrigger="20")
    assert error is None
    assert sorted(seen) == sorted(f"m{i}" for i in range(200))


@needs_available_now
def test_available_now_rides_out_a_blip_in_its_first_second(available_now, conf, emulator, primary, queue) -> None:
    """The primary (its administration API too) is down for the first 3 s of the run: the run waits for it and
    reads all 50. (Before: it ended at once with 0 of 50 and reported success.)"""
    _send(primary, queue, _messages("m", 50))
    emulator.fault("primary", "down", duration=3)
    seen, error = available_now(conf, queue, maxMessagesPerTrigger="20")
    assert error is None
    assert sorted(seen) == sorted(f"m{i}" for i in range(50))


@needs_available_now
def test_available_now_fails_loudly_when_its_namespace_stays_away(available_now, conf, emulator, primary,
                                                                  queue) -> None:
    """The primary goes down for good after the first batch: the run fails with SourceUnavailableError saying
    what it still owed, within readRetryTimeout, instead of ending short as if done."""
    _send(primary, queue, _messages("m", 60))
    try:
        seen, error = available_now(conf, queue, lambda batch: batch == 0 and emulator.fault("primary", "down"),
                                    maxMessagesPerTrigger="20", readRetryTimeout="5")
    finally:
        emulator.heal("primary")
    assert len(seen) == 20
    assert error is not None and "still to read" in str(error) and "Nothing was lost" in str(error)
