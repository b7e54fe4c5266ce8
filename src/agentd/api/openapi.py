"""The OpenAPI 3.2 document of API v1, served at /openapi.json (docs/api.md explains it)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from agentd import __version__
from agentd.vocabulary import (
    STREAM_ERROR_EVENT,
    EventType,
    MessageRole,
    MessageStatus,
    RunErrorCode,
    RunStatus,
)

UUID = {"type": "string", "format": "uuid"}
TIME = {"type": "string", "format": "date-time"}
NULLABLE_TIME = {"type": ["string", "null"], "format": "date-time"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("Error"), description)


_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait", "schema": {
    "type": "integer", "minimum": 1}}}
_TOO_MANY = {"description": "over a limit (stable code); retry after Retry-After",
             "headers": _RETRY_AFTER,
             "content": {"application/json": {"schema": _ref("Error")}}}
# Every authenticated request: its address may be refused for guessing tokens (a 429
# too_many_attempts), as any other limit says.
_ERRORS = {"401": _error("missing, unknown or revoked token"),
           "429": _TOO_MANY,
           "503": {**_error("the database is unavailable, or the request lost a race with "
                            "concurrent writes and wrote nothing; retry after Retry-After"),
                   "headers": _RETRY_AFTER}}
_ID = {"name": "id", "in": "path", "required": True, "schema": UUID}
_PAGE_LIMIT = {"name": "limit", "in": "query", "description": "transcript page: the newest "
               "`limit` messages (widened to whole turns); default: the whole transcript",
               "schema": {"type": "integer", "minimum": 1, "maximum": 1000}}

SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["code", "message"],
        "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}}},
    "Conversation": {"type": "object",
                     "required": ["id", "title", "model", "archived_at", "created_at",
                                  "updated_at"],
                     "properties": {
                         "id": UUID, "title": {"type": "string"},
                         "model": {"type": ["string", "null"],
                                   "description": "what runs that name no model use; null: "
                                                  "the daemon's default model"},
                         "archived_at": {**NULLABLE_TIME, "description": "set while archived "
                                         "(hidden from the list)"},
                         "created_at": TIME, "updated_at": TIME}},
    "Usage": {"type": "object", "description": "token counts, from providers that report them",
              "properties": {"input_tokens": {"type": "integer"},
                             "output_tokens": {"type": "integer"},
                             "runs": {"type": "integer",
                                      "description": "(totals) runs that reported usage"}}},
    "Message": {"type": "object",
                "required": ["id", "role", "content", "status", "run_id", "created_at"],
                "properties": {
                    "id": UUID, "role": {"enum": [str(r) for r in MessageRole]},
                    "content": {"type": "string"},
                    "status": {"enum": [str(s) for s in MessageStatus]},
                    "run_id": {"type": ["string", "null"], "format": "uuid"},
                    "created_at": TIME, "tool_calls": {"type": "array"},
                    "tool_call_id": {"type": "string"},
                    "superseded_by": {"type": ["string", "null"], "format": "uuid",
                                      "description": "the user message of the retry or edit "
                                                     "that replaced this exchange (kept, but "
                                                     "never shown to the model again)"},
                    "model": {"type": ["string", "null"],
                              "description": "on a run's answer: the model that wrote it"},
                    "usage": {**_ref("Usage"), "description": "on a run's answer: its tokens"},
                    "device_id": {"type": ["string", "null"], "format": "uuid",
                                  "description": "on a run's question: the device that asked "
                                                 "it (null: it came from no device)"},
                    "device": {"type": ["string", "null"],
                               "description": "on a run's question: that device's name"}}},
    "Run": {"type": "object",
            "required": ["id", "conversation_id", "status", "cancel_requested", "worker_id",
                         "error", "usage", "created_at", "started_at", "finished_at"],
            "properties": {
                "id": UUID, "conversation_id": UUID, "user_message_id": UUID,
                "device_id": {"type": ["string", "null"], "format": "uuid"},
                "device": {"type": ["string", "null"],
                           "description": "name of the device that asked"},
                "status": {"enum": [str(s) for s in RunStatus]},
                "model": {"type": ["string", "null"]},
                "cancel_requested": {"type": "boolean"},
                "worker_id": {"type": ["string", "null"]},
                "fence": {"type": ["integer", "null"]},
                "lease_expires_at": NULLABLE_TIME,
                "error": {"type": ["string", "null"],
                          "description": "why it failed, in a short message fit for any "
                                         "client (no internals; the daemon log has the "
                                         "detail, by run id)"},
                "error_code": {"enum": [*[str(c) for c in RunErrorCode], None],
                               "description": "a stable code beside `error` (added in "
                                              "0.2; older servers omit it)"},
                "usage": {"type": ["object", "null"]},
                "created_at": TIME, "started_at": NULLABLE_TIME, "finished_at": NULLABLE_TIME}},
    "Lease": {"type": ["object", "null"],
              "properties": {"run_id": UUID, "device": {"type": ["string", "null"]},
                             "device_id": {"type": ["string", "null"]},
                             "worker_id": {"type": "string"}, "fence": {"type": "integer"},
                             "expires_at": TIME}},
    "Attached": {"type": "array", "items": {
        "type": "object", "required": ["device", "since"],
        "properties": {"device": {"type": "string"}, "device_id": UUID, "since": TIME}}},
    "ConversationState": {"allOf": [_ref("Conversation"), {
        "type": "object", "required": ["messages", "runs", "lease", "attached", "usage"],
        "properties": {"messages": {"type": "array", "items": _ref("Message")},
                       "runs": {"type": "array", "items": _ref("Run")},
                       "lease": _ref("Lease"), "attached": _ref("Attached"),
                       "usage": {**_ref("Usage"), "description": "totals of all its runs"},
                       "has_more": {"type": "boolean", "description": "with `limit`: older "
                                    "turns remain before `messages`"},
                       "before": {"type": ["string", "null"], "format": "uuid",
                                  "description": "the cursor of the next older page "
                                                 "(GET …/messages?before=)"}}}]},
    "MessagePage": {"type": "object", "required": ["messages", "has_more", "before"],
                    "properties": {
                        "messages": {"type": "array", "items": _ref("Message"),
                                     "description": "in turn order (oldest first); whole "
                                                    "turns only"},
                        "has_more": {"type": "boolean",
                                     "description": "older turns remain before this page"},
                        "before": {"type": ["string", "null"], "format": "uuid",
                                   "description": "pass as `before` for the next older page; "
                                                  "null when there is none"}}},
    "Draft": {"type": "object", "required": ["run_id", "message_id", "content"],
              "properties": {"run_id": UUID, "message_id": UUID,
                             "content": {"type": "string"}}},
    "CreateRun": {"type": "object", "additionalProperties": False,
                  "description": "`content` is required unless `retry_of` is given",
                  "properties": {
                      "content": {"type": "string", "minLength": 1,
                                  "description": "the message; with retry_of: the edited text"},
                      "model": {"type": "string", "maxLength": 200,
                                "description": "`demo` or `<provider>:<model>` (GET /v1/models);"
                                               " default: the conversation's model, else the "
                                               "daemon's default"},
                      "params": {"type": "object", "description": "provider parameters; the "
                                 "demo model takes tokens, delay_ms, tool (any registered "
                                 "tool, MCP ones as `<server>.<tool>`), tool_args (a JSON "
                                 "object: the call's arguments), fail. A retry without params "
                                 "reuses the retried run's"},
                      "on_busy": {"enum": ["enqueue", "reject", "interrupt"],
                                  "default": "enqueue"},
                      "retry_of": {"anyOf": [UUID, {"const": "last"}],
                                   "description": "re-run the conversation's latest turn (its "
                                                  "question's message id, or `last`), with "
                                                  "`content` to edit it first; the old exchange "
                                                  "is kept, marked superseded"}}},
    "CreateConversation": {"type": "object", "additionalProperties": False, "properties": {
        "title": {"type": "string", "maxLength": 500},
        "model": {"type": "string", "maxLength": 200}}},
    "UpdateConversation": {"type": "object", "additionalProperties": False, "minProperties": 1,
                           "properties": {
                               "title": {"type": "string", "maxLength": 500},
                               "model": {"type": ["string", "null"], "maxLength": 200,
                                         "description": "null: back to the default model"},
                               "archived": {"type": "boolean"}}},
    "Fork": {"type": "object", "required": ["message_id"], "additionalProperties": False,
             "properties": {"message_id": UUID}},
    "Forked": {"allOf": [_ref("Conversation"), {
        "type": "object", "required": ["copied_messages", "forked_from"],
        "properties": {"copied_messages": {"type": "integer"},
                       "forked_from": {"type": "object", "properties": {
                           "conversation_id": UUID, "message_id": UUID}}}}]},
    "ModelOffer": {"type": "object", "required": ["name", "provider", "kind", "usable", "reason"],
                   "properties": {
                       "name": {"type": "string", "description": "what a run names"},
                       "provider": {"type": "string"},
                       "kind": {"enum": ["demo", "openai", "anthropic", "local"]},
                       "usable": {"type": "boolean"},
                       "reason": {"type": ["string", "null"],
                                  "description": "why it cannot be used now"}}},
    "RunCreated": {"type": "object", "required": ["run_id", "status", "conversation_id"],
                   "properties": {"run_id": UUID, "status": {"enum": [str(s) for s in RunStatus]},
                                  "conversation_id": UUID,
                                  "drafts": {"type": "array", "items": _ref("Draft")}}},
    "Approval": {"type": "object",
                 "required": ["call_id", "tool", "arguments", "requested_at", "expires_at",
                              "pending", "decision", "device", "device_id", "timed_out",
                              "note", "decided_at"],
                 "properties": {
                     "call_id": {"type": "string"}, "tool": {"type": "string"},
                     "arguments": {"type": "object"}, "requested_at": TIME,
                     "expires_at": TIME,
                     "pending": {"type": "boolean",
                                 "description": "a decision can still land: undecided, "
                                                "before its deadline, its turn still waiting"},
                     "decision": {"enum": ["approve", "deny", None],
                                  "description": "null while undecided (pending, or left "
                                                 "so by a turn that ended while it waited)"},
                     "device": {"type": ["string", "null"],
                                "description": "the device that decided"},
                     "device_id": {"type": ["string", "null"], "format": "uuid"},
                     "timed_out": {"type": "boolean"}, "note": {"type": ["string", "null"]},
                     "decided_at": NULLABLE_TIME}},
    "Decision": {"type": "object", "required": ["decision"], "additionalProperties": False,
                 "properties": {"decision": {"enum": ["approve", "deny"]},
                                "note": {"type": "string", "maxLength": 2000}}},
    "Decided": {"type": "object",
                "required": ["run_id", "call_id", "decision", "device", "device_id", "note",
                             "decided_at"],
                "properties": {"run_id": UUID, "call_id": {"type": "string"},
                               "decision": {"enum": ["approve", "deny"]},
                               "device": {"type": ["string", "null"]},
                               "device_id": {"type": ["string", "null"], "format": "uuid"},
                               "note": {"type": ["string", "null"]}, "decided_at": TIME}},
    "Pairing": {"type": "object",
                "required": ["code", "expires_at", "url", "fingerprint", "command"],
                "properties": {
                    "code": {"type": "string", "description": "one-time code, 10 Crockford "
                             "base32 characters as XXXXX-XXXXX (case, dashes, O/I/L forgiven)"},
                    "expires_at": TIME,
                    "url": {"type": "string", "description": "how other machines reach this "
                            "server (public_url, else derived from listen)"},
                    "fingerprint": {"type": ["string", "null"], "description": "SHA256:<base64> "
                                    "of the served certificate; null over plain HTTP"},
                    "command": {"type": "string",
                                "description": "the `agenttui login` line to run"}}},
    "Paired": {"type": "object",
               "required": ["token", "account", "account_id", "device", "device_id"],
               "properties": {"token": {"type": "string", "description": "the new device's "
                                        "bearer token, answered this once"},
                              "account": {"type": "string"}, "account_id": UUID,
                              "device": {"type": "string"}, "device_id": UUID}},
    "Device": {"type": "object",
               "required": ["id", "name", "created_at", "last_seen_at", "revoked_at",
                            "current"],
               "properties": {"id": UUID, "name": {"type": "string"}, "created_at": TIME,
                              "last_seen_at": NULLABLE_TIME, "revoked_at": NULLABLE_TIME,
                              "current": {"type": "boolean",
                                          "description": "the device asking"}}},
    "StopResult": {"type": "object", "required": ["cancelled", "flagged", "drafts"],
                   "properties": {"cancelled": {"type": "array", "items": UUID},
                                  "flagged": {"type": "array", "items": UUID},
                                  "drafts": {"type": "array", "items": _ref("Draft"),
                                             "description": "in the order their turns were "
                                                            "queued"}}},
}

# -- the streams ---------------------------------------------------------------------------
# Each Server-Sent Event is described as a client's parser reads it: {event, id, data}, `data`
# being JSON (contentMediaType + contentSchema). OpenAPI 3.2's `itemSchema` of a
# text/event-stream response names the schema of one event. Payloads are additive: a field may
# be added to any of them (clients ignore what they do not know), never renamed or removed.

NULLABLE_UUID = {"type": ["string", "null"], "format": "uuid"}
_NULLABLE_TEXT = {"type": ["string", "null"]}


def _journal(kind: EventType, required: tuple[str, ...] = (),
             **properties: Any) -> dict[str, Any]:
    """The data of one journal event: its own fields, plus `type` and `seq` (and `run_id` in a
    conversation's feed)."""
    return {"type": "object", "required": ["type", "seq", *required],
            "properties": {"type": {"const": str(kind)},
                           "seq": {"type": "integer", "minimum": 1,
                                   "description": "its place in the run's journal"},
                           "run_id": {**UUID, "description": "(conversation feeds) its run"},
                           **properties}}


_TOOL_CALL_FIELDS = {"call_id": {"type": "string"}, "name": {"type": "string"}}
EVENT_DATA: dict[EventType, dict[str, Any]] = {
    EventType.USER_MESSAGE: _journal(EventType.USER_MESSAGE, message_id=UUID,
                                     role={"const": str(MessageRole.USER)},
                                     content={"type": "string"}),
    EventType.RUN_QUEUED: _journal(EventType.RUN_QUEUED),
    EventType.RUN_STARTED: _journal(EventType.RUN_STARTED, worker_id={"type": "string"},
                                    fence={"type": "integer"}, lease_expires_at=TIME),
    EventType.CONTENT_DELTA: _journal(EventType.CONTENT_DELTA, ("delta",),
                                      delta={"type": "string"}),
    EventType.TOOL_CALL: _journal(EventType.TOOL_CALL, ("call_id", "name"), **_TOOL_CALL_FIELDS,
                                  arguments={"description": "the arguments the model gave"}),
    EventType.TOOL_RESULT: _journal(EventType.TOOL_RESULT, ("call_id",), **_TOOL_CALL_FIELDS,
                                    result={"description": "what the tool answered"},
                                    error={"type": "string",
                                           "description": "why it did not run, or failed"}),
    EventType.APPROVAL_REQUESTED: _journal(
        EventType.APPROVAL_REQUESTED, ("call_id", "tool"), call_id={"type": "string"},
        tool={"type": "string"}, arguments={"type": "object"}, device=_NULLABLE_TEXT,
        device_id=NULLABLE_UUID, expires_at=TIME, timeout_s={"type": "number"}),
    EventType.APPROVAL_DECIDED: _journal(
        EventType.APPROVAL_DECIDED, ("call_id", "decision"), call_id={"type": "string"},
        tool={"type": "string"}, decision={"enum": ["approve", "deny"]},
        device=_NULLABLE_TEXT, device_id=NULLABLE_UUID, note=_NULLABLE_TEXT,
        timed_out={"type": "boolean"}),
    EventType.CANCEL_REQUESTED: _journal(EventType.CANCEL_REQUESTED,
                                         partial={"type": "boolean"}),
    EventType.COMPLETE: _journal(
        EventType.COMPLETE, ("status",), status={"enum": [str(s) for s in RunStatus]},
        error=_NULLABLE_TEXT, error_code={"enum": [*[str(c) for c in RunErrorCode], None]},
        message_id=NULLABLE_UUID, usage={"type": ["object", "null"]},
        draft={"type": "object", "properties": {"message_id": UUID,
                                                "content": {"type": "string"}}},
        deleted={"type": "boolean"}),
}
FEED_DATA: dict[str, dict[str, Any]] = {
    "snapshot": {"type": "object", "required": ["type", "conversation"],
                 "properties": {"type": {"const": "snapshot"},
                                "conversation": _ref("ConversationState")}},
    "run_state": {"type": "object", "required": ["type", "run_id", "status"],
                  "properties": {"type": {"const": "run_state"}, "run_id": UUID,
                                 "status": {"enum": [str(s) for s in RunStatus]},
                                 "cancel_requested": {"type": "boolean"}}},
    "lease": {"type": "object", "required": ["type", "lease"],
              "properties": {"type": {"const": "lease"}, "lease": _ref("Lease")}},
    "presence": {"type": "object", "required": ["type", "attached"],
                 "properties": {"type": {"const": "presence"}, "attached": _ref("Attached")}},
    "conversation": {"type": "object", "required": ["type"],
                     "properties": {"type": {"const": "conversation"},
                                    "conversation": {"type": "object"},
                                    "superseded": {"type": "object"},
                                    "usage": _ref("Usage")}},
    "deleted": {"type": "object", "required": ["type", "conversation_id"],
                "properties": {"type": {"const": "deleted"}, "conversation_id": UUID}},
}
STREAM_ERROR_DATA = {"type": "object", "required": ["type", "error"],
                     "properties": {"type": {"const": STREAM_ERROR_EVENT},
                                    "error": _ref("Error/properties/error")}}


def _sse_event(name: str, data: dict[str, Any], *, id_required: bool) -> dict[str, Any]:
    """One event of a stream as a client reads it: its name, its id and its JSON data."""
    return {"type": "object", "required": ["event", "data", *(["id"] if id_required else [])],
            "properties": {"event": {"const": name}, "id": {"type": "string"},
                           "retry": {"type": "integer"},
                           "data": {"type": "string", "contentMediaType": "application/json",
                                    "contentSchema": data}}}


def _feed_event(kind: EventType) -> dict[str, Any]:
    data = EVENT_DATA[kind]
    return {**data, "required": [*data["required"], "run_id"]}


SCHEMAS["RunStreamEvent"] = {
    "description": "one event of GET /v1/runs/{id}/events: a journal event (its id is its seq), "
                   "or the `error` that ends a stream the server will not continue",
    "anyOf": [*[_sse_event(str(kind), data, id_required=True)
                for kind, data in EVENT_DATA.items()],
              _sse_event(STREAM_ERROR_EVENT, STREAM_ERROR_DATA, id_required=False)]}
SCHEMAS["ConversationStreamEvent"] = {
    "description": "one event of GET /v1/conversations/{id}/events: the snapshot, a run's "
                   "journal event (with its run_id), a change of run state, lease, presence or "
                   "the conversation, `deleted`, or the `error` that ends the stream; ids are "
                   "opaque cursors",
    "anyOf": [*[_sse_event(name, data, id_required=True) for name, data in FEED_DATA.items()],
              *[_sse_event(str(kind), _feed_event(kind), id_required=True)
                for kind in EVENT_DATA],
              _sse_event(STREAM_ERROR_EVENT, STREAM_ERROR_DATA, id_required=False)]}


def _sse(item: str) -> dict[str, Any]:
    return {"description": "Server-Sent Events (`: keepalive` comments between them)",
            "content": {"text/event-stream": {"itemSchema": _ref(item)}}}


def build_spec() -> dict[str, Any]:
    spec = _spec()
    # Every operation that reads a JSON body (api/bodies.json_body) can also answer these.
    for operation in (op for ops in spec["paths"].values() for op in ops.values()):
        if "requestBody" in operation:
            responses = operation["responses"]
            responses.setdefault("408", _error("body_timeout: the body did not arrive in time"))
            responses.setdefault("413", _error("body too large"))
    return spec


def _spec() -> dict[str, Any]:
    events = ", ".join(str(e) for e in EventType)
    return {
        "openapi": "3.2.0",
        "info": {"title": "agentd API", "version": __version__,
                 "description": "Durable AI-agent turns. Every /v1 call but POST /v1/pair "
                                "needs `Authorization: Bearer <device token>`. Streams end with "
                                "an `error` event `{type, error: {code, message}}` when the "
                                "server will not continue them (code device_revoked)."},
        "components": {"schemas": SCHEMAS, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/me": {"get": {"summary": "who this token is", "responses": {
                "200": _json({"type": "object", "required": ["account", "device"]},
                             "the account and device"), **_ERRORS}}},
            "/v1/conversations": {
                "post": {"summary": "create a conversation", "requestBody": {
                    "required": False, "content": {"application/json": {
                        "schema": _ref("CreateConversation")}}},
                    "responses": {"201": _json(_ref("Conversation"), "created"),
                                  "400": _error("bad input"),
                                  "403": _error("model_not_allowed: a model this account "
                                                "may not use"),
                                  "413": _error("body over 1 MiB"),
                                  "422": _error("unknown or unusable model, or a model name "
                                                "over 200 characters"), **_ERRORS}},
                "get": {"summary": "list conversations, most recent first (archived ones only "
                                   "with archived=true, and then only them), a page at a time",
                        "parameters": [
                    {"name": "limit", "in": "query",
                     "schema": {"type": "integer", "minimum": 1, "maximum": 1000,
                                "default": 100}},
                    {"name": "archived", "in": "query",
                     "schema": {"enum": ["true", "false"], "default": "false"}},
                    {"name": "after", "in": "query", "schema": {"type": "string"},
                     "description": "a page's `next`: the page after it"}],
                    "responses": {"200": _json({"type": "object",
                                                "required": ["conversations", "next"],
                                                "properties": {
                                                    "conversations": {
                                                        "type": "array",
                                                        "items": _ref("Conversation")},
                                                    "next": {"type": ["string", "null"]}}},
                                               "conversations"),
                                  "400": _error("invalid_limit, invalid_archived or "
                                                "invalid_after"), **_ERRORS}}},
            "/v1/conversations/{id}": {
                "parameters": [_ID],
                "get": {"summary": "transcript, active and queued runs, lease, attached devices",
                        "parameters": [_PAGE_LIMIT],
                        "responses": {"200": _json(_ref("ConversationState"), "the state"),
                                      "400": _error("invalid_limit"),
                                      "404": _error("no such conversation"), **_ERRORS}},
                "patch": {"summary": "rename, set the model, archive or restore (every attached "
                                     "device sees it live)", "requestBody": {
                    "required": True, "content": {"application/json": {
                        "schema": _ref("UpdateConversation")}}},
                    "responses": {"200": _json(_ref("Conversation"), "updated"),
                                  "400": _error("bad input"),
                                  "404": _error("no such conversation"),
                                  "403": _error("model_not_allowed: a model this account "
                                                "may not use"),
                                  "413": _error("body over 1 MiB"),
                                  "422": _error("unknown or unusable model, or a model name "
                                                "over 200 characters"), **_ERRORS}},
                "delete": {"summary": "stop its running turn, then remove it and everything of "
                                      "it in one transaction; attached devices get `deleted`",
                           "responses": {"204": {"description": "deleted"},
                                         "404": _error("no such conversation (or deleted "
                                                       "already)"), **_ERRORS}}},
            "/v1/conversations/{id}/messages": {"get": {
                "summary": "a page of the transcript, pages newest first: the `limit` newest "
                           "messages of the turns before message `before` (whole turns), "
                           "reaching back to message `until` when given",
                "parameters": [
                    _ID,
                    {"name": "before", "in": "query", "schema": UUID,
                     "description": "a message id (a page's `before`); omitted: the newest "
                                    "page"},
                    {"name": "limit", "in": "query",
                     "schema": {"type": "integer", "minimum": 1, "maximum": 1000,
                                "default": 100}},
                    {"name": "until", "in": "query", "schema": UUID,
                     "description": "a message id the page must include (jump to a message)"}],
                "responses": {"200": _json(_ref("MessagePage"), "the page"),
                              "400": _error("invalid_before / invalid_until (not a message "
                                            "of this conversation), invalid_limit, "
                                            "unknown_parameter"),
                              "404": _error("no such conversation"), **_ERRORS}}},
            "/v1/conversations/{id}/fork": {"post": {
                "summary": "a new conversation holding the transcript up to and including "
                           "message_id (ended turns only; the original is untouched)",
                "parameters": [_ID],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref("Fork")}}},
                "responses": {"201": _json(_ref("Forked"), "the new conversation"),
                              "400": _error("bad input"),
                              "404": _error("no such conversation, or no such message in it"),
                              "409": _error("message_not_forkable: its turn has not ended"),
                              "413": _error("body over 1 MiB"), **_ERRORS}}},
            "/v1/models": {"get": {
                "summary": "the models the configured providers offer, and whether each can "
                           "be used now",
                "responses": {"200": _json({"type": "object",
                                            "required": ["models", "default_model"],
                                            "properties": {
                                                "models": {"type": "array",
                                                           "items": _ref("ModelOffer")},
                                                "default_model": {"type": "string"}}},
                                           "the models"), **_ERRORS}}},
            "/v1/conversations/{id}/export": {"get": {
                "summary": "the transcript as Markdown", "parameters": [_ID],
                "responses": {"200": {"description": "Markdown", "content": {
                    "text/markdown": {"schema": {"type": "string"}}}},
                    "404": _error("no such conversation"), **_ERRORS}}},
            "/v1/search": {"get": {
                "summary": "search titles and messages across the account's conversations",
                "parameters": [
                    {"name": "q", "in": "query", "required": True,
                     "schema": {"type": "string", "minLength": 1, "maxLength": 200}},
                    {"name": "limit", "in": "query",
                     "schema": {"type": "integer", "minimum": 1, "maximum": 200}}],
                "responses": {"200": _json({"type": "object", "required": ["results"],
                                            "properties": {"results": {
                                                "type": "array", "items": {
                                                    "type": "object", "required": [
                                                        "conversation_id", "message_id",
                                                        "content", "truncated"],
                                                    "properties": {
                                                        "message_id": {
                                                            "type": ["string", "null"],
                                                            "format": "uuid",
                                                            "description": "null: a title "
                                                            "hit of a conversation with no "
                                                            "message yet"},
                                                        "role": {"type": ["string",
                                                                          "null"]},
                                                        "content": {
                                                            "type": "string",
                                                            "description": "at most 400 "
                                                            "characters of the message, "
                                                            "around the first match"},
                                                        "truncated": {
                                                            "type": "boolean",
                                                            "description": "the message is "
                                                            "longer than `content`; GET "
                                                            "/v1/conversations/{id}/messages"
                                                            "?until=<message_id> loads it "
                                                            "whole"}}}}}},
                                           "matches"),
                              "400": _error("bad query"), **_ERRORS}}},
            "/v1/conversations/{id}/runs": {"post": {
                "summary": "queue a turn (202: it runs in the background)",
                "parameters": [_ID, {"name": "Idempotency-Key", "in": "header",
                                     "schema": {"type": "string", "maxLength": 200}}],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref("CreateRun")}}},
                "responses": {"202": _json(_ref("RunCreated"),
                                           "queued, or running: started in the same commit"),
                              "400": _error("bad input"),
                              "403": _error("model_not_allowed: the account may not use "
                                            "this model (the message names it)"),
                              "404": _error("no such conversation (or retry_of message)"),
                              "409": _error("busy (on_busy=reject), idempotency conflict, or a "
                                            "retry: nothing_to_retry / turn_active"),
                              "413": _error("content or body too large"),
                              "422": _error("unknown or unusable model, a model name over 200 "
                                            "characters, invalid params for the model, an "
                                            "unknown tool (invalid_params) or a tool whose MCP "
                                            "server is unavailable (tool_unavailable: names "
                                            "the tool, not why)"),
                              **_ERRORS,
                              "429": {**_TOO_MANY, "description": "queue_full: the account "
                                      "is at its queued limit, or too_many_attempts; nothing "
                                      "was written"}}}},
            "/v1/conversations/{id}/stop": {"post": {
                "summary": "stop the conversation: cancel queued turns (drafts handed back) "
                           "and ask the running one to stop, atomically",
                "parameters": [_ID],
                "responses": {"202": _json(_ref("StopResult"), "stop recorded"),
                              "404": _error("no such conversation"), **_ERRORS}}},
            "/v1/conversations/{id}/events": {"get": {
                "summary": "SSE: a snapshot, then every run's events, lease, presence and "
                           "conversation changes (title, model, archive, superseded messages, "
                           "token totals); `deleted` ends it; resumable with Last-Event-ID or "
                           "?cursor=",
                "parameters": [_ID, {"name": "cursor", "in": "query",
                                     "schema": {"type": "string"}},
                               {**_PAGE_LIMIT, "description": "the snapshot's transcript: "
                                "its newest `limit` messages (whole turns) with has_more and "
                                "before; default: all of it"}],
                "responses": {"200": _sse("ConversationStreamEvent"),
                              "400": _error("bad cursor or limit"),
                              "404": _error("no such conversation"), **_ERRORS}}},
            "/v1/runs/{id}": {"get": {"summary": "the run", "parameters": [_ID], "responses": {
                "200": _json(_ref("Run"), "the run"), "404": _error("no such run"),
                **_ERRORS}}},
            "/v1/runs/{id}/wait": {"get": {
                "summary": "block until the run is terminal or the timeout passes",
                "parameters": [_ID, {"name": "timeout", "in": "query", "schema": {
                    "type": "number", "minimum": 0, "maximum": 300}}],
                "responses": {"200": _json(_ref("Run"), "the run (check status)"),
                              "400": _error("bad timeout"), "404": _error("no such run"),
                              **_ERRORS,
                              "401": _error("missing, unknown or revoked token; a device "
                                            "revoked while it waits: device_revoked")}}},
            "/v1/runs/{id}/cancel": {"post": {
                "summary": "cancel one run: a queued one ends at once and its text comes back "
                           "as a draft (to the device that asked it); a running one is asked "
                           "to stop (not with only=queued)",
                "parameters": [_ID, {"name": "only", "in": "query", "required": False,
                                     "schema": {"type": "string", "enum": ["queued"]},
                                     "description": "queued: cancel it only while it is "
                                                    "queued; a run started since is left "
                                                    "alone"}],
                "responses": {"202": _json(_ref("StopResult"), "cancel recorded"),
                              "400": _error("invalid_query: only is not 'queued'"),
                              "404": _error("no such run"), **_ERRORS}}},
            "/v1/runs/{id}/approvals": {"get": {
                "summary": "the run's tool approvals, oldest first, pending and decided",
                "parameters": [_ID],
                "responses": {"200": _json({"type": "object", "required": ["approvals"],
                                            "properties": {"approvals": {
                                                "type": "array", "items": _ref("Approval")}}},
                                           "approvals"),
                              "404": _error("no such run"), **_ERRORS}}},
            "/v1/runs/{id}/approvals/{call_id}": {"post": {
                "summary": "approve or deny a pending tool call, from any device of the "
                           "account; the first decision wins",
                "parameters": [_ID, {"name": "call_id", "in": "path", "required": True,
                                     "schema": {"type": "string", "minLength": 1,
                                                "maxLength": 200}}],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": _ref("Decision")}}},
                "responses": {"200": _json(_ref("Decided"), "the decision landed"),
                              "400": _error("bad body"),
                              "404": _error("no such run (not_found) or no such approval "
                                            "(approval_not_found)"),
                              "409": _error("decided already, naming who "
                                            "(approval_already_decided), timed out "
                                            "(approval_expired) or no longer awaited: the "
                                            "run was stopped or ended "
                                            "(approval_not_pending)"),
                              "413": _error("body over 1 MiB"),
                              "422": _error("decision is not approve/deny, or a bad note"),
                              **_ERRORS}}},
            "/v1/runs/{id}/events": {"get": {
                "summary": f"SSE of the run's journal after `from` (or Last-Event-ID); each "
                           f"id is the seq; ends after `complete`. Types: {events}",
                "parameters": [_ID, {"name": "from", "in": "query", "schema": {
                    "type": "integer", "minimum": 0}}],
                "responses": {"200": _sse("RunStreamEvent"), "400": _error("bad cursor"),
                              "404": _error("no such run"), **_ERRORS}}},
            "/v1/pairings": {"post": {
                "summary": "mint a one-time pairing code for another device of this account",
                "requestBody": {"required": False, "content": {"application/json": {"schema": {
                    "type": "object", "additionalProperties": False, "properties": {
                        "device": {"type": "string", "minLength": 1, "maxLength": 200,
                                   "description": "the new device's name (default: the "
                                                  "name it gives when pairing)"}}}}}},
                "responses": {"201": _json(_ref("Pairing"), "the code and the login line"),
                              "400": _error("bad input"), **_ERRORS}}},
            "/v1/pair": {"post": {
                "summary": "redeem a pairing code for a new device token (no bearer token; "
                           "rate-limited per client address)",
                "security": [],
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "additionalProperties": False, "required": ["code"],
                    "properties": {"code": {"type": "string", "minLength": 1, "maxLength": 64},
                                   "device": {"type": "string", "minLength": 1,
                                              "maxLength": 200}}}}}},
                "responses": {"201": _json(_ref("Paired"), "the new device and its token"),
                              "400": _error("bad input"),
                              "401": _error("invalid_pairing_code: unknown, used or expired; "
                                            "nothing was created"),
                              "429": _TOO_MANY,
                              "503": _ERRORS["503"]}}},
            "/v1/devices": {"get": {
                "summary": "this account's devices (never their tokens)",
                "responses": {"200": _json({"type": "object", "required": ["devices"],
                                            "properties": {"devices": {
                                                "type": "array", "items": _ref("Device")}}},
                                           "the devices"), **_ERRORS}}},
            "/v1/devices/{id}": {"delete": {
                "summary": "revoke a device of this account: its token stops working and its "
                           "open streams end with an `error` event (device_revoked)",
                "parameters": [_ID],
                "responses": {"200": _json({"type": "object",
                                            "required": ["revoked", "revoked_at"],
                                            "properties": {"revoked": UUID,
                                                           "revoked_at": TIME}},
                                           "revoked, now or by an earlier request"),
                              "404": _error("no such device in this account"), **_ERRORS}}},
            "/healthz": {"get": {"summary": "liveness (open to all; the worker id only to "
                                            "loopback clients)", "security": [], "responses": {
                "200": _json({"type": "object"}, "alive")}}},
            "/readyz": {"get": {"summary": "readiness: database, hub, not draining (the detail "
                                           "only to loopback clients or a device token)",
                                "security": [], "responses": {
                                    "200": _json({"type": "object"}, "ready"),
                                    "503": _json({"type": "object"}, "not ready")}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (loopback clients or a device "
                                            "token)", "security": [],
                                 "responses": {"200": {"description": "text exposition",
                                                       "content": {"text/plain": {
                                                           "schema": {"type": "string"}}}},
                                               "401": _error("not loopback and no valid "
                                                             "token")}}},
            "/openapi.json": {"get": {"summary": "this document", "security": [],
                                      "responses": {"200": _json({"type": "object"},
                                                                 "the spec")}}},
        },
    }


async def serve_spec(_request: web.Request) -> web.Response:
    return web.json_response(build_spec())
