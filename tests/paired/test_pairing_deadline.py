"""Pairing at a failover is bounded (issue 34, item 6): a secondary whose administration endpoint accepts and never
answers, or whose host name does not resolve, fails the failing-over send with ``PairingError`` within a minute
(``send_availability.pairing_timeout``, 30 s by default, over all of one send's attempts), and nothing of the send
is acknowledged, so its batch is replayed. An endpoint that answers keeps its behaviour: a queue it refuses leaves
the others; one that stops answering ends the attempt with the queues made so far."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage
from pairing import pair_config, peek_all, within

from spark_sb import sink as sink_module
from spark_sb.config import load_config
from spark_sb.errors import PairingError
from spark_sb.paired import PairedSender

#: what "within a minute" means: before, one attempt against a silent endpoint took (1 + 10) x 3 requests of 10 s
MINUTE = 60.0


@pytest.fixture(autouse=True)
def _fresh_senders() -> Iterator[None]:
    yield
    sink_module.close_senders()


def _with_secondary_admin(config: dict, endpoint: str, **secondary: Any) -> dict:
    return {**config, "secondary": {**config["secondary"], "admin_endpoint": endpoint, **secondary}}


def _timed(seconds: float, work: Any) -> tuple[BaseException | None, float]:
    """``work()`` within ``seconds`` (else an AssertionError): the error it raised (None) and how long it took."""
    started = time.monotonic()
    try:
        within(seconds, work)
    except AssertionError:
        raise
    except Exception as exc:  # noqa: BLE001 - handed to the test
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


def test_a_failover_to_a_secondary_whose_admin_endpoint_never_answers_fails_the_batch_within_a_minute(
        emulator, primary, secondary, make_queue, silent_endpoint) -> None:
    """The pairing defaults (pairing_timeout 30 s, admin_timeout 10 s, 3 tries 1 s apart, 10 backlog queues): the
    sink's partition fails with PairingError within a minute, reporting nothing sent (the batch is replayed)."""
    q = make_queue()
    raw = _with_secondary_admin(pair_config(primary, secondary, "pd", failover_interval="2s"), silent_endpoint)
    config = load_config({**raw, "sink": {"entity": q}})
    assert config.send_availability.pairing_timeout.total_seconds() == 30
    run = sink_module.PartitionRun(config, config.fingerprint(), 3, 0, (), reject=False)
    rows = [{"body": f"m{i}".encode(), "message_id": f"m{i}"} for i in range(20)]
    emulator.fault("primary", "down")
    error, seconds = _timed(MINUTE + 30, lambda: list(run.run_rows(rows)))
    assert isinstance(error, PairingError), error
    assert seconds < MINUTE, f"PairingError after {seconds:.0f} s"
    text = str(error)
    assert silent_endpoint in text and "pairing_timeout 30 s" in text
    assert "replays" in text and "nothing is lost" in text
    # nothing reported sent: the partition raised, so Spark fails the batch and replays it
    assert (run.sent, run.primary, run.backlog) == (0, 0, {})
    assert sink_module.sender_for(config).backlog_queues == ()
    emulator.heal("primary")
    assert peek_all(primary.connection_string, q) == []


def test_a_send_spends_one_pairing_timeout_over_the_last_wait_and_the_failover(
        emulator, primary, secondary, make_queue, silent_endpoint) -> None:
    """Short settings: the attempt at the last wait before the failover uses up pairing_timeout (2 s: two tries of
    the listing, 1 s each); the failover does not try again, it raises that attempt's error at once."""
    q = make_queue()
    raw = _with_secondary_admin(
        pair_config(primary, secondary, "pd", failover_interval="1s", pairing_timeout="2s", provision_retries=3,
                    provision_retry_spacing="0s"), silent_endpoint, admin_timeout="1s")
    attempts: list[float] = []
    with PairedSender.from_config(raw) as sender:
        provision = sender._provision

        def counted(deadline: float) -> list[str]:
            attempts.append(deadline)
            return provision(deadline)

        sender._provision = counted  # type: ignore[method-assign]
        emulator.fault("primary", "down")
        error, seconds = _timed(30, lambda: sender.send(q, [ServiceBusMessage("a", message_id="a")]))
        assert isinstance(error, PairingError), error
        assert len(attempts) == 1  # the failover found the send's pairing time used up
        assert seconds < 1 + 2 + 3, f"{seconds:.1f} s"  # the failover interval, pairing_timeout, slack
        assert "not tried again" in str(error) and "pairing_timeout (2 s)" in str(error)
        assert sender.stats()["sent_primary"] == sender.stats()["sent_backlog"] == 0


def test_an_admin_host_that_does_not_resolve_fails_pairing_at_once_naming_it(
        emulator, primary, secondary, make_queue) -> None:
    """Defaults but the failover interval: a host name that does not resolve ends the attempt after its first
    request's tries (2 s), not after every backlog queue's (22 s before)."""
    q = make_queue()
    raw = _with_secondary_admin(pair_config(primary, secondary, "pd", failover_interval="0s"),
                                "http://nonexistent.invalid:5300")
    with PairedSender.from_config(raw) as sender:
        emulator.fault("primary", "down")
        error, seconds = _timed(MINUTE, lambda: sender.send(q, [ServiceBusMessage("a", message_id="a")]))
        assert isinstance(error, PairingError), error
        assert seconds < 10, f"{seconds:.1f} s"
        assert "nonexistent.invalid" in str(error) and "host not found" in str(error)
        assert "SharedAccessKey=" not in str(error)
        assert sender.stats()["sent_backlog"] == 0


def test_a_queue_the_endpoint_refuses_leaves_the_others(emulator, primary, secondary) -> None:
    """An endpoint that answers (here 503 for one queue, every try) is still asked for the other queues."""
    raw = pair_config(primary, secondary, "pd", backlog_queue_count=3, provision_retries=2,
                      provision_retry_spacing="0s")
    with PairedSender.from_config(raw) as sender:
        names = sender.config.send_availability.backlog_queue_names()
        emulator.fault("secondary", "busy", entity=names[0])
        try:
            assert sender.pair() == 2
        finally:
            emulator.heal("secondary")
        assert sender.backlog_queues == (names[1], names[2])


def test_an_endpoint_that_stops_answering_ends_the_attempt_with_the_queues_made_so_far(
        emulator, primary, secondary, secondary_admin) -> None:
    """The second queue's creation is never answered (a request the emulator holds): the attempt ends there, with
    the first queue, instead of waiting on the third too."""
    raw = _with_secondary_admin(
        pair_config(primary, secondary, "pd", backlog_queue_count=3, provision_retries=2,
                    provision_retry_spacing="0s"), secondary.admin_url, admin_timeout="1s")
    with PairedSender.from_config(raw) as sender:
        names = sender.config.send_availability.backlog_queue_names()
        emulator.fault("secondary", "timeout", entity=names[1])
        try:
            error, seconds = _timed(30, sender.pair)
        finally:
            emulator.heal("secondary")
        assert error is None, error
        assert sender.backlog_queues == (names[0],)
        assert seconds < 2 * 1 + 3, f"{seconds:.1f} s"  # two tries of 1 s, slack
        assert [p.name for p in secondary_admin.list_queues() if p.name == names[2]] == []  # never asked for
