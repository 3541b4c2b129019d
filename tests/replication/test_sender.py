"""The replicating sender (active and passive replication) against the two emulator namespaces with injected
faults, on fake time: where the messages end up, what the caller is told."""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.exceptions import OperationTimeoutError

from spark_sb.errors import BadMessageError, ConfigError, EntityNotFoundError, ReplicationError
from spark_sb.replication import ReplicatingSender


def received(namespace: Any, queue: str) -> list[str]:
    """The message ids a receiver of ``queue`` peeks through the SDK, sorted."""
    with ServiceBusClient.from_connection_string(namespace.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue) as receiver:
            return sorted(str(m.message_id) for m in receiver.peek_messages(max_message_count=100))


def msg(message_id: str | None) -> ServiceBusMessage:
    message = ServiceBusMessage(f"body of {message_id}")
    message.message_id = message_id  # None: the sender gives it one
    return message


# --- active ------------------------------------------------------------------------------------------------


def test_active_sends_every_message_to_both_namespaces_with_the_same_id(make_sender, pair_queue, primary,
                                                                         secondary) -> None:
    q = pair_queue()
    sender = make_sender("active")
    one = sender.send(q, msg("a-1"))
    unnamed = msg(None)
    many = sender.send(q, [msg("a-2"), unnamed, msg("a-3")])
    assert one.destinations == {"primary": 1, "secondary": 1} and one.sent == 1 and one.errors == {}
    assert many.destinations == {"primary": 3, "secondary": 3} and many.sent == 3
    assert unnamed.message_id is not None and len(unnamed.message_id) == 32  # a uuid4 hex, on the caller's object
    expected = sorted(["a-1", "a-2", "a-3", unnamed.message_id])
    assert received(primary, q) == expected  # what a receiver of each namespace gets
    assert received(secondary, q) == expected
    assert sender.state(q) == "both"
    assert sender.stats()["sent_primary"] == sender.stats()["sent_secondary"] == 4


@pytest.mark.parametrize("down", ["primary", "secondary"])
def test_active_one_side_down_every_send_succeeds_on_the_other_and_the_down_side_is_skipped(
    stored, emulator, make_sender, pair_queue, primary, secondary, time_, down
) -> None:
    q = pair_queue()
    up = "secondary" if down == "primary" else "primary"
    sender = make_sender("active")
    emulator.fault(down, "down")
    first = sender.send(q, [msg("d-1"), msg("d-2")])
    assert first.destinations == {up: 2} and first.sent == 2
    assert set(first.errors) == {down}  # the down side's error is reported, not raised
    assert sender.state(q) == f"{up} only ({down} skipped)"
    assert sender.active_namespace(q) == ("secondary" if down == "primary" else "primary")
    emulator.heal(down)
    # healed, but skipped until the retry interval has passed: not tried, no error
    second = sender.send(q, msg("d-3"))
    assert second.destinations == {up: 1} and second.errors == {}
    time_.now += 29.9
    assert sender.send(q, msg("d-4")).destinations == {up: 1}
    time_.now += 0.2
    third = sender.send(q, msg("d-5"))
    assert third.destinations == {"primary": 1, "secondary": 1}
    assert sender.state(q) == "both"
    assert stored(up, q) == ["d-1", "d-2", "d-3", "d-4", "d-5"]
    assert stored(down, q) == ["d-5"]
    stats = sender.stats()
    assert (stats["skipped_sides"], stats["degraded_sends"], stats[f"sent_{up}"], stats[f"sent_{down}"]) == (2, 1, 5, 1)
    assert time_.sleeps == []


def test_active_a_skipped_side_is_tried_at_once_when_the_other_fails(stored, emulator, make_sender, pair_queue,
                                                                     primary, secondary) -> None:
    q = pair_queue()
    sender = make_sender("active")
    emulator.fault("primary", "down")
    assert sender.send(q, msg("s-1")).destinations == {"secondary": 1}
    emulator.heal("primary")
    emulator.fault("secondary", "down")  # the only side tried fails: the skipped primary is tried at once
    result = sender.send(q, msg("s-2"))
    assert result.destinations == {"primary": 1} and set(result.errors) == {"secondary"}
    assert sender.state(q) == "primary only (secondary skipped)"
    emulator.heal("secondary")
    assert stored("primary", q) == ["s-2"]
    assert stored("secondary", q) == ["s-1"]


