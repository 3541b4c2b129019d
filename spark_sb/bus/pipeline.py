"""Several sends in flight on one SDK sender: one link, one connection.

azure-servicebus opens a connection per sender and sends one message (or batch) at a time on it: each
``send_messages`` writes its transfer, then waits for its disposition. A worker that keeps ``sends_in_flight``
sends in flight at once therefore held that many connections per entity (8 by default; a cluster of 600 such
workers holds 4,800 of a namespace's 5,000). Its connection-sharing switch (``ServiceBusClient._connection_sharing``)
is private and broken (it builds the connection from an attribute the SASL credential does not have).

:func:`send_batch` keeps the SDK's sender, its link and its connection, and lets several threads use them at
once: each thread writes its transfer, then waits for its own delivery's disposition, pumping the connection
(``do_work``: one frame, or the socket's read timeout) while it waits. Every call into the sender's pyamqp
handler (open, transfer, pump, close) is made under the sender's ``io`` lock, so the handler is never used by two
threads at once; between two frames another thread may write its transfer, so transfers go out while earlier
ones wait for their dispositions. Measured on the emulator with a namespace 40 ms away: 8 sends in flight on one
connection moved 1 KiB messages 2.4 to 2.8 times as fast as the sequential raw send, against 2.1 to 2.3 times
for 8 threads with a connection each (``bench/latency.py``).

The SDK's retry policy (``retry_total``, backoff), its per-attempt ``try_timeout`` and its mapping of AMQP errors to
``ServiceBusError`` subclasses are kept. Its error *handling* is not: the SDK's ``_handle_exception`` closes the
sender's handler after most errors, which is right when one send owns the link and wrong when eight share it (one
refused delivery closed the link under the seven others, and a failed send closed a handler another thread had just
opened). Here an error belongs to what failed (``docs/sizing.md``, "One connection, many sends"):

* **a refused delivery** (the service's disposition rejects it: no session id for a session queue, server busy,
  quota) fails its own send, mapped as the SDK maps it; the link and the other sends go on;
* **a lost link or connection** (a detach, such as ``amqp:link:detach-forced``; a dead socket) fails the sends on
  it, each with the link's own AMQP condition; the first of them to see it closes the handler, exactly once (it is
  still the sender's current one), and every one of them sends again at once on the new link: one reconnect,
  shared. A send whose transfer was on the wire when its link died may have been stored: when it fails in the end
  its error says so (:func:`spark_sb.errors.is_outcome_unknown`), and a resend is absorbed by duplicate detection;
* **an attempt's own wait** running out (its try timeout) fails that send as timed out (its outcome unknown too);
  the link stays open.

A transfer is written to the socket by the thread that sends it, at once (the pump only reads): a send costs one
round trip, not one plus the pump's next wake.

It uses the SDK's internals (:data:`INTERNALS`), checked at import (:func:`check_internals`): an SDK without one of
them sends through its public ``send_messages``, one batch at a time per connection, and says why once.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from azure.servicebus.exceptions import OperationTimeoutError

from ..errors import mark_outcome_unknown

_LOGGER = logging.getLogger(__name__)

__all__ = ["INTERNALS", "SenderClosed", "SenderIo", "check_internals", "missing_internals", "send_batch",
           "supported"]

try:  # the SDK's pyamqp, vendored under azure.servicebus
    from azure.servicebus import ServiceBusSender
    from azure.servicebus._common.tracing import (
        get_span_links_from_batch,
        is_tracing_enabled,
        send_trace_context_manager,
    )
    from azure.servicebus._pyamqp.client import SendClient
    from azure.servicebus._pyamqp.constants import (
        MESSAGE_DELIVERY_DONE_STATES,
        LinkDeliverySettleReason,
        LinkState,
        MessageDeliveryState,
    )
    from azure.servicebus._pyamqp.error import ErrorCondition, MessageException
    from azure.servicebus._pyamqp.message import BatchMessage, _MessageDelivery
    from azure.servicebus._pyamqp.sender import SenderLink
    from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
    _NOT_DELIVERED = LinkDeliverySettleReason.NOT_DELIVERED
    _ATTACHED = LinkState.ATTACHED
    _IMPORT_ERROR: str | None = None
except (ImportError, AttributeError) as err:  # pragma: no cover - another SDK layout: sends go one at a time
    _MessageDelivery = None  # type: ignore[assignment,misc]  # mypy: an optional import's fallback (python/mypy#1153)
    _IMPORT_ERROR = str(err)


class _Delivery(_MessageDelivery if _MessageDelivery is not None else object):  # type: ignore[misc]
    """The SDK's delivery record of one transfer, which wakes its sender (``wake``) when it is settled or failed."""

    def __init__(self, sdk_sender: Any, handler: Any, message: Any, expiry: float | None) -> None:
        self.wake = threading.Event()
        self.failure: BaseException | None = None
        self.sdk_sender = sdk_sender
        self.handler = handler
        self.pending: Any = None  # pyamqp's PendingDelivery of the transfer (``sent``: written to the socket)
        self.reason: Any = None  # set by the SDK's ``_on_send_complete``: why the delivery was settled
        super().__init__(message, MessageDeliveryState.WaitingToBeSent, expiry)

    @property
    def on_the_wire(self) -> bool:
        """Whether the transfer was written: the service may have stored it, answered or not."""
        return bool(getattr(self.pending, "sent", False))

    @property
    def state(self) -> Any:
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        self._state = value
        if value in MESSAGE_DELIVERY_DONE_STATES:
            self.wake.set()

    def fail(self, error: BaseException) -> None:
        self.failure = error
        self.wake.set()

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


