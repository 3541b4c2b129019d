"""The configuration: parsed once, typed, frozen, validated, with errors that name the option and value."""

from __future__ import annotations

import dataclasses
import json
import pickle
from datetime import timedelta
from pathlib import Path

import pytest
from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential

from spark_sb.config import (
    SinkConfig,
    SparkSbConfig,
    format_duration,
    from_options,
    load_config,
    load_reference,
    parse_duration,
    redact_connection_string,
)
from spark_sb.errors import ConfigError

KEY = "Zm9vYmFyLXNlY3JldC1rZXktMTIzNDU2Nzg5MA=="
PRIMARY = f"Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey={KEY}"
SECONDARY = f"Endpoint=sb://contoso-dr.servicebus.windows.net/;SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey={KEY}"
CLIENT_SECRET = "cl13nt~s3cr3t~value"


def minimal(**sections: object) -> dict[str, object]:
    data: dict[str, object] = {"primary": {"connection_string": PRIMARY}, "secondary": {"connection_string": SECONDARY}}
    data.update(sections)
    return data


def error_of(data: object) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(data)  # type: ignore[arg-type]
    return str(caught.value)


def test_defaults_follow_the_behaviour_table() -> None:
    config = load_config(minimal())
    sa = config.send_availability
    assert sa.backlog_queue_count == 10
    assert sa.failover_interval == timedelta(seconds=60)
    assert sa.ping_primary_interval == timedelta(seconds=60)
    assert sa.server_busy_backoff == timedelta(seconds=10)
    assert config.syphon.receive_batch == 100
    assert config.syphon.retry_interval == timedelta(seconds=1)
    assert sa.backlog_prefix == "contoso"
    assert sa.backlog_queue_names()[0] == "contoso/x-servicebus-transfer/0"
    assert sa.backlog_queue_names()[-1] == "contoso/x-servicebus-transfer/9"
    assert config.sink == SinkConfig()
    assert config.sink.column_map["body"] == "body" and config.sink.chunk_size == 500


def test_yaml_file_with_environment_interpolation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SB_PRIMARY", PRIMARY)
    monkeypatch.setenv("SB_SECONDARY", SECONDARY)
    monkeypatch.delenv("SB_COUNT", raising=False)
    path = tmp_path / "conf.yaml"
    path.write_text(
        """
primary:   {connection_string: "${SB_PRIMARY}"}
secondary: {connection_string: "${SB_SECONDARY}"}
send_availability:
  backlog_queue_count: ${SB_COUNT:-4}
  failover_interval: 500ms
  ping_primary_interval: PT2M
  backlog_prefix: shop-eu
syphon: {retry_interval: 90, receive_batch: 50}
sink: {key_column: id, columns: {subject: topic}, source: {path: /data/in, options: {a: 1}}}
""",
        encoding="utf-8",
    )
    config = load_config(path)
    assert config.primary.connection_string is not None
    assert config.primary.connection_string.shared_access_key == KEY
    assert config.send_availability.backlog_queue_count == 4
    assert config.send_availability.failover_interval == timedelta(milliseconds=500)
    assert config.send_availability.ping_primary_interval == timedelta(minutes=2)
    assert config.send_availability.backlog_prefix == "shop-eu"
    assert config.syphon.retry_interval == timedelta(seconds=90)
    assert config.sink.key_column == "id"
    assert config.sink.column_map["subject"] == "topic" and config.sink.column_map["message_id"] == "id"
    assert config.sink.source.to_dict() == {"format": "delta", "path": "/data/in", "options": {"a": "1"}}
    assert load_config(str(path)) == config


def test_escaped_reference_is_kept_literally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SINK_TABLE", "metrics")
    config = load_config(minimal(sink={"metrics_table": "${SINK_TABLE}", "reject_table": "$${NOT_A_VARIABLE}"}))
    assert config.sink.metrics_table == "metrics"
    assert config.sink.reject_table == "${NOT_A_VARIABLE}"


def test_a_reference_adds_a_whole_number_to_a_numeric_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """``${NAME+N}`` and ``${NAME+N:-default}``: one variable moves several ports (conf/local.yaml)."""
    endpoint = "http://localhost:${SB_BASE+2:-5300}"
    monkeypatch.delenv("SB_BASE", raising=False)
    emulator = "Endpoint=sb://localhost:${SB_BASE:-5672};SharedAccessKeyName=k;SharedAccessKey=v;UseDevelopmentEmulator=true"
    unset = load_config(minimal(primary={"connection_string": emulator, "admin_endpoint": endpoint}))
    assert (unset.primary.port, unset.primary.admin_endpoint) == (5672, "http://localhost:5300")
    monkeypatch.setenv("SB_BASE", " 6000 ")
    moved = load_config(minimal(primary={"connection_string": emulator.replace("SB_BASE:", "SB_BASE+1:"),
                                         "admin_endpoint": endpoint}))
    assert (moved.primary.port, moved.primary.admin_endpoint) == (6001, "http://localhost:6002")
    monkeypatch.setenv("SB_BASE", "six thousand")
    text = error_of(minimal(primary={"connection_string": emulator, "admin_endpoint": endpoint}))
    assert text == ("primary.admin_endpoint: environment variable SB_BASE must be a whole number (referenced as "
                    "${SB_BASE+2}, which adds 2 to it)")
    assert "six thousand" not in text
    monkeypatch.delenv("SB_BASE")
    text = error_of(minimal(primary={"connection_string": emulator, "admin_endpoint": "http://localhost:${SB_BASE+2}"}))
    assert text.startswith("primary.admin_endpoint: environment variable SB_BASE is not set (referenced as "
                           "${SB_BASE+2}; write ${SB_BASE+2:-default} to give a default)")
    monkeypatch.setenv("SB_BASE", "")
    assert load_config(minimal(primary={"connection_string": emulator, "admin_endpoint": endpoint})) \
        .primary.admin_endpoint == "http://localhost:5300"  # empty takes the default, as ${NAME:-default} does


