"""The captures a monitor has seen, and how to say where their files are. Pure: no textual, no zmq.

The agent reports the capture in progress (or its last one) in every batch and lists all of its
captures on `capture-status`; `CaptureBook` merges both. A file lives on the agent's host: when
that is not this machine, the Captures screen gives the host and path and the `scp` line.
"""

from __future__ import annotations

import socket
from typing import Any, cast
from urllib.parse import urlsplit

from torchtop.contract.capture import (
    CAPTURE_ACTIVE,
    CAPTURE_FINISHED,
    PROFILE_MAX_STEPS,
    CaptureInfo,
    CaptureKind,
    CaptureState,
)
from torchtop.contract.net import url_host
from torchtop.monitor.model import fmt
from torchtop.monitor.model.hotspots import short_site

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def next_steps(n: int, up: bool) -> int:
    """The capture length after one + or - press: by 1 to 10, by 5 to 50, by 10 to the limit."""
    if up:
        n += 1 if n < 10 else 5 if n < 50 else 10
    else:
        n -= 1 if n <= 10 else 5 if n <= 50 else 10
    return max(1, min(PROFILE_MAX_STEPS, n))


class CaptureBook:
    """Captures of the current run by id, and the one the agent reports as current."""

    def __init__(self) -> None:
        self.by_id: dict[int, CaptureInfo] = {}
        self.current: CaptureInfo | None = None
        self.asked: set[int] = set()  # ids this monitor requested: their end is announced

    def reset(self) -> None:
        """A new run: its capture ids start again at 1."""
        self.by_id.clear()
        self.asked.clear()
        self.current = None

    def requested(self, capture: CaptureInfo | None) -> None:
        if capture is not None:
            self.asked.add(capture.id)
            self.see(capture)

    def see(self, capture: CaptureInfo | None) -> CaptureInfo | None:
        """Record a batch's capture; return it if it has just finished and should be announced."""
        if capture is None:
            return None
        before = self.by_id.get(capture.id)
        self.by_id[capture.id] = capture
        self.current = capture
        newly = capture.state in CAPTURE_FINISHED and (before is None or before.state not in CAPTURE_FINISHED)
        if newly and (capture.id in self.asked or (before is not None and before.state in CAPTURE_ACTIVE)):
            return capture
        return None

    def merge(self, captures: list[CaptureInfo]) -> None:
        """A capture-status answer: the agent's full list."""
        for c in captures:
            self.by_id[c.id] = c

    @property
    def active(self) -> CaptureInfo | None:
        c = self.current
        return c if c is not None and c.state in CAPTURE_ACTIVE else None

    def listing(self) -> list[CaptureInfo]:
        """Newest first."""
        return [self.by_id[k] for k in sorted(self.by_id, reverse=True)]


def progress(c: CaptureInfo) -> float:
    """How far a capture got, 0..1 (steps, or seconds for a timed memory capture)."""
    if c.state in CAPTURE_FINISHED or c.state == CaptureState.WRITING:
        return 1.0
    if c.steps_total:
        return min(1.0, c.steps_done / c.steps_total)
    return 0.0


def progress_text(c: CaptureInfo) -> str:
    """One line: what the capture is doing now."""
    what = "profile" if c.kind == CaptureKind.PROFILE else "memory snapshot"
    if c.state == CaptureState.PENDING:
        return f"{what} #{c.id}: waiting for the next step boundary"
    if c.state == CaptureState.RUNNING:
        if c.steps_total:
            return f"{what} #{c.id}: step {c.steps_done}/{c.steps_total}"
        return f"{what} #{c.id}: recording for {c.seconds:g} s"
    if c.state == CaptureState.WRITING:
        return f"{what} #{c.id}: writing the file"
    if c.state == CaptureState.FAILED:
        return f"{what} #{c.id} failed: {c.error}"
    return f"{what} #{c.id} done: {c.path}"


def toast_text(c: CaptureInfo) -> str:
    """A finished capture in a toast: short, so the toast stays a corner of an 80x24 screen; the
    path and the summary are on the Captures screen (c)."""
    what = "profile" if c.kind == CaptureKind.PROFILE else "memory snapshot"
    if c.state == CaptureState.FAILED:
        error = c.error if len(c.error) <= 60 else c.error[:59] + "…"
        return f"{what} #{c.id} failed: {error}"
    name = c.path.rsplit("/", 1)[-1]
    if len(name) > 36:  # its start (kind, pid, id) and its end (the format); the rest on screen c
        name = name[:17] + "…" + name[-18:]
    return f"{what} #{c.id} done: {name}" if name else f"{what} #{c.id} done"


