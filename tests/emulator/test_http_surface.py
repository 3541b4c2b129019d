"""What the emulator's HTTP surface (the admin port and the WebSocket endpoints) refuses: bodies it must not read
before a request is authenticated, XML it must not expand, and what a web page can forge (a cross-site POST to
the controls, DNS rebinding, a WebSocket from a page's origin)."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from spark_sb import cli
from spark_sb.admin import admin_client
from spark_sb.emulator import AdminLimits, Emulator, EmulatorProcess, NamespaceOptions, admin_http, sas
from spark_sb.emulator.model import QueueSpec
from spark_sb.emulator.server import DEFAULT_KEY, DEFAULT_KEY_NAME, WEBSOCKET_PATH, send_control

MIB = 1024 * 1024
PAGE_ORIGIN = "http://localhost:8080"  # a local web app the user lets in (allowed_origins)


@pytest.fixture(scope="module")
def emu() -> Iterator[Emulator]:
    with Emulator([NamespaceOptions("surface", ws_port=0)], allowed_origins=[PAGE_ORIGIN]) as emulator:
        yield emulator


@pytest.fixture(autouse=True)
def healed(emu: Emulator) -> Iterator[None]:
    yield
    emu.heal("surface")


def _token(emu: Emulator) -> str:
    return sas.make_token(f"https://localhost:{emu['surface'].amqp_port}", DEFAULT_KEY_NAME, DEFAULT_KEY)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    return sock


def _request(port: int, head: str, body: bytes = b"", wait: float = 10.0) -> tuple[int, bytes]:
    """Send a raw request; (status, the whole answer), or (0, b"") when nothing comes back within ``wait``."""
    with _connect(port) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n" + body)
        sock.settimeout(wait)
        answer = b""
        try:
            while b"\r\n\r\n" not in answer or len(answer) < _length(answer):
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
        except TimeoutError:
            return 0, b""
    if not answer.startswith(b"HTTP/"):
        return 0, answer
    return int(answer.split(b" ", 2)[1]), answer


def _length(answer: bytes) -> int:
    """The length of a whole answer, from its head's Content-Length."""
    head, _, _ = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return len(head) + 4


def _head(method: str, path: str, port: int, *headers: str) -> str:
    return "".join(f"{line}\r\n" for line in (f"{method} {path} HTTP/1.1", f"Host: localhost:{port}", *headers))


def _faults(emu: Emulator) -> dict:
    return send_control(emu["surface"].admin_url, "faults")["faults"]


# --------------------------------------------------------------------------- bodies before authentication


def _pushed_before_answer(port: int, head: str, first: bytes, limit: int) -> tuple[int, bytes]:
    """Push ``first`` then up to ``limit`` bytes of body; (bytes pushed when the server answered or closed,
    its answer). Pushed == limit: the server kept reading."""
    with _connect(port) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n" + first)
        piece, pushed = b"x" * (64 * 1024), 0
        while pushed < limit:
            readable, _, _ = select.select([sock], [], [], 0.05)
            if readable:
                break
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break
            pushed += len(piece)
        try:
            sock.settimeout(2)
            answer = sock.recv(65536)
        except OSError:
            answer = b""
        return pushed, answer


def test_an_unauthenticated_chunked_body_of_size_minus_one_is_not_read(emu: Emulator) -> None:
    """A chunk size of -1 used to read to the end of the stream before the 401: 64 MiB held in memory."""
    port = emu["surface"].admin_port
    head = _head("PUT", "/orders", port, "Content-Type: application/atom+xml", "Transfer-Encoding: chunked")
    pushed, answer = _pushed_before_answer(port, head, b"-1\r\n", 8 * MIB)
    assert pushed < 2 * MIB, f"the server read {pushed} bytes of an unauthenticated body without answering"
    assert answer == b"" or answer.startswith(b"HTTP/1.1 401"), answer[:200]


def test_an_unauthenticated_body_is_never_read_whatever_its_length(emu: Emulator) -> None:
    port = emu["surface"].admin_port
    head = _head("PUT", "/orders", port, "Content-Type: application/atom+xml", f"Content-Length: {MIB}")
    pushed, answer = _pushed_before_answer(port, head, b"", MIB)
    assert pushed < MIB
    assert answer == b"" or answer.startswith(b"HTTP/1.1 401"), answer[:200]