@pytest.mark.parametrize("base", [None, "6000"])
def test_the_shipped_local_configuration_moves_all_four_ports_with_one_variable(
        base: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """conf/local.yaml and ``spark-sb emulator start --base-port N`` agree: AMQP N and N+1, admin N+2 and N+3;
    unset, the emulator's defaults 5672/5300 and 5673/5301."""
    if base is None:
        monkeypatch.delenv("SPARK_SB_BASE_PORT", raising=False)
    else:
        monkeypatch.setenv("SPARK_SB_BASE_PORT", base)
    config = load_config(Path(__file__).resolve().parents[1] / "conf" / "local.yaml")
    ports = (config.primary.port, config.secondary.port, config.primary.admin_endpoint, config.secondary.admin_endpoint)
    assert ports == ((5672, 5673, "http://localhost:5300", "http://localhost:5301") if base is None
                     else (6000, 6001, "http://localhost:6002", "http://localhost:6003"))


def test_unset_variable_names_the_variable_and_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SB_MISSING", raising=False)
    text = error_of(minimal(secondary={"connection_string": "${SB_MISSING}"}))
    assert text.startswith("secondary.connection_string:")
    assert "SB_MISSING is not set" in text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("500ms", timedelta(milliseconds=500)),
        ("60s", timedelta(seconds=60)),
        ("5m", timedelta(minutes=5)),
        ("1h30m", timedelta(minutes=90)),
        ("2 min", timedelta(minutes=2)),
        ("PT1M", timedelta(minutes=1)),
        ("PT0.5S", timedelta(milliseconds=500)),
        ("P1DT1H", timedelta(days=1, hours=1)),
        (90, timedelta(seconds=90)),
        ("90", timedelta(seconds=90)),
        (1.5, timedelta(seconds=1.5)),
    ],
)
def test_durations(text: object, expected: timedelta) -> None:
    assert parse_duration(text, "x") == expected


def test_durations_are_written_as_people_write_them() -> None:
    assert format_duration(timedelta(hours=2)) == "2 h"
    assert format_duration(timedelta(minutes=60)) == "60 min"
    assert format_duration(timedelta(seconds=90)) == "90 s"
    assert format_duration(timedelta(milliseconds=1500)) == "1.5 s"
    assert format_duration(timedelta(milliseconds=500)) == "500 ms"


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"send_availability": {"failover_interval": "2h"}},
         "send_availability.failover_interval: must be between 0 s and 60 min, got 2 h"),
        ({"send_availability": {"ping_primary_interval": "500ms"}},
         "send_availability.ping_primary_interval: must be between 1 s and 30 min, got 500 ms"),
        ({"send_availability": {"ping_primary_interval": "31m"}},
         "send_availability.ping_primary_interval: must be between 1 s and 30 min, got 31 min"),
        ({"send_availability": {"server_busy_backoff": "5s"}},
         "send_availability.server_busy_backoff: must be at least 10 s, got 5 s"),
        ({"send_availability": {"backlog_queue_count": 0}},
         "send_availability.backlog_queue_count: must be between 1 and 100, got 0"),
        ({"send_availability": {"backlog_queue_count": "ten"}},
         "send_availability.backlog_queue_count: must be a whole number, got 'ten'"),
        ({"send_availability": {"failover_interval": "soon"}},
         "send_availability.failover_interval: not a duration"),
        ({"send_availability": {"primary_retry_total": 11}},
         "send_availability.primary_retry_total: must be between 0 and 10, got 11"),
        ({"send_availability": {"backlog_prefix": "/bad/"}},
         "send_availability.backlog_prefix: must be letters, digits"),
        ({"syphon": {"retry_interval": "3m"}}, "syphon.retry_interval: must be between 1 s and 2 min, got 3 min"),
        ({"syphon": {"retry_interval": "0.5s"}}, "syphon.retry_interval: must be between 1 s and 2 min, got 500 ms"),
        ({"syphon": {"receive_batch": 0}}, "syphon.receive_batch: must be between 1 and 10000, got 0"),
    ],
)
def test_out_of_range_values_are_named_with_their_value(sections: dict[str, object], message: str) -> None:
    assert error_of(minimal(**sections)).startswith(message)


def test_edges_of_the_ranges_are_accepted() -> None:
    config = load_config(
        minimal(
            send_availability={"failover_interval": 0, "ping_primary_interval": "30m", "server_busy_backoff": "10s"},
            syphon={"retry_interval": "2m"},
        )
    )
    assert config.send_availability.failover_interval == timedelta(0)
    assert config.syphon.retry_interval == timedelta(minutes=2)
    assert load_config(minimal(send_availability={"failover_interval": "60m"})).send_availability.failover_interval == (
        timedelta(hours=1)
    )


def test_unknown_options_are_named_with_a_suggestion() -> None:
    assert error_of(minimal(send_availability={"failover_intervall": "1m"})) == (
        "send_availability.failover_intervall: unknown option (did you mean failover_interval?)"
    )
    assert error_of(minimal(send_availability={"failoverInterval": "1m"})) == (
        "send_availability.failoverInterval: unknown option (did you mean failover_interval?)"
    )
    text = error_of(minimal(syphon={"retry": 1, "zzz": 2}))
    assert text.startswith("syphon: unknown options retry") and "zzz" in text
    assert error_of(minimal(secundary={})) == "secundary: unknown option (did you mean secondary?)"


def test_connection_string_is_parsed_into_fields() -> None:
    config = load_config(minimal())
    cs = config.primary.connection_string
    assert cs is not None
    assert cs.host == "contoso.servicebus.windows.net"
    assert cs.shared_access_key_name == "RootManageSharedAccessKey"
    assert cs.shared_access_key == KEY
    assert not cs.use_development_emulator
    assert config.primary.fully_qualified_namespace == "contoso.servicebus.windows.net"
    credential = config.primary.credential()
    assert isinstance(credential, AzureNamedKeyCredential)
    assert credential.named_key == ("RootManageSharedAccessKey", KEY)


def test_sas_connection_string() -> None:
    sas = "SharedAccessSignature sr=contoso&sig=SIGSECRET&se=1900000000&skn=send"
    config = load_config(minimal(primary={"connection_string": f"Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessSignature={sas}"}))
    credential = config.primary.credential()
    assert isinstance(credential, AzureSasCredential) and credential.signature == sas
    assert "SIGSECRET" not in repr(config)