def fetch_from(
    endpoint_label: str, endpoint_host: str, capture_host: str, local_host: str | None = None
) -> tuple[str, list[str]] | None:
    """Where to scp a capture's file from, (destination, extra scp args); None when it is local.

    An ssh:// target names its destination (user, host, port) in the endpoint label; a direct
    tcp:// target its host, unless the capture was written on this machine (its host is ours: a
    job view's rank reached by its host name); a loopback agent is on this machine unless it
    reports another host name (a tunnel the user made by hand).
    """
    first = endpoint_label.split()[0] if endpoint_label.strip() else ""
    if first.lower().startswith("ssh://"):
        try:
            parts = urlsplit(first)
            host, user, port = parts.hostname, parts.username, parts.port
        except ValueError:
            host, user, port = None, None, None
        if host:
            host = url_host(host)
            return (f"{user}@{host}" if user else host), (["-P", str(port)] if port else [])
    local = socket.gethostname() if local_host is None else local_host
    if capture_host and capture_host == local:  # written on this machine, whatever the address
        return None
    if endpoint_host and endpoint_host not in LOOPBACK and endpoint_host != local:
        return url_host(endpoint_host), []
    if capture_host and capture_host != local:
        return capture_host, []
    return None


def describe(c: CaptureInfo) -> str:
    """Human lines for a finished capture, without its file: capture_lines says where that is."""
    lines = [f"{c.kind} capture {c.id}: {c.state}" + (f" ({c.error})" if c.error else "")]
    if c.note:  # the directory asked for was refused: where the file went, and why
        lines.append(f"  note: {c.note}")
    s = c.summary or {}
    if "buckets" in s:
        parts = "  ".join(f"{k} {fmt.pct(v, 0)}" for k, v in s["buckets"].items() if v >= 0.005)
        n = s.get("steps", 0)
        lines.append(f"  {n} {fmt.plural(n, 'step')} of {s.get('step_ms', 0):.1f} ms: {parts}")
        if s.get("gpu_idle") is not None:
            lines.append(f"  GPU idle {fmt.pct(s['gpu_idle'], 0)} of the steps")
    for key, title in (
        ("top_device", "top ops by self device time"),
        ("top_cpu", "top ops by self CPU time"),
    ):
        if s.get(key):
            lines.append(f"  {title}:")
            lines += [f"    {r['self_ms']:9.3f} ms  {r['calls']:6d}x  {r['name']}" for r in s[key][:5]]
    if s.get("top_sites"):
        lines.append("  top allocation sites:")
        lines += [
            f"    {r['bytes'] / 2**20:9.1f} MiB  {r['allocs']:6d}x  {r['site']}" for r in s["top_sites"][:5]
        ]
    lines += growth_lines(s)
    return "\n".join(lines)


def growth_lines(s: dict[str, Any], n: int = 5) -> list[str]:
    """A memory capture's sites that grew between its midpoint and its end (the agent's
    memory_growth.py), checked as read: "grew over 200 steps:", then a line a site."""
    note = s.get("growth_note")
    if isinstance(note, str) and note:
        return [f"  growth not measured: {note[:200]}"]
    steps, sites = s.get("growth_steps"), s.get("growing_sites")
    if type(steps) is not int or steps <= 0 or not isinstance(sites, list):
        return []
    over = f"over {steps:,} {fmt.plural(steps, 'step')}"
    rows = _grown(cast("list[Any]", sites)[:10])[:n]
    if not rows:  # the agent lists growth of 1 MiB or more (memory_growth.FLOOR)
        return [f"  no allocation site grew by 1 MiB or more {over}"]
    return [f"  grew {over}:"] + [
        f"    {short_site(site)} +{fmt.size(b)} (+{fmt.size(per)} a step)" for site, b, per in rows
    ]


def _grown(sites: list[Any]) -> list[tuple[str, float, float]]:
    """The well-formed rows: (site, bytes, bytes a step)."""
    rows: list[tuple[str, float, float]] = []
    for r in sites:
        row = cast("dict[str, Any]", r) if isinstance(r, dict) else {}
        site, b, per = row.get("site"), _count(row.get("bytes")), _count(row.get("per_step"))
        if isinstance(site, str) and b is not None and b > 0 and per is not None:
            rows.append((site[:300], b, per))
    return rows


def _count(v: object) -> float | None:
    """A finite count of bytes (0 or more), else None."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 2**63:
        return float(v)
    return None


def capture_lines(c: CaptureInfo, source: tuple[str, list[str]] | None) -> list[str]:
    """A capture for the Captures screen and `torchtop capture`: state, file (with its host and
    the scp line when it is on another machine: `source`, from fetch_from), summary."""
    lines = describe(c).splitlines()
    at = 2 if c.note else 1  # after the state and its note
    if c.path:
        if source is None:
            lines.insert(at, f"  file: {c.path}")
        else:
            dest, args = source
            lines.insert(at, f"  file: {dest}:{c.path}")
            lines.insert(at + 1, "  fetch: " + " ".join(["scp", *args, f"{dest}:{c.path}", "."]))
    return lines
