"""The send-availability core: the paired sender and its retry policy (its shared health state lives in
:mod:`spark_sb.bus.health`, re-exported here). No Spark import anywhere below this package."""

from __future__ import annotations

from ..bus import EntityState, HealthBoard
from .retry import ConstantBackoff, ExponentialBackoff, NoBackoff, Retry
from .sender import PRIMARY, PairedSender, SendResult

__all__ = [
    "PRIMARY",
    "ConstantBackoff",
    "EntityState",
    "ExponentialBackoff",
    "HealthBoard",
    "NoBackoff",
    "PairedSender",
    "Retry",
    "SendResult",
]
