"""The dead-letter round trip's last step: remove exactly the dead-lettered messages that were sent again.

A notebook reads a dead-letter queue in batch (``spark.read.format("servicebus")`` with ``entity:
orders/$DeadLetterQueue``: a peek, nothing taken away), fixes the rows it wants, writes them back to the entity,
and then calls :func:`remove` with the sequence numbers of the rows it resent::

    resent = [r.sequence_number for r in fixed.select("sequence_number").collect()]
    spark_sb.dead_letters.remove("conf/local.yaml", "orders", resent)

Service Bus fetches a dead-lettered message only by receiving it (a sequence number fetches deferred messages
only), so :func:`remove` receives the dead-letter queue in peek-lock, in sequence-number order, and completes the
messages it was given. It holds the lock of every other one it received until it stops (as soon as it has them
all or has passed the highest one), then gives them back (abandon: available again at once, the delivery count one
higher): a message given back at once would be the next one received. Locks last the entity's lock duration
(60 s by default), so a pass over a long dead-letter queue before the wanted messages is bounded by that. Nothing is removed
that was not asked for; a message asked for that is not there (removed already, or locked by another receiver)
is reported in :attr:`Removed.missing`, never an error: calling it twice removes nothing more.

Spark-free: it runs on the driver, through the process's namespaces (:mod:`spark_sb.bus`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .bus import shared_namespace
from .config import DEAD_LETTER_SUFFIX, SparkSbConfig, entity_path, load_config, split_dead_letter
from .errors import ConfigError, as_spark_sb_error

_LOGGER = logging.getLogger(__name__)

__all__ = ["Removed", "remove"]

#: messages per receive
_PAGE = 250


@dataclass(frozen=True)
class Removed:
    """What :func:`remove` did: the sequence numbers it removed, and those asked for that were not there."""

    removed: tuple[int, ...]
    missing: tuple[int, ...]

    def __str__(self) -> str:
        return f"removed {len(self.removed)}, not found {len(self.missing)}"


def remove(conf: str | os.PathLike[str] | Mapping[str, Any] | SparkSbConfig, entity: str,
           sequence_numbers: Iterable[int], *, namespace: Literal["primary", "secondary"] = "primary",
           receive_wait: float = 1.0) -> Removed:
    """Remove the messages with these sequence numbers from the dead-letter queue of ``entity`` (a queue or
    ``topic/subscriptions/name``; its ``/$DeadLetterQueue`` may be written or not) on ``namespace``.
    ``receive_wait``: seconds a receive waits for the next message before the queue counts as read through."""
    config = load_config(conf)
    if namespace not in ("primary", "secondary"):
        raise ConfigError("namespace", "must be primary or secondary", namespace)
    base = entity_path(split_dead_letter(str(entity).strip())[0])
    path = base + DEAD_LETTER_SUFFIX
    try:
        wanted = {int(n) for n in sequence_numbers}
    except (TypeError, ValueError) as err:
        raise ConfigError("sequence_numbers", f"must be integers ({err})") from None
    if not wanted:
        return Removed((), ())
    highest = max(wanted)
    removed: list[int] = []
    held: list[Any] = []
    bus = shared_namespace(config, namespace)
    try:
        with bus.receiver(path) as receiver:
            try:
                while wanted:
                    page = receiver.receive_messages(max_message_count=_PAGE, max_wait_time=receive_wait)
                    if not page:
                        break
                    for message in page:
                        number = int(message.sequence_number)
                        if number in wanted:
                            receiver.complete_message(message)
                            wanted.discard(number)
                            removed.append(number)
                        else:
                            held.append(message)
                    if int(page[-1].sequence_number) >= highest:
                        break
            finally:
                _give_back(receiver, held)
    except Exception as exc:
        where = f"{namespace} {getattr(config, namespace).fully_qualified_namespace}"
        converted = as_spark_sb_error(exc, namespace=where, entity=path)
        _LOGGER.error("removing dead-lettered messages of %r on the %s stopped after %d removed: %s", base, where,
                      len(removed), type(exc).__name__)
        if converted is None:
            raise
        raise converted from exc
    result = Removed(tuple(sorted(removed)), tuple(sorted(wanted)))
    _LOGGER.info("dead-letter queue of %r on the %s: %s (%d others received and given back)", base, namespace,
                 result, len(held))
    return result


def _give_back(receiver: Any, held: list[Any]) -> None:
    """Abandon the messages received and not asked for; one whose lock is lost is available again anyway."""
    for message in held:
        try:
            receiver.abandon_message(message)
        except Exception as exc:  # noqa: BLE001 - its lock expires: available again, nothing lost
            _LOGGER.warning("giving back dead-lettered message %s failed (%s); it is available again when its "
                            "lock expires", message.sequence_number, type(exc).__name__)
