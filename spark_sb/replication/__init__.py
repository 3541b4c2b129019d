"""Active and passive replication (behaviour.md, "Active and passive replication"): the sender that writes to
both namespaces (:class:`ReplicatingSender`) and the plain-Python receiver that reads both and suppresses the
second copy of a message (:class:`DedupeReceiver`). Spark-free: nothing below this package imports pyspark.

For Spark, the receiving side is ``spark.readStream.format("servicebus")`` over both namespaces followed by
:func:`spark_sb.dedupe`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..errors import ReplicationError

_EXPORTS = {
    "ReplicatingSender": ".sender",
    "ReplicationResult": ".sender",
    "DedupeReceiver": ".dedupe",
    "ReceiveUnavailableError": ".dedupe",
}

__all__ = ["DedupeReceiver", "ReceiveUnavailableError", "ReplicatingSender", "ReplicationError", "ReplicationResult"]

if TYPE_CHECKING:
    from .dedupe import DedupeReceiver, ReceiveUnavailableError
    from .sender import ReplicatingSender, ReplicationResult


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
