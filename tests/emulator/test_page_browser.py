"""The emulator's live page in a real browser: Debian's Chromium, headless, driven by Playwright (never a browser of
Playwright's own). Each step's screenshot is saved in build/page-screenshots/ (named after the test and the step).

make test installs Chromium where it may (Makefile: chromium); without it these tests fail saying what to install."""

from __future__ import annotations

import http.server
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.exceptions import ServiceBusError
from playwright import sync_api
from playwright.sync_api import Page, expect

from spark_sb.emulator import Emulator, NamespaceInfo, NamespaceOptions

SCREENSHOTS = Path(__file__).resolve().parents[2] / "build" / "page-screenshots"
SECRET = "the-locked-namespace-key"
ENTITIES = {"queues": [{"name": "orders"}, {"name": "audit"}],
            "topics": [{"name": "events", "subscriptions": [{"name": "all"}]}]}
#: what a headless Chromium needs here: no sandbox (root in a container), no GPU, nothing fetched from the network
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-default-apps"]


def _chromium() -> str:
    path = os.environ.get("SPARK_SB_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("the emulator page's browser tests need Chromium on PATH: apt-get install chromium (make test "
                    "installs it when it runs as root), or SPARK_SB_CHROMIUM=/path/to/chromium")
    return path


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    with Emulator([NamespaceOptions("primary"), NamespaceOptions("secondary"), NamespaceOptions("locked", key=SECRET)],
                  data_dir=tmp_path_factory.mktemp("page-browser"), entities=ENTITIES) as e:
        yield e


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sync_api.BrowserContext]:
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=_chromium(), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1600, "height": 1000}, timeout=60_000)
        context.set_default_timeout(15_000)
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser: sync_api.BrowserContext, emu: Emulator) -> Iterator[Page]:
    """The live page on the primary's admin port, loaded and polling; the script's errors fail the test."""
    tab = browser.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda err: errors.append(str(err)))
    tab.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    elsewhere: list[str] = []  # the page loads nothing but from its own emulator: it works without a network
    tab.on("request", lambda r: None if r.url.startswith(emu["primary"].admin_url + "/") else elsewhere.append(r.url))
    tab.goto(emu["primary"].page_url)
    expect(tab.locator("#updated")).to_contain_text("live: updated")
    yield tab
    tab.close()
    for name in emu.info:
        emu.heal(name)
    refused = [e for e in errors if "401" not in e and "403" not in e]  # refusals the tests ask for
    assert not refused, f"the page's script failed: {refused}"
    assert not elsewhere, f"the page asked for something elsewhere: {elsewhere}"


class Shots:
    """Saves a test's steps as build/page-screenshots/<test>-<n>-<step>.png."""

    def __init__(self, test: str) -> None:
        self.test = test
        self.taken = 0
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    def __call__(self, tab: Page, step: str) -> Path:
        self.taken += 1
        path = SCREENSHOTS / f"{self.test}-{self.taken:02d}-{step}.png"
        tab.screenshot(path=str(path), full_page=True)
        return path


@pytest.fixture
def shot(request: pytest.FixtureRequest) -> Shots:
    return Shots(request.node.name)


def send(info: NamespaceInfo, queue: str, *messages: ServiceBusMessage) -> None:
    with ServiceBusClient.from_connection_string(info.connection_string, retry_total=0) as c, \
            c.get_queue_sender(queue) as s:
        s.send_messages(list(messages))


def count_cell(tab: Page, namespace: str, entity: str, count: str) -> sync_api.Locator:
    return tab.locator(f'#ns-{namespace} tr[data-entity="{entity}"] td[data-count="{count}"]')


def test_the_page_loads_and_its_counts_follow_the_sdk(page: Page, emu: Emulator, shot: Shots) -> None:
    for name in ("primary", "secondary", "locked"):
        expect(page.get_by_role("heading", name=name)).to_be_visible()
    expect(page.get_by_role("table", name="Entities of secondary")).to_be_visible()
    cell = count_cell(page, "secondary", "audit", "active")
    before = int(cell.inner_text())
    shot(page, "loaded")
    send(emu["secondary"], "audit", *(ServiceBusMessage(f"row {i}") for i in range(5)))
    expect(cell).to_have_text(str(before + 5))  # no reload: the script's poll
    shot(page, "five-sent")
    assert page.evaluate("performance.getEntriesByType('navigation').length") == 1


