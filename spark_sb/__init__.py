"""spark-sb: keep Spark pipelines sending to Azure Service Bus through namespace outages."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
