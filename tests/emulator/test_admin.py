"""The real ServiceBusAdministrationClient, built by spark_sb.admin.admin_client, against the emulator's
admin HTTP API (AdminServer) over a real Broker."""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.core.pipeline.transport import RequestsTransport
from azure.servicebus.management import (
    CorrelationRuleFilter,
    FalseRuleFilter,
    ServiceBusAdministrationClient,
    SqlRuleFilter,
    TrueRuleFilter,
)

from spark_sb import admin
from spark_sb.admin import EmulatorAdminTransport, admin_client, emulator_admin_endpoint
from spark_sb.emulator import AdminLimits, sas, store
from spark_sb.emulator.admin_http import AdminServer, format_duration, parse_duration
from spark_sb.emulator.broker import Broker, Incoming
from spark_sb.emulator.model import MAX_TTL_SECONDS, QueueSpec

KEY_NAME = "RootManageSharedAccessKey"
KEY = "SAS_KEY_VALUE"
CONN = f"Endpoint=sb://localhost:5672;SharedAccessKeyName={KEY_NAME};SharedAccessKey={KEY};UseDevelopmentEmulator=true"
MAX_DAYS = 10675199


# --------------------------------------------------------------------------- fixtures


class Namespace:
    """A broker on a one-thread executor (standing in for the reactor) and its admin server."""

    def __init__(self, make_store: Any, limits: AdminLimits | None = None) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1)
        self.faults: dict[str | None, str] = {}
        self.controls: list[tuple[str, str, dict]] = []
        self.broker = self.call(lambda: Broker(make_store()))
        self.server = AdminServer(
            "127.0.0.1", 0, broker=self.broker, call=self.call, keys={KEY_NAME: KEY},
            fault=self.faults.get, control=self.control, limits=limits,
        )
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.server.port}"

    def call(self, fn: Any) -> Any:
        return self.executor.submit(fn).result()

    def control(self, method: str, path: str, body: dict) -> tuple[int, dict]:
        self.controls.append((method, path, body))
        return 200, {"method": method, "path": path, "body": body}

    def client(self, conn: str = CONN, **kwargs: Any) -> Any:
        kwargs.setdefault("retry_total", 0)
        return admin_client(conn, admin_endpoint=self.endpoint, **kwargs)

    def send(self, path: str, count: int) -> list[int]:
        msgs = [Incoming(raw=b"hello-%d" % i, message_id=f"m{i}") for i in range(count)]
        return self.call(lambda: self.broker.send(path, msgs))

    def close(self) -> None:
        self.server.stop()
        self.call(self.broker.close)
        self.executor.shutdown(wait=True)


@pytest.fixture
def ns() -> Any:
    namespace = Namespace(store.MemoryStore)
    yield namespace
    namespace.close()


@pytest.fixture
def client(ns: Namespace) -> Any:
    c = ns.client()
    yield c
    c.close()


