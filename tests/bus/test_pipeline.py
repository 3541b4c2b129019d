"""Several sends in flight on one SDK sender (``spark_sb.bus.pipeline``), with the SDK against the emulator: an error
stays with the delivery it belongs to, a detach costs one reconnect shared by every send in flight, a transfer goes
on the wire when it is sent, and an SDK without one of the internals the path uses sends through its public
``send_messages``. Not timed: the tests count messages, errors and connections, never seconds (the bounds below are
seconds in which a thing happens at all, far above what it takes)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceiveMode
from pairing import pair_config, received_ids

from spark_sb import bus
from spark_sb.bus import pipeline
from spark_sb.config import load_config
from spark_sb.emulator import Emulator, NamespaceOptions
from spark_sb.errors import ErrorClass, classify, is_link_gone

IN_FLIGHT = 8


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """``far``: 40 ms away (20 ms each way), so that eight sends are on the wire before the first answer."""
    emu = Emulator([NamespaceOptions("primary"), NamespaceOptions("secondary"), NamespaceOptions("far", latency=0.02)],
                   data_dir=tmp_path_factory.mktemp("pipeline"))
    with emu:
        yield emu


@pytest.fixture
def far(emulator: Emulator) -> Iterator[bus.Namespace]:
    info = emulator["far"]
    config = load_config(pair_config(info, emulator["secondary"], "pipe"))
    namespace = bus.Namespace("primary", config.primary)
    yield namespace
    namespace.close()
    emulator.heal("far")


def _opened(emulator: Emulator, name: str) -> int:
    server = emulator.server(name)
    return int(server.call(server.stats)["connections_opened"])


def _batch(namespace: bus.Namespace, queue: str, ids: list[str], session_id: str | None) -> Any:
    with namespace.sender(queue) as sdk_sender:
        batch = sdk_sender.create_message_batch()
    for message_id in ids:
        batch.add_message(ServiceBusMessage(b"x" * 64, message_id=message_id, session_id=session_id))
    return batch


def _all_at_once(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run every call in a thread of its own, all released at once; each result is its value or its exception."""
    start = threading.Barrier(len(calls))

    def run(call: Callable[[], Any]) -> Any:
        start.wait()
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            return exc

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def test_one_refused_chunk_among_eight_in_flight_fails_alone(emulator: Emulator, far: bus.Namespace,
                                                              make_queue: Callable[..., str]) -> None:
    """Eight lanes send five chunks each, one after the other, to a queue that requires sessions; one chunk has no
    session id, which the service refuses (its delivery alone is rejected). Only that send fails, as a bad message;
    every other chunk is stored once, on the one connection."""
    queue = make_queue("far", requires_session=True)
    rounds, bad = 5, (3, 2)
    _batch(far, queue, [], None)  # the sender's one connection, opened
    before = _opened(emulator, "far")

    def lane(i: int) -> list[Exception]:
        failed = []
        for r in range(rounds):
            session = None if (i, r) == bad else f"s{i}"
            try:
                far.send(queue, _batch(far, queue, [f"c{i}-{r}-{j}" for j in range(20)], session))
            except Exception as exc:  # noqa: BLE001 - the test reads it
                failed.append(exc)
        return failed

    results = _all_at_once([lambda i=i: lane(i) for i in range(IN_FLIGHT)])

    errors = {i: r for i, r in enumerate(results) if r}
    assert list(errors) == [bad[0]] and len(errors[bad[0]]) == 1, f"only the refused chunk fails: {errors!r}"
    assert classify(errors[bad[0]][0]) is ErrorClass.BAD_MESSAGE, repr(errors[bad[0]][0])
    assert _opened(emulator, "far") - before == 0, "the shared connection stayed open: no reconnect"
    stored = _session_ids(emulator["far"].connection_string, queue, IN_FLIGHT)
    expected = sorted(f"c{i}-{r}-{j}" for i in range(IN_FLIGHT) for r in range(rounds) for j in range(20)
                      if (i, r) != bad)
    assert sorted(stored) == expected, "every good chunk once, the refused one nowhere"


