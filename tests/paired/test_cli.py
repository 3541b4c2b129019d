"""``spark-sb provision``, ``spark-sb status`` and the small commands around them, through the ``spark-sb`` console
script against the emulator pair (issue 46): status answers the first question of an outage (which namespace can be
reached, and if not why, named; the primary's entities; the backlog), with an exit status that says it."""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from azure.servicebus import ServiceBusClient, ServiceBusMessage

from spark_sb import cli, messages

ROOT = Path(__file__).resolve().parents[2]
#: the console script of the environment running the tests (pip install -e . made it)
SCRIPT = Path(sys.executable).parent / "spark-sb"
#: a host that never resolves (RFC 2606's reserved top-level domain)
NOWHERE = "spark-sb-status-test.invalid"


def spark_sb(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``spark-sb ARGS`` as a user runs it; this checkout's spark_sb first on the path."""
    assert SCRIPT.exists(), f"no spark-sb console script beside {sys.executable} (pip install -e .)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def timed(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = spark_sb(*args)
    return done, time.monotonic() - started


def _write(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "spark-sb.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _line(out: str, side: str) -> str:
    """The line that says whether ``side`` (primary, secondary) can be reached."""
    return next(line for line in out.splitlines() if re.match(rf"{side}\s+\S+: ", line))


def _rows(out: str, header: str) -> dict[str, list[str]]:
    """The rows of the table under the line starting with ``header``, by their first cell."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        cells = line.split()
        rows[cells[0]] = cells[1:]
    return rows


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as server:
        return int(server.getsockname()[1])


def _primary(config: dict, **section: Any) -> dict:
    return {**config, "primary": {**config["primary"], **section}}


def _park(secondary: Any, queue: str, entities: list[str]) -> None:
    """One backlog message bound for each of ``entities`` in ``queue``, as a failover parks them."""
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages([messages.to_backlog(ServiceBusMessage(f"m{i}", message_id=f"m{i}"), entity)
                                  for i, entity in enumerate(entities)])


# --- provision ---------------------------------------------------------------------------------------------


def test_provision_says_what_it_created_and_a_second_run_that_they_were_there(make_config, secondary,
                                                                             tmp_path) -> None:
    config = make_config(backlog_queue_count=3)
    conf = _write(tmp_path, config)
    names = [f"{config['send_availability']['backlog_prefix']}/x-servicebus-transfer/{i}" for i in range(3)]
    first = spark_sb("provision", "--conf", conf)
    assert first.returncode == 0, first.stderr
    host = secondary.connection_string.split("sb://")[1].split(";")[0]
    assert f"created 3 backlog queues on the secondary {host} (administration API {secondary.admin_url}): " \
           f"{', '.join(names)}; 0 already there" in first.stdout
    second = spark_sb("provision", "--conf", conf)
    assert second.returncode == 0, second.stderr
    assert f"created 0 backlog queues on the secondary {host}" in second.stdout
    assert f"; 3 already there: {', '.join(names)}" in second.stdout
    assert "3 of 3 backlog queues usable" in second.stdout


def test_provision_with_a_wrong_key_names_the_secondary_and_the_refusal_at_once(make_config, secondary,
                                                                               tmp_path) -> None:
    config = make_config(provision_retries=3, provision_retry_spacing="5s")
    wrong = secondary.connection_string.replace("SharedAccessKey=", "SharedAccessKey=wrong")
    config["secondary"] = {**config["secondary"], "connection_string": wrong}
    done, took = timed("provision", "--conf", _write(tmp_path, config))
    assert done.returncode == 2, done.stdout + done.stderr
    host = secondary.connection_string.split("sb://")[1].split(";")[0]
    line = done.stderr.strip()
    assert line.startswith(f"spark-sb provision: secondary {host}: refused the credential ("), line
    assert "401" in line and "wrong" not in line and "Traceback" not in done.stderr
    assert took < 30, f"{took:.0f} s: the refusal was retried"  # 3 retries 5 s apart would be 10 s more


def test_provision_fails_with_one_line_naming_the_option(tmp_path, make_config, capsys) -> None:
    config = make_config()
    config["send_availability"]["failover_interval"] = "2h"
    assert cli.main(["provision", "--conf", _write(tmp_path, config)]) == 2
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


# --- status ------------------------------------------------------------------------------------------------


def test_status_with_both_namespaces_up_shows_them_reachable_the_entities_and_the_backlog(
    make_config, make_queue, primary, secondary, secondary_admin, tmp_path
) -> None:
    orders = make_queue()
    config = make_config(backlog_queue_count=3)
    config["sink"] = {"entity": orders}
    conf = _write(tmp_path, config)
    assert spark_sb("provision", "--conf", conf).returncode == 0
    prefix = config["send_availability"]["backlog_prefix"]
    secondary_admin.create_queue(f"{prefix}/extra")
    _park(secondary, f"{prefix}/x-servicebus-transfer/2", [orders, orders])
    done = spark_sb("status", "--conf", conf)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for side, info in (("primary", primary), ("secondary", secondary)):
        host = info.connection_string.split("sb://")[1].split(";")[0]
        assert _line(out, side).split(None, 1)[1] == (f"{host}: reachable (administration API {info.admin_url} and "
                                                      f"AMQP {host} answered)")
    assert _rows(out, "primary entity")[orders] == ["queue", "Active", "0", "0", "2", "sink.entity,", "in", "the",
                                                    "backlog"]
    backlog = _rows(out, "backlog queue")
    assert [backlog[f"{prefix}/x-servicebus-transfer/{i}"] for i in range(3)] == [["0", "0", "0"]] * 2 + [
        ["2", "0", "0"]]
    assert "never used" in " ".join(backlog[f"{prefix}/extra"])
    assert "none seen by this process" not in out and "entities:" not in out
    assert done.stderr == ""


def test_status_names_an_entity_the_backlog_holds_messages_for_that_the_primary_does_not_have(
    make_config, secondary, tmp_path
) -> None:
    config = make_config(backlog_queue_count=1)
    conf = _write(tmp_path, config)
    assert spark_sb("provision", "--conf", conf).returncode == 0
    _park(secondary, f"{config['send_availability']['backlog_prefix']}/x-servicebus-transfer/0", ["gone-away"])
    done = spark_sb("status", "--conf", conf)
    assert done.returncode == 2, done.stdout + done.stderr
    assert _rows(done.stdout, "primary entity")["gone-away"][:2] == ["-", "not"]
    assert "spark-sb status: gone-away: not found on the primary" in done.stderr


def test_status_shows_the_deferred_messages_a_syphon_job_left(tmp_path, make_config, secondary) -> None:
    """A syphon job that died leaves its batch deferred: never delivered to a receive, waiting to be taken
    back (issue 39). status counts them beside the active count (which includes them)."""
    config = make_config(backlog_queue_count=2)
    conf = _write(tmp_path, config)
    assert spark_sb("provision", "--conf", conf).returncode == 0
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
    done = spark_sb("status", "--conf", conf)
    rows = _rows(done.stdout, "backlog queue")
    assert rows == {queue.replace("/1", "/0"): ["0", "0", "0"], queue: ["3", "2", "0"]}
    assert "deferred (counted in active)" in done.stdout and "Syphon.drain()" in done.stdout


def test_status_with_the_primary_down_names_it_unreachable_and_why(emulator, make_config, make_queue, primary,
                                                                   secondary, tmp_path) -> None:
    orders = make_queue()
    config = make_config(backlog_queue_count=1)
    config["sink"] = {"entity": orders}
    conf = _write(tmp_path, config)
    assert spark_sb("provision", "--conf", conf).returncode == 0
    _park(secondary, f"{config['send_availability']['backlog_prefix']}/x-servicebus-transfer/0", [orders] * 3)
    emulator.fault("primary", "down")
    done = spark_sb("status", "--conf", conf)
    assert done.returncode == 1, done.stdout + done.stderr
    host = primary.connection_string.split("sb://")[1].split(";")[0]
    line = _line(done.stdout, "primary")
    assert line.split(None, 1)[1] == (
        f"{host}: unreachable (administration API {primary.admin_url}: the connection was closed without an answer; "
        f"AMQP {host}: the connection was closed without an answer)")
    assert "reachable (" in _line(done.stdout, "secondary") and "unreachable" not in _line(done.stdout, "secondary")
    # what the secondary says still shows: how many messages wait for the primary's entity
    assert " ".join(_rows(done.stdout, "primary entity")[orders]) == (
        "? unknown (primary unreachable) - - 3 sink.entity, in the backlog")
    assert _rows(done.stdout, "backlog queue")[f"{config['send_availability']['backlog_prefix']}"
                                               "/x-servicebus-transfer/0"] == ["3", "0", "0"]
    assert done.stderr.strip() == f"spark-sb status: {line.split(None, 1)[0]} {line.split(None, 1)[1]}"


def test_status_with_a_connection_string_to_a_closed_port_says_connection_refused(make_config, tmp_path) -> None:
    port = _closed_port()
    config = make_config()
    endpoint = f"Endpoint=sb://127.0.0.1:{port};"
    string = re.sub(r"Endpoint=sb://[^;]+;", endpoint, config["primary"]["connection_string"])
    conf = _write(tmp_path, _primary(config, connection_string=string, admin_endpoint=f"http://127.0.0.1:{port}"))
    done = spark_sb("status", "--conf", conf)
    assert done.returncode == 1, done.stdout + done.stderr
    assert _line(done.stdout, "primary").split(None, 1)[1] == (
        f"127.0.0.1:{port}: unreachable (administration API http://127.0.0.1:{port}: connection refused; "
        f"AMQP 127.0.0.1:{port}: connection refused)")
    assert "SharedAccessKey" not in done.stdout + done.stderr


def test_status_with_a_host_that_does_not_resolve_says_host_not_found(make_config, tmp_path) -> None:
    config = make_config()
    string = re.sub(r"Endpoint=sb://[^:;]+", f"Endpoint=sb://{NOWHERE}", config["primary"]["connection_string"])
    conf = _write(tmp_path, _primary(config, connection_string=string, admin_endpoint=f"http://{NOWHERE}:5300"))
    done = spark_sb("status", "--conf", conf)
    assert done.returncode == 1, done.stdout + done.stderr
    line = _line(done.stdout, "primary")
    assert line.split()[1].startswith(f"{NOWHERE}:") and ": unreachable (" in line, line
    assert f"administration API http://{NOWHERE}:5300: host not found" in line
    assert re.search(rf"AMQP {re.escape(NOWHERE)}:\d+: host not found\)$", line), line


def test_status_with_a_wrong_key_says_the_namespace_refused_the_credential_at_once(make_config, secondary,
                                                                                   tmp_path) -> None:
    config = make_config()
    wrong = secondary.connection_string.replace("SharedAccessKey=", "SharedAccessKey=wrong")
    conf = _write(tmp_path, {**config, "secondary": {**config["secondary"], "connection_string": wrong}})
    done, took = timed("status", "--conf", conf)
    assert done.returncode == 2, done.stdout + done.stderr
    host = secondary.connection_string.split("sb://")[1].split(";")[0]
    line = _line(done.stdout, "secondary")
    assert line.startswith(f"secondary {host}: refused the credential (administration API {secondary.admin_url} "
                           "said 401 "), line
    assert f"AMQP {host} said 401 " in line and "wrong" not in done.stdout + done.stderr
    assert "reachable (" in _line(done.stdout, "primary")
    assert took < 30, f"{took:.0f} s: the refusal was retried"


def test_status_with_an_admin_endpoint_that_never_answers_is_bounded_by_admin_timeout(make_config, silent_endpoint,
                                                                                      tmp_path) -> None:
    conf = _write(tmp_path, _primary(make_config(), admin_endpoint=silent_endpoint, admin_timeout="1s"))
    done, took = timed("status", "--conf", conf)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"administration API {silent_endpoint}: no answer within 1 s (admin_timeout)" in _line(done.stdout,
                                                                                                   "primary")
    assert took < 30, f"{took:.0f} s for an admin_timeout of 1 s"


def test_status_and_provision_document_their_exit_statuses() -> None:
    done = spark_sb("status", "--help")
    text = " ".join(done.stdout.split())
    assert "exit status: 0 both namespaces answered" in text and "1 a namespace could not be reached" in text
    assert "2 a configuration problem" in text


def test_provision_help_gives_its_own_exit_statuses_the_secondary_only(make_config, primary, tmp_path) -> None:
    """provision asks the secondary alone (a wrong primary key passes it): its --help said status's statuses,
    "0 both namespaces answered ... an entity ... that the primary does not have" (the walk of issue 46)."""
    text = " ".join(spark_sb("provision", "--help").stdout.split())
    assert "exit status: 0 the secondary answered" in text and "1 the secondary could not be reached" in text
    assert "2 a configuration problem: the configuration file, or a credential the secondary refused" in text
    assert "both namespaces" not in text and "the primary does not have" not in text
    # as it says: a primary that refuses the credential does not fail provision
    conf = _write(tmp_path, _primary(make_config(), connection_string=primary.connection_string.replace(
        "SharedAccessKey=", "SharedAccessKey=wrong")))
    done = spark_sb("provision", "--conf", conf)
    assert done.returncode == 0, done.stdout + done.stderr


# --- the emulator's faults ---------------------------------------------------------------------------------


def test_a_fault_takes_a_duration_like_every_other_duration(emulator, make_queue) -> None:
    queue = make_queue()
    server = emulator.server("primary")
    done = spark_sb("emulator", "fault", "--admin", emulator["primary"].admin_url, "busy", "--entity", queue,
                    "--duration", "3s")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"primary: busy on {queue} for 3 s"
    assert server.call(lambda: server.fault_for(queue)) == "busy"
    deadline = time.monotonic() + 30
    while server.call(lambda: server.fault_for(queue)) is not None:
        assert time.monotonic() < deadline, "the fault did not heal by itself"
        time.sleep(0.2)
    bare = spark_sb("emulator", "fault", "--admin", emulator["primary"].admin_url, "busy", "--entity", queue,
                    "--duration", "2")
    try:
        assert bare.returncode == 0 and bare.stdout.strip() == f"primary: busy on {queue} for 2 s", bare.stderr
    finally:
        emulator.heal("primary")
    bad = spark_sb("emulator", "fault", "--admin", emulator["primary"].admin_url, "busy", "--duration", "3 parsecs")
    assert bad.returncode == 2 and "--duration" in bad.stderr


def test_a_fault_on_a_misspelt_entity_is_refused_naming_it(emulator, make_queue) -> None:
    queue = make_queue()
    server = emulator.server("primary")
    misspelt = queue.replace("q-", "Q_", 1)
    done = spark_sb("emulator", "fault", "--admin", emulator["primary"].admin_url, "down", "--entity", misspelt)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip() == (f"spark-sb emulator fault: --entity: namespace primary has no entity {misspelt!r} "
                                   f"(did you mean {queue}?)")
    assert server.call(lambda: dict(server.faults)) == {}
    other = spark_sb("emulator", "fault", "--admin", emulator["primary"].admin_url, "down", "--entity", "zzz-none")
    assert other.returncode == 2 and "has no entity 'zzz-none'" in other.stderr
    assert server.call(lambda: dict(server.faults)) == {}


def test_every_emulator_fault_kind_is_accepted_from_the_command_line(emulator, make_queue, capsys) -> None:
    queue = make_queue()
    admin = emulator["primary"].admin_url
    try:
        assert cli.main(["emulator", "fault", "--admin", admin, "ack-lost", "--entity", queue]) == 0
        # a topic's subscription and an entity's dead-letter queue are the entity's
        assert cli.main(["emulator", "fault", "--admin", admin, "busy", "--entity", f"{queue}/$DeadLetterQueue"]) == 0
    finally:
        assert cli.main(["emulator", "heal", "--admin", admin]) == 0


def test_every_fault_kind_is_explained_in_its_help_and_in_the_emulator_page() -> None:
    """``spark-sb emulator fault --help`` listed the kinds with no word on what each does, and the emulator page's
    table left out ``ack-lost`` (issue 46's walk)."""
    from spark_sb.emulator import FAULT_KINDS

    shown = spark_sb("emulator", "fault", "--help")
    text = " ".join(shown.stdout.split())
    table = [line for line in (ROOT / "docs" / "emulator.md").read_text().splitlines()
             if line.strip().startswith("| `")]
    for kind in FAULT_KINDS:
        assert re.search(rf"(^|; | ){re.escape(kind)}: \w", text[text.index("positional arguments"):]), (kind, text)
        assert any(line.strip().startswith(f"| `{kind}` |") for line in table), f"docs/emulator.md: no row for {kind}"
    heal = " ".join(spark_sb("emulator", "heal", "--help").stdout.split())
    assert "--admin URL the namespace's admin URL" in heal


# --- help --------------------------------------------------------------------------------------------------


def _parsers(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    found = [(words, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += _parsers(child, (*words, name))
    return found


#: reStructuredText a terminal shows as it is: ``literal``, :func:`name`, `text`_
RST = re.compile(r"``|:[a-z]+:`|`_\b")


def test_no_help_text_shows_restructuredtext() -> None:
    parsers = _parsers(cli.build_parser())
    assert {words for words, _ in parsers} >= {(), ("emulator",), ("emulator", "start"), ("emulator", "fault"),
                                               ("emulator", "heal"), ("emulator", "proxy"), ("provision",),
                                               ("status",), ("report",)}
    for words, parser in parsers:
        assert not RST.search(parser.format_help()), f"spark-sb {' '.join(words)} --help: {parser.format_help()}"
    shown = spark_sb("--help")
    assert shown.returncode == 0 and not RST.search(shown.stdout) and "The spark-sb command line" in shown.stdout
