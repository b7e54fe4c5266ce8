"""A model's tool-call arguments, decoded from the text it streamed."""

from __future__ import annotations

from agentd.providers.transcript import decode_arguments


def test_arguments_are_an_object_or_kept_as_the_text_the_model_sent() -> None:
    assert decode_arguments('{"a": [1]}') == {"a": [1]}
    assert decode_arguments("   ") == {}
    assert decode_arguments("[1, 2]") == "[1, 2]"  # JSON, but not an object
    assert decode_arguments("{broken") == "{broken"
    # Nested past what the decoder recurses into: a tool error the model reads, not a turn
    # failed as an internal error.
    deep = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"
    assert decode_arguments(deep) == deep
