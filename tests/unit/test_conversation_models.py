"""The model each conversation was last seen with in one process (conversation_models.py): a
guess per account and conversation, bounded, the least recently seen forgotten first."""

from __future__ import annotations

from uuid import uuid4

import pytest

from agentd.conversation_models import ConversationModels
from agentd.queue import ModelGuess


def test_a_conversation_never_seen_has_no_guess_and_one_without_a_model_has_one() -> None:
    models = ConversationModels()
    account, conversation = uuid4(), uuid4()
    assert models.guess(account, conversation) is None
    models.seen(account, conversation, None)  # no model of its own: default_model applies
    assert models.guess(account, conversation) == ModelGuess(None)
    models.seen(account, conversation, "demo")
    assert models.guess(account, conversation) == ModelGuess("demo")


def test_a_guess_is_only_for_the_account_that_was_shown_the_row() -> None:
    models = ConversationModels()
    conversation = uuid4()
    models.seen(uuid4(), conversation, "demo")
    assert models.guess(uuid4(), conversation) is None


def test_the_least_recently_seen_conversation_is_forgotten_first() -> None:
    models = ConversationModels(capacity=2)
    account = uuid4()
    first, second, third = uuid4(), uuid4(), uuid4()
    models.seen(account, first, "a")
    models.seen(account, second, "b")
    assert models.guess(account, first) == ModelGuess("a")  # used: now the most recent
    models.seen(account, third, "c")
    assert len(models) == 2
    assert models.guess(account, second) is None
    assert models.guess(account, first) == ModelGuess("a")
    models.forget(account, first)
    assert models.guess(account, first) is None and len(models) == 1


def test_a_capacity_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ConversationModels(capacity=0)
