"""The emulator's Microsoft Entra ID authority over https: what MSAL (inside azure-identity's
``ClientSecretCredential``) calls for the client-credentials grant.

MSAL, given ``authority="https://localhost:<port>"`` and ``disable_instance_discovery=True``, reads the tenant's
OpenID configuration and posts to the token endpoint it names:

* ``GET /{tenant}/v2.0/.well-known/openid-configuration`` -> :meth:`~spark_sb.emulator.aad.Authority.openid_configuration`;
* ``POST /{tenant}/oauth2/v2.0/token`` (form: ``grant_type=client_credentials``, ``client_id``,
  ``client_secret``, ``scope=https://servicebus.azure.net/.default``) ->
  :meth:`~spark_sb.emulator.aad.Authority.client_credentials_response`.

MSAL accepts only an https authority, so this server speaks TLS with the emulator's own certificate
(:func:`spark_sb.emulator.tls.ensure_certificates`); a client trusts the emulator's CA file
(``connection_verify=<ca.pem>`` on the credential). One server per emulator: like Entra ID, its tokens are good for
every namespace. The form (which holds the secret) and the tokens are never logged.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import ssl
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from . import aad

_LOGGER = logging.getLogger(__name__)

__all__ = ["AuthorityServer"]

_DISCOVERY = re.compile(r"^/([^/]+)/v2\.0/\.well-known/openid-configuration$")
_TOKEN = re.compile(r"^/([^/]+)/oauth2/v2\.0/token$")
_MAX_FORM = 64 * 1024


class AuthorityServer:
    """Serves ``authority``'s OpenID configuration and token endpoint over TLS (``context``, a server
    :class:`ssl.SSLContext`) on ``host:port`` (0: a free port), in its own threads."""

    def __init__(self, host: str, port: int, authority: aad.Authority, context: ssl.SSLContext, *,
                 handshake_timeout: float = 10.0) -> None:
        self.authority = authority
        self._host = host
        self._requested_port = port
        self._context = context
        self._handshake_timeout = handshake_timeout
        self._httpd: _HttpsServer | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"AuthorityServer(host={self._host!r}, port={self.port})"

    @property
    def port(self) -> int:
        if self._httpd is not None:
            return int(self._httpd.server_address[1])
        return self._requested_port

    def start(self) -> AuthorityServer:
        if self._httpd is not None:
            raise RuntimeError("the authority server is already started")
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        server_cls = type("_Https", (_HttpsServer,), {"address_family": family})
        try:
            httpd = server_cls((self._host, self._requested_port), _Handler)
        except OSError as err:
            raise OSError(err.errno, f"the Entra ID authority cannot listen for https on {self._host}:"
                                     f"{self._requested_port}: {err.strerror or err}") from None
        httpd.owner = self
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"spark-sb-authority-{self.port}", daemon=True)
        self._thread.start()
        _LOGGER.info("Entra ID authority on https://%s:%d", self._host, self.port)
        return self

    def stop(self) -> None:
        httpd, thread = self._httpd, self._thread
        if httpd is None:
            return
        if thread is not None and thread.is_alive():
            httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join(timeout=2.0)
        self._httpd = None
        self._thread = None


class _HttpsServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    owner: AuthorityServer

    def finish_request(self, request: Any, client_address: Any) -> None:
        """The TLS handshake happens here, in the request's own thread (a slow client holds up no one)."""
        owner = self.owner
        request.settimeout(owner._handshake_timeout)
        try:
            tls = owner._context.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as err:
            _LOGGER.debug("authority: TLS handshake with %s failed: %s", client_address, err)
            return
        tls.settimeout(60)
        try:
            super().finish_request(tls, client_address)
        finally:
            try:
                tls.close()
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        _LOGGER.debug("authority: connection from %s ended with an error", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "spark-sb-emulator-authority"
    sys_version = ""
    # headers and body are written separately: without TCP_NODELAY the body waits for the client's delayed ACK
    disable_nagle_algorithm = True
    server: _HttpsServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        # the request line has no secret (the secret travels in the form); the form is never logged
        _LOGGER.debug("authority %s: %s", self.client_address[0], format % args)

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        match = _DISCOVERY.match(path)
        if match is None:
            self._send(404, {"error": "not_found", "error_description": f"no such endpoint: GET {path} (this "
                             "authority serves /{tenant}/v2.0/.well-known/openid-configuration and "
                             "POST /{tenant}/oauth2/v2.0/token)"})
            return
        host = self.headers.get("Host") or f"localhost:{self.server.owner.port}"
        self._send(*self.server.owner.authority.openid_configuration(match.group(1), f"https://{host}"))

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_FORM:
            self.close_connection = True
            self._send(413, {"error": "invalid_request", "error_description": "the request body is too large"})
            return
        body = self.rfile.read(length) if length > 0 else b""
        match = _TOKEN.match(path)
        if match is None:
            self._send(404, {"error": "not_found", "error_description": f"no such endpoint: POST {path}"})
            return
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if content_type != "application/x-www-form-urlencoded":
            self._send(400, {"error": "invalid_request", "error_description": "AADSTS900144: the token request "
                             "must be a form (Content-Type: application/x-www-form-urlencoded)"})
            return
        form = urllib.parse.parse_qs(body.decode("utf-8", errors="replace"), keep_blank_values=True)
        headers = {k: v for k, v in self.headers.items()}
        self._send(*self.server.owner.authority.client_credentials_response(match.group(1), form, headers))

    def _send(self, status: int, answer: dict[str, Any]) -> None:
        payload = json.dumps(answer).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(payload)
