"""Which parts of a composer text are sends whose answers were lost (screens.main.resent), and
whether a handed-back draft is still in the composer (screens.main.holds_block)."""

from __future__ import annotations

from agenttui.screens.main import UncertainSend, holds_block, resent

LOST = UncertainSend("Plan:\n\nfirst words", "key-1", 0.0)  # blank lines of its own
OTHER = UncertainSend("second words", "key-2", 0.0)
SEP = "\n\n"


def test_unedited_lost_sends_handed_back_go_again_each_under_its_key() -> None:
    handed = [LOST.text, OTHER.text]
    assert resent(SEP.join(handed), [LOST, OTHER], handed) == [LOST, OTHER]
    # Ends and starts with whitespace of their own (a pasted newline, an indented line).
    ending, indented = UncertainSend("A\n", "k-a", 0.0), UncertainSend("  B", "k-b", 0.0)
    handed = [ending.text, indented.text]
    assert resent(SEP.join(handed), [ending, indented], handed) == [ending, indented]


def test_what_else_was_handed_back_or_typed_goes_as_new_messages_between_them() -> None:
    handed = ["a draft", LOST.text, "refused words"]
    text = SEP.join(handed) + SEP + "typed since"
    assert resent(text, [LOST], handed) == ["a draft", LOST, "refused words\n\ntyped since"]
    assert resent(LOST.text + SEP + "more", [LOST], [LOST.text]) == [LOST, "more"]


def test_without_handed_back_texts_only_whole_joined_sends_are_resent() -> None:
    assert resent(LOST.text + SEP + OTHER.text, [LOST, OTHER]) == [LOST, OTHER]
    # Typed again by hand, a lost send inside a longer message is not cut out of it.
    typed = "Answer:\n\nsecond words\n\nbecause"
    assert resent(typed, [OTHER]) == [typed]
    assert resent("Plan:\n\nfirst words, edited", [LOST]) == ["Plan:\n\nfirst words, edited"]


def test_a_draft_is_in_the_composer_only_as_whole_paragraphs() -> None:
    assert holds_block("look at this", "ok") is False
    assert holds_block("ok, and more", "ok") is False
    assert holds_block("first\n\nok\n\nlast", "ok") is True
    assert holds_block("x\n\n\ny", "x\n") is True  # handed back with a newline of its own
    assert holds_block("first\n  \n  ok  ", "ok") is True
    assert holds_block("Plan:\n\nfirst words\n\nmore", "Plan:\n\nfirst words") is True
    assert holds_block("Plan:\n\nfirst words, edited", "Plan:\n\nfirst words") is False