@pytest.mark.parametrize(
    ("connection_string", "problem"),
    [
        (f"SharedAccessKeyName=n;SharedAccessKey={KEY}", "missing Endpoint"),
        (f"Endpoint=contoso;SharedAccessKeyName=n;SharedAccessKey={KEY}", "Endpoint must look like sb://"),
        (f"Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKey={KEY}", "SharedAccessKeyName and SharedAccessKey"),
        ("Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=n", "SharedAccessKeyName and SharedAccessKey"),
        ("Endpoint=sb://contoso.servicebus.windows.net/", "missing SharedAccessKey"),
        (f"Endpoint=sb://c.servicebus.windows.net/;SharedAccessKeyName=n;SharedAccessKey={KEY};SharedAccessSignature=s",
         "give either SharedAccessKey or SharedAccessSignature"),
        (f"Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=n;{KEY.rstrip('=')}", "malformed"),
        (f"{PRIMARY};UseDevelopmentEmulator=maybe", "UseDevelopmentEmulator must be true or false"),
        ("", "must be a Service Bus connection string"),
    ],
)
def test_bad_connection_strings_name_the_option_but_never_the_key(connection_string: str, problem: str) -> None:
    text = error_of(minimal(primary={"connection_string": connection_string}))
    assert text.startswith(f"primary.connection_string: {problem}")
    assert KEY not in text


def test_repr_and_str_never_show_a_secret() -> None:
    config = load_config(
        minimal(
            secondary={
                "fully_qualified_namespace": "contoso-dr.servicebus.windows.net",
                "credential": {"type": "client_secret", "tenant_id": "t", "client_id": "c", "client_secret": CLIENT_SECRET},
            },
            sink={"key_column": "id", "source": {"path": "/in", "options": {"password": "hunter2"}}},
        )
    )
    for text in (repr(config), str(config), repr(config.primary), str(config.primary.connection_string),
                 repr(config.secondary.credential_config), str(config.to_dict())):
        assert KEY not in text
        assert CLIENT_SECRET not in text
        assert "hunter2" not in text
    assert str(config.primary.connection_string) == (
        "Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey=***"
    )
    assert "key_column='id'" in repr(config.sink)


def test_redacting_a_malformed_connection_string_hides_unknown_segments() -> None:
    assert redact_connection_string(f"Endpoint=sb://a/;{KEY};SharedAccessKey={KEY}") == (
        "Endpoint=sb://a/;***;SharedAccessKey=***"
    )


def test_credential_sections() -> None:
    config = load_config(minimal(secondary={"fully_qualified_namespace": "sb://contoso-dr.servicebus.windows.net/"}))
    assert config.secondary.fully_qualified_namespace == "contoso-dr.servicebus.windows.net"
    assert config.secondary.credential_config is not None
    assert config.secondary.credential_config.type == "default"
    secret = load_config(
        minimal(secondary={
            "fully_qualified_namespace": "contoso-dr.servicebus.windows.net",
            "credential": {"type": "client_secret", "tenant_id": "t", "client_id": "c", "client_secret": CLIENT_SECRET},
        })
    )
    credential = secret.secondary.credential()
    assert type(credential).__name__ == "ClientSecretCredential"


@pytest.mark.parametrize(
    ("secondary", "message"),
    [
        ({"fully_qualified_namespace": "x.servicebus.windows.net", "credential": {"type": "client_secret", "client_id": "c"}},
         "secondary.credential.tenant_id: required when type is client_secret"),
        ({"fully_qualified_namespace": "x.servicebus.windows.net", "credential": {"type": "managed_identiy"}},
         "secondary.credential.type: must be one of default, client_secret, managed_identity (did you mean managed_identity?)"),
        ({"fully_qualified_namespace": "x.servicebus.windows.net", "credential": {"client_secret": CLIENT_SECRET}},
         "secondary.credential.client_secret: only used with type client_secret, got ***"),
        ({"connection_string": SECONDARY, "fully_qualified_namespace": "x.servicebus.windows.net"},
         "secondary: give either connection_string or fully_qualified_namespace"),
        ({"connection_string": SECONDARY, "credential": {"type": "default"}},
         "secondary.credential: only used with fully_qualified_namespace"),
        ({}, "secondary: needs connection_string, or fully_qualified_namespace"),
        ({"connection_string": PRIMARY}, "secondary: must be a different namespace from the primary, got contoso.servicebus.windows.net"),
        ({"fully_qualified_namespace": "CONTOSO.servicebus.windows.net"}, "secondary: must be a different namespace"),
        ({"connection_string": SECONDARY + ";EntityPath=orders"}, "secondary.connection_string: EntityPath is not allowed"),
    ],
)
def test_namespace_errors(secondary: dict[str, object], message: str) -> None:
    text = error_of(minimal(secondary=secondary))
    assert text.startswith(message)
    assert CLIENT_SECRET not in text and KEY not in text


def test_missing_sections_are_named(tmp_path: Path) -> None:
    assert error_of({"secondary": {"connection_string": SECONDARY}}) == "primary: required"
    empty = tmp_path / "empty.yaml"
    empty.write_text("", encoding="utf-8")
    assert error_of(empty) == "primary: required"
    broken = tmp_path / "broken.yaml"
    broken.write_text(f"primary: {{connection_string: '{PRIMARY}'\nsecondary: [", encoding="utf-8")
    text = error_of(broken)
    assert text.startswith(f"{broken}: not valid YAML at line") and KEY not in text
    assert "cannot read the configuration file" in error_of(tmp_path / "absent.yaml")


@pytest.mark.parametrize(
    ("endpoint", "prefix"),
    [
        ("sb://contoso.servicebus.windows.net/", "contoso"),
        ("sb://Contoso.servicebus.windows.net:5671/", "contoso"),
        ("sb://localhost:5672;UseDevelopmentEmulator=true", "localhost-5672"),
        ("sb://127.0.0.1:5673;UseDevelopmentEmulator=true", "127-0-0-1-5673"),
    ],
)
def test_default_backlog_prefix(endpoint: str, prefix: str) -> None:
    primary = f"Endpoint={endpoint};SharedAccessKeyName=n;SharedAccessKey={KEY}"
    if ";UseDevelopmentEmulator" in endpoint:
        address, flag = endpoint.split(";")
        primary = f"Endpoint={address};SharedAccessKeyName=n;SharedAccessKey={KEY};{flag}"
    config = load_config(minimal(primary={"connection_string": primary}))
    assert config.send_availability.backlog_prefix == prefix


