"""AMQP over WebSockets for the emulator: what the SDKs' ``transport_type=AmqpOverWebsocket`` (and so any
``http_proxy``) connects to.

Each endpoint serves the path the SDKs use (``/$servicebus/websocket``) and the subprotocol ``AMQPWSB10``; every
binary message carries AMQP bytes. Like the AMQPS relay (:mod:`spark_sb.emulator.tls`), it relays those bytes
to the namespace's own plain AMQP port on loopback, so everything behind it sees the same plaintext for WebSocket
clients as for plain ones, and when either side closes the other is closed: an outage that drops the plain
connection closes the WebSocket too. A route with an SSL context serves ``wss://`` (TLS with the emulator's CA),
one without serves ``ws://`` (what an emulator connection string, ``UseDevelopmentEmulator=true``, makes the
SDK use).

A web page cannot open them: a browser always sends its page's ``Origin``, and one is let in only when it is the
endpoint's own (``http://localhost:5380`` for ``ws://localhost:5380``: websocket-client, the sync SDK's
transport, sends that; no page is served there) by a name a page cannot rebind (``localhost``, a loopback
address, the namespace's configured host), or one of the ``allowed_origins``. No ``Origin`` (aiohttp, the
JavaScript, Java and .NET SDKs) is let in. Anything else is answered 403.

The WebSocket protocol itself is the ``websockets`` package's (part of the ``[emulator]`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import unquote, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.protocol import State
from websockets.typing import Subprotocol

from ._service import LoopService

_LOGGER = logging.getLogger(__name__)

#: the path every Service Bus SDK opens (Python, JS, Java, .NET)
PATH = "/$servicebus/websocket"
#: the WebSocket subprotocol of AMQP 1.0 (OASIS AMQP WebSocket Binding), as the SDKs offer it
SUBPROTOCOL = "AMQPWSB10"
#: the largest WebSocket message accepted: far above any AMQP frame the SDKs write (they write one frame, at most
#: the negotiated max-frame-size, per message)
MAX_MESSAGE_SIZE = 16 * 1024 * 1024


@dataclass
class WebSocketRoute:
    """One WebSocket endpoint: ``host:port`` (0: a free port) relayed to the plain AMQP port ``upstream`` on
    loopback; ``context`` set: ``wss://`` (TLS), else ``ws://``."""

    name: str
    host: str
    port: int
    upstream_host: str
    upstream_port: int
    context: ssl.SSLContext | None = None

    @property
    def scheme(self) -> str:
        return "ws" if self.context is None else "wss"

    @property
    def url(self) -> str:
        return f"{self.scheme}://localhost:{self.port}{PATH}"


