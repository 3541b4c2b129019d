"""spark-sb: keep Spark pipelines sending to Azure Service Bus through namespace outages.

The public API. Everything else is internal and may change::

    from spark_sb import PairedSink, PairedSender, Syphon, dedupe, load_config, register
    from spark_sb.replication import ReplicatingSender, DedupeReceiver

Names are loaded on first use, so that ``import spark_sb`` stays cheap and the Spark-free parts (the paired
sender, the syphon core, the configuration) never import pyspark.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

#: the package's version: the one place it is kept (pyproject.toml reads it, ``spark-sb --version`` prints it)
__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "PairedSink": ".sink",  # the foreachBatch sink (Spark)
    "register": ".source",  # registers the servicebus and servicebus-backlog streaming sources (Spark)
    "dedupe": ".source",  # drops the second copy of each message within a window (Spark)
    "PairedSender": ".paired",
    "Syphon": ".syphon",
    "load_config": ".config",
    "SparkSbConfig": ".config",
    "SparkSbError": ".errors",
    "ConfigError": ".errors",
    "ConnectionQuotaError": ".errors",
    "PairingError": ".errors",
    "CredentialRejectedError": ".errors",
    "EntityNotFoundError": ".errors",
    "BadMessageError": ".errors",
    "BadInputError": ".errors",
    "BacklogUnavailableError": ".errors",
    "ReplicationError": ".errors",
    "SourceUnavailableError": ".errors",
    "SyphonSettleError": ".syphon",
    "unwrap": ".errors",  # the spark-sb error behind what Spark raised
}

__all__ = [
    "BacklogUnavailableError",
    "BadInputError",
    "BadMessageError",
    "ConfigError",
    "ConnectionQuotaError",
    "CredentialRejectedError",
    "EntityNotFoundError",
    "PairedSender",
    "PairedSink",
    "PairingError",
    "ReplicationError",
    "SparkSbConfig",
    "SourceUnavailableError",
    "SparkSbError",
    "Syphon",
    "SyphonSettleError",
    "__version__",
    "dedupe",
    "load_config",
    "register",
    "unwrap",
]

if TYPE_CHECKING:
    from .config import SparkSbConfig, load_config
    from .errors import (
        BacklogUnavailableError,
        BadInputError,
        BadMessageError,
        ConfigError,
        ConnectionQuotaError,
        CredentialRejectedError,
        EntityNotFoundError,
        PairingError,
        ReplicationError,
        SourceUnavailableError,
        SparkSbError,
        unwrap,
    )
    from .paired import PairedSender
    from .sink import PairedSink
    from .source import dedupe, register
    from .syphon import Syphon, SyphonSettleError


#: the modules of the Spark edge, which need the ``[spark]`` extra
_SPARK_MODULES = (".sink", ".source")
_SPARK_PACKAGES = ("pyspark", "pyarrow", "pandas", "delta", "py4j")


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        loaded = importlib.import_module(module, __name__)
    except ModuleNotFoundError as err:
        top = (err.name or "").split(".")[0]
        # only a package that is not installed at all calls for the extra; a module missing from an installed
        # Spark is a version gap (spark_sb.capabilities names those), not an install hint
        if module in _SPARK_MODULES and top in _SPARK_PACKAGES and not _installed(top):
            raise ImportError(f"spark_sb.{name} needs Spark: pip install 'spark-sb[spark]' ({err})",
                              name=err.name) from err
        raise
    value = getattr(loaded, name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
