"""The job's own output (stdout and stderr, as written to its log file), tailed live; long lines
wrap at the widget's width (an 80-column terminal shows them whole), again on a resize."""

from __future__ import annotations

import textwrap
from collections import deque
from pathlib import Path

from textual import events
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
        self._raw: deque[str] = deque(maxlen=MAX_LINES)  # the lines as written, for a re-wrap
        self._wrap_at = 0  # the width the lines on screen are wrapped at (0: not yet laid out)

    def _wrapped(self, lines: list[str] | deque[str]) -> list[str]:
        width = self._wrap_at
        if width <= 0:
            return list(lines)
        out: list[str] = []
        for line in lines:
            if len(line) <= width:
                out.append(line)
            else:  # at spaces; a word longer than the width is broken inside
                out += textwrap.wrap(line, width, drop_whitespace=True, replace_whitespace=False) or [""]
        return out

    def on_resize(self, _event: events.Resize) -> None:
        width = self.scrollable_content_region.width - 1  # the scrollbar, once the log is long
        if width > 0 and width != self._wrap_at:
            self._wrap_at = width
            self.clear()
            self.write_lines(self._wrapped(self._raw))

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
            self._raw.extend(lines)
            self.write_lines(self._wrapped(lines))
        return len(data)