def test_two_emulator_namespaces_differ_by_port() -> None:
    emulator = "Endpoint=sb://localhost:{};SharedAccessKeyName=n;SharedAccessKey=k;UseDevelopmentEmulator=true"
    config = load_config({"primary": {"connection_string": emulator.format(5672)},
                          "secondary": {"connection_string": emulator.format(5673)}})
    assert config.primary.fully_qualified_namespace == "localhost:5672"
    assert config.secondary.fully_qualified_namespace == "localhost:5673"
    assert config.primary.is_emulator
    with pytest.raises(ConfigError, match="different namespace"):
        load_config({"primary": {"connection_string": emulator.format(5672)},
                     "secondary": {"connection_string": emulator.format(5672)}})


def test_primary_clients_get_small_sdk_retry_settings() -> None:
    config = load_config(minimal(send_availability={"primary_try_timeout": "2s"}))
    kwargs = config.send_availability.primary_client_kwargs()
    assert kwargs == {"retry_total": 0, "retry_backoff_factor": 0.8, "retry_backoff_max": 5.0, "try_timeout": 2.0}
    client = config.primary.client(**kwargs)  # builds, does not connect
    try:
        assert client._config.retry_total == 0
        assert client._config.try_timeout == 2.0
        assert client.fully_qualified_namespace == "contoso.servicebus.windows.net"
    finally:
        client.close()


def test_frozen_picklable_and_fingerprinted() -> None:
    config = load_config(minimal(sink={"metrics_table": "metrics"}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.send_availability.failover_interval = timedelta(0)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sink.metrics_table = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.sink.columns["body"] = "other"  # type: ignore[index]
    copied = pickle.loads(pickle.dumps(config))
    assert copied == config and hash(copied) == hash(config)
    assert copied.fingerprint() == config.fingerprint() == load_config(minimal(sink={"metrics_table": "metrics"})).fingerprint()
    assert len(config.fingerprint()) == 32
    assert KEY not in config.fingerprint()
    other_key = load_config(minimal(primary={"connection_string": PRIMARY.replace(KEY, "b3RoZXI=")}, sink={"metrics_table": "metrics"}))
    assert other_key.fingerprint() != config.fingerprint()
    other_interval = load_config(minimal(send_availability={"failover_interval": "61s"}, sink={"metrics_table": "metrics"}))
    assert other_interval.fingerprint() != config.fingerprint()


def test_to_dict_with_secrets_round_trips() -> None:
    config = load_config(
        minimal(
            secondary={
                "fully_qualified_namespace": "contoso-dr.servicebus.windows.net",
                "credential": {"type": "client_secret", "tenant_id": "t", "client_id": "c", "client_secret": CLIENT_SECRET},
            },
            send_availability={"failover_interval": "1500ms", "backlog_queue_count": 3},
            sink={"key_column": "id", "reject_table": "$${NOT_A_VARIABLE}", "trigger": "1500ms",
                  "columns": {"body": "payload"}, "source": {"table": "events"}, "max_batches": 3},
        )
    )
    assert config.sink.reject_table == "${NOT_A_VARIABLE}"
    assert load_config(config.to_dict(secrets=True)) == config
    assert isinstance(load_config(config), SparkSbConfig)


def test_spark_options_build_the_same_object() -> None:
    expected = load_config(
        minimal(
            send_availability={"failover_interval": "30s", "backlog_queue_count": 4, "backlog_prefix": "shop"},
            syphon={"receive_batch": 10},
            sink={"key_column": "id"},
        )
    )
    options = {
        "primary.connectionString": PRIMARY,
        "SECONDARY.CONNECTION_STRING": SECONDARY,
        "sendAvailability.failoverInterval": "30s",
        "send_availability.backlog_queue_count": "4",
        "sendavailability.backlogprefix": "shop",
        "sendAvailability.pingPrimaryInterval": "",  # empty: unset, the default applies
        "syphon.receiveBatch": "10",
        "sink.keyColumn": "id",
        "checkpointLocation": "/tmp/cp",  # not ours: ignored
        "maxMessagesPerTrigger": "100",
    }
    assert from_options(options) == expected


def test_spark_option_errors_name_the_option_as_written() -> None:
    options = {"primary.connectionString": PRIMARY, "secondary.connectionString": SECONDARY}
    with pytest.raises(ConfigError) as caught:
        from_options({**options, "sendAvailability.failoverInterval": "2h"})
    assert str(caught.value) == "sendAvailability.failoverInterval: must be between 0 s and 60 min, got 2 h"
    with pytest.raises(ConfigError) as caught:
        from_options({**options, "sendAvailability.failoverIntervall": "1m"})
    assert str(caught.value) == "sendAvailability.failoverIntervall: unknown option (did you mean failover_interval?)"
    with pytest.raises(ConfigError) as caught:
        from_options({**options, "primary.connectionString": f"Endpoint=sb://a/;SharedAccessKey={KEY}"})
    assert str(caught.value).startswith("primary.connectionString: SharedAccessKeyName and SharedAccessKey")
    assert KEY not in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        from_options({**options, "secondary.credential.clientSecret": CLIENT_SECRET})
    assert CLIENT_SECRET not in str(caught.value)


@pytest.mark.parametrize(
    ("sink", "expected"),
    [
        ({"chunk_size": 0}, "sink.chunk_size: must be between 1 and 100000, got 0"),
        ({"columns": {"bdy": "x"}}, "sink.columns.bdy: unknown message field (did you mean body?)"),
        ({"columns": {"body": ""}}, "sink.columns.body: must be a column name, got ''"),
        ({"trigger": "soon"}, "sink.trigger: not a duration"),
        ({"source": {"format": "parquet"}}, "sink.source: format parquet needs a path (or give a table)"),
        ({"source": {"rows_per_second": 0}}, "sink.source.rows_per_second: must be at least 1, got 0"),
        ({"key_column": "a", "columns": {"message_id": "b"}}, "sink.key_column: give either key_column or"),
        ({"max_batches": "x"}, "sink.max_batches: must be a whole number, got 'x'"),
        ({"reject": "/tmp/r"}, "sink.reject: unknown option (did you mean reject_table?)"),
    ],
)
def test_sink_errors_name_the_option_and_the_value(sink: dict, expected: str) -> None:
    assert error_of(minimal(sink=sink)).startswith(expected)


def test_sink_options_from_spark_options() -> None:
    config = from_options({
        "primary.connectionString": PRIMARY, "secondary.connectionString": SECONDARY, "sink.keyColumn": "id",
        "sink.columns.sessionId": "sid", "sink.source.rowsPerSecond": "7", "sink.chunkSize": "20",
        "sink.trigger": "2s",
    })
    assert config.sink.column_map["session_id"] == "sid" and config.sink.column_map["message_id"] == "id"
    assert config.sink.source.rows_per_second == 7 and config.sink.chunk_size == 20
    assert config.sink.trigger == timedelta(seconds=2)


@pytest.mark.parametrize(
    "option",
    [
        "fs.azure.account.key.myaccount.dfs.core.windows.net",
        "fs.s3a.access.key",
        "fs.s3a.secret.key",
        "fs.azure.sas.container.myaccount.blob.core.windows.net",
        "fs.azure.account.oauth2.client.secret",
        "spark.hadoop.fs.gs.auth.service.account.private.key",
        "apiKey",
        "kafka.sasl.jaas.config",
    ],
)
def test_secret_reader_options_never_show(option: str) -> None:
    secret = "s3cr3t-v4lue-0123456789"
    config = load_config(minimal(sink={"key_column": "id",
                                       "source": {"path": "/in", "format": "parquet",
                                                  "options": {option: secret, "maxFilesPerTrigger": "1"}}}))
    for text in (repr(config), str(config), repr(config.sink), repr(config.sink.source.options),
                 str(config.to_dict())):
        assert secret not in text, (option, text)
    # what is not a secret stays readable, and the real value is still there for the reader
    assert "maxFilesPerTrigger" in repr(config.sink.source.options) and "'1'" in repr(config.sink.source.options)
    assert config.sink.source.options[option] == secret


def test_column_names_are_not_taken_for_secrets() -> None:
    config = load_config(minimal(sink={"entity": "orders", "columns": {"partition_key": "pk", "session_id": "sid"}}))
    assert "'pk'" in repr(config.sink) and "'sid'" in repr(config.sink)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"send_availability": {"backlog_queue_count": 10**9}},
         "send_availability.backlog_queue_count: must be between 1 and 100, got 1000000000"),
        ({"syphon": {"receive_batch": 10**9}}, "syphon.receive_batch: must be between 1 and 10000, got 1000000000"),
    ],
)
def test_counts_have_an_upper_bound(sections: dict[str, object], message: str) -> None:
    assert error_of(minimal(**sections)).startswith(message)