def raw_request(ns: Namespace, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None, token: str | None = "default") -> tuple[int, bytes]:
    """One HTTP request without the SDK; returns (status, body)."""
    hdrs = dict(headers or {})
    if token == "default":
        token = sas.make_token("https://localhost:5672", KEY_NAME, KEY)
    if token is not None:
        hdrs["Authorization"] = token
    req = urllib.request.Request(ns.endpoint + path, data=body, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


# --------------------------------------------------------------------------- queues


def test_create_queue_round_trips_every_property(ns: Namespace, client: Any) -> None:
    ns.call(lambda: ns.broker.create_entity(QueueSpec(name="target")))
    created = client.create_queue(
        "orders",
        lock_duration=timedelta(seconds=45),
        max_delivery_count=7,
        default_message_time_to_live=timedelta(hours=2),
        dead_lettering_on_message_expiration=True,
        requires_session=True,
        requires_duplicate_detection=True,
        duplicate_detection_history_time_window=timedelta(minutes=3),
        max_size_in_megabytes=2048,
        auto_delete_on_idle=timedelta(hours=6),
        forward_dead_lettered_messages_to="target",
        status="Disabled",
    )
    for props in (created, client.get_queue("orders")):
        assert props.name == "orders"
        assert props.lock_duration == timedelta(seconds=45)
        assert props.max_delivery_count == 7
        assert props.default_message_time_to_live == timedelta(hours=2)
        assert props.dead_lettering_on_message_expiration is True
        assert props.requires_session is True
        assert props.requires_duplicate_detection is True
        assert props.duplicate_detection_history_time_window == timedelta(minutes=3)
        assert props.max_size_in_megabytes == 2048
        assert props.auto_delete_on_idle == timedelta(hours=6)
        assert props.forward_dead_lettered_messages_to.endswith("/target")
        assert props.status == "Disabled"
    spec = ns.call(lambda: ns.broker.get_entity("queue", "orders"))
    assert spec == QueueSpec(
        name="orders", lock_duration=45.0, max_delivery_count=7, default_message_time_to_live=7200.0,
        dead_lettering_on_message_expiration=True, requires_session=True, requires_duplicate_detection=True,
        duplicate_detection_history_time_window=180.0, max_size_in_megabytes=2048, status="Disabled",
        auto_delete_on_idle=21600.0, forward_dead_lettered_messages_to="target",
    )


def test_queue_defaults_and_max_timespan(ns: Namespace, client: Any) -> None:
    client.create_queue("plain")
    props = client.get_queue("plain")
    assert props.lock_duration == timedelta(minutes=1)
    assert props.max_delivery_count == 10
    assert props.default_message_time_to_live.days == MAX_DAYS  # TimeSpan.MaxValue
    assert props.auto_delete_on_idle.days == MAX_DAYS
    assert props.duplicate_detection_history_time_window == timedelta(minutes=10)
    assert props.status == "Active"
    assert props.requires_session is False
    spec = ns.call(lambda: ns.broker.get_entity("queue", "plain"))
    assert spec.default_message_time_to_live is None and spec.auto_delete_on_idle is None


def test_update_queue_changes_description_and_keeps_messages(ns: Namespace, client: Any) -> None:
    client.create_queue("orders")
    ns.send("orders", 2)
    props = client.get_queue("orders")
    props.max_delivery_count = 3
    props.lock_duration = timedelta(seconds=20)
    props.default_message_time_to_live = timedelta(minutes=30)
    client.update_queue(props)
    after = client.get_queue("orders")
    assert after.max_delivery_count == 3
    assert after.lock_duration == timedelta(seconds=20)
    assert after.default_message_time_to_live == timedelta(minutes=30)
    assert client.get_queue_runtime_properties("orders").active_message_count == 2
    # keyword overrides and a max TTL sent back by the SDK (P10675199DT2H48M5.47758S) both work
    client.update_queue(after, default_message_time_to_live=timedelta(days=MAX_DAYS, seconds=10085.47758))
    assert ns.call(lambda: ns.broker.get_entity("queue", "orders")).default_message_time_to_live is None


def test_update_of_a_missing_queue_is_not_found(ns: Namespace, client: Any) -> None:
    props = client.create_queue("gone")
    client.delete_queue("gone")
    with pytest.raises(ResourceNotFoundError):
        client.update_queue(props)


def test_create_existing_queue_raises_resource_exists(client: Any) -> None:
    client.create_queue("orders")
    with pytest.raises(ResourceExistsError):
        client.create_queue("orders")
    with pytest.raises(ResourceExistsError):
        client.create_topic("orders")  # one namespace of names for queues and topics


def test_missing_entities_raise_resource_not_found(client: Any) -> None:
    client.create_topic("events")
    with pytest.raises(ResourceNotFoundError):
        client.get_queue("nope")
    with pytest.raises(ResourceNotFoundError):
        client.get_queue_runtime_properties("nope")
    with pytest.raises(ResourceNotFoundError):
        client.get_topic("nope")
    with pytest.raises(ResourceNotFoundError):
        client.get_topic_runtime_properties("nope")
    with pytest.raises(ResourceNotFoundError):
        client.get_subscription("events", "nope")
    with pytest.raises(ResourceNotFoundError):
        client.get_subscription("nope", "nope")
    with pytest.raises(ResourceNotFoundError):
        client.delete_queue("nope")
    with pytest.raises(ResourceNotFoundError):
        client.delete_topic("nope")
    with pytest.raises(ResourceNotFoundError):
        client.create_subscription("nope", "sub")
    with pytest.raises(ResourceNotFoundError):
        list(client.list_subscriptions("nope"))


def test_delete_queue(ns: Namespace, client: Any) -> None:
    client.create_queue("orders")
    ns.send("orders", 1)
    client.delete_queue("orders")
    with pytest.raises(ResourceNotFoundError):
        client.get_queue("orders")
    assert [q.name for q in client.list_queues()] == []


def test_list_queues_pages_through_everything(ns: Namespace, client: Any) -> None:
    names = [f"q{i}" for i in range(5)]
    for name in reversed(names):
        client.create_queue(name)
    ns.send("q3", 2)
    assert [q.name for q in client.list_queues(max_page_size=2)] == names
    runtime = {q.name: q.active_message_count for q in client.list_queues_runtime_properties(max_page_size=3)}
    assert runtime == {"q0": 0, "q1": 0, "q2": 0, "q3": 2, "q4": 0}


def test_queue_name_with_slashes(client: Any) -> None:
    name = "contoso/x-servicebus-transfer/3"
    client.create_queue(name, max_delivery_count=4)
    assert client.get_queue(name).max_delivery_count == 4
    assert [q.name for q in client.list_queues()] == [name]
    client.delete_queue(name)
    with pytest.raises(ResourceNotFoundError):
        client.get_queue(name)


def test_runtime_counts_after_send(ns: Namespace, client: Any) -> None:
    client.create_queue("orders")
    ns.send("orders", 3)
    rt = client.get_queue_runtime_properties("orders")
    assert rt.name == "orders"
    assert rt.active_message_count == 3
    assert rt.total_message_count == 3
    assert rt.dead_letter_message_count == 0
    assert rt.scheduled_message_count == 0
    assert rt.size_in_bytes >= 0
    assert rt.created_at_utc is not None


def test_invalid_description_is_400_naming_the_field(client: Any) -> None:
    with pytest.raises(HttpResponseError) as info:
        client.create_queue("bad", lock_duration=timedelta(seconds=1))
    assert info.value.status_code == 400
    assert "lock_duration" in str(info.value)
    with pytest.raises(HttpResponseError) as info:
        client.create_queue("bad2", max_delivery_count=0)
    assert info.value.status_code == 400
    assert "max_delivery_count" in str(info.value)


def test_malformed_xml_is_400_and_the_server_keeps_serving(ns: Namespace, client: Any) -> None:
    status, body = raw_request(ns, "PUT", "/broken?api-version=2021-05", b"<entry><content>not closed")
    assert status == 400
    assert b"<Code>400</Code>" in body
    status, body = raw_request(ns, "PUT", "/broken?api-version=2021-05", b"\x00\xff garbage")
    assert status == 400
    bad_value = (b'<entry xmlns="http://www.w3.org/2005/Atom"><content type="application/xml">'
                 b'<QueueDescription xmlns="http://schemas.microsoft.com/netservices/2010/10/servicebus/connect">'
                 b"<MaxDeliveryCount>many</MaxDeliveryCount></QueueDescription></content></entry>")
    status, body = raw_request(ns, "PUT", "/broken", bad_value)
    assert status == 400
    assert b"MaxDeliveryCount" in body and b"many" in body
    status, _ = raw_request(ns, "PUT", "/broken", b"")
    assert status == 400
    client.create_queue("fine")
    assert client.get_queue("fine").name == "fine"


# --------------------------------------------------------------------------- topics, subscriptions, rules


def test_topics(ns: Namespace, client: Any) -> None:
    created = client.create_topic(
        "events",
        default_message_time_to_live=timedelta(hours=1),
        requires_duplicate_detection=True,
        duplicate_detection_history_time_window=timedelta(minutes=5),
        max_size_in_megabytes=2048,
    )
    assert created.requires_duplicate_detection is True
    props = client.get_topic("events")
    assert props.default_message_time_to_live == timedelta(hours=1)
    assert props.duplicate_detection_history_time_window == timedelta(minutes=5)
    assert props.max_size_in_megabytes == 2048
    props.default_message_time_to_live = timedelta(minutes=10)
    client.update_topic(props)
    assert client.get_topic("events").default_message_time_to_live == timedelta(minutes=10)
    client.create_topic("alerts")
    assert [t.name for t in client.list_topics()] == ["alerts", "events"]
    client.create_subscription("events", "a")
    client.create_subscription("events", "b")
    assert client.get_topic_runtime_properties("events").subscription_count == 2
    assert {t.name: t.subscription_count for t in client.list_topics_runtime_properties()} == {
        "alerts": 0, "events": 2}
    client.delete_topic("events")
    with pytest.raises(ResourceNotFoundError):
        client.get_subscription("events", "a")
    assert [t.name for t in client.list_topics()] == ["alerts"]


def test_subscriptions(ns: Namespace, client: Any) -> None:
    client.create_topic("events")
    sub = client.create_subscription(
        "events", "all",
        lock_duration=timedelta(seconds=30),
        max_delivery_count=5,
        default_message_time_to_live=timedelta(hours=1),
        dead_lettering_on_message_expiration=True,
        requires_session=False,
    )
    assert sub.name == "all" and sub.lock_duration == timedelta(seconds=30)
    got = client.get_subscription("events", "all")
    assert got.max_delivery_count == 5
    assert got.default_message_time_to_live == timedelta(hours=1)
    assert got.dead_lettering_on_message_expiration is True
    with pytest.raises(ResourceExistsError):
        client.create_subscription("events", "all")
    client.create_rule("events", "all", "eu", filter=CorrelationRuleFilter(properties={"region": "eu"}))
    got.max_delivery_count = 8
    client.update_subscription("events", got)
    assert client.get_subscription("events", "all").max_delivery_count == 8
    assert [r.name for r in client.list_rules("events", "all")] == ["$Default", "eu"]  # rules survive updates
    client.create_subscription("events", "other")
    assert [s.name for s in client.list_subscriptions("events")] == ["all", "other"]
    ns.send("events", 2)
    rt = client.get_subscription_runtime_properties("events", "other")
    assert rt.active_message_count == 2 and rt.total_message_count == 2
    assert {s.name: s.active_message_count
            for s in client.list_subscriptions_runtime_properties("events")} == {"all": 2, "other": 2}
    client.delete_subscription("events", "other")
    with pytest.raises(ResourceNotFoundError):
        client.get_subscription("events", "other")
    assert [s.name for s in client.list_subscriptions("events")] == ["all"]


def test_rules(ns: Namespace, client: Any) -> None:
    client.create_topic("events")
    client.create_subscription("events", "s")
    default = client.get_rule("events", "s", "$Default")
    assert isinstance(default.filter, TrueRuleFilter)

    corr = CorrelationRuleFilter(
        correlation_id="c1", message_id="m1", to="to1", reply_to="rt1", label="subj", session_id="s1",
        reply_to_session_id="rs1", content_type="application/json",
        properties={"region": "eu", "priority": 2, "big": 2**40, "urgent": True, "ratio": 0.5},
    )
    created = client.create_rule("events", "s", "corr", filter=corr)
    for rule in (created, client.get_rule("events", "s", "corr")):
        f = rule.filter
        assert isinstance(f, CorrelationRuleFilter)
        assert (f.correlation_id, f.message_id, f.to, f.reply_to, f.label, f.session_id,
                f.reply_to_session_id, f.content_type) == (
            "c1", "m1", "to1", "rt1", "subj", "s1", "rs1", "application/json")
        assert dict(f.properties) == {"region": "eu", "priority": 2, "big": 2**40, "urgent": True, "ratio": 0.5}

    client.create_rule("events", "s", "sql", filter=SqlRuleFilter("region = 'eu'"))
    client.create_rule("events", "s", "never", filter=FalseRuleFilter())
    with pytest.raises(ResourceExistsError):
        client.create_rule("events", "s", "sql", filter=SqlRuleFilter("region = 'us'"))
    rules = {r.name: r for r in client.list_rules("events", "s")}
    assert set(rules) == {"$Default", "corr", "sql", "never"}
    assert isinstance(rules["sql"].filter, SqlRuleFilter) and rules["sql"].filter.sql_expression == "region = 'eu'"
    assert isinstance(rules["never"].filter, FalseRuleFilter)
    assert dict(rules["corr"].filter.properties)["priority"] == 2

    stored = {r.name: r.filter for r in ns.call(lambda: ns.broker.list_rules("events", "s"))}
    assert stored["$Default"] == {"type": "true"}
    assert stored["never"] == {"type": "false"}
    assert stored["sql"] == {"type": "sql", "expression": "region = 'eu'"}
    assert stored["corr"] == {
        "type": "correlation", "correlation_id": "c1", "message_id": "m1", "to": "to1", "reply_to": "rt1",
        "subject": "subj", "session_id": "s1", "reply_to_session_id": "rs1", "content_type": "application/json",
        "properties": {"region": "eu", "priority": 2, "big": 2**40, "urgent": True, "ratio": 0.5},
    }

    sql_rule = rules["sql"]
    sql_rule.filter = SqlRuleFilter("region = 'us'")
    client.update_rule("events", "s", sql_rule)
    assert client.get_rule("events", "s", "sql").filter.sql_expression == "region = 'us'"

    client.delete_rule("events", "s", "$Default")
    client.delete_rule("events", "s", "never")
    assert sorted(r.name for r in client.list_rules("events", "s")) == ["corr", "sql"]
    with pytest.raises(ResourceNotFoundError):
        client.get_rule("events", "s", "never")
    with pytest.raises(ResourceNotFoundError):
        client.delete_rule("events", "s", "never")


def test_namespace_properties(client: Any) -> None:
    props = client.get_namespace_properties()
    assert props.name == "localhost"
    assert props.messaging_sku == "Standard"
    assert props.created_at_utc is not None


def test_description_survives_a_restart_on_sqlite(tmp_path: Any) -> None:
    db = tmp_path / "ns.db"
    first = Namespace(lambda: store.SqliteStore(db))
    try:
        c = first.client()
        c.create_queue("durable", max_delivery_count=3, lock_duration=timedelta(seconds=15))
        c.create_topic("events")
        c.create_subscription("events", "s")
        c.create_rule("events", "s", "eu", filter=CorrelationRuleFilter(properties={"region": "eu"}))
        first.send("durable", 1)
        c.close()
    finally:
        first.close()
    second = Namespace(lambda: store.SqliteStore(db))
    try:
        c = second.client()
        props = c.get_queue("durable")
        assert (props.max_delivery_count, props.lock_duration) == (3, timedelta(seconds=15))
        assert c.get_queue_runtime_properties("durable").active_message_count == 1
        assert dict(c.get_rule("events", "s", "eu").filter.properties) == {"region": "eu"}
        c.close()
    finally:
        second.close()


# --------------------------------------------------------------------------- authentication and secrets


def test_wrong_key_is_client_authentication_error(ns: Namespace) -> None:
    bad = CONN.replace(KEY, "NOT_THE_KEY")
    with ns.client(bad) as c, pytest.raises(ClientAuthenticationError) as info:
        c.get_queue("orders")
    assert KEY not in str(info.value) and "NOT_THE_KEY" not in str(info.value)
    body = info.value.response.text()
    assert "<Code>401</Code>" in body
    assert "sig=" not in body and "NOT_THE_KEY" not in body


def test_unknown_key_name_is_rejected(ns: Namespace) -> None:
    bad = CONN.replace(f"SharedAccessKeyName={KEY_NAME}", "SharedAccessKeyName=Other")
    with ns.client(bad) as c, pytest.raises(ClientAuthenticationError):
        list(c.list_queues())


def test_expired_token_rejected_and_fresh_token_accepted(ns: Namespace) -> None:
    expired = sas.make_token("https://localhost:5672", KEY_NAME, KEY, ttl=-60)
    conn = f"Endpoint=sb://localhost:5672;SharedAccessSignature={expired};UseDevelopmentEmulator=true"
    with ns.client(conn) as c, pytest.raises(ClientAuthenticationError):
        c.get_namespace_properties()
    status, body = raw_request(ns, "GET", "/$namespaceinfo", token=expired)
    assert status == 401 and b"expired" in body
    fresh = sas.make_token("https://localhost:5672", KEY_NAME, KEY, ttl=600)
    conn = f"Endpoint=sb://localhost:5672;SharedAccessSignature={fresh};UseDevelopmentEmulator=true"
    with ns.client(conn) as c:  # the SDK sends it as "Bearer SharedAccessSignature ..."
        c.create_queue("with-sas-token")
        assert c.get_queue("with-sas-token").name == "with-sas-token"


def test_missing_or_entity_scoped_tokens(ns: Namespace, client: Any) -> None:
    client.create_queue("mine")
    client.create_queue("theirs")
    status, body = raw_request(ns, "GET", "/mine", token=None)
    assert status == 401 and b"<Code>401</Code>" in body
    scoped = sas.make_token("sb://localhost:5672/mine", KEY_NAME, KEY)
    assert raw_request(ns, "GET", "/mine", token=scoped)[0] == 200
    assert raw_request(ns, "GET", "/theirs", token=scoped)[0] == 401
    assert raw_request(ns, "GET", "/$Resources/queues", token=scoped)[0] == 401


def test_a_token_signed_for_the_request_url_with_its_query_covers_that_request(ns: Namespace, client: Any) -> None:
    """The JavaScript SDK's admin client signs each request's whole URL, query included (Service Bus takes it):
    ``sr=https://host/queue?api-version=2021-05``. The emulator refused it ("does not cover")."""
    client.create_queue("signed")
    own = sas.make_token("https://localhost:5672/signed?api-version=2021-05", KEY_NAME, KEY)
    assert raw_request(ns, "GET", "/signed?api-version=2021-05", token=own)[0] == 200
    status, body = raw_request(ns, "GET", "/other?api-version=2021-05", token=own)
    assert status == 401 and b"does not cover" in body


def test_the_javascript_admin_clients_paths_tokens_and_ids(ns: Namespace, client: Any) -> None:
    """What @azure/service-bus's ServiceBusAdministrationClient sends and reads: "Subscriptions" and "Rules"
    capitalised, lists with a trailing slash, a token signed for each request's own URL, and the names read back
    out of the entry's id by those exact words. Each of these failed (400, 404, 401, a parse error)."""
    client.create_topic("events")

    def js(method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        url = f"https://localhost:5672{path}"
        return raw_request(ns, method, path, body, {"Content-Type": "application/atom+xml"},
                           token=sas.make_token(url.lower(), KEY_NAME, KEY))

    description = (b'<entry xmlns="http://www.w3.org/2005/Atom"><content type="application/xml">'
                   b'<SubscriptionDescription xmlns="http://schemas.microsoft.com/netservices/2010/10/servicebus/'
                   b'connect"/></content></entry>')
    status, body = js("PUT", "/events/Subscriptions/audit?api-version=2021-05", description)
    assert status == 201, body
    assert b"/events/Subscriptions/audit?" in body.split(b"</id>")[0]
    status, body = js("GET", "/events/Subscriptions/?api-version=2021-05")
    assert status == 200 and b"<title type=\"text\">audit</title>" in body, body
    status, body = js("GET", "/events/Subscriptions/audit/Rules/?api-version=2021-05")
    assert status == 200 and b"/events/Subscriptions/audit/Rules/$Default?" in body, body
    assert js("DELETE", "/events/Subscriptions/audit/Rules/$Default?api-version=2021-05")[0] == 200
    assert client.get_subscription("events", "audit").name == "audit"
    assert [r.name for r in client.list_rules("events", "audit")] == []


def test_secrets_never_in_repr_str_or_logs(ns: Namespace, caplog: Any) -> None:
    caplog.set_level(logging.DEBUG)
    with ns.client() as c:
        c.create_queue("q")
        things = [c, c._pipeline._transport, c._credential, ns.server]
        for thing in things:
            assert KEY not in repr(thing) and KEY not in str(thing)
    bad = CONN.replace(KEY, "ANOTHER_SECRET")
    with ns.client(bad) as c, pytest.raises(ClientAuthenticationError) as info:
        c.get_queue("q")
    assert "ANOTHER_SECRET" not in str(info.value) and "ANOTHER_SECRET" not in repr(info.value)
    with pytest.raises(ValueError) as bad_endpoint:
        admin_client(CONN, admin_endpoint="ftp://nowhere/x")
    assert KEY not in str(bad_endpoint.value)
    assert KEY not in caplog.text and "ANOTHER_SECRET" not in caplog.text
    assert "sig=" not in caplog.text


# --------------------------------------------------------------------------- faults and controls


def test_busy_fault_is_503(ns: Namespace, client: Any) -> None:
    client.create_queue("orders")
    ns.faults[None] = "busy"
    with pytest.raises(HttpResponseError) as info:
        client.get_queue("orders")
    assert info.value.status_code == 503
    assert "busy" in str(info.value).lower()
    del ns.faults[None]
    assert client.get_queue("orders").name == "orders"


def test_unauthorized_fault_is_401(ns: Namespace, client: Any) -> None:
    ns.faults[None] = "unauthorized"
    with pytest.raises(ClientAuthenticationError):
        client.create_queue("orders")
    ns.faults.clear()
    client.create_queue("orders")


def test_notfound_fault_hides_one_entity(ns: Namespace, client: Any) -> None:
    client.create_queue("orders")
    client.create_queue("other")
    ns.faults["orders"] = "notfound"
    with pytest.raises(ResourceNotFoundError):
        client.get_queue("orders")
    with pytest.raises(ResourceNotFoundError):
        client.delete_queue("orders")
    assert client.get_queue("other").name == "other"
    assert [q.name for q in client.list_queues()] == ["orders", "other"]
    del ns.faults["orders"]
    assert client.get_queue("orders").name == "orders"


def test_disabled_and_quota_faults_do_not_affect_admin(ns: Namespace, client: Any) -> None:
    ns.faults[None] = "disabled"
    client.create_queue("orders")
    ns.faults[None] = "quota"
    assert client.get_queue("orders").name == "orders"


def test_down_fault_closes_the_connection(ns: Namespace, client: Any) -> None:
    ns.faults[None] = "down"
    with pytest.raises((ServiceRequestError, ServiceResponseError)):
        client.get_namespace_properties()
    ns.faults.clear()
    assert client.get_namespace_properties().name == "localhost"


def test_timeout_fault_holds_without_blocking_others(ns: Namespace, client: Any) -> None:
    client.create_queue("slow")
    client.create_queue("fast")
    ns.faults["slow"] = "timeout"
    started = time.monotonic()
    with pytest.raises(ServiceResponseError):
        client.get_queue("slow", read_timeout=1)
    assert time.monotonic() - started < 10
    assert client.get_queue("fast").name == "fast"
    # a request still held when the server stops does not delay stop()
    held = threading.Thread(target=lambda: _swallow(lambda: client.get_queue("slow", read_timeout=30)))
    held.start()
    time.sleep(0.5)
    started = time.monotonic()
    ns.server.stop()
    assert time.monotonic() - started < 2.5
    held.join(5)
    assert not held.is_alive()


def _swallow(fn: Any) -> None:
    try:
        fn()
    except AzureError:
        pass


def test_control_requests_need_the_control_header_not_a_token_and_return_json(ns: Namespace) -> None:
    control = {"Content-Type": "application/json", "X-Spark-SB-Emulator": "1"}
    status, body = raw_request(ns, "POST", "/$emulator/fault", b'{"kind": "busy"}', headers=control, token=None)
    assert status == 200
    assert b'"path": "/$emulator/fault"' in body
    assert ns.controls == [("POST", "/$emulator/fault", {"kind": "busy"})]
    status, body = raw_request(ns, "GET", "/$emulator/faults", headers=control, token=None)
    assert status == 200 and ns.controls[-1] == ("GET", "/$emulator/faults", {})
    status, body = raw_request(ns, "POST", "/$emulator/fault", b"{not json", headers=control, token=None)
    assert status == 400


def test_stop_releases_the_port(ns: Namespace, client: Any) -> None:
    client.create_queue("orders")
    port = ns.server.port
    started = time.monotonic()
    ns.server.stop()
    assert time.monotonic() - started < 2.5
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    with pytest.raises((ServiceRequestError, ServiceResponseError)):
        client.get_queue("orders")


# --------------------------------------------------------------------------- admin.py without a server


def test_real_namespace_keeps_tls_and_the_default_transport(monkeypatch: Any) -> None:
    conn = "Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=" + KEY
    seen: list[str] = []

    def fake_send(self: Any, request: Any, **kwargs: Any) -> Any:
        seen.append(request.url)
        raise ServiceRequestError("no network in tests")

    monkeypatch.setattr(RequestsTransport, "send", fake_send)
    with admin_client(conn, retry_total=0) as c:
        assert type(c._pipeline._transport) is RequestsTransport
        with pytest.raises(ServiceRequestError):
            c.get_queue("orders")
    assert seen and seen[0].startswith("https://contoso.servicebus.windows.net/orders")
    with pytest.raises(ValueError):
        admin_client(conn, admin_endpoint="http://localhost:5300")
    with pytest.raises(ValueError):
        admin_client(conn + ";AdminEndpoint=http://localhost:5300")
    with pytest.raises(ValueError):
        admin_client(fully_qualified_namespace="contoso.servicebus.windows.net", credential=object(),
                     admin_endpoint="http://localhost:5300")


def test_emulator_admin_endpoint_resolution() -> None:
    assert emulator_admin_endpoint(CONN) == "http://localhost:5300"
    assert emulator_admin_endpoint(CONN + ";AdminEndpoint=http://127.0.0.1:9999") == "http://127.0.0.1:9999"
    assert emulator_admin_endpoint(CONN, "127.0.0.1:7000") == "http://127.0.0.1:7000"
    mixed_case = CONN.replace("UseDevelopmentEmulator=true", "usedevelopmentemulator=TRUE")
    assert admin.is_emulator(mixed_case)
    with admin_client(mixed_case) as c:
        transport = c._pipeline._transport
        assert isinstance(transport, EmulatorAdminTransport)
        assert transport.admin_endpoint == "http://localhost:5300"
        assert transport.rewrite("https://localhost:5672/q?api-version=2024-05") == (
            "http://localhost:5300/q?api-version=2024-05")
    with pytest.raises(ValueError):
        admin_client(CONN, transport=RequestsTransport())
    with pytest.raises(ValueError):
        admin_client()


def test_emulator_admin_endpoint_from_connection_string(ns: Namespace) -> None:
    with admin_client(CONN + f";AdminEndpoint={ns.endpoint}", retry_total=0) as c:
        c.create_queue("via-conn-string")
        assert c.get_queue("via-conn-string").name == "via-conn-string"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(60.0, "PT1M"), (600.0, "PT10M"), (30.5, "PT30.5S"), (86400.0 + 7200, "P1DT2H"), (0.0, "PT0S"),
     (None, "P10675199DT2H48M5.4775807S"), (MAX_TTL_SECONDS, "P10675199DT2H48M5.4775807S")],
)
def test_durations(seconds: float | None, text: str) -> None:
    assert format_duration(seconds) == text
    if seconds is not None and seconds < MAX_TTL_SECONDS:
        assert parse_duration(text, "x") == seconds


