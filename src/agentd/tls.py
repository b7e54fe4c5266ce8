"""The daemon's TLS: the certificate it serves and the URL other machines reach it by.

A configured certificate (`tls_cert`/`tls_key`) is served as is. Otherwise agentd keeps a
self-signed ECDSA P-256 certificate in `<data dir>/tls/`: made on first start, then reused, and
made anew only when it is missing, unreadable, expired or no longer matches its key — always said
in the log, because every device that pinned the old one has to re-pin. Devices trust it by its
fingerprint (agentd.fingerprints), not by a CA.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import ipaddress
import logging
import os
import secrets
import socket
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agentd.files import replace_file
from agentd.fingerprints import fingerprint
from agentd.settings import Settings, certificate_name, is_loopback_host

log = logging.getLogger("agentd.tls")

CERT_NAME = "agentd.crt"
KEY_NAME = "agentd.key"
VALIDITY = dt.timedelta(days=3650)  # a renewal breaks every pin: make it rare
_WILDCARDS = ("", "0.0.0.0", "::")


class TLSError(RuntimeError):
    """The certificate cannot be read, made or served; the message says which file and why."""


class NotTheFleetsCertificate(TLSError):
    """A worker restarted by its supervisor found another self-signed certificate than the one
    the rest of the fleet serves (removed or made anew on disk since the start): it does not
    serve, so one port never presents two certificates that devices pin."""

    def __init__(self, found: str, served: str) -> None:
        super().__init__(
            f"the certificate on disk ({found}) is not the one the other workers serve "
            f"({served}): this worker does not serve until agentd is restarted, which "
            "serves the certificate on disk with every worker")


@dataclass(frozen=True, slots=True)
class ServerCertificate:
    cert_path: Path
    key_path: Path
    fingerprint: str
    not_after: dt.datetime
    self_signed: bool


# A configured certificate this close to its end is said at start and by `agentd doctor`: it
# is renewed outside agentd, and a daemon that serves an expired one fails every client's check.
EXPIRY_WARNING = dt.timedelta(days=14)


def expiry_problem(cert: ServerCertificate, now: dt.datetime | None = None) -> str | None:
    """"expired on …" or "expires on … (in N days)" for a certificate past or near its end."""
    now = now or dt.datetime.now(dt.UTC)
    if cert.not_after <= now:
        return f"expired on {cert.not_after:%Y-%m-%d %H:%M} UTC"
    if cert.not_after - now <= EXPIRY_WARNING:
        return (f"expires on {cert.not_after:%Y-%m-%d %H:%M} UTC (in "
                f"{(cert.not_after - now).days} days)")
    return None


def say_expiry(cert: ServerCertificate | None) -> None:
    """Log a configured certificate past or near its end (at start, once per daemon)."""
    ending = expiry_problem(cert) if cert is not None and not cert.self_signed else None
    if cert is not None and ending is not None:
        log.log(logging.ERROR if ending.startswith("expired") else logging.WARNING,
                "renew the configured TLS certificate: clients refuse an expired one",
                extra={"cert": str(cert.cert_path), "ending": ending})


def data_root(settings: Settings) -> Path:
    from agentd.embedded_pg import default_data_root

    return settings.data_dir or default_data_root()


def tls_dir(settings: Settings) -> Path:
    return data_root(settings) / "tls"


def server_certificate(settings: Settings) -> ServerCertificate:
    """The certificate to serve: the configured one, else the self-signed one (made if needed)."""
    if settings.tls_cert is not None and settings.tls_key is not None:
        cert = _load_cert(settings.tls_cert)
        _check_pair(settings.tls_cert, settings.tls_key)
        return _describe(settings.tls_cert, settings.tls_key, cert, self_signed=False)
    directory = tls_dir(settings)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    cert_path, key_path = directory / CERT_NAME, directory / KEY_NAME
    with _locked(directory):  # daemons starting together must not each make their own
        problem = _unusable(cert_path, key_path)
        if problem is None:
            cert = _load_cert(cert_path)
            _say_unnamed(cert, settings, directory)
            return _describe(cert_path, key_path, cert, self_signed=True)
        _generate(cert_path, key_path, certificate_names(settings))
        made = _describe(cert_path, key_path, _load_cert(cert_path), self_signed=True)
    if problem == "missing":
        log.info("made a self-signed TLS certificate", extra={
            "path": str(cert_path), "fingerprint": made.fingerprint})
    else:
        log.warning("made a NEW self-signed TLS certificate: devices that pinned the old one "
                    "must re-pin", extra={"reason": problem, "path": str(cert_path),
                                          "fingerprint": made.fingerprint})
    return made


def _say_unnamed(cert: x509.Certificate, settings: Settings, directory: Path) -> None:
    """Warn when the operator now names agentd by what its self-signed certificate, made
    before, does not name. It is kept, not made anew: every paired device pinned it. A
    client that pins (agenttui) does not mind; one that checks names (curl --cacert) fails."""
    chosen = _chosen_names(settings)
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return
    named = {n.lower() for n in names.get_values_for_type(x509.DNSName)} | \
        {str(a) for a in names.get_values_for_type(x509.IPAddress)}
    missing = sorted({n for n in chosen if n not in named})
    if missing:
        log.warning("the self-signed TLS certificate does not name how agentd is now "
                    "reached: clients that check names refuse it (agenttui pins it, and does "
                    "not mind); remove the tls directory to make one that does, after which "
                    "paired devices must re-pin", extra={"missing": ",".join(missing),
                                                         "tls_dir": str(directory)})


def server_context(cert: ServerCertificate) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert.cert_path, cert.key_path)
    except (OSError, ssl.SSLError) as exc:
        raise TLSError(f"cannot serve {cert.cert_path} with {cert.key_path}: {exc}") from None
    return context


def _chosen_names(settings: Settings) -> list[str]:
    """The names the operator chose agentd to be reached by: the listen address (unless a
    wildcard), public_url's host and tls_names."""
    names = [settings.listen_host] if settings.listen_host not in _WILDCARDS else []
    if settings.public_url:
        names.append(_url_host(settings.public_url))
    # As a certificate spells them (checked by Settings.validate): a host name in ASCII.
    return [certificate_name(n) for n in names + settings.extra_tls_names]


