"""Every administration (HTTP) call is bounded by the namespace's ``admin_timeout`` (issue 33): a management endpoint
that accepts connections and never answers costs seconds, never azure-core's 300 s. Pairing, the CLI's status and
the administration client itself, against a silent endpoint beside the emulator's AMQP port."""

from __future__ import annotations

import pytest
from pairing import pair_config, within

from spark_sb import bus
from spark_sb.config import load_config
from spark_sb.errors import ConfigError, PairingError
from spark_sb.paired import PairedSender

#: what "within a minute" means here: the SDK's default would wait 300 s for each request
MINUTE = 60.0



def _silent(config: dict, side: str, endpoint: str, timeout: str = "1s") -> dict:
    return {**config, side: {**config[side], "admin_endpoint": endpoint, "admin_timeout": timeout}}


def test_an_administration_call_to_an_endpoint_that_never_answers_fails_within_its_timeout(
    primary, secondary, silent_endpoint
) -> None:
    config = load_config(_silent(pair_config(primary, secondary, "at"), "primary", silent_endpoint))

    def ask() -> None:
        with bus.admin_client(config.primary, retry_total=0) as admin:
            admin.get_queue("anything")

    with pytest.raises(Exception, match="(?i)timed? ?out"):
        within(MINUTE, ask)


def test_pairing_with_a_secondary_management_endpoint_that_never_answers_fails_within_a_minute(
    primary, secondary, silent_endpoint
) -> None:
    config = _silent(pair_config(primary, secondary, "at", provision_retries=1,
                                 provision_retry_spacing="0s"), "secondary", silent_endpoint)
    with PairedSender.from_config(config) as sender, pytest.raises(PairingError):
        within(MINUTE, sender.pair)


def test_admin_timeout_is_checked_naming_the_option(primary, secondary) -> None:
    with pytest.raises(ConfigError, match=r"primary.admin_timeout: .*, got 0 ?s"):
        load_config({**pair_config(primary, secondary, "at"),
                     "primary": {"connection_string": primary.connection_string, "admin_timeout": "0s"}})
    default = load_config(pair_config(primary, secondary, "at"))
    assert default.primary.admin_timeout_seconds == 10.0
