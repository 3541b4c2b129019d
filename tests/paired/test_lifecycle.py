"""Bad input, closing, and many threads through one sender."""

from __future__ import annotations

import os
import threading
import time

import pytest
from azure.servicebus import ServiceBusMessage

from spark_sb import messages
from spark_sb.config import from_options, load_config
from spark_sb.errors import ConfigError
from spark_sb.paired import PairedSender


def _sockets() -> set[str]:
    """The sockets this process holds (``socket:[inode]``): compared as sets, so that sockets of earlier tests
    closing meanwhile do not count."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


@pytest.mark.parametrize(
    ("change", "option", "shown"),
    [
        (("send_availability", "failover_interval", "2h"), "send_availability.failover_interval", "2 h"),
        (("send_availability", "ping_primary_interval", "0s"), "send_availability.ping_primary_interval", "0 s"),
        (("send_availability", "backlog_queue_count", 0), "send_availability.backlog_queue_count", "0"),
        (("secondary", "admin_endpoint", "ftp://localhost:1"), "secondary.admin_endpoint", "ftp://localhost:1"),
        (("primary", "admin_endpoint", "localhost:notaport"), "primary.admin_endpoint", "localhost:notaport"),
    ],
)
def test_a_wrong_value_names_the_option_and_value_before_anything_connects(
    make_config, change, option, shown
) -> None:
    config = make_config()
    section, key, value = change
    config[section][key] = value
    threads = threading.active_count()
    with pytest.raises(ConfigError) as info:
        PairedSender.from_config(config)
    assert str(info.value).startswith(f"{option}: ") and shown in str(info.value)
    assert "SAS_KEY_VALUE" not in str(info.value)
    assert threading.active_count() == threads


def test_a_missing_section_is_named(make_config) -> None:
    config = make_config()
    del config["secondary"]
    with pytest.raises(ConfigError, match="^secondary: required"):
        PairedSender.from_config(config)


def test_admin_endpoint_is_parsed_normalised_and_only_for_the_emulator(make_config, primary) -> None:
    config = make_config()
    config["secondary"]["admin_endpoint"] = "127.0.0.1:5301"
    assert load_config(config).secondary.admin_endpoint == "http://127.0.0.1:5301"
    assert load_config(config).to_dict()["secondary"]["admin_endpoint"] == "http://127.0.0.1:5301"
    real = "Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=n;SharedAccessKey=k"
    config["secondary"] = {"connection_string": real, "admin_endpoint": "http://localhost:5301"}
    with pytest.raises(ConfigError, match="^secondary.admin_endpoint: only used with an emulator"):
        load_config(config)
    config["secondary"] = {"fully_qualified_namespace": "contoso.servicebus.windows.net",
                           "admin_endpoint": "http://localhost:5301"}
    with pytest.raises(ConfigError, match="^secondary.admin_endpoint"):
        load_config(config)
    options = {"primary.connectionString": primary.connection_string, "primary.adminEndpoint": primary.admin_url,
               "secondary.connectionString": primary.connection_string.replace("localhost", "127.0.0.1")}
    assert from_options(options).primary.admin_endpoint == primary.admin_url.replace("localhost", "localhost")


def test_close_leaves_no_threads_or_sockets_and_is_idempotent(emulator, make_config, make_queue, fake_time) -> None:
    q = make_queue()
    threads_before = set(threading.enumerate())
    sockets_before = _sockets()
    sender = PairedSender.from_config(make_config(failover_interval="0s", ping_primary_interval="1s"),
                                      clock=fake_time.clock, sleep=fake_time.sleep,
                                      ping_wait=fake_time.idle)
    assert sender.send(q, ServiceBusMessage("primary")).primary == 1
    emulator.fault("primary", "quota", entity=q)
    assert sender.send(q, ServiceBusMessage("backlog")).backlog == 1
    emulator.fault("primary", "down")  # the ping meets a dropped connection: the primary's client is rebuilt
    fake_time.advance(1)
    assert sender.send(q, ServiceBusMessage("backlog again")).backlog == 1
    opened = _sockets() - sockets_before  # the sender's connections (and the in-process emulator's ends)
    assert opened
    started = time.monotonic()
    sender.close()
    assert time.monotonic() - started < 5
    sender.close()
    with pytest.raises(RuntimeError, match="closed"):
        sender.send(q, ServiceBusMessage("late"))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (set(threading.enumerate()) - threads_before or _sockets() & opened):
        time.sleep(0.05)
    assert set(threading.enumerate()) - threads_before == set()
    assert _sockets() & opened == set()


def test_threads_sending_through_a_failover_lose_nothing(
    emulator, make_sender, make_queue, primary, secondary, drain
) -> None:
    q = make_queue()
    sender = make_sender(failover_interval="5s", backlog_queue_count=2)
    sender.pair()
    sent = []
    results = []
    lock = threading.Lock()
    faulted = threading.Event()
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(20):
                message_id = f"w{worker}-{i}"
                result = sender.send(q, ServiceBusMessage(message_id, message_id=message_id))
                with lock:
                    sent.append(message_id)
                    results.append(result)
                    if len(sent) == 30 and not faulted.is_set():
                        emulator.fault("primary", "quota", entity=q)
                        faulted.set()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert errors == []
    primary_count = sum(r.primary for r in results)
    backlog_count = sum(r.backlog for r in results)
    assert primary_count + backlog_count == 80 and backlog_count > 0 and primary_count >= 30
    on_primary = [m.message_id for m in drain(primary.connection_string, q, primary_count)]
    in_backlog = []
    for queue in sender.backlog_queues:
        expected = sum(r.destinations.get(queue, 0) for r in results)
        for m in drain(secondary.connection_string, queue, expected):
            assert messages.from_backlog(m, m.enqueued_time_utc).entity == q
            in_backlog.append(m.message_id)
    assert sorted(on_primary + in_backlog) == sorted(sent)
    assert len(set(on_primary + in_backlog)) == 80


def test_a_second_sender_of_a_pairing_with_other_intervals_is_refused_naming_both_values(make_config) -> None:
    config = make_config(failover_interval="10s", ping_primary_interval="5s", backlog_cooldown="30s")
    other = {**config, "send_availability": {**config["send_availability"], "failover_interval": "20s",
                                             "backlog_cooldown": "1m"}}
    first = PairedSender.from_config(config)
    try:
        with pytest.raises(ConfigError) as info:
            PairedSender.from_config(other)
        text = str(info.value)
        assert "send_availability.failover_interval" in text and "10 s" in text and "20 s" in text
        assert "send_availability.backlog_cooldown" in text and "30 s" in text and "1 min" in text
        assert "ping_primary_interval" not in text  # the same for both
        assert "SAS_KEY_VALUE" not in text
        with PairedSender.from_config(config) as same:  # the same options share the state
            assert same.board is first.board
    finally:
        first.close()
    with PairedSender.from_config(other) as later:  # nobody uses the first options any more
        assert later.board.failover_interval == 20 and later.board.backlog_cooldown == 60
