"""The tests' own helpers (tests/pairing.py) against the emulator: what they count is what the queue held."""

from __future__ import annotations

from pathlib import Path

from azure.servicebus import ServiceBusClient, ServiceBusMessage
from pairing import received_ids

from spark_sb.emulator import Emulator, NamespaceOptions
from spark_sb.emulator.model import QueueSpec


def test_received_ids_takes_every_message_of_a_namespace_slower_than_its_receive_wait(tmp_path: Path) -> None:
    """A receive that waits one second comes back empty from a namespace 1.2 s away with every message still
    on its way (sent by the namespace, so no longer in the queue), as one did from a loaded emulator in make test:
    the helper receives again, then peeks, before it calls the queue empty."""
    with Emulator([NamespaceOptions("far", latency=0.6)], data_dir=tmp_path) as emu:
        server = emu.server("far")
        server.call(lambda: server.broker.create_entity(QueueSpec(name="q")))
        far = emu["far"]
        with ServiceBusClient.from_connection_string(far.connection_string) as client, \
                client.get_queue_sender("q") as sender:
            sender.send_messages([ServiceBusMessage("x", message_id=f"m-{i}") for i in range(30)])
        assert sorted(received_ids(far.connection_string, "q")) == sorted(f"m-{i}" for i in range(30))