@pytest.mark.parametrize("size", [b"-1", b"+10", b"0x10", b"1_0", b"", b"zz"])
def test_a_malformed_chunk_size_is_a_400_even_when_authenticated(emu: Emulator, size: bytes) -> None:
    port = emu["surface"].admin_port
    head = _head("PUT", "/orders", port, f"Authorization: {_token(emu)}", "Content-Type: application/atom+xml",
                 "Transfer-Encoding: chunked")
    status, answer = _request(port, head, size + b"\r\n" + b"x" * 4096, wait=5)
    assert status == 400, answer[:300]
    assert b"chunk" in answer


def test_an_authenticated_chunked_body_over_the_cap_is_refused_before_it_is_read(emu: Emulator) -> None:
    port = emu["surface"].admin_port
    head = _head("PUT", "/orders", port, f"Authorization: {_token(emu)}", "Content-Type: application/atom+xml",
                 "Transfer-Encoding: chunked")
    pushed, answer = _pushed_before_answer(port, head, b"7FFFFFFF\r\n", 8 * MIB)
    assert pushed < 2 * MIB
    assert answer == b"" or answer.startswith(b"HTTP/1.1 413"), answer[:200]


# --------------------------------------------------------------------------- XML


def test_a_dtd_is_refused_in_a_utf16_body(emu: Emulator) -> None:
    """The byte check for <!DOCTYPE missed it in UTF-16: the entity was expanded (1.8 M characters from 18.8 kB)."""
    port = emu["surface"].admin_port
    xml = ('<?xml version="1.0" encoding="utf-16"?>'
           '<!DOCTYPE entry [<!ENTITY minute "PT1M">]>'
           '<entry xmlns="http://www.w3.org/2005/Atom"><content type="application/xml">'
           '<QueueDescription xmlns="http://schemas.microsoft.com/netservices/2010/10/servicebus/connect">'
           "<LockDuration>&minute;</LockDuration></QueueDescription></content></entry>")
    body = xml.encode("utf-16")
    assert b"<!DOCTYPE" not in body
    head = _head("PUT", "/dtd-queue", port, f"Authorization: {_token(emu)}", "Content-Type: application/atom+xml",
                 f"Content-Length: {len(body)}")
    status, answer = _request(port, head, body)
    assert status == 400, answer[:300]
    assert b"document type declarations are not accepted" in answer
    assert _request(port, _head("GET", "/dtd-queue", port, f"Authorization: {_token(emu)}"))[0] == 404


# --------------------------------------------------------------------------- what a web page can forge


def test_a_cross_site_form_post_cannot_fault_the_namespace(emu: Emulator) -> None:
    """What a page can send without a preflight: a text/plain POST, no custom header, no token."""
    port = emu["surface"].admin_port
    body = b'{"kind": "down"}'
    status, answer = _request(port, _head("POST", "/$emulator/fault", port, "Content-Type: text/plain",
                                          "Origin: http://attacker.example", f"Content-Length: {len(body)}"), body)
    assert status == 403, answer[:300]
    assert b"X-Spark-SB-Emulator" in answer
    assert _faults(emu) == {}


def test_the_controls_take_json_only(emu: Emulator) -> None:
    port = emu["surface"].admin_port
    body = b'{"kind": "busy"}'
    status, answer = _request(port, _head("POST", "/$emulator/fault", port, "X-Spark-SB-Emulator: 1",
                                          "Content-Type: text/plain", f"Content-Length: {len(body)}"), body)
    assert status == 415, answer[:300]
    assert _faults(emu) == {}


def test_a_dns_rebinding_host_reaches_neither_the_controls_nor_the_admin_api(emu: Emulator) -> None:
    port = emu["surface"].admin_port
    body = b'{"kind": "down"}'
    status, answer = _request(port, f"POST /$emulator/fault HTTP/1.1\r\nHost: rebind.attacker.example:{port}\r\n"
                                    f"X-Spark-SB-Emulator: 1\r\nContent-Type: application/json\r\n"
                                    f"Content-Length: {len(body)}\r\n", body)
    assert status == 403, answer[:300]
    assert _faults(emu) == {}
    status, answer = _request(port, f"GET /$Resources/queues HTTP/1.1\r\nHost: rebind.attacker.example:{port}\r\n"
                                    f"Authorization: {_token(emu)}\r\n")
    assert status == 403, answer[:300]


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]"])
def test_the_controls_answer_with_the_header_on_a_local_host(emu: Emulator, host: str) -> None:
    port = emu["surface"].admin_port
    body = b'{"kind": "busy", "entity": "orders"}'
    status, answer = _request(port, f"POST /$emulator/fault HTTP/1.1\r\nHost: {host}:{port}\r\n"
                                    "X-Spark-SB-Emulator: 1\r\nContent-Type: application/json; charset=utf-8\r\n"
                                    f"Content-Length: {len(body)}\r\n", body)
    assert status == 200, answer[:300]
    assert _faults(emu)["orders"]["kind"] == "busy"