def _session_ids(connection_string: str, queue: str, sessions: int) -> list[str]:
    """Every message id in sessions ``s0`` to ``s<sessions-1>`` of a session queue (received and deleted)."""
    ids: list[str] = []
    with ServiceBusClient.from_connection_string(connection_string) as client:
        for i in range(sessions):
            with client.get_queue_receiver(queue, session_id=f"s{i}",
                                           receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
                while got := receiver.receive_messages(max_message_count=100, max_wait_time=1):
                    ids.extend(str(message.message_id) for message in got)
    return ids


def test_a_forced_detach_with_eight_in_flight_costs_one_reconnect(emulator: Emulator, far: bus.Namespace,
                                                                   make_queue: Callable[..., str]) -> None:
    queue = make_queue("far")
    server = emulator.server("far")
    rounds = 6
    first_done = threading.Barrier(IN_FLIGHT + 1)
    detached_at: list[float] = []
    successes: list[float] = []
    lock = threading.Lock()

    def sender(lane: int) -> None:
        for r in range(rounds):
            far.send(queue, _batch(far, queue, [f"l{lane}-r{r}-{j}" for j in range(20)], None))
            with lock:
                successes.append(time.monotonic())
            if r == 0:
                first_done.wait()

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        futures = [pool.submit(sender, lane) for lane in range(IN_FLIGHT)]
        first_done.wait()
        before = _opened(emulator, "far")
        time.sleep(0.01)  # the lanes are sending their second chunks
        detached_at.append(time.monotonic())
        assert server.call(lambda: server.detach_links(queue)) >= 1
        errors = [f.exception(timeout=120) for f in futures]

    assert errors == [None] * IN_FLIGHT, f"every send succeeds through the detach: {errors!r}"
    assert _opened(emulator, "far") - before <= 2, "one reconnect, shared by the sends in flight"
    after = [t for t in successes if t > detached_at[0]]
    assert after and min(after) - detached_at[0] < 2.0, "the first success comes within a few round trips"
    expected = {f"l{lane}-r{r}-{j}" for lane in range(IN_FLIGHT) for r in range(rounds) for j in range(20)}
    assert set(received_ids(emulator["far"].connection_string, queue)) == expected


def test_a_link_that_stays_detached_fails_its_sends_with_the_condition(emulator: Emulator,
                                                                        make_queue: Callable[..., str]) -> None:
    """The namespace down: every attach is answered with ``amqp:link:detach-forced``; the caller sees that
    condition (link gone), not the ``amqp:unknown-error`` of a delivery the link dropped."""
    queue = make_queue("far")
    info = emulator["far"]
    config = load_config({**pair_config(info, emulator["secondary"], "pipe", primary_retry_total=1,
                                        primary_try_timeout="3s")})
    namespace = bus.Namespace("primary", config.primary, config.send_availability.primary_client_kwargs())
    try:
        namespace.send(queue, _batch(namespace, queue, ["warm"], None))
        batches = [_batch(namespace, queue, [f"d{i}"], None) for i in range(IN_FLIGHT)]
        emulator.fault("far", "down", queue)
        results = _all_at_once([lambda b=b: namespace.send(queue, b) for b in batches])
    finally:
        emulator.heal("far")
        namespace.close()
    assert all(isinstance(r, Exception) for r in results), results
    for error in results:
        assert is_link_gone(error) or "detach-forced" in str(error), repr(error)
        assert "unknown-error" not in str(error), repr(error)


def test_a_transfer_is_on_the_wire_before_the_pump_wakes(emulator: Emulator, far: bus.Namespace,
                                                         make_queue: Callable[..., str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The first send's answer is held (ack-lost: stored, never acknowledged), so the pump waits on a silent
    socket; a second send meanwhile is stored at once, not when the pump next wakes."""
    queue = make_queue("far")
    far.send(queue, _batch(far, queue, ["warm"], None))
    monkeypatch.setattr(pipeline, "_POLL", 30.0)
    emulator.fault("far", "ack-lost", queue)
    held = threading.Thread(target=lambda: _ignore(lambda: far.send(queue, _batch(far, queue, ["held"], None))),
                            daemon=True)
    held.start()
    second = threading.Thread(target=lambda: _ignore(lambda: far.send(queue, _batch(far, queue, ["second"], None))),
                              daemon=True)
    time.sleep(0.5)  # the first is on the wire, its answer held; the pump waits on the socket
    second.start()
    deadline = time.monotonic() + 5
    seen: set[str] = set()
    with ServiceBusClient.from_connection_string(emulator["far"].connection_string) as client, \
            client.get_queue_receiver(queue) as receiver:
        while "second" not in seen and time.monotonic() < deadline:
            seen |= {str(m.message_id) for m in receiver.peek_messages(max_message_count=10)}
            time.sleep(0.1)
    emulator.heal("far", queue)
    assert "second" in seen, f"the second transfer waited for the pump: the queue held {sorted(seen)}"


def _ignore(call: Callable[[], Any]) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - the held sends fail when the fault heals; the test reads the queue
        pass


def test_sends_go_on_while_another_thread_builds_its_batches(emulator: Emulator, far: bus.Namespace,
                                                              make_queue: Callable[..., str]) -> None:
    """Building batches (a partition's 500 messages encoded) holds the sender open, not its link: a send in flight
    on it is answered meanwhile."""
    queue = make_queue("far")
    building, built = threading.Event(), threading.Event()

    def build() -> None:
        with far.batch_sender(queue) as sdk_sender:
            sdk_sender.create_message_batch().add_message(ServiceBusMessage(b"x"))
            building.set()
            built.wait(30)  # a long build

    builder = threading.Thread(target=build, daemon=True)
    builder.start()
    assert building.wait(30)
    sent = threading.Event()
    sender = threading.Thread(target=lambda: (far.send(queue, _batch_unlocked(far, queue)), sent.set()), daemon=True)
    sender.start()
    try:
        assert sent.wait(15), "the send waited for the batches being built"
    finally:
        built.set()
        builder.join(30)
        sender.join(30)


def _batch_unlocked(namespace: bus.Namespace, queue: str) -> Any:
    with namespace.batch_sender(queue) as sdk_sender:
        batch = sdk_sender.create_message_batch()
    batch.add_message(ServiceBusMessage(b"y", message_id="during-build"))
    return batch


@pytest.mark.parametrize("internal", [f"{owner}.{name}" for owner, _, name in pipeline.INTERNALS])
def test_an_sdk_without_an_internal_sends_through_send_messages(
        emulator: Emulator, far: bus.Namespace, make_queue: Callable[..., str], internal: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Each internal the path calls, taken away when the path looks for them (at import): every send goes through
    the SDK's public ``send_messages`` (which the SDK keeps working: the internal is back before it sends), none
    fails, and the log says why once."""
    [(owner, name)] = [(where, n) for o, where, n in pipeline.INTERNALS if f"{o}.{n}" == internal]
    with pytest.MonkeyPatch.context() as patch:
        for cls in [cls for cls in owner.__mro__ if name in vars(cls)]:  # and where it is inherited from
            patch.delattr(cls, name)
        assert pipeline.check_internals() == [internal]
    queue = make_queue("far")
    calls = []
    original = type(far_sender := _opened_sender(far, queue)).send_messages

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(self, *args, **kwargs)

    try:
        with pytest.MonkeyPatch.context() as patch, caplog.at_level(logging.WARNING, logger=pipeline.__name__):
            patch.setattr(type(far_sender), "send_messages", counted)
            results = _all_at_once([lambda i=i: far.send(queue, _batch_unlocked(far, queue)) for i in range(4)])
    finally:
        pipeline.check_internals()
    assert results == [None] * 4
    assert len(calls) == 4, "every send through send_messages"
    said = [r for r in caplog.records if internal in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert len(received_ids(emulator["far"].connection_string, queue)) == 4


def _opened_sender(namespace: bus.Namespace, queue: str) -> Any:
    with namespace.batch_sender(queue) as sdk_sender:
        return sdk_sender


def test_closing_the_namespace_lets_the_sends_in_flight_end(emulator: Emulator, make_queue: Callable[..., str]
                                                            ) -> None:
    """A namespace closed while sends are in flight (a worker shutting down) closes its connection once they are
    answered: none fails, every message is stored (ack-lost holds the answers until the close has begun, so each
    is sent again: stored at least once); a send after the close is refused, saying so."""
    queue = make_queue("far")
    config = load_config(pair_config(emulator["far"], emulator["secondary"], "pipe"))
    namespace = bus.Namespace("primary", config.primary)
    namespace.send(queue, _batch(namespace, queue, ["warm"], None))
    batches = [_batch(namespace, queue, [f"z{i}-{j}" for j in range(100)], None) for i in range(IN_FLIGHT)]
    emulator.fault("far", "ack-lost", queue)  # the answers held: every send is in flight when the close comes
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        futures = [pool.submit(namespace.send, queue, b) for b in batches]
        deadline = time.monotonic() + 30
        while _waiting(namespace) < IN_FLIGHT and time.monotonic() < deadline:
            time.sleep(0.01)
        closer = threading.Thread(target=namespace.close, kwargs={"timeout": 30})
        closer.start()
        time.sleep(0.2)
        emulator.heal("far", queue)  # held answers are settled with a timeout error: each send goes again
        results = [f.exception(timeout=60) for f in futures]
        closer.join(60)
    assert results == [None] * IN_FLIGHT
    with pytest.raises(RuntimeError, match="closed"):
        namespace.send(queue, batches[0])
    ids = received_ids(emulator["far"].connection_string, queue)
    assert set(ids) == {"warm"} | {f"z{i}-{j}" for i in range(IN_FLIGHT) for j in range(100)}


def _waiting(namespace: bus.Namespace) -> int:
    """The sends of ``namespace`` waiting for their answers (on the wire)."""
    return sum(len(io._outstanding) for io in list(namespace._sender_ios.values()))


def test_a_connection_whose_sends_wait_long_is_kept_alive(tmp_path: Any) -> None:
    """A namespace that closes a connection silent for 1.5 s (its open asks for a frame every 0.75 s): a send
    whose answer is held 4 s keeps its connection open (empty frames), so it is not reconnected under the wait."""
    emu = Emulator([NamespaceOptions("idle"), NamespaceOptions("secondary")], data_dir=tmp_path, idle_timeout=1.5,
                   entities={"queues": [{"name": "held"}]})
    with emu:
        config = load_config(pair_config(emu["idle"], emu["secondary"], "pipe"))
        namespace = bus.Namespace("primary", config.primary)
        try:
            namespace.send("held", _batch(namespace, "held", ["warm"], None))
            before = _opened(emu, "idle")
            emu.fault("idle", "ack-lost", "held")
            sending = threading.Thread(target=lambda: _ignore(
                lambda: namespace.send("held", _batch(namespace, "held", ["held"], None))), daemon=True)
            sending.start()
            time.sleep(4)
            opened_while_held = _opened(emu, "idle") - before
            emu.heal("idle", "held")
            sending.join(60)
        finally:
            namespace.close()
    assert opened_while_held == 0, "the connection was closed as idle while its send waited"


class _Span:
    """A tracing implementation that records the spans the SDK opens (azure-core's ``AbstractSpan``, the parts the
    SDK calls)."""

    opened: list[tuple[str, int]] = []

    def __init__(self, name: str = "span", kind: Any = None, links: Any = None, **_: Any) -> None:
        self.name = name
        self.links = links or []

    def __enter__(self) -> _Span:
        return self

    def __exit__(self, *exc: Any) -> None:
        _Span.opened.append((self.name, len(self.links)))

    def add_attribute(self, key: str, value: Any) -> None:
        pass

    def to_header(self) -> dict[str, str]:
        return {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


def test_each_send_has_the_sdks_send_span(emulator: Emulator, far: bus.Namespace, make_queue: Callable[..., str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With tracing on (azure-core's tracing implementation set), a send in flight on the shared link opens the
    span ``ServiceBus.send`` the SDK's ``send_messages`` opens, linked to its messages' spans."""
    from azure.core.settings import settings

    queue = make_queue("far")
    monkeypatch.setattr(_Span, "opened", [])
    settings.tracing_implementation.set_value(_Span)
    try:
        far.send(queue, _batch(far, queue, ["t1", "t2", "t3"], None))
    finally:
        settings.tracing_implementation.unset_value()
    assert ("ServiceBus.send", 3) in _Span.opened, _Span.opened