def test_a_token_for_another_namespace_is_refused(primary: Any, secondary: Any) -> None:
    # the secondary's connection string (same host, same development key) against the primary's admin API
    with admin_client(secondary.connection_string, admin_endpoint=primary.admin_url, retry_total=0) as wrong:
        with pytest.raises(ClientAuthenticationError):
            wrong.get_namespace_properties()
    with admin_client(primary.connection_string, admin_endpoint=primary.admin_url, retry_total=0) as right:
        assert right.get_namespace_properties() is not None


def test_the_admin_port_in_the_connection_string_is_this_namespace(primary: Any, secondary: Any) -> None:
    # Microsoft's emulator convention: the administration client is given the admin port (5300 there) in the
    # connection string, so its token names that port; it is this namespace's, as its AMQP port is
    def at_admin_port(ns: Any) -> str:
        return ns.connection_string.replace(f":{ns.amqp_port};", f":{ns.admin_port};")

    # (the Python SDK's administration client speaks https whatever the string says; the emulator's transport
    # takes it to the admin port over http, with the token the SDK made for the admin port)
    with ServiceBusAdministrationClient.from_connection_string(
            at_admin_port(primary), retry_total=0,
            transport=EmulatorAdminTransport(primary.admin_url)) as plain_sdk:
        assert plain_sdk.get_namespace_properties().name
        plain_sdk.create_queue("named-by-the-admin-port")
        assert plain_sdk.get_queue("named-by-the-admin-port").name == "named-by-the-admin-port"
    # the secondary's token, whether it names its admin port or its AMQP port, still opens nothing on the primary
    for conn in (at_admin_port(secondary), secondary.connection_string):
        with admin_client(conn, admin_endpoint=primary.admin_url, retry_total=0) as wrong:
            with pytest.raises(ClientAuthenticationError, match="InvalidAudience"):
                wrong.get_namespace_properties()


