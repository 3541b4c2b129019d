"""What the jobs print (issue 46, item 3 and the jobs' side of item 2): spark-sb's own lines and one last line saying
what the run did, the Azure SDK's and py4j's lines only when asked (``--verbose``, ``--log-config``), no ERROR and no
traceback when a run stops as it should, one line naming the error when it fails; ``--max-batches N`` runs N batches
of this run, whatever batch its checkpoint resumes from.

The jobs run in this process, on this session's Spark, through ``writer_main`` and ``syphon_main`` as the console
scripts call them. A :func:`fresh_console` takes pytest's log handlers off the root logger for the test, so the
job configures logging as it does in a fresh process, writing to stderr (captured by ``capsys``)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest

from spark_sb import jobs
from spark_sb.config import load_config
from spark_sb.source import backlog_depth

from . import test_syphon_stream
from .conftest import receive_all, sink_config

_park = test_syphon_stream._park
#: the fixture: a configuration whose backlog queues exist, a destination queue, the job's locations
setup = test_syphon_stream.setup

#: run on every Spark version make test tries (Makefile, EVERY_SPARK)
pytestmark = pytest.mark.every_spark

#: a log line of the jobs' format whose logger is not spark-sb's: the SDK's, its AMQP stack's, urllib3's, py4j's...
_FOREIGN = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ (?!spark_sb[.:])\S+: ", re.MULTILINE)
#: a log line of spark-sb's own
_OURS = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ spark_sb[.\w]*: ")


@contextlib.contextmanager
def fresh_console() -> Iterator[None]:
    """The root logger as a fresh process has it (no handler: the job adds its own, on stderr) for the block; the
    test session's logging put back after, and the session's progress interval (the syphon job sets it). Used
    around the job's call, in the test's body: pytest adds its log handlers at the start of each phase."""
    from pyspark.sql import SparkSession

    root, ours, py4j = logging.getLogger(), logging.getLogger("spark_sb"), logging.getLogger("py4j")
    clientserver, emulator = logging.getLogger("py4j.clientserver"), logging.getLogger("spark_sb.emulator")
    saved = (root.handlers[:], root.level, ours.level, py4j.level, clientserver.filters[:], emulator.level,
             ours.handlers[:], ours.propagate)
    spark = SparkSession.getActiveSession()
    interval = spark.conf.get("spark.sql.streaming.noDataProgressEventInterval") if spark else None
    root.handlers = []
    emulator.setLevel(logging.CRITICAL)  # this session's emulator, in this process: not the job's console
    try:
        yield
    finally:
        for handler in [*root.handlers, *ours.handlers]:
            if handler not in saved[0] and handler not in saved[6]:
                handler.close()
        root.handlers, clientserver.filters = saved[0], saved[4]
        ours.handlers, ours.propagate = saved[6], saved[7]
        root.setLevel(saved[1])
        ours.setLevel(saved[2])
        py4j.setLevel(saved[3])
        emulator.setLevel(saved[5])
        if spark is not None and interval is not None:
            spark.conf.set("spark.sql.streaming.noDataProgressEventInterval", interval)


def run_job(main: Any, argv: list[str]) -> int | None:
    """``main(argv)`` as the console script runs it, in a :func:`fresh_console`: its exit status (``SystemExit``'s
    code, or what it returned)."""
    with fresh_console():
        try:
            return main(argv)
        except SystemExit as exited:
            return exited.code  # type: ignore[return-value]


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def _only_ours(err: str, prog: str) -> None:
    """Every line is spark-sb's own log line or the job's last line: no other library's, no traceback."""
    foreign = [line for line in _lines(err) if not (_OURS.match(line) or line.startswith(f"{prog}: "))]
    assert not foreign, "\n".join(foreign[:20])
    assert "ERROR" not in err and "Traceback" not in err, err[-3000:]