def test_active_both_down_raises_naming_both_sides_and_sends_nothing(stored, emulator, make_sender, pair_queue,
                                                                     primary, secondary) -> None:
    q = pair_queue()
    sender = make_sender("active")
    emulator.fault("primary", "down")
    emulator.fault("secondary", "quota", entity=q)
    with pytest.raises(ReplicationError) as info:
        sender.send(q, [msg("x-1"), msg("x-2")])
    assert set(info.value.errors) == {"primary", "secondary"}
    assert "primary" in str(info.value) and "secondary" in str(info.value) and q in str(info.value)
    assert info.value.retryable
    assert sender.state(q) == "both skipped"
    # the next send tries both again: still down, still nothing
    with pytest.raises(ReplicationError):
        sender.send(q, msg("x-3"))
    emulator.heal("primary")
    emulator.heal("secondary")
    assert stored("primary", q) == [] and stored("secondary", q) == []


def test_active_an_entity_missing_on_both_is_entity_not_found(make_sender, primary, secondary) -> None:
    sender = make_sender("active")
    q = f"no-such-queue-{uuid.uuid4().hex[:8]}"
    with pytest.raises(EntityNotFoundError) as info:
        sender.send(q, msg("lost?"))
    text = str(info.value)
    assert q in text and "primary" in text and "secondary" in text
    assert "SAS_KEY_VALUE" not in text
    assert sender.state(q) == "both"  # not an outage: nothing skipped


def test_active_a_too_large_message_is_a_bad_message_and_nothing_is_sent(stored, make_sender, pair_queue, primary,
                                                                         secondary) -> None:
    q = pair_queue()
    sender = make_sender("active")
    big = ServiceBusMessage(b"x" * 300_000, message_id="huge-1")
    with pytest.raises(BadMessageError) as info:
        sender.send(q, [msg("small-1"), big])
    assert "huge-1" in str(info.value) and q in str(info.value)
    assert stored("primary", q) == [] and stored("secondary", q) == []
    assert sender.state(q) == "both"


def test_active_a_side_that_stored_part_of_a_call_has_not_accepted_it(stored, make_sender, pair_queue, primary,
                                                                       secondary) -> None:
    q = pair_queue(max_size_in_megabytes=1)  # the primary's queue is full after 5 of these messages
    sender = make_sender("active")
    big = [ServiceBusMessage(b"x" * 200_000, message_id=f"big-{i}") for i in range(8)]  # one batch each
    result = sender.send(q, big)
    assert result.destinations == {"secondary": 8} and result.sent == 8
    assert "primary" in result.errors  # quota exceeded after 5 batches
    assert stored("primary", q) == [f"big-{i}" for i in range(5)]  # duplicates receivers drop by id
    assert stored("secondary", q) == [f"big-{i}" for i in range(8)]
    assert sender.state(q) == "secondary only (primary skipped)"


def _counting_adds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The message id of every message the SDK adds to a batch (``ServiceBusMessageBatch.add_message``; an add
    refused because the batch is full is not counted)."""
    from azure.servicebus import ServiceBusMessageBatch

    adds: list[str] = []
    add = ServiceBusMessageBatch.add_message

    def counting(self: Any, message: Any) -> None:
        add(self, message)
        adds.append(str(message.message_id))

    monkeypatch.setattr(ServiceBusMessageBatch, "add_message", counting)
    return adds


def test_active_encodes_each_message_once_for_both_namespaces(stored, make_sender, pair_queue, monkeypatch) -> None:
    """Active replication costs the CPU of one encode per message (issue 21): both namespaces are sent the same
    batches, built once."""
    q = pair_queue()
    sender = make_sender("active")
    sender.send(q, [msg("warm")])  # both sides' links open
    adds = _counting_adds(monkeypatch)
    ids = [f"once-{i}" for i in range(20)]
    result = sender.send(q, [msg(i) for i in ids])
    assert result.destinations == {"primary": 20, "secondary": 20}
    assert sorted(adds) == sorted(ids)  # each encoded once (twice before: a batch per side)
    assert stored("primary", q) == stored("secondary", q) == sorted(["warm", *ids])


def test_active_a_side_taking_smaller_batches_builds_its_own(stored, emulator, make_sender, pair_queue,
                                                             monkeypatch) -> None:
    """Namespaces of different tiers take batches of different sizes: here the primary's links take 1 MiB
    batches (premium), the secondary's 256 KiB (standard). The primary's one batch of three 150 KB messages does
    not fit the secondary's link, and the secondary builds its own batches."""
    server = emulator.server("primary")
    limit = server.max_message_size
    q = pair_queue()
    server.call(lambda: setattr(server, "max_message_size", 1024 * 1024))
    try:
        sender = make_sender("active")  # links opened from now on advertise the larger limit
        adds = _counting_adds(monkeypatch)
        ids = [f"wide-{i}" for i in range(3)]
        result = sender.send(q, [ServiceBusMessage(b"x" * 150_000, message_id=i) for i in ids])
    finally:
        server.call(lambda: setattr(server, "max_message_size", limit))
    assert result.destinations == {"primary": 3, "secondary": 3} and result.errors == {}
    assert sorted(adds) == sorted(ids * 2)  # the primary's batch, then the secondary's own
    assert stored("primary", q) == stored("secondary", q) == ids


