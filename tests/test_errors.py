"""classify() maps every SDK exception as the "Error classes" table of behaviour.md says.

The SDK exceptions are made by the SDK itself: the AMQP-level cause is raised inside a real
ServiceBusSender's send (its link opening is replaced by the raise, so no network is used) and the SDK's
own handler (``_do_retryable_operation`` -> ``_handle_exception`` -> ``create_servicebus_exception``)
turns it into the exception an application sees, with the cause the SDK attaches.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
)
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusMessageBatch
from azure.servicebus._pyamqp.error import (
    AMQPConnectionError,
    AMQPLinkError,
    AuthenticationException,
    ErrorCondition,
    TokenAuthFailure,
    TokenExpired,
)
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
from azure.servicebus.exceptions import (
    MessageSizeExceededError,
    MessagingEntityDisabledError,
    MessagingEntityNotFoundError,
    OperationTimeoutError,
    ServiceBusAuthenticationError,
    ServiceBusAuthorizationError,
    ServiceBusCommunicationError,
    ServiceBusConnectionError,
    ServiceBusError,
    ServiceBusQuotaExceededError,
    ServiceBusServerBusyError,
)

from spark_sb.admin import admin_client
from spark_sb.errors import (
    ENCODING_ERRORS,
    BacklogUnavailableError,
    BadMessageError,
    ConfigError,
    CredentialRejectedError,
    EntityNotFoundError,
    ErrorClass,
    PairingError,
    SparkSbError,
    already_exists,
    as_spark_sb_error,
    classify,
    encoding_error,
    is_blip,
    is_connection_lost,
    is_link_gone,
    needs_session,
    redact,
    unreachable_reason,
    unwrap,
)

SECRET = "c2VjcmV0LWtleS12YWx1ZQ=="
CONNECTION_STRING = f"Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=send;SharedAccessKey={SECRET}"


@pytest.fixture(scope="module")
def client() -> Iterator[ServiceBusClient]:
    sb_client = ServiceBusClient.from_connection_string(CONNECTION_STRING, retry_total=0)
    yield sb_client
    sb_client.close()


def raised_by_sdk(client: ServiceBusClient, cause: BaseException) -> BaseException:
    """What ``sender.send_messages`` raises when opening the link fails with ``cause``."""
    sender = client.get_queue_sender("orders")

    def fail(*_args: object, **_kwargs: object) -> None:
        raise cause

    sender._open = fail  # the only replaced piece: no network, the SDK's own error handling runs
    with pytest.raises(BaseException) as caught:
        sender.send_messages(ServiceBusMessage("x"))
    return caught.value


SDK_CASES = [
    # (id, AMQP cause, SDK exception the application sees, class)
    ("socket-error", AMQPConnectionError(ErrorCondition.SocketError, description="reset by peer"),
     ServiceBusConnectionError, ErrorClass.OUTAGE),
    ("link-detach-forced", AMQPLinkError(ErrorCondition.LinkDetachForced, description="idle"),
     ServiceBusConnectionError, ErrorClass.OUTAGE),
    ("host-not-found", AMQPConnectionError(ErrorCondition.NotFound, description="no such host"),
     ServiceBusCommunicationError, ErrorClass.OUTAGE),
    ("send-timed-out", AMQPLinkError(ErrorCondition.ClientError, description="Send timed out"),
     OperationTimeoutError, ErrorClass.OUTAGE),
    ("entity-disabled", AMQPLinkError(b"com.microsoft:entity-disabled", description="disabled"),
     MessagingEntityDisabledError, ErrorClass.OUTAGE),
    ("quota-exceeded", AMQPLinkError(ErrorCondition.ResourceLimitExceeded, description="entity full"),
     ServiceBusQuotaExceededError, ErrorClass.OUTAGE),
    ("internal-error", AMQPLinkError(ErrorCondition.InternalError, description="oops"),
     ServiceBusError, ErrorClass.OUTAGE),
    ("server-busy", AMQPLinkError(b"com.microsoft:server-busy", description="busy"),
     ServiceBusServerBusyError, ErrorClass.THROTTLED),
    ("entity-not-found", AMQPLinkError(ErrorCondition.NotFound, description="no entity orders"),
     MessagingEntityNotFoundError, ErrorClass.CONFIGURATION_NOT_FOUND),
    ("message-too-large", AMQPLinkError(ErrorCondition.LinkMessageSizeExceeded, description="too large"),
     MessageSizeExceededError, ErrorClass.BAD_MESSAGE),
    # the credential is rejected: CBS put-token answered 401 / 403, or a claim is missing on attach
    ("cbs-401", TokenAuthFailure(401, b"InvalidSignature: The token has an invalid signature."),
     ServiceBusAuthenticationError, ErrorClass.CONFIGURATION_CREDENTIAL),
    ("cbs-403", TokenAuthFailure(403, b"Forbidden"),
     ServiceBusAuthenticationError, ErrorClass.CONFIGURATION_CREDENTIAL),
    ("missing-send-claim", AMQPLinkError(ErrorCondition.UnauthorizedAccess, description="'Send' claim required"),
     ServiceBusAuthorizationError, ErrorClass.CONFIGURATION_CREDENTIAL),
    ("cbs-404", TokenAuthFailure(404, b"The messaging entity could not be found"),
     ServiceBusAuthenticationError, ErrorClass.CONFIGURATION_NOT_FOUND),
    # the CBS exchange broke without the service saying no: an outage
    ("cbs-put-token-rejected", TokenAuthFailure(0, "Auth message has been rejected."),
     ServiceBusAuthenticationError, ErrorClass.OUTAGE),
    ("cbs-link-broken", TokenAuthFailure(
        status_code=ErrorCondition.ClientError,
        status_description="CBS authentication link is in broken status, please recreate the cbs link."),
     ServiceBusAuthenticationError, ErrorClass.OUTAGE),
    ("cbs-link-failed-to-open", AuthenticationException(
        ErrorCondition.InternalError, description="Failed to open CBS authentication link."),
     ServiceBusAuthenticationError, ErrorClass.OUTAGE),
    ("cbs-token-expired", TokenExpired(ErrorCondition.InternalError, description="CBS Authentication Expired."),
     ServiceBusAuthenticationError, ErrorClass.OUTAGE),
    # not AMQP errors: the SDK wraps them as "Handler failed"
    ("identity-rejects-secret", ClientAuthenticationError("AADSTS7000215: Invalid client secret provided."),
     ServiceBusError, ErrorClass.CONFIGURATION_CREDENTIAL),
    ("cbs-timed-out", TimeoutError("Authentication attempt timed-out."),
     ServiceBusError, ErrorClass.OUTAGE),
]


@pytest.mark.parametrize(
    ("cause", "sdk_type", "expected"),
    [case[1:] for case in SDK_CASES],
    ids=[case[0] for case in SDK_CASES],
)
def test_classify_maps_what_the_sdk_raises(
    client: ServiceBusClient, cause: BaseException, sdk_type: type, expected: ErrorClass
) -> None:
    raised = raised_by_sdk(client, cause)
    assert type(raised) is sdk_type
    assert classify(raised) is expected


def test_a_credential_error_is_told_apart_by_its_cause_not_its_text() -> None:
    # same SDK type and message, different causes
    rejected = ServiceBusAuthenticationError(message="auth failed 401", error=TokenAuthFailure(401, b"bad"))
    broken = ServiceBusAuthenticationError(
        message="auth failed 401", error=AMQPConnectionError(ErrorCondition.SocketError, description="reset")
    )
    assert classify(rejected) is ErrorClass.CONFIGURATION_CREDENTIAL
    assert classify(broken) is ErrorClass.OUTAGE


@pytest.mark.parametrize(
    ("condition", "status", "expected"),
    [
        (b"amqp:unauthorized-access", 401, ErrorClass.CONFIGURATION_CREDENTIAL),
        (b"com.microsoft:server-busy", 503, ErrorClass.THROTTLED),
        (b"amqp:not-found", 404, ErrorClass.CONFIGURATION_NOT_FOUND),
        (b"com.microsoft:timeout", 408, ErrorClass.OUTAGE),
        (b"amqp:resource-limit-exceeded", 403, ErrorClass.OUTAGE),  # quota: 403 is not a rejected credential
    ],
)
def test_classify_maps_management_request_failures(condition: bytes, status: int, expected: ErrorClass) -> None:
    # schedule_messages / cancel_scheduled_messages / peek fail through the SDK's management error handler
    with pytest.raises(ServiceBusError) as caught:
        PyamqpTransport.handle_amqp_mgmt_error(
            logging.getLogger("test"), "Service request failed.", condition, "described", status
        )
    assert classify(caught.value) is expected


def test_a_message_that_does_not_fit_a_batch_is_a_bad_message() -> None:
    batch = ServiceBusMessageBatch(max_size_in_bytes=200)
    with pytest.raises(ValueError) as caught:  # MessageSizeExceededError is also a ValueError
        batch.add_message(ServiceBusMessage(b"x" * 500))
    assert isinstance(caught.value, MessageSizeExceededError)
    assert classify(caught.value) is ErrorClass.BAD_MESSAGE


def test_a_plain_value_error_is_not_a_bad_message(client: ServiceBusClient) -> None:
    sender = client.get_queue_sender("orders")
    sender.close()
    with pytest.raises(ValueError) as caught:  # "The handler has already been shutdown"
        sender.send_messages(ServiceBusMessage("x"))
    assert classify(caught.value) is ErrorClass.OTHER
    assert classify(KeyError("bug")) is ErrorClass.OTHER


@pytest.mark.parametrize(
    "message",
    [
        ServiceBusMessage("x", application_properties={"n": 2**31}),  # int over its range
        ServiceBusMessage("x", application_properties={"raw": b"\xff"}),  # not UTF-8
        ServiceBusMessage("x", application_properties={"o": object()}),  # no AMQP type
    ],
    ids=["int-over-range", "not-utf8", "unknown-type"],
)
def test_an_encoding_error_is_a_bad_message_where_it_is_converted(message: ServiceBusMessage) -> None:
    batch = ServiceBusMessageBatch(max_size_in_bytes=262_144)
    with pytest.raises(ENCODING_ERRORS) as caught:
        batch.add_message(message)
    assert classify(caught.value) is ErrorClass.OTHER  # the raw error could come from anywhere
    converted = encoding_error(caught.value, "m-1", "orders")
    assert classify(converted) is ErrorClass.BAD_MESSAGE and not converted.retryable
    assert str(converted).startswith("message 'm-1' for entity 'orders' rejected: cannot be encoded: ")


def _http_error(status: int) -> HttpResponseError:
    error = HttpResponseError(message=f"status {status}")
    error.status_code = status
    return error


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ClientAuthenticationError("401 Unauthorized"), ErrorClass.CONFIGURATION_CREDENTIAL),
        (_http_error(403), ErrorClass.CONFIGURATION_CREDENTIAL),
        (ResourceNotFoundError("Queue 'orders' does not exist"), ErrorClass.CONFIGURATION_NOT_FOUND),
        (_http_error(429), ErrorClass.THROTTLED),
        (_http_error(503), ErrorClass.OUTAGE),
        (_http_error(400), ErrorClass.OTHER),
        (ConnectionResetError("reset"), ErrorClass.OUTAGE),
    ],
)
def test_classify_maps_administration_failures(error: BaseException, expected: ErrorClass) -> None:
    assert classify(error) is expected


def test_only_outages_count_toward_failover() -> None:
    assert [c for c in ErrorClass if c.counts_toward_failover] == [ErrorClass.OUTAGE]
    assert not ErrorClass.THROTTLED.fails_at_once
    assert ErrorClass.CONFIGURATION_CREDENTIAL.fails_at_once
    assert ErrorClass.CONFIGURATION_NOT_FOUND.fails_at_once
    assert ErrorClass.OTHER.fails_at_once
    assert not ErrorClass.BAD_MESSAGE.fails_at_once


def test_project_errors_share_one_root_and_carry_their_class() -> None:
    bad = BadMessageError("m-17", "orders", "324 KiB after the backlog rewrite, the limit is 256 KiB")
    assert str(bad) == (
        "message 'm-17' for entity 'orders' rejected: 324 KiB after the backlog rewrite, the limit is 256 KiB"
    )
    assert (bad.message_id, bad.entity) == ("m-17", "orders")
    backlog = BacklogUnavailableError("orders", ["contoso/x-servicebus-transfer/3"])
    assert "contoso/x-servicebus-transfer/3" in str(backlog) and "retried" in str(backlog)
    assert backlog.retryable
    cases = {
        bad: ErrorClass.BAD_MESSAGE,
        backlog: ErrorClass.OUTAGE,
        CredentialRejectedError("contoso.servicebus.windows.net", "401"): ErrorClass.CONFIGURATION_CREDENTIAL,
        EntityNotFoundError("contoso.servicebus.windows.net", "orders"): ErrorClass.CONFIGURATION_NOT_FOUND,
        ConfigError("syphon.receive_batch", "must be at least 1", 0): ErrorClass.OTHER,
        PairingError("no usable backlog queue"): ErrorClass.OTHER,
    }
    for error, expected in cases.items():
        assert isinstance(error, SparkSbError)
        assert classify(error) is expected


def test_config_error_names_option_and_value() -> None:
    error = ConfigError("send_availability.failover_interval", "must be between 0 s and 60 min", "2 h")
    assert str(error) == "send_availability.failover_interval: must be between 0 s and 60 min, got 2 h"
    assert str(error.with_option("sendAvailability.failoverInterval")).startswith("sendAvailability.failoverInterval:")


def test_as_spark_sb_error_turns_a_rejected_credential_into_a_clear_error(client: ServiceBusClient) -> None:
    raised = raised_by_sdk(client, TokenAuthFailure(401, b"InvalidSignature"))
    error = as_spark_sb_error(raised, namespace="primary contoso.servicebus.windows.net", entity="orders")
    assert isinstance(error, CredentialRejectedError)
    # the namespace, its host and the refusal (the CBS status and its description, not the SDK's wrapper's
    # "Service Bus has encountered an error")
    assert str(error) == ("the primary namespace (contoso.servicebus.windows.net) refused the credential for "
                          "'orders': 401 InvalidSignature")
    too_large = raised_by_sdk(client, AMQPLinkError(ErrorCondition.LinkMessageSizeExceeded, description="big"))
    bad = as_spark_sb_error(too_large, entity="orders", message_id="m-1")
    assert isinstance(bad, BadMessageError) and "'m-1'" in str(bad)
    outage = raised_by_sdk(client, AMQPConnectionError(ErrorCondition.SocketError, description="reset"))
    assert as_spark_sb_error(outage) is None


def test_secrets_never_reach_an_error_message() -> None:
    text = f"failed for {CONNECTION_STRING} with SharedAccessSignature sr=x&sig=abcSIG123&se=1&skn=send"
    cleaned = redact(text)
    assert SECRET not in cleaned and "abcSIG123" not in cleaned
    assert "SharedAccessKey=***" in cleaned
    assert SECRET not in str(CredentialRejectedError("contoso", text))
    assert SECRET not in str(ConfigError("primary.connection_string", "bad", CONNECTION_STRING))


@pytest.mark.parametrize(
    ("cause", "lost"),
    [
        (AMQPConnectionError(ErrorCondition.SocketError, description="reset by peer"), True),
        (AMQPLinkError(ErrorCondition.LinkDetachForced, description="idle"), True),
        (AMQPConnectionError(ErrorCondition.NotFound, description="no such host"), False),
        (AMQPLinkError(b"com.microsoft:server-busy", description="busy"), False),
        (TokenAuthFailure(401, b"InvalidSignature"), False),
    ],
    ids=["socket-error", "link-detach-forced", "host-not-found", "server-busy", "cbs-401"],
)
def test_a_connection_the_sdk_shut_down_is_told_apart(client: ServiceBusClient, cause: BaseException,
                                                      lost: bool) -> None:
    assert is_connection_lost(raised_by_sdk(client, cause)) is lost


def _schedule_refused(description: str) -> ServiceBusError:
    with pytest.raises(ServiceBusError) as caught:  # how the SDK reports a refused schedule_messages
        PyamqpTransport.handle_amqp_mgmt_error(
            logging.getLogger("test"), "Service request failed.", b"amqp:invalid-field", description, 400)
    return caught.value


def test_a_refusal_for_a_missing_session_id_is_told_apart() -> None:
    refused = _schedule_refused("The SessionId was not set on message 'p', and it cannot be sent to 'orders'")
    assert needs_session(refused)
    assert classify(refused) is ErrorClass.BAD_MESSAGE  # without the session id it can never be sent
    assert not needs_session(_schedule_refused("The message body is invalid"))
    assert not needs_session(ValueError("sessionid"))  # not an answer of the service


def test_a_timeout_raised_while_a_refusal_was_handled_is_an_outage_not_a_bad_message() -> None:
    """The soak's lost messages (issue 48): the syphon pinged a session queue (refused: no session id, which
    counts as reachable), then its send timed out inside that handler; the refusal was the timeout's context, and
    the messages were dead-lettered as refused by their destination."""
    refused = _schedule_refused("The SessionId was not set on message 'p', and it cannot be sent to 'orders'")
    timed_out = OperationTimeoutError(message="Send operation timed out")
    try:
        try:
            raise refused
        except ServiceBusError:
            raise timed_out  # noqa: B904 - the implicit chaining under test
    except OperationTimeoutError as raised:
        assert raised.__context__ is refused
        assert classify(raised) is ErrorClass.OUTAGE
    assert classify(ServiceBusError("wrapped", error=refused)) is ErrorClass.BAD_MESSAGE  # a cause the SDK attaches
    try:
        raise ServiceBusError("refused") from refused
    except ServiceBusError as explicit:
        assert classify(explicit) is ErrorClass.BAD_MESSAGE


def test_an_entity_that_already_exists_is_told_apart() -> None:
    assert already_exists(ResourceExistsError("Queue 'contoso/x-servicebus-transfer/0' already exists"))
    assert not already_exists(_http_error(409))
    assert not already_exists(ResourceNotFoundError("Queue 'orders' does not exist"))


def test_an_unreachable_endpoint_is_named_with_its_reason() -> None:
    emulator = "Endpoint=sb://127.0.0.1;SharedAccessKeyName=k;SharedAccessKey=x;UseDevelopmentEmulator=true"
    with admin_client(emulator, admin_endpoint="http://127.0.0.1:1", retry_total=0) as closed_port:
        with pytest.raises(Exception) as caught:  # noqa: PT011 - what azure-core raises, read by errors.py
            list(closed_port.list_queues())
    assert unreachable_reason(caught.value) == "connection refused"
    try:
        try:
            raise TimeoutError("timed out")
        except TimeoutError as exc:
            raise ConnectionError("could not connect") from exc
    except ConnectionError as wrapped:
        assert unreachable_reason(wrapped) == "connection timed out"
    assert unreachable_reason(_http_error(503)) is None


def test_a_settlement_on_a_receiver_the_sdk_shut_down_is_a_blip_and_other_value_errors_are_not(
        primary, make_queue) -> None:
    """The SDK's own ValueError for a settlement after it shut the receiver's handler down (what it does when the
    connection is lost: ``_close_handler``): an outage whose message comes back (its lock lapses), not a bug."""
    q = make_queue()
    with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as emulator_client, \
            emulator_client.get_queue_sender(q) as sender:
        sender.send_messages([ServiceBusMessage("a"), ServiceBusMessage("b")])
    with ServiceBusClient.from_connection_string(primary.connection_string, retry_total=0) as emulator_client, \
            emulator_client.get_queue_receiver(q, max_wait_time=5) as receiver:
        received = receiver.receive_messages(max_message_count=2, max_wait_time=5)
        assert len(received) == 2
        receiver._close_handler()  # as the SDK's _handle_exception does for a lost connection
        raised = []
        for settle in (receiver.abandon_message, receiver.complete_message):
            with pytest.raises(ValueError, match="handler has already been shutdown") as caught:
                settle(received[0])
            raised.append(caught.value)
    for error in raised:
        assert type(error) is ValueError
        assert classify(error) is ErrorClass.OUTAGE
        assert is_blip(error) and is_link_gone(error)
        assert as_spark_sb_error(error) is None  # handled as an outage, never a configuration error
    # not every ValueError: the words of an encoder, of a sender used after close, or of a bug stay OTHER
    for other in (ValueError("The handler has already been shutdown. Please use ServiceBusClient to create a new "
                             "instance."), ValueError("Failed to abandon"), ValueError("invalid literal"),
                  UnicodeEncodeError("utf-8", "x", 0, 1, "surrogates not allowed")):
        assert classify(other) is ErrorClass.OTHER and not is_blip(other) and not is_link_gone(other)


def test_a_pairing_error_says_what_happened_to_the_data_and_what_to_check() -> None:
    error = PairingError("secondary contoso-dr.servicebus.windows.net: no usable backlog queue under 'contoso'")
    text = str(error)
    assert text.startswith("secondary contoso-dr.servicebus.windows.net: no usable backlog queue under 'contoso'. ")
    assert "not acknowledged" in text and "replays it from its checkpoint" in text and "nothing is lost" in text
    for check in ("administration endpoint is reachable", "Manage rights", "queue quota",
                  "send_availability.backlog_prefix"):
        assert check in text, check
    assert error.detail == "secondary contoso-dr.servicebus.windows.net: no usable backlog queue under 'contoso'"
    # copied (a send that waited for another's attempt) or pickled (a Spark task's error): the advice once
    import pickle

    for again in (PairingError(text), pickle.loads(pickle.dumps(error))):
        assert str(again) == text and again.detail == error.detail
    assert "never" not in (PairingError.__doc__ or "")  # pairing is lazy: a send raises it
    assert "SharedAccessKey=***" in str(PairingError("Endpoint=sb://x/;SharedAccessKey=secret"))


def test_retry_after_reads_the_wait_a_throttled_namespace_asks_for() -> None:
    from azure.servicebus.exceptions import ServiceBusServerBusyError

    from spark_sb.errors import RETRY_AFTER_MAX, retry_after

    busy = ServiceBusServerBusyError(message="The request was terminated because the namespace 'p' is being throttled. "
                                             "Error code : 50002. Please wait 2 seconds and try again.")
    assert retry_after(busy) == 2.0
    assert retry_after(ServiceBusServerBusyError(message="busy")) is None
    assert retry_after(RuntimeError("Please wait 3600 seconds")) == RETRY_AFTER_MAX  # bounded


def test_a_connection_refused_at_the_quota_is_pushback_not_an_outage() -> None:
    from azure.servicebus.exceptions import ServiceBusConnectionError

    from spark_sb.errors import ErrorClass, classify, is_connection_quota

    refused = ServiceBusConnectionError(message="Cannot open a new connection")
    refused._condition = "amqp:resource-limit-exceeded"
    lost = ServiceBusConnectionError(message="connection lost")
    assert is_connection_quota(refused) and classify(refused) is ErrorClass.THROTTLED
    assert not is_connection_quota(lost) and classify(lost) is ErrorClass.OUTAGE


# --- unwrap: the spark-sb error behind what Spark raised (tests/spark/test_errors_through_spark.py: the real ones) --


class _Wrapped(Exception):
    """What Spark hands the caller: only the Python traceback's text of the error crossed the process."""


