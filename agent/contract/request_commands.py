"""What a monitor may ask an agent: the `cmd` of a `wire.Request`."""

from __future__ import annotations

from enum import Enum


class Command(str, Enum):
    """What a `Request` asks. The wire carries the string, so an agent answers a command it does
    not know (an older or newer monitor's) with a line that names it, not a decode error."""

    HELLO = "hello"
    PING = "ping"
    SNAPSHOT = "snapshot"
    MEMORY = "memory"
    CAPTURE_PROFILE = "capture-profile"
    CAPTURE_MEMORY = "capture-memory"
    CAPTURE_STATUS = "capture-status"

    def __str__(self) -> str:  # the command as typed, in f-strings too (3.11 formats a str Enum by name)
        return self.value


# a tuple, not a set: a str Enum hashes by its name, so a received string is found by ==
CAPTURE_COMMANDS = (Command.CAPTURE_PROFILE, Command.CAPTURE_MEMORY, Command.CAPTURE_STATUS)
