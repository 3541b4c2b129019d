"""An asyncio server in a thread of its own, for the emulator's relays and its test proxy."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Self


class LoopService:
    """Runs ``_listen()`` (open the listeners) and then the loop in one daemon thread until ``stop()``, which runs
    ``_close_all()`` (close listeners and connections) on the loop before it ends. ``start()`` raises what
    ``_listen()`` raised."""

    #: what ``start()`` names in its timeout error
    what = "the service"

    def __init__(self, name: str) -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    async def _listen(self) -> None:
        raise NotImplementedError

    async def _close_all(self) -> None:
        raise NotImplementedError

    def start(self, timeout: float = 10.0) -> Self:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"{self.what} did not start within {timeout} s")
        if self._error is not None:
            self._thread.join(timeout)
            raise self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._listen())
        except BaseException as err:  # noqa: BLE001 - reported to start()
            self._error = err
            loop.run_until_complete(self._close_all())
            loop.close()
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._close_all())
            loop.close()

    def stop(self, timeout: float = 5.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
