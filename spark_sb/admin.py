"""Provisioning through the unmodified ``ServiceBusAdministrationClient``.

``admin_client`` builds the SDK's client (``async_admin_client``: its ``azure.servicebus.aio.management``
counterpart, which needs aiohttp, as the SDK's async admin client does). For a real namespace it is exactly the SDK's client (TLS, the
SDK's default transport). For an emulator connection string (``UseDevelopmentEmulator=true``), or an
emulator reached with a Microsoft Entra ID credential (``use_tls=False``), the SDK would still build
``https://<namespace>/...`` URLs; the emulator serves its admin API over plain HTTP on its own port (5300
by Microsoft's convention), so the client gets a transport that sends every request to that endpoint
instead. (A credential's bearer token is attached before the transport rewrites the URL, so azure-core's
"bearer tokens only over https" rule sees the SDK's https URL.)
"""

from __future__ import annotations

import functools
import logging
import urllib.parse
from typing import TYPE_CHECKING, Any

from azure.core.pipeline.transport import RequestsTransport
from azure.servicebus.management import ServiceBusAdministrationClient

if TYPE_CHECKING:
    from azure.servicebus.aio.management import ServiceBusAdministrationClient as AsyncAdministrationClient

_LOGGER = logging.getLogger(__name__)

EMULATOR_ADMIN_PORT = 5300

__all__ = [
    "EMULATOR_ADMIN_PORT",
    "EmulatorAdminTransport",
    "admin_client",
    "async_admin_client",
    "admin_endpoint_of",
    "emulator_admin_endpoint",
    "namespace_admin_endpoint",
]


class _ToEmulator:
    """Sends every request to the emulator's admin endpoint.

    The SDK builds ``https://<namespace>/<path>?...``; this rewrites scheme and host:port to
    ``admin_endpoint`` (e.g. ``http://localhost:5300``) and keeps path and query. Used only for the emulator.
    Environment proxy settings are ignored unless ``use_env_settings=True`` is given: the emulator is local.
    """

    def __init__(self, admin_endpoint: str, **kwargs: Any) -> None:
        kwargs.setdefault("use_env_settings", False)
        super().__init__(**kwargs)
        self._scheme, self._netloc = _split_endpoint(admin_endpoint)

    @property
    def admin_endpoint(self) -> str:
        return f"{self._scheme}://{self._netloc}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(admin_endpoint={self.admin_endpoint!r})"

    def rewrite(self, url: str) -> str:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == self._scheme and parts.netloc == self._netloc:
            return url
        return urllib.parse.urlunsplit((self._scheme, self._netloc, parts.path, parts.query, parts.fragment))


# azure-core exports its transports through an unannotated module __getattr__: to mypy they are Any
class EmulatorAdminTransport(_ToEmulator, RequestsTransport):  # type: ignore[misc]
    """A ``RequestsTransport`` that sends every request to the emulator's admin endpoint (see ``_ToEmulator``)."""

    def send(self, request: Any, **kwargs: Any) -> Any:
        request.url = self.rewrite(request.url)
        return super().send(request, **kwargs)


@functools.cache
def _async_classes() -> tuple[type, type]:
    """The async admin client and an aiohttp transport to the emulator; ImportError naming aiohttp without it."""
    try:
        from azure.core.pipeline.transport import AioHttpTransport
        from azure.servicebus.aio.management import ServiceBusAdministrationClient as AsyncClient
    except ImportError as err:
        raise ImportError("async_admin_client needs aiohttp, as the SDK's async admin client does: "
                          "pip install aiohttp") from err

    class AsyncEmulatorAdminTransport(_ToEmulator, AioHttpTransport):  # type: ignore[misc]  # Any, as above
        async def send(self, request: Any, **kwargs: Any) -> Any:
            request.url = self.rewrite(request.url)
            return await super().send(request, **kwargs)

    return AsyncClient, AsyncEmulatorAdminTransport


def _split_endpoint(endpoint: str) -> tuple[str, str]:
    """``http://host:port`` or ``host:port`` -> (scheme, netloc). Errors name the value."""
    value = endpoint.strip()
    if "://" not in value:
        value = "http://" + value
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
        raise ValueError(f"admin_endpoint must look like http://host:port, got {endpoint!r}")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        raise ValueError(f"admin_endpoint has an invalid port: {endpoint!r}") from None
    return parts.scheme, parts.netloc


def _settings(connection_string: str) -> dict[str, str]:
    """Connection string properties with lower-cased names (values untouched)."""
    out: dict[str, str] = {}
    for part in connection_string.strip().rstrip(";").split(";"):
        name, sep, value = part.partition("=")
        if sep:
            out[name.strip().lower()] = value.strip()
    return out


def is_emulator(connection_string: str) -> bool:
    """True when the connection string says ``UseDevelopmentEmulator=true`` (any case)."""
    return _settings(connection_string).get("usedevelopmentemulator", "").lower() == "true"


def emulator_admin_endpoint(connection_string: str, admin_endpoint: str | None = None) -> str:
    """The admin endpoint for an emulator connection string: ``admin_endpoint`` when given, else the
    string's ``AdminEndpoint=``, else ``http://<Endpoint host>:5300`` (Microsoft's emulator convention)."""
    settings = _settings(connection_string)
    explicit = admin_endpoint or settings.get("adminendpoint")
    if explicit:
        return namespace_admin_endpoint("", explicit)
    try:
        return namespace_admin_endpoint(settings.get("endpoint", ""))
    except ValueError:
        raise ValueError("the connection string has no Endpoint=sb://host[:port]") from None