@pytest.mark.parametrize(("option", "value", "message"), [
    ("maxMessagesPerTrigger", "1000000000", "maxMessagesPerTrigger: must be at most 10000, got 1000000000"),
    ("maxMessagesPerTrigger", "0", "maxMessagesPerTrigger: must be positive, got 0"),
    ("receiveTimeout", "1e9", "receiveTimeout: must be at most 300, got 1e9"),
])
def test_backlog_source_options_are_bounded(tmp_path: Path, option: str, value: str, message: str) -> None:
    from spark_sb.source import BacklogStreamReader

    conf = tmp_path / "conf.yaml"
    conf.write_text(f"primary: {{connection_string: '{PRIMARY}'}}\nsecondary: {{connection_string: '{SECONDARY}'}}\n")
    with pytest.raises(ConfigError) as caught:
        BacklogStreamReader({"conf": str(conf), option: value})
    assert str(caught.value) == message


# --- pydantic models: frozen, unknown options, secrets, one duration type -------------------------------


def test_every_section_is_frozen() -> None:
    config = load_config(minimal(secondary={"fully_qualified_namespace": "contoso-dr.servicebus.windows.net"}))
    for section, name in ((config, "sink"), (config.primary, "admin_endpoint"), (config.primary.connection_string, "host"),
                          (config.secondary.credential_config, "client_id"), (config.syphon, "ledger"),
                          (config.sink.source, "table")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, name, None)
    with pytest.raises(AttributeError):
        del config.primary


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"secondary": {"fully_qualified_namespace": "x.servicebus.windows.net", "credential": {"tenantid": "t"}}},
         "secondary.credential.tenantid: unknown option (did you mean tenant_id?)"),
        ({"sink": {"source": {"rows_per_sec": 5}}}, "sink.source.rows_per_sec: unknown option (did you mean rows_per_second?)"),
        ({"primary": {"connectionString": PRIMARY}}, "primary.connectionString: unknown option (did you mean connection_string?)"),
        ({"primary": {"connection_string": PRIMARY, "adminEndpoint": "http://localhost:5300", "zzz": 1}},
         "primary: unknown options adminEndpoint (did you mean admin_endpoint?), zzz"),
    ],
)
def test_unknown_nested_options_are_named_with_a_suggestion(sections: dict[str, object], message: str) -> None:
    assert error_of(minimal(**sections)) == message


