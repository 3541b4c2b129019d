"""What ``spark-sb status`` and ``spark-sb provision`` find on the two namespaces.

``status`` answers the first question of an outage: can each namespace be reached, and if not, why (the host,
the refusal or the network error, on one line, no secret); what state the primary's entities are in (those the
configuration names, and those whose messages sit in the backlog); what each backlog queue holds. Every request
is bounded by its namespace's ``admin_timeout``, administration (HTTP) and AMQP alike, and is made once (no SDK
retry): a rejected credential is reported at once.

Exit status (:data:`EXIT_OK`, :data:`EXIT_UNREACHABLE`, :data:`EXIT_CONFIGURATION`): 0 when both namespaces
answered and accepted the credential; 1 when a namespace could not be reached (connection refused, host not found,
no answer within ``admin_timeout``, connection closed) or answered with an error (busy); 2 for a configuration
problem: the configuration file itself, a credential a namespace refused, or an entity the configuration names
(or that backlog messages are bound for) that the primary does not have. 2 wins over 1.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from azure.core.exceptions import ResourceNotFoundError
from azure.servicebus import ServiceBusMessageState

from . import bus
from .admin import admin_endpoint_of
from .bus.deferred import PAGE
from .config import NamespaceConfig, SparkSbConfig
from .errors import ConfigError, ErrorClass, _causes, classify, is_unanswered, redact, unreachable_reason
from .messages import parked_session

__all__ = ["EXIT_CONFIGURATION", "EXIT_OK", "EXIT_UNREACHABLE", "Problem", "describe", "provision", "status"]

#: every namespace answered and accepted the credential
EXIT_OK = 0
#: a namespace could not be reached, or answered with an error
EXIT_UNREACHABLE = 1
#: the configuration: the file, a refused credential, an entity the primary does not have
EXIT_CONFIGURATION = 2

#: what an AMQP request may take beyond its own timeout before it counts as unanswered (the SDK does not bound
#: opening a connection: an endpoint that accepts and never answers would hold it for ever)
_GRACE = 2.0
_PROBE_QUEUE = "spark-sb-status-probe"

Kind = Literal["credential", "configuration", "not-found", "unreachable", "error"]
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Problem:
    """What went wrong with one request: its kind and the detail (the status and the service's words, or the
    network error), on one line, no secret."""

    kind: Kind
    detail: str

    @property
    def exit_code(self) -> int:
        return EXIT_CONFIGURATION if self.kind in ("credential", "configuration", "not-found") else EXIT_UNREACHABLE

    @property
    def text(self) -> str:
        """The problem on its own: ``refused the credential (401 ...)``, ``connection refused``..."""
        if self.kind == "credential":
            return f"refused the credential ({self.detail})"
        if self.kind == "error":
            return f"answered with an error ({self.detail})"
        return self.detail

    def at(self, surface: str) -> str:
        """The problem of a request to ``surface`` (``administration API http://...``, ``AMQP host:port``)."""
        if self.kind in ("credential", "error"):
            return f"{surface} said {self.detail}"
        return f"{surface}: {self.detail}"


class _Unanswered(TimeoutError):
    """An AMQP request still running after its bound (its thread is left behind, a daemon)."""


# --- saying what went wrong --------------------------------------------------------------------------------

_NETWORK_WORDS = (
    (re.compile(r"(?i)connection refused|errno 111\b|actively refused"), "connection refused"),
    (re.compile(r"(?i)name or service not known|nodename nor servname|getaddrinfo failed|failed to resolve|"
                r"name resolution|no address associated"), "host not found"),
    (re.compile(r"(?i)certificate verify failed|ssl"), "TLS handshake failed"),
    (re.compile(r"(?i)reset by peer|connection aborted|remote end closed|remotedisconnected|broken pipe|"
                r"eof occurred|connection closed|unexpected eof|unexpectedly closed"),
     "the connection was closed without an answer"),
    (re.compile(r"(?i)timed? ?out"), "no answer in time"),
)


def _status_code(exc: BaseException) -> int | None:
    for link in _causes(exc):
        for name in ("status_code", "_status_code"):
            value = getattr(link, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        found = re.search(r"Status [Cc]ode: (\d{3})", str(link))
        if found:
            return int(found.group(1))
    return None


def _detail(exc: BaseException) -> str:
    """The service's own words: an administration error's ``<Detail>``, a CBS refusal's ``Description:``, else
    the first line of the deepest message that says something."""
    texts = [str(link) for link in _causes(exc)]
    for text in texts:
        found = re.search(r"<Detail>(.*?)</Detail>", text, re.DOTALL) or re.search(r"Description: ([^\n]+)", text)
        if found:
            return found.group(1).strip()
    lines = [text.strip().splitlines()[0] for text in texts if text.strip()]
    return lines[-1] if lines else type(exc).__name__


def _network_reason(exc: BaseException) -> str | None:
    reason = unreachable_reason(exc)
    if reason is not None:
        return reason
    text = " | ".join(f"{type(link).__name__}: {link}" for link in _causes(exc))
    return next((words for pattern, words in _NETWORK_WORDS if pattern.search(text)), None)


def describe(exc: BaseException, timeout: float | None = None) -> Problem:
    """``exc`` of one request as a :class:`Problem`: a refused credential (with the status and the service's
    words), an entity not found, an endpoint that could not be reached (and why), or another error."""
    if isinstance(exc, _Unanswered):
        return Problem("unreachable", str(exc))
    if isinstance(exc, ConfigError):  # e.g. a connection_verify file this machine does not have
        return Problem("configuration", str(exc))
    error_class = classify(exc)
    status = _status_code(exc)
    shown = f"{status} " if status else ""
    if error_class is ErrorClass.CONFIGURATION_CREDENTIAL:
        return Problem("credential", redact(f"{shown}{_detail(exc)}"))
    if error_class is ErrorClass.CONFIGURATION_NOT_FOUND:
        return Problem("not-found", "not found")
    reason = _network_reason(exc)
    if reason is not None and (is_unanswered(exc) or status is None):
        if reason.startswith("no answer") and timeout is not None:
            reason = f"no answer within {timeout:g} s (admin_timeout)"
        return Problem("unreachable", reason)
    if error_class is ErrorClass.THROTTLED:
        return Problem("error", redact(f"busy: {shown}{_detail(exc)}"))
    return Problem("error", redact(f"{shown}{_detail(exc)}"))


def _bounded(work: Callable[[], T], seconds: float, what: str) -> T:
    """``work()`` in a daemon thread: its value or its error, or :class:`_Unanswered` after ``seconds``."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="spark-sb-status", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise _Unanswered(f"no answer within {seconds:g} s ({what})")
    if "error" in outcome:
        raise outcome["error"]
    value: T = outcome["value"]
    return value


# --- one namespace -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Namespace:
    """What was learnt of one namespace: over its administration API and over AMQP."""

    side: str
    config: NamespaceConfig
    admin: Problem | None = None
    amqp: Problem | None = None
    amqp_tried: bool = False

    @property
    def address(self) -> str:
        return self.config.fully_qualified_namespace

    @property
    def admin_endpoint(self) -> str:
        cs = self.config.connection_string
        return admin_endpoint_of(None if cs is None else cs.reveal(), self.config.fully_qualified_namespace,
                                 self.config.admin_endpoint, use_tls=not self.config.is_emulator)

    @property
    def timeout(self) -> float:
        return self.config.admin_timeout_seconds

    @property
    def admin_answered(self) -> bool:
        return self.admin is None or self.admin.kind == "not-found"

    def problems(self) -> list[Problem]:
        return [p for p in (self.admin, self.amqp) if p is not None and p.kind != "not-found"]

    def line(self) -> str:
        """``primary localhost:5672: unreachable (administration API http://localhost:5300: connection refused;
        AMQP localhost:5672: connection refused)``: one line, no secret."""
        problems = self.problems()
        surfaces = [(f"administration API {self.admin_endpoint}", self.admin)]
        if self.amqp_tried:
            surfaces.append((f"AMQP {self._amqp_address()}", self.amqp))
        if not problems:
            return f"{self.side} {self.address}: reachable ({' and '.join(name for name, _ in surfaces)} answered)"
        parts = [f"{name}: answered" if problem is None or problem.kind == "not-found" else problem.at(name)
                 for name, problem in surfaces]
        return f"{self.side} {self.address}: {self.headline()} ({'; '.join(parts)})"

    def headline(self) -> str:
        """``reachable``, ``refused the credential``, ``misconfigured``, ``unreachable`` or ``answered with an
        error``."""
        kinds = {p.kind for p in self.problems()}
        return ("refused the credential" if "credential" in kinds else "misconfigured" if "configuration" in kinds
                else "unreachable" if "unreachable" in kinds else "answered with an error" if kinds else "reachable")

    def _amqp_address(self) -> str:
        custom = self.config.custom_endpoint_address
        return custom.removeprefix("sb://") if custom else self.address

    def admin_call(self, work: Callable[[Any], T]) -> T | None:
        """``work(admin client)``, once, bounded by ``admin_timeout``; None (and :attr:`admin` says why) when it
        failed. A client that cannot be built is a configuration problem."""
        try:
            client = bus.admin_client(self.config, retry_total=0)
        except ValueError as exc:
            self.admin = Problem("configuration", redact(f"no administration client could be built: {exc}"))
            return None
        try:
            return work(client)
        except Exception as exc:
            self.admin = describe(exc, self.timeout)
            return None
        finally:
            client.close()


class _Amqp:
    """One ``ServiceBusClient`` of a namespace, without SDK retries; every request bounded by ``admin_timeout``
    (its own operation timeout, and a thread that gives up on it shortly after)."""

    def __init__(self, namespace: _Namespace) -> None:
        self.namespace = namespace
        self.timeout = namespace.timeout
        self.client: Any = None
        self.hung = False

    def __enter__(self) -> _Amqp:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.client is not None and not self.hung:
            try:
                _bounded(self.client.close, self.timeout + _GRACE, "closing")
            except Exception:  # noqa: BLE001,S110 - nothing more to learn from it
                pass

    def _call(self, work: Callable[[], T]) -> T:
        if self.hung:
            raise _Unanswered(f"no answer within {self.timeout + _GRACE:g} s")
        try:
            return _bounded(work, self.timeout + _GRACE, f"admin_timeout {self.timeout:g} s, and {_GRACE:g} s more")
        except _Unanswered:
            self.hung = True
            raise

    def peek_queue(self, queue: str, *, whole: bool) -> list[Any]:
        """The messages of ``queue``: every one (``whole``, a page of :data:`PAGE` per request) or the first.
        Raises what the namespace said; each request bounded."""
        if self.client is None:
            self.client = self.namespace.config.client(retry_total=0)
        receiver = self.client.get_queue_receiver(queue, prefetch_count=0)
        found: list[Any] = []

        def page_from(start: int) -> list[Any]:
            return list(receiver.peek_messages(max_message_count=PAGE if whole else 1, sequence_number=start,
                                               timeout=self.timeout))

        try:
            start = 1  # not 0: the SDK reads 0 as "after the last message this receiver saw"
            while True:
                page = self._call(functools.partial(page_from, start))
                found.extend(page)
                if not page or not whole:
                    return found
                start = int(page[-1].sequence_number or 0) + 1
        finally:
            if not self.hung:
                try:
                    self._call(receiver.close)
                except Exception:  # noqa: BLE001,S110 - what was asked is answered
                    pass

    def probe(self, queue: str) -> None:
        """Reach the namespace over AMQP with a peek of ``queue`` (an entity it does not have is an answer)."""
        self.namespace.amqp_tried = True
        try:
            self.peek_queue(queue, whole=False)
        except Exception as exc:
            self.namespace.amqp = describe(exc, self.timeout)


# --- status ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Backlog:
    """The secondary's backlog queues: runtime properties, deferred counts, destinations of what they hold."""

    found: dict[str, Any] = dataclasses.field(default_factory=dict)
    deferred: dict[str, int] = dataclasses.field(default_factory=dict)
    destinations: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    unread: dict[str, Problem] = dataclasses.field(default_factory=dict)


def _secondary_side(config: SparkSbConfig, ns: _Namespace) -> _Backlog:
    sa = config.send_availability
    wanted = sa.backlog_queue_names()
    backlog = _Backlog()

    def listing(client: Any) -> dict[str, Any]:
        return {props.name: props for props in client.list_queues_runtime_properties()
                if props.name in wanted or props.name.startswith(f"{sa.backlog_prefix}/")}

    backlog.found = ns.admin_call(listing) or {}
    holding = [name for name in wanted if name in backlog.found
               and (backlog.found[name].total_message_count or 0) > (backlog.found[name].dead_letter_message_count or 0)]
    with _Amqp(ns) as amqp:
        amqp.probe(wanted[0])
        for name in holding:
            if ns.amqp is not None and ns.amqp.kind != "not-found":
                backlog.unread[name] = ns.amqp
                continue
            try:
                messages = amqp.peek_queue(name, whole=True)
            except Exception as exc:
                backlog.unread[name] = describe(exc, ns.timeout)
                continue
            backlog.deferred[name] = sum(1 for m in messages if m.state == ServiceBusMessageState.DEFERRED)
            for message in messages:
                entity = parked_session(message)[0]
                if entity:
                    backlog.destinations[entity] += 1
    return backlog


@dataclasses.dataclass
class _Entity:
    name: str
    why: list[str]
    kind: str = "?"
    status: str = "unknown"
    active: str = "-"
    dead_letter: str = "-"
    problem: Problem | None = None


def _entity_state(ns: _Namespace, entity: _Entity) -> None:
    """Fill ``entity`` from the primary's administration API: a queue, else a topic, else not found. A failure
    of the namespace itself (unreachable, a refused credential) leaves it unknown and :attr:`_Namespace.admin`
    says why; an error answered for this entity alone is the entity's."""

    def ask(client: Any) -> None:
        try:
            queue = client.get_queue(entity.name)
            runtime = client.get_queue_runtime_properties(entity.name)
        except (ResourceNotFoundError, AttributeError, TypeError):  # the SDK reads a topic's entry as no queue
            pass
        else:
            entity.kind, entity.status = "queue", str(queue.status or "Active")
            entity.active = str(runtime.active_message_count)
            entity.dead_letter = str(runtime.dead_letter_message_count)
            return
        try:
            topic = client.get_topic(entity.name)
            runtime = client.get_topic_runtime_properties(entity.name)
        except (ResourceNotFoundError, AttributeError, TypeError):
            entity.kind, entity.status = "-", "not found"
            entity.problem = Problem("not-found", f"{entity.name}: not found on the primary {ns.address}")
            return
        entity.kind, entity.status = "topic", str(topic.status or "Active")
        entity.active = f"{runtime.subscription_count} subscriptions"

    def ask_entity(client: Any) -> None:
        try:
            ask(client)
        except Exception as exc:
            problem = describe(exc, ns.timeout)
            if problem.kind != "error":
                raise
            entity.status = "error"
            entity.problem = Problem("error", f"{entity.name}: the primary {ns.address} {problem.text}")

    ns.admin_call(ask_entity)


def _primary_side(config: SparkSbConfig, ns: _Namespace, entities: list[_Entity]) -> None:
    ns.admin_call(lambda client: client.get_namespace_properties())
    for entity in entities:
        if ns.admin is not None:
            break
        _entity_state(ns, entity)
    queue = next((e.name for e in entities if e.kind == "queue"), _PROBE_QUEUE)
    with _Amqp(ns) as amqp:
        amqp.probe(queue)


def _configured_entities(config: SparkSbConfig) -> dict[str, list[str]]:
    named: dict[str, list[str]] = {}
    if config.sink.entity:
        named.setdefault(config.sink.entity, []).append("sink.entity")
    cs = config.primary.connection_string
    if cs is not None and cs.entity_path:
        named.setdefault(cs.entity_path, []).append("primary EntityPath")
    return named


def _table(rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join((cell.rjust(w) if r else cell.ljust(w)) for cell, w, r in zip(row, widths, right, strict=True))
            .rstrip() for row in rows]


def status(config: SparkSbConfig, out: Callable[[str], None], err: Callable[[str], None]) -> int:
    """``spark-sb status``: print what both namespaces say; return the exit status."""
    primary = _Namespace("primary", config.primary)
    secondary = _Namespace("secondary", config.secondary)
    named = _configured_entities(config)
    entities = [_Entity(name, why) for name, why in named.items()]
    with ThreadPoolExecutor(2, thread_name_prefix="spark-sb-status") as pool:
        backlog_future = pool.submit(_secondary_side, config, secondary)
        primary_future = pool.submit(_primary_side, config, primary, entities)
        backlog = backlog_future.result()
        primary_future.result()
    for name in sorted(set(backlog.destinations) - set(named)):
        entity = _Entity(name, ["in the backlog"])
        entities.append(entity)
        if primary.admin is None:
            _entity_state(primary, entity)
    for entity in entities:
        if entity.name in backlog.destinations and "in the backlog" not in entity.why:
            entity.why.append("in the backlog")

    width = len("secondary")
    for ns in (primary, secondary):
        out(ns.line().replace(f"{ns.side} ", f"{ns.side:<{width}} ", 1))

    out("")
    if entities:
        rows = [["primary entity", "kind", "status", "active", "dead-letter", "in the backlog", "why"]]
        for entity in entities:
            status_text = entity.status
            if entity.status == "unknown" and not primary.admin_answered:
                status_text = f"unknown (primary {primary.headline()})"
            rows.append([entity.name, entity.kind, status_text, entity.active, entity.dead_letter,
                         str(backlog.destinations.get(entity.name, 0)), ", ".join(entity.why)])
        for line in _table(rows, [False, False, False, True, True, True, False]):
            out(line)
    else:
        out("primary entity: none named by the configuration (sink.entity) and none in the backlog")
    out("")

    sa = config.send_availability
    wanted = sa.backlog_queue_names()
    found = backlog.found
    if config.replication.replicating:
        out(f"backlog queues: none used (replication mode {config.replication.mode}: the secondary holds the same "
            "entities)")
    elif not secondary.admin_answered:
        out(f"backlog queues: not known (the secondary's administration API: {secondary.admin.text})"
            if secondary.admin is not None else "backlog queues: not known")
    else:
        rows = [["backlog queue", "active", "deferred", "dead-letter", ""]]
        for name in wanted + sorted(set(found) - set(wanted)):
            props = found.get(name)
            if props is None:
                rows.append([name, "missing", "-", "-", ""])
            elif name in wanted:
                note = f"(not read: {backlog.unread[name].text})" if name in backlog.unread else ""
                rows.append([name, str(props.active_message_count), str(backlog.deferred.get(name, 0))
                             if name not in backlog.unread else "?", str(props.dead_letter_message_count), note])
            else:
                rows.append([name, str(props.active_message_count), "-", str(props.dead_letter_message_count),
                             "(not a backlog queue of this configuration: never used)"])
        for line in _table(rows, [False, True, True, True, False]):
            out(line)
        if any(backlog.deferred.values()):
            out("")
            out("deferred (counted in active): set aside by a syphon job, which reads them back by sequence "
                "number; left by a job that died, they wait for its next run or Syphon.drain() to take them back")

    unread = {name: p for name, p in backlog.unread.items() if p is not secondary.amqp}
    problems = [*primary.problems(), *secondary.problems(), *(e.problem for e in entities if e.problem),
                *unread.values()]
    if not problems:
        return EXIT_OK
    for ns in (primary, secondary):
        if ns.problems():
            err(f"spark-sb status: {ns.line()}")
    for entity in entities:
        if entity.problem is not None:
            err(f"spark-sb status: {entity.problem.text} ({', '.join(entity.why)})")
    for name, problem in unread.items():
        err(f"spark-sb status: backlog queue {name} could not be read: {problem.text}")
    return max(p.exit_code for p in problems)


# --- provision ---------------------------------------------------------------------------------------------


def provision(source: Any, out: Callable[[str], None], err: Callable[[str], None]) -> int:
    """``spark-sb provision``: pair (create the missing backlog queues on the secondary) and say what it made,
    what was there already and what is left out; return the exit status."""
    from .paired import PairedSender

    with PairedSender.from_config(source) as sender:
        config = sender.config
        sa = config.send_availability
        wanted = sa.backlog_queue_names()
        ns = _Namespace("secondary", config.secondary)
        where = f"the secondary {ns.address} (administration API {ns.admin_endpoint})"

        def listing(client: Any) -> dict[str, str]:
            return {props.name: str(props.status or "Active") for props in client.list_queues()
                    if props.name in wanted}

        before = ns.admin_call(listing)
        if ns.admin is not None and ns.admin.kind in ("credential", "configuration", "unreachable"):
            err(f"spark-sb provision: {ns.line()}")
            return ns.admin.exit_code
        sender.pair()
        usable = list(sender.backlog_queues)
    if before is None:  # the listing was answered with an error; pairing retried it
        out(f"{len(usable)} usable backlog queues on {where}: {', '.join(usable)} (which of them were there "
            f"before is not known: listing them first failed: {ns.admin.text if ns.admin else '?'})")
        return EXIT_OK
    created = [name for name in usable if name not in before]
    there = [name for name in usable if name in before]
    left_out = [name for name in wanted if name in before and name not in usable]
    failed = [name for name in wanted if name not in before and name not in usable]
    line = f"created {len(created)} backlog queues on {where}"
    line += f": {', '.join(created)}" if created else ""
    line += f"; {len(there)} already there" + (f": {', '.join(there)}" if there else "")
    out(line)
    if left_out:
        out(f"left out {len(left_out)} (there, not Active; never modified): "
            + ", ".join(f"{name} ({before[name]})" for name in left_out))
    if failed:
        out(f"could not create {len(failed)} (see the warnings above): {', '.join(failed)}")
    out(f"{len(usable)} of {len(wanted)} backlog queues usable")
    return EXIT_OK
