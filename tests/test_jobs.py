"""The writer job (``spark-sb-writer``, :mod:`spark_sb.jobs`) checks the credentials of what its sink sends to
before Spark starts (issue 46's walk): with a wrong key for the secondary it sent every batch to a healthy primary
and exited 0, so the mistake would have shown at the first failover, in an outage. The console script as a user
runs it, against the emulator pair; no Spark starts in these tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from pairing import pair_config

from spark_sb import CredentialRejectedError
from spark_sb.config import load_config
from spark_sb.jobs import writer_credentials

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(sys.executable).parent / "spark-sb-writer"
WRONG = "SharedAccessKey=not-the-key"


def _config(primary: Any, secondary: Any, queue: str, tmp_path: Path, wrong: str | None = None) -> dict:
    config = pair_config(primary, secondary, "jw", backlog_queue_count=2, primary_try_timeout="3s")
    if wrong:
        section = config[wrong]
        section["connection_string"] = section["connection_string"].replace("SharedAccessKey=SAS_KEY_VALUE", WRONG)
        assert WRONG in section["connection_string"]
    config["sink"] = {"entity": queue, "source": {"format": "rate", "rows_per_second": 1},
                      "checkpoint_location": str(tmp_path / "checkpoint")}
    return config


def _writer(config: dict, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    path = tmp_path / "spark-sb.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "SPARK_SB_JVM_LOG": str(tmp_path / "jvm.log")}
    started = time.monotonic()
    done = subprocess.run([str(SCRIPT), "--conf", str(path), "--max-batches", "1"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    return done, time.monotonic() - started


@pytest.mark.parametrize("wrong", ["secondary", "primary"])
def test_the_writer_refuses_a_wrong_key_before_spark_starts(primary, secondary, make_queue, tmp_path,
                                                           wrong) -> None:
    queue = make_queue()
    done, took = _writer(_config(primary, secondary, queue, tmp_path, wrong), tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # no "starting Spark": nothing started
    entity = queue if wrong == "primary" else "jw"
    assert lines[0].startswith(f"spark-sb-writer: CredentialRejectedError: the {wrong} namespace (localhost:"), lines
    assert f"refused the credential for '{entity}" in lines[0] and "401" in lines[0], lines
    assert "not-the-key" not in done.stderr + done.stdout
    assert took < 60, f"{took:.0f} s"


def test_the_credential_check_leaves_an_outage_to_the_sink(emulator, primary, secondary, make_queue,
                                                            tmp_path) -> None:
    """The writer must start while the primary is down (that is what it is for): no answer is not a refusal."""
    config = load_config(_config(primary, secondary, make_queue(), tmp_path))
    emulator.fault("primary", "down")
    started = time.monotonic()
    writer_credentials(config)  # returns: the sink fails over
    assert time.monotonic() - started < 30
    emulator.heal("primary")
    with pytest.raises(CredentialRejectedError, match=r"^the secondary namespace \(localhost:\d+\) refused"):
        writer_credentials(load_config(_config(primary, secondary, make_queue(), tmp_path, "secondary")))
