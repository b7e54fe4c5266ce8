"""Certificate fingerprints in the one format agentd and agenttui print, take and compare.

`SHA256:` followed by the unpadded base64 of the DER certificate's SHA-256, as OpenSSH shows host
keys (`SHA256:uNiVztksCsDhcc0u9e8BujQXVUpKZIDTMczCvj3tD2s`). The hex form other tools print
(`openssl x509 -fingerprint -sha256`, with or without colons) is accepted as input too.
Standard library only: the client imports this without the daemon's dependencies.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re

PREFIX = "SHA256:"
_HEX = re.compile(r"^[0-9a-fA-F]{64}$")


class BadFingerprint(ValueError):
    pass


def fingerprint(der: bytes) -> str:
    """The fingerprint of a DER-encoded certificate."""
    digest = hashlib.sha256(der).digest()
    return PREFIX + base64.b64encode(digest).decode().rstrip("=")


def digest_of(text: str) -> bytes:
    """The 32 digest bytes a fingerprint names, from either accepted spelling."""
    body = text.strip()
    if body.upper().startswith(PREFIX):
        body = body[len(PREFIX):]
    compact = body.replace(":", "")
    if _HEX.match(compact):
        return bytes.fromhex(compact)
    try:
        raw = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise BadFingerprint(f"{text!r} is not a SHA-256 fingerprint (expected SHA256: "
                             "followed by 43 base64 characters, as `agentd pair` prints)")
    return raw


def normalize(text: str) -> str:
    """The canonical spelling of a fingerprint given in either accepted form."""
    return PREFIX + base64.b64encode(digest_of(text)).decode().rstrip("=")


def matches(der: bytes, pinned: str) -> bool:
    """Whether a certificate is the pinned one (constant-time comparison of the digests)."""
    return hmac.compare_digest(hashlib.sha256(der).digest(), digest_of(pinned))