def test_active_one_instance_shared_by_threads(stored, make_sender, pair_queue, primary, secondary) -> None:
    q = pair_queue()
    sender = make_sender("active")

    def five(t: int) -> list[dict]:
        return [dict(sender.send(q, msg(f"t{t}-{i}")).destinations) for i in range(5)]

    with ThreadPoolExecutor(4) as pool:
        results = [r for one in pool.map(five, range(4)) for r in one]  # an error in a thread is raised here
    assert results == [{"primary": 1, "secondary": 1}] * 20
    expected = sorted(f"t{t}-{i}" for t in range(4) for i in range(5))
    assert stored("primary", q) == expected and stored("secondary", q) == expected


# --- passive -----------------------------------------------------------------------------------------------


def test_passive_sends_to_the_primary_only(stored, make_sender, pair_queue, primary, secondary) -> None:
    q = pair_queue()
    sender = make_sender("passive")
    result = sender.send(q, [msg("p-1"), msg("p-2")])
    assert result.destinations == {"primary": 2} and result.sent == 2 and result.errors == {}
    assert stored("primary", q) == ["p-1", "p-2"] and stored("secondary", q) == []
    assert sender.active_namespace(q) == "primary" and sender.state(q) == "primary active"


def test_passive_swaps_on_an_outage_for_every_sender_and_stays_swapped_until_the_next(
    stored, emulator, make_sender, config, pair_queue, primary, secondary, caplog
) -> None:
    caplog.set_level(logging.WARNING, logger="spark_sb.replication.sender")
    q = pair_queue()
    conf = config("passive")
    sender = make_sender(conf)
    assert sender.send(q, msg("before")).destinations == {"primary": 1}
    emulator.fault("primary", "down")
    result = sender.send(q, [msg("during-1"), msg("during-2")])
    assert result.destinations == {"secondary": 2} and set(result.errors) == {"primary"}
    assert sender.active_namespace(q) == "secondary" and sender.state(q) == "secondary active"
    other = make_sender(conf)  # another sender of the process learns the swap
    assert other.active_namespace(q) == "secondary"
    emulator.heal("primary")
    # no failback timer: the secondary stays active after the primary is back
    assert other.send(q, msg("healed")).destinations == {"secondary": 1}
    emulator.fault("secondary", "down")
    back = sender.send(q, msg("swap-back"))
    assert back.destinations == {"primary": 1}
    assert sender.active_namespace(q) == other.active_namespace(q) == "primary"
    emulator.heal("secondary")
    assert stored("primary", q) == ["before", "swap-back"]
    assert stored("secondary", q) == ["during-1", "during-2", "healed"]
    assert sender.stats()["swaps"] == 2 and other.stats()["swaps"] == 0
    swaps = [r.getMessage() for r in caplog.records if "is now active" in r.getMessage()]
    assert len(swaps) == 2 and all(q in line for line in swaps)
    assert "the secondary namespace is now active" in swaps[0] and "the primary namespace is now active" in swaps[1]
    assert not any("SAS_KEY_VALUE" in r.getMessage() for r in caplog.records)


