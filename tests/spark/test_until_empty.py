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
from .test_job_console import _lines, _only_ours, run_job

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
    left = re.search(r"spark-sb-syphon: moved 0, re-parked \d+, dead-lettered 0 in \d+ batch(es)?; stopped after "
                     r"\d+ s \(the --until-empty timeout, 8 s\) with (\d+) messages left in the backlog", err)
    assert left is not None and int(left.group(2)) == 4, err[-3000:]
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


def _sequence_numbers(secondary: Any, queue: str) -> list[int]:
    """The sequence numbers of the messages in ``queue`` (peeked): a re-parked copy has a new one."""
    from azure.servicebus import ServiceBusClient

    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        with client.get_queue_receiver(queue) as receiver:
            return sorted(int(m.sequence_number) for m in receiver.peek_messages(max_message_count=100))


def _conf_file(tmp_path: Path, config: dict, **syphon: Any) -> str:
    import json

    conf = tmp_path / "syphon.json"
    conf.write_text(json.dumps({**config, "syphon": {**config["syphon"], **syphon}}))
    return str(conf)


@pytest.mark.timeout(240)
def test_with_the_primary_down_the_job_moves_and_re_parks_nothing_and_says_so(spark, emulator, setup, secondary,
                                                                               tmp_path, capsys) -> None:
    """Issue 46, item 4: a scheduled run while the primary namespace is down ends at once with exit status 3,
    having moved and re-parked nothing (every message keeps its sequence number), and says how many wait."""
    queue = setup["queues"][0]
    _park(secondary, queue, setup["entity"], [f"w{i}" for i in range(5)])
    before = _sequence_numbers(secondary, queue)
    emulator.fault("primary", "down")
    try:
        started = time.monotonic()
        status = run_job(jobs.syphon_main, ["--conf", _conf_file(tmp_path, setup["config"]), "--until-empty",
                                            "--timeout", "20"])
        elapsed = time.monotonic() - started
    finally:
        emulator.heal("primary")
    err = capsys.readouterr().err
    assert status == jobs.EXIT_BACKLOG_LEFT, err[-3000:]
    assert elapsed < 20 + jobs.STOP_SETTLE, elapsed
    assert re.fullmatch(r"spark-sb-syphon: moved 0, re-parked 0, dead-lettered 0 in 0 batches; the primary is down, "
                        r"5 messages wait in the backlog \(ServiceBusConnectionError: .*\)", _lines(err)[-1]), err[-3000:]
    _only_ours(err, "spark-sb-syphon")
    assert _sequence_numbers(secondary, queue) == before  # nothing re-parked, nothing moved
    assert not Path(setup["config"]["syphon"]["ledger"]).exists()  # no batch ran


@pytest.mark.timeout(300)
def test_a_batch_that_finds_the_primary_down_stops_the_run_and_re_parks_nothing(spark, emulator, setup, primary,
                                                                               secondary, tmp_path, capsys,
                                                                               monkeypatch) -> None:
    """The primary goes down while the job runs (before its second batch): that batch re-parks and completes
    nothing, the run stops with exit status 3 saying how many wait; the next run replays the batch and moves
    everything, each message once."""
    from spark_sb.republisher import Republisher
    from spark_sb.syphon import PRIMARY_DOWN

    queue, entity, config = setup["queues"][0], setup["entity"], setup["config"]
    ids = [f"m{i}" for i in range(6)]
    _park(secondary, queue, entity, ids)
    conf = _conf_file(tmp_path, config, max_messages_per_trigger=3)
    republish, batches = Republisher.__call__, []

    def down_before_the_second_batch(self: Any, df: Any, batch_id: int) -> None:
        batches.append(batch_id)
        if len(batches) == 2:
            emulator.fault("primary", "down")
        republish(self, df, batch_id)

    monkeypatch.setattr(Republisher, "__call__", down_before_the_second_batch)  # foreachBatch runs in this process
    try:
        status = run_job(jobs.syphon_main, ["--conf", conf, "--until-empty", "--timeout", "60"])
    finally:
        emulator.heal("primary")
    err = capsys.readouterr().err
    assert status == jobs.EXIT_BACKLOG_LEFT, err[-3000:]
    assert re.fullmatch(r"spark-sb-syphon: moved 3, re-parked 0, dead-lettered 0 in 2 batches; the primary is down, "
                        r"3 messages wait in the backlog \(it stopped answering during a batch, .*\)",
                        _lines(err)[-1]), err[-3000:]
    _only_ours(err, "spark-sb-syphon")
    ledger = spark.read.format("delta").load(config["syphon"]["ledger"]).collect()
    assert sorted((r.outcome, r.reason) for r in ledger) == [("delivered", None)] * 3 + [("left", PRIMARY_DOWN)] * 3
    assert len(_sequence_numbers(secondary, queue)) == 3  # the three left: no copy beside them

    monkeypatch.setattr(Republisher, "__call__", republish)
    assert run_job(jobs.syphon_main, ["--conf", conf, "--until-empty", "--timeout", "120"]) == 0
    assert re.search(r"moved 3, re-parked 0, dead-lettered 0 in \d+ batch(es)?; the backlog is empty$",
                     capsys.readouterr().err)
    assert sorted(str(m.message_id) for m in receive_all(primary.connection_string, entity, wait=1.0)) == ids
    delivered = spark.read.format("delta").load(config["syphon"]["ledger"]).where("outcome = 'delivered'")
    assert sorted(r.message_id for r in delivered.collect()) == ids  # each once
    assert _sequence_numbers(secondary, queue) == []


@pytest.mark.timeout(240)
def test_the_timeout_bounds_a_run(spark, setup, secondary, tmp_path, capsys, monkeypatch) -> None:
    """``--timeout`` bounds the run itself, not only the wait between runs: at the timeout the batch in flight
    finishes and the job stops, saying what it left (Spark 4.2's Trigger.AvailableNow run went on to its end)."""
    from spark_sb.republisher import Republisher

    queue, entity, config = setup["queues"][0], setup["entity"], setup["config"]
    _park(secondary, queue, entity, [f"t{i}" for i in range(8)])
    republish = Republisher.__call__

    def slow(self: Any, df: Any, batch_id: int) -> None:
        time.sleep(1.5)
        republish(self, df, batch_id)

    monkeypatch.setattr(Republisher, "__call__", slow)
    started = time.monotonic()
    status = run_job(jobs.syphon_main, ["--conf", _conf_file(tmp_path, config, max_messages_per_trigger=1),
                                        "--until-empty", "--timeout", "3"])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert status == jobs.EXIT_BACKLOG_LEFT, err[-3000:]
    assert elapsed < 3 + jobs.STOP_SETTLE, elapsed
    last = re.fullmatch(r"spark-sb-syphon: moved (\d), re-parked 0, dead-lettered 0 in \d batch(es)?; stopped after "
                        r"\d+ s \(the --until-empty timeout, 3 s\) with (\d) messages left in the backlog.*",
                        _lines(err)[-1])
    assert last is not None, err[-3000:]
    moved, left = int(last.group(1)), int(last.group(3))
    assert left > 0 and moved + left == 8, last.group(0)
    _only_ours(err, "spark-sb-syphon")
