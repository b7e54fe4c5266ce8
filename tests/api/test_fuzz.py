"""Fuzz API v1 from its own /openapi.json (schemathesis): no input, valid or not, may yield a 5xx
or an answer the document does not describe (status, content type, headers, body schema: for
the two event streams, every event read against the stream's `itemSchema`).

The cases come from a fixed seed: a run fuzzes the same inputs as the last one, so a failure
reproduces, and a change of the API or the document is what changes the cases.

Cases run synchronously against the daemon process (requests transport) in a worker thread; about
half of the cases that take an `{id}` get an id the fuzzing account really owns, so handlers run
past their 404 with generated bodies and queries.
"""

from __future__ import annotations

import asyncio
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api.conftest import Api
from tests.api.helpers import start_run, wait_run
from tests.support.factories import create_conversation

MAX_EXAMPLES = 25
SEED = 20261201  # fixed: the same cases on every run
STREAM_READ_S = 3.0
# The response-conformance checks of schemathesis, on every operation, the streams included.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]


def fuzz_operation(operation: Any, mode: GenerationMode, base_url: str, token: str,
                   owned: dict[str, str], statuses: set[int]) -> str | None:
    """Run one operation's cases; the first failure (shrunk by hypothesis) as text, or None.

    Every status answered is added to `statuses`.
    """
    owned_id = owned["run"] if operation.path.startswith("/v1/runs/") else owned["conversation"]
    session = requests.Session()
    session.trust_env = False

    @seed(SEED)
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode), use_owned=st.booleans())
    def check(case: Any, use_owned: bool) -> None:
        if use_owned and "id" in (case.path_parameters or {}):
            case.path_parameters["id"] = owned_id
            if operation.method.upper() == "DELETE":
                # A delete gets a conversation of its own: the owned one must outlive the run.
                case.path_parameters["id"] = session.post(
                    f"{base_url}/v1/conversations", json={"title": "to delete"}, timeout=10,
                    headers={"Authorization": f"Bearer {token}"}).json()["id"]
        response = case.call(base_url=base_url, session=session, timeout=STREAM_READ_S,
                             headers={"Authorization": f"Bearer {token}"})
        statuses.add(response.status_code)
        case.validate_response(response, checks=CHECKS)

    try:
        check()
    except Unsatisfiable:
        if mode != GenerationMode.NEGATIVE:
            raise
        return None  # no parameters or body: nothing to make invalid
    except (Exception, FailureGroup) as exc:  # a FailureGroup is a BaseExceptionGroup
        return f"{operation.label} [{mode.value}]: {type(exc).__name__}: {exc}"
    finally:
        session.close()
    return None


def fuzz_all(spec: dict[str, Any], base_url: str, token: str,
             owned: dict[str, str]) -> tuple[list[str], dict[str, set[int]]]:
    """Failures, and the statuses each operation answered to valid (positive) cases."""
    schema = schemathesis.openapi.from_dict(spec)
    schema.config.update(base_url=base_url)
    schema.config.max_stream_events = 2  # a conversation stream never ends by itself
    failures: list[str] = []
    answered: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            statuses: set[int] = set()
            failure = fuzz_operation(operation, mode, base_url, token, owned, statuses)
            if failure is not None:
                failures.append(failure)
            if mode == GenerationMode.POSITIVE:
                answered[f"{operation.method.upper()} {operation.path}"] = statuses
    return failures, answered


async def test_fuzzed_requests_never_5xx_and_always_match_the_document(api: Api):
    conversation_id = await create_conversation(api.a, "fuzzed")
    turn = await start_run(api.a, conversation_id, "a turn to fuzz around")
    await wait_run(api.a, turn["run_id"])
    spec = (await api.a.get("/openapi.json")).json()
    owned = {"conversation": conversation_id, "run": turn["run_id"]}

    failures, answered = await asyncio.to_thread(fuzz_all, spec, api.url, api.token_a, owned)

    assert not failures, "\n\n".join(failures)
    operations = {f"{m.upper()} {p}" for p, item in spec["paths"].items() for m in item
                  if m in ("get", "post", "put", "patch", "delete")}
    assert set(answered) == operations
    # The owned ids took the reads past their 404s: the handlers themselves were fuzzed.
    for label, statuses in answered.items():
        if label.startswith("GET") and "{id}" in label:
            assert any(200 <= s < 300 for s in statuses), f"{label} never succeeded: {statuses}"
    assert (await api.a.get("/readyz")).status_code == 200
    assert "unhandled error" not in api.daemon.log_text()