def _without_admin_endpoint(connection_string: str) -> str:
    parts = [p for p in connection_string.strip().rstrip(";").split(";")
             if p.partition("=")[0].strip().lower() != "adminendpoint"]
    return ";".join(parts)


def admin_client(
    connection_string: str | None = None,
    *,
    fully_qualified_namespace: str | None = None,
    credential: Any = None,
    admin_endpoint: str | None = None,
    use_tls: bool = True,
    **kwargs: Any,
) -> ServiceBusAdministrationClient:
    """A ``ServiceBusAdministrationClient`` for a connection string, or a namespace and a credential.

    Emulator connection strings (``UseDevelopmentEmulator=true``) get plain HTTP to ``admin_endpoint``
    (default: the string's ``AdminEndpoint=``, else port 5300 on the Endpoint's host); so does a namespace and
    credential with ``use_tls=False`` (the emulator with Entra ID; default: port 5300 on the namespace's host).
    Anything else is the SDK's own client with TLS; ``admin_endpoint`` is refused there. Other keyword
    arguments go to the SDK (``retry_total``, ``api_version``, ``connection_timeout``...).
    """
    client: ServiceBusAdministrationClient = _build(ServiceBusAdministrationClient, EmulatorAdminTransport,
                                                    connection_string, fully_qualified_namespace, credential,
                                                    admin_endpoint, use_tls, kwargs)
    return client


def async_admin_client(
    connection_string: str | None = None,
    *,
    fully_qualified_namespace: str | None = None,
    credential: Any = None,
    admin_endpoint: str | None = None,
    use_tls: bool = True,
    **kwargs: Any,
) -> AsyncAdministrationClient:
    """:func:`admin_client` for ``azure.servicebus.aio.management``: the same arguments and choices, an async
    client (``async with async_admin_client(conn) as admin: await admin.create_queue(...)``). Needs aiohttp;
    ``credential`` is an async credential (``azure.identity.aio``)."""
    client_class, transport_class = _async_classes()
    client: AsyncAdministrationClient = _build(client_class, transport_class, connection_string,
                                               fully_qualified_namespace, credential, admin_endpoint, use_tls,
                                               kwargs)
    return client


def _build(client_class: Any, transport_class: type, connection_string: str | None,
           fully_qualified_namespace: str | None, credential: Any, admin_endpoint: str | None, use_tls: bool,
           kwargs: dict[str, Any]) -> Any:
    if connection_string is not None:
        if fully_qualified_namespace is not None or credential is not None:
            raise ValueError("pass either a connection string or fully_qualified_namespace and credential, not both")
        if is_emulator(connection_string):
            if "transport" in kwargs:
                raise ValueError("a custom transport cannot be used with an emulator connection string")
            endpoint = emulator_admin_endpoint(connection_string, admin_endpoint)
            transport = transport_class(endpoint, **kwargs)
            _LOGGER.debug("admin client for the emulator's admin API at %s", endpoint)
            return client_class.from_connection_string(
                _without_admin_endpoint(connection_string), transport=transport, **kwargs
            )
        if admin_endpoint is not None or "adminendpoint" in _settings(connection_string):
            raise ValueError("an admin endpoint applies only to emulator connection strings "
                             "(UseDevelopmentEmulator=true); real namespaces are reached over TLS")
        return client_class.from_connection_string(connection_string, **kwargs)
    if fully_qualified_namespace is None or credential is None:
        raise ValueError("pass a connection string, or fully_qualified_namespace and credential")
    if not use_tls:
        if "transport" in kwargs:
            raise ValueError("a custom transport cannot be used with use_tls=False (the emulator)")
        endpoint = namespace_admin_endpoint(fully_qualified_namespace, admin_endpoint)
        _LOGGER.debug("admin client for the emulator's admin API at %s (token credential)", endpoint)
        return client_class(fully_qualified_namespace, credential, transport=transport_class(endpoint, **kwargs),
                            **kwargs)
    if admin_endpoint is not None:
        raise ValueError("an admin endpoint applies only to emulator connection strings "
                         "(UseDevelopmentEmulator=true); real namespaces are reached over TLS")
    return client_class(fully_qualified_namespace, credential, **kwargs)


def namespace_admin_endpoint(fully_qualified_namespace: str, admin_endpoint: str | None = None) -> str:
    """The emulator's admin endpoint for a namespace (``host[:port]``, or an ``sb://`` endpoint): ``admin_endpoint``
    when given, else ``http://<host>:5300``."""
    if admin_endpoint:
        scheme, netloc = _split_endpoint(admin_endpoint)
        return f"{scheme}://{netloc}"
    host = urllib.parse.urlsplit("//" + fully_qualified_namespace.split("://", 1)[-1]).hostname
    if not host:
        raise ValueError(f"fully_qualified_namespace has no host: {fully_qualified_namespace!r}")
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{EMULATOR_ADMIN_PORT}"


def admin_endpoint_of(connection_string: str | None, fully_qualified_namespace: str,
                      admin_endpoint: str | None = None, *, use_tls: bool = True) -> str:
    """Where :func:`admin_client` sends requests, for error messages (no secret): the emulator's admin
    endpoint for an emulator connection string or ``use_tls=False``, else ``https://<namespace>``."""
    try:
        if connection_string is not None and is_emulator(connection_string):
            return emulator_admin_endpoint(connection_string, admin_endpoint)
        if connection_string is None and not use_tls:
            return namespace_admin_endpoint(fully_qualified_namespace, admin_endpoint)
    except ValueError:
        pass
    return f"https://{fully_qualified_namespace}"