def test_a_fault_set_on_the_page_takes_the_namespace_down_and_heal_brings_it_back(page: Page, emu: Emulator, shot: Shots) -> None:
    primary = emu["primary"]
    page.get_by_label("Namespace", exact=True).select_option("primary")
    page.get_by_label("Fault", exact=True).select_option("down")
    page.get_by_role("button", name="Set fault").click()
    expect(page.locator("#fault-result")).to_have_text("fault down set on namespace primary until healed")
    expect(page.locator("#ns-primary .state")).to_have_text("DOWN")
    shot(page, "primary-down")
    with pytest.raises(ServiceBusError):
        send(primary, "orders", ServiceBusMessage("while the primary is down"))
    page.get_by_role("button", name="Heal down on namespace primary").click()
    expect(page.locator("#ns-primary .state")).to_have_text("up")
    expect(page.get_by_role("table", name="Faults in force on primary")).to_have_count(0)
    shot(page, "healed")
    send(primary, "orders", ServiceBusMessage("after the heal"))


def test_an_entity_fault_for_a_while_from_the_page(page: Page, emu: Emulator, shot: Shots) -> None:
    page.get_by_label("Namespace", exact=True).select_option("secondary")
    page.get_by_label("Entity (empty: the whole namespace)").fill("orders")
    page.get_by_label("Fault", exact=True).select_option("busy")
    page.get_by_label("For seconds (empty: until healed)").fill("60")
    page.get_by_role("button", name="Set fault").click()
    expect(page.locator("#fault-result")).to_have_text("fault busy set on orders on secondary for 60 s")
    faults = page.get_by_role("table", name="Faults in force on secondary")
    expect(faults).to_contain_text("busy")
    expect(faults).to_contain_text("s left")
    shot(page, "entity-busy")
    with pytest.raises(ServiceBusError):
        send(emu["secondary"], "orders", ServiceBusMessage("busy"))
    send(emu["secondary"], "audit", ServiceBusMessage("another queue is not faulted"))
    page.get_by_role("button", name="Heal", exact=True).click()  # the form's: heals what it names
    expect(page.locator("#fault-result")).to_have_text("healed orders on secondary: busy on orders")
    expect(faults).to_have_count(0)
    send(emu["secondary"], "orders", ServiceBusMessage("healed"))


def test_a_peek_shows_a_message_and_a_dead_letter_with_its_reason(page: Page, emu: Emulator, shot: Shots) -> None:
    primary = emu["primary"]
    send(primary, "audit", ServiceBusMessage("<script>alert(1)</script> order 42", subject="order-created",
                                             correlation_id="corr-42", application_properties={"region": "west"}))
    page.get_by_role("button", name="Peek audit on primary").click()
    newest = page.locator("details.message").first
    expect(newest.locator("summary")).to_be_visible()
    newest.locator("summary").click()
    expect(newest).to_contain_text("order-created")
    expect(newest).to_contain_text("corr-42")
    expect(newest).to_contain_text("region")
    expect(newest).to_contain_text("west")
    expect(newest.locator("pre")).to_have_text("<script>alert(1)</script> order 42")  # shown, not run
    shot(page, "peek")
    send(primary, "orders", ServiceBusMessage("poison", message_id="poison-7"))
    with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as c, \
            c.get_queue_receiver("orders", max_wait_time=5) as r:
        poisoned = False
        while not poisoned and (batch := r.receive_messages(50, max_wait_time=5)):  # a receive may return early
            for m in batch:
                if m.message_id == "poison-7":
                    r.dead_letter_message(m, reason="SchemaError", error_description="amount is not a number")
                    poisoned = True
                else:
                    r.complete_message(m)
        assert poisoned
    expect(count_cell(page, "primary", "orders", "dead_letter")).not_to_have_text("0")
    page.get_by_role("button", name="Dead letters of orders on primary").click()
    poison = page.locator("details.message", has_text="poison-7")
    expect(poison.locator("summary")).to_contain_text("SchemaError")
    poison.locator("summary").click()
    expect(poison).to_contain_text("amount is not a number")
    shot(page, "dead-letter")