def test_max_batches_runs_that_many_batches_each_run_and_stops_quietly(spark, primary, secondary, make_queue,
                                                                       tmp_path, capsys) -> None:
    # batches back to back (no trigger): the batch after the last has started by the time the run stops, so a
    # run that stopped on a batch id, or let that batch fail loudly, shows here
    entity = make_queue()
    config = sink_config(primary, secondary, entity=entity, source={"format": "rate", "rows_per_second": 20},
                         checkpoint_location=str(tmp_path / "checkpoint"))
    conf = tmp_path / "writer.json"
    conf.write_text(json.dumps(config))
    commits = tmp_path / "checkpoint" / "commits"

    sent = 0
    for run, expected in ((1, 3), (2, 6)):
        assert run_job(jobs.writer_main, ["--conf", str(conf), "--max-batches", "3"]) == 0
        err = capsys.readouterr().err
        committed = sorted(int(p.name) for p in commits.iterdir() if p.name.isdigit())
        assert committed == list(range(expected)), f"run {run}: batches {committed}\n{err[-2000:]}"
        _only_ours(err, "spark-sb-writer")
        last = re.fullmatch(r"spark-sb-writer: 3 batches in \d+ s, (\d+) rows: \d+ -> primary, 0 rejected, .*; "
                            r"stopped after --max-batches 3", _lines(err)[-1])
        assert last is not None, err[-2000:]
        sent += int(last.group(1))
    assert len(receive_all(primary.connection_string, entity, wait=1.0)) == sent  # each run said what it sent


def test_the_syphon_says_what_it_moved_and_logs_the_sdk_only_when_asked(spark, setup, primary, secondary, tmp_path,
                                                                         capsys) -> None:
    conf = tmp_path / "syphon.json"
    conf.write_text(json.dumps(setup["config"]))
    queue, entity = setup["queues"][0], setup["entity"]

    _park(secondary, queue, entity, [f"q{i}" for i in range(3)])
    assert run_job(jobs.syphon_main, ["--conf", str(conf), "--until-empty", "--timeout", "120"]) == 0
    err = capsys.readouterr().err
    _only_ours(err, "spark-sb-syphon")
    assert not _FOREIGN.search(err)
    assert re.fullmatch(r"spark-sb-syphon: moved 3, re-parked 0, dead-lettered 0 in \d+ batch(es)?; the backlog is "
                        r"empty", _lines(err)[-1]), err[-2000:]

    _park(secondary, queue, entity, [f"v{i}" for i in range(2)])
    assert run_job(jobs.syphon_main, ["--conf", str(conf), "--until-empty", "--timeout", "120", "--verbose"]) == 0
    err = capsys.readouterr().err
    sdk = [line for line in _FOREIGN.findall(err) if re.search(r" (azure|uamqp|pyamqp|urllib3)[.\w]*: $", line)]
    assert sdk, err[-3000:]  # the SDK's connections and HTTP requests (the driver settles and counts)
    assert re.search(r"moved 2, re-parked 0, dead-lettered 0 in \d+ batch(es)?; the backlog is empty$", err)
    assert sorted(str(m.message_id) for m in receive_all(primary.connection_string, entity, wait=1.0)) == [
        "q0", "q1", "q2", "v0", "v1"]


