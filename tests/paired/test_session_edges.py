"""Sessions at their edges (issue 48): a secondary that cannot be asked never holds a send nothing could have
parked, what a sender parks is known to every thread at once, an entity's session is one whatever the case of its
name, an unencodable session id is a bad message, and a session's question to the backlog costs what its own
session needs."""

from __future__ import annotations

from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage
from pairing import pair_config, session_bodies

from spark_sb import sink as sink_module
from spark_sb.config import load_config
from spark_sb.errors import BadMessageError
from spark_sb.paired import PRIMARY
from spark_sb.syphon import Syphon


def _send(sender: Any, q: str, session: str, n: int) -> dict[str, int]:
    message = ServiceBusMessage(f"{session}/{n}", message_id=f"{session}/{n}", session_id=session)
    return dict(sender.send(q, message).destinations)


def _drain_backlog(config: dict, expected: int) -> None:
    with Syphon.from_config(config) as syphon:
        assert syphon.drain(max_wait_time=0.5).total_moved == expected


# --- 4. entity names are case-insensitive ------------------------------------------------------------------

def test_a_session_sent_under_two_spellings_of_its_entity_keeps_its_order(
        emulator, make_queue, make_sender, make_config, fake_time, primary) -> None:
    """Service Bus entity names are case-insensitive: ``Orders`` and ``orders`` are one queue, so one session.
    Messages parked under one spelling are followed by messages sent under the other."""
    q = make_queue(requires_session=True)
    config = make_config(failover_interval="0s", backlog_queue_count=4)
    sender = make_sender(config=config)
    spellings = [q, q.upper(), q.title()]
    sessions = [f"s{n}" for n in range(8)]  # several, so that some hash differently under another spelling
    for s in sessions:
        assert _send(sender, spellings[0], s, 0) == {PRIMARY: 1}
    emulator.fault("primary", "quota")  # the emulator keys a fault by the spelling: the whole namespace
    for s in sessions:
        assert PRIMARY not in _send(sender, spellings[1], s, 1)  # failed over: parked
    emulator.heal("primary")
    fake_time.advance(5)
    sender.run_pings_once()
    assert sender.state(spellings[2]) == "healthy" and sender.state(spellings[1]) == "healthy"
    for s in sessions:
        assert PRIMARY not in _send(sender, spellings[2], s, 2)  # follows the parked one, whatever the spelling
    for s in sessions:
        assert PRIMARY not in _send(sender, spellings[1], s, 3)
    # the syphon moves one session of one entity, whatever the spellings its messages were parked under
    _drain_backlog(config, 3 * len(sessions))
    for s in sessions:
        assert session_bodies(primary.connection_string, q, s, 4) == [f"{s}/{n}" for n in range(4)]


def test_the_health_of_an_entity_is_one_whatever_the_spelling(
        emulator, make_queue, make_sender, make_config) -> None:
    q = make_queue()
    sender = make_sender(config=make_config(failover_interval="0s", backlog_queue_count=1))
    emulator.fault("primary", "quota")
    try:
        assert sender.send(q.upper(), ServiceBusMessage("x")).backlog == 1
    finally:
        emulator.heal("primary")
    assert sender.state(q) == "failed_over"
    assert sender.board.snapshot() == {q.upper(): "failed_over"}  # one entity, as first spelled


# --- 6. an unencodable session id --------------------------------------------------------------------------

@pytest.mark.parametrize("failed_over", [False, True])
def test_an_unencodable_session_id_is_a_bad_message_naming_the_field_and_value(
        emulator, make_queue, make_sender, make_config, failed_over) -> None:
    q = make_queue(requires_session=True)
    sender = make_sender(config=make_config(failover_interval="0s", backlog_queue_count=2))
    if failed_over:
        emulator.fault("primary", "quota", entity=q)
        sender.send(q, ServiceBusMessage("first", session_id="ok"))
        assert sender.state(q) == "failed_over"
    bad = ServiceBusMessage("x", message_id="m-1", session_id="s\ud800")
    with pytest.raises(BadMessageError) as caught:
        sender.send(q, [ServiceBusMessage("fine", message_id="m-0", session_id="ok"), bad])
    text = str(caught.value)
    assert "'m-1'" in text and "session_id" in text and "'s\\ud800'" in text, text


def test_a_sink_partition_sends_a_session_in_order_whatever_the_spellings_of_its_entity(
        emulator, make_queue, primary, secondary) -> None:
    """The sink gathers a partition's rows in chunks per entity: rows of one session under two spellings of its
    entity are one chunk, in order, not two chunks sent one after the other."""
    q = make_queue(requires_session=True)
    raw = pair_config(primary, secondary, "se", backlog_queue_count=1, failover_interval="10s",
                      ping_primary_interval="5s", primary_try_timeout="3s")
    config = load_config({**raw, "sink": {"entity": q}})
    spellings = [q, q.upper()]
    rows = [{"body": f"S/{n}".encode(), "message_id": f"S/{n}", "session_id": "S", "entity": spellings[n % 2]}
            for n in range(6)]
    try:
        run = sink_module.PartitionRun(config, config.fingerprint(), 1, 0, (), reject=False)
        out = list(run.run_rows(rows))
        [summary] = [b for b in out if b.column("kind")[0].as_py() == "summary"]
        assert summary.column("sent")[0].as_py() == 6
    finally:
        sink_module.close_senders()
    assert session_bodies(primary.connection_string, q, "S", 6) == [f"S/{n}" for n in range(6)]