def test_a_sas_token_with_manage_opens_the_controls_too(emu: Emulator) -> None:
    port = emu["surface"].admin_port
    body = b'{"kind": "busy"}'
    head = _head("POST", "/$emulator/fault", port, f"Authorization: {_token(emu)}", "Content-Type: application/json",
                 f"Content-Length: {len(body)}")
    assert _request(port, head, body)[0] == 200
    bad = _token(emu).replace("sig=", "sig=AAAA")
    status, _ = _request(port, _head("POST", "/$emulator/heal", port, f"Authorization: {bad}",
                                     "Content-Type: application/json", "Content-Length: 2"), b"{}")
    assert status == 401
    assert _faults(emu)[""]["kind"] == "busy"


def test_the_cli_still_faults_and_heals(emu: Emulator, capsys: pytest.CaptureFixture[str]) -> None:
    admin = emu["surface"].admin_url
    server = emu.server("surface")
    if "orders" not in send_control(admin, "entities")["entities"]:  # the CLI faults only an entity that exists
        server.call(lambda: server.broker.create_entity(QueueSpec(name="orders")))
    assert cli.main(["emulator", "fault", "--admin", admin, "busy", "--entity", "orders"]) in (0, None)
    assert _faults(emu)["orders"]["kind"] == "busy"
    assert cli.main(["emulator", "heal", "--admin", admin]) in (0, None)
    assert _faults(emu) == {}
    out = capsys.readouterr().out
    assert "surface: busy on orders until healed" in out and "surface: healed all" in out


# --------------------------------------------------------------------------- WebSockets


def _upgrade(emu: Emulator, origin: str | None) -> int:
    port = emu["surface"].ws_port
    assert port is not None
    headers = ["Upgrade: websocket", "Connection: Upgrade", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
               "Sec-WebSocket-Version: 13", "Sec-WebSocket-Protocol: AMQPWSB10"]
    if origin is not None:
        headers.append(f"Origin: {origin}")
    return _request(port, _head("GET", WEBSOCKET_PATH, port, *headers))[0]


def test_a_web_page_cannot_open_a_websocket(emu: Emulator) -> None:
    assert _upgrade(emu, "http://attacker.example") == 403
    port = emu["surface"].ws_port
    assert _upgrade(emu, f"http://rebind.attacker.example:{port}") == 403  # DNS rebinding onto the endpoint
    assert _upgrade(emu, "null") == 403  # a sandboxed frame, a file:// page


def test_sdk_websockets_and_allowed_origins_are_let_in(emu: Emulator) -> None:
    port = emu["surface"].ws_port
    assert _upgrade(emu, None) == 101  # aiohttp, the JavaScript, Java and .NET SDKs
    assert _upgrade(emu, f"http://localhost:{port}") == 101  # websocket-client, the sync SDK's transport
    assert _upgrade(emu, f"http://127.0.0.1:{port}") == 101
    assert _upgrade(emu, PAGE_ORIGIN) == 101  # allowed_origins


def test_the_allowed_origins_are_an_emulator_option() -> None:
    """(the fixture's ``allowed_origins`` is what lets PAGE_ORIGIN in: without it the same page is refused)"""
    with Emulator([NamespaceOptions("bare", ws_port=0)]) as bare:
        port = bare["bare"].ws_port
        head = _head("GET", WEBSOCKET_PATH, port, "Upgrade: websocket", "Connection: Upgrade",
                     "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13",
                     f"Origin: {PAGE_ORIGIN}")
        started = time.monotonic()
        assert _request(port, head)[0] == 403
        assert time.monotonic() - started < 5


# --------------------------------------------------------------------------- kept-alive connections


class _CountingSocket:
    """The server's side of a connection, counting the writes the server makes on it."""

    def __init__(self, sock: socket.socket, writes: list[int]) -> None:
        self._sock = sock
        self._writes = writes

    def sendall(self, data: bytes, *args: object) -> None:
        self._writes.append(len(data))
        self._sock.sendall(data, *args)

    def send(self, data: bytes, *args: object) -> int:
        self._writes.append(len(data))
        return self._sock.send(data, *args)

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


