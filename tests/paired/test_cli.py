"""``spark-sb provision`` and ``spark-sb status``."""

from __future__ import annotations

import yaml
from azure.servicebus import ServiceBusClient, ServiceBusMessage

from spark_sb import cli, messages


def _write(tmp_path, config: dict) -> str:
    path = tmp_path / "spark-sb.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_provision_prints_the_usable_count_and_status_the_backlog(
    tmp_path, make_config, secondary_admin, capsys
) -> None:
    config = make_config(backlog_queue_count=3)
    conf = _write(tmp_path, config)
    assert cli.main(["provision", "--conf", conf]) == 0
    assert capsys.readouterr().out.strip() == "3"
    prefix = config["send_availability"]["backlog_prefix"]
    secondary_admin.create_queue(f"{prefix}/extra")
    assert cli.main(["status", "--conf", conf]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["backlog", "queue", "active", "deferred", "dead-letter"]
    for i in range(3):
        assert any(line.split() == [f"{prefix}/x-servicebus-transfer/{i}", "0", "0", "0"] for line in lines)
    assert any(line.startswith(f"{prefix}/extra") and "never used" in line for line in lines)
    assert "entities: none seen by this process" in out
    assert "deferred (counted in active)" not in out


def test_status_shows_the_deferred_messages_a_syphon_job_left(tmp_path, make_config, secondary, capsys) -> None:
    """A syphon job that died leaves its batch deferred: never delivered to a receive, waiting to be taken
    back (issue 39). status counts them beside the active count (which includes them)."""
    config = make_config(backlog_queue_count=2)
    conf = _write(tmp_path, config)
    assert cli.main(["provision", "--conf", conf]) == 0
    queue = f"{config['send_availability']['backlog_prefix']}/x-servicebus-transfer/1"
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages([messages.to_backlog(ServiceBusMessage(f"m{i}", message_id=f"m{i}"), "orders")
                                  for i in range(3)])
        with client.get_queue_receiver(queue, prefetch_count=0) as receiver:
            got: list = []
            while len(got) < 2:
                got += receiver.receive_messages(max_message_count=2 - len(got), max_wait_time=2)
            for message in got:
                receiver.defer_message(message)
    capsys.readouterr()
    assert cli.main(["status", "--conf", conf]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:3]}
    assert rows == {queue.replace("/1", "/0"): ["0", "0", "0"], queue: ["3", "2", "0"]}
    assert "deferred (counted in active)" in out and "Syphon.drain()" in out


def test_provision_fails_with_one_line_naming_the_option(tmp_path, make_config, capsys) -> None:
    config = make_config()
    config["send_availability"]["failover_interval"] = "2h"
    assert cli.main(["provision", "--conf", _write(tmp_path, config)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("spark-sb provision: send_availability.failover_interval: must be between 0 s and 60 min, "
                           "got 2 h")


def test_provision_with_zero_usable_queues_exits_non_zero(emulator, tmp_path, make_config, capsys) -> None:
    config = make_config(provision_retries=1)
    emulator.fault("secondary", "busy")
    assert cli.main(["provision", "--conf", _write(tmp_path, config)]) == 1
    err = capsys.readouterr().err
    assert "no usable backlog queue" in err and "Traceback" not in err
    assert err.strip().count("\\n") == 0 and err.strip().splitlines()[-1].startswith("spark-sb provision: ")


def test_every_emulator_fault_kind_is_accepted_from_the_command_line(emulator, capsys) -> None:
    admin = emulator["primary"].admin_url
    try:
        assert cli.main(["emulator", "fault", "--admin", admin, "ack-lost", "--entity", "nowhere"]) == 0
    finally:
        assert cli.main(["emulator", "heal", "--admin", admin]) == 0
