"""Microsoft Entra ID (AAD) for the emulator: the tokens it issues, and how a namespace checks them.

The real service takes an Entra ID access token on ``$cbs`` (put-token of type ``jwt``, audience
``https://servicebus.azure.net``) and grants what the principal's Azure RBAC role assignments on the namespace
allow. The emulator has no Entra ID and no role assignments, so it plays both sides:

* **Issuing.** Every namespace's admin HTTP port serves a managed-identity token endpoint in the App Service
  protocol at :data:`TOKEN_PATH` (``GET /msi/token?api-version=2019-08-01&resource=...[&client_id=...]`` with
  header ``X-IDENTITY-HEADER``; answer ``{"access_token", "expires_on", "resource", "token_type",
  "client_id"}``), which is what azure-identity's ``ManagedIdentityCredential`` (and so
  ``DefaultAzureCredential``) calls when ``IDENTITY_ENDPOINT`` and ``IDENTITY_HEADER`` are set. Which
  identities exist, their roles and their tokens' lifetime are :class:`AadOptions` of the emulator.
* **Service principals.** The emulator's authority (https, :mod:`spark_sb.emulator.authority_http`) serves what
  MSAL asks Entra ID for in the client-credentials grant, which is how azure-identity's
  ``ClientSecretCredential(tenant_id, client_id, client_secret, authority="https://localhost:<port>",
  disable_instance_discovery=True, connection_verify=<the emulator's CA>)`` gets its tokens: the tenant's
  OpenID configuration (:meth:`Authority.openid_configuration`) and the token endpoint
  (:meth:`Authority.client_credentials_response`). The app registrations (:class:`App`: tenant, client id,
  secret, roles) are :class:`AadOptions` too; by default one well-known development app
  (:data:`DEFAULT_CLIENT_ID` / :data:`DEFAULT_CLIENT_SECRET` in :data:`TENANT_ID`, Data Owner). A wrong secret
  or an unknown app is answered as Entra ID answers it (``invalid_client`` AADSTS7000215,
  ``unauthorized_client`` AADSTS700016), naming the app, never the secret.
* **Roles travel in the token.** A token carries the principal's roles in a ``roles`` claim (a list of role
  names: :data:`OWNER_ROLE`, :data:`SENDER_ROLE`, :data:`RECEIVER_ROLE`). This is the emulator's convention
  (a real Service Bus token carries no roles; the service looks the principal up), so that a namespace can
  check a token by itself.
* **Checking.** A namespace verifies the signature (HS256 with the emulator's signing key), the audience
  (``https://servicebus.azure.net`` with or without a trailing ``/``, the form the SDK's scope
  ``https://servicebus.azure.net//.default`` maps to), the expiry and ``not before`` against the emulator's
  clock, and turns the roles into rights (:data:`RIGHTS_OF_ROLE`): Sender -> ``Send``; Receiver -> ``Listen``
  (receive, peek, settle, renew locks, receive deferred); Owner -> ``Send``, ``Listen`` and ``Manage`` (the
  administration API). A link or request that needs a right its token does not give is refused with
  ``amqp:unauthorized-access`` naming the right, the missing role and the principal; a token past its expiry
  stops working (:class:`Grant`) until the client puts a fresh one.

Every emulator uses the same well-known development signing key unless told otherwise
(:data:`DEFAULT_SIGNING_KEY`, like the well-known SAS key): as in Entra ID, a token is good for every
namespace, here of every emulator. Tokens, client secrets and the identity header are secrets: they are never
logged or put in an error message.
"""

from __future__ import annotations

import base64
import hmac
import logging
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import jwt

_LOGGER = logging.getLogger(__name__)

__all__ = [
    "ALGORITHM", "API_VERSION", "AUDIENCE", "AadError", "AadOptions", "App", "Authority", "DEFAULT_CLIENT_ID",
    "DEFAULT_CLIENT_SECRET", "DEFAULT_IDENTITY_HEADER", "DEFAULT_SIGNING_KEY", "Grant", "Identity", "LISTEN", "MANAGE", "OWNER_ROLE", "RECEIVER_ROLE", "RIGHTS_OF_ROLE",
    "ROLES", "SAS_GRANT", "SEND", "SENDER_ROLE", "TENANT_ID", "TOKEN_PATH", "issuers", "looks_like_jwt", "normalise_audience",
]

