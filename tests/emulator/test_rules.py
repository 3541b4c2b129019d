"""Subscription rules through the unmodified SDK (ServiceBusAdministrationClient through the project's admin
wrapper, ServiceBusClient for the messages), following the calls of Microsoft's topic samples: SQL filters with
parameters and the grammar the samples use, rule actions, filter counts; unparsable text gets a 400 naming it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from azure.core.exceptions import HttpResponseError
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.management import (
    CorrelationRuleFilter,
    ServiceBusAdministrationClient,
    SqlRuleAction,
    SqlRuleFilter,
)

from spark_sb.emulator.sql import Context, SqlError, apply_action, compile_action, compile_filter


def received(client: ServiceBusClient, topic: str, sub: str) -> list[Any]:
    # the messages are stored when the send returns: a short wait only tells that no more are coming
    with client.get_subscription_receiver(topic, sub, max_wait_time=2) as r:
        got = r.receive_messages(max_message_count=50, max_wait_time=0.5)
        for m in got:
            r.complete_message(m)
    return got


def _props(m: Any) -> dict[str, Any]:
    def text(v: Any) -> Any:
        return v.decode() if isinstance(v, bytes) else v

    return {text(k): text(v) for k, v in (m.application_properties or {}).items()}


def _colours(client: ServiceBusClient, topic: str) -> None:
    with client.get_topic_sender(topic) as s:
        s.send_messages([
            ServiceBusMessage("red-3", application_properties={"Color": "Red", "Quantity": 3}, subject="bulk"),
            ServiceBusMessage("blue-10", application_properties={"Color": "Blue", "Quantity": 10}, subject="priority"),
            ServiceBusMessage("green", application_properties={"Color": "Green"}, to="shop"),
        ])


def test_sql_filters_with_parameters_and_the_samples_grammar(
    client: ServiceBusClient, admin: ServiceBusAdministrationClient, make_topic: Callable[..., str]
) -> None:
    topic = make_topic({})
    filters = {
        "param": SqlRuleFilter("Color = @c", parameters={"@c": "Red"}),
        "or": SqlRuleFilter("Color = 'Red' OR Quantity > 5"),
        "in": SqlRuleFilter("Color IN ('Green', 'Blue') AND NOT Quantity < 5"),
        "like": SqlRuleFilter("sys.Label LIKE 'prio%'"),
        "isnull": SqlRuleFilter("Quantity IS NULL AND sys.To = 'shop'"),
        "arith": SqlRuleFilter("Quantity * 2 >= @min", parameters={"@min": 20}),
    }
    for name, rule_filter in filters.items():
        admin.create_subscription(topic, name)
        admin.delete_rule(topic, name, "$Default")
        admin.create_rule(topic, name, name, filter=rule_filter)
    param_rule = admin.get_rule(topic, "param", "param")
    assert param_rule.filter.sql_expression == "Color = @c" and dict(param_rule.filter.parameters) == {"@c": "Red"}
    _colours(client, topic)
    with ThreadPoolExecutor(len(filters)) as pool:  # a receiver takes a second to close: in parallel
        by_name = dict(zip(filters, pool.map(lambda name: received(client, topic, name), filters), strict=True))
    got = {name: sorted(str(m) for m in msgs) for name, msgs in by_name.items()}
    assert got == {
        "param": ["red-3"],
        "or": ["blue-10", "red-3"],
        "in": ["blue-10"],
        "like": ["blue-10"],
        "isnull": ["green"],
        "arith": ["blue-10"],
    }


def test_rule_actions_set_and_remove_properties_of_the_subscriptions_copy(
    client: ServiceBusClient, admin: ServiceBusAdministrationClient, make_topic: Callable[..., str]
) -> None:
    topic = make_topic({"plain": {}})
    admin.create_subscription(topic, "act")
    admin.delete_rule(topic, "act", "$Default")
    admin.create_rule(topic, "act", "recolour", filter=SqlRuleFilter("Color = 'Red'"),
                      action=SqlRuleAction("SET Color = 'Crimson'; SET Quantity = Quantity + @n; SET sys.Label = 'seen'",
                                           parameters={"@n": 100}))
    admin.create_rule(topic, "act", "strip", filter=CorrelationRuleFilter(properties={"Color": "Blue"}),
                      action=SqlRuleAction("REMOVE Quantity"))
    rule = admin.get_rule(topic, "act", "recolour")
    assert isinstance(rule.action, SqlRuleAction) and rule.action.sql_expression.startswith("SET Color = 'Crimson'")
    _colours(client, topic)
    act = {str(m): m for m in received(client, topic, "act")}
    assert sorted(act) == ["blue-10", "red-3"]
    assert _props(act["red-3"]) == {"Color": "Crimson", "Quantity": 103}
    assert act["red-3"].subject == "seen"
    assert _props(act["blue-10"]) == {"Color": "Blue"}
    assert act["blue-10"].subject == "priority"
    # the other subscription's copy is untouched
    plain = {str(m): m for m in received(client, topic, "plain")}
    assert _props(plain["red-3"]) == {"Color": "Red", "Quantity": 3} and plain["red-3"].subject == "bulk"


@pytest.mark.parametrize(
    ("rule_filter", "action", "named"),
    [
        (SqlRuleFilter("Color = "), None, "Color = "),
        (SqlRuleFilter("Color === 'x'"), None, "Color === 'x'"),
        (SqlRuleFilter("Color = @missing"), None, "@missing"),
        (SqlRuleFilter("1=1"), SqlRuleAction("SET"), "SET"),
        (SqlRuleFilter("1=1"), SqlRuleAction("DROP Color"), "DROP Color"),
    ],
)
def test_an_unparsable_filter_or_action_gets_400_naming_the_text(
    client: ServiceBusClient, admin: ServiceBusAdministrationClient, make_topic: Callable[..., str],
    rule_filter: Any, action: Any, named: str,
) -> None:
    topic = make_topic({"s": {}})
    with pytest.raises(HttpResponseError) as err:
        admin.create_rule(topic, "s", "bad", filter=rule_filter, action=action)
    assert err.value.status_code == 400
    assert named in str(err.value)
    # the emulator keeps serving
    assert [r.name for r in admin.list_rules(topic, "s")] == ["$Default"]
    with client.get_topic_sender(topic) as s:
        s.send_messages(ServiceBusMessage("after"))
    assert [str(m) for m in received(client, topic, "s")] == ["after"]


def test_filter_counts_in_topic_and_subscription_runtime_properties(
    admin: ServiceBusAdministrationClient, make_topic: Callable[..., str]
) -> None:
    topic = make_topic({"a": {}, "b": {}})
    admin.create_rule(topic, "a", "sql1", filter=SqlRuleFilter("x = 1"))
    admin.create_rule(topic, "a", "corr", filter=CorrelationRuleFilter(correlation_id="c"))
    admin.create_rule(topic, "b", "corr", filter=CorrelationRuleFilter(properties={"k": "v"}))
    props = admin.get_topic_runtime_properties(topic)
    assert props.subscription_count == 2
    # $Default (a true filter, which is a SQL filter 1=1) in both, sql1: 3 SQL; 2 correlation filters
    assert (props.sql_filter_count, props.correlation_filter_count) == (3, 2)


# --------------------------------------------------------------------------- the parser itself (no network)


def _ctx(props: dict[str, Any], **fields: Any) -> Context:
    return Context(fields, props, {})


def test_three_valued_logic_missing_properties_never_match_but_is_null_does() -> None:
    assert compile_filter("Missing = 1 OR 1 = 1")(_ctx({})) is True
    assert compile_filter("Missing = 1")(_ctx({})) is False
    assert compile_filter("NOT Missing = 1")(_ctx({})) is False  # NOT unknown is unknown
    assert compile_filter("Missing IS NULL")(_ctx({})) is True
    assert compile_filter("a <> 'x'")(_ctx({"a": "y"})) is True
    assert compile_filter("a NOT IN ('x', 'y')")(_ctx({"a": "z"})) is True
    assert compile_filter("a LIKE '50!%%' ESCAPE '!'")(_ctx({"a": "50% off"})) is True
    assert compile_filter("[my prop] = 'v' AND user.n >= 2.5")(_ctx({"my prop": "v", "n": 3})) is True
    assert compile_filter("sys.MessageId = 'm1' AND sys.CorrelationId = 'c'")(
        _ctx({}, message_id="m1", correlation_id="c")) is True
    assert compile_filter("a = '1'")(_ctx({"a": 1})) is False  # no implicit conversion


def test_actions_run_in_order_and_errors_name_the_position() -> None:
    changes = compile_action("SET a = 'x'; SET b = a + 'y'; REMOVE c")
    props, fields = apply_action(changes, _ctx({"a": "0", "c": 1}))
    assert props == {"a": "x", "b": "xy"} and fields == {}
    with pytest.raises(SqlError, match=r"'EXISTS\(a\)'.*not supported.*position 0"):
        compile_filter("EXISTS(a)")
    with pytest.raises(SqlError, match="sys.MessageId"):
        compile_action("SET sys.MessageId = 'x'")