def test_a_sas_key_never_shows_in_repr_dumps_or_pickles() -> None:
    sas = "SharedAccessSignature sr=contoso&sig=SIGSECRET0123&se=1900000000&skn=send"
    config = load_config(minimal(
        primary={"connection_string": f"Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessSignature={sas}"},
        secondary={"fully_qualified_namespace": "contoso-dr.servicebus.windows.net",
                   "credential": {"type": "client_secret", "tenant_id": "t", "client_id": "c", "client_secret": CLIENT_SECRET}},
        sink={"source": {"path": "/in", "options": {"fs.azure.account.key.acct": "ACCOUNTKEY0123"}}},
    ))
    pickled = pickle.dumps(config)
    for shown in (repr(config), str(config), repr(config.primary.connection_string), str(config.model_dump()),
                  config.model_dump_json(), str(config.to_dict()), str(config.secondary.credential_config),
                  pickled.decode("latin-1")):
        assert "SIGSECRET0123" not in shown and CLIENT_SECRET not in shown and "ACCOUNTKEY0123" not in shown
    copied = pickle.loads(pickled)
    assert copied == config and hash(copied) == hash(config) and copied.fingerprint() == config.fingerprint()
    assert copied.primary.connection_string is not None
    assert copied.primary.connection_string.shared_access_signature == sas
    assert copied.secondary.credential_config is not None and copied.secondary.credential_config.client_secret is not None
    assert copied.secondary.credential_config.client_secret.get_secret_value() == CLIENT_SECRET
    assert copied.sink.source.options["fs.azure.account.key.acct"] == "ACCOUNTKEY0123"
    assert config.to_dict(secrets=True)["primary"]["connection_string"].endswith(sas)


def test_one_duration_type_for_the_configuration_and_the_emulator() -> None:
    from spark_sb import durations
    from spark_sb.emulator import admin_http, model

    for text in ("500ms", "60s", "5m", "1h30m", "2 min", "PT1M", "PT0.5S", "P1DT1H", 90, "90", 1.5):
        expected = parse_duration(text, "x")
        assert model.parse_duration(text, "x") == expected.total_seconds() == durations.parse_seconds(text)
    assert admin_http.parse_duration("P1DT1H", "x") == timedelta(days=1, hours=1).total_seconds()
    config = load_config(minimal(send_availability={"failover_interval": "PT1M30S"}))
    assert config.send_availability.failover_interval == timedelta(seconds=90)
    assert config.send_availability.model_dump()["failover_interval"] == "90s"  # dumped so that it parses back
    with pytest.raises(model.EntityConfigError, match="expected a duration such as 30s, 5m or PT1M, got 'soon'"):
        model.parse_duration("soon", "queue 'q': lock_duration")


# --- the configuration by reference ----------------------------------------------------------------------

REFERENCED = {
    "primary": {"connection_string": "${SB_PRIMARY}"},
    "secondary": {"connection_string": "Endpoint=sb://contoso-dr.servicebus.windows.net/;SharedAccessKeyName=n;"
                                       "SharedAccessKey=${SB_SECONDARY_KEY}"},
    "send_availability": {"failover_interval": "30s"},
    "sink": {"reject_table": "$${NOT_A_VARIABLE}"},
}


@pytest.fixture
def referenced_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SB_PRIMARY", PRIMARY)
    monkeypatch.setenv("SB_SECONDARY_KEY", KEY)


@pytest.mark.usefixtures("referenced_env")
def test_a_configuration_of_references_is_passed_by_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "conf.yaml"
    path.write_text(json.dumps(REFERENCED), encoding="utf-8")
    config = load_config(path)
    assert config.origin_path == str(path.resolve())
    reference = config.reference()
    assert reference == REFERENCED
    assert json.loads(json.dumps(reference)) == reference
    from_dict = load_config(REFERENCED)
    assert from_dict.origin_path is None and from_dict.reference() == REFERENCED
    # where it came from takes no part in equality, hashing, the fingerprint or the repr
    assert from_dict == config and hash(from_dict) == hash(config) and from_dict.fingerprint() == config.fingerprint()
    assert repr(from_dict) == repr(config) and str(tmp_path) not in repr(config)
    copied = pickle.loads(pickle.dumps(config))
    assert copied.reference() == REFERENCED and copied.origin_path == config.origin_path
    # rebuilt where it runs: the references resolve there
    monkeypatch.setenv("SB_SECONDARY_KEY", "b3RoZXI=")
    rebuilt = load_reference(json.dumps(reference))
    assert rebuilt.secondary.connection_string is not None
    assert rebuilt.secondary.connection_string.shared_access_key == "b3RoZXI="
    assert rebuilt.sink.reject_table == "${NOT_A_VARIABLE}"
    assert rebuilt.send_availability.failover_interval == timedelta(seconds=30)
    assert load_reference(reference) == rebuilt != config  # a mapping too; the key came from here


@pytest.mark.usefixtures("referenced_env")
@pytest.mark.parametrize(
    ("sections", "option"),
    [
        ({"primary": {"connection_string": PRIMARY}}, "primary.connection_string"),
        ({"primary": {"connection_string": "Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=n;"
                                           f"SharedAccessKey=${{SB_KEY:-{KEY}}}"}}, "primary.connection_string"),
        ({"secondary": {"fully_qualified_namespace": "contoso-dr.servicebus.windows.net",
                        "credential": {"type": "client_secret", "tenant_id": "t", "client_id": "c",
                                       "client_secret": CLIENT_SECRET}}}, "secondary.credential.client_secret"),
        ({"sink": {"source": {"path": "/in", "options": {"fs.s3a.secret.key": "s3cr3t"}}}}, "sink.source.options.fs.s3a.secret.key"),
    ],
)
def test_a_literal_secret_is_not_passed_by_reference(sections: dict[str, object], option: str) -> None:
    config = load_config({**REFERENCED, **sections})
    assert config.reference() is None
    given = {**REFERENCED, **sections}
    with pytest.raises(ConfigError) as caught:
        load_reference(json.dumps(given))
    assert str(caught.value) == (
        f"{option}: must be a ${{ENV_VAR}} reference when the configuration is passed to Spark by value, got ***")
    assert KEY not in str(caught.value) and CLIENT_SECRET not in str(caught.value) and "s3cr3t" not in str(caught.value)
    assert load_config(config.to_dict(secrets=True)).reference() is None