class WebSocketRelay(LoopService):
    """Serves each route's WebSocket endpoint and relays its AMQP bytes to the route's upstream, in one thread with
    an asyncio loop. ``start()`` fills in the routes' ports; ``stop()`` closes every listener and connection."""

    what = "the WebSocket endpoints"

    def __init__(self, routes: Sequence[WebSocketRoute], *, open_timeout: float = 10.0,
                 close_timeout: float = 2.0, name: str = "sb-emulator-ws", allowed_origins: Sequence[str] = ()) -> None:
        super().__init__(name)
        self.routes = list(routes)
        #: web origins (``scheme://host[:port]``) let in besides none and each endpoint's own
        self.allowed_origins = frozenset(_origin(o) for o in allowed_origins)
        self._open_timeout = open_timeout
        self._close_timeout = close_timeout
        self._servers: list[Server] = []
        self._upstreams: set[asyncio.StreamWriter] = set()
        self._open = 0

    @property
    def connections(self) -> int:
        """Open WebSocket clients (each with its upstream)."""
        return self._open

    async def _listen(self) -> None:
        for route in self.routes:
            try:
                server = await serve(
                    functools.partial(self._relay, route=route), route.host, route.port,
                    ssl=route.context, subprotocols=[Subprotocol(SUBPROTOCOL)],
                    process_request=functools.partial(self._check_request, route=route),
                    compression=None, max_size=MAX_MESSAGE_SIZE,
                    # the clients keep the connection alive (aiohttp pings every 10 s); a sync client reads only
                    # when it waits for something, so a server ping could go unanswered and drop an idle sender
                    ping_interval=None, open_timeout=self._open_timeout, close_timeout=self._close_timeout,
                    server_header=None, backlog=1024, reuse_address=True)
            except OSError as err:
                what = "AMQP over secure WebSockets (wss)" if route.context else "AMQP over WebSockets (ws)"
                raise OSError(err.errno, f"namespace {route.name}: cannot listen for {what} on "
                                         f"{route.host}:{route.port}: {err.strerror or err}") from None
            self._servers.append(server)
            route.port = next(iter(server.sockets)).getsockname()[1]
            _LOGGER.info("namespace %s: AMQP over WebSockets at %s (on %s), relayed to %s:%d", route.name,
                         route.url, route.host, route.upstream_host, route.upstream_port)

    async def _relay(self, ws: ServerConnection, route: WebSocketRoute) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(route.upstream_host, route.upstream_port)
        except OSError as err:
            # the namespace is down: the client meets a closed connection, as on the AMQP and AMQPS ports
            _LOGGER.debug("namespace %s: WebSocket client dropped, the AMQP port is closed: %s", route.name, err)
            await self._drop(ws)
            return
        self._open += 1
        self._upstreams.add(up_writer)
        try:
            pumps = [asyncio.create_task(_to_upstream(ws, up_writer)),
                     asyncio.create_task(_to_client(up_reader, ws))]
            # the first side to end ends both: an outage that drops the plain connection closes the WebSocket
            _, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for p in pending:
                p.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        finally:
            self._open -= 1
            up_writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(up_writer.wait_closed(), self._close_timeout)
            with contextlib.suppress(Exception):
                up_writer.transport.abort()
            self._upstreams.discard(up_writer)
            if ws.state is State.OPEN:  # the namespace's side ended first
                await self._drop(ws)

    async def _drop(self, ws: ServerConnection) -> None:
        """End the client's connection as a dropped AMQP connection ends: what was sent is delivered, then the
        stream ends, without a WebSocket close frame. The sync SDK's transport (websocket-client) would hand a
        close frame to the AMQP reader as an empty text message, which it cannot read (a TypeError, not the
        connection error it retries on)."""
        ws.transport.close()
        try:
            await asyncio.wait_for(ws.wait_closed(), self._close_timeout)
        except TimeoutError:
            ws.transport.abort()

    async def _close_all(self) -> None:
        for server in self._servers:
            server.close(close_connections=True)
        for w in list(self._upstreams):
            with contextlib.suppress(Exception):
                w.transport.abort()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), self._close_timeout + 1)
        self._servers.clear()


    def _check_request(self, connection: ServerConnection, request: Request, route: WebSocketRoute) -> Response | None:
        """A browser's page is refused (403, by its ``Origin``); only the SDKs' path opens a WebSocket, anything
        else is answered 404 naming it."""
        origin = request.headers.get("Origin")
        if origin is not None and not self._origin_allowed(origin, route):
            _LOGGER.info("namespace %s: a WebSocket from the web origin %r refused", route.name, origin[:200])
            return connection.respond(HTTPStatus.FORBIDDEN, f"the origin {origin[:200]!r} may not open AMQP over "
                                                            "WebSockets here (the emulator's allowed_origins)\n")
        path = unquote(urlsplit(request.path).path).rstrip("/")
        if path != PATH:
            return connection.respond(HTTPStatus.NOT_FOUND, f"AMQP over WebSockets is served at {PATH}, not {path}\n")
        return None

    def _origin_allowed(self, origin: str, route: WebSocketRoute) -> bool:
        value = _origin(origin)
        if value in self.allowed_origins:
            return True
        try:
            split = urlsplit(value)
            port = split.port or (443 if split.scheme == "https" else 80)
        except ValueError:
            return False
        # the endpoint's own origin (what websocket-client sends), by a name a page's owner cannot rebind
        return split.scheme in ("http", "https") and port == route.port and _local_name(split.hostname or "", route)


def _origin(text: str) -> str:
    return text.strip().rstrip("/").lower()


def _local_name(host: str, route: WebSocketRoute) -> bool:
    """``localhost``, a loopback address or the route's own (configured) host."""
    if host in ("localhost", route.host.strip("[]").lower()) or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _to_upstream(ws: ServerConnection, writer: asyncio.StreamWriter) -> None:
    try:
        async for message in ws:
            if isinstance(message, str):  # the AMQP WebSocket binding carries binary messages only
                await ws.close(1003, "AMQP over WebSockets takes binary messages")
                return
            writer.write(message)
            await writer.drain()
    except (ConnectionClosed, OSError):
        return


async def _to_client(reader: asyncio.StreamReader, ws: ServerConnection) -> None:
    try:
        while data := await reader.read(65536):
            await ws.send(data)
    except (ConnectionClosed, OSError, asyncio.IncompleteReadError):
        return