# --------------------------------------------------------------------------- the port's bounds (AdminLimits)

LIMITED = AdminLimits(request_timeout=1.0, idle_timeout=30.0, workers=2, max_connections=8,
                      max_connections_per_client=4)


@pytest.fixture
def limited() -> Any:
    namespace = Namespace(store.MemoryStore, LIMITED)
    yield namespace
    namespace.close()


def _open(ns: Namespace, source: str = "127.0.0.1", data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", ns.server.port), timeout=10, source_address=(source, 0))
    if data:
        sock.sendall(data)
    return sock


def _closed(sock: socket.socket, within: float = 10.0) -> bytes | None:
    """What the port sent before it closed ``sock`` (None: still open after ``within`` seconds)."""
    sock.settimeout(within)
    answer = b""
    try:
        while data := sock.recv(65536):
            answer += data
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return answer


def _get(path: str) -> bytes:
    token = sas.make_token("https://localhost:5672", KEY_NAME, KEY)
    return f"GET {path}?api-version=2021-05 HTTP/1.1\r\nHost: localhost\r\nAuthorization: {token}\r\n\r\n".encode()


def test_a_head_that_does_not_come_within_the_request_timeout_is_closed(limited: Namespace) -> None:
    """A read waited 300 s for each line of a head; now a head has request_timeout (here 1 s) from its first byte,
    and a new connection as long for its first byte."""
    partial = _open(limited, data=b"GET /q?api-version=2021-05 HTTP/1.1\r\nHost: local")
    silent = _open(limited)
    for sock in (partial, silent):
        with sock:
            assert _closed(sock) == b""
    stats = limited.server.stats()
    assert stats["timed_out"] == 2 and stats["connections"] == 0


def test_the_port_caps_connections_per_client_closing_the_oldest_waiting_and_refusing_when_all_are_served(
        limited: Namespace) -> None:
    """No cap held any number of connections, each a thread. A client address holds at most
    max_connections_per_client (here 4): a fifth closes its oldest connection still waiting for a request; when all
    four are being served (here: waiting on a blocked broker) the fifth is answered 503. Two workers serve them,
    whatever the connections."""
    limited.call(lambda: limited.broker.create_entity(QueueSpec(name="capped")))
    waiting = [_open(limited, "127.0.0.2", b"GET /capped HTTP/1.1\r\n") for _ in range(4)]
    newest = _open(limited, "127.0.0.2", b"GET /capped HTTP/1.1\r\n")
    assert _closed(waiting[0]) == b""  # the oldest made room
    # another address is not touched by 127.0.0.2's cap
    with limited.client() as client:
        assert client.get_queue("capped").name == "capped"
    for sock in [*waiting, newest]:
        sock.close()
    gate = threading.Event()
    limited.executor.submit(gate.wait, 30)  # the broker's thread is busy: every request waits on it
    served = [_open(limited, "127.0.0.3", _get("/capped")) for _ in range(4)]
    try:
        deadline = time.monotonic() + 10
        while limited.server.stats()["busy"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        with _open(limited, "127.0.0.3", _get("/capped")) as refused:
            answer = _closed(refused)
        assert answer is not None and answer.startswith(b"HTTP/1.1 503 "), answer
        assert b"Connection: close" in answer
        stats = limited.server.stats()
        assert stats["workers"] == 2 and stats["connections_refused"] == 1 and stats["connections_evicted"] == 1
    finally:
        gate.set()
    for sock in served:
        with sock:
            sock.settimeout(10)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