@pytest.mark.usefixtures("referenced_env")
def test_what_holds_no_secret_is_passed_by_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SB_AUTH", f"SharedAccessKeyName=n;SharedAccessKey={KEY}")
    monkeypatch.setenv("SB_CLIENT_SECRET", CLIENT_SECRET)
    given = {"primary": {"connection_string": "Endpoint=sb://contoso.servicebus.windows.net/;${SB_AUTH}"},
             "secondary": {"fully_qualified_namespace": "contoso-dr.servicebus.windows.net",
                           "credential": {"type": "client_secret", "tenant_id": "t", "client_id": "c",
                                          "client_secret": "${SB_CLIENT_SECRET}"}}}
    config = load_config(given)
    assert config.reference() == given
    rebuilt = load_reference(json.dumps(given))
    assert rebuilt == config and rebuilt.primary.connection_string is not None
    assert rebuilt.primary.connection_string.shared_access_key == KEY
    # nothing secret at all (azure.identity credentials): by reference too, even when built without a mapping
    plain = load_config({"primary": {"fully_qualified_namespace": "contoso.servicebus.windows.net"},
                         "secondary": {"fully_qualified_namespace": "contoso-dr.servicebus.windows.net"}})
    assert plain.reference() == {"primary": {"fully_qualified_namespace": "contoso.servicebus.windows.net"},
                                 "secondary": {"fully_qualified_namespace": "contoso-dr.servicebus.windows.net"}}
    assert from_options({"primary.connectionString": "${SB_PRIMARY}",
                         "secondary.connectionString": REFERENCED["secondary"]["connection_string"]}).reference() == {
        "primary": {"connection_string": "${SB_PRIMARY}"},
        "secondary": {"connection_string": REFERENCED["secondary"]["connection_string"]}}


def test_load_reference_refuses_what_is_not_a_configuration() -> None:
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_reference("{primary: ")
    with pytest.raises(ConfigError, match="must be a mapping of options, got list"):
        load_reference("[1]")


