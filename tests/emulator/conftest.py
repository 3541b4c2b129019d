"""Fixtures of the emulator's own tests: an emulator that also serves AMQP over WebSockets, and an HTTP proxy."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from azure.servicebus.management import ServiceBusAdministrationClient

from spark_sb.admin import admin_client
from spark_sb.emulator import Emulator, NamespaceInfo, NamespaceOptions
from spark_sb.emulator.proxy import HttpProxy


@pytest.fixture(scope="session")
def websocket_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """The primary and the secondary on free ports, each with its ws:// and wss:// endpoints."""
    with Emulator([NamespaceOptions("primary"), NamespaceOptions("secondary")],
                  data_dir=tmp_path_factory.mktemp("websockets"), websockets=True) as emu:
        yield emu


@pytest.fixture(scope="session")
def http_proxy_server() -> Iterator[HttpProxy]:
    """An HTTP proxy asking for Basic authentication, as a workspace's egress proxy would."""
    with HttpProxy(username="sb-egress", password=secrets.token_urlsafe(12)) as proxy:
        yield proxy


@pytest.fixture
def admin(primary: NamespaceInfo) -> Iterator[ServiceBusAdministrationClient]:
    """The administration client of the primary namespace (no retries: a refusal is the answer)."""
    with admin_client(primary.connection_string, admin_endpoint=primary.admin_url, retry_total=0) as c:
        yield c
