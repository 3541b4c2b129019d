"""The emulator's live page during the demo, in screenshots: runs ``jobs/demo.py`` (what ``make demo`` runs), opens
the page it prints in Debian's Chromium (headless, Playwright) and saves the page while the primary is down and the
backlog queues fill, and once the syphon has drained them (docs/emulator.md shows both)::

    .venv/bin/python bench/page_shots.py [--out docs/img] [demo options, e.g. --batches 20]

Exits with the demo's status. It needs what the browser tests need: ``chromium`` on PATH (``make chromium``).
"""

from __future__ import annotations

import argparse
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from playwright.sync_api import Page, expect, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
#: batches after the outage's start before the first screenshot: the backlog queues have some rows by then
BATCHES_INTO_OUTAGE = 3


def _lines(proc: subprocess.Popen[str], out: queue.Queue[str | None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        out.put(line.rstrip("\n"))
    out.put(None)


def _until(lines: queue.Queue[str | None], pattern: str, timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            raise SystemExit(f"the demo ended before printing {pattern!r}")
        if found := re.search(pattern, line):
            return found
    raise SystemExit(f"the demo did not print {pattern!r} within {timeout:g} s")


def _shoot(page: Page, path: Path) -> None:
    page.screenshot(path=str(path), full_page=True)
    print(f"page_shots: saved {path}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "page-shots",
                        help="where the two screenshots go (default: build/page-shots)")
    args, demo_args = parser.parse_known_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("page_shots needs Chromium on PATH (make chromium; Debian: apt-get install chromium)")
    args.out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "demo.py"), "--no-picture", *demo_args],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_lines, args=(proc, lines), daemon=True).start()
    try:
        url = _until(lines, r"watch both namespaces live.*: (http://\S+)", 120).group(1)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True, args=ARGS)
            page = browser.new_page(viewport={"width": 1600, "height": 900})
            page.goto(url)
            _until(lines, r">>> the primary namespace is DOWN", 600)
            for _ in range(BATCHES_INTO_OUTAGE):
                _until(lines, r"^batch ", 120)
            expect(page.locator("#ns-primary .state")).to_have_text("DOWN")
            page.wait_for_timeout(1500)  # the next poll shows the batch just sent
            _shoot(page, args.out / "emulator-page-outage.png")
            _until(lines, r"^syphon: batches", 900)  # the syphon has drained the backlog; the emulator is up
            page.wait_for_timeout(1500)
            _shoot(page, args.out / "emulator-page-after-syphon.png")
            browser.close()
        return proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
