"""The sink through a primary outage and the syphon job, both over AMQP over WebSockets with TLS (the emulator's
wss endpoints, its CA trusted) through an HTTP CONNECT proxy: how a workspace whose egress allows only port 443
through a proxy reaches Service Bus. The network options travel to the executors with the configuration. Run on the
development Spark only (not ``every_spark``): the options are the configuration's and the SDK's, the same on every
Spark, and make test's time is better spent on what differs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spark_sb import jobs
from spark_sb.bus import close_all
from spark_sb.capabilities import python_data_sources
from spark_sb.config import load_config
from spark_sb.emulator import Emulator, NamespaceOptions
from spark_sb.emulator.model import QueueSpec
from spark_sb.emulator.proxy import HttpProxy
from spark_sb.sink import PairedSink

from .conftest import receive_all

PROXY_USER, PROXY_PASSWORD = "etl", f"proxy-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def wss_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    with Emulator([NamespaceOptions("primary"), NamespaceOptions("secondary")], websockets=True,
                  data_dir=tmp_path_factory.mktemp("wss-emulator")) as emu:
        yield emu
    close_all()


@pytest.fixture(scope="module")
def proxy(wss_emulator: Emulator) -> Iterator[HttpProxy]:
    """The workspace's egress: a proxy that lets only the namespaces' wss ports through."""
    ports = {info.wss_port for info in wss_emulator.info.values()}
    with HttpProxy(username=PROXY_USER, password=PROXY_PASSWORD, allowed_ports=ports) as running:
        yield running


def _namespace(emu: Emulator, side: str, proxy: HttpProxy) -> dict[str, Any]:
    info = emu[side]
    return {"connection_string": info.connection_string, "admin_endpoint": info.admin_url,
            "transport": "websockets", "custom_endpoint_address": f"sb://localhost:{info.wss_port}",
            "connection_verify": info.ca_file,
            "http_proxy": {"host": "127.0.0.1", "port": proxy.port, "username": PROXY_USER, "password": PROXY_PASSWORD}}


def _config(emu: Emulator, proxy: HttpProxy, tmp_path: Path) -> dict[str, Any]:
    entity = f"net-{uuid.uuid4().hex[:8]}"
    server = emu.server("primary")
    server.call(lambda: server.broker.create_entity(QueueSpec(name=entity, requires_duplicate_detection=True)))
    return {
        "primary": _namespace(emu, "primary", proxy), "secondary": _namespace(emu, "secondary", proxy),
        "send_availability": {"backlog_prefix": f"net-{uuid.uuid4().hex[:8]}", "backlog_queue_count": 2,
                              "failover_interval": "0s", "ping_primary_interval": "1s",
                              "primary_try_timeout": "5s"},
        "sink": {"entity": entity, "key_column": "key"},
        "syphon": {"retry_interval": "1s", "checkpoint_location": str(tmp_path / "checkpoint"),
                   "ledger": str(tmp_path / "ledger")},
    }


def _rows(spark: Any, first: int, count: int = 40) -> Any:
    return spark.range(first, first + count).selectExpr("concat('row-', id) AS key", "concat('body ', id) AS body") \
        .repartition(2)


def _through_an_outage(sink: PairedSink, emu: Emulator, df: Any, batch_id: int) -> Any:
    emu.fault("primary", "down")
    try:
        return sink.send_batch(df, batch_id)
    finally:
        emu.heal("primary")


def _tunnels(proxy: HttpProxy) -> int:
    return sum(proxy.tunnels.values())


def test_the_sink_through_an_outage_over_websockets_through_a_proxy(
        spark: Any, wss_emulator: Emulator, proxy: HttpProxy, tmp_path: Path) -> None:
    emu = wss_emulator
    config = _config(emu, proxy, tmp_path)
    entity = config["sink"]["entity"]
    sink = PairedSink.from_config(config)
    tunnels = _tunnels(proxy)
    healthy = sink.send_batch(_rows(spark, 0), 0)
    assert (healthy.rows, healthy.primary, healthy.backlog_total, healthy.rejected) == (40, 40, 0, 0)
    failed_over = _through_an_outage(sink, emu, _rows(spark, 40), 1)
    assert (failed_over.rows, failed_over.primary, failed_over.backlog_total) == (40, 0, 40)
    assert _tunnels(proxy) > tunnels  # the executors' connections went through the proxy
    arrived = [str(m.message_id) for m in receive_all(emu["primary"].connection_string, entity, expected=40)]
    assert sorted(arrived) == sorted(f"row-{i}" for i in range(40))


@pytest.mark.skipif(not python_data_sources(), reason="the syphon job needs Python data sources (Spark 4.0+)")
def test_the_syphon_job_over_websockets_through_a_proxy(
        spark: Any, wss_emulator: Emulator, proxy: HttpProxy, tmp_path: Path) -> None:
    from spark_sb.source import backlog_depth

    emu = wss_emulator
    config = _config(emu, proxy, tmp_path)
    entity = config["sink"]["entity"]
    parked = _through_an_outage(PairedSink.from_config(config), emu, _rows(spark, 0, 60), 0)
    assert parked.backlog_total == 60
    tunnels = _tunnels(proxy)
    query, _ = jobs.start_syphon(spark, config, receive_timeout=0.5)
    try:
        jobs.await_until_empty(query, idle_batches=1, timeout=240, depth=lambda: backlog_depth(load_config(config)))
    finally:
        query.stop()
    arrived = [str(m.message_id) for m in receive_all(emu["primary"].connection_string, entity, expected=60)]
    assert sorted(arrived) == sorted(f"row-{i}" for i in range(60))  # every row once
    assert backlog_depth(load_config(config)) == 0
    assert _tunnels(proxy) > tunnels  # the syphon's readers and republisher went through the proxy
