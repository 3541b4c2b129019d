"""Messages the sink sends through its fast encoder (spark_sb.wire, issue 50), for the Java and JavaScript suites'
``python_fast_path`` scenario: another SDK, not the emulator's decoder, judges the bytes.

:func:`send` sends :data:`ROWS` through the sink's own code path (``spark_sb.sink.PartitionRun``, as a Spark
partition does) twice: with ``sink.encoder: fast`` to the ``fast`` queues and with ``sink.encoder: sdk`` (every
message built and encoded by azure-servicebus) to the ``sdk`` queues; a session queue of each for the rows with a
session id. It checks that the fast run's rows took the fast path (their bytes built by spark_sb.wire and added
to the batch as they are) and the SDK run's did not, and returns what the scenario program needs to check every
field of every message (:func:`spec`), as JSON in ``SB_FAST_PATH``:
``{"queues": {"fast", "sdk", "fast_session", "sdk_session"}, "session_id", "messages": [...]}``, each message
``{"message_id", "session": bool, "fast": bool, "body_b64", "subject", "content_type", "correlation_id", "to",
"reply_to", "partition_key", "session_id", "properties": {name: [AMQP type, text]}}``. The text of a value is
what the other SDK's value prints as (a timestamp's milliseconds, a binary's base64), so that a program checks it
by its own type table."""

from __future__ import annotations

import base64
import contextlib
import datetime
from collections.abc import Iterator, Mapping
from typing import Any

from pairing import pair_config

from spark_sb import sink as sink_module
from spark_sb import wire
from spark_sb.config import load_config
from spark_sb.emulator import Emulator

#: the queues of the scenario: name in the scenario -> whether it requires sessions
QUEUES = {"fast": False, "sdk": False, "fast_session": True, "sdk_session": True}

_BINARY = base64.b64encode(b"\x00\x01\x7f\x80\xfe\xff").decode()
#: every type of messages.SENDABLE_PROPERTY_TYPES that spark_sb.wire encodes itself: name -> (type, text)
_TYPED: dict[str, tuple[str, str | None]] = {
    "s": ("string", "text with ünïcode ✓"),
    "empty": ("string", ""),
    "sym": ("symbol", "a-symbol"),
    "bin": ("binary", _BINARY),
    "yes": ("boolean", "true"),
    "no": ("boolean", "false"),
    "b": ("byte", "-5"),
    "sh": ("short", "-300"),
    "i": ("int", "42"),
    "ineg": ("int", "-100000"),
    "imax": ("int", "2147483647"),
    "l": ("long", "-1234567890123"),
    "lsmall": ("long", "7"),
    "ub": ("ubyte", "200"),
    "us": ("ushort", "60000"),
    "ui": ("uint", "4000000000"),
    "ul": ("ulong", "12345678901"),
    "f": ("float", "1.5"),
    "d": ("double", "2.718281828459045"),
    "dneg": ("double", "-0.25"),
    "t": ("timestamp", "1704164645123"),
    "nothing": ("string", None),
}
#: types whose bytes the SDK's own value encoder writes inside the fast path (spark_sb.wire hands it the value)
_SDK_VALUES: dict[str, tuple[str, str | None]] = {
    "u": ("uuid", "6f1c2a9e-2b4d-4c4e-9a61-0d3f5e7b8c90"),
    "dec": ("decimal128", "12.5"),
}
_LONG_TEXT = "long " + "x" * 300  # past 255 bytes: the 32-bit string and map constructors


def _row(message_id: str, body: bytes | str, properties: Mapping[str, tuple[str, str | None]] | None = None,
         **fields: str) -> dict[str, Any]:
    row: dict[str, Any] = {"message_id": message_id, "body": body, **fields}
    if properties is not None:
        row["application_properties"] = {name: text for name, (_, text) in properties.items()}
        row["application_property_types"] = {name: kind for name, (kind, _) in properties.items()}
    return row


