"""The one error of the embedded server: what went wrong, and what to do about it."""

from __future__ import annotations


class EmbeddedPgError(RuntimeError):
    """The embedded PostgreSQL server could not be found, initialised, started or stopped."""