def test_an_answer_leaves_in_one_write_so_a_kept_alive_request_waits_on_no_delayed_ack(
        emu: Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head and the body went out in two writes: on a kept-alive connection the body then waited for the
    client's delayed ACK (Nagle), about 45 ms on every request of the SDK's admin client, which reuses its
    connection. Each answer is one write now, whatever its status."""
    writes: list[int] = []
    setup = admin_http._Handler.setup

    def counting_setup(handler: admin_http._Handler) -> None:
        handler.request = _CountingSocket(handler.request, writes)
        setup(handler)

    monkeypatch.setattr(admin_http._Handler, "setup", counting_setup)
    server = emu.server("surface")
    if "kept-alive" not in send_control(emu["surface"].admin_url, "entities")["entities"]:
        server.call(lambda: server.broker.create_entity(QueueSpec(name="kept-alive")))
    port = emu["surface"].admin_port
    auth = f"Authorization: {_token(emu)}"
    requests = [
        _head("GET", "/kept-alive?api-version=2021-05", port, auth),  # 200, an entry
        _head("GET", "/absent?api-version=2021-05", port, auth),  # 404, an error body
        _head("GET", "/$emulator/stats", port, "X-Spark-SB-Emulator: 1"),  # 200, JSON
        _head("GET", "/kept-alive?api-version=2021-05", port),  # 401
    ]
    with _connect(port) as sock:
        for head in requests:
            del writes[:]
            sock.sendall(head.encode("latin-1") + b"\r\n")
            answer = b""
            while b"\r\n\r\n" not in answer or len(answer) < _length(answer):
                data = sock.recv(65536)
                assert data, f"the connection closed after {answer!r}"
                answer += data
            assert answer.startswith(b"HTTP/1.1 "), answer
            assert b"connection: close" not in answer.lower()  # kept alive
            assert writes == [len(answer)], f"{head.splitlines()[0]}: {len(writes)} writes {writes}"


def test_a_slowloris_of_300_connections_holds_no_thread_and_the_sdk_still_answers(emu: Emulator) -> None:
    """The admin port held a thread per connection, each read waiting up to 300 s: 300 slow clients (one header
    byte a second, their heads never ending) held 307 threads. The loop now reads the heads without a thread, the
    port holds at most max_connections_per_client (128) from one address, closing the oldest waiting one for a new
    connection, so the SDK's admin client gets in and is answered at once, and the thread count stays flat."""
    info, server = emu["surface"], emu.server("surface")
    if "slowloris" not in send_control(info.admin_url, "entities")["entities"]:
        server.call(lambda: server.broker.create_entity(QueueSpec(name="slowloris")))
    before = threading.active_count()
    peak, slow = before, []
    try:
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", info.admin_port), timeout=10)
            sock.sendall(f"GET /slowloris?api-version=2021-05 HTTP/1.1\r\nHost: localhost:{info.admin_port}\r\n"
                         "X-Slow: ".encode())
            slow.append(sock)
            peak = max(peak, threading.active_count())
        with admin_client(info.connection_string, admin_endpoint=info.admin_url, retry_total=0) as client:
            for _ in range(3):
                for sock in slow:  # a header byte a second each
                    try:
                        sock.send(b"x")
                    except OSError:  # closed by the port to make room
                        pass
                started = time.monotonic()
                assert client.get_queue("slowloris").name == "slowloris"
                assert time.monotonic() - started < 2.0
                peak = max(peak, threading.active_count())
                time.sleep(1.0)
        stats = send_control(info.admin_url, "stats")
    finally:
        for sock in slow:
            sock.close()
    assert peak - before < 24, f"{peak - before} threads more during the slowloris"
    admin = stats["admin"]
    assert admin["connections"] <= admin["limits"]["max_connections_per_client"] == 128
    assert admin["connections_evicted"] >= 300 - 128
    assert admin["workers"] <= admin["limits"]["workers"]


def test_the_admin_ports_bounds_are_options_of_the_emulator_process() -> None:
    """spark-sb emulator start --admin-request-timeout, --admin-idle-timeout, --admin-workers,
    --admin-max-connections and --admin-max-connections-per-client reach every admin port, shown in its stats."""
    limits = AdminLimits(request_timeout=2.5, idle_timeout=0, workers=3, max_connections=40,
                         max_connections_per_client=20)
    with EmulatorProcess.start(data_dir=None, namespaces=[NamespaceOptions("bounded")], admin_limits=limits) as proc:
        stats = send_control(proc["bounded"].admin_url, "stats")
    assert stats["admin"]["limits"] == {"request_timeout": 2.5, "idle_timeout": 0, "workers": 3,
                                        "max_connections": 40, "max_connections_per_client": 20}
