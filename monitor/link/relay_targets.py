"""Finding the nodes' relays of a job: over ssh (`torchtop ls --relays` on each host), or in the
job's rendezvous store (store.py), and reaching each through one ssh tunnel per node.

A host whose torchtop has no relays (an older one, or relays turned off) lists none: its ranks
are reached one by one, as before. A relay of another job is never used. No textual, no torch.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from typing import Any

from torchtop.monitor.link.targets import Endpoint, TargetError

LIST_TIMEOUT_S = 20.0


def remote_relays(target: str, options: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The relays running on an ssh host; [] when it has none or cannot say (an older torchtop)."""
    from torchtop.monitor.link import ssh

    parsed = ssh.parse(target)
    remote = os.environ.get(ssh.ENV_REMOTE_CMD) or "torchtop"
    cmd = [*ssh.ssh_base(parsed, options), parsed.destination, f"{remote} ls --json --relays"]
    for _ in range(2):  # a busy sshd drops a connection now and then: once more before doing without
        try:
            proc = subprocess.run(
                cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=LIST_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return []
        if proc.returncode != 255:
            break
    if proc.returncode != 0:
        return []  # an older torchtop there (no --relays), or ssh failed: its ranks one by one
    try:
        relays = json.loads((proc.stdout.strip().splitlines() or ["[]"])[-1])
    except ValueError:
        return []
    if not isinstance(relays, list):
        return []
    out = []
    for r in relays:
        if (
            isinstance(r, dict)
            and isinstance(r.get("address"), str)
            and isinstance(r.get("pub_address"), str)
        ):
            out.append({**r, "_ssh": target})
    return out


def relays_from_store(store: tuple[str, int], job: str | None) -> tuple[str, list[str]]:
    """(the job's id, ssh targets of its nodes) from the relays registered in its store; `job`:
    its id or a prefix, needed only when the store holds several."""
    from torchtop.monitor.link.store import StoreError, read_jobs, read_relays

    where = f"{store[0]}:{store[1]}"
    try:
        jobs = read_jobs(store[0], store[1])
        found = [j for j in jobs if j.startswith(job)] if job else jobs
        if len(found) != 1:
            listing = ", ".join(jobs) or "none"
            raise TargetError(
                f"{'no' if not found else 'several'} jobs with relays in the store at {where} "
                f"{'match ' + repr(job) if job else ''} (jobs: {listing}); "
                + (
                    "start the job's ranks with torchtop (relays start with them)"
                    if not jobs
                    else "name one with --job ID"
                )
            )
        job_id = found[0]
        entries = read_relays(store[0], store[1], job_id)
    except StoreError as exc:
        raise TargetError(str(exc)) from None
    if not entries:
        raise TargetError(
            f"no relay of job {job_id} registered in its store at {where} (relays start with "
            "the ranks' agents unless TORCHTOP_RELAY=0): name the nodes instead (ssh://host ..., --hosts FILE)"
        )
    return job_id, sorted(
        {direct_target(e) or f"ssh://{e.get('ssh_host') or e.get('host')}" for e in entries}
    )


DIRECT = "relay+"  # a relay reached over TCP with CURVE: relay+<its 40-character public key><tcp://host:port>


def direct_target(entry: dict[str, Any]) -> str | None:
    """A relay on TCP (CURVE) that this monitor's client key may reach (`torchtop keys`); None:
    through ssh. Opt out with TORCHTOP_RELAY_SSH=1."""
    from torchtop.contract import curve_keys

    address, server_key = entry.get("tcp_address"), entry.get("server_key")
    if (
        os.environ.get("TORCHTOP_RELAY_SSH") == "1"
        or not isinstance(address, str)
        or not isinstance(server_key, str)
    ):
        return None
    if len(server_key) != curve_keys.Z85_KEY_LEN or not address.startswith("tcp://"):
        return None
    try:
        curve_keys.load_client(server_key)
    except curve_keys.KeyConfigError:
        return None
    return f"{DIRECT}{server_key}{address}"


def direct_endpoint(target: str) -> Endpoint:
    """The Endpoint of a DIRECT target: requests on its port, summaries on port + 1."""
    from torchtop.contract import curve_keys
    from torchtop.monitor.link.targets import Endpoint as _Endpoint

    key, address = (
        target[len(DIRECT) : len(DIRECT) + curve_keys.Z85_KEY_LEN],
        target[len(DIRECT) + curve_keys.Z85_KEY_LEN :],
    )
    ep = _Endpoint(address, address, label="")
    try:
        curve = curve_keys.load_client(key)
    except curve_keys.KeyConfigError as exc:
        raise TargetError(str(exc)) from None
    return _Endpoint.tcp(ep.host, ep.port, None, f"{ep.host}:{ep.port}", curve=curve)
