"""The Spark sink on Microsoft Entra ID: the credential is built where the sends happen, in the executors' Python
workers, from the identity environment they were given (``IDENTITY_ENDPOINT``/``IDENTITY_HEADER`` of the
emulator's managed-identity endpoint), with no connection string anywhere."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from spark_sb.emulator import Emulator, NamespaceOptions
from spark_sb.emulator.aad import AadOptions
from spark_sb.emulator.model import QueueSpec
from spark_sb.sink import PairedSink

from .conftest import receive_all

HEADER = f"spark-identity-header-{uuid.uuid4().hex}"
_AZURE_ENV = ("AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET", "AZURE_FEDERATED_TOKEN_FILE",
              "MSI_ENDPOINT", "MSI_SECRET", "IMDS_ENDPOINT", "IDENTITY_SERVER_THUMBPRINT")


@pytest.fixture(scope="module")
def aad_emulator() -> Iterator[Emulator]:
    with Emulator([NamespaceOptions("primary"), NamespaceOptions("secondary")], entra_id=True,
                  aad=AadOptions(identity_header=HEADER)) as emu:
        yield emu


def test_the_sink_sends_on_entra_id_with_credentials_built_on_the_executors(
    spark: Any, aad_emulator: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    emu = aad_emulator
    queue = f"aad-sink-{uuid.uuid4().hex[:8]}"
    server = emu.server("primary")
    server.call(lambda: server.broker.create_entity(QueueSpec(name=queue)))
    identity = {"IDENTITY_ENDPOINT": emu["primary"].identity_endpoint, "IDENTITY_HEADER": HEADER}
    for name in _AZURE_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in identity.items():
        monkeypatch.setenv(name, value)  # the driver (pairing)
    environment = spark.sparkContext.environment  # the executors' Python workers (their JVM started without it)
    saved = dict(environment)
    environment.update(identity)
    config = {side: {"fully_qualified_namespace": f"localhost:{emu[side].amqp_port}", "emulator": True,
                     "admin_endpoint": emu[side].admin_url, "credential": {"type": "default"}}
              for side in ("primary", "secondary")}
    config["send_availability"] = {"backlog_prefix": f"aad-{uuid.uuid4().hex[:8]}", "backlog_queue_count": 1}
    config["sink"] = {"entity": queue}
    issued = emu.authority.issued
    try:
        sink = PairedSink.from_config(config)
        summary = sink.send_batch(spark.range(40).selectExpr("concat('row-', id) AS body").repartition(2), 0)
    finally:
        environment.clear()
        environment.update(saved)
    assert (summary.rows, summary.primary, summary.backlog_total, summary.rejected) == (40, 40, 0, 0)
    assert emu.authority.issued > issued
    received = receive_all(emu["primary"].connection_string, queue, expected=40, wait=1.0)
    assert sorted(str(m) for m in received) == sorted(f"row-{i}" for i in range(40))
