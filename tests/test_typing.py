"""The public API's types as a user's type checker and IDE see them (the package ships ``py.typed``,
tests/test_packaging.py): mypy, the installed one, checks a small program that uses the API correctly (no error,
even with ``--strict``: no untyped call, no ``Any`` leaking out of the API) and one that misuses it (each misuse
reported where an IDE would underline it).

One mypy run checks both snippets (about 15 s), with ``--follow-imports=silent`` as a user's installed package
is: what spark_sb's own modules hold is ``make typecheck``'s business, not the snippets'. The spark_sb checked is
this checkout's (``MYPYPATH``); mypy's cache goes to a temporary directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CORRECT = '''
    import datetime
    from collections.abc import Mapping
    from concurrent.futures import Future

    from azure.servicebus import ServiceBusMessage
    from pyspark.sql import DataFrame, SparkSession

    from spark_sb import (ConfigError, PairedSender, PairedSink, SparkSbConfig, SparkSbError, Syphon, dedupe,
                          load_config, register)
    from spark_sb.paired import SendResult
    from spark_sb.replication import DedupeReceiver, ReplicatingSender, ReplicationResult
    from spark_sb.sink import BatchSummary
    from spark_sb.syphon import MoveSummary

    CONF = {"primary": {"connection_string": "${SB_PRIMARY}"}, "secondary": {"connection_string": "${SB_SECONDARY}"}}


    def configure(path: str) -> SparkSbConfig:
        config = load_config(path)
        interval: datetime.timedelta = config.send_availability.failover_interval
        queues: int = config.send_availability.backlog_queue_count
        mode: str = config.replication.mode
        entity: str | None = config.sink.entity
        print(interval, queues, mode, entity)
        return load_config(CONF)


    def send(config: SparkSbConfig) -> int:
        with PairedSender(config) as sender:
            result: SendResult = sender.send("orders", ServiceBusMessage("hello"))
            where: str | None = result.destination
            counts: Mapping[str, int] = result.destinations
            pending: Future[SendResult] = sender.submit("orders", [ServiceBusMessage("a"), ServiceBusMessage("b")])
            print(where, counts, pending.result().backlog)
            return result.sent + sender.backlog_queue_count


    def replicate(config: SparkSbConfig) -> None:
        with ReplicatingSender.from_config(config) as sender:
            result: ReplicationResult = sender.send("orders", ServiceBusMessage("hello"))
            failed: Mapping[str, BaseException] = result.errors
            print(failed)
        with DedupeReceiver.from_config(config, "orders", window=datetime.timedelta(minutes=5)) as receiver:
            for message in receiver.receive_messages(max_message_count=10, max_wait_time=5):
                receiver.complete_message(message)


    def syphon(config: SparkSbConfig) -> int:
        with Syphon.from_config(config) as mover:
            summary: MoveSummary = mover.run_once(max_messages=100)
            return summary.received


    def pipeline(spark: SparkSession, df: DataFrame, config: SparkSbConfig) -> None:
        register(spark)
        sink = PairedSink(config)
        deduped: DataFrame = dedupe(df, window="10 minutes")
        deduped.writeStream.foreachBatch(sink).start()  # pyspark types the function as returning None
        latest: BatchSummary | None = sink.latest
        print(sink.send_batch(df, 0).sent, latest)
        totals: BatchSummary = sink.totals
        print(totals.sent)


    try:
        send(configure("conf/local.yaml"))
    except ConfigError as err:
        print(err)
    except SparkSbError as err:
        print(err)
'''

#: each misuse, on its own line, with the error code mypy gives it
MISUSED = '''
    from azure.servicebus import ServiceBusMessage

    from spark_sb import PairedSender, PairedSink, Syphon, dedupe, load_config
    from spark_sb.replication import ReplicatingSender

    config = load_config("conf/local.yaml")
    sender = PairedSender(42)  # arg-type
    sender = PairedSender.from_config(3.5)  # arg-type
    result = PairedSender(config).send("orders", ServiceBusMessage("hello"))
    print(result.destinaton)  # attr-defined
    print(result.sent.upper())  # attr-defined
    print(config.send_availabilty)  # attr-defined
    seconds: float = config.send_availability.failover_interval  # assignment
    PairedSender(config).send(["orders"], ServiceBusMessage("hello"))  # arg-type
    PairedSender(config).send("orders", "hello")  # arg-type
    Syphon(config, clock=3)  # arg-type
    PairedSink("conf/local.yaml")  # arg-type
    ReplicatingSender(config, retries=3)  # call-arg
    dedupe("events", window="10 minutes")  # arg-type
'''


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[int, str, str]]]:
    """mypy --strict on both snippets at once: each one's errors as (line, code, message)."""
    workdir = tmp_path_factory.mktemp("typing")
    snippets = {name: workdir / f"{name}.py" for name in ("correct", "misused")}
    snippets["correct"].write_text(textwrap.dedent(CORRECT))
    snippets["misused"].write_text(textwrap.dedent(MISUSED))
    config = workdir / "mypy.ini"  # a user's configuration: none, but what is on the command line
    config.write_text("[mypy]\n")
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    env.pop("PYTHONPATH", None)
    ran = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(config), "--python-version", "3.11", "--strict",
         "--follow-imports", "silent", "--cache-dir", str(workdir / "mypy-cache"), "--show-error-codes",
         "--no-error-summary", "--no-color-output", *map(str, snippets.values())],
        capture_output=True, text=True, timeout=180, env=env, cwd=workdir)
    assert ran.returncode in (0, 1), f"mypy failed to run:\n{ran.stdout}\n{ran.stderr}"
    errors: dict[str, list[tuple[int, str, str]]] = {name: [] for name in snippets}
    for m in re.finditer(r"^(?P<file>[^:\n]+):(?P<line>\d+): error: (?P<message>.*?)  \[(?P<code>[\w-]+)\]$",
                         ran.stdout, re.MULTILINE):
        errors[Path(m["file"]).stem].append((int(m["line"]), m["code"], m["message"]))
    return errors


def test_a_program_that_uses_the_public_api_correctly_type_checks_strictly(
        checked: dict[str, list[tuple[int, str, str]]]) -> None:
    errors = checked["correct"]
    assert errors == [], "\n".join(f"line {n}: {message} [{code}]" for n, code, message in errors)


def test_each_misuse_of_the_public_api_is_reported_where_it_is(checked: dict[str, list[tuple[int, str, str]]]) -> None:
    lines = textwrap.dedent(MISUSED).splitlines()
    expected = {(n, line.rsplit("# ", 1)[1]) for n, line in enumerate(lines, 1) if "  # " in line}
    found = {(n, code) for n, code, _ in checked["misused"]}
    assert found == expected, "\n".join(f"line {n}: {lines[n - 1].strip()} -> {sorted(c for m, c in found if m == n)}"
                                        for n in sorted({n for n, _ in found ^ expected}))
