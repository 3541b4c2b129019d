"""The end of ``make demo`` (jobs/demo.py): its count of every row is its own assertion. CI runs the demo itself
(``.ci/run``, before ``make test``); these tests hold the count to what a user reads as clean."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _demo():
    spec = importlib.util.spec_from_file_location("spark_sb_demo", ROOT / "jobs" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


demo = _demo()
PRODUCED = [f"id-{n}" for n in range(10)]


def test_every_row_in_the_primary_once_is_clean() -> None:
    count = demo.Count.of(PRODUCED, list(reversed(PRODUCED)), {"sb://s/backlog-0": []}, {})
    assert count.clean
    assert "lost:                      0" in count.lines()
    assert count.lines()[-1] == "every row is in the primary once"


@pytest.mark.parametrize(("in_primary", "in_backlog", "dead", "what"), [
    (PRODUCED[:-1], {}, {}, "lost:                      1"),
    (PRODUCED + PRODUCED[:1], {}, {}, "duplicated:                1"),
    (PRODUCED[:-1], {"sb://s/backlog-1": PRODUCED[-1:]}, {}, "left in the backlog:       1  backlog-1: 1"),
    (PRODUCED[:-1], {}, {"MaxDeliveryCountExceeded": 1}, "dead-lettered:             1  MaxDeliveryCountExceeded: 1"),
    (PRODUCED + ["id-other"], {}, {}, "not produced by this run:  1"),
    ([], {}, {}, "in the primary 'orders':    0"),
], ids=["lost", "duplicated", "left", "dead-lettered", "unexpected", "nothing"])
def test_a_row_lost_duplicated_or_left_is_not_clean(in_primary, in_backlog, dead, what) -> None:
    produced = PRODUCED if in_primary else []
    count = demo.Count.of(produced, in_primary, in_backlog, dead)
    assert not count.clean
    assert what in [line.rstrip() for line in count.lines()]
    assert count.lines()[-1].startswith("NOT CLEAN")


def test_ci_runs_the_demo_before_the_tests() -> None:
    """The README's two commands, both, in that order: a broken demo fails CI."""
    commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith(("#", "set ", "cd "))]
    assert commands == ["make demo", "make test"]
    assert re.search(r"^set -euo pipefail$", (ROOT / ".ci" / "run").read_text(), re.M)


#: reStructuredText a terminal shows as it is: ``literal``, :func:`name`, `text`_ (as tests/paired/test_cli.py)
RST = re.compile(r"``|:[a-z]+:`|`_\b")


@pytest.mark.parametrize("job", ["demo.py", "paired_writer.py", "syphon.py"])
def test_the_jobs_help_reads_as_plain_text_and_says_every_option(job: str) -> None:
    """``python jobs/<job> --help`` as the getting-started page runs the jobs: the demo's showed its docstring's
    reStructuredText (``--picture``), pointed at a behaviour.md the manual does not have, and left --conf and
    --batches unexplained (issue 46's walk)."""
    done = subprocess.run([sys.executable, str(ROOT / "jobs" / job), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert not RST.search(done.stdout), done.stdout
    assert "behaviour.md" not in done.stdout
    options = done.stdout[done.stdout.index("\noptions:"):]
    # each option's line (or the line after a long one) says something beyond its name
    for match in re.finditer(r"^  (-[^\n]*)$", options, re.M):
        line = match.group(1)
        said = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        following = options[match.end():].split("\n", 2)[1] if match.end() < len(options) else ""
        assert len(said) > 1 or following.startswith(" " * 10), f"{job} --help: {line.strip()} has no help"


def test_the_demo_trigger_takes_a_duration_like_every_other() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "jobs" / "demo.py"), "--trigger", "soon"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "--trigger" in done.stderr, done.stderr
    assert demo.seconds_argument("500ms") == 0.5 and demo.seconds_argument("2") == 2.0


def test_the_demo_prints_the_address_of_a_live_page_of_both_namespaces(tmp_path: Path) -> None:
    """Issue 52: the demo's emulator pair, and the line it prints at its start: the page answers there."""
    import requests

    with demo._emulator(tmp_path, free_ports=True) as emu:
        line = demo._page_line(emu, "the outage")
        url = line.rsplit(": ", 1)[1]
        page = requests.get(url, timeout=10)
    assert line.startswith("watch both namespaces live (the outage): http://localhost:")
    assert page.status_code == 200
    assert 'id="ns-primary"' in page.text and 'id="ns-secondary"' in page.text and ">orders<" in page.text