def test_a_namespace_with_its_own_key_needs_it_on_the_page(page: Page, emu: Emulator, shot: Shots) -> None:
    page.get_by_label("Namespace", exact=True).select_option("locked")
    page.get_by_label("Fault", exact=True).select_option("down")
    page.get_by_role("button", name="Set fault").click()
    expect(page.locator("#fault-result")).to_contain_text("namespace locked has a key of its own")
    send(emu["locked"], "orders", ServiceBusMessage("not down"))
    page.get_by_label("Key of a namespace with its own key (or a SAS token)").fill(SECRET)
    page.get_by_role("button", name="Set fault").click()
    expect(page.locator("#ns-locked .state")).to_have_text("DOWN")
    shot(page, "locked-down-with-key")
    with pytest.raises(ServiceBusError):
        send(emu["locked"], "orders", ServiceBusMessage("down"))


def test_the_page_says_when_it_cannot_reach_the_emulator(browser: sync_api.BrowserContext,
                                                         tmp_path: Path, shot: Shots) -> None:
    """The emulator stopped under an open page: the page says so (its last counts stay), it does not freeze."""
    with Emulator([NamespaceOptions("alone")], data_dir=tmp_path, entities=ENTITIES) as alone:
        tab = browser.new_page()
        tab.goto(alone["alone"].page_url)
        expect(tab.locator("#updated")).to_contain_text("live: updated")
    try:
        expect(tab.locator("#updated")).to_contain_text("cannot reach the emulator")
        expect(tab.locator("#updated")).to_have_class("stale")
        expect(tab.locator("#namespaces")).to_have_class("stale")  # the last counts, dimmed
        expect(tab.get_by_role("table", name="Entities of alone")).to_be_visible()
        shot(tab, "emulator-stopped")
    finally:
        tab.close()


def test_a_poll_that_is_never_answered_shows_as_unreachable_and_the_poll_goes_on(page: Page, shot: Shots) -> None:
    """The page's requests are bounded: an answer that never comes (held here by the browser) is a timeout."""
    held: list[sync_api.Route] = []
    page.route("**/$page/namespaces", lambda route: held.append(route))  # accepted, never answered
    expect(page.locator("#updated")).to_contain_text("cannot reach the emulator", timeout=30_000)
    shot(page, "never-answered")
    page.unroute("**/$page/namespaces")
    assert held  # the poll was held, and went on after its timeout
    expect(page.locator("#updated")).to_contain_text("live: updated", timeout=30_000)


class _AttackerPage(http.server.BaseHTTPRequestHandler):
    """Another site's page (another origin) that posts forms and a no-cors fetch to the emulator's fault endpoints."""

    target = ""

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        target = self.target
        body = f"""<!doctype html><html><body><h1>another site</h1>
<iframe name="sink" title="sink"></iframe>
<form id="plain" method="POST" action="{target}/$page/fault" enctype="text/plain" target="sink">
<input name='{{"namespace":"primary","kind":"down","x":"' value='"}}'></form>
<form id="urlencoded" method="POST" action="{target}/$emulator/fault" target="sink">
<input name="kind" value="down"></form>
<script>
document.getElementById("plain").submit();
setTimeout(() => document.getElementById("urlencoded").submit(), 300);
fetch("{target}/$page/fault", {{method: "POST", mode: "no-cors", body: '{{"namespace":"primary","kind":"down"}}',
  headers: {{"Content-Type": "text/plain"}}}}).finally(() => {{ document.title = "sent"; }});
</script></body></html>""".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def test_a_cross_site_form_post_cannot_set_a_fault(browser: sync_api.BrowserContext, emu: Emulator,
                                                   shot: Shots) -> None:
    primary = emu["primary"]
    handler = type("Attacker", (_AttackerPage,), {"target": f"http://localhost:{primary.admin_port}"})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    tab = browser.new_page()
    try:
        answers: list[tuple[str, int]] = []
        tab.on("response", lambda r: answers.append((r.url, r.status)) if "fault" in r.url else None)
        tab.goto(f"http://127.0.0.1:{server.server_address[1]}/")  # another origin than localhost:<admin port>
        expect(tab).to_have_title("sent")
        deadline = time.monotonic() + 30
        while len(answers) < 3 and time.monotonic() < deadline:  # the second form posts 300 ms after the first
            tab.wait_for_timeout(100)
        shot(tab, "attacker-page")
        assert len(answers) == 3 and all(status in (403, 415) for _, status in answers), answers
    finally:
        tab.close()
        server.shutdown()
        server.server_close()
    assert emu.server("primary").call(lambda: dict(emu.server("primary").faults)) == {}
    send(primary, "orders", ServiceBusMessage("the primary is still up"))
