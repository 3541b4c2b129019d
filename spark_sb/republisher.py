"""The syphon job's ``foreachBatch`` (the Spark edge of the syphon): republish one batch of the
``servicebus-backlog`` source from the executors, record one ledger row per message in a Delta table, then
settle the batch's backlog messages from the driver. The restore-and-republish work itself is the Spark-free
core, :mod:`spark_sb.syphon`.

A batch's backlog messages stay deferred until its outcomes are in the ledger. In order:
  1. executors restore them from the bytes the source's rows carry (nothing is fetched again), republish the
     restored copies to healthy destinations and re-park the ones for a destination that is down
     (``republish_received``): one Outcome per message, nothing settled;
  2. the driver appends the outcomes to the Delta ledger (one atomic append per batch);
  3. the driver settles them (settle_outcomes): delivered and re-parked ones completed, the others
     dead-lettered with their reason.
A batch replayed after a crash anywhere in between reads the ledger first: what it records is not sent
again, only settled. A copy sent in step 1 whose outcome was never recorded is sent again with the same
message id, and the primary's duplicate detection suppresses it; a re-parked copy whose outcome was never
recorded is found by its x-ms-reparked-from marker (the replay peeks the backlog queue for markers once per
queue, only when it has messages to send) and not sent again.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from . import messages as msgs
from . import tables
from .bus import shared_namespace
from .bus.deferred import peek_deferred
from .capabilities import warn_if_speculating
from .config import SparkSbConfig
from .syphon import PRIMARY_DOWN, Outcome, PrimaryDownError, republish_received, settle_outcomes

_LOGGER = logging.getLogger(__name__)

__all__ = ["LEDGER_DDL", "Republisher", "republish_partition"]

#: the ledger's columns (one row per moved, dead-lettered or re-parked message)
LEDGER_DDL = (
    "message_id STRING, backlog_queue STRING, sequence_number BIGINT, destination STRING, outcome STRING, "
    "reason STRING, description STRING, batch_id BIGINT, backlog_enqueued_time TIMESTAMP, recorded_time TIMESTAMP"
)
_LEDGER_NAMES = ("message_id", "backlog_queue", "sequence_number", "destination", "outcome", "reason",
                 "description", "batch_id", "backlog_enqueued_time", "recorded_time")

def _ledger_schema() -> Any:
    import pyarrow as pa

    return pa.schema([("message_id", pa.string()), ("backlog_queue", pa.string()),
                      ("sequence_number", pa.int64()), ("destination", pa.string()), ("outcome", pa.string()),
                      ("reason", pa.string()), ("description", pa.string()), ("batch_id", pa.int64()),
                      ("backlog_enqueued_time", pa.timestamp("us", tz="UTC")),
                      ("recorded_time", pa.timestamp("us", tz="UTC"))])


def republish_partition(config: SparkSbConfig, batch_id: int, skip: frozenset[tuple[str, int]],
                        batches: Iterator[Any], *, replay: bool = False) -> Iterator[Any]:
    """``mapInArrow`` body over the ``servicebus-backlog`` source's rows (``backlog_queue``,
    ``sequence_number``, ``backlog_message``): :func:`republish_received` for this partition's messages (but
    those in ``skip``, which the ledger already records), restored from the bytes the rows carry (a row
    without them is peeked), and one ledger row per outcome. ``replay``: the batch may have been attempted
    before (see :func:`republish_received`)."""
    import pyarrow as pa

    received: dict[str, list[Any]] = {}
    missing: dict[str, list[int]] = {}  # rows without bytes: peeked, then merged in sequence order
    for batch in batches:
        queues = batch.column("backlog_queue").to_pylist()
        numbers = batch.column("sequence_number").to_pylist()
        encoded = batch.column("backlog_message").to_pylist()
        for queue, number, data in zip(queues, numbers, encoded, strict=True):
            if (queue, int(number)) in skip:
                continue
            if data is None:
                missing.setdefault(queue, []).append(int(number))
            else:
                received.setdefault(queue, []).append(msgs.from_received_bytes(data))
    for queue, numbers in missing.items():
        with shared_namespace(config, "secondary").receiver(queue) as receiver:
            received.setdefault(queue, []).extend(peek_deferred(receiver, sorted(set(numbers))))
    for found in received.values():  # a session's messages go home in the order they were parked
        found.sort(key=lambda message: int(message.sequence_number))
    outcomes = republish_received(config, received, replay=replay) if received else []
    now = datetime.datetime.now(datetime.UTC)
    columns: dict[str, list[Any]] = {name: [] for name in _LEDGER_NAMES}
    for row in outcomes:
        values = {**{name: getattr(row, name, None) for name in _LEDGER_NAMES}, "batch_id": batch_id,
                  "recorded_time": now}
        for name in _LEDGER_NAMES:
            columns[name].append(values[name])
    yield pa.RecordBatch.from_pydict(columns, schema=_ledger_schema())


_OUTCOME_FIELDS = tuple(f.name for f in dataclasses.fields(Outcome))


def _ledger_outcome(row: Any) -> Outcome:
    """The :class:`Outcome` of one ledger row (a Spark ``Row`` or a dict)."""
    values: dict[str, Any] = row if isinstance(row, dict) else row.asDict()
    return Outcome(**{name: values[name] for name in _OUTCOME_FIELDS})


class Republisher:
    """The ``foreachBatch`` of ``jobs/syphon.py``: republish one batch of the ``servicebus-backlog`` source
    from the executors, append one ledger row per message to the Delta ledger (one atomic append), then
    settle the batch's backlog messages from the driver. A replayed batch
    skips what the ledger records for it and only settles it (see the comment above :data:`LEDGER_DDL`).

    A batch that found the primary namespace down (outcomes ``left`` with reason
    :data:`~spark_sb.syphon.PRIMARY_DOWN`: nothing re-parked) records and settles the rest as any batch, then
    raises :class:`~spark_sb.syphon.PrimaryDownError`, so that Spark does not commit it: the run stops there and
    the next run replays it (:attr:`primary_down` says so in this process).

    ``after`` (for tests) is called with each step's name once it is done: ``"republished"``,
    ``"recorded"``, ``"settled"``."""

    def __init__(self, config: SparkSbConfig, *, after: Callable[[str, int], None] | None = None) -> None:
        config.syphon.require_job_locations()
        self.config = config
        self.ledger = str(config.syphon.ledger)
        self.totals: dict[str, int] = {}
        #: batches this object ran to the end (a batch that stopped for the primary counts)
        self.batches = 0
        #: the error of the batch that found the primary down (None: none did)
        self.primary_down: PrimaryDownError | None = None
        #: seconds spent in each step over all batches: read and republish, ledger, settle
        self.step_seconds: dict[str, float] = {}
        self._after = after or (lambda step, batch_id: None)
        self._begun: int | None = None  # the last batch id this process began

    def _ledger_df(self, spark: Any) -> Any:
        return tables.read(spark, self.ledger)

    def recorded(self, spark: Any, batch_id: int) -> list[Outcome]:
        """The outcomes the ledger records for ``batch_id``."""
        ledger = self._ledger_df(spark)
        if ledger is None:
            return []
        rows = ledger.where(ledger.batch_id == batch_id).collect()
        return [_ledger_outcome(r) for r in rows]

    def __call__(self, batch_df: Any, batch_id: int) -> None:
        spark = batch_df.sparkSession
        times = [time.monotonic()]
        if self._begun is None:  # this process's first batch: a speculative copy would republish its messages twice
            warn_if_speculating(spark)
        # only a batch id this process began before, or the first one it runs, can be a replay
        replay = self._begun is None or batch_id <= self._begun
        self._begun = batch_id
        before = self.recorded(spark, batch_id) if replay else []
        # what the ledger records as settled is not sent again; a message it records as left is tried again
        skip = frozenset((o.backlog_queue, int(o.sequence_number)) for o in before
                         if o.sequence_number is not None and o.outcome != "left")
        # one task per source partition (a backlog queue's share of the batch): no shuffle
        rows = batch_df.select("backlog_queue", "sequence_number", "backlog_message")
        out = rows.mapInArrow(partial(republish_partition, self.config, batch_id, skip, replay=replay), LEDGER_DDL)
        table = out.toArrow()  # one small row per message (at most maxMessagesPerTrigger)
        times.append(time.monotonic())
        self._after("republished", batch_id)
        if table.num_rows:
            # no txnAppId/txnVersion: a replay already skips what the ledger records for its batch, and Delta
            # rebuilds the table's state (a 50-task job) to check a transaction version on every write
            tables.append(spark.createDataFrame(table), self.ledger)
        times.append(time.monotonic())
        self._after("recorded", batch_id)
        new = [_ledger_outcome(r) for r in table.to_pylist()]
        settled = settle_outcomes(self.config, before + new)
        times.append(time.monotonic())
        self._after("settled", batch_id)
        counts = dict(collections.Counter(o.outcome for o in new))
        for key, n in counts.items():
            self.totals[key] = self.totals.get(key, 0) + n
        steps = dict(zip(("republish", "ledger", "settle"), (b - a for a, b in itertools.pairwise(times)),
                         strict=True))
        for step, seconds in steps.items():
            self.step_seconds[step] = self.step_seconds.get(step, 0.0) + seconds
        _LOGGER.info("syphon batch %d: %s, %d backlog messages settled (recorded by an earlier attempt: %d); "
                     "read and republish %.2f s, ledger %.2f s, settle %.2f s", batch_id, counts or "nothing",
                     settled, len(before), *steps.values())
        self.batches += 1
        waiting = sum(1 for o in new if o.outcome == "left" and o.reason == PRIMARY_DOWN)
        if waiting:
            self.primary_down = PrimaryDownError(batch_id, waiting)
            raise self.primary_down
