"""The daemon's certificate: made once, reused, made anew only when it must be (and said so),
a configured one served as is; URLs and the server context."""

from __future__ import annotations

import datetime as dt
import logging
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from agentd import tls
from agentd.fingerprints import fingerprint
from agentd.settings import Settings


def settings(tmp_path: Path, **values: object) -> Settings:
    return Settings(data_dir=tmp_path, tls="on", **values).validate()  # type: ignore[arg-type]


def der(path: Path) -> bytes:
    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(
        serialization.Encoding.DER)


def test_first_start_makes_an_ecdsa_certificate_later_starts_reuse_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="agentd.tls"):
        made = tls.server_certificate(settings(
            tmp_path, listen="127.0.0.1:9443",
            tls_names="desk.lan, 10.1.2.3, Bücher.lan, [2001:db8::7]"))
    assert "made a self-signed TLS certificate" in caplog.text
    assert made.self_signed and made.fingerprint == fingerprint(der(made.cert_path))
    assert made.fingerprint.startswith("SHA256:") and len(made.fingerprint) == 7 + 43
    cert = x509.load_pem_x509_certificate(made.cert_path.read_bytes())
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"
    assert cert.not_valid_after_utc - dt.datetime.now(dt.UTC) > dt.timedelta(days=3000)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = sans.get_values_for_type(x509.DNSName)
    addresses = {str(a) for a in sans.get_values_for_type(x509.IPAddress)}
    assert {"desk.lan", "localhost"} <= set(names) and tls.socket.gethostname().lower() in names
    assert "xn--bcher-kva.lan" in names  # a name beyond ASCII as its A-label (it was a crash)
    assert {"127.0.0.1", "::1", "10.1.2.3", "2001:db8::7"} <= addresses
    assert stat.S_IMODE(made.key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(made.cert_path.parent.stat().st_mode) == 0o700

    caplog.clear()
    again = tls.server_certificate(settings(tmp_path))
    assert again.fingerprint == made.fingerprint and not caplog.text


def test_concurrent_first_starts_agree_on_one_certificate(tmp_path: Path) -> None:
    barrier = threading.Barrier(4)
    seen: list[str] = []

    def start() -> None:
        barrier.wait()
        seen.append(tls.server_certificate(settings(tmp_path)).fingerprint)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(seen) == 4 and len(set(seen)) == 1


def _expire(cert_path: Path, key_path: Path) -> None:
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    old = x509.load_pem_x509_certificate(cert_path.read_bytes())
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    expired = (x509.CertificateBuilder().subject_name(old.subject).issuer_name(old.issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(past - dt.timedelta(days=30)).not_valid_after(past)
               .sign(key, hashes.SHA256()))
    cert_path.write_bytes(expired.public_bytes(serialization.Encoding.PEM))


@pytest.mark.parametrize("damage", ["expired", "unreadable key", "another key", "missing key"])
def test_a_certificate_that_cannot_be_served_is_made_anew_and_said_loudly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    made = tls.server_certificate(settings(tmp_path))
    if damage == "expired":
        _expire(made.cert_path, made.key_path)
    elif damage == "unreadable key":
        made.key_path.write_text("-----BEGIN PRIVATE KEY-----\ngarbage\n")
    elif damage == "another key":
        other = ec.generate_private_key(ec.SECP256R1())
        made.key_path.write_bytes(other.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
    else:
        made.key_path.unlink()
    with caplog.at_level(logging.INFO, logger="agentd.tls"):
        renewed = tls.server_certificate(settings(tmp_path))
    assert renewed.fingerprint != made.fingerprint
    record = next(r for r in caplog.records if "certificate" in r.getMessage())
    if damage == "missing key":
        assert record.levelno == logging.INFO
    else:
        assert record.levelno == logging.WARNING and "must re-pin" in record.getMessage()
        assert getattr(record, "reason", "")
    tls.server_context(renewed)  # and it serves


def test_a_configured_certificate_is_served_as_is(tmp_path: Path) -> None:
    own = tls.server_certificate(settings(tmp_path / "elsewhere"))
    configured = tls.server_certificate(settings(tmp_path, tls_cert=own.cert_path,
                                                 tls_key=own.key_path))
    assert not configured.self_signed and configured.fingerprint == own.fingerprint
    assert not (tmp_path / "tls").exists()  # nothing made in the data directory
    with pytest.raises(tls.TLSError, match=r"missing\.pem"):
        tls.server_certificate(settings(tmp_path, tls_cert=tmp_path / "missing.pem",
                                        tls_key=own.key_path))
    other = tls.server_certificate(settings(tmp_path / "third"))
    with pytest.raises(tls.TLSError, match="with the key"):
        tls.server_certificate(settings(tmp_path, tls_cert=own.cert_path,
                                        tls_key=other.key_path))


def test_a_configured_certificate_past_or_near_its_end_is_said_at_start_and_by_doctor(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """agentd does not renew a configured certificate: it serves it as is, and says so loudly
    when it has expired or soon will (before, doctor passed it and the start said nothing)."""
    from agentd.doctor import _tls_check

    own = tls.server_certificate(settings(tmp_path / "elsewhere"))
    configured = settings(tmp_path, tls_cert=own.cert_path, tls_key=own.key_path)
    fresh = tls.server_certificate(configured)
    assert tls.expiry_problem(fresh) is None and _tls_check(configured).ok
    soon = fresh.not_after - dt.timedelta(days=3, hours=1)
    assert tls.expiry_problem(fresh, soon) == (
        f"expires on {fresh.not_after:%Y-%m-%d %H:%M} UTC (in 3 days)")

    _expire(own.cert_path, own.key_path)
    expired = tls.server_certificate(configured)  # still served: it is the operator's to renew
    with caplog.at_level(logging.INFO, logger="agentd.tls"):
        tls.say_expiry(expired)
    [record] = [r for r in caplog.records if "renew" in r.getMessage()]
    assert record.levelno == logging.ERROR
    assert getattr(record, "ending", "").startswith("expired on ")
    check = _tls_check(configured)
    assert not check.ok and "expired on" in check.detail and str(own.cert_path) in check.detail
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agentd.tls"):
        tls.say_expiry(tls.server_certificate(settings(tmp_path / "own")))  # self-signed
    assert not [r for r in caplog.records if "renew" in r.getMessage()]


def test_a_name_configured_after_the_certificate_was_made_is_said_not_made_anew(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The self-signed certificate keeps the names it was made with (every paired device
    pinned it): a name chosen later is said at start, so that curl --cacert failing on it is
    explained. Before, nothing said so."""
    made = tls.server_certificate(settings(tmp_path))
    with caplog.at_level(logging.INFO, logger="agentd.tls"):
        again = tls.server_certificate(settings(tmp_path, tls_names="agentd.example.test",
                                                public_url="https://10.9.8.7:8740"))
    assert again.fingerprint == made.fingerprint  # kept
    [record] = [r for r in caplog.records if "does not name" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert getattr(record, "missing", "") == "10.9.8.7,agentd.example.test"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agentd.tls"):  # what it names: nothing said
        tls.server_certificate(settings(tmp_path, tls_names="LOCALHOST,127.0.0.1"))
    assert not [r for r in caplog.records if "does not name" in r.getMessage()]


def test_server_context_refuses_old_protocols(tmp_path: Path) -> None:
    context = tls.server_context(tls.server_certificate(settings(tmp_path)))
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2


def test_urls_for_this_machine_and_for_others(tmp_path: Path) -> None:
    local = Settings(data_dir=tmp_path)
    assert tls.local_url(local) == tls.public_url(local) == "http://127.0.0.1:8740"
    wildcard = Settings(data_dir=tmp_path, listen="0.0.0.0:9000")
    assert tls.local_url(wildcard) == "https://127.0.0.1:9000"
    assert tls.public_url(wildcard).startswith("https://") and "0.0.0.0" not in \
        tls.public_url(wildcard)
    v6 = Settings(data_dir=tmp_path, listen="[::]:9000")
    assert tls.local_url(v6) == "https://[::1]:9000"
    named = Settings(data_dir=tmp_path, listen="0.0.0.0:9000",
                     public_url="https://agent.example.org/")
    assert tls.public_url(named) == "https://agent.example.org"