def test_the_backlog_source_refuses_a_secret_in_its_flat_options_and_takes_references(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark writes a source's options into its plan and event log: a literal key there is refused, naming the
    option and not the key; the same option as a ${VAR} reference is resolved where the reader runs."""
    from spark_sb.source import BacklogStreamReader

    with pytest.raises(ConfigError) as caught:
        BacklogStreamReader({"primary.connectionString": PRIMARY, "secondary.connectionString": SECONDARY})
    assert str(caught.value).startswith("primary.connectionString: holds a literal secret") and KEY not in str(
        caught.value)
    monkeypatch.setenv("SB_TEST_PRIMARY", PRIMARY)
    monkeypatch.setenv("SB_TEST_SECONDARY", SECONDARY)
    reader = BacklogStreamReader({"primary.connectionString": "${SB_TEST_PRIMARY}",
                                  "secondary.connectionString": "${SB_TEST_SECONDARY}"})
    assert reader.config.primary.connection_string is not None
    assert reader.config.primary.connection_string.shared_access_key == KEY


@pytest.mark.parametrize("name", ["local.yaml", "replicated.yaml"])
def test_the_shipped_configurations_load(name: str) -> None:
    config = load_config(Path(__file__).resolve().parents[1] / "conf" / name)
    assert config.sink.entity == "orders"
    assert config.replication.mode == ("active" if name == "replicated.yaml" else "paired")


def test_replication_mode_defaults_to_paired_and_a_bad_mode_or_a_missing_second_namespace_is_named() -> None:
    assert load_config(minimal()).replication.mode == "paired"
    assert load_config(minimal(replication={"mode": "passive"})).replication.replicating
    assert error_of(minimal(replication={"mode": "activ"})) == (
        "replication.mode: must be one of paired, active, passive (did you mean active?), got 'activ'")
    alone = {"primary": {"connection_string": PRIMARY}, "replication": {"mode": "active"}}
    assert error_of(alone).startswith("secondary: required: replication mode 'active' sends to both namespaces")
    assert error_of(minimal(replication={"mode": "active", "retry_interval": "2h"})).startswith(
        "replication.retry_interval: must be between")


def test_entity_paths_are_queues_with_any_name_or_topic_subscriptions() -> None:
    from spark_sb.config import entity_path

    assert entity_path("sales/orders") == "sales/orders"  # a hierarchical queue name, as backlog queues have
    assert entity_path(" events/subscriptions/all ") == "events/subscriptions/all"
    for bad in ("", "  ", "events/subscriptions/", "/subscriptions/all", "events/subscriptions/a/b", None):
        with pytest.raises(ConfigError, match="^entity: must name a queue or a subscription"):
            entity_path(bad)


# --- the network options -------------------------------------------------------------------------------------

PROXY_PASSWORD = "pr0xy~p@ss"


def test_network_options_reach_every_client_and_hide_the_proxy_password(tmp_path: Path) -> None:
    from azure.servicebus import TransportType

    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    config = load_config({
        "primary": {"connection_string": PRIMARY, "custom_endpoint_address": "gateway.contoso.com:8443",
                    "http_proxy": "http://bob:pr0xy~p%40ss@proxy.contoso.com:3128", "connection_verify": str(ca)},
        "secondary": {"connection_string": SECONDARY, "transport": "websockets"},
    })
    primary, secondary = config.primary, config.secondary
    assert primary.websockets and secondary.websockets  # a proxy implies WebSockets; the secondary says it
    assert primary.network_kwargs() == {
        "transport_type": TransportType.AmqpOverWebsocket, "custom_endpoint_address": "sb://gateway.contoso.com:8443",
        "http_proxy": {"proxy_hostname": "proxy.contoso.com", "proxy_port": 3128, "username": "bob",
                       "password": PROXY_PASSWORD},
        "connection_verify": str(ca)}
    assert primary.admin_kwargs() == {"proxies": {"https": "http://bob:pr0xy~p%40ss@proxy.contoso.com:3128",
                                                  "http": "http://bob:pr0xy~p%40ss@proxy.contoso.com:3128"},
                                      "connection_verify": str(ca)}
    client = primary.client()
    try:
        assert client._config.transport_type == TransportType.AmqpOverWebsocket
        assert client._config.http_proxy["password"] == PROXY_PASSWORD
        assert client._config.custom_endpoint_hostname == "gateway.contoso.com"
        assert client._config.connection_port == 8443
    finally:
        client.close()
    shown = [repr(config), str(config), json.dumps(config.to_dict()), repr(primary.http_proxy),
             str(pickle.dumps(config))]
    assert not any(PROXY_PASSWORD in text or "p%40ss" in text for text in shown)
    assert config.to_dict()["primary"]["http_proxy"] == {"host": "proxy.contoso.com", "port": 3128,
                                                         "username": "bob", "password": "***"}
    assert load_config(config.to_dict(secrets=True)) == config


def test_flat_spark_options_for_the_network() -> None:
    config = from_options({"primary.connectionString": PRIMARY, "secondary.connectionString": SECONDARY,
                           "primary.httpProxy.host": "proxy", "primary.httpProxy.port": "3128",
                           "primary.httpProxy.password": PROXY_PASSWORD, "secondary.transport": "websockets",
                           "secondary.customEndpointAddress": "sb://gw:443"})
    assert config.primary.http_proxy is not None and config.primary.http_proxy.port == 3128
    assert config.secondary.websockets and config.secondary.custom_endpoint_address == "sb://gw:443"


@pytest.mark.parametrize(("primary", "message"), [
    ({"http_proxy": f"http://bob:{PROXY_PASSWORD}@proxy"}, "primary.http_proxy: needs a port"),
    ({"http_proxy": "socks5://proxy:1080"}, "primary.http_proxy: must look like http://"),
    ({"http_proxy": "http://proxy:3128", "transport": "amqp"}, "primary.transport: a proxy tunnels AMQP over "
                                                               "WebSockets only"),
    ({"http_proxy": {"host": "proxy", "port": 0}}, "primary.http_proxy.port: must be"),
    ({"transport": "tcp"}, "primary.transport: must be one of amqp, websockets, got 'tcp'"),
    ({"custom_endpoint_address": "sb://gw/path"}, "primary.custom_endpoint_address: must look like sb://host"),
    ({"custom_endpoint_address": "sb://gw:99999"}, "primary.custom_endpoint_address: has an invalid port"),
])
def test_bad_network_options_name_the_option_never_the_password(primary: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"primary": {"connection_string": PRIMARY, **primary}, "secondary": {"connection_string": SECONDARY}})
    assert message in str(caught.value)
    assert PROXY_PASSWORD not in str(caught.value)


def test_a_missing_ca_bundle_is_named_when_a_client_is_built(tmp_path: Path) -> None:
    config = load_config({"primary": {"connection_string": PRIMARY, "connection_verify": str(tmp_path / "x.pem")},
                          "secondary": {"connection_string": SECONDARY}})
    with pytest.raises(ConfigError, match=r"connection_verify: \(namespace contoso.servicebus.windows.net\) is "
                                          r"not a readable CA bundle"):
        config.primary.client()


def test_a_malformed_proxy_url_is_named_with_its_password_masked() -> None:
    """urlparse cannot read an unclosed IPv6 bracket: its ValueError used to carry the whole URL, password too."""
    with pytest.raises(ConfigError) as caught:
        load_config({"primary": {"connection_string": PRIMARY, "http_proxy": f"http://bob:{PROXY_PASSWORD}@[::1:3128"},
                     "secondary": {"connection_string": SECONDARY}})
    message = str(caught.value)
    assert message.startswith("primary.http_proxy: ")
    assert "http://bob:***@[::1:3128" in message
    assert PROXY_PASSWORD not in message and "p@ss" not in message


@pytest.mark.parametrize("host", ["contoso.servicebus.windows.net", "sb://Contoso.ServiceBus.ChinaCloudAPI.cn:5671/",
                                  "contoso.servicebus.usgovcloudapi.net"])
def test_emulator_true_is_refused_for_a_real_service_bus_host(host: str) -> None:
    """emulator: true turns TLS off: never for a real namespace."""
    with pytest.raises(ConfigError) as caught:
        load_config({"primary": {"fully_qualified_namespace": host, "emulator": True},
                     "secondary": {"connection_string": SECONDARY}})
    message = str(caught.value)
    assert message.startswith("primary.emulator: ")
    assert host.split("://")[-1].split(":")[0].lower() in message


def test_emulator_true_keeps_tls_off_for_a_local_emulator() -> None:
    config = load_config({"primary": {"fully_qualified_namespace": "localhost:5672", "emulator": True},
                          "secondary": {"connection_string": SECONDARY}})
    assert config.primary.is_emulator and not config.primary.use_tls


def test_use_development_emulator_is_refused_for_a_real_service_bus_host() -> None:
    """UseDevelopmentEmulator=true turns TLS off as emulator: true does: never for a real namespace."""
    real = "Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=secret-key-value;" \
           "UseDevelopmentEmulator=true"
    with pytest.raises(ConfigError) as caught:
        load_config({"primary": {"connection_string": real}, "secondary": {"connection_string": SECONDARY}})
    message = str(caught.value)
    assert message.startswith("primary.connection_string: ") and "contoso.servicebus.windows.net" in message
    assert "TLS" in message and "secret-key-value" not in message


def test_a_misspelt_connection_string_key_is_named_with_its_did_you_mean() -> None:
    """A typo in a key's name (``SharedAccesKey``) was redacted as a whole (``***``), hiding the very typo; the
    error now names it and what it resembles, and still shows no secret."""
    text = f"Endpoint=sb://localhost:5672;SharedAccessKeyName=RootManageSharedAccessKey;SharedAccesKey={KEY}"
    with pytest.raises(ConfigError) as caught:
        load_config(minimal(primary={"connection_string": text}))
    message = str(caught.value)
    assert message.startswith("primary.connection_string: unknown key SharedAccesKey (did you mean SharedAccessKey?)")
    assert "SharedAccesKey=***" in message
    assert KEY not in message and KEY.rstrip("=") not in message


def test_an_unknown_connection_string_key_that_resembles_none_is_left_alone() -> None:
    text = f"Endpoint=sb://contoso.servicebus.windows.net/;SharedAccessKeyName=n;SharedAccessKey={KEY};TransportType=Amqp"
    config = load_config(minimal(primary={"connection_string": text}))
    assert config.primary.connection_string.shared_access_key == KEY
    assert redact_connection_string(text).endswith(";SharedAccessKey=***;TransportType=***")