class SenderIo:
    """The lock around every call into one SDK sender's handler (re-entrant: ``with io:``), and the sender's pump
    thread (:meth:`track`), which reads the connection while sends wait for their dispositions. The pump takes
    the lock only when no thread waits to write (to open the link, write a transfer, or use the sender in a
    ``with`` block): a plain lock let the readers take it back frame after frame while a thread with a transfer
    to write waited, and the sends in flight went out one at a time (measured: 0.99 of a sequential send against
    a namespace 40 ms away, where 8 sends in flight on one link reach 2.4)."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._writers = 0  # threads waiting to take it other than to pump
        self._outstanding: set[_Delivery] = set()
        self._pump_thread: threading.Thread | None = None
        self._kept_alive = 0.0

    def __enter__(self) -> SenderIo:
        me = threading.get_ident()
        with self._cv:
            if self._owner == me:
                self._depth += 1
                return self
            self._writers += 1
            try:
                while self._owner is not None:
                    self._cv.wait()
            finally:
                self._writers -= 1
            self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._cv:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cv.notify_all()

    # --- the pump: one thread per sender reads the connection while deliveries wait for their dispositions ---

    def track(self, delivery: _Delivery) -> None:
        """``delivery`` waits for its disposition: make sure the pump thread runs (called with the lock held)."""
        with self._cv:
            self._outstanding.add(delivery)
            if self._pump_thread is None:
                self._pump_thread = threading.Thread(target=self._pump, name="spark-sb-send-pump", daemon=True)
                self._pump_thread.start()

    def untrack(self, delivery: _Delivery) -> None:
        """``delivery`` is no longer waited for (settled, failed, or its sender gave up on it)."""
        with self._cv:
            self._outstanding.discard(delivery)

    def _pump(self) -> None:
        """While deliveries wait: wait for a frame without the lock, read it with the lock (their dispositions
        settle them: :class:`_Delivery` wakes its sender). Ends when none waits."""
        try:
            while True:
                with self._cv:
                    waiting = [d for d in self._outstanding if not d.wake.is_set()]
                    if not waiting:
                        self._pump_thread = None
                        return
                handler = waiting[-1].handler
                if not _unsent(handler) and _readable(handler, _POLL) is False:
                    self._keep_alive(handler)
                    continue
                if not self._take_for_pump(_POLL):
                    continue
                try:
                    self._pump_once(waiting)
                finally:
                    self.__exit__()
        except BaseException:
            with self._cv:
                self._pump_thread = None
            raise

    def _keep_alive(self, handler: Any) -> None:
        """While deliveries wait on a silent connection, an empty frame when the service's idle timeout is half
        gone (what the SDK's own reads do; the pump reads only when there is something to read)."""
        keep_alive = getattr(getattr(handler, "_connection", None), "_get_remote_timeout", None)
        if keep_alive is None or time.monotonic() - self._kept_alive < _KEEP_ALIVE_EVERY:
            return
        self._kept_alive = time.monotonic()
        if self._take_for_pump(0):
            try:
                keep_alive(time.time())
            except Exception as exc:  # noqa: BLE001 - a dead connection: the next read says so to the sends
                _LOGGER.debug("an empty frame to keep the connection open failed: %s", type(exc).__name__)
            finally:
                self.__exit__()

    def _pump_once(self, waiting: list[_Delivery]) -> None:
        """One frame (or the transfers the link queued), under the lock; a handler that was replaced or whose
        connection failed fails its waiting deliveries (their senders map and retry that as the SDK would)."""
        for handler in {id(d.handler): d.handler for d in waiting}.values():
            mine = [d for d in waiting if d.handler is handler]
            try:
                if any(d.sdk_sender._handler is not handler for d in mine):
                    raise MessageException(condition=ErrorCondition.ClientError,
                                           description="Send failed - connection not running.")
                readable = _readable(handler, 0)
                if readable is False:
                    handler._link.update_pending_deliveries()
                else:
                    # the frames that are there already, under one hold of the lock (a disposition each, often)
                    for _ in range(_FRAMES_PER_PUMP):
                        if not handler.do_work():
                            raise MessageException(condition=ErrorCondition.ClientError,
                                                   description="Send failed - connection not running.")
                        if _readable(handler, 0) is not True:
                            break
                    if _unsent(handler):
                        handler._link.update_pending_deliveries()
            except Exception as exc:  # noqa: BLE001 - the connection failed: handed to each send waiting on it
                for delivery in mine:
                    delivery.fail(exc)

    def reset(self, sdk_sender: Any, handler: Any) -> bool:
        """Close ``sdk_sender``'s handler after its link or connection failed, if it is still ``handler`` (the one
        the failure was seen on): the first send (or the pump) to see a failure closes it, exactly once; a send that
        finds a new handler already there just sends on it. Returns whether this call closed it."""
        with self:
            if handler is None or sdk_sender._handler is not handler:
                return False
            _LOGGER.debug("closing the sender's link and connection after they failed; the sends on it go again")
            try:
                sdk_sender._close_handler()
            except Exception as exc:  # noqa: BLE001 - a dead connection may fail its own close; it is gone anyway
                _LOGGER.debug("closing a failed handler raised %s", type(exc).__name__)
                sdk_sender._handler, sdk_sender._running = None, False
            return True

    def pump_now(self, handler: Any) -> None:
        """Read the frames already there for ``handler`` (a send whose own wait ran out reads them before it says
        it timed out: they may hold its answer, read by nobody while another thread held the lock)."""
        with self:
            waiting = [d for d in self._outstanding if d.handler is handler and not d.wake.is_set()]
            if waiting:
                self._pump_once(waiting)

    def _take_for_pump(self, timeout: float) -> bool:
        """Take the lock for the pump once nobody holds it and no thread waits to write, within ``timeout``
        seconds. True when taken (release it with ``__exit__``)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._owner is not None or self._writers:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            self._owner, self._depth = threading.get_ident(), 1
        return True


class _Unsettled(Exception):
    """A send's own wait for its disposition ran out (its try timeout); the link may well be fine."""


class _LinkLost(Exception):
    """The link or the connection under a delivery failed (``error``: what it failed with, its AMQP condition
    kept); ``on_the_wire``: the transfer had been written (the service may have stored it)."""

    def __init__(self, handler: Any, error: BaseException, on_the_wire: bool) -> None:
        super().__init__(str(error))
        self.handler = handler
        self.error = error
        self.on_the_wire = on_the_wire


class _Refused(Exception):
    """The service answered the delivery with a rejection (``error``): a matter of this send alone."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class SenderClosed(Exception):
    """The sender was closed by another thread (``Namespace.drop_sender``) before this attempt: nothing of the
    attempt was sent; send again on the namespace's new sender."""

#: the conditions of a rejected delivery that say its link or connection is gone, not the message refused
_LINK_CONDITIONS = () if _MessageDelivery is None else (
    ErrorCondition.LinkDetachForced, ErrorCondition.ConnectionCloseForced, ErrorCondition.LinkStolen)

#: the longest the pump waits on the socket, and a send on its delivery, before looking again
_POLL = 0.05
#: how often the pump looks whether a silent connection needs an empty frame (seconds)
_KEEP_ALIVE_EVERY = 1.0
#: the most frames the pump reads under one hold of the lock, while more are there to read
_FRAMES_PER_PUMP = 16


def _readable(handler: Any, timeout: float) -> bool | None:
    """Whether ``handler``'s connection has a frame's bytes to read, waiting up to ``timeout`` seconds for them:
    bytes in pyamqp's own read buffer or the TLS layer's, or the socket readable. ``None`` when it cannot be told
    (no plain or TLS socket: WebSockets, a closed transport); then the caller reads as the SDK does."""
    transport = getattr(getattr(handler, "_connection", None), "_transport", None)
    sock = getattr(transport, "sock", None)
    if sock is None or not isinstance(sock, socket.socket):
        return None
    buffered = getattr(transport, "_read_buffer", None)
    if buffered is not None:
        with buffered.getbuffer() as view:
            if view.nbytes > buffered.tell():
                return True
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    try:
        ready, _, _ = select.select([sock], [], [], timeout)
    except (OSError, ValueError):  # closed under us: let the SDK's read say so
        return True
    return bool(ready)


def _unsent(handler: Any) -> bool:
    """Whether ``handler``'s link holds transfers it has not written yet (the SDK writes them in its next
    ``do_work``, or here)."""
    link = getattr(handler, "_link", None)
    return link is not None and any(not delivery.sent for delivery in getattr(link, "_pending_deliveries", ()))


#: the SDK internals :func:`send_batch` pipelines with: (what, where, name). Missing one, sends go through the SDK's
#: public ``send_messages``, one batch at a time per connection.
INTERNALS: tuple[tuple[str, Any, str], ...] = () if _MessageDelivery is None else (
    ("ServiceBusSender", ServiceBusSender, "_open"),
    ("ServiceBusSender", ServiceBusSender, "_close_handler"),
    ("ServiceBusSender", ServiceBusSender, "_handle_exception"),
    ("ServiceBusSender", ServiceBusSender, "_backoff"),
    ("ServiceBusSender", ServiceBusSender, "create_message_batch"),
    ("SendClient", SendClient, "_transfer_message"),
    ("SendClient", SendClient, "_on_send_complete"),
    ("SendClient", SendClient, "do_work"),
    ("SenderLink", SenderLink, "update_pending_deliveries"),
    ("SenderLink", SenderLink, "send_transfer"),
    ("PyamqpTransport", PyamqpTransport, "create_servicebus_exception"),
)
#: what every ``ServiceBusSender`` instance must hold (set in its constructor): looked at on each sender's first send
_INSTANCE_INTERNALS = ("_config", "_shutdown", "_running", "_amqp_transport")

_missing: list[str] = []
_said: set[str] = set()  # the reasons already logged (once each)


def missing_internals() -> list[str]:
    """The SDK internals :func:`send_batch` needs that this azure-servicebus lacks (empty when it has them all)."""
    if _MessageDelivery is None:
        return [f"azure.servicebus._pyamqp ({_IMPORT_ERROR})"]
    return [f"{owner}.{name}" for owner, where, name in INTERNALS if not hasattr(where, name)]


def check_internals() -> list[str]:
    """Look for :data:`INTERNALS` again (done at import) and keep the answer: what is missing, which makes every
    :func:`send_batch` send through ``send_messages``."""
    _missing[:] = missing_internals()
    _said.clear()
    return list(_missing)


def supported(sdk_sender: Any) -> bool:
    """Whether :func:`send_batch` pipelines on ``sdk_sender`` (an SDK ``ServiceBusSender``): the SDK has every
    internal of :data:`INTERNALS` and the sender the attributes it sets up. When not, says why once."""
    missing = list(_missing) or [name for name in _INSTANCE_INTERNALS if not hasattr(sdk_sender, name)]
    if not missing:
        return True
    reason = ", ".join(missing)
    if reason not in _said:
        _said.add(reason)
        _LOGGER.warning("this azure-servicebus has no %s: several sends in flight on one link are off; each "
                        "connection sends one batch at a time (the SDK's send_messages)", reason)
    return False


check_internals()


def send_batch(sdk_sender: Any, io: SenderIo, batch: Any, *,
               check: Callable[[BaseException], None] | None = None) -> None:
    """Send ``batch`` (a ``ServiceBusMessageBatch`` of ``sdk_sender``) on ``sdk_sender``, which other threads may
    be sending on at the same time through this function (each holding ``io`` only while it calls the handler).
    Returns once the service accepted the batch; raises the ``ServiceBusError`` the SDK maps the failure to (see
    the module docstring for who fails and who closes what). ``check(error)`` sees each mapped error first and may
    raise its own (the namespace raises a rejected credential at once)."""
    if not supported(sdk_sender):
        with io:
            sdk_sender.send_messages(batch)
        return
    # the SDK's own "ServiceBus.send" span (with the links of the messages' spans) when tracing is on
    links = get_span_links_from_batch(batch) if is_tracing_enabled() else []  # type: ignore[no-untyped-call]
    with send_trace_context_manager(sdk_sender, links=links):
        _send(sdk_sender, io, batch, check)


def _send(sdk_sender: Any, io: SenderIo, batch: Any, check: Callable[[BaseException], None] | None) -> None:
    """:func:`send_batch`'s attempts, with the SDK's retry policy."""
    config = sdk_sender._config
    try_timeout = config.try_timeout if config.try_timeout and config.try_timeout > 0 else None
    retried = 0
    reconnected = False
    unknown = False  # an attempt's transfer was written and never answered: it may be stored already
    while True:
        try:
            _attempt(sdk_sender, io, batch, try_timeout)
            if unknown:
                _LOGGER.debug("a batch sent again after its link failed with it on the wire may be stored twice "
                              "(duplicate detection absorbs it)")
            return
        except SenderClosed:
            raise
        except _Unsettled:
            # this send's wait ran out, not the link: only this send fails (or is sent again) as timed out
            unknown = True
            error: Exception = OperationTimeoutError(message="Send operation timed out")
        except _Refused as refused:
            error = _mapped(sdk_sender, refused.error, check)
            if not error._retryable:  # type: ignore[attr-defined]
                raise error from None
        except _LinkLost as lost:
            unknown = unknown or lost.on_the_wire
            error = _mapped(sdk_sender, lost.error, check)
            io.reset(sdk_sender, lost.handler)
            if not reconnected:  # the one reconnect, shared: every send on the link goes again at once
                reconnected = True
                continue
            if not error._retryable:  # type: ignore[attr-defined]
                raise _marked(error, unknown) from None
        except Exception as exc:  # noqa: BLE001 - opening or writing failed: the SDK's handling, under the lock
            with io:  # the handler is the one this thread opened or wrote on, still current: the SDK closes it
                error = sdk_sender._handle_exception(exc)  # raises when the error is not retryable
            if check is not None:
                check(error)
        retried += 1
        if retried > config.retry_total:
            raise _marked(error, unknown)
        sdk_sender._backoff(retried_times=retried, last_exception=error)


def _mapped(sdk_sender: Any, error: BaseException, check: Callable[[BaseException], None] | None) -> Exception:
    """``error`` (pyamqp's) as the SDK maps it to a ``ServiceBusError``, without closing anything."""
    mapped: Exception = sdk_sender._amqp_transport.create_servicebus_exception(
        _LOGGER, error, custom_endpoint_address=sdk_sender._config.custom_endpoint_address)
    if check is not None:
        check(mapped)
    return mapped


def _marked(error: Exception, unknown: bool) -> Exception:
    if unknown:
        mark_outcome_unknown(error)
    return error


def _attempt(sdk_sender: Any, io: SenderIo, batch: Any, timeout: float | None) -> None:
    """One attempt: open the sender if needed, write the transfer (now, not at the pump's next wake), wait until
    ``timeout`` for its disposition, which the sender's pump thread reads (:meth:`SenderIo.track`). Raises
    :class:`_Refused`, :class:`_LinkLost` or :class:`_Unsettled` for what happened to the delivery; an error in
    opening or writing as it comes."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with io:
        if sdk_sender._shutdown.is_set():
            raise SenderClosed
        sdk_sender._open(timeout)
        handler = sdk_sender._handler
        delivery = _Delivery(sdk_sender, handler, BatchMessage(*batch._message),
                             None if timeout is None else time.time() + timeout)
        link = handler._link
        if link is None or link.get_state() != _ATTACHED:
            # the link died while no send was waiting on it (nobody read its detach until now)
            raise _LinkLost(handler, _link_error(handler) or MessageException(
                condition=ErrorCondition.ClientError, description="Send failed - link not attached."), False)
        delivery.pending = handler._transfer_message(delivery, timeout or 0)
        link.update_pending_deliveries()  # the transfer goes on the wire now
        io.track(delivery)
    try:
        while not delivery.wake.wait(_POLL if deadline is None else max(0.0, min(_POLL, deadline - time.monotonic()))):
            if deadline is not None and time.monotonic() >= deadline:
                io.pump_now(handler)  # its answer may be there, unread while another thread held the lock
                if not delivery.wake.is_set():
                    raise _Unsettled
    finally:
        io.untrack(delivery)
    if delivery.failure is not None:
        raise _LinkLost(handler, _link_error(handler) or delivery.failure, delivery.on_the_wire)
    if delivery.state in (MessageDeliveryState.Error, MessageDeliveryState.Cancelled, MessageDeliveryState.Timeout):
        error = delivery.error
        if delivery.reason == _NOT_DELIVERED:
            # the link dropped it (a detach, a discarded session): the link's error, not "unknown-error"
            raise _LinkLost(handler, _link_error(handler) or error or MessageException(
                condition=ErrorCondition.ClientError, description="Send failed - link detached."), delivery.on_the_wire)
        if isinstance(error, TimeoutError):
            raise _Unsettled from error
        if error is None:
            error = MessageException(condition=ErrorCondition.UnknownError, description="Send failed.")
        if getattr(error, "condition", None) in _LINK_CONDITIONS:
            # refused because its link or connection is being closed (written before the detach was read)
            raise _LinkLost(handler, error, True)
        raise _Refused(error)


def _link_error(handler: Any) -> BaseException | None:
    """The error ``handler``'s link or connection failed with (a detach's condition and description), if any."""
    link = getattr(handler, "_link", None)
    error = getattr(link, "_error", None)
    if error is None:
        connection = getattr(handler, "_connection", None)
        error = getattr(connection, "_error", None)
    return error if isinstance(error, BaseException) else None
