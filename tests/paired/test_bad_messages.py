"""Messages the SDK cannot encode (issue 9, findings 2 and 3): a bad message, never an outage, never counted
against a backlog queue, never retried; nothing of the call is sent."""

from __future__ import annotations

from datetime import timedelta

import pytest
from azure.servicebus import ServiceBusMessage

from spark_sb import messages
from spark_sb.errors import BadMessageError
from spark_sb.paired import PRIMARY

#: (message id, the field the SDK cannot encode, the message)
UNENCODABLE = [
    ("int-over-range", "n", lambda: ServiceBusMessage("x", message_id="int-over-range",
                                                      application_properties={"n": 2**31})),
    ("negative-ttl", "time_to_live", lambda: ServiceBusMessage("x", message_id="negative-ttl",
                                                               time_to_live=timedelta(seconds=-1))),
    ("ttl-over-limit", "time_to_live", lambda: ServiceBusMessage("x", message_id="ttl-over-limit",
                                                                 time_to_live=timedelta(days=100))),
    ("not-utf8", "raw", lambda: ServiceBusMessage("x", message_id="not-utf8",
                                                  application_properties={"raw": b"\xff\xfe"})),
]


def _check(info: pytest.ExceptionInfo[BadMessageError], message_id: str, field: str, entity: str) -> None:
    text = str(info.value)
    assert info.value.message_id == message_id and message_id in text
    assert info.value.entity == entity and entity in text
    if hasattr(messages, "check_encodable"):  # the precise reason names the field
        assert field in text
    else:
        assert "cannot be encoded" in text


@pytest.mark.parametrize(("message_id", "field", "make"), UNENCODABLE, ids=[u[0] for u in UNENCODABLE])
def test_a_message_the_sdk_cannot_encode_is_a_bad_message_and_nothing_of_the_call_is_sent(
    make_sender, make_queue, fake_time, primary, drain, message_id, field, make
) -> None:
    q = make_queue()
    sender = make_sender()
    with pytest.raises(BadMessageError) as info:
        sender.send(q, [ServiceBusMessage("good", message_id="good"), make()])
    _check(info, message_id, field, q)
    assert fake_time.sleeps == [] and sender.state(q) == "healthy"  # no retry, no failover timer
    assert drain(primary.connection_string, q, 1, wait=0.5) == []  # nothing of the call was sent
    assert sender.send(q, ServiceBusMessage("next")).destinations == {PRIMARY: 1}


@pytest.mark.parametrize(("message_id", "field", "make"), UNENCODABLE, ids=[u[0] for u in UNENCODABLE])
def test_a_bad_message_while_failed_over_cools_no_backlog_queue(
    emulator, make_sender, make_queue, secondary_admin, message_id, field, make
) -> None:
    q, other = make_queue(), make_queue()
    sender = make_sender(failover_interval="0s", backlog_queue_count=2)
    for entity in (q, other):
        emulator.fault("primary", "quota", entity=entity)
    assert sender.send(q, ServiceBusMessage("before")).backlog == 1
    with pytest.raises(BadMessageError) as info:
        sender.send(q, [ServiceBusMessage("good"), make()])
    _check(info, message_id, field, q)
    assert sender.board.cooling() == []  # the bad message is not the backlog queue's fault
    # valid messages, for this entity and another, still go to the backlog
    assert sender.send(q, ServiceBusMessage("after")).backlog == 1
    assert sender.send(other, ServiceBusMessage("other")).backlog == 1
    total = sum(secondary_admin.get_queue_runtime_properties(name).active_message_count
                for name in sender.backlog_queues)
    assert total == 3  # nothing of the bad call reached the backlog


def test_a_refused_chunk_among_sends_in_flight_fails_alone_and_fails_nothing_over(
    make_sender, make_queue, primary, secondary_admin, drain
) -> None:
    """Issue 47: eight sends in flight share the entity's one link; one chunk the service refuses (no session id for
    a queue that requires sessions) closed that link under the others, which failed as connection errors: an
    outage, counted towards failover. Now it fails alone as a bad message; the entity stays healthy, nothing is
    parked, every other message is in the primary once."""
    q = make_queue(requires_session=True)
    sender = make_sender(failover_interval="0s")
    rounds, bad = 4, (5, 2)
    futures = {}
    for r in range(rounds):
        for lane in range(8):
            messages_ = [ServiceBusMessage(f"{lane}-{r}-{j}", message_id=f"{lane}-{r}-{j}",
                                           session_id=None if (lane, r) == bad else f"s{lane}") for j in range(25)]
            futures[(lane, r)] = sender.submit(q, messages_)
    failed = {key: f.exception(timeout=120) for key, f in futures.items() if f.exception(timeout=120) is not None}
    assert list(failed) == [bad], failed
    assert isinstance(failed[bad], BadMessageError), repr(failed[bad])
    assert sender.state(q) == "healthy"
    assert sum(f.result().primary for key, f in futures.items() if key != bad) == (rounds * 8 - 1) * 25
    assert sum(secondary_admin.get_queue_runtime_properties(b).active_message_count
               for b in sender.backlog_queues) == 0
