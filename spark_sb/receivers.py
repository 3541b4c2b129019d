"""The per-process registry of the syphon's backlog-queue receivers and syphons.

The SDK takes about half a second to open a receiver (it polls the handshake in 50 ms steps) and up to a
second to close one (it joins its keep-alive thread), so the ``servicebus-backlog`` source and the syphon's
sink keep them for the life of the process, as the sink keeps its paired senders (:mod:`spark_sb.sink`):

* :func:`backlog_receiver`: one peek-lock receiver (prefetch 0) per backlog queue and configuration, used
  under a lock by one caller at a time. An error that can leave the link broken drops it: the next use
  opens a new one. ``retries=True`` (receiving, peeking) keeps the SDK's default retry policy, which also
  reopens a link the service closed; ``retries=False`` (fetching deferred messages by sequence number) has
  none, because the SDK retries "message not found" with backoff, and the syphon asks for messages that may
  be gone or locked on purpose. ``delete=True`` gives a receive-and-delete receiver instead: fetching
  deferred messages by sequence number with it removes them in one request, where completing them one by
  one costs a request each;
* :func:`syphon_for`: one :class:`~spark_sb.syphon.Syphon` per configuration, so its clients and what it
  learnt about destinations (down until when, healthy when) last from batch to batch.

Both close at interpreter exit (``atexit``); :func:`close_all` closes them earlier.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .config import SparkSbConfig

if TYPE_CHECKING:
    from .syphon import Syphon

_LOGGER = logging.getLogger(__name__)

__all__ = ["backlog_receiver", "close_all", "syphon_for"]

_LOCK = threading.Lock()
_CLIENTS: dict[tuple[str, bool], Any] = {}
_RECEIVERS: dict[tuple[str, str, bool, bool], Any] = {}
_QUEUE_LOCKS: dict[tuple[str, str, bool, bool], threading.Lock] = {}
_SYPHONS: dict[str, tuple[Syphon, threading.Lock]] = {}
_ATEXIT_REGISTERED = False


def _register_atexit() -> None:
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        atexit.register(close_all)
        _ATEXIT_REGISTERED = True


def _close(thing: Any, what: str) -> None:
    try:
        thing.close()
    except Exception as exc:  # a broken handler: nothing left to do but say so
        _LOGGER.debug("closing %s failed: %s", what, type(exc).__name__)


@contextlib.contextmanager
def backlog_receiver(config: SparkSbConfig, queue: str, *, retries: bool = True, delete: bool = False
                     ) -> Iterator[Any]:
    """This process's peek-lock receiver (prefetch 0) of backlog queue ``queue`` on ``config``'s secondary,
    held exclusively for the ``with`` block; ``retries`` and ``delete``: see the module docstring."""
    from azure.servicebus import ServiceBusReceiveMode
    from azure.servicebus.exceptions import MessageNotFoundError

    fingerprint = config.fingerprint()
    key = (fingerprint, queue, retries, delete)
    with _LOCK:
        lock = _QUEUE_LOCKS.setdefault(key, threading.Lock())
    with lock:
        with _LOCK:
            receiver = _RECEIVERS.get(key)
            if receiver is None:
                client = _CLIENTS.get((fingerprint, retries))
                if client is None:
                    client = _CLIENTS[(fingerprint, retries)] = (
                        config.secondary.client() if retries else config.secondary.client(retry_total=0))
                    _register_atexit()
                mode = ServiceBusReceiveMode.RECEIVE_AND_DELETE if delete else ServiceBusReceiveMode.PEEK_LOCK
                receiver = _RECEIVERS[key] = client.get_queue_receiver(queue, prefetch_count=0, receive_mode=mode)
        try:
            yield receiver
        except MessageNotFoundError:  # an answer, not a broken link
            raise
        except Exception:
            with _LOCK:
                if _RECEIVERS.get(key) is receiver:
                    del _RECEIVERS[key]
            _close(receiver, f"the receiver of {queue!r}")
            raise


@contextlib.contextmanager
def syphon_for(config: SparkSbConfig) -> Iterator[Syphon]:
    """This process's :class:`~spark_sb.syphon.Syphon` (re-parking, for the Spark path) for ``config``, held
    exclusively for the ``with`` block."""
    from .syphon import Syphon

    fingerprint = config.fingerprint()
    with _LOCK:
        entry = _SYPHONS.get(fingerprint)
        if entry is None:
            entry = _SYPHONS[fingerprint] = (Syphon(config, repark=True), threading.Lock())
            _register_atexit()
    with entry[1]:
        yield entry[0]


def close_all() -> None:
    """Close every receiver, client and syphon of the registry (idempotent)."""
    with _LOCK:
        receivers, clients = list(_RECEIVERS.items()), list(_CLIENTS.values())
        syphons = [syphon for syphon, _ in _SYPHONS.values()]
        _RECEIVERS.clear()
        _CLIENTS.clear()
        _SYPHONS.clear()
    for (_, queue, _, _), receiver in receivers:
        _close(receiver, f"the receiver of {queue!r}")
    for client in clients:
        _close(client, "a client")
    for syphon in syphons:
        _close(syphon, "a syphon")