def test_passive_after_a_failure_part_way_only_the_rest_goes_to_the_other_side(stored, make_sender, pair_queue,
                                                                               primary, secondary) -> None:
    q = pair_queue(max_size_in_megabytes=1)  # the primary's queue is full after 5 of these messages
    sender = make_sender("passive")
    big = [ServiceBusMessage(b"x" * 200_000, message_id=f"big-{i}") for i in range(8)]  # one batch each
    result = sender.send(q, big)
    assert result.destinations == {"primary": 5, "secondary": 3} and result.sent == 8
    assert stored("primary", q) == [f"big-{i}" for i in range(5)]
    assert stored("secondary", q) == [f"big-{i}" for i in range(5, 8)]  # nothing resent, nothing lost
    assert sender.active_namespace(q) == "secondary"


def test_passive_both_down_raises_and_keeps_the_roles(stored, emulator, make_sender, pair_queue, primary,
                                                      secondary) -> None:
    q = pair_queue()
    sender = make_sender("passive")
    emulator.fault("primary", "down")
    emulator.fault("secondary", "down")
    with pytest.raises(ReplicationError) as info:
        sender.send(q, msg("nowhere"))
    assert set(info.value.errors) == {"primary", "secondary"}
    assert sender.active_namespace(q) == "primary" and sender.stats()["swaps"] == 0
    emulator.heal("primary")
    emulator.heal("secondary")
    assert stored("primary", q) == [] and stored("secondary", q) == []


def test_passive_busy_waits_and_retries_the_same_side_without_swapping(stored, emulator, make_sender, pair_queue,
                                                                       primary, secondary, time_) -> None:
    q = pair_queue()
    sender = make_sender("passive")
    emulator.fault("primary", "busy", entity=q)
    time_.after_sleep = lambda count: emulator.heal("primary", entity=q) if count == 2 else None
    result = sender.send(q, msg("after-busy"))
    assert time_.sleeps == [10.0, 10.0]  # server_busy_backoff each time
    assert result.destinations == {"primary": 1}
    assert sender.active_namespace(q) == "primary"
    stats = sender.stats()
    assert (stats["busy_waits"], stats["swaps"]) == (2, 0)
    assert stored("primary", q) == ["after-busy"] and stored("secondary", q) == []


def test_passive_entity_not_found_raises_at_once_without_swapping(stored, make_sender, make_queue, secondary) -> None:
    q = make_queue("secondary")  # on the secondary only
    sender = make_sender("passive")
    with pytest.raises(EntityNotFoundError) as info:
        sender.send(q, msg("lost?"))
    assert q in str(info.value) and "primary" in str(info.value)
    assert sender.active_namespace(q) == "primary"
    assert stored("secondary", q) == []


def test_passive_a_lost_acknowledgement_stores_the_message_on_both_namespaces(
    stored, emulator, make_sender, pair_queue, primary, secondary
) -> None:
    q = pair_queue()
    sender = make_sender("passive")
    sender.send(q, msg("warm-up"))  # the link is open: the next send only waits for its answer
    emulator.fault("primary", "ack-lost", entity=q)
    result = sender.send(q, msg("m"))
    assert result.destinations == {"secondary": 1}
    assert isinstance(result.errors["primary"], OperationTimeoutError)
    assert sender.active_namespace(q) == "secondary"
    emulator.heal("primary", entity=q)
    # the duplicate-reception hazard: the primary stored m although its answer was lost
    assert stored("primary", q) == ["m", "warm-up"]
    assert stored("secondary", q) == ["m"]


# --- construction and lifecycle ------------------------------------------------------------------------------


def test_paired_mode_is_refused_and_the_repr_shows_no_secret(config, make_sender) -> None:
    with pytest.raises(ConfigError, match="PairedSender"):
        ReplicatingSender.from_config(config("paired"))
    sender = make_sender("active")
    text = repr(sender)
    assert "active" in text and "primary" in text and "SAS_KEY_VALUE" not in text and "SharedAccessKey" not in text


def test_arguments_are_checked_and_a_closed_sender_refuses(make_sender, pair_queue) -> None:
    q = pair_queue()
    sender = make_sender("active")
    with pytest.raises(ValueError):
        sender.send("", msg("x"))
    with pytest.raises(TypeError):
        sender.send(q, ["not a message"])  # type: ignore[list-item]
    assert sender.send(q, []).sent == 0
    sender.close()
    sender.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        sender.send(q, msg("late"))
