"""The syphon job: move the messages parked in the backlog queues back to the primary.

    spark-submit jobs/syphon.py --conf conf/local.yaml [--max-batches N] [--until-empty]
    python jobs/syphon.py --conf conf/local.yaml          # a local session (local[2])

Runs ``spark.readStream.format("servicebus-backlog") -> foreachBatch(Republisher)`` with
``syphon.checkpoint_location`` and the Delta ledger ``syphon.ledger`` (a path or a table name): one row per
moved, dead-lettered or re-parked message. Both are required: a configuration without them is refused before
the query starts. The trigger is ``syphon.retry_interval``: a destination found down is tried again after it.

A batch's backlog messages are settled only once the ledger records their outcomes, so the query can be
killed at any point and restarted from its checkpoint: a replayed batch sends again only what the ledger does
not record (the primary's duplicate detection suppresses a copy sent twice) and settles the rest.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

_LOGGER = logging.getLogger("spark_sb.jobs.syphon")


def start(spark: Any, conf: Any, *, max_per_trigger: int | None = None, receive_timeout: float = 1.0) -> tuple[Any, Any]:
    """Start the syphon query; returns ``(query, republisher)``. Raises ``ConfigError`` when the checkpoint or
    the ledger location is missing, before anything starts."""
    from spark_sb.config import load_config
    from spark_sb.republisher import Republisher
    from spark_sb.source import config_options, register

    config = load_config(conf)
    republisher = Republisher(config)  # refuses a configuration without checkpoint or ledger
    register(spark)
    stream = (spark.readStream.format("servicebus-backlog")
              .options(**config_options(config))  # by reference: no secret in the plan
              .option("maxMessagesPerTrigger", str(max_per_trigger or config.syphon.max_messages_per_trigger))
              .option("receiveTimeout", str(receive_timeout))
              .load())
    log_batch_steps(spark, "spark-sb-syphon")
    query = (stream.writeStream.foreachBatch(republisher)
             .option("checkpointLocation", config.syphon.checkpoint_location)
             .trigger(processingTime=f"{config.syphon.retry_interval.total_seconds()} seconds")
             .queryName("spark-sb-syphon")
             .start())
    return query, republisher


_STEPS = ("latestOffset", "addBatch", "walCommit", "commitOffsets")
_LISTENING: set[int] = set()


def log_batch_steps(spark: Any, query_name: str) -> None:
    """Log Spark's time per step of each batch of the query named ``query_name`` (once per session): the
    source's ``latestOffset`` (completing the last batch, taking the batch received ahead), ``addBatch`` (the
    foreachBatch, which logs its own steps) and the offset and commit logs."""
    from pyspark.sql.streaming import StreamingQueryListener

    if id(spark) in _LISTENING:
        return

    class _Steps(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:
            pass

        def onQueryProgress(self, event: Any) -> None:
            progress = event.progress
            if progress.name != query_name or not progress.numInputRows:
                return
            durations = progress.durationMs
            _LOGGER.info("batch %d: %d messages in %.2f s (%s)", progress.batchId, progress.numInputRows,
                         durations.get("triggerExecution", 0) / 1000,
                         ", ".join(f"{step} {durations.get(step, 0) / 1000:.2f} s" for step in _STEPS))

        def onQueryIdle(self, event: Any) -> None:
            pass

        def onQueryTerminated(self, event: Any) -> None:
            pass

    spark.streams.addListener(_Steps())
    _LISTENING.add(id(spark))


def _backlog_depth(progress: Any) -> int | None:
    """The backlog depth the source reported in this progress (``None`` when it reported none)."""
    try:
        offset = progress["sources"][0].get("latestOffset")
        return int((json.loads(offset) if isinstance(offset, str) else offset)["backlogDepth"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def await_until_empty(query: Any, idle_batches: int = 2, timeout: float = 300.0, poll: float = 0.5) -> None:
    """Stop the query once ``idle_batches`` consecutive triggers found nothing and the backlog depth is 0 (or
    after ``timeout``). The depth counts messages still locked by a run that died (they come back when their
    lock expires, up to the queue's lock duration later), which a trigger alone does not see."""
    deadline = time.monotonic() + timeout
    idle, last = 0, None
    while query.isActive and time.monotonic() < deadline:
        progress = query.lastProgress
        if progress is not None and progress.get("timestamp") != last:
            last = progress.get("timestamp")
            empty = progress.get("numInputRows", 0) == 0 and _backlog_depth(progress) in (None, 0)
            idle = idle + 1 if empty else 0
            if idle >= idle_batches:
                break
        query.awaitTermination(poll)
    query.stop()
    query.awaitTermination()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conf", type=Path, required=True, help="spark-sb YAML configuration")
    parser.add_argument("--until-empty", action="store_true", help="stop when the backlog is empty")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from paired_writer import build_session

    from spark_sb.config import load_config
    from spark_sb.errors import ConfigError

    try:
        config = load_config(args.conf)
        config.syphon.require_job_locations()
    except ConfigError as err:
        print(f"spark-sb syphon: {err}", file=sys.stderr)
        return 2
    spark = build_session("spark-sb-syphon")
    if args.until_empty:  # an idle stream reports progress every second (default 10 s): stop sooner
        spark.conf.set("spark.sql.streaming.noDataProgressEventInterval", "1s")
    query, republisher = start(spark, config)
    if args.until_empty:
        await_until_empty(query)
    else:
        query.awaitTermination()
    _LOGGER.info("syphon stopped: %s", republisher.totals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
