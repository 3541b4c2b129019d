"""The commands of the README and the manual, run as written: the step-by-step block of docs/getting-started.md
(after ``<!-- run by tests/spark/test_readme.py: the step-by-step block -->``) is run line by line (a line ending
in ``&`` in the background) in a folder that holds the project's ``.venv``, ``conf`` and ``jobs``, against the
emulator on its default ports; then every row the writer produced is in the primary once and the picture exists.
Then the first pipeline of README.md (the same block as docs/getting-started.md's) runs against that emulator.
Every other ``.venv/bin/...`` command that README.md or a page of docs/ shows answers ``--help``."""

from __future__ import annotations

import collections
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusReceiveMode

from spark_sb import messages
from spark_sb.admin import admin_client
from spark_sb.config import load_config

from .conftest import child_env

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "getting-started.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
MARK = "<!-- run by tests/spark/test_readme.py: the step-by-step block -->"
FIRST_PIPELINE = "<!-- run by tests/spark/test_readme.py: the first pipeline -->"
DEFAULT_PORTS = (5672, 5673, 5300, 5301)
PRIMARY = ("Endpoint=sb://localhost:5672;SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey=SAS_KEY_VALUE;"
           "UseDevelopmentEmulator=true")


def _blocks(text: str) -> list[tuple[int, str]]:
    """``(offset, body)`` of every fenced bash block."""
    return [(m.start(), m.group(1)) for m in re.finditer(r"```bash\n(.*?)```", text, re.S)]


