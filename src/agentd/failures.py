"""What a failed run tells its clients: a stable code and a short message without internals.

A run's `error` is shown to every device of the account, so it never carries a base URL, a key
variable's name, a provider's response body or an exception's text; those go to the daemon's log
only, keyed by run id (`log_failure`). Clients branch on `error_code` (vocabulary.RunErrorCode).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from agentd.providers.base import ProviderError
from agentd.vocabulary import RunErrorCode

log = logging.getLogger("agentd.failures")

CLIENT_MESSAGES: dict[RunErrorCode, str] = {
    RunErrorCode.DEADLINE_EXCEEDED: "the turn ran past its time limit",
    RunErrorCode.PROVIDER_ERROR: "the model provider failed",
    RunErrorCode.PROVIDER_TIMEOUT: "the model provider took too long to answer",
    RunErrorCode.PROVIDER_UNAVAILABLE: "the model provider could not be reached or is failing",
    RunErrorCode.PROVIDER_AUTH: "the model provider refused this daemon's credentials",
    RunErrorCode.PROVIDER_RATE_LIMITED: "the model provider is rate limiting requests; "
                                        "retry later",
    RunErrorCode.PROVIDER_REJECTED: "the model provider rejected the request",
    RunErrorCode.MODEL_UNAVAILABLE: "the model is not available on this daemon",
    RunErrorCode.TOOL_STEPS_EXCEEDED: "the model asked for more tool steps than a turn allows",
    # Written by the reaper's and the stop's SQL as well (sql/queries.sql); a test keeps them
    # equal.
    RunErrorCode.LEASE_EXPIRED: "the worker running this turn stopped renewing its lease",
    RunErrorCode.SHUTDOWN: "the daemon stopped before the turn finished",
    RunErrorCode.INTERNAL_ERROR: "an internal error ended the turn",
    RunErrorCode.STOPPED_BEFORE_START: "stopped before it started",
}


@dataclass(frozen=True, slots=True)
class RunFailure:
    """How a run ended without its answer, as clients see it."""

    code: RunErrorCode
    message: str


def failure(code: RunErrorCode) -> RunFailure:
    return RunFailure(code, CLIENT_MESSAGES[code])


def classify(error: BaseException) -> RunFailure:
    """The client-facing failure for an exception that ended a turn."""
    if isinstance(error, ProviderError):
        return failure(RunErrorCode(error.code))
    return failure(RunErrorCode.INTERNAL_ERROR)


def log_failure(run_id: Any, ended: RunFailure, error: BaseException | None,
                **context: Any) -> None:
    """The whole story for the operator: code, the exception's own text, the traceback of a
    bug. Keyed by run id, as every client-facing error points here."""
    extra = {"run_id": str(run_id), "error_code": str(ended.code), **context}
    if error is None:
        log.warning("run failed", extra=extra)
    elif isinstance(error, ProviderError):
        log.warning("run failed: %s", error, extra=extra)
    else:
        log.error("run failed: %s: %s", type(error).__name__, error, exc_info=error,
                  extra=extra)
