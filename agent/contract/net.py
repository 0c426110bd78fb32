"""How a host is written in an address: one rule for the agent's binds and the monitor's targets."""

from __future__ import annotations


def url_host(host: str) -> str:
    """`host` as it goes before `:port` in a URL: an IPv6 address in brackets (once), else as is."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def tcp_address(host: str, port: int) -> str:
    return f"tcp://{url_host(host)}:{port}"
