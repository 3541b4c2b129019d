"""Issue 34 item 7: a syphon job (``jobs/syphon.py``, its own process and Spark) killed with SIGKILL while its
reader is busy receiving leaves no Python process behind. Spark starts the reader's process (the streaming source
runner) as a plain child of the JVM; that process reads Spark's socket only between calls, so a reader busy in
``latestOffset`` did not notice the JVM's death, and went on receiving and deferring (holding message locks) as an
orphan. :func:`spark_sb.lifeline.watch_parent` ends it within about a second of its parent's death.

The backlog namespace is far (every byte delayed), so that deferring a batch takes a long time: the job is killed
once the first messages are deferred, that is while its reader is in the middle of the batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusMessageState
from pairing import pair_config

from spark_sb import messages
from spark_sb.bus import close_all
from spark_sb.emulator import Emulator, NamespaceOptions
from spark_sb.emulator.model import QueueSpec

from .conftest import child_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

_JOBS = Path(__file__).resolve().parents[2] / "jobs"
#: one way, on every AMQP byte of the backlog namespace: a defer (one round trip per message) takes 2 x this
_LATENCY = 0.15
#: messages per backlog queue: deferring them one by one takes far longer than the test waits after the kill
_PER_QUEUE = 150
_MARK = "SPARK_SB_ORPHAN_TEST"


@pytest.fixture(scope="module")
def far() -> Iterator[Emulator]:
    """A near primary and a far secondary (the backlog queues' namespace)."""
    emu = Emulator([NamespaceOptions("primary"), NamespaceOptions("secondary", latency=_LATENCY)])
    with emu:
        yield emu


def _marked(mark: str) -> dict[int, str]:
    """``pid: command line`` of every live process whose environment carries ``mark`` (the job's processes:
    its driver, its JVM and every Python process Spark started; they inherit the environment)."""
    found = {}
    needle = f"{_MARK}={mark}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                if stat.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue  # dead, not reaped yet
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if needle not in environ.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                found[int(entry)] = cmdline.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def _tree(pids: dict[int, str]) -> str:
    lines = []
    for pid, cmd in sorted(pids.items()):
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            lines.append(f"{pid} ppid={int(fields[1])} pgid={int(fields[2])} sid={int(fields[3])} {cmd}")
        except OSError:
            lines.append(f"{pid} (gone) {cmd}")
    return "\n".join(lines)


def _deferred(connection_string: str, queues: list[str]) -> int:
    with ServiceBusClient.from_connection_string(connection_string, retry_total=0) as client:
        count = 0
        for queue in queues:
            with client.get_queue_receiver(queue) as receiver:
                page = receiver.peek_messages(max_message_count=_PER_QUEUE + 10)
                count += sum(1 for m in page if m.state == ServiceBusMessageState.DEFERRED)
    return count


@pytest.mark.parametrize("kill", ["driver"])  # "jvm" fails and passes alike (each case takes about 45 s)
def test_a_killed_syphon_job_leaves_no_python_process_behind(far, tmp_path, kill) -> None:
    """``driver``: SIGKILL of the job's own process (``python jobs/syphon.py``; its JVM then exits as its stdin
    closes); ``jvm``: SIGKILL of the JVM alone (what spark-submit's top process or the OOM killer is). Either way
    the reader's process, a child of the JVM, loses its parent in the middle of a batch. (SIGKILL of the job's whole
    process group kills the reader's process too: it is in the JVM's group.)"""
    primary, secondary = far["primary"], far["secondary"]
    destination = f"orphans-{uuid.uuid4().hex[:8]}"
    far.server("primary").call(lambda: far.server("primary").broker.create_entity(QueueSpec(name=destination)))
    cfg = pair_config(primary, secondary, "or", backlog_queue_count=2)
    prefix = cfg["send_availability"]["backlog_prefix"]
    queues = [f"{prefix}/x-servicebus-transfer/{i}" for i in range(2)]
    server = far.server("secondary")
    for name in queues:
        server.call(lambda name=name: server.broker.create_entity(QueueSpec(name=name, lock_duration=60)))
    with ServiceBusClient.from_connection_string(secondary.connection_string, retry_total=0) as client:
        for queue in queues:
            with client.get_queue_sender(queue) as sender:
                sender.send_messages([messages.to_backlog(ServiceBusMessage(f"body {i}", message_id=f"m{i}"),
                                                          destination) for i in range(_PER_QUEUE)])
    cfg["syphon"] = {"retry_interval": "1s", "checkpoint_location": str(tmp_path / "checkpoint"),
                     "ledger": str(tmp_path / "ledger"), "max_messages_per_trigger": 2 * _PER_QUEUE}
    conf = tmp_path / "syphon.yaml"
    conf.write_text(json.dumps(cfg))
    log = tmp_path / "job.log"
    mark = uuid.uuid4().hex
    command = [sys.executable, str(_JOBS / "syphon.py"), "--conf", str(conf)]
    with log.open("w") as out:
        job = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=child_env(**{_MARK: mark}),
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _deferred(secondary.connection_string, queues):  # the reader is deferring its first batch
            assert job.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the job never deferred: " + log.read_text()[-3000:]
            time.sleep(0.2)
        before = _marked(mark)
        runner = [pid for pid, cmd in before.items() if "python_streaming_source_runner" in cmd]
        assert len(runner) == 1, _tree(before)
        if kill == "driver":
            os.kill(job.pid, signal.SIGKILL)
        else:
            jvm = [pid for pid, cmd in before.items() if cmd.split()[0].endswith("java")]
            assert len(jvm) == 1, _tree(before)
            os.kill(jvm[0], signal.SIGKILL)
        killed = time.monotonic()
        left = _marked(mark)
        while left and time.monotonic() < killed + 15:
            time.sleep(0.2)
            left = _marked(mark)
        assert not left, (f"still alive {time.monotonic() - killed:.0f} s after the kill:\n{_tree(left)}\n"
                          f"before the kill:\n{_tree(before)}")
        assert _deferred(secondary.connection_string, queues) < 2 * _PER_QUEUE  # it was killed mid-batch
    finally:
        for pid in _marked(mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        close_all()