OWNER_ROLE = "Azure Service Bus Data Owner"
SENDER_ROLE = "Azure Service Bus Data Sender"
RECEIVER_ROLE = "Azure Service Bus Data Receiver"
ROLES = (OWNER_ROLE, SENDER_ROLE, RECEIVER_ROLE)

SEND, LISTEN, MANAGE = "Send", "Listen", "Manage"
ALL_RIGHTS = frozenset({SEND, LISTEN, MANAGE})
RIGHTS_OF_ROLE: Mapping[str, frozenset[str]] = {
    OWNER_ROLE: ALL_RIGHTS,
    SENDER_ROLE: frozenset({SEND}),
    RECEIVER_ROLE: frozenset({LISTEN}),
}
#: what each right lets a client do, for refusals
_ACTIONS = {SEND: "sending (send, schedule, cancel scheduled)",
            LISTEN: "receiving (receive, peek, settle, renew locks, receive deferred)",
            MANAGE: "managing entities (the administration API)"}

AUDIENCE = "https://servicebus.azure.net"
TENANT_ID = "5b3e2c1a-0000-4000-8000-00000000e11d"  # the emulator's own tenant
ISSUER = f"https://sts.windows.net/{TENANT_ID}/"  # see issuers()
ALGORITHM = "HS256"
#: the managed-identity token endpoint on every namespace's admin port (``IDENTITY_ENDPOINT``)
TOKEN_PATH = "/msi/token"
#: the App Service protocol version azure-identity and msal send
API_VERSION = "2019-08-01"
#: the well-known development value of ``IDENTITY_HEADER`` (like the well-known SAS key ``SAS_KEY_VALUE``)
DEFAULT_IDENTITY_HEADER = "spark-sb-emulator-identity-header"
#: the well-known development signing key shared by every emulator (at least 32 bytes for HS256)
DEFAULT_SIGNING_KEY = "spark-sb emulator: well-known Microsoft Entra ID signing key, for development only"
#: the well-known development app registration (like the well-known SAS key): its client id and secret
DEFAULT_CLIENT_ID = "spark-sb-emulator-app"
DEFAULT_CLIENT_SECRET = "spark-sb-emulator-client-secret"
_NBF_LEEWAY = 300.0  # clock skew tolerated on "not before", as Entra ID's own validators do (5 min)
_TENANT = re.compile(r"[A-Za-z0-9.\-]+")  # what azure-identity accepts as a tenant id


class AadError(Exception):
    """A token is malformed, not signed by the emulator's key, for another audience, or expired. The message
    never contains the token."""


def looks_like_jwt(token: str) -> bool:
    """Three base64url segments separated by dots (a SAS token starts with ``SharedAccessSignature``)."""
    parts = token.strip().split(".")
    return len(parts) == 3 and all(parts[:2]) and not token.startswith("SharedAccessSignature")


def normalise_audience(value: str) -> str:
    """``https://servicebus.azure.net//.default`` / ``https://servicebus.azure.net/`` ->
    ``https://servicebus.azure.net`` (the scope and resource forms azure-identity and the SDK use)."""
    text = value.strip().lower()
    text = text.removesuffix("/.default")
    return text.rstrip("/")


@dataclass(frozen=True)
class Identity:
    """A managed identity the token endpoint issues tokens for: ``client_id`` None is the system-assigned
    identity (a request without ``client_id``); ``roles`` go into its tokens; ``lifetime`` (seconds) overrides
    :attr:`AadOptions.token_lifetime` for its tokens."""

    client_id: str | None = None
    roles: tuple[str, ...] = (OWNER_ROLE,)
    lifetime: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "roles", tuple(self.roles))
        for role in self.roles:
            if role not in ROLES:
                raise ValueError(f"Identity.roles: unknown role {role!r} (roles: {', '.join(ROLES)})")
        if self.lifetime is not None and not self.lifetime > 0:
            raise ValueError(f"Identity.lifetime: must be a positive number of seconds, got {self.lifetime!r}")
        if self.client_id is not None and not str(self.client_id).strip():
            raise ValueError("Identity.client_id: must be a non-empty string or None (system-assigned)")

    @property
    def object_id(self) -> str:
        """A stable principal id (``oid``) for the identity."""
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"spark-sb-emulator/identity/{self.client_id or 'system'}"))

    @property
    def name(self) -> str:
        return f"managed identity {self.client_id!r}" if self.client_id else "the system-assigned managed identity"


