"""Tool names on providers' wires: agentd's `server.tool` ↔ ^[a-zA-Z0-9_-]{1,64}$, both ways."""

from __future__ import annotations

import pytest

from agentd.providers.transcript import WIRE_TOOL_NAME, ToolNames


@pytest.mark.parametrize("names", [
    ["calculator", "notes"],
    ["time.get_current_time", "time.convert_time"],
    ["a.b", "a__b", "a_b"],  # a collision after spelling dots as __
    ["srv." + "x" * 120, "srv." + "x" * 121],  # too long, and equal once cut to 64
    ["weird.tool name/ü", "weird.tool_name__"],
])
def test_every_name_maps_to_a_distinct_valid_wire_name_and_back(names: list[str]) -> None:
    mapping = ToolNames(names)
    wires = [mapping.wire(name) for name in names]
    assert all(WIRE_TOOL_NAME.match(w) for w in wires), wires
    assert len(set(wires)) == len(names), wires
    assert [mapping.local(w) for w in wires] == names
    assert ToolNames(names).wire(names[0]) == wires[0]  # same request, same spelling


def test_valid_names_go_out_unchanged_and_unknown_wire_names_come_back_as_they_are() -> None:
    mapping = ToolNames(["calculator", "time.now"])
    assert mapping.wire("calculator") == "calculator"
    assert mapping.wire("time.now") == "time__now"
    assert mapping.local("something_else") == "something_else"