_TRACEBACK = """[STREAM_FAILED] Query [id = 1] terminated with exception: Traceback (most recent call last):
  File "/x/spark_sb/source.py", line 10, in _check
    raise CredentialRejectedError(namespace, refusal(exc), entity=entity) from exc
spark_sb.errors.CredentialRejectedError: the primary namespace (localhost:5672) refused the credential: 401 No
 SQLSTATE: 38000
\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(PythonRunner.scala:1)"""


def test_unwrap_rebuilds_the_spark_sb_error_from_the_text_spark_carries() -> None:
    wrapped = _Wrapped(_TRACEBACK)
    error = unwrap(wrapped)
    assert type(error) is CredentialRejectedError
    assert str(error) == "the primary namespace (localhost:5672) refused the credential: 401 No"
    assert error.error_class is ErrorClass.CONFIGURATION_CREDENTIAL and not error.retryable
    assert (error.namespace, error.entity) == (None, None) and error.__cause__ is wrapped
    # the last one printed is what was raised; a SQLSTATE Spark appends on the same line is not the message's
    both = _Wrapped("spark_sb.errors.SourceUnavailableError: first\n\nDuring handling...\n"
                    "spark_sb.errors.ConfigError: entity: required SQLSTATE: 38000")
    last = unwrap(both)
    assert type(last) is ConfigError and str(last) == "entity: required" and last.option is None


def test_unwrap_returns_a_spark_sb_error_as_it_is_and_none_for_anything_else() -> None:
    error = ConfigError("entity", "required")
    assert unwrap(error) is error
    try:
        try:
            raise error
        except ConfigError as inner:
            raise RuntimeError("wrapped in this process") from inner
    except RuntimeError as outer:
        assert unwrap(outer) is error
    assert unwrap(RuntimeError("a bug: spark_sb.errors.NotAClass: x")) is None
    assert unwrap(_Wrapped("ValueError: spark_sb.errors.ConfigError: not at the start of a line")) is None
    assert unwrap(_Wrapped("spark_sb.errors.redact: a function, not an error class")) is None
