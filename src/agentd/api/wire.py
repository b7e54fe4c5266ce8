"""The JSON shapes of API v1 (a contract scripts depend on: change only with a version bump)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from agentd.conversations import (
    Attached,
    Conversation,
    ConversationMeta,
    ConversationState,
    Lease,
    Message,
    MessagePage,
    RunRow,
)
from agentd.providers.catalog import Offer
from agentd.queue import Draft, Event
from agentd.vocabulary import MessageRole


def ts(value: datetime | None) -> str | None:
    """RFC 3339 UTC with a Z."""
    if value is None:
        return None
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def conversation(c: Conversation) -> dict[str, Any]:
    return {"id": str(c.id), "title": c.title, "model": c.model,
            "archived_at": ts(c.archived_at), "created_at": ts(c.created_at),
            "updated_at": ts(c.updated_at)}


def conversation_meta(meta: ConversationMeta) -> dict[str, Any]:
    """The `conversation` frame of a feed: what changed about the conversation itself."""
    c = meta.conversation
    return {"conversation": {"id": str(c.id), "title": c.title, "model": c.model,
                             "archived_at": ts(c.archived_at)},
            "superseded": {str(k): str(v) for k, v in meta.superseded.items()},
            "usage": meta.usage}


def model_offer(offer: Offer) -> dict[str, Any]:
    return {"name": offer.name, "provider": offer.provider, "kind": offer.kind,
            "usable": offer.usable, "reason": offer.reason}


def message(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"id": str(m.id), "role": str(m.role), "content": m.content,
                           "status": str(m.status), "run_id": str(m.run_id) if m.run_id else None,
                           "created_at": ts(m.created_at),
                           "superseded_by": str(m.superseded_by) if m.superseded_by else None}
    if m.usage is not None:
        out["usage"] = m.usage
        out["model"] = m.model
    if m.role == MessageRole.USER and m.run_id is not None:
        out["device_id"] = str(m.device_id) if m.device_id else None
        out["device"] = m.device
    if m.tool_calls:
        out["tool_calls"] = m.tool_calls
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def run(r: RunRow) -> dict[str, Any]:
    request = r.request or {}
    return {
        "id": str(r.id), "conversation_id": str(r.conversation_id),
        "user_message_id": str(r.user_message_id),
        "device_id": str(r.origin_device_id) if r.origin_device_id else None,
        "device": r.origin_device,
        "status": str(r.status), "model": request.get("model"),
        "cancel_requested": r.cancel_requested, "worker_id": r.worker_id, "fence": r.fence,
        "lease_expires_at": ts(r.lease_expires_at) if r.status == "running" else None,
        "error": r.error, "error_code": r.error_code, "usage": r.usage,
        "created_at": ts(r.created_at),
        "started_at": ts(r.started_at), "finished_at": ts(r.finished_at),
    }


def lease(lease_row: Lease | None) -> dict[str, Any] | None:
    if lease_row is None or not lease_row.live:
        return None
    return {"run_id": str(lease_row.run_id), "device": lease_row.device,
            "device_id": str(lease_row.device_id) if lease_row.device_id else None,
            "worker_id": lease_row.worker_id, "fence": lease_row.fence,
            "expires_at": ts(lease_row.expires_at)}


def attached(devices: Sequence[Attached]) -> list[dict[str, Any]]:
    return [{"device": a.device, "device_id": str(a.device_id), "since": ts(a.since)}
            for a in devices]


def conversation_state(state: ConversationState) -> dict[str, Any]:
    return {**conversation(state.conversation),
            "messages": [message(m) for m in state.messages],
            "runs": [run(r) for r in state.runs],
            "lease": lease(state.lease),
            "attached": attached(state.attached),
            "usage": state.usage,
            "has_more": state.has_more,
            "before": str(state.before) if state.before else None}


def message_page(page: MessagePage) -> dict[str, Any]:
    """A transcript page: its messages in turn order, and where the next older page starts."""
    return {"messages": [message(m) for m in page.messages], "has_more": page.has_more,
            "before": str(page.before) if page.before else None}


def event(e: Event, run_id: str | None = None) -> dict[str, Any]:
    """An SSE data payload: the event's own fields plus type and seq (and run_id in feeds)."""
    out: dict[str, Any] = {**e.payload, "type": str(e.type), "seq": e.seq}
    if run_id is not None:
        out["run_id"] = run_id
    return out


def drafts(items: list[Draft]) -> list[dict[str, Any]]:
    return [{"run_id": str(d.run_id), "message_id": str(d.message_id), "content": d.content}
            for d in items]


def approval(row: dict[str, Any]) -> dict[str, Any]:
    """One tool approval of a run: what was asked, who decided (null while undecided), and
    whether a decision can still land (`pending`)."""
    return {"call_id": row["call_id"], "tool": row["tool"], "arguments": row["arguments"],
            "requested_at": ts(row["requested_at"]), "expires_at": ts(row["expires_at"]),
            "pending": bool(row.get("pending")), "decision": row["decision"],
            "device": row["decided_by_name"],
            "device_id": str(row["decided_by"]) if row["decided_by"] else None,
            "timed_out": row["timed_out"], "note": row["note"],
            "decided_at": ts(row["decided_at"])}