@dataclass(frozen=True)
class App:
    """An app registration (a service principal) the authority issues client-credentials tokens for: its
    ``tenant_id`` (default: the emulator's :data:`TENANT_ID`), ``client_id``, ``secret`` (never in the repr),
    the ``roles`` that go into its tokens and ``lifetime`` (seconds; default :attr:`AadOptions.token_lifetime`)."""

    client_id: str = DEFAULT_CLIENT_ID
    secret: str = field(default=DEFAULT_CLIENT_SECRET, repr=False)
    roles: tuple[str, ...] = (OWNER_ROLE,)
    tenant_id: str = TENANT_ID
    lifetime: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "roles", tuple(self.roles))
        for role in self.roles:
            if role not in ROLES:
                raise ValueError(f"App.roles: unknown role {role!r} (roles: {', '.join(ROLES)})")
        for name in ("client_id", "secret", "tenant_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"App.{name}: must be a non-empty string")
        if not _TENANT.fullmatch(self.tenant_id):
            raise ValueError(f"App.tenant_id: letters, digits, '-' and '.' only, got {self.tenant_id!r}")
        if self.lifetime is not None and not self.lifetime > 0:
            raise ValueError(f"App.lifetime: must be a positive number of seconds, got {self.lifetime!r}")

    @property
    def object_id(self) -> str:
        """A stable principal id (``oid``) for the app's service principal."""
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"spark-sb-emulator/app/{self.tenant_id}/{self.client_id}"))

    @property
    def name(self) -> str:
        return f"app {self.client_id!r}"


@dataclass(frozen=True)
class AadOptions:
    """Microsoft Entra ID as one emulator plays it (shared by its namespaces).

    ``identities``: who the token endpoint issues tokens for (default: the system-assigned identity as Data
    Owner). ``apps``: the app registrations the authority (https) issues client-credentials tokens for (default:
    the well-known development app, :data:`DEFAULT_CLIENT_ID` with :data:`DEFAULT_CLIENT_SECRET`, Data Owner).
    ``token_lifetime``: seconds a token lives (an identity's own ``lifetime`` wins). ``identity_header``:
    the secret ``IDENTITY_HEADER`` value the endpoint requires. ``signing_key``: the HS256 key (at least 32
    characters). The secrets are not in the repr.
    """

    identities: tuple[Identity, ...] = (Identity(),)
    apps: tuple[App, ...] = (App(),)
    token_lifetime: float = 3600.0
    identity_header: str = field(default=DEFAULT_IDENTITY_HEADER, repr=False)
    signing_key: str = field(default=DEFAULT_SIGNING_KEY, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "identities", tuple(self.identities))
        ids = [i.client_id for i in self.identities]
        if len(set(ids)) != len(ids):
            raise ValueError(f"AadOptions.identities: client ids must be distinct, got {ids}")
        object.__setattr__(self, "apps", tuple(self.apps))
        apps = [(a.tenant_id, a.client_id) for a in self.apps]
        if len(set(apps)) != len(apps):
            raise ValueError(f"AadOptions.apps: (tenant_id, client_id) must be distinct, got {apps}")
        if not self.token_lifetime > 0:
            raise ValueError(f"AadOptions.token_lifetime: must be a positive number of seconds, got "
                             f"{self.token_lifetime!r}")
        if not self.identity_header:
            raise ValueError("AadOptions.identity_header: must be a non-empty string")
        if len(self.signing_key.encode()) < 32:
            raise ValueError("AadOptions.signing_key: must be at least 32 bytes long for HS256")


@dataclass(frozen=True)
class Grant:
    """What a token put on ``$cbs`` allows on a connection: ``rights`` until ``expires`` (epoch seconds; None
    never). A SAS token's grant expires at its ``se``, an Entra ID token's at its ``exp``: a client renews it
    with a new put-token. ``principal`` and ``roles`` name it in refusals (``roles`` None for SAS)."""

    rights: frozenset[str]
    expires: float | None
    principal: str
    roles: tuple[str, ...] | None = None

    def expired(self, now: float) -> bool:
        return self.expires is not None and now >= self.expires

    def refusal(self, right: str, resource: str, now: float) -> str | None:
        """None when this grant allows ``right`` now; else the service-like reason it does not."""
        if self.expired(now):
            when = datetime.fromtimestamp(self.expires or 0, UTC).isoformat(timespec="seconds")
            return (f"Unauthorized access to '{resource}': ExpiredToken: the token of {self.principal} expired at "
                    f"{when}; put a new token on $cbs.")
        if right in self.rights:
            return None
        needed = [role for role in ROLES if right in RIGHTS_OF_ROLE[role]]
        missing = " or ".join(reversed(needed))
        has = ", ".join(self.roles or ()) or "no role"
        return (f"Unauthorized access. '{right}' claim(s) are required to perform this operation on '{resource}': "
                f"{_ACTIONS[right]} needs the role {missing}; the token of {self.principal} has {has}.")


