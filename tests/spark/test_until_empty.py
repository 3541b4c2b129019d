"""``--until-empty`` tells the truth (issue 34, item 3 and the job's side of item 2): it stops once the backlog is
seen empty, never takes an unknown depth for an empty backlog, says what it left at its timeout, and the job exits
non-zero (3) when the backlog is not empty, or (1) with the error when its query failed.

The loop of Spark 4.0 and 4.1 (``jobs.await_until_empty``) is tested with a fake query that reads nothing and
reports no depth, as a stuck query does there; the depth comes from the emulator's administration API through
``backlog_depth``. The job (``jobs.syphon_main``) runs for real, on this session's Spark: the loop on 4.0 and 4.1,
``Trigger.AvailableNow`` runs on 4.2."""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pairing import within

from spark_sb import jobs
from spark_sb.config import load_config
from spark_sb.source import backlog_depth

from . import test_syphon_stream
from .conftest import receive_all

_park = test_syphon_stream._park
#: the fixture: a configuration whose backlog queues exist, a destination queue, the job's locations
setup = test_syphon_stream.setup

#: run on every Spark version make test tries (Makefile, EVERY_SPARK)
pytestmark = pytest.mark.every_spark


class _IdleQuery:
    """A streaming query that runs and reads nothing: each look at ``lastProgress`` is a new trigger with no input
    rows and no backlog depth in its progress (Spark 4.0 and 4.1 have no ``reportLatestOffset``)."""

    def __init__(self) -> None:
        self.id = "an idle query"
        self.isActive = True
        self.triggers = 0
        self.status = {"isTriggerActive": False}

    @property
    def lastProgress(self) -> dict:
        self.triggers += 1
        return {"timestamp": f"t{self.triggers}", "numInputRows": 0, "sources": [{"latestOffset": None}]}

    def awaitTermination(self, timeout: float | None = None) -> bool:
        if timeout and self.isActive:
            time.sleep(timeout)
        return not self.isActive

    def stop(self) -> None:
        self.isActive = False

    def exception(self) -> None:
        return None


def _depth(config: dict) -> Any:
    return lambda: backlog_depth(load_config(config))


def test_an_unknown_depth_is_never_an_empty_backlog(setup, silent_endpoint, caplog) -> None:
    # the secondary's administration API accepts and never answers: backlog_depth gives None (admin_timeout)
    config = {**setup["config"], "secondary": {**setup["config"]["secondary"], "admin_endpoint": silent_endpoint,
                                               "admin_timeout": "500ms"}}
    assert backlog_depth(load_config(config)) is None
    query, started = _IdleQuery(), time.monotonic()
    with caplog.at_level(logging.WARNING, logger="spark_sb.jobs"):
        outcome = within(60, lambda: jobs.await_until_empty(query, idle_batches=1, timeout=4, poll=0.1,
                                                              depth=_depth(config)))
    elapsed = time.monotonic() - started
    assert elapsed >= 4, f"stopped after {elapsed:.1f} s, taking an unknown depth for an empty backlog"
    assert (outcome.empty, outcome.depth) == (False, None) and not query.isActive
    assert "depth unknown" in outcome.why and "timeout, 4 s" in outcome.why
    assert any(r.levelno == logging.WARNING and outcome.why in r.getMessage() for r in caplog.records)


def test_at_its_timeout_it_says_what_it_left(setup, secondary, caplog) -> None:
    config = setup["config"]
    _park(secondary, setup["queues"][0], setup["entity"], ["m0", "m1", "m2"])
    query = _IdleQuery()  # stuck: the three parked messages stay where they are
    with caplog.at_level(logging.WARNING, logger="spark_sb.jobs"):
        outcome = within(60, lambda: jobs.await_until_empty(query, idle_batches=1, timeout=2, poll=0.1,
                                                              depth=_depth(config)))
    assert outcome is not None, "stopped silently, saying nothing of what it left"
    assert (outcome.empty, outcome.depth) == (False, 3)
    assert "3 messages left in the backlog" in outcome.why and "timeout, 2 s" in outcome.why
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("3 messages left in the backlog" in w for w in warnings), warnings


def test_timeout_0_goes_on_until_the_backlog_is_empty(setup, secondary) -> None:
    config, queue = setup["config"], setup["queues"][1]
    _park(secondary, queue, setup["entity"], ["e0", "e1"])
    emptied = threading.Timer(3.0, lambda: receive_all(secondary.connection_string, queue, expected=2))
    query, started = _IdleQuery(), time.monotonic()
    emptied.start()
    try:
        outcome, ended = within(60, lambda: (jobs.await_until_empty(query, idle_batches=1, timeout=0, poll=0.1,
                                                                      depth=_depth(config)), time.monotonic()))
    finally:
        emptied.join()
    assert ended - started >= 3, f"stopped after {ended - started:.1f} s, before the backlog was empty"
    assert outcome == jobs.UntilEmpty(True, 0, "the backlog is empty") and not query.isActive


@pytest.fixture
def job_conf(spark: Any, setup: dict, tmp_path: Path) -> Any:
    """The job's configuration file; this session's progress interval, which the job sets, put back after."""
    import json

    conf = tmp_path / "syphon.json"
    conf.write_text(json.dumps(setup["config"]))
    interval = spark.conf.get("spark.sql.streaming.noDataProgressEventInterval")
    yield conf
    spark.conf.set("spark.sql.streaming.noDataProgressEventInterval", interval)


@pytest.mark.timeout(240)
def test_the_job_exits_3_saying_what_it_left_when_it_cannot_move_the_backlog(
        spark, emulator, setup, secondary, job_conf, capsys) -> None:
    # the destination is down for the whole run: each message is re-parked (a new backlog message) by each batch
    entity = setup["entity"]
    _park(secondary, setup["queues"][0], entity, [f"d{i}" for i in range(4)])
    emulator.fault("primary", "down", entity=entity)
    try:
        with pytest.raises(SystemExit) as exited:
            jobs.syphon_main(["--conf", str(job_conf), "--until-empty", "--timeout", "8"])
    finally:
        emulator.heal("primary", entity=entity)
    err = capsys.readouterr().err
    assert exited.value.code == jobs.EXIT_BACKLOG_LEFT, err[-3000:]
    # exactly the 4 parked: the job stops between two batches, so no re-parked copy is left beside its original
    left = re.search(r"--until-empty stopped after \d+ s .* with (\d+) messages left in the backlog", err)
    assert left is not None and int(left.group(1)) == 4, err[-3000:]
    assert backlog_depth(load_config(setup["config"])) == 4  # moved nowhere, lost nowhere


@pytest.mark.timeout(240)
def test_the_job_exits_1_with_the_error_when_its_query_failed(spark, setup, secondary, job_conf, capsys,
                                                             monkeypatch) -> None:
    from spark_sb.republisher import Republisher

    def fail(self: Any, df: Any, batch_id: int) -> None:
        raise RuntimeError("the ledger's storage refused the append")

    monkeypatch.setattr(Republisher, "__call__", fail)  # foreachBatch runs in this (the driver's) process
    _park(secondary, setup["queues"][0], setup["entity"], ["f0"])
    with pytest.raises(SystemExit) as exited:
        jobs.syphon_main(["--conf", str(job_conf), "--until-empty", "--timeout", "60"])
    err = capsys.readouterr().err
    assert exited.value.code == jobs.EXIT_QUERY_FAILED, err[-3000:]
    assert "the syphon query failed" in err, err[-3000:]
    assert "RuntimeError: the ledger's storage refused the append" in err, err[-3000:]
