"""The emulator's live page over HTTP (spark_sb/emulator/page.py): what it counts and peeks against what the SDK did,
faults set and healed from it, and what it refuses. tests/emulator/test_page_browser.py drives it in Chromium."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.exceptions import ServiceBusError

from spark_sb.admin import admin_client
from spark_sb.emulator import Emulator, NamespaceInfo, NamespaceOptions
from spark_sb.emulator.sas import make_token

HEADER = {"X-Spark-SB-Emulator": "1"}
SECRET = "a-key-of-its-own"
ENTITIES = {"queues": [{"name": "orders"}, {"name": "audit"}],
            "topics": [{"name": "events", "subscriptions": [{"name": "all"}]}]}


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """The primary and the secondary with the development key, and ``locked`` with a key of its own."""
    with Emulator([NamespaceOptions("primary"), NamespaceOptions("secondary"),
                   NamespaceOptions("locked", key=SECRET)],
                  data_dir=tmp_path_factory.mktemp("page"), entities=ENTITIES) as e:
        yield e


@pytest.fixture
def primary(emu: Emulator) -> Iterator[NamespaceInfo]:
    yield emu["primary"]
    for name in emu.info:
        emu.heal(name)


def _drain(info: NamespaceInfo, queue: str) -> None:
    with ServiceBusClient.from_connection_string(info.connection_string, retry_total=0) as c, \
            c.get_queue_receiver(queue, max_wait_time=1) as r:
        while batch := r.receive_messages(100, max_wait_time=1):
            for m in batch:
                r.complete_message(m)


def get(info: NamespaceInfo, path: str, headers: dict[str, str] | None = None, **params: Any) -> requests.Response:
    return requests.get(info.admin_url + path, headers=HEADER if headers is None else headers, params=params,
                        timeout=10)


def post(info: NamespaceInfo, op: str, body: dict[str, Any], headers: dict[str, str] | None = None
         ) -> requests.Response:
    return requests.post(f"{info.admin_url}/$page/{op}", data=json.dumps(body), timeout=10,
                         headers={**HEADER, "Content-Type": "application/json"} if headers is None else headers)


def entity_row(info: NamespaceInfo, namespace: str, path: str) -> dict[str, Any]:
    view = get(info, "/$page/view").json()
    ns = next(n for n in view["namespaces"] if n["name"] == namespace)
    return next(e for e in ns["entities"] if e["path"] == path)


def send(info: NamespaceInfo, queue: str, *messages: ServiceBusMessage) -> None:
    with ServiceBusClient.from_connection_string(info.connection_string, retry_total=0) as c, \
            c.get_queue_sender(queue) as s:
        s.send_messages(list(messages))


def test_the_view_counts_what_the_sdk_did(primary: NamespaceInfo) -> None:
    """Active (deferred included, as the service counts it), deferred, scheduled and dead-letter counts, as the
    administration client reads them, and the connections against their quota."""
    _drain(primary, "orders")
    send(primary, "orders", *(ServiceBusMessage(f"m{i}") for i in range(4)))
    with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as c:
        with c.get_queue_sender("orders") as s:
            s.schedule_messages(ServiceBusMessage("later"), dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))
        with c.get_queue_receiver("orders", max_wait_time=5) as r:
            first, second = r.receive_messages(2, max_wait_time=5)
            r.defer_message(first)
            r.dead_letter_message(second, reason="bad row", error_description="field x")
            view = get(primary, "/$page/view").json()  # the receiver's connection open
        row = entity_row(primary, "primary", "orders")
    assert (row["active"], row["deferred"], row["scheduled"], row["dead_letter"]) == (3, 1, 1, 1)
    with admin_client(primary.connection_string, admin_endpoint=primary.admin_url, retry_total=0) as admin:
        props = admin.get_queue_runtime_properties("orders")
    assert (props.active_message_count, props.scheduled_message_count, props.dead_letter_message_count,
            props.size_in_bytes) == (row["active"], row["scheduled"], row["dead_letter"], row["size_in_bytes"])
    ns = next(n for n in view["namespaces"] if n["name"] == "primary")
    assert ns["stats"]["connections"] >= 1 and ns["stats"]["entity_links"] >= 1
    assert ns["stats"]["limits"]["max_connections"] == 5000
    assert [n["name"] for n in view["namespaces"]] == ["primary", "secondary", "locked"]
    assert [e["path"] for e in ns["entities"]] == ["audit", "events", "events/subscriptions/all", "orders"]


def test_a_peek_shows_properties_and_bodies_newest_first_and_pages(primary: NamespaceInfo) -> None:
    _drain(primary, "audit")
    when = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)
    send(primary, "audit", ServiceBusMessage(
        '{"order": 7}', subject="order-created", correlation_id="c-7", content_type="application/json",
        session_id=None, application_properties={"region": "west", "count": 3, "ratio": 0.5, "ok": True,
                                                 "at": when}),
         ServiceBusMessage(b"\x00\xff\x10binary"), *(ServiceBusMessage(f"n{i}") for i in range(5)))
    newest = get(primary, "/$page/messages", namespace="primary", entity="audit", count="3", format="json").json()
    seqs = [m["system"]["sequence_number"] for m in newest["messages"]]
    assert seqs == sorted(seqs, reverse=True) and len(seqs) == 3
    older = get(primary, "/$page/messages", namespace="primary", entity="audit", before=str(min(seqs)),
                format="json").json()
    assert [m["body"]["text"] for m in older["messages"]][:2] == ["n1", "n0"]
    first_seq = older["messages"][-1]["system"]["sequence_number"]
    oldest = get(primary, "/$page/messages", namespace="primary", entity="audit", count="2", format="json",
                 **{"from": str(first_seq)}).json()["messages"]
    typed, binary = oldest
    assert typed["system"]["subject"] == "order-created" and typed["system"]["correlation_id"] == "c-7"
    assert typed["system"]["content_type"] == "application/json"
    assert typed["body"] == {"kind": "text", "text": '{"order": 7}', "size": 12, "cut": False}
    assert {a["name"]: (a["value"], a["type"]) for a in typed["application"]} == {
        "region": ("west", "string"), "count": ("3", "int"), "ratio": ("0.5", "double"), "ok": ("true", "boolean"),
        "at": ("2026-11-29T12:00:00.000Z", "timestamp")}
    assert binary["body"]["kind"] == "binary" and binary["body"]["text"].startswith("00 ff 10")
    # a peek locks nothing and counts no delivery: the receiver gets the first message as never delivered
    with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as c, \
            c.get_queue_receiver("audit", max_wait_time=5) as r:
        (got,) = r.receive_messages(1, max_wait_time=5)
        assert (str(got), got.delivery_count) == ('{"order": 7}', 0)
        r.complete_message(got)
    html = get(primary, "/$page/messages", namespace="primary", entity="audit").text
    assert "Messages of audit on primary" in html and "n4" in html


def test_the_dead_letter_queue_shows_reasons_and_descriptions(primary: NamespaceInfo) -> None:
    _drain(primary, "orders")
    send(primary, "orders", ServiceBusMessage("<b>not html</b>", message_id="poison-1"))
    with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as c, \
            c.get_queue_receiver("orders", max_wait_time=5) as r:
        (m,) = r.receive_messages(1, max_wait_time=5)
        r.dead_letter_message(m, reason="SchemaError", error_description="field 'amount' is not a number")
    peek = get(primary, "/$page/messages", namespace="primary", entity="orders", dlq="1", format="json").json()
    found = next(m for m in peek["messages"] if m["system"]["message_id"] == "poison-1")
    assert (found["system"]["dead_letter_reason"], found["system"]["dead_letter_description"],
            found["system"]["dead_letter_source"]) == ("SchemaError", "field 'amount' is not a number", "orders")
    html = get(primary, "/$page/messages", namespace="primary", entity="orders", dlq="1").text
    assert "SchemaError" in html and "&lt;b&gt;not html&lt;/b&gt;" in html and "<b>not html" not in html


def test_a_fault_from_the_page_takes_the_namespace_down_and_heal_brings_it_back(primary: NamespaceInfo) -> None:
    answer = post(primary, "fault", {"namespace": "primary", "kind": "down"})
    assert answer.status_code == 200 and answer.json()["message"] == "fault down set on namespace primary until healed"
    with pytest.raises(ServiceBusError):
        send(primary, "orders", ServiceBusMessage("while down"))
    # the page stays up on the faulted namespace's own admin port, and says so
    ns = next(n for n in get(primary, "/$page/view").json()["namespaces"] if n["name"] == "primary")
    assert ns["down"] and ns["faults"] == [{"entity": None, "kind": "down", "seconds_left": None}]
    assert post(primary, "heal", {"namespace": "primary"}).json()["message"] == \
        "healed namespace primary: down on the namespace"
    assert post(primary, "heal", {"namespace": "primary", "entity": "orders"}).json()["message"] == \
        "no fault was in force on orders on primary: nothing to heal"
    send(primary, "orders", ServiceBusMessage("after heal"))
    # an entity's fault, for a while
    assert post(primary, "fault", {"namespace": "primary", "entity": "audit", "kind": "busy", "duration": 30}
                ).json()["message"] == "fault busy set on audit on primary for 30 s"
    with pytest.raises(ServiceBusError):
        send(primary, "audit", ServiceBusMessage("busy"))
    send(primary, "orders", ServiceBusMessage("another entity is not faulted"))
    row = entity_row(primary, "primary", "audit")
    assert row["fault"] == "busy"


def test_the_secondary_port_serves_the_same_page_and_faults_the_primary(emu: Emulator,
                                                                         primary: NamespaceInfo) -> None:
    secondary = emu["secondary"]
    assert post(secondary, "fault", {"namespace": "primary", "kind": "down"}).status_code == 200
    with pytest.raises(ServiceBusError):
        send(primary, "orders", ServiceBusMessage("while down"))
    assert get(secondary, "/$page/view").json()["namespaces"][0]["down"]
    assert post(secondary, "heal", {"namespace": "primary"}).status_code == 200
    send(primary, "orders", ServiceBusMessage("healed from the other port"))


def test_what_another_site_can_send_is_refused(emu: Emulator, primary: NamespaceInfo) -> None:
    """A form can post text/plain or urlencoded, without the header; a rebinding name reaches nothing: no fault."""
    url = f"{primary.admin_url}/$page/fault"
    forged = '{"namespace": "primary", "kind": "down", "x": "="}'
    assert requests.post(url, data=forged, headers={"Content-Type": "text/plain"}, timeout=10).status_code == 403
    assert requests.post(url, data=forged, timeout=10, headers={**HEADER, "Content-Type": "text/plain"}
                         ).status_code == 415
    assert requests.post(url, data={"namespace": "primary", "kind": "down"}, headers=HEADER, timeout=10
                         ).status_code == 415
    assert requests.post(url, data=forged, timeout=10, headers={
        **HEADER, "Content-Type": "application/json", "Host": f"attacker.example:{primary.admin_port}"}
    ).status_code == 403
    assert get(primary, "/$page/view", headers={}).status_code == 403
    assert get(primary, "/$page/messages", headers={}, namespace="primary", entity="orders").status_code == 403
    assert emu.server("primary").call(lambda: dict(emu.server("primary").faults)) == {}
    page = requests.get(primary.page_url, timeout=10)
    assert page.status_code == 200 and page.headers["X-Frame-Options"] == "DENY"
    csp = page.headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "default-src 'none'" in csp
    assert 'src="http' not in page.text and 'href="http' not in page.text  # nothing loaded from elsewhere
    send(primary, "orders", ServiceBusMessage("still up"))


def test_a_namespace_with_its_own_key_needs_it_for_messages_and_faults(emu: Emulator, primary: NamespaceInfo) -> None:
    locked = emu["locked"]
    refused = post(primary, "fault", {"namespace": "locked", "kind": "down"})
    assert refused.status_code == 401 and "namespace locked has a key of its own" in refused.json()["error"]
    wrong = post(primary, "fault", {"namespace": "locked", "kind": "down"},
                 headers={**HEADER, "Content-Type": "application/json", "X-Spark-SB-Key": "guess"})
    assert wrong.status_code == 401 and "not the namespace's" in wrong.json()["error"] and "guess" not in wrong.text
    assert get(primary, "/$page/messages", namespace="locked", entity="orders").status_code == 401
    with_key = post(primary, "fault", {"namespace": "locked", "kind": "down"},
                    headers={**HEADER, "Content-Type": "application/json", "X-Spark-SB-Key": SECRET})
    assert with_key.status_code == 200
    with pytest.raises(ServiceBusError):
        send(locked, "orders", ServiceBusMessage("down"))
    token = make_token(f"sb://localhost:{locked.amqp_port}/", locked.key_name, SECRET)
    healed = post(primary, "heal", {"namespace": "locked"},
                  headers={**HEADER, "Content-Type": "application/json", "Authorization": token})
    assert healed.status_code == 200
    send(locked, "orders", ServiceBusMessage("up again"))
    assert get(primary, "/$page/messages", headers={**HEADER, "X-Spark-SB-Key": SECRET}, namespace="locked",
               entity="orders").status_code == 200
    # its counts are shown without the key; the page says a key is needed
    locked_view = next(n for n in get(primary, "/$page/view").json()["namespaces"] if n["name"] == "locked")
    assert locked_view["locked"] and any(e["active"] >= 1 for e in locked_view["entities"])
    assert SECRET not in requests.get(primary.page_url, timeout=10).text


@pytest.mark.parametrize(("op", "body", "status", "says"), [
    ("fault", {"namespace": "tertiary", "kind": "down"}, 404, "no namespace 'tertiary'"),
    ("fault", {"namespace": "primary", "kind": "explode"}, 400, "got 'explode'"),
    ("fault", {"namespace": "primary", "kind": "busy", "entity": "nope"}, 404, "no entity 'nope'"),
    ("fault", {"namespace": "primary", "kind": "busy", "duration": -1}, 400, "got -1"),
    ("heal", {"namespace": 7}, 404, "no namespace 7"),
    ("heal", {"namespace": "primary", "entity": "nope"}, 404, "no entity 'nope'"),
])
def test_a_bad_fault_names_the_field_and_the_value(emu: Emulator, primary: NamespaceInfo, op: str,
                                                   body: dict[str, Any], status: int, says: str) -> None:
    answer = post(primary, op, body)
    assert answer.status_code == status and says in answer.json()["error"]
    assert emu.server("primary").call(lambda: dict(emu.server("primary").faults)) == {}


@pytest.mark.parametrize(("params", "status", "says"), [
    ({"namespace": "primary", "entity": "orders", "count": "0"}, 400, "count must be a whole number from 1 to 200, "
                                                                      "got '0'"),
    ({"namespace": "primary", "entity": "orders", "from": "1", "before": "9"}, 400, "give one of them"),
    ({"namespace": "primary", "entity": "missing"}, 404, "entity 'missing'"),
    ({"namespace": "primary", "entity": "events"}, 400, "is a topic"),
    ({"namespace": "primary"}, 400, "entity: name the queue or subscription"),
    ({"namespace": "primary", "entity": "orders", "dlq": "yes"}, 400, "dlq must be 1 (the dead-letter queue) or 0, "
                                                                     "got 'yes'"),
])
def test_a_bad_peek_names_the_field_and_the_value(primary: NamespaceInfo, params: dict[str, str], status: int,
                                                  says: str) -> None:
    answer = get(primary, "/$page/messages", **params)
    assert answer.status_code == status and says in answer.json()["error"]


def test_spark_sb_emulator_start_prints_the_page() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "spark_sb.cli", "emulator", "start", "--in-memory", "--namespace",
                             "alpha=0:0", "--namespace", "beta=0:0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(3)]
        tag, url = lines[2].split(" ", 1)
        assert tag == "PAGE" and url.startswith("http://localhost:") and url.endswith("/")
        page = requests.get(url, timeout=10)
        assert page.status_code == 200 and 'id="ns-alpha"' in page.text and 'id="ns-beta"' in page.text
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_paired_senders_backlog_queue_is_named_so(emu: Emulator, primary: NamespaceInfo) -> None:
    from spark_sb.emulator.model import QueueSpec

    server = emu.server("secondary")
    server.call(lambda: server.broker.create_entity(QueueSpec(name="localhost-5672/x-servicebus-transfer/0")))
    html = get(primary, "/$page/namespaces").text
    row = html[html.index('data-entity="localhost-5672/x-servicebus-transfer/0"'):]
    assert row[:row.index("</tr>")].count("<td>backlog queue</td>") == 1
    assert html.count("<td>backlog queue</td>") == 1  # orders, audit: queues


def test_a_namespace_whose_server_stopped_shows_as_unreachable(tmp_path: Any) -> None:
    """The page of the other namespaces stays; the stopped one says why, its peeks and faults are 503s."""
    with Emulator([NamespaceOptions("alive"), NamespaceOptions("gone")], data_dir=tmp_path, entities=ENTITIES) as e:
        e.server("gone").stop()
        alive = e["alive"]
        gone = next(n for n in get(alive, "/$page/view").json()["namespaces"] if n["name"] == "gone")
        assert "AMQP server is not running" in gone["error"]
        assert 'class="state failed">unreachable' in get(alive, "/$page/namespaces").text
        peek = get(alive, "/$page/messages", namespace="gone", entity="orders")
        assert peek.status_code == 503 and "namespace gone" in peek.json()["error"]
        assert post(alive, "fault", {"namespace": "gone", "kind": "down"}).status_code == 503
        assert get(alive, "/$page/messages", namespace="alive", entity="orders").status_code == 200
