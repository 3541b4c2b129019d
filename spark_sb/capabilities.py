"""What the running Spark offers spark-sb's Spark edge, detected from what pyspark ships (a module that may be
missing), never from its version string; the version only appears in messages.

* Spark 3.5: ``mapInArrow``, so the paired sink; no Python data sources, so neither source nor the syphon job.
* Spark 4.0 and 4.1: Python data sources, whose streaming readers have ``latestOffset()`` without arguments:
  the sources apply ``maxMessagesPerTrigger`` themselves and log the backlog depth, and ``--until-empty`` asks
  the administration API for the depth itself.
* Spark 4.2: admission control (``latestOffset(start, limit)``, read limits), ``reportLatestOffset`` (the depth
  in the query progress) and ``Trigger.AvailableNow`` for Python readers.
"""

from __future__ import annotations

import functools
import logging
from importlib.util import find_spec
from typing import Any

from .errors import UnsupportedSparkError

__all__ = ["admission_control", "python_data_sources", "require_python_data_sources", "spark_version",
           "trigger_available_now", "warn_if_speculating"]

_LOGGER = logging.getLogger(__name__)


def spark_version() -> str:
    """The installed pyspark's version, for messages."""
    try:
        import pyspark
    except ImportError:
        return "(pyspark not installed)"
    return str(getattr(pyspark, "__version__", "(unknown version)"))


def _has(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


@functools.cache
def python_data_sources() -> bool:
    """Whether Spark runs Python data sources (``pyspark.sql.datasource``, Spark 4.0 and later)."""
    return _has("pyspark.sql.datasource")


@functools.cache
def admission_control() -> bool:
    """Whether Python streaming readers get admission control (``latestOffset(start, limit)``, read limits) and
    ``reportLatestOffset`` (``pyspark.sql.streaming.datasource``, Spark 4.2 and later)."""
    return _has("pyspark.sql.streaming.datasource")


@functools.cache
def trigger_available_now() -> bool:
    """Whether Python streaming readers can support ``trigger(availableNow=True)``."""
    if not admission_control():
        return False
    from pyspark.sql.streaming import datasource

    return hasattr(datasource, "SupportsTriggerAvailableNow")


def require_python_data_sources(what: str) -> None:
    """Raise :class:`~spark_sb.errors.UnsupportedSparkError` naming ``what``, the Spark version and what is
    missing when Spark has no Python data sources (Spark 3.5: the sink works there, the sources do not)."""
    if not _has("pyspark"):
        raise ImportError(f"{what} needs Spark: pip install 'spark-sb[spark]', or run it where Spark is installed")
    if not python_data_sources():
        raise UnsupportedSparkError(f"{what} needs Spark 4.0 or later: Spark {spark_version()} has no Python data "
                                    "sources (pyspark.sql.datasource); on Spark 3.5 only the paired sink and the "
                                    "paired writer job run")


#: the delta-spark releases built for each Spark (the Spark their jars depend on, from their POMs on Maven
#: Central; delta-spark's own pyspark requirement is looser): Databricks brings its own Delta
DELTA_FOR_SPARK = {"3.5": ("3.2", "3.3"), "4.0": ("4.0",), "4.1": ("4.1", "4.2", "4.3"), "4.2": ("4.4",)}


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (a pip name), None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def delta_package() -> str:
    """Delta Lake's Maven coordinates for the installed delta-spark: what a local session fetches and what
    ``spark-submit --packages`` takes."""
    version = installed_version("delta-spark") or DELTA_FOR_SPARK["4.2"][0] + ".0"
    scala = "2.12" if version.startswith("3.") else "2.13"
    return f"io.delta:delta-spark_{scala}:{version}"


def check_delta_pairing() -> None:
    """Raise :class:`~spark_sb.errors.UnsupportedSparkError` when the installed delta-spark is built for another
    Spark than the installed pyspark (its jars would fail at the first Delta read or write, far from the cause).
    A Spark this table does not know is let through."""
    spark, delta = installed_version("pyspark"), installed_version("delta-spark")
    if spark is None or delta is None:
        return
    built_for = DELTA_FOR_SPARK.get(".".join(spark.split(".")[:2]))
    if built_for is not None and ".".join(delta.split(".")[:2]) not in built_for:
        wanted = " or ".join(f"{minor}.x" for minor in built_for)
        raise UnsupportedSparkError(f"delta-spark {delta} is not built for Spark {spark}: install delta-spark "
                                    f"{wanted} with it (docs/where-it-runs/spark-versions.md)")


#: what :func:`warn_if_speculating` logs
SPECULATION_WARNING = (
    "spark.speculation is on: Spark may run a slow task a second time on another executor, and both copies send "
    "the partition's rows, with the same message ids. An entity with duplicate detection keeps one copy of each; "
    "an entity without it receives both (see docs/guarantee.md, On a cluster). Turn spark.speculation off for "
    "this job, or duplicate detection on for its entities.")


def warn_if_speculating(spark: Any) -> bool:
    """Log :data:`SPECULATION_WARNING` when the session runs speculative copies of tasks (``spark.speculation``);
    returns whether it does. Its callers ask once each: ``PairedSink`` on its first batch, the syphon's
    ``Republisher`` on the first batch of its process."""
    try:
        speculating = str(spark.conf.get("spark.speculation", "false")).strip().lower() == "true"
    except Exception as err:  # a session that cannot say (a Connect server refusing the key): nothing to warn of
        _LOGGER.debug("spark.speculation not readable: %s", type(err).__name__)
        return False
    if speculating:
        _LOGGER.warning(SPECULATION_WARNING)
    return speculating
