"""Pairing codes as people type them, and fingerprints as people compare them."""

from __future__ import annotations

import base64
import hashlib
import math
import re

import pytest

from agentd.fingerprints import BadFingerprint, digest_of, fingerprint, matches, normalize
from agentd.pairing import ALPHABET, CODE_CHARS, code_hash, new_code, normalize_code


def test_codes_carry_at_least_40_bits_in_two_typable_groups() -> None:
    assert CODE_CHARS * math.log2(len(ALPHABET)) >= 40
    codes = {new_code() for _ in range(2000)}
    assert len(codes) == 2000
    assert all(re.fullmatch(r"[0-9A-HJKMNP-TV-Z]{5}-[0-9A-HJKMNP-TV-Z]{5}", c) for c in codes)
    # Every symbol turns up: the codes use the whole alphabet, uniformly enough to see it.
    assert set("".join(codes).replace("-", "")) == set(ALPHABET)


@pytest.mark.parametrize(("typed", "canonical"), [
    ("7K3QX-M9V2D", "7K3QXM9V2D"), ("7k3qx m9v2d", "7K3QXM9V2D"), ("7K3QXM9V2D", "7K3QXM9V2D"),
    ("O0IL1-abcde", "00111ABCDE"), (" 7k3qx_m9v2d ", "7K3QXM9V2D")])
def test_typing_slips_are_forgiven(typed: str, canonical: str) -> None:
    assert normalize_code(typed) == canonical
    assert code_hash(normalize_code(typed) or "") == hashlib.sha256(canonical.encode()).digest()


@pytest.mark.parametrize("typed", ["", "7K3QX", "7K3QX-M9V2D-X", "7K3QX-M9V2U", "ünïcode123"])
def test_what_cannot_be_a_code_is_none(typed: str) -> None:
    assert normalize_code(typed) is None


def test_fingerprints_one_format_out_two_accepted_in() -> None:
    der = b"a certificate"
    digest = hashlib.sha256(der).digest()
    shown = fingerprint(der)
    assert shown == "SHA256:" + base64.b64encode(digest).decode().rstrip("=")
    colon_hex = ":".join(f"{b:02X}" for b in digest)  # as openssl x509 -fingerprint prints it
    for spelling in (shown, shown.removeprefix("SHA256:"), colon_hex, digest.hex(),
                     "sha256:" + digest.hex()):
        assert normalize(spelling) == shown
        assert digest_of(spelling) == digest
    assert matches(der, shown) and not matches(b"another certificate", shown)
    for bad in ("", "SHA256:", "SHA256:abc", "MD5:" + digest.hex(), shown[:-2]):
        with pytest.raises(BadFingerprint):
            normalize(bad)
