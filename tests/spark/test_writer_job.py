"""The writer job (spark_sb.jobs, behind jobs/paired_writer.py and spark-sb-writer) as a user runs it."""

from __future__ import annotations

import collections
import time
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException

from spark_sb import jobs

from .conftest import receive_all, sink_config, wait_until

#: run on every Spark version make test tries (Makefile, EVERY_SPARK)
pytestmark = pytest.mark.every_spark


def _run(spark: Any, config: dict, rows: int) -> int:
    """One run of the job without a checkpoint location until it sent ``rows`` rows or more; returns how many
    it sent."""
    query, sink = jobs.start_writer(spark, config)
    wait_until(lambda: sink.totals.rows >= rows, timeout=60)
    jobs.await_batches(query, 0)  # stops between two batches
    return sink.totals.rows


def test_runs_without_a_checkpoint_never_reuse_message_ids(spark, primary, secondary, make_queue) -> None:
    # each run starts a fresh checkpoint, so the rate source counts from 0 again: the message ids must still
    # differ, or duplicate detection on the entity drops the second run's rows
    q = make_queue(requires_duplicate_detection=True)
    config = sink_config(primary, secondary, entity=q, source={"format": "rate", "rows_per_second": 20})
    first = _run(spark, config, 30)
    second = _run(spark, config, 30)
    assert first > 0 and second > 0
    # what each run counted: a run stops between two batches, so no batch is sent and left uncounted
    ids = [str(m.message_id) for m in receive_all(primary.connection_string, q)]
    assert len(ids) == first + second  # a reused id would have been dropped by duplicate detection
    assert len(ids) == len(set(ids))


def test_a_replayed_batch_keeps_its_message_ids(spark, primary, secondary, make_queue, tmp_path) -> None:
    # no duplicate detection: a replayed batch arrives twice, and only the same ids show it was the same batch
    q = make_queue()
    config = sink_config(primary, secondary, entity=q, source={"format": "rate", "rows_per_second": 20})
    checkpoint = str(tmp_path / "checkpoint")
    crashed: dict[str, int] = {}

    def crash_once_after_sending(batch_df: Any, batch_id: int) -> None:
        summary = sink.send_batch(batch_df, batch_id)
        if summary.rows and not crashed:
            crashed.update(batch=batch_id, rows=summary.rows)
            raise RuntimeError("killed after sending")

    query, sink = jobs.start_writer(spark, config, foreach_batch=crash_once_after_sending, checkpoint=checkpoint)
    with pytest.raises(StreamingQueryException, match="killed after sending"):
        query.awaitTermination(60)
    assert crashed
    query, sink = jobs.start_writer(spark, config, checkpoint=checkpoint)
    wait_until(lambda: sink.totals.batches >= 2, timeout=60)
    jobs.await_batches(query, 0)
    ids = [str(m.message_id) for m in receive_all(primary.connection_string, q)]
    twice = [i for i, n in collections.Counter(ids).items() if n == 2]
    assert len(twice) == crashed["rows"] and not [i for i, n in collections.Counter(ids).items() if n > 2]


def test_stopping_the_job_never_interrupts_a_batch(spark, primary, secondary, make_queue, tmp_path) -> None:
    # batches run back to back, each busy for a second after it sent (as a ledger write is): a stop that
    # interrupted one would leave it sent but not committed, so the next run on the checkpoint would send it again
    q = make_queue()
    config = sink_config(primary, secondary, entity=q, source={"format": "rate", "rows_per_second": 50})
    checkpoint = tmp_path / "checkpoint"
    finished: list[int] = []

    def busy_after_sending(batch_df: Any, batch_id: int) -> None:
        sink(batch_df, batch_id)
        time.sleep(1.0)
        finished.append(batch_id)

    query, sink = jobs.start_writer(spark, config, foreach_batch=busy_after_sending, checkpoint=str(checkpoint))
    jobs.await_batches(query, 3, settle=5)
    assert not query.isActive
    time.sleep(1.5)  # an interrupted batch's Python function would still finish now
    committed = {int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit()}
    assert finished and set(finished) <= committed, f"sent but not committed: {set(finished) - committed}"
    ids = [str(m.message_id) for m in receive_all(primary.connection_string, q)]
    assert len(ids) == len(set(ids)) == sink.totals.rows
