"""A streaming query of the ``servicebus`` source through a stall of its namespace during a read. Run on the
development Spark only (not ``every_spark``): the retry is the reader's own code, the same on every Spark (as are
the stall tests of test_servicebus_source.py, marked ``spark_independent``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from azure.servicebus import ServiceBusClient, ServiceBusMessage

from spark_sb.bus import close_all
from spark_sb.emulator import fault
from spark_sb.source import ServiceBusDataSource, ServiceBusStreamReader, config_options

from .conftest import sink_config


class _StallingReader(ServiceBusStreamReader):
    """The source's reader whose first ``read`` (a marker file says it happened) makes the primary hold every
    answer for ``stallSeconds`` first, through the emulator's control API (the read runs in a Python worker)."""

    stall: dict[str, str] = {}  # stallmarker, stalladmin, stallseconds: the stalling source's own options

    def read(self, partition: Any) -> Any:
        marker = Path(self.stall["stallmarker"])
        if not marker.exists():
            marker.write_text("stalled")
            fault(self.stall["stalladmin"], "timeout", duration=float(self.stall["stallseconds"]))
        yield from super().read(partition)


class _StallingSource(ServiceBusDataSource):
    """The servicebus source with three options of its own (``stallMarker``, ``stallAdmin``, ``stallSeconds``),
    kept from the source's options (which refuse an option they do not know)."""

    _OWN = ("stallmarker", "stalladmin", "stallseconds")

    def __init__(self, options: Any) -> None:
        self.stall = {str(k).lower(): v for k, v in options.items() if str(k).lower() in self._OWN}
        super().__init__({k: v for k, v in options.items() if str(k).lower() not in self._OWN})

    @classmethod
    def name(cls) -> str:
        return "servicebus-stalling"

    def streamReader(self, schema: Any) -> ServiceBusStreamReader:
        reader = _StallingReader(self.options)
        reader.stall = self.stall
        return reader


def _send(info: Any, entity: str, items: list[ServiceBusMessage]) -> None:
    with ServiceBusClient.from_connection_string(info.connection_string, retry_total=0) as client:
        with client.get_queue_sender(entity) as sender:
            sender.send_messages(items)


def test_a_query_carries_on_through_a_stall_during_a_read(spark, emulator, primary, secondary, make_queue,
                                                         tmp_path) -> None:
    """The primary stalls for 5 s (longer than one attempt's 3 s try timeout) while a batch is read: the query
    carries on, and every message becomes one row, once."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the stalling source goes to Spark by value
    spark.dataSource.register(_StallingSource)
    queue = make_queue()
    conf = sink_config(primary, secondary)
    conf.pop("sink")
    _send(primary, queue, [ServiceBusMessage(f"m{i}", message_id=f"m{i}") for i in range(20)])
    marker = tmp_path / "stalled"
    seen: list[str] = []

    def collect(df: Any, batch_id: int) -> None:
        seen.extend(r.message_id for r in df.select("message_id").collect())

    query = (spark.readStream.format("servicebus-stalling")
             .options(**config_options(conf), entity=queue, maxMessagesPerTrigger="8", receiveTimeout="0.5",
                      stallMarker=str(marker), stallAdmin=primary.admin_url, stallSeconds="5")
             .load().writeStream.foreachBatch(collect).option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(processingTime="1 second").start())
    try:
        deadline = time.monotonic() + 180
        while len(seen) < 20 and query.isActive and time.monotonic() < deadline:
            time.sleep(0.5)
        assert query.exception() is None, query.exception()
    finally:
        query.stop()
        close_all()  # this process's receivers
    assert marker.exists()  # the stall happened
    assert sorted(seen) == sorted(f"m{i}" for i in range(20))  # every message once