def test_log_config_takes_over_the_jobs_logging(spark, setup, secondary, tmp_path, capsys) -> None:
    # a dictConfig in YAML: spark-sb's lines into a file, nothing else anywhere; the job's last line still printed
    log = tmp_path / "syphon.log"
    settings = tmp_path / "logging.yaml"
    settings.write_text(
        "version: 1\n"
        "handlers:\n"
        f"  file: {{class: logging.FileHandler, filename: '{log}', formatter: plain}}\n"
        "formatters:\n"
        "  plain: {format: '%(levelname)s %(name)s %(message)s'}\n"
        "loggers:\n"
        "  spark_sb: {level: INFO, handlers: [file], propagate: false}\n"
        "root: {level: CRITICAL}\n")
    conf = tmp_path / "syphon.json"
    conf.write_text(json.dumps(setup["config"]))
    _park(secondary, setup["queues"][0], setup["entity"], ["l0"])
    assert run_job(jobs.syphon_main, ["--conf", str(conf), "--until-empty", "--log-config", str(settings)]) == 0
    err = capsys.readouterr().err
    assert _lines(err) == ["spark-sb-syphon: moved 1, re-parked 0, dead-lettered 0 in 1 batch; the backlog is "
                           "empty"], err[-2000:]
    assert "INFO spark_sb.republisher syphon batch 0: {'delivered': 1}" in log.read_text()
    assert run_job(jobs.syphon_main, ["--conf", str(conf), "--log-config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err.startswith(f"spark-sb-syphon: --log-config: {tmp_path / 'missing.yaml'}: ")


@pytest.mark.timeout(240)
def test_a_refused_credential_ends_the_job_with_one_line_naming_it(spark, emulator, setup, secondary, tmp_path,
                                                                   capsys) -> None:
    conf = tmp_path / "syphon.json"
    conf.write_text(json.dumps(setup["config"]))
    _park(secondary, setup["queues"][0], setup["entity"], ["c0", "c1"])
    emulator.fault("primary", "unauthorized")
    try:
        status = run_job(jobs.syphon_main, ["--conf", str(conf), "--until-empty", "--timeout", "120"])
    finally:
        emulator.heal("primary")
    err = capsys.readouterr().err
    assert status == jobs.EXIT_QUERY_FAILED, err[-3000:]
    _only_ours(err, "spark-sb-syphon")
    last = _lines(err)[-1]
    assert re.fullmatch(r"spark-sb-syphon: the syphon query failed after moved 0, re-parked 0, dead-lettered 0 in 0 "
                        r"batches \(nothing is lost: the next run replays its batch from the checkpoint\): "
                        r"CredentialRejectedError: .*", last), last
    assert backlog_depth(load_config(setup["config"])) == 2  # moved nowhere, lost nowhere


def test_the_one_line_of_a_failure_names_the_error_and_its_message() -> None:
    spark_text = ("[FOREACH_BATCH_USER_FUNCTION_ERROR] An error occurred in the user provided function.\n"
                  "Traceback (most recent call last):\n  File \"x.py\", line 3, in call\n"
                  "spark_sb.errors.CredentialRejectedError: the primary refused the credential (Unauthorized)\n"
                  "\tat org.apache.spark.api.python.PythonRunner.handle(PythonRunner.scala:1)\n"
                  "py4j.protocol.Py4JJavaError: An error occurred while calling o1.toArrow.\n")
    assert jobs._one_line(RuntimeError(spark_text)) == (
        "CredentialRejectedError: the primary refused the credential (Unauthorized)")
    assert jobs._one_line(ValueError("no\nmore")) == "ValueError: no"
    assert jobs._one_line(KeyError()) == "KeyError"



def test_the_one_line_of_a_failure_in_the_jvm_names_the_java_exception() -> None:
    """A job whose executor was lost while Spark inferred the source's schema, with spark.task.maxFailures 1 (the
    cluster soak): the line said only "Py4JJavaError: An error occurred while calling o53.load."."""
    java_text = ("An error occurred while calling o53.load.\n"
                 ": org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 0.0 failed 1 "
                 "times, most recent failure: Lost task 0.0 in stage 0.0 (TID 0) (127.0.0.3 executor 0): "
                 "ExecutorLostFailure (executor 0 exited caused by one of the running tasks) Reason: Command exited "
                 "with code 137\nDriver stacktrace:\n\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndepen"
                 "dentStages(DAGScheduler.scala:2935)\nCaused by: java.io.IOException: later\n")
    assert jobs._one_line(RuntimeError(java_text)) == (
        "SparkException: Job aborted due to stage failure: Task 0 in stage 0.0 failed 1 times, most recent failure: "
        "Lost task 0.0 in stage 0.0 (TID 0) (127.0.0.3 executor 0): ExecutorLostFailure (executor 0 exited caused by "
        "one of the running tasks) Reason: Command exited with code 137")


def test_a_failed_writer_run_ends_with_one_line_naming_the_error(spark, primary, secondary, make_queue, tmp_path,
                                                                 capsys, monkeypatch) -> None:
    from spark_sb.sink import PairedSink

    def fail(self: Any, df: Any, batch_id: int) -> None:
        raise RuntimeError("the metrics table's storage refused the append")

    monkeypatch.setattr(PairedSink, "__call__", fail)  # foreachBatch runs in this (the driver's) process
    config = sink_config(primary, secondary, entity=make_queue(), source={"format": "rate", "rows_per_second": 20},
                         checkpoint_location=str(tmp_path / "checkpoint"))
    conf = tmp_path / "writer.json"
    conf.write_text(json.dumps(config))
    assert run_job(jobs.writer_main, ["--conf", str(conf), "--max-batches", "3"]) == jobs.EXIT_QUERY_FAILED
    err = capsys.readouterr().err
    _only_ours(err, "spark-sb-writer")
    assert _lines(err)[-1] == ("spark-sb-writer: the writer query failed after 0 batches (the next run replays its "
                               "batch from the checkpoint): RuntimeError: the metrics table's storage refused the "
                               "append"), err[-2000:]
