"""The bus layer against a far namespace (an emulator namespace 200 ms away): opening a receiver costs several
round trips, more than a short receive wait. The source's receives wait 0.2 to 0.5 s once a batch has started,
and the SDK spends a receive's wait on opening the link too: against a far namespace a new receiver never opened
and its queue was never read (found by bench/latency.py's syphon row)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from pairing import pair_config

from spark_sb import bus
from spark_sb.config import load_config
from spark_sb.emulator import Emulator, NamespaceOptions


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    emu = Emulator([NamespaceOptions("primary", latency=0.1), NamespaceOptions("secondary")],
                   data_dir=tmp_path_factory.mktemp("far-bus"), entities={"queues": [{"name": "far-q"}]})
    with emu:
        yield emu


def test_a_new_receiver_of_a_far_namespace_receives_within_a_short_wait(primary: Any, secondary: Any) -> None:
    with ServiceBusClient.from_connection_string(primary.connection_string) as client, \
            client.get_queue_sender("far-q") as sender:
        sender.send_messages([ServiceBusMessage(f"m{i}") for i in range(3)])
    config = load_config(pair_config(primary, secondary, "far"))
    namespace = bus.Namespace("primary", config.primary)
    try:
        with namespace.receiver("far-q", delete=True) as receiver:
            got = receiver.receive_messages(max_message_count=10, max_wait_time=0.3)
        assert sorted(str(m) for m in got) == ["m0", "m1", "m2"]
    finally:
        namespace.close()
