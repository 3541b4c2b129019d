"""Azure Service Bus's limits as the emulator plays them, per namespace (:class:`~spark_sb.emulator.NamespaceOptions`).

- **Connections**: at most ``max_connections`` (the service: 5,000) concurrent connections per namespace, every
  transport counted (AMQP, AMQPS, ws, wss); a connection counts from its TCP accept to its close. The next one is
  answered with an AMQP ``open`` and closed with ``amqp:resource-limit-exceeded`` (:func:`connections_text`).
- **Receivers**: at most ``max_receivers`` (the service: 5,000 concurrent receive requests) receiver links attached
  to one queue or subscription at once; the next attach is refused with ``amqp:resource-limit-exceeded``
  (:func:`receivers_text`).
- **Throttling**: ``ops_per_second`` (off by default: the service's rate depends on its tier) fills a
  :class:`TokenBucket` per namespace. Each message sent costs one token (a batch of k: k), each ``$management``
  request one, each message delivered to a receiver one. A send or a management request that finds the bucket
  empty (at or below zero) is refused with ``com.microsoft:server-busy`` (:func:`busy_text`); one that finds it
  positive is admitted whatever it costs (the bucket goes below zero, so the long-run rate is exactly the rate).
  Deliveries are never refused: they wait until the bucket is positive again.
- **Entities and rules** (the service's Standard and Premium quotas): at most ``max_entities`` queues and topics
  in a namespace (10,000), ``max_subscriptions`` subscriptions on a topic (2,000) and ``max_sql_filters`` SQL
  filters on a topic (2,000: a SQL, true or false filter, ``$Default`` included, across all its subscriptions;
  correlation filters are not counted). The next create is refused with ``amqp:resource-limit-exceeded`` (the
  admin API: 403) naming the limit (:func:`entities_text`, :func:`subscriptions_text`, :func:`sql_filters_text`).
- **Entity size**: ``max_size_in_megabytes`` counts each stored message at its encoded size (what the service
  counts, headers and properties included) plus :data:`STORED_MESSAGE_OVERHEAD` (the in-memory store:
  :data:`MEMORY_STORE_MESSAGE_OVERHEAD`), what its copy costs the emulator's memory, so the quota bounds the
  memory; ``SizeInBytes`` still reports the encoded sizes alone, as the service does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

#: the service's limits: concurrent connections per namespace, concurrent receivers per queue or subscription
DEFAULT_MAX_CONNECTIONS = 5000
DEFAULT_MAX_RECEIVERS = 5000
#: the service's limits: queues and topics per namespace, subscriptions per topic, SQL filters per topic
DEFAULT_MAX_ENTITIES = 10000
DEFAULT_MAX_SUBSCRIPTIONS = 2000
DEFAULT_MAX_SQL_FILTERS = 2000
#: what a stored message costs the emulator's memory besides its encoded bytes, counted against an entity's
#: max_size_in_megabytes (the service counts the encoded size alone): measured with 50,000 one-byte messages sent
#: by the SDK, 556 bytes each in all with the SQLite store (62 of them encoded), 833 with the in-memory store,
#: which keeps a copy of every message (:attr:`spark_sb.emulator.store.Store.message_overhead`)
STORED_MESSAGE_OVERHEAD = 512
MEMORY_STORE_MESSAGE_OVERHEAD = 800


class TokenBucket:
    """Refilled at ``rate`` tokens a second, holding at most ``rate`` (one second's worth); starts full. Its clock is
    monotonic, whatever clock the broker follows (tests that drive message expiry do not drive the rate)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0:
            raise ValueError(f"the rate must be positive, got {rate!r}")
        self.rate = float(rate)
        self._clock = clock
        self._tokens = self.rate
        self._at = clock()

    def tokens(self) -> float:
        """The tokens it holds now (below zero after an admitted operation cost more than it held)."""
        now = self._clock()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
        self._at = now
        return self._tokens

    def take(self, cost: int) -> float | None:
        """Admit an operation of ``cost`` tokens when the bucket holds any (None); else take nothing and return the
        seconds until it holds some again."""
        tokens = self.tokens()
        if tokens > 0:
            self._tokens -= cost
            return None
        return -tokens / self.rate

    def charge(self, cost: int) -> None:
        """Take ``cost`` tokens whatever the bucket holds (what was delivered because it held some)."""
        self.tokens()
        self._tokens -= cost


def busy_text(namespace: str, wait: float) -> str:
    """The service's words for a throttled request; ``wait``: seconds until the bucket is positive again (said
    rounded up, at least 1)."""
    seconds = max(1, math.ceil(wait))
    return (f"The request was terminated because the namespace '{namespace}' is being throttled. Error code : 50002. "
            f"Please wait {seconds} seconds and try again.")


def connections_text(namespace: str, limit: int) -> str:
    return (f"Cannot open a new connection: the namespace '{namespace}' already has {limit} concurrent connections, "
            f"its maximum (max-connections). Close connections or lower the number of clients.")


def entities_text(path: str, namespace: str, limit: int) -> str:
    return (f"Cannot create '{path}': the namespace '{namespace}' already has {limit} queues and topics, its maximum "
            f"(max-entities; Service Bus allows 10,000 per namespace).")


def subscriptions_text(path: str, topic: str, limit: int) -> str:
    return (f"Cannot create the subscription '{path}': the topic '{topic}' already has {limit} subscriptions, its "
            f"maximum (max-subscriptions; Service Bus allows 2,000 per topic).")


def sql_filters_text(what: str, topic: str, limit: int) -> str:
    return (f"Cannot create {what}: the topic '{topic}' would have more than {limit} SQL filters, its maximum "
            f"(max-sql-filters; Service Bus allows 2,000 SQL filters per topic).")


def receivers_text(entity: str, limit: int) -> str:
    return (f"Cannot attach a receiver to '{entity}': it already has {limit} concurrent receivers, its maximum "
            f"(max-receivers). Close receivers or lower the number of clients.")
