"""spark-sb: keep Spark pipelines sending to Azure Service Bus through namespace outages."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["PairedSink", "__version__", "register"]


def __getattr__(name: str) -> Any:
    # the sink imports pyspark: loaded on first use only, so that the paired core runs without Spark
    if name == "PairedSink":
        from .sink import PairedSink

        return PairedSink
    if name == "register":  # registers the servicebus-backlog streaming source with a SparkSession
        from .source import register

        return register
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
