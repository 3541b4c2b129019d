"""Sessions at their edges (issue 48): a secondary that cannot be asked never holds a send nothing could have
parked, what a sender parks is known to every thread at once, an entity's session is one whatever the case of its
name, an unencodable session id is a bad message, and a session's question to the backlog costs what its own
session needs."""

from __future__ import annotations

from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage

from spark_sb.errors import BadMessageError
from spark_sb.syphon import Syphon


def _send(sender: Any, q: str, session: str, n: int) -> dict[str, int]:
    message = ServiceBusMessage(f"{session}/{n}", message_id=f"{session}/{n}", session_id=session)
    return dict(sender.send(q, message).destinations)


def _drain_backlog(config: dict, expected: int) -> None:
    with Syphon.from_config(config) as syphon:
        assert syphon.drain(max_wait_time=0.5).total_moved == expected


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
