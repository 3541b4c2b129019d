"""The emulator's byte relays: a port that hands a namespace's AMQP bytes to its plain AMQP port on loopback,
terminating TLS on the way (AMQPS, :mod:`spark_sb.emulator.tls`) or delaying them (a far namespace).

**A far namespace.** A route with a ``delay`` holds every chunk of bytes, in each direction, for that long
before passing it on, in order, without slowing the flow down: a round trip costs twice the delay, as it does
to a namespace in another region, and many frames can be on their way at once (a delay, not a bandwidth
limit). The namespace itself is unchanged behind it.

When either side closes, the relay closes the other: an outage that drops the plain connection drops the
client too, after the delay (what one side sent last still reaches the other).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

from ._service import LoopService

_LOGGER = logging.getLogger(__name__)

__all__ = ["Relay", "Route", "abort", "pump"]

#: chunks a delayed direction may hold before it stops reading (64 KiB each)
_HELD_CHUNKS = 1024


@dataclass
class Route:
    """One endpoint: ``host:port`` (0: a free port) relayed to the plain AMQP port ``upstream`` on loopback;
    ``delay`` seconds are added to each direction."""

    name: str
    host: str
    port: int
    upstream_host: str
    upstream_port: int
    delay: float = 0.0


class Relay(LoopService):
    """Relays each route's port to its upstream, in one thread with an asyncio loop, terminating TLS with
    ``context`` when given. ``start()`` fills in the routes' ports; ``stop()`` closes every listener and
    connection."""

    what = "the relay"
    #: what a listening error names: the kind of endpoint
    endpoint = "AMQP"

    def __init__(self, routes: Sequence[Route], context: ssl.SSLContext | None = None, *,
                 handshake_timeout: float = 10.0, name: str = "sb-emulator-relay") -> None:
        super().__init__(name)
        self.routes = list(routes)
        self._context = context
        self._handshake_timeout = handshake_timeout
        self._servers: list[asyncio.AbstractServer] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def connections(self) -> int:
        """Open client connections (each with its upstream)."""
        return len(self._tasks)

    async def _listen(self) -> None:
        handshake = None if self._context is None else self._handshake_timeout  # asyncio refuses one without TLS
        for route in self.routes:
            try:
                server = await asyncio.start_server(functools.partial(self._accept, route=route), route.host,
                                                    route.port, ssl=self._context, ssl_handshake_timeout=handshake,
                                                    backlog=1024, reuse_address=True)
            except OSError as err:
                raise OSError(err.errno, f"namespace {route.name}: cannot listen for {self.endpoint} on "
                                         f"{route.host}:{route.port}: {err.strerror or err}") from None
            self._servers.append(server)
            route.port = server.sockets[0].getsockname()[1]
            _LOGGER.info("namespace %s: %s on %s:%d, relayed to %s:%d%s", route.name, self.endpoint, route.host,
                         route.port, route.upstream_host, route.upstream_port,
                         f" {route.delay * 1000:g} ms later each way" if route.delay else "")

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, route: Route) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        up_writer: asyncio.StreamWriter | None = None
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(route.upstream_host, route.upstream_port)
            except OSError as err:
                _LOGGER.debug("namespace %s: %s client dropped, the AMQP port is closed: %s", route.name,
                              self.endpoint, err)
                return
            self._writers.add(up_writer)
            pumps = [asyncio.create_task(pump(reader, up_writer, route.delay)),
                     asyncio.create_task(pump(up_reader, writer, route.delay))]
            try:
                # the first side to end ends both: an outage that drops the plain connection drops the client
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:  # stop() cancels this task: its pumps end with it
                for p in pumps:
                    p.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except asyncio.CancelledError:
            pass  # stop(): the connection ends here, which is all a cancel asks of it
        finally:
            # close, not abort: what one side sent last (a close frame) still reaches the other
            ends = [w for w in (writer, up_writer) if w is not None]
            for w in ends:
                w.close()
            for w in ends:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(w.wait_closed(), 2)
                abort(w)
                self._writers.discard(w)
            self._tasks.discard(task)

    async def _close_all(self) -> None:
        for server in self._servers:
            server.close()
        for w in list(self._writers):
            abort(w)
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)
        self._servers.clear()


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float = 0.0) -> None:
    """Copy ``reader`` to ``writer`` until either ends, each chunk ``delay`` seconds after it was read."""
    if delay > 0:
        return await _delayed_pump(reader, writer, delay)
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
        return


async def _delayed_pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Read as bytes come, write each chunk when it is due: the chunks behind one wait in a queue, so a delay
    never lowers the rate. The end of the input (b"") is passed on after the delay too."""
    loop = asyncio.get_running_loop()
    held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_HELD_CHUNKS)

    async def deliver() -> None:
        while True:
            due, data = await held.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                return
            writer.write(data)
            await writer.drain()

    async def read() -> None:
        while True:
            try:
                data = await reader.read(65536)
            except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
                data = b""
            await held.put((loop.time() + delay, data))
            if not data:
                return

    # reading ends at the end of the input; delivering when that end is passed on, or when the writer fails
    # (then reading stops too)
    reading, delivering = asyncio.create_task(read()), asyncio.create_task(deliver())
    try:
        await asyncio.wait([delivering], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (reading, delivering):
            task.cancel()
        await asyncio.gather(reading, delivering, return_exceptions=True)


def abort(writer: asyncio.StreamWriter) -> None:
    """Close a connection at once (no TLS close_notify exchange to wait for)."""
    with contextlib.suppress(Exception):
        writer.transport.abort()
