"""``spark-sb provision`` and ``spark-sb status``."""

from __future__ import annotations

import yaml

from spark_sb import cli


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
    assert lines[0].split() == ["backlog", "queue", "active", "dead-letter"]
    for i in range(3):
        assert any(line.split()[:3] == [f"{prefix}/x-servicebus-transfer/{i}", "0", "0"] for line in lines)
    assert any(line.startswith(f"{prefix}/extra") and "never used" in line for line in lines)
    assert "entities: none seen by this process" in out


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
