"""The HTTP client of API v1: one typed call per endpoint, and streams that survive disconnects.

`ConversationStream` and `RunStream` reconnect by themselves with backoff and resume from the
last event id, so a consumer sees every journal event exactly once, in order, whatever the
network does: duplicates are dropped by (run, seq), a gap is filled from the run's own journal.
No Textual here: scripts and the `ask` command use this package alone. `errors` (what it
raises), `http` (the calls), `streams` (the resumable feeds and their items).
"""

from agenttui.client.errors import (
    ApiError,
    CertificateMismatch,
    Conflict,
    NotFound,
    RateLimited,
    Unauthorized,
    Unavailable,
    describe,
    outcome_unknown,
)
from agenttui.client.http import (
    DEFAULT_URL,
    KEEPALIVE_S,
    UNSET,
    AgentClient,
    canonical_url,
    new_idempotency_key,
    token_problem,
    url_problem,
)
from agenttui.client.streams import (
    Backoff,
    ConnectionState,
    ConnectionStatus,
    ConversationChanged,
    ConversationDeleted,
    ConversationStream,
    FeedItem,
    LeaseChanged,
    PresenceChanged,
    RunStateChanged,
    RunStream,
    Snapshot,
)
from agenttui.models import (
    Attached,
    Conversation,
    ConversationState,
    CreatedRun,
    Draft,
    Lease,
    Me,
    MessagePage,
    Models,
    Run,
    RunEvent,
    SearchHit,
    StopResult,
)

__all__ = [
    "DEFAULT_URL", "KEEPALIVE_S", "UNSET", "AgentClient", "ApiError", "Attached", "Backoff",
    "CertificateMismatch",
    "Conflict", "ConnectionState", "ConnectionStatus", "Conversation", "ConversationChanged",
    "ConversationDeleted", "ConversationState", "ConversationStream", "CreatedRun", "Draft",
    "FeedItem", "Lease", "LeaseChanged", "Me", "MessagePage", "Models", "NotFound",
    "PresenceChanged", "RateLimited", "Run",
    "RunEvent", "RunStateChanged", "RunStream", "SearchHit", "Snapshot", "StopResult",
    "Unauthorized", "Unavailable", "canonical_url", "describe", "new_idempotency_key",
    "outcome_unknown", "token_problem", "url_problem",
]