#: a verified SAS token (the emulator's keys all give every right)
SAS_GRANT = Grant(ALL_RIGHTS, None, "the shared access key")


def _rights(roles: Iterable[str]) -> frozenset[str]:
    rights: set[str] = set()
    for role in roles:
        rights |= RIGHTS_OF_ROLE.get(role, frozenset())
    return frozenset(rights)


class Authority:
    """Issues and verifies the emulator's Entra ID tokens (one per emulator, shared by its namespaces and their
    admin ports). ``clock`` gives epoch seconds (the emulator's, injectable). Thread-safe."""

    def __init__(self, options: AadOptions | None = None, clock: Callable[[], float] = time.time) -> None:
        self.options = options or AadOptions()
        self.clock = clock
        self._lock = threading.Lock()
        self._identities = {i.client_id: i for i in self.options.identities}
        self._apps = {(a.tenant_id.lower(), a.client_id): a for a in self.options.apps}
        self.issued = 0  # tokens issued (tests watch renewals with it)
        self._issued_for: dict[str | None, int] = {}

    def __repr__(self) -> str:
        return (f"Authority(identities={sorted(str(k) for k in self._identities)}, "
                f"apps={sorted(client for _, client in self._apps)})")

    # --- identities ------------------------------------------------------------------------------------

    def assign(self, identity: Identity) -> None:
        """Add or replace an identity (its roles, its tokens' lifetime) while the emulator runs."""
        with self._lock:
            self._identities[identity.client_id] = identity

    def identity(self, client_id: str | None) -> Identity | None:
        with self._lock:
            return self._identities.get(client_id)

    def register(self, app: App) -> None:
        """Add or replace an app registration (its secret, roles, tokens' lifetime) while the emulator runs."""
        with self._lock:
            self._apps[(app.tenant_id.lower(), app.client_id)] = app

    def app(self, tenant_id: str, client_id: str) -> App | None:
        with self._lock:
            return self._apps.get((tenant_id.lower(), client_id))

    def tenants(self) -> set[str]:
        """The tenants the authority knows: the emulator's own and those of its app registrations (lower case)."""
        with self._lock:
            return {TENANT_ID.lower(), *(tenant for tenant, _ in self._apps)}

    # --- issuing ---------------------------------------------------------------------------------------

    def issue(self, client_id: str | None = None, *, resource: str = AUDIENCE, roles: Iterable[str] | None = None,
              lifetime: float | None = None, now: float | None = None) -> tuple[str, int]:
        """A signed token and its expiry (epoch seconds) for the identity ``client_id``; ``roles`` and
        ``lifetime`` override the identity's (an unknown ``client_id`` is allowed when ``roles`` are given)."""
        identity = self.identity(client_id)
        if identity is None:
            if roles is None:
                raise AadError(f"no managed identity with client_id {client_id!r} is configured")
            identity = Identity(client_id, tuple(roles), lifetime)
        granted = tuple(roles) if roles is not None else identity.roles
        Identity(client_id, granted)  # validates the role names
        life = lifetime or identity.lifetime or self.options.token_lifetime
        return self._sign(client_id, client_id or identity.object_id, identity.object_id, granted, life, resource,
                          TENANT_ID, now)

    def _sign(self, counted: str | None, appid: str, object_id: str, roles: Iterable[str], life: float,
              resource: str, tenant: str, now: float | None) -> tuple[str, int]:
        issued_at = self.clock() if now is None else now
        expires = int(issued_at + life)
        claims = {
            "aud": resource, "iss": f"https://sts.windows.net/{tenant}/", "iat": int(issued_at),
            "nbf": int(issued_at), "exp": expires, "tid": tenant, "oid": object_id, "sub": object_id,
            "appid": appid, "idtyp": "app", "ver": "1.0", "roles": list(roles),
        }
        token = jwt.encode(claims, self.options.signing_key, algorithm=ALGORITHM)
        with self._lock:
            self.issued += 1
            self._issued_for[counted] = self._issued_for.get(counted, 0) + 1
        return token, expires

    def issued_for(self, client_id: str | None) -> int:
        """How many tokens were issued for the identity or app ``client_id`` (None: system-assigned)."""
        with self._lock:
            return self._issued_for.get(client_id, 0)

    def token_response(self, query: Mapping[str, list[str]], headers: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
        """Answer a token request of the App Service managed-identity protocol: (HTTP status, JSON body).
        Errors are ``{"statusCode": ..., "message": ...}`` as App Service writes them."""

        def error(status: int, message: str) -> tuple[int, dict[str, Any]]:
            return status, {"statusCode": status, "message": message}

        def one(name: str) -> str | None:
            values = query.get(name) or []
            return values[0] if values else None

        lowered = {str(k).lower(): v for k, v in headers.items()}  # HTTP header names are case-insensitive
        given = lowered.get("x-identity-header")
        if not given:
            return error(401, "the request has no X-IDENTITY-HEADER header (set IDENTITY_HEADER)")
        if not hmac.compare_digest(given.encode(), self.options.identity_header.encode()):
            return error(401, "X-IDENTITY-HEADER does not match this emulator's identity header")
        version = one("api-version")
        if version != API_VERSION:
            return error(400, f"api-version must be {API_VERSION}, got {version!r}")
        resource = one("resource")
        if not resource or not resource.strip():
            return error(400, "the query parameter 'resource' is required (e.g. https://servicebus.azure.net)")
        for unsupported in ("mi_res_id", "object_id", "principal_id"):
            if one(unsupported):
                return error(400, f"'{unsupported}' is not supported by the emulator: select an identity with "
                                  "client_id")
        client_id = one("client_id")
        identity = self.identity(client_id)
        if identity is None:
            with self._lock:
                known = sorted(str(k) if k else "(system-assigned)" for k in self._identities)
            return error(400, f"no managed identity with client_id {client_id!r} is assigned to this emulator "
                              f"(assigned: {', '.join(known) or 'none'})")
        token, expires = self.issue(client_id, resource=resource)
        _LOGGER.debug("issued a token for %s (roles %s), expiring at %d", identity.name,
                      ", ".join(identity.roles) or "none", expires)
        return 200, {"access_token": token, "expires_on": str(expires), "resource": resource,
                     "token_type": "Bearer", "client_id": client_id or identity.object_id}

    # --- the OAuth 2.0 authority (client-credentials grant) ---------------------------------------------

    def openid_configuration(self, tenant: str, base_url: str) -> tuple[int, dict[str, Any]]:
        """The tenant's OpenID configuration as Entra ID's v2.0 endpoint serves it (what MSAL reads for the
        token endpoint): (HTTP status, JSON body). ``base_url`` is the authority (``https://localhost:5443``)."""
        if tenant.lower() not in self.tenants():
            return _oauth_error(400, "invalid_tenant", 90002,
                                f"Tenant '{tenant}' not found. Check to make sure you have the correct tenant ID "
                                "and are signing into the correct cloud (this emulator knows "
                                f"{', '.join(sorted(self.tenants()))}).")
        root = f"{base_url.rstrip('/')}/{tenant}"
        return 200, {
            "token_endpoint": f"{root}/oauth2/v2.0/token",
            "token_endpoint_auth_methods_supported": ["client_secret_post", "client_secret_basic"],
            "authorization_endpoint": f"{root}/oauth2/v2.0/authorize",
            "issuer": f"{root}/v2.0",
            "grant_types_supported": ["client_credentials"],
            "response_types_supported": ["token"],
            "scopes_supported": [f"{AUDIENCE}/.default"],
            "subject_types_supported": ["pairwise"],
            "id_token_signing_alg_values_supported": [ALGORITHM],
            "request_uri_parameter_supported": False,
            "tenant_region_scope": None,
            "cloud_instance_name": "spark-sb emulator",
        }

    def client_credentials_response(self, tenant: str, form: Mapping[str, list[str]],
                                    headers: Mapping[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        """Answer ``POST /{tenant}/oauth2/v2.0/token`` of the client-credentials grant (the client authenticated
        by ``client_id`` + ``client_secret`` in the form, or HTTP Basic): (HTTP status, JSON body), errors as
        Entra ID writes them (``error``, ``error_description`` with its AADSTS code, ``error_codes``). Neither the
        secret nor the token is logged or put in an error."""

        def one(name: str) -> str | None:
            values = form.get(name) or []
            return values[0] if values else None

        grant = one("grant_type")
        if grant != "client_credentials":
            return _oauth_error(400, "unsupported_grant_type", 70003,
                                f"The app requested an unsupported grant type '{grant}': this emulator's "
                                "authority supports client_credentials only.")
        client_id, secret = one("client_id"), one("client_secret")
        basic = _basic_credentials(headers or {})
        if basic is not None:
            client_id, secret = client_id or basic[0], secret or basic[1]
        if not client_id:
            return _oauth_error(400, "invalid_request", 900144,
                                "The request body must contain the following parameter: 'client_id'.")
        if tenant.lower() not in self.tenants():
            return _oauth_error(400, "invalid_tenant", 90002,
                                f"Tenant '{tenant}' not found. Check to make sure you have the correct tenant ID "
                                "and are signing into the correct cloud.")
        app = self.app(tenant, client_id)
        if app is None:
            _LOGGER.info("authority: token request for the unknown app %r in tenant %s refused", client_id, tenant)
            return _oauth_error(400, "unauthorized_client", 700016,
                                f"Application with identifier '{client_id}' was not found in the directory "
                                f"'{tenant}'. This can happen if the application has not been installed by the "
                                "administrator of the tenant (here: not in the emulator's AadOptions.apps).")
        if not secret:
            return _oauth_error(401, "invalid_client", 7000218,
                                "The request body must contain the following parameter: 'client_assertion' or "
                                f"'client_secret' (app '{client_id}').")
        if not hmac.compare_digest(secret.encode(), app.secret.encode()):
            _LOGGER.info("authority: token request for %s refused: invalid client secret", app.name)
            return _oauth_error(401, "invalid_client", 7000215,
                                "Invalid client secret provided. Ensure the secret being sent in the request is the "
                                "client secret value, not the client secret ID, for a secret added to app "
                                f"'{client_id}'.")
        scopes = [s for s in (one("scope") or "").split() if s not in ("openid", "profile", "offline_access")]
        if len(scopes) != 1 or not scopes[0].endswith("/.default"):
            return _oauth_error(400, "invalid_scope", 1002012,
                                f"The provided value for scope {' '.join(scopes) or '(none)'} is not valid. Client "
                                "credential flows must have a scope value with /.default suffixed to the resource "
                                "identifier (application ID URI).")
        resource = normalise_audience(scopes[0])
        if resource != AUDIENCE:
            return _oauth_error(400, "invalid_resource", 500011,
                                f"The resource principal named {scopes[0].removesuffix('/.default')} was not found "
                                f"in the tenant '{tenant}': this emulator issues tokens for {AUDIENCE} only.")
        life = app.lifetime or self.options.token_lifetime
        token, expires = self._sign(app.client_id, app.client_id, app.object_id, app.roles, life, AUDIENCE,
                                    app.tenant_id, None)
        _LOGGER.debug("authority: issued a token for %s (roles %s), expiring at %d", app.name,
                      ", ".join(app.roles) or "none", expires)
        return 200, {"token_type": "Bearer", "expires_in": int(life), "ext_expires_in": int(life),
                     "access_token": token}

    # --- verifying -------------------------------------------------------------------------------------

    def verify(self, token: str, now: float | None = None) -> Grant:
        """Check ``token`` as Service Bus does: its signature, audience, tenant and issuer (``tid`` the emulator's
        :data:`TENANT_ID`, ``iss`` that tenant's v1 or v2 issuer, :func:`issuers`), expiry and not-before (whole
        seconds, against the emulator's clock); the :class:`Grant` its roles give. Raises :class:`AadError` with
        a reason that never contains the token."""
        if not isinstance(token, str) or not looks_like_jwt(token):
            raise AadError("not a JSON Web Token")
        try:
            # the times are checked below against the emulator's (injectable) clock, not PyJWT's
            claims = jwt.decode(
                token, self.options.signing_key, algorithms=[ALGORITHM],
                options={"verify_exp": False, "verify_nbf": False, "verify_iat": False, "verify_aud": False,
                         "verify_iss": False, "require": ["exp", "aud", "iss", "tid"]},
            )
        except jwt.InvalidSignatureError:
            raise AadError("InvalidSignature: the token is not signed by this emulator's key") from None
        except jwt.InvalidAlgorithmError:
            raise AadError(f"InvalidSignature: the token must be signed with {ALGORITHM}") from None
        except jwt.MissingRequiredClaimError as err:
            raise AadError(f"InvalidToken: the token has no '{err.claim}' claim") from None
        except jwt.PyJWTError as err:
            raise AadError(f"MalformedToken: {type(err).__name__}") from None
        audiences = claims["aud"] if isinstance(claims["aud"], list) else [claims["aud"]]
        if not any(isinstance(a, str) and normalise_audience(a) == AUDIENCE for a in audiences):
            shown = ", ".join(str(a) for a in audiences)
            raise AadError(f"InvalidAudience: the token is for {shown}, not {AUDIENCE}")
        tenant, issuer = claims["tid"], claims["iss"]
        if not isinstance(tenant, str) or tenant.lower() != TENANT_ID.lower():
            raise AadError(f"InvalidTenant: the token's tenant tid={tenant!r} is not this namespace's tenant "
                           f"{TENANT_ID}")
        if issuer not in issuers(tenant):
            raise AadError(f"InvalidIssuer: the token's issuer iss={issuer!r} is not the tenant's issuer "
                           f"({' or '.join(issuers(tenant))})")
        expires, not_before, _ = (_seconds(claims, name) for name in ("exp", "nbf", "iat"))
        if expires is None:
            raise AadError("InvalidToken: the token has no 'exp' claim")
        current = self.clock() if now is None else now
        if current >= expires:
            try:
                when = datetime.fromtimestamp(expires, UTC).isoformat(timespec="seconds")
            except (OverflowError, OSError, ValueError):
                when = f"{expires} (seconds since the epoch)"
            raise AadError(f"ExpiredToken: the token expired at {when}")
        if not_before is not None and not_before > current + _NBF_LEEWAY:
            raise AadError("InvalidToken: the token is not valid yet (nbf)")
        roles = claims.get("roles") or []
        if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
            raise AadError("InvalidToken: 'roles' must be a list of role names")
        appid = claims.get("appid") or claims.get("oid") or "an unknown principal"
        principal = f"principal {appid}"
        return Grant(_rights(roles), float(expires), principal, tuple(roles))


def issuers(tenant: str) -> tuple[str, str]:
    """The issuers Entra ID writes into a token of ``tenant``: v1.0 (``sts.windows.net``) and v2.0."""
    return f"https://sts.windows.net/{tenant}/", f"https://login.microsoftonline.com/{tenant}/v2.0"


def _seconds(claims: Mapping[str, Any], name: str) -> int | None:
    """A NumericDate claim (``exp``, ``nbf``, ``iat``): whole seconds since the epoch, as Entra ID writes them (a
    JSON integer, not a string, a fraction or ``inf``); None when the token has none."""
    value = claims.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise AadError(f"InvalidToken: '{name}' must be a whole number of seconds since the epoch, got {value!r}")
    return value


def _oauth_error(status: int, error: str, code: int, text: str) -> tuple[int, dict[str, Any]]:
    """An OAuth 2.0 error as Entra ID writes it; azure-identity shows ``error_description``."""
    trace = str(uuid.uuid4())
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return status, {"error": error,
                    "error_description": f"AADSTS{code}: {text} Trace ID: {trace} Timestamp: {stamp}",
                    "error_codes": [code], "timestamp": stamp, "trace_id": trace, "correlation_id": trace}


def _basic_credentials(headers: Mapping[str, str]) -> tuple[str, str] | None:
    """``client_secret_basic``: (client id, secret) from ``Authorization: Basic ...``, or None."""
    value = next((v for k, v in headers.items() if str(k).lower() == "authorization"), "")
    if not value.lower().startswith("basic "):
        return None
    try:
        decoded = base64.b64decode(value[6:].strip(), validate=True).decode()
    except ValueError:
        return None
    client_id, sep, secret = decoded.partition(":")
    if not sep:
        return None
    return urllib.parse.unquote_plus(client_id), urllib.parse.unquote_plus(secret)
