"""The `notes` tool: a per-conversation notebook in PostgreSQL whose writes are fenced.

The downstream resource of fencing (docs/providers.md, "Fenced writes"): each append carries
the run's fence, and the notebook rejects a fence lower than the highest it has seen for the
conversation, so an execution that lost its lease (and was superseded) cannot write after its
successor did. Being in the daemon's own database, it also refuses a run that no longer holds
its turn, as every worker write does, which covers the time before the successor wrote. Reads
are not fenced.
"""

from __future__ import annotations

from typing import Any

from agentd.tools.registry import Tool, ToolContext, ToolError

MAX_NOTE_CHARS = 4000
DEFAULT_LIST_LIMIT = 50
MAX_LIST_LIMIT = 200


class StaleFence(ToolError):
    """A superseded execution tried to write: nothing was written."""


async def append_note(ctx: ToolContext, text: str) -> dict[str, Any]:
    """Append behind the fence; raises StaleFence (writing nothing) for a superseded run."""
    note = await ctx.store.append_note(conversation_id=ctx.conversation_id, run_id=ctx.run_id,
                                       fence=ctx.fence, text=text)
    if note is None:
        mark = await ctx.store.note_fence_mark(ctx.conversation_id)
        if mark is None or mark <= ctx.fence:
            raise StaleFence("rejected: this run no longer holds its turn (it ended, its "
                             "lease ran out, or its conversation was deleted); nothing written")
        raise StaleFence(f"rejected: this run's fence {ctx.fence} is lower than {mark}, which a "
                         "newer execution of this conversation already used; nothing written")
    return {"note_id": note.id, "created_at": note.created_at.isoformat()}


async def list_notes(ctx: ToolContext, limit: int) -> dict[str, Any]:
    notes = await ctx.store.list_notes(ctx.conversation_id, limit)
    return {"notes": [{"note_id": n.id, "text": n.text,
                       "created_at": n.created_at.isoformat()} for n in notes]}


async def _notes(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    if args["action"] == "append":
        text = str(args.get("text") or "").strip()
        if not text:
            raise ToolError("append needs a non-empty 'text'")
        return await append_note(ctx, text)
    limit = args.get("limit", DEFAULT_LIST_LIMIT)
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise ToolError(f"limit must be between 1 and {MAX_LIST_LIMIT}")
    return await list_notes(ctx, limit)


def notes_tool() -> Tool:
    return Tool(
        "notes",
        "This conversation's notebook: 'append' a note (text) or 'list' the latest notes.",
        {"type": "object",
         "properties": {"action": {"type": "string", "enum": ["append", "list"]},
                        "text": {"type": "string", "maxLength": MAX_NOTE_CHARS},
                        "limit": {"type": "integer"}},
         "required": ["action"], "additionalProperties": False},
        _notes)