def certificate_names(settings: Settings) -> list[str]:
    """Host names and addresses the self-signed certificate names (its subjectAltName)."""
    names = [socket.gethostname(), socket.getfqdn(), "localhost", "127.0.0.1", "::1",
             *_chosen_names(settings)]
    for name in (socket.gethostname(), socket.getfqdn()):
        try:
            names += [str(info[4][0]) for info in socket.getaddrinfo(name, None,
                                                                   proto=socket.IPPROTO_TCP)]
        except OSError:
            continue
    primary = _primary_address()
    if primary:
        names.append(primary)
    unique: dict[str, None] = {}
    for name in names:
        if name and name.split("%")[0] not in unique:
            unique[name.split("%")[0]] = None
    return list(unique)


def public_url(settings: Settings) -> str:
    """How another machine reaches this daemon: public_url, else derived from `listen`."""
    if settings.public_url:
        return settings.public_url.rstrip("/")
    host = settings.listen_host
    if host in _WILDCARDS:
        # A name others can resolve to this machine, else the address of its default route.
        name = socket.getfqdn() or socket.gethostname()
        host = name if not is_loopback_host(name) else (_primary_address() or name)
    return _url(settings, host)


def local_url(settings: Settings) -> str:
    """How a client on this machine reaches the daemon (a wildcard address via loopback)."""
    host = settings.listen_host
    if host in _WILDCARDS:
        host = "127.0.0.1" if host != "::" else "::1"
    return _url(settings, host)


def _primary_address() -> str | None:
    """The address this machine reaches the network from (a UDP "connect" sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only the routing table is consulted
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(address).is_loopback else address


def _url(settings: Settings, host: str) -> str:
    scheme = "https" if settings.serves_tls else "http"
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{settings.listen_port}"


def _url_host(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).hostname or ""


# -- files -------------------------------------------------------------------------------------


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _unusable(cert_path: Path, key_path: Path) -> str | None:
    """Why the stored certificate cannot be served (None: it can)."""
    if not cert_path.exists() or not key_path.exists():
        return "missing"
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        return f"unreadable ({type(exc).__name__}: {exc})"
    if cert.not_valid_after_utc <= dt.datetime.now(dt.UTC):
        return f"expired on {cert.not_valid_after_utc.isoformat()}"
    public = key.public_key().public_bytes(serialization.Encoding.DER,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    if public != cert.public_key().public_bytes(serialization.Encoding.DER,
                                                serialization.PublicFormat.SubjectPublicKeyInfo):
        return "the certificate does not match its key"
    return None


def _generate(cert_path: Path, key_path: Path, names: list[str]) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([
        x509.NameAttribute(NameOID.COMMON_NAME, (socket.gethostname() or "agentd")[:64]),
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agentd (self-signed)")])
    alt: list[x509.GeneralName] = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            try:
                alt.append(x509.DNSName(certificate_name(name)))
            except ValueError:  # this machine's own name, unusable in a certificate: skipped
                log.warning("a host name left out of the certificate", extra={"name": name})
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(int.from_bytes(secrets.token_bytes(16), "big") >> 1)
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        # An end-entity certificate; OpenSSL also takes it as its own trust anchor, so
        # `curl --cacert agentd.crt` works as well as pinning does.
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=False, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    replace_file(key_path, key_pem)
    replace_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)


def _load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise TLSError(f"cannot read the TLS certificate {path}: {exc}") from None


def _check_pair(cert_path: Path, key_path: Path) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert_path, key_path)
    except (OSError, ssl.SSLError) as exc:
        raise TLSError(f"cannot use the TLS certificate {cert_path} with the key {key_path}: "
                       f"{exc}") from None


def _describe(cert_path: Path, key_path: Path, cert: x509.Certificate, *,
              self_signed: bool) -> ServerCertificate:
    der = cert.public_bytes(serialization.Encoding.DER)
    return ServerCertificate(cert_path, key_path, fingerprint(der), cert.not_valid_after_utc,
                             self_signed)
