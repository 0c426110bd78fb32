"""Request commands are an Enum (wire.Command) whose values are the strings on the wire."""

from __future__ import annotations

from torchtop.contract import wire
from torchtop.contract.request_commands import CAPTURE_COMMANDS, Command


def test_a_command_is_its_string_on_the_wire() -> None:
    req = wire.Request(v=wire.PROTOCOL_VERSION, id=1, cmd=Command.CAPTURE_STATUS)
    back = wire.decode(wire.encode(req))
    assert isinstance(back, wire.Request) and back.cmd == "capture-status" == Command.CAPTURE_STATUS
    assert f"{Command.PING}" == "ping" and str(Command.SNAPSHOT) == "snapshot"


def test_a_received_string_is_found_among_the_capture_commands() -> None:
    # the agent decodes a plain str: a set of str Enum members would hash it by name and miss it
    for cmd in ("capture-profile", "capture-memory", "capture-status"):
        assert cmd in CAPTURE_COMMANDS
    assert "hello" not in CAPTURE_COMMANDS
    assert {c.value for c in Command} == {
        "hello",
        "ping",
        "snapshot",
        "memory",
        *map(str, CAPTURE_COMMANDS),
    }
