"""A small HTTP proxy for tests and demos: what a workspace whose egress goes through a proxy puts between the SDK
and Service Bus.

It opens ``CONNECT host:port`` tunnels (what websocket-client, the sync SDK's WebSocket transport, uses for ws://
and wss://, and aiohttp, the async one's, for wss://) and relays absolute-form requests such as
``GET http://host:port/path`` with their upgrade (what aiohttp sends for ws:// through a proxy): the request goes
to its host in origin form, without the proxy's own headers, and the connection is relayed as it is from then
on (one target per client connection). With a username and password it asks for Basic authentication
(``407 Proxy Authentication Required``); ``allowed_ports`` limits where it connects (``403`` elsewhere), as an
egress firewall would. ``tunnels`` counts what it opened per target, ``refused`` what it turned away, so a test
can prove that the traffic went through it. The password never appears in a log line or a repr.

    with HttpProxy(username="user", password=secret) as proxy:
        ServiceBusClient(..., http_proxy=proxy.http_proxy)  # azure.servicebus.aio: proxy.aio_http_proxy
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import hmac
import logging
from collections.abc import Collection
from typing import Any
from urllib.parse import urlsplit

from ._service import LoopService
from .relay import pump

_LOGGER = logging.getLogger(__name__)

#: the longest request head (request line and headers) the proxy reads
MAX_HEAD = 64 * 1024
#: the proxy's own headers, never sent on to the target
_HOP_HEADERS = ("proxy-authorization", "proxy-connection")


class HttpProxy(LoopService):
    """An HTTP proxy on ``host:port`` (0: a free port, in ``port`` after ``start()``)."""

    what = "the HTTP proxy"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, username: str | None = None,
                 password: str | None = None, allowed_ports: Collection[int] | None = None,
                 head_timeout: float = 10.0, name: str = "sb-emulator-proxy") -> None:
        super().__init__(name)
        if (username is None) != (password is None):
            raise ValueError("the proxy needs both a username and a password, or neither")
        self.host = host
        self.port = port
        self.username = username
        self._password = password
        self.allowed_ports = None if allowed_ports is None else frozenset(allowed_ports)
        self._head_timeout = head_timeout
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        #: connections opened to each (host, port) target
        self.tunnels: collections.Counter[tuple[str, int]] = collections.Counter()
        #: requests turned away: no or wrong credentials (407), a port not allowed (403), a bad request (400)
        self.refused = 0

    def __repr__(self) -> str:
        auth = "" if self.username is None else f", username={self.username!r}, password=***"
        return f"HttpProxy({self.host!r}, {self.port}{auth})"

    def __enter__(self) -> HttpProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def http_proxy(self) -> dict[str, Any]:
        """The sync SDK's ``http_proxy=`` for this proxy (holds the password: do not log it)."""
        settings: dict[str, Any] = {"proxy_hostname": self.host, "proxy_port": self.port}
        if self.username is not None:
            settings.update(username=self.username, password=self._password)
        return settings

    @property
    def aio_http_proxy(self) -> dict[str, Any]:
        """The async SDK's ``http_proxy=``: its transport (aiohttp) takes ``proxy_hostname`` as a URL and refuses a
        bare host (``InvalidURL``), which the sync one (websocket-client) needs: ``http://HOST``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return {**self.http_proxy, "proxy_hostname": f"http://{host}"}

    async def _listen(self) -> None:
        try:
            self._server = await asyncio.start_server(self._accept, self.host, self.port, limit=MAX_HEAD,
                                                      backlog=1024, reuse_address=True)
        except OSError as err:
            raise OSError(err.errno, f"the HTTP proxy cannot listen on {self.host}:{self.port}: "
                                     f"{err.strerror or err}") from None
        self.port = self._server.sockets[0].getsockname()[1]
        _LOGGER.info("HTTP proxy on %s%s", self.url, " (Basic authentication)" if self.username else "")

    async def _close_all(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.transport.abort()
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        up_writer: asyncio.StreamWriter | None = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._head_timeout)
            except asyncio.LimitOverrunError:
                await self._refuse(writer, 431, "Request Header Fields Too Large")
                return
            except (asyncio.IncompleteReadError, TimeoutError, OSError):
                return
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            method, _, rest = request_line.partition(" ")
            target, _, version = rest.partition(" ")
            headers = [line for line in header_lines if line]
            if not self._authorized(headers):
                await self._refuse(writer, 407, "Proxy Authentication Required",
                                   'Proxy-Authenticate: Basic realm="spark-sb emulator proxy"\r\n')
                return
            if method.upper() == "CONNECT":
                host, port = _host_port(target, None)
                forward = None
            else:
                url = urlsplit(target)
                if url.scheme not in ("http", "ws") or not url.hostname:
                    await self._refuse(writer, 400, "Bad Request")
                    return
                host, port = url.hostname, url.port or 80
                path = (url.path or "/") + (f"?{url.query}" if url.query else "")
                kept = [h for h in headers if h.partition(":")[0].strip().lower() not in _HOP_HEADERS]
                forward = "\r\n".join([f"{method} {path} {version}", *kept, "", ""]).encode("latin-1")
            if host is None or port is None:
                await self._refuse(writer, 400, "Bad Request")
                return
            if self.allowed_ports is not None and port not in self.allowed_ports:
                await self._refuse(writer, 403, "Forbidden")
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(host, port)
            except OSError as err:
                _LOGGER.info("HTTP proxy: cannot reach %s:%d: %s", host, port, err)
                writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                with contextlib.suppress(OSError):
                    await writer.drain()
                return
            self._writers.add(up_writer)
            self.tunnels[(host, port)] += 1
            _LOGGER.debug("HTTP proxy: %s to %s:%d", "tunnel" if forward is None else method, host, port)
            if forward is None:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                up_writer.write(forward)
            pumps = [asyncio.create_task(pump(reader, up_writer)), asyncio.create_task(pump(up_reader, writer))]
            # the first side to end ends both
            _, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for p in pending:
                p.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        finally:
            for w in (writer, up_writer):
                if w is None:
                    continue
                w.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(w.wait_closed(), 2)
                with contextlib.suppress(Exception):
                    w.transport.abort()
                self._writers.discard(w)
            self._tasks.discard(task)

    def _authorized(self, headers: list[str]) -> bool:
        if self.username is None or self._password is None:
            return True
        for line in headers:
            name, _, value = line.partition(":")
            if name.strip().lower() != "proxy-authorization":
                continue
            scheme, _, encoded = value.strip().partition(" ")
            if scheme.lower() != "basic":
                return False
            try:
                user, sep, password = base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return False
            # both compared in full whatever the first says: no timing hint at which one was wrong
            user_ok = hmac.compare_digest(user.encode(), self.username.encode())
            password_ok = hmac.compare_digest(password.encode(), self._password.encode())
            return bool(sep) and user_ok and password_ok
        return False

    async def _refuse(self, writer: asyncio.StreamWriter, status: int, reason: str, extra: str = "") -> None:
        self.refused += 1
        _LOGGER.info("HTTP proxy: refused a request: %d %s", status, reason)
        writer.write(f"HTTP/1.1 {status} {reason}\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n"
                     .encode("latin-1"))
        with contextlib.suppress(OSError):
            await writer.drain()


def _host_port(authority: str, default: int | None) -> tuple[str | None, int | None]:
    """``host:port`` or ``[v6]:port`` of a CONNECT request."""
    url = urlsplit(f"//{authority}")
    try:
        port = url.port or default
    except ValueError:
        return None, None
    return url.hostname, port


def run_foreground(host: str, port: int, *, username: str | None = None, password: str | None = None,
                   allowed_ports: Collection[int] | None = None, out: Any = None) -> int:
    """What ``spark-sb emulator proxy`` does: start, print ``PROXY <url>``, wait for SIGINT or SIGTERM, then say
    how many tunnels it opened and how many requests it refused."""
    import signal
    import sys
    import threading

    out = out or sys.stdout
    stop = threading.Event()
    with HttpProxy(host, port, username=username, password=password, allowed_ports=allowed_ports) as proxy:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        print(f"PROXY {proxy.url}", file=out, flush=True)
        while not stop.wait(0.5):
            pass
        print(f"opened {sum(proxy.tunnels.values())} tunnels, refused {proxy.refused} requests", file=out,
              flush=True)
    return 0
