"""The send-availability core: the paired sender, its shared health state and its retry policy. No Spark
import anywhere below this package."""

from __future__ import annotations

from .health import EntityState, HealthBoard
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
