"""Sessions keep their order through an outage, with the sink and with the servicebus writer: twelve sessions, each
partition holding whole sessions in order, the primary's entity refusing for three batches and back, the syphon
moving the backlog home beside the stream. Every session reaches the primary in order, each message once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from pairing import session_bodies
from pyspark.sql import functions as F

from spark_sb.capabilities import python_data_sources
from spark_sb.sink import PairedSink
from spark_sb.syphon import Syphon

from .conftest import sink_config

SESSIONS = [f"account-{n:02d}" for n in range(12)]
PER_BATCH = 3  # messages of each session per batch
BATCHES = 8
OUTAGE = range(2, 5)  # the batches sent while the primary's entity refuses


def _frame(spark: Any, batch: int) -> Any:
    """Batch ``batch``: ``PER_BATCH`` messages of every session, three partitions each holding whole sessions in
    order (as Spark's ordering needs: one session's rows in one partition, sorted)."""
    rows = [(s, batch * PER_BATCH + i) for s in SESSIONS for i in range(PER_BATCH)]
    return (spark.createDataFrame(rows, "session_id string, n long")
            .repartition(3, "session_id").sortWithinPartitions("session_id", "n")
            .select(F.format_string("%s/%d", "session_id", "n").alias("body"), "session_id",
                    F.format_string("%s/%d", "session_id", "n").alias("message_id")))


@contextmanager
def _syphon_running(config: dict) -> Iterator[Syphon]:
    """The syphon moving the backlog home in a thread, as its job does beside the stream, at a pace that leaves
    messages parked for a few batches (two per backlog queue every 0.3 s)."""
    stop = threading.Event()
    errors: list[BaseException] = []
    with Syphon.from_config(config) as syphon:
        def loop() -> None:
            while not stop.wait(0.3):
                try:
                    syphon.run_once(max_messages=2, max_wait_time=0.1)
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    errors.append(exc)
                    return
        thread = threading.Thread(target=loop, name="syphon", daemon=True)
        thread.start()
        try:
            yield syphon
        finally:
            stop.set()
            thread.join(60)
    assert not errors, errors


def _sessions_in_order(emulator: Any, primary: Any, secondary: Any, config: dict, q: str) -> None:
    with Syphon.from_config(config) as syphon:  # what is still parked, home
        syphon.drain(max_wait_time=0.5)
    expected = BATCHES * PER_BATCH
    for s in SESSIONS:
        assert session_bodies(primary.connection_string, q, s, expected, wait=20) == \
            [f"{s}/{n}" for n in range(expected)], s


def _through_an_outage(emulator: Any, q: str, config: dict, send: Callable[[int], Any]) -> list[Any]:
    """The batches: healthy, refused (parked), then back with the syphon started beside them: the sessions'
    messages are still parked when the next batches come, which follow them."""
    results = []
    for batch in range(OUTAGE.stop):
        if batch == OUTAGE.start:
            emulator.fault("primary", "quota", entity=q)
        results.append(send(batch))
    emulator.heal("primary", entity=q)
    time.sleep(1.5)  # a ping interval: the entity fails back while its sessions are parked
    with _syphon_running(config):
        for batch in range(OUTAGE.stop, BATCHES):
            results.append(send(batch))
    return results


def test_the_sink_keeps_every_session_in_order_through_an_outage_and_a_failback(
        spark, emulator, primary, secondary, make_queue) -> None:
    q = make_queue(requires_session=True, requires_duplicate_detection=True)
    config = sink_config(primary, secondary, entity=q, send_availability={"backlog_queue_count": 3})
    sink = PairedSink.from_config(config)
    summaries = _through_an_outage(emulator, q, config, lambda batch: sink.send_batch(_frame(spark, batch), batch))
    assert summaries[0].primary == len(SESSIONS) * PER_BATCH
    assert all(s.backlog_total for s in summaries[OUTAGE.start + 1:OUTAGE.stop])  # parked during the outage
    assert summaries[OUTAGE.stop].backlog_total and not summaries[OUTAGE.stop].failed_over  # back, and following
    assert sink.totals.sent == BATCHES * len(SESSIONS) * PER_BATCH
    _sessions_in_order(emulator, primary, secondary, config, q)


@pytest.mark.skipif(not python_data_sources(), reason="the servicebus format needs Python data sources (Spark 4)")
def test_the_servicebus_writer_keeps_every_session_in_order_through_an_outage(
        spark, emulator, primary, secondary, make_queue) -> None:
    from spark_sb.source import config_options, register

    register(spark)
    q = make_queue(requires_session=True, requires_duplicate_detection=True)
    config = sink_config(primary, secondary, send_availability={"backlog_queue_count": 3})
    options = {**config_options(config), "entity": q, "keyColumn": "message_id"}

    def send(batch: int) -> None:
        _frame(spark, batch).write.format("servicebus").options(**options).mode("append").save()

    _through_an_outage(emulator, q, config, send)
    _sessions_in_order(emulator, primary, secondary, config, q)