def _commands(block: str) -> list[str]:
    """The block's commands: comments dropped, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [line.split(" #")[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def walkthrough() -> list[str]:
    text = GUIDE.read_text()
    at = text.index(MARK)
    return _commands(next(body for offset, body in _blocks(text) if offset > at))


def first_pipeline(page: Path = README) -> str:
    """The python block after the first pipeline's mark."""
    text = page.read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(FIRST_PIPELINE):], re.S).group(1)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _primary_orders() -> list[str]:
    """Bodies in the primary's ``orders`` queue (received and deleted, pings dropped), until the queue's active
    count is 0: an empty page alone is not the end on a loaded machine (a clean-clone run stopped at one with the
    50 rows the syphon moved home last still in the queue)."""
    bodies: list[str] = []
    deadline = time.monotonic() + 120
    with ServiceBusClient.from_connection_string(PRIMARY, retry_total=1) as client, admin_client(PRIMARY) as admin:
        with client.get_queue_receiver("orders", receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as rx:
            while time.monotonic() < deadline:
                page = rx.receive_messages(max_message_count=250, max_wait_time=2)
                bodies.extend(str(m) for m in page if not messages.is_ping(m))
                if not page and not admin.get_queue_runtime_properties("orders").active_message_count:
                    break
    return bodies


def _backlog_left() -> int | None:
    """Active messages left in the local configuration's backlog queues."""
    from spark_sb.source import backlog_depth  # the Spark 4 edge: this module is also collected on Spark 3.5

    return backlog_depth(load_config(ROOT / "conf" / "local.yaml"))


def test_the_walkthrough_block_is_there_and_runnable() -> None:
    commands = walkthrough()
    assert commands[0].endswith("&") and "emulator start" in commands[0]
    assert any("jobs/syphon.py --conf conf/local.yaml" in c for c in commands)
    assert any(c.startswith(".venv/bin/spark-sb report") for c in commands)


@pytest.mark.slow
@pytest.mark.timeout(780)  # the step-by-step block (about 6 min here), then the first pipeline (about 1 min)
def test_the_readme_commands_work_as_written(tmp_path: Path) -> None:
    busy = [port for port in DEFAULT_PORTS if not _port_free(port)]
    assert not busy, f"the README's emulator needs ports {DEFAULT_PORTS}; in use: {busy}"
    for name in (".venv", "conf", "jobs"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = child_env(SPARK_SB_JVM_LOG=str(tmp_path / "jvm.log"))
    background: list[subprocess.Popen] = []
    outputs: list[str] = []
    try:
        for command in walkthrough():
            if command.endswith("&"):
                log = (tmp_path / "background.log").open("w")
                background.append(subprocess.Popen(shlex.split(command[:-1]), cwd=tmp_path, env=env, stdout=log,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
                deadline = time.monotonic() + 60
                while any(_port_free(p) for p in DEFAULT_PORTS) and time.monotonic() < deadline:
                    assert background[-1].poll() is None, (tmp_path / "background.log").read_text()
                    time.sleep(0.2)
                continue
            done = subprocess.run(shlex.split(command), cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=300)
            outputs.append(f"$ {command}\n{done.stdout}{done.stderr}")
            assert done.returncode == 0, "\n".join(outputs)[-5000:]
        bodies = _primary_orders()
        backlog_left = _backlog_left()
        # the README's first pipeline, against the same emulator (its rows are not the walkthrough's: counted apart)
        pipeline = first_pipeline()
        assert pipeline == first_pipeline(GUIDE)
        done = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", pipeline], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    finally:
        for process in background:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)

    values = [int(b.removeprefix("row ")) for b in bodies]
    assert not [v for v, n in collections.Counter(values).items() if n > 1], "a row arrived twice"
    # the writer runs share one checkpoint: the rate source's rows 0..n-1, every one in the primary
    assert values and sorted(values) == list(range(len(values))), sorted(values)[-5:]
    assert backlog_left == 0  # the syphon's --until-empty left nothing parked
    # a quiet run: Spark's console (Ivy's jar resolution, its log lines) goes to the log file the job names
    writer = next(o for o in outputs if "spark-sb-writer" in o.splitlines()[0])
    assert "console output goes to" in writer and str(tmp_path / "jvm.log") in writer, writer[-2000:]
    assert ":: loading settings" not in writer and "Ivy Default Cache" not in writer, writer[-2000:]
    assert "Ivy Default Cache" in (tmp_path / "jvm.log").read_text()
    status = next(o for o in outputs if "spark-sb status" in o.splitlines()[0])
    parked = sum(int(line.split()[1]) for line in status.splitlines() if "x-servicebus-transfer/" in line)
    assert parked > 0, f"the outage parked nothing:\n{status}"
    totals = re.match(r"(\d+) rows: (\d+) -> primary, .*0 rejected", done.stdout.strip().splitlines()[-1])
    assert totals and int(totals[1]) > 0 and totals[1] == totals[2], done.stdout[-2000:]
    picture = next(tmp_path.glob("data/*.png"))
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000


def _other_commands() -> list[str]:
    """The commands of every bash block of README.md and docs/ but the step-by-step block (which is run)."""
    commands: list[str] = []
    for page in PAGES:
        text = page.read_text()
        for offset, body in _blocks(text):
            if text[:offset].rstrip().endswith(MARK):
                continue
            commands += _commands(body)
    return commands


def test_the_pages_show_commands() -> None:
    commands = _other_commands()
    assert any(c.startswith(".venv/bin/spark-sb report") for c in commands)  # README.md
    assert any("emulator fault --admin" in c for c in commands)  # docs/emulator.md
    assert any(c.startswith(".venv/bin/spark-sb provision") for c in commands)  # docs/paired-sender.md


def test_every_other_command_the_pages_show_answers_help() -> None:
    seen: set[tuple[str, ...]] = set()
    for command in _other_commands():
        words = shlex.split(command.rstrip("&"))
        if not words[0].startswith(".venv/bin/"):
            continue
        program = [str(ROOT / words[0])] + [w for w in words[1:] if w.endswith(".py")][:1]
        subcommands = tuple(w for w in words[1:3] if re.fullmatch(r"[a-z]+", w)) if len(program) == 1 else ()
        key = (*program, *subcommands)
        if key in seen or "bench/" in command:
            continue
        seen.add(key)
        done = subprocess.run([*key, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert done.returncode == 0, f"{command}: {done.stderr[-1000:]}"