#: the rows sent to each queue (``session_id`` rows to the session queues)
ROWS: list[dict[str, Any]] = [
    _row("fp-every-field", b"\x00\x01 binary body \xff", _TYPED, subject="the subject",
         content_type="application/octet-stream", correlation_id="corr-1", to="to-1", reply_to="reply-queue",
         partition_key="pk-1"),
    _row("fp-text-body", "a str body with ünïcode ✓", {"s": ("string", "x"), "i": ("int", "1")},
         content_type="text/plain; charset=utf-8", subject="ünïcode subject"),
    _row("fp-large", b"\xab" * 5000, {**{f"p{n:03d}": ("string", f"value {n}") for n in range(40)},
                                       "long_text": ("string", _LONG_TEXT)},
         subject=_LONG_TEXT, correlation_id="c" * 128),
    _row("fp-minimal", b""),
    {"message_id": "fp-untyped", "body": b"untyped", "subject": "plain",  # no types: strings
     "application_properties": {"plain": "text", "n": "7"}},
    _row("fp-session", b"in a session", {"i": ("int", "3"), "t": ("timestamp", "0")}, session_id="fp-s",
         partition_key="fp-s", subject="session subject"),
    _row("fp-session-2", "second in the session", None, session_id="fp-s", reply_to="r"),
    _row("fp-sdk-values", b"uuid and decimal", {**_SDK_VALUES, "i": ("int", "9")}, subject="sdk values"),
    {**_row("fp-fallback", b"left to the SDK", {"i": ("int", "9")}, subject="fallback"),
     "scheduled_enqueue_time": datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)},
]
#: the rows the fast path leaves to the SDK (a scheduled enqueue time; one in the past is enqueued at once)
FALLBACK_IDS = {"fp-fallback"}


def spec(queues: Mapping[str, str]) -> dict[str, Any]:
    """What the scenario program checks (see the module's docstring)."""
    messages = []
    for row in ROWS:
        types = row.get("application_property_types") or {}
        messages.append({
            "message_id": row["message_id"],
            "session": "session_id" in row,
            "fast": row["message_id"] not in FALLBACK_IDS,
            "body_b64": base64.b64encode(row["body"].encode() if isinstance(row["body"], str) else row["body"])
            .decode(),
            **{name: row.get(name) for name in ("subject", "content_type", "correlation_id", "to", "reply_to",
                                                "partition_key", "session_id")},
            "properties": {name: [types.get(name, "string"), text]
                           for name, text in (row.get("application_properties") or {}).items()},
        })
    return {"queues": dict(queues), "session_id": "fp-s", "messages": messages}


@contextlib.contextmanager
def _counting_appends() -> Iterator[list[int]]:
    """Counts the messages spark_sb.wire.append added to a batch from their own bytes while the block runs."""
    counted = [0]
    original = wire.append

    def append(batch: Any, message: Any) -> bool:
        added = original(batch, message)
        counted[0] += added
        return added

    wire.append = append  # type: ignore[assignment]
    try:
        yield counted
    finally:
        wire.append = original  # type: ignore[assignment]


def _send(emulator: Emulator, encoder: str, plain: str, session: str) -> int:
    """Send :data:`ROWS` through a sink partition run with ``encoder``; the messages wire.append added."""
    raw = pair_config(emulator["primary"], emulator["secondary"], "fp", backlog_queue_count=1)
    config = load_config({**raw, "sink": {"encoder": encoder}})
    rows = [{**row, "entity": session if "session_id" in row else plain} for row in ROWS]
    try:
        with _counting_appends() as appended:
            run = sink_module.PartitionRun(config, config.fingerprint(), 1, 0, (), reject=False)
            out = list(run.run_rows(rows))
    finally:
        sink_module.close_senders()
    [summary] = [batch for batch in out if batch.column("kind")[0].as_py() == "summary"]
    assert summary.column("sent")[0].as_py() == len(ROWS), summary.to_pylist()
    return appended[0]


def send(emulator: Emulator, queues: Mapping[str, str]) -> dict[str, Any]:
    """Send :data:`ROWS` to ``queues`` (:data:`QUEUES`' names -> queue names on the emulator's primary) with each
    encoder; checks that the fast run's rows took the fast path; :func:`spec`."""
    for row in ROWS:
        message = sink_module._to_message(row, row["message_id"], fast=True)
        fast = wire.is_encoded(message) and message.encoded is not None  # type: ignore[attr-defined]
        assert fast == (row["message_id"] not in FALLBACK_IDS), f"{row['message_id']}: fast path {fast}"
        assert not wire.is_encoded(sink_module._to_message(row, row["message_id"], fast=False))
    fast_rows = len(ROWS) - len(FALLBACK_IDS)
    appended = _send(emulator, "fast", queues["fast"], queues["fast_session"])
    assert appended == fast_rows, f"the fast encoder's run added {appended} messages from their bytes, not {fast_rows}"
    appended = _send(emulator, "sdk", queues["sdk"], queues["sdk_session"])
    assert appended == 0, f"the SDK encoder's run added {appended} messages from spark_sb.wire's bytes"
    return spec(queues)
