"""Which parts of a composer text are sends whose answers were lost (screens.main.resent), and
whether a handed-back draft is still in the composer (screens.main.holds_block): matched as
whole paragraph blocks, never by a split of what was typed nor by a substring."""

from __future__ import annotations

from agenttui.screens.main import UncertainSend, holds_block, resent

LOST = UncertainSend("Plan:\n\nfirst words", "key-1", 0.0)  # blank lines of its own
OTHER = UncertainSend("second words", "key-2", 0.0)


def test_a_text_that_is_lost_sends_only_is_those_sends_in_the_composer_order() -> None:
    assert resent("Plan:\n\nfirst words", [LOST]) == [LOST]
    assert resent("second words\n\nPlan:\n\nfirst words\n", [LOST, OTHER]) == [OTHER, LOST]


def test_text_beside_lost_sends_is_new_messages_in_between() -> None:
    assert resent("a draft\n\nPlan:\n\nfirst words\n\ntyped since", [LOST]) == [
        "a draft", LOST, "typed since"]
    assert resent("Plan:\n\nfirst words\n\nmore\n\nsecond words", [LOST, OTHER]) == [
        LOST, "more", OTHER]


def test_a_lost_send_inside_a_paragraph_or_edited_is_no_part() -> None:
    assert resent("Plan:\n\nfirst words, edited", [LOST]) == ["Plan:\n\nfirst words, edited"]
    assert resent("I said second words", [OTHER]) == ["I said second words"]
    assert resent("a new one", []) == ["a new one"]


def test_a_draft_is_in_the_composer_only_as_whole_blocks() -> None:
    assert holds_block("look at this", "ok") is False
    assert holds_block("ok, and more", "ok") is False
    assert holds_block("first\n\nok\n\nlast", "ok") is True
    assert holds_block("Plan:\n\nfirst words\n\nmore", "Plan:\n\nfirst words") is True
    assert holds_block("Plan:\n\nfirst words, edited", "Plan:\n\nfirst words") is False
