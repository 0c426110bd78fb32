"""The job's own output (stdout and stderr, as written to its log file), tailed live."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import Log

CHUNK = 256 * 1024  # most bytes read per poll: a chatty job cannot stall the UI
MAX_LINES = 5000


class LogTail(Log):
    """A Log that follows a file as it grows (and starts over if it is truncated)."""

    def __init__(self, path: Path, **kwargs: object) -> None:
        super().__init__(max_lines=MAX_LINES, **kwargs)  # type: ignore[arg-type]
        self.path = path
        self._offset = 0
        self._partial = ""

    def poll(self) -> int:
        """Append what the file gained since the last poll; returns the bytes read."""
        try:
            size = self.path.stat().st_size
            if size < self._offset:  # truncated or replaced
                self._offset, self._partial = 0, ""
            if size == self._offset:
                return 0
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read(CHUNK)
        except OSError:
            return 0
        self._offset += len(data)
        text = self._partial + data.decode("utf-8", errors="replace")
        lines = text.split("\n")
        self._partial = lines.pop()
        if lines:
            self.write_lines(lines)
        return len(data)
