"""The emulator as users run it: the CLI, a child process, kill -9 and a restart on the same data."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceiveMode
from azure.servicebus.management import QueueProperties

from spark_sb.admin import admin_client
from spark_sb.emulator import EmulatorProcess, NamespaceOptions

ENTITIES = """
queues:
  - name: orders
    max_delivery_count: 5
  - name: sessions
    requires_session: true
topics:
  - name: events
    subscriptions:
      - name: all
"""


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spark_sb.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_start_prints_one_connection_string_per_namespace_and_stops_on_sigterm(tmp_path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "spark_sb.cli", "emulator", "start", "--data-dir", str(tmp_path),
         "--namespace", "alpha=0:0", "--namespace", "beta=0:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        lines = [proc.stdout.readline().strip() for _ in range(2)]
    finally:
        proc.terminate()
        proc.wait(10)
    assert [line.split(" ", 1)[0] for line in lines] == ["alpha", "beta"]
    for line in lines:
        conn = line.split(" ", 1)[1]
        assert conn.startswith("Endpoint=sb://localhost:")
        assert "SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey=SAS_KEY_VALUE" in conn
        assert conn.endswith("UseDevelopmentEmulator=true")
    assert proc.returncode == 0


def test_a_configured_key_replaces_the_default_one(tmp_path) -> None:
    env = {**os.environ, "SPARK_SB_EMULATOR_KEY": "s3cret-key"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "spark_sb.cli", "emulator", "start", "--in-memory", "--namespace", "p=0:0",
         "--key-name", "sender"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        conn = proc.stdout.readline().strip().split(" ", 1)[1]
    finally:
        proc.terminate()
        proc.wait(10)
    assert "SharedAccessKeyName=sender;SharedAccessKey=s3cret-key;" in conn


def test_a_bad_entities_file_is_a_clear_cli_error(tmp_path) -> None:
    bad = tmp_path / "entities.yaml"
    bad.write_text("queues:\n  - name: orders\n    max_delivery_count: zero\n")
    result = _cli("emulator", "start", "--data-dir", str(tmp_path), "--namespace", "p=0:0", "--entities", str(bad))
    assert result.returncode == 2
    assert "orders" in result.stderr and "max_delivery_count" in result.stderr and "'zero'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_namespace_option_is_a_clear_cli_error(tmp_path) -> None:
    result = _cli("emulator", "start", "--data-dir", str(tmp_path), "--namespace", "primary:5672")
    assert result.returncode == 2
    assert "NAME=AMQP_PORT:ADMIN_PORT" in result.stderr and "'primary:5672'" in result.stderr


def test_fault_cli_reaches_a_running_emulator_and_reports_an_unreachable_one(tmp_path) -> None:
    entities = tmp_path / "entities.yaml"
    entities.write_text("queues:\n  - name: orders\n")
    with EmulatorProcess.start(data_dir=tmp_path / "data", namespaces=[NamespaceOptions("p")],
                               entities=entities) as emu:
        out = _cli("emulator", "fault", "--admin", emu["p"].admin_url, "busy", "--entity", "orders", "--duration", "5")
        assert out.returncode == 0 and "busy on orders for 5 s" in out.stdout
        out = _cli("emulator", "heal", "--admin", emu["p"].admin_url)
        assert out.returncode == 0 and "healed all" in out.stdout
    out = _cli("emulator", "heal", "--admin", "http://127.0.0.1:9")
    assert out.returncode == 1 and "cannot reach" in out.stderr


@pytest.mark.slow
def test_kill_9_keeps_every_accepted_unsettled_message_and_every_entity(tmp_path) -> None:
    entities = tmp_path / "entities.yaml"
    entities.write_text(ENTITIES)
    emu = EmulatorProcess.start(data_dir=tmp_path / "data", namespaces=[NamespaceOptions("p")], entities=entities)
    try:
        info = emu["p"]
        admin = admin_client(info.connection_string, admin_endpoint=info.admin_url)
        admin.create_queue("made-at-runtime", lock_duration="PT45S")
        with ServiceBusClient.from_connection_string(info.connection_string) as c:
            with c.get_queue_sender("orders") as s:
                s.send_messages([ServiceBusMessage(f"o{i}", message_id=f"o{i}") for i in range(200)])
            with c.get_topic_sender("events") as s:
                s.send_messages(ServiceBusMessage("e", message_id="e"))
            with c.get_queue_sender("sessions") as s:
                s.send_messages(ServiceBusMessage("s", message_id="s", session_id="S1"))
            with c.get_queue_receiver("orders") as r:
                got = r.receive_messages(max_message_count=30, max_wait_time=2)
                for m in got[:10]:
                    r.complete_message(m)
                r.defer_message(got[10])
                # the other 19 stay locked, unsettled, when the process dies
                emu.kill()
        restarted = emu.restart()
        info = restarted["p"]
        admin = admin_client(info.connection_string, admin_endpoint=info.admin_url)
        names = {q.name for q in admin.list_queues()}
        assert {"orders", "sessions", "made-at-runtime"} <= names
        made: QueueProperties = admin.get_queue("made-at-runtime")
        assert made.lock_duration.total_seconds() == 45
        assert admin.get_subscription("events", "all") is not None
        with ServiceBusClient.from_connection_string(info.connection_string) as c:
            with c.get_queue_receiver("orders", receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as r:
                back = []
                deadline = time.monotonic() + 30
                while len(back) < 189 and time.monotonic() < deadline:
                    back.extend(r.receive_messages(max_message_count=100, max_wait_time=2))
            with c.get_queue_receiver("orders") as r:
                deferred = r.peek_messages(max_message_count=5, sequence_number=1)
            with c.get_subscription_receiver("events", "all") as r:
                events = r.receive_messages(max_wait_time=2)
            with c.get_queue_receiver("sessions", session_id="S1") as r:
                sessions = r.receive_messages(max_wait_time=2)
        completed = {m.message_id for m in got[:10]}
        expected = {f"o{i}" for i in range(200)} - completed - {got[10].message_id}
        assert {m.message_id for m in back} == expected and len(back) == len(expected)
        assert [(m.message_id, m.state.name) for m in deferred] == [(got[10].message_id, "DEFERRED")]
        assert [m.message_id for m in events] == ["e"]
        assert [m.message_id for m in sessions] == ["s"]
        restarted.stop()
    finally:
        emu.stop()


def test_start_with_tls_prints_the_tls_ports_and_the_ca_file_and_serves_amqps(tmp_path) -> None:
    from azure.core.credentials import AzureNamedKeyCredential
    from azure.servicebus import TransportType

    from spark_sb.emulator.server import default_namespaces

    # without --namespace, --tls puts the primary on the SDK's own AMQPS port
    assert [(n.name, n.tls_port) for n in default_namespaces(tls=True)] == [("primary", 5671), ("secondary", 5674)]
    entities = tmp_path / "entities.yaml"
    entities.write_text(ENTITIES)
    proc = subprocess.Popen(
        [sys.executable, "-m", "spark_sb.cli", "emulator", "start", "--data-dir", str(tmp_path / "data"), "--tls",
         "--namespace", "alpha=0:0", "--namespace", "beta=0:0:0", "--entities", str(entities)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        lines = [proc.stdout.readline().strip() for _ in range(5)]
        assert [line.split(" ", 1)[0] for line in lines[:2]] == ["alpha", "beta"]
        amqps = [line.split(" ") for line in lines[2:4]]
        assert [(tag, name) for tag, name, _ in amqps] == [("AMQPS", "alpha"), ("AMQPS", "beta")]
        tag, ca_file = lines[4].split(" ", 1)
        assert tag == "CA" and ca_file == str((tmp_path / "data" / "tls" / "ca.pem").absolute())
        port = int(amqps[0][2].removeprefix("localhost:"))
        with ServiceBusClient("localhost", AzureNamedKeyCredential("RootManageSharedAccessKey", "SAS_KEY_VALUE"),
                              custom_endpoint_address=f"sb://localhost:{port}", transport_type=TransportType.Amqp,
                              connection_verify=ca_file, retry_total=0) as client:
            with client.get_queue_sender("orders") as sender:
                sender.send_messages(ServiceBusMessage("over tls"))
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0


def test_the_subprocess_emulator_keeps_its_tls_port_across_a_restart(tmp_path) -> None:
    emu = EmulatorProcess.start(data_dir=tmp_path, namespaces=[NamespaceOptions("p")], tls=True)
    restarted = None
    try:
        before = emu["p"]
        assert before.tls_port and before.ca_file == str(tmp_path.absolute() / "tls" / "ca.pem")
        ca_pem = open(before.ca_file).read()
        emu.kill()
        restarted = emu.restart()
        after = restarted["p"]
        assert (after.tls_port, after.ca_file) == (before.tls_port, before.ca_file)
        assert open(after.ca_file).read() == ca_pem
    finally:
        emu.stop()
        if restarted is not None:
            restarted.stop()


def test_a_restarted_emulator_keeps_its_namespaces_latency_and_habits(tmp_path) -> None:
    """A far namespace killed and restarted is still far (the soak's kill -9s kept the ports and dropped the
    rest); a peek then costs at least a round trip (a lower bound: never failed by a slow machine)."""
    entities = tmp_path / "entities.yaml"
    entities.write_text(ENTITIES)
    emu = EmulatorProcess.start(data_dir=tmp_path / "data", entities=entities,
                                namespaces=[NamespaceOptions("p", latency=0.3, idle_detach=600, detach_every=900)])
    restarted = None
    try:
        emu.kill()
        restarted = emu.restart()
        info = restarted["p"]
        with ServiceBusClient.from_connection_string(info.connection_string) as client, \
                client.get_queue_receiver("orders") as receiver:
            receiver.peek_messages(max_message_count=1)  # the link is open
            started = time.monotonic()
            receiver.peek_messages(max_message_count=1)
            assert time.monotonic() - started >= 0.6
        assert restarted.namespaces["p"].detach_every == 900 and restarted.namespaces["p"].idle_detach == 600
    finally:
        emu.stop()
        if restarted is not None:
            restarted.stop()


def test_token_lifetime_sets_how_long_its_entra_id_tokens_live(tmp_path, monkeypatch) -> None:
    """``--token-lifetime`` (the soak runs the Spark jobs on short tokens, so that every client renews them):
    azure-identity's managed identity credential gets a token from the emulator in a child process that
    expires that long after it was issued, and the restart keeps the option."""
    from azure.identity import ManagedIdentityCredential

    from spark_sb.emulator.aad import DEFAULT_IDENTITY_HEADER

    emu = EmulatorProcess.start(data_dir=None, namespaces=[NamespaceOptions("p")], entra_id=True, token_lifetime=45)
    restarted = None
    try:
        monkeypatch.setenv("IDENTITY_ENDPOINT", emu["p"].identity_endpoint)
        monkeypatch.setenv("IDENTITY_HEADER", DEFAULT_IDENTITY_HEADER)
        asked = time.time()
        with ManagedIdentityCredential() as credential:
            token = credential.get_token("https://servicebus.azure.net/.default")
        assert asked + 40 <= token.expires_on <= time.time() + 46
        emu.kill()
        restarted = emu.restart()
        monkeypatch.setenv("IDENTITY_ENDPOINT", restarted["p"].identity_endpoint)
        with ManagedIdentityCredential() as credential:
            assert credential.get_token("https://servicebus.azure.net/.default").expires_on <= time.time() + 46
    finally:
        emu.stop()
        if restarted is not None:
            restarted.stop()
    bad = _cli("emulator", "start", "--in-memory", "--token-lifetime", "0s")
    assert bad.returncode == 2 and "--token-lifetime: must be a positive duration, got '0s'" in bad.stderr


def test_an_entities_file_with_a_bad_sql_rule_is_a_clear_cli_error(tmp_path) -> None:
    bad = tmp_path / "entities.yaml"
    bad.write_text("topics:\n  - name: events\n    subscriptions:\n      - name: eu\n"
                   "        rules: [{name: eu, filter: {type: sql, expression: \"region = = 'eu'\"}}]\n")
    result = _cli("emulator", "start", "--data-dir", str(tmp_path), "--namespace", "p=0:0", "--entities", str(bad))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "events/subscriptions/eu rule 'eu'" in result.stderr and "position 9" in result.stderr
    assert "Traceback" not in result.stderr


def _free_block(size: int) -> int:
    """A base port with ``size`` consecutive ports free on 127.0.0.1."""
    import random
    import socket

    for _ in range(200):
        base = random.randrange(20000, 60000)
        sockets = []
        try:
            for port in range(base, base + size):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise AssertionError("no block of free ports")


def test_one_variable_moves_the_emulator_and_conf_local_yaml_to_other_ports(tmp_path) -> None:
    """SPARK_SB_BASE_PORT=N (or --base-port N): the pair on N, N+1 (AMQP) and N+2, N+3 (admin), where
    conf/local.yaml, reading the same variable, finds it: provision and status work with nothing else changed."""
    from pathlib import Path

    base = _free_block(4)
    env = {**os.environ, "SPARK_SB_BASE_PORT": str(base)}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "spark_sb.cli", "emulator", "start", "--in-memory",
                             "--entities", str(root / "conf" / "entities.yaml")],  # as getting started starts it
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = [proc.stdout.readline().strip() for _ in range(2)]
        assert [line.split(" ", 1)[0] for line in lines] == ["primary", "secondary"]
        assert f"Endpoint=sb://localhost:{base};" in lines[0] and f"Endpoint=sb://localhost:{base + 1};" in lines[1]
        conf = str(root / "conf" / "local.yaml")
        for command in ("provision", "status"):
            ran = subprocess.run([sys.executable, "-m", "spark_sb.cli", command, "--conf", conf], capture_output=True,
                                 text=True, timeout=60, env=env)
            assert ran.returncode == 0, (command, ran.stdout, ran.stderr)
        healed = _cli("emulator", "heal", "--admin", f"http://localhost:{base + 2}")
        assert healed.returncode == 0, healed.stderr
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0


@pytest.mark.parametrize(("args", "env", "expected"), [
    (("--base-port", "80"), None, "--base-port must be a port from 1024 to 65525, got '80'"),
    (("--base-port", "six"), None, "--base-port must be a port from 1024 to 65525, got 'six'"),
    ((), "65530", "$SPARK_SB_BASE_PORT must be a port from 1024 to 65525, got '65530'"),
    (("--base-port", "6000", "--namespace", "p=0:0"), None, "give either --base-port or --namespace, not both"),
])
def test_a_bad_base_port_is_a_clear_cli_error(args: tuple[str, ...], env: str | None, expected: str) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "SPARK_SB_BASE_PORT"}
    result = subprocess.run([sys.executable, "-m", "spark_sb.cli", "emulator", "start", "--in-memory", *args],
                            capture_output=True, text=True, timeout=30,
                            env=environ if env is None else {**environ, "SPARK_SB_BASE_PORT": env})
    assert result.returncode == 2
    assert result.stderr.strip() == f"spark-sb emulator: {expected}"


def test_a_namespace_names_its_own_ports_whatever_spark_sb_base_port_says(tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "spark_sb.cli", "emulator", "start", "--in-memory",
                             "--namespace", "alpha=0:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SPARK_SB_BASE_PORT": "not a port"})
    try:
        line = proc.stdout.readline().strip()
    finally:
        proc.terminate()
        proc.wait(10)
    assert line.startswith("alpha Endpoint=sb://localhost:"), (line, proc.stderr.read())


def test_base_port_also_places_the_tls_ports(tmp_path) -> None:
    """--base-port N --tls: AMQPS on N+4 (primary) and N+5 (secondary), as --help says."""
    base = _free_block(6)
    proc = subprocess.Popen([sys.executable, "-m", "spark_sb.cli", "emulator", "start", "--data-dir", str(tmp_path),
                             "--base-port", str(base), "--tls"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        lines = [proc.stdout.readline().strip() for _ in range(4)]
    finally:
        proc.terminate()
        proc.wait(10)
    assert lines[2:] == [f"AMQPS primary localhost:{base + 4}", f"AMQPS secondary localhost:{base + 5}"], lines


def test_a_second_emulator_on_a_store_in_use_is_refused_naming_it(tmp_path) -> None:
    """Issue 46's walk: getting started's other ports, started beside the default pair on the default --data-dir,
    served the same store (the other pair's messages, with locks neither saw). The second start exits 2 in one
    line naming the directory and the process; once the first stops, the store opens again."""
    from spark_sb.emulator import Emulator

    data = tmp_path / "data"
    with Emulator([NamespaceOptions("primary"), NamespaceOptions("secondary")], data_dir=data):
        done = _cli("emulator", "start", "--data-dir", str(data), "--namespace", "primary=0:0",
                    "--namespace", "secondary=0:0")
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.strip() == (f"spark-sb emulator: the store of namespace 'primary' in {data} is in use by "
                                       f"another emulator (process {os.getpid()}): stop it, or give this one another "
                                       "--data-dir (or --in-memory)"), done.stderr
        assert not done.stdout  # no connection string: nothing served
        with pytest.raises(OSError, match="is in use by another emulator"):
            Emulator([NamespaceOptions("secondary")], data_dir=data).start()
        # another namespace's store in the same directory is its own
        with Emulator([NamespaceOptions("third")], data_dir=data) as third:
            assert third["third"].amqp_port
    with Emulator([NamespaceOptions("primary")], data_dir=data) as again:  # the first stopped: free again
        assert again["primary"].amqp_port
