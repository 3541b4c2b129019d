"""AMQPS for the emulator: certificates it makes for itself, and a relay that terminates TLS.

A client built from a namespace and a credential (``ServiceBusClient("localhost", credential)``) always speaks
TLS. The relay accepts it on the namespace's TLS port and hands the plain AMQP bytes to the namespace's own plain
port on loopback, so everything behind it (the Proton transport and whatever inspects its byte stream) sees the
same plaintext for TLS clients as for plain ones. When either side closes, the relay closes the other: an outage
that drops the plain connection drops the TLS client too.

Certificates (``ensure_certificates``): a CA, self-signed and name-constrained to the loopback names, signs one
server certificate whose SANs are ``localhost``, ``127.0.0.1``, ``::1`` and the configured host. The CA's private
key is never written anywhere: it signs and is forgotten, so the CA a user trusts can vouch for nothing else. The
files (``ca.pem``, ``server.pem``, ``server.key``) are reused while they are valid, cover the hosts and match each
other; otherwise all three are made again (an unreadable file is named in a warning).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .relay import Relay, Route

try:
    import fcntl
except ImportError:  # not on Windows: one emulator per data directory there
    fcntl = None  # type: ignore[assignment]

_LOGGER = logging.getLogger(__name__)

CA_FILE = "ca.pem"
CERT_FILE = "server.pem"
KEY_FILE = "server.key"
#: how long a generated certificate is valid, and how long before its end it is made again
VALIDITY = datetime.timedelta(days=365)
RENEW_BEFORE = datetime.timedelta(days=30)
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class CertificateError(ValueError):
    """The emulator's certificate files cannot be written or used."""


@dataclass(frozen=True)
class Certificates:
    """Where the emulator's TLS files are. ``ca_file`` is what clients trust (``connection_verify=``)."""

    directory: Path
    ca_file: Path
    cert_file: Path
    key_file: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as err:
            raise CertificateError(f"cannot load the emulator's certificate {self.cert_file} "
                                   f"with its key {self.key_file}: {err}") from None
        return context


def certificate_hosts(host: str) -> list[str]:
    """The names a server certificate for an emulator listening on ``host`` must cover."""
    names = list(_LOOPBACK_NAMES)
    extra = socket.gethostname() if host in _WILDCARD_HOSTS else host
    if extra and extra not in names:
        names.append(extra)
    return names


def ensure_certificates(
    directory: str | Path, hosts: Iterable[str] = _LOOPBACK_NAMES, *, clock: Callable[[], float] = time.time,
) -> Certificates:
    """The CA and server certificate in ``directory``: the stored ones if they are usable for ``hosts`` at
    ``clock()`` for at least :data:`RENEW_BEFORE` more, else new ones."""
    directory = Path(directory).absolute()
    certs = Certificates(directory, directory / CA_FILE, directory / CERT_FILE, directory / KEY_FILE)
    wanted = list(dict.fromkeys(hosts))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / ".lock", "a") as lock:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)  # two emulators on one data directory make one set
            problem = _problem(certs, wanted, clock())
            if problem is not None:
                _LOGGER.log(logging.WARNING if problem.startswith("cannot") else logging.INFO,
                            "TLS certificates in %s: %s; making new ones", directory, problem)
                _generate(certs, wanted, clock())
    except OSError as err:
        raise CertificateError(f"cannot keep the emulator's TLS certificates in {directory}: {err}") from None
    return certs


def _problem(certs: Certificates, hosts: Sequence[str], now: float) -> str | None:
    """Why the stored files cannot be used (``None``: they can)."""
    for path in (certs.ca_file, certs.cert_file, certs.key_file):
        if not path.exists():
            return f"{path.name} is missing"
    try:
        ca = x509.load_pem_x509_certificate(certs.ca_file.read_bytes())
    except ValueError as err:
        return f"cannot read {certs.ca_file}: {err}"
    try:
        cert = x509.load_pem_x509_certificate(certs.cert_file.read_bytes())
    except ValueError as err:
        return f"cannot read {certs.cert_file}: {err}"
    try:
        key = serialization.load_pem_private_key(certs.key_file.read_bytes(), password=None)
    except (ValueError, TypeError) as err:
        return f"cannot read {certs.key_file}: {err}"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as err:
        return f"{certs.cert_file.name} is not signed by {certs.ca_file.name} ({type(err).__name__})"
    if key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) \
            != cert.public_key().public_bytes(serialization.Encoding.DER,
                                              serialization.PublicFormat.SubjectPublicKeyInfo):
        return f"{certs.key_file.name} is not the key of {certs.cert_file.name}"
    moment = datetime.datetime.fromtimestamp(now, datetime.UTC)
    for c, path in ((ca, certs.ca_file), (cert, certs.cert_file)):
        if c.not_valid_before_utc > moment:
            return f"{path.name} is not valid before {c.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
        if c.not_valid_after_utc - RENEW_BEFORE < moment:
            return f"{path.name} expires {c.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return f"{certs.cert_file.name} names no hosts"
    covered = {str(v) for v in sans.get_values_for_type(x509.DNSName)}
    covered |= {str(v) for v in sans.get_values_for_type(x509.IPAddress)}
    missing = [h for h in hosts if str(_general_name(h).value) not in covered]
    if missing:
        return f"{certs.cert_file.name} does not name {', '.join(missing)}"
    return None


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _generate(certs: Certificates, hosts: Sequence[str], now: float) -> None:
    start = datetime.datetime.fromtimestamp(now, datetime.UTC) - datetime.timedelta(minutes=5)
    end = start + VALIDITY
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "spark-sb emulator"),
                         x509.NameAttribute(NameOID.COMMON_NAME, f"spark-sb emulator local CA {start:%Y-%m-%d %H:%M}")])
    permitted: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_network(h)) if isinstance(_general_name(h), x509.IPAddress) else x509.DNSName(h)
        for h in hosts]
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        # the CA vouches for the emulator's names only, whatever trust store it is added to
        .add_extension(x509.NameConstraints(permitted_subtrees=permitted, excluded_subtrees=None),
                       critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    del ca_key  # never stored: nothing else can ever be signed by this CA
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    _write(certs.key_file, key_pem, 0o600)
    _write(certs.cert_file, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(certs.ca_file, ca.public_bytes(serialization.Encoding.PEM), 0o644)
    _LOGGER.info("TLS: made a CA (%s) and a server certificate for %s, valid until %s UTC", certs.ca_file,
                 ", ".join(hosts), f"{end:%Y-%m-%d}")


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    tmp.replace(path)


# ---------------------------------------------------------------------- the relay
class TlsRelay(Relay):
    """Terminates TLS on each route's port and relays the plain bytes to its upstream (:class:`Relay` with a
    server context)."""

    what = "the AMQPS relay"
    endpoint = "AMQPS (TLS)"

    def __init__(self, routes: Sequence[Route], context: ssl.SSLContext, *, handshake_timeout: float = 10.0,
                 name: str = "sb-emulator-tls") -> None:
        super().__init__(routes, context, handshake_timeout=handshake_timeout, name=name)
