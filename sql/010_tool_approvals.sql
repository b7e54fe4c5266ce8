-- Tool approvals: a tool call whose policy is `ask` waits, with the run's lease kept, until a
-- device of the run's account decides it or the wait times out. The first decision wins: the
-- decision columns are written once, by a statement that requires them to be empty.

-- Two journal events for it: approval_requested (the worker asks) and approval_decided (the
-- worker reports the decision it read, so every tail and feed sees who decided).
ALTER TABLE run_event DROP CONSTRAINT run_event_type_check;
ALTER TABLE run_event ADD CONSTRAINT run_event_type_check CHECK (type IN (
    'user_message', 'run_queued', 'run_started', 'content_delta', 'tool_call', 'tool_result',
    'approval_requested', 'approval_decided', 'cancel_requested', 'complete'));

CREATE TABLE tool_approval (
    run_id        uuid NOT NULL REFERENCES agent_run (id) ON DELETE CASCADE,
    -- the model's id for the call; unique within a run
    call_id       text NOT NULL CHECK (length(call_id) BETWEEN 1 AND 200),
    account_id    uuid NOT NULL REFERENCES account (id) ON DELETE CASCADE,
    -- the claim token of the execution that asked: a decision lands only while that execution
    -- still owns the run (a superseded or finished execution's question is not pending)
    execution_id  uuid NOT NULL,
    fence         bigint NOT NULL,
    tool          text NOT NULL,
    arguments     jsonb NOT NULL,
    requested_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- undecided by then (database clock): denied as timed out
    expires_at    timestamptz NOT NULL,
    decision      text CHECK (decision IN ('approve', 'deny')),
    decided_by    uuid REFERENCES device (id) ON DELETE SET NULL,
    timed_out     boolean NOT NULL DEFAULT false,
    note          text CHECK (length(note) <= 2000),
    decided_at    timestamptz,
    PRIMARY KEY (run_id, call_id),
    CONSTRAINT tool_approval_decided_shape CHECK ((decision IS NULL) = (decided_at IS NULL)),
    CONSTRAINT tool_approval_timeout_denies CHECK (NOT timed_out OR decision = 'deny')
);
-- Deleting a device nulls decided_by; this index keeps that from scanning every approval.
CREATE INDEX tool_approval_decided_by_idx ON tool_approval (decided_by)
    WHERE decided_by IS NOT NULL;
