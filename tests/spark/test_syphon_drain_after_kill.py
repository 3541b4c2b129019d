"""Issue 39: a syphon job (``jobs/syphon.py``, its own process and Spark) killed with SIGKILL mid-run leaves its
batch deferred in the backlog queues, and a deferred message is never delivered to a receive. ``Syphon.drain``,
run alone without Spark as docs/syphon.md offers, takes them back and moves them home once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusMessageState, ServiceBusSubQueue
from pairing import peek_all

from spark_sb import messages
from spark_sb.bus import close_all
from spark_sb.emulator.model import QueueSpec
from spark_sb.syphon import X_MS_REPARKED_FROM, Syphon

from .conftest import child_env, receive_all, sink_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

_JOBS = Path(__file__).resolve().parents[2] / "jobs"
#: the backlog queues' lock duration: messages the dead job had received and not yet deferred come back this soon
_LOCK = 5.0


@pytest.fixture
def setup(emulator: Any, primary: Any, secondary: Any, tmp_path: Path) -> Iterator[dict]:
    """Two backlog queues with a short lock and a syphon configuration (small batches) written to a file."""
    cfg = sink_config(primary, secondary)
    cfg.pop("sink")
    cfg["syphon"] = {"retry_interval": "1s", "checkpoint_location": str(tmp_path / "checkpoint"),
                     "ledger": str(tmp_path / "ledger"), "max_messages_per_trigger": 20}
    prefix = cfg["send_availability"]["backlog_prefix"]
    server = emulator.server("secondary")
    queues = [f"{prefix}/x-servicebus-transfer/{i}" for i in range(2)]
    for name in queues:
        server.call(lambda name=name: server.broker.create_entity(
            QueueSpec(name=name, max_delivery_count=2**31 - 1, lock_duration=_LOCK)))
    conf = tmp_path / "syphon.yaml"
    conf.write_text(json.dumps(cfg))
    yield {"config": cfg, "queues": queues, "conf": conf, "log": tmp_path / "job.log"}
    close_all()


def _park(secondary: Any, queues: list[str], parked: list[tuple[str, str]]) -> None:
    """Park ``(destination, message id)`` pairs, spread over the backlog queues in turn."""
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        for q, queue in enumerate(queues):
            with client.get_queue_sender(queue) as sender:
                sender.send_messages([messages.to_backlog(ServiceBusMessage(f"body {i}", message_id=i), entity)
                                      for entity, i in parked[q::len(queues)]])


def _backlog(secondary: Any, queues: list[str]) -> list[Any]:
    return [m for queue in queues for m in peek_all(secondary.connection_string, queue, tries=3)]


def _with_copies(secondary: Any, queues: list[str]) -> list[str]:
    """``queue:sequence number`` of the deferred originals whose re-parked copy is in the backlog too."""
    found = []
    for queue in queues:
        backlog = peek_all(secondary.connection_string, queue, tries=3)
        copied = {messages.text(value) for m in backlog for key, value in (m.application_properties or {}).items()
                  if messages.text(key) == X_MS_REPARKED_FROM}
        found += [f"{queue}:{m.sequence_number}" for m in _deferred(backlog)
                  if f"{queue}:{m.sequence_number}" in copied]
    return found


def _deferred(backlog: list[Any]) -> list[Any]:
    return [m for m in backlog if m.state == ServiceBusMessageState.DEFERRED]


def _kill_when(setup: dict, condition: Callable[[], bool], timeout: float = 150) -> None:
    """Start the syphon job (streaming, no --until-empty) and kill it with SIGKILL (the driver, its JVM and its
    Python workers) once ``condition()`` holds. The job is stopped (SIGSTOP) before ``condition()`` is asked
    again: what holds while it is frozen is what the kill leaves, never a state it moved on from meanwhile."""
    command = [sys.executable, str(_JOBS / "syphon.py"), "--conf", str(setup["conf"])]
    with setup["log"].open("w") as out:
        job = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if condition():
                os.killpg(job.pid, signal.SIGSTOP)
                if condition():
                    break
                os.killpg(job.pid, signal.SIGCONT)
            assert job.poll() is None, setup["log"].read_text()[-3000:]
            assert time.monotonic() < deadline, "the job never got there: " + setup["log"].read_text()[-3000:]
            time.sleep(0.1)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def _drain_alone(setup: dict, secondary: Any) -> Any:
    """What an operator does after the crash: wait for the dead job's locks to expire, then drain, no Spark."""
    time.sleep(_LOCK + 0.5)
    with Syphon.from_config(setup["config"]) as syphon:
        summary = syphon.drain(max_wait_time=2.0)
    left = _backlog(secondary, setup["queues"])
    assert left == [], [(m.message_id, m.state) for m in left]  # nothing active, nothing deferred
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        for queue in setup["queues"]:
            with client.get_queue_receiver(queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as receiver:
                assert receiver.peek_messages(max_message_count=10) == []
    return summary


def test_drain_alone_after_a_killed_job_empties_the_backlog_and_delivers_every_message_once(
        emulator, setup, primary, secondary, make_queue) -> None:
    """One job, two destinations, killed mid-batch once it has both (then drain, no Spark):

    * ``sent``, with duplicate detection: the job sent part of its batch and died before completing it; drain
      sends those again with the same message id, and the primary makes them duplicates, not second copies;
    * ``down``, no duplicate detection, down while the job runs: the job sent nothing there, it re-parked
      copies, and died before completing the originals; drain completes those originals without sending them
      (their copies carry them, as for a replayed batch of the job), so nothing hides a second copy."""
    sent = make_queue(requires_duplicate_detection=True)
    down = make_queue()
    queues = setup["queues"]
    ids = {entity: [f"{tag}{i:03d}" for i in range(60)] for entity, tag in ((sent, "s"), (down, "d"))}
    _park(secondary, queues, [(entity, i) for n in range(60) for entity in (sent, down) for i in ids[entity][n:n + 1]])

    def mid_batch() -> bool:  # a batch's copies re-parked and some of it sent, none of it completed yet
        deferred = {str(m.message_id) for m in _deferred(_backlog(secondary, queues))}
        home = {str(m.message_id) for m in peek_all(primary.connection_string, sent, tries=3)}
        return bool(deferred & home) and bool(_with_copies(secondary, queues))

    emulator.fault("primary", "down", entity=down)
    try:
        _kill_when(setup, mid_batch)
    finally:
        emulator.heal("primary", entity=down)
    assert mid_batch()  # frozen, then killed: what it left
    backlog = _backlog(secondary, queues)
    summary = _drain_alone(setup, secondary)
    assert summary.taken_back >= len(_deferred(backlog)) > 0
    for entity in (sent, down):
        arrived = [str(m.message_id) for m in receive_all(primary.connection_string, entity, wait=1.0)]
        assert sorted(arrived) == ids[entity], entity  # every message, once
