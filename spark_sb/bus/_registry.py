"""The process registry: one object per (kind, key) for the life of the process.

:func:`shared` creates an object on first use and hands the same one to every later caller; a kind names what
the objects are (``"namespace"``, ``"paired-sender"``, ``"health-board"``, ...) so that keys of different kinds
never meet. :func:`close_all` closes and forgets every object that has a ``close()`` (clients, senders,
syphons); objects without one (a health board: state, no handle) stay, so that entity health outlives it.
The registry closes its objects at interpreter exit (``atexit``). PySpark's forked Python workers end with
``os._exit``, which skips ``atexit``: their sockets are closed by the operating system when the worker ends.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from ..errors import redact

_LOGGER = logging.getLogger(__name__)

__all__ = ["close_all", "close_quietly", "entries", "shared"]

T = TypeVar("T")

_LOCK = threading.Lock()
_OBJECTS: dict[tuple[str, Hashable], Any] = {}
# one creation lock per (kind, key): a slow factory (pairing, a connection) holds up only its own key
_CREATING: dict[tuple[str, Hashable], threading.Lock] = {}
_ATEXIT_REGISTERED = False


def close_quietly(thing: Any, what: str | None = None) -> None:
    """``thing.close()``; a failure (a broken handler) is logged at debug level: nothing is left to do."""
    try:
        thing.close()
    except Exception as exc:  # closing a broken handler: nothing left to do but say so
        _LOGGER.debug("closing %s failed: %s", what or type(thing).__name__, redact(str(exc)))


def shared(kind: str, key: Hashable, factory: Callable[[], T], *,
           replace_if: Callable[[T], bool] | None = None) -> T:
    """The process-wide object of ``kind`` for ``key``, created by ``factory()`` on first use (an exception
    there registers nothing and reaches the caller). ``replace_if(current)`` True: the current object is closed
    and a new one takes its place (e.g. a new configuration of the same pairing)."""
    global _ATEXIT_REGISTERED
    slot = (kind, key)
    with _LOCK:
        current = _OBJECTS.get(slot)
        if current is not None and (replace_if is None or not replace_if(current)):
            return current  # type: ignore[no-any-return]
        creating = _CREATING.setdefault(slot, threading.Lock())
    with creating:
        with _LOCK:
            current = _OBJECTS.get(slot)
        if current is not None:
            if replace_if is None or not replace_if(current):
                return current  # type: ignore[no-any-return]
            with _LOCK:
                if _OBJECTS.get(slot) is current:
                    del _OBJECTS[slot]
            close_quietly(current, f"the replaced {kind} {key!r}")
        made = factory()
        with _LOCK:
            _OBJECTS[slot] = made
            if not _ATEXIT_REGISTERED:
                atexit.register(close_all)
                _ATEXIT_REGISTERED = True
        return made


def entries(kind: str) -> dict[Any, Any]:
    """``{key: object}`` of ``kind`` now in the registry."""
    with _LOCK:
        return {key: thing for (k, key), thing in _OBJECTS.items() if k == kind}


def close_all(kind: str | None = None) -> None:
    """Close and forget every object of the registry that has a ``close()`` (of ``kind`` only, when given),
    the most recently created first (a user closes before what it uses). Idempotent."""
    with _LOCK:
        closing = [(slot, thing) for slot, thing in _OBJECTS.items()
                   if callable(getattr(thing, "close", None)) and (kind is None or slot[0] == kind)]
        for slot, _ in closing:
            del _OBJECTS[slot]
    for (k, key), thing in reversed(closing):
        close_quietly(thing, f"the {k} {key!r}")
