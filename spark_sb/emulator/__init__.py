"""A local Azure Service Bus that the unmodified azure-servicebus SDK talks to.

Imports nothing from the rest of spark_sb but the leaf :mod:`spark_sb.durations`.
"""

from __future__ import annotations

from .amqp import FAULT_KINDS
from .server import (
    DEFAULT_NAMESPACES,
    Emulator,
    EmulatorProcess,
    NamespaceInfo,
    NamespaceOptions,
    fault,
    heal,
)

__all__ = [
    "DEFAULT_NAMESPACES",
    "Emulator",
    "EmulatorProcess",
    "FAULT_KINDS",
    "NamespaceInfo",
    "NamespaceOptions",
    "fault",
    "heal",
]
