"""The one owner of the SDK handles of a process: everything that talks to Service Bus goes through it.

* :class:`Namespace`: one namespace's ``ServiceBusClient`` and the senders and receivers it opened, cached per
  entity, rebuilt after a detach without pulling a handle from under a use; pings (:meth:`Namespace.ping`);
* :func:`shared_namespace`: the process-wide :class:`Namespace` of a configuration's primary or secondary;
* :func:`shared` / :func:`close_all`: the process registry of long-lived objects (paired senders, syphons,
  health boards, shared namespaces), closed at interpreter exit; :func:`close_quietly` closes one handle;
* :mod:`spark_sb.bus.health`: per-entity send availability state shared by every sender of a pairing, and
  its background ping task (:mod:`spark_sb.bus.pings`);
* :func:`admin_client`: a ``ServiceBusAdministrationClient`` for a configured namespace.

What an SDK exception means is answered by :mod:`spark_sb.errors` (:func:`~spark_sb.errors.classify` and its
predicates), the only module that inspects SDK exception types or their text. No Spark import here.
"""

from __future__ import annotations

from ._namespace import (
    PING_SCHEDULE_AHEAD,
    SENDER_KWARGS,
    STALE_AFTER,
    Namespace,
    admin_client,
    current_lane,
    send_lane,
    shared_namespace,
)
from ._registry import close_all, close_quietly, entries, shared
from .health import EntityState, HealthBoard, all_boards, entity_key, join_board, shared_board
from .pings import PingTask

__all__ = [
    "PING_SCHEDULE_AHEAD",
    "SENDER_KWARGS",
    "STALE_AFTER",
    "EntityState",
    "HealthBoard",
    "Namespace",
    "PingTask",
    "admin_client",
    "all_boards",
    "close_all",
    "close_quietly",
    "current_lane",
    "entity_key",
    "entries",
    "join_board",
    "send_lane",
    "shared",
    "shared_board",
    "shared_namespace",
]
