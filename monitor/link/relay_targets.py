"""Finding the nodes' relays of a job: over ssh (`torchtop ls --relays` on each host), or in the
job's rendezvous store (store.py), and reaching each through one ssh tunnel per node.

A host whose torchtop has no relays (an older one, or relays turned off) lists none: its ranks
are reached one by one, as before. A relay of another job is never used. The store is written
by whoever reaches the job's master port, so nothing in it is taken on its word: a relay is
reached directly (TCP, CURVE) only with a server key the user's own keys directory holds, else
over ssh (where ssh vouches for the host); every registration of a node is kept, and a node
registered twice is said; at most MAX_STORE_HOSTS hosts, the others named. No textual, no torch.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence

from torchtop.contract.relay import RelayInfo, relay_info
from torchtop.monitor.link.targets import Endpoint, TargetError

LIST_TIMEOUT_S = 20.0
MAX_STORE_HOSTS = 1024  # hosts a store may send this monitor to (over ssh or TCP)
MAX_NODE_HOSTS = 4  # a node's registrations naming different hosts: at most this many tried


def remote_relays(target: str, options: Sequence[str] = ()) -> list[RelayInfo]:
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
    out: list[RelayInfo] = []
    for r in relays[:64]:  # a node runs one relay per job
        try:
            info = relay_info(r) if isinstance(r, dict) else None
        except ValueError:
            continue
        if info is not None:
            info.ssh = target  # learned over ssh: this host's own listing
            out.append(info)
    return out


def relays_from_store(
    store: tuple[str, int], job: str | None, notes: list[str] | None = None
) -> tuple[str, list[str]]:
    """(the job's id, a target for each of its nodes) from the relays registered in its store;
    `job`: its id or a prefix, needed only when the store holds several. What is not taken as
    the store gives it (a node registered twice, lines that are no relay's, hosts past the cap)
    is said in `notes`."""
    from torchtop.monitor.link.store import StoreError, read_jobs, read_relays

    where = f"{store[0]}:{store[1]}"
    try:
        jobs = read_jobs(store[0], store[1])
        found = [j for j in jobs if j.startswith(job)] if job else jobs
        if len(found) != 1:
            listing = ", ".join(j[:80] for j in jobs[:20]) or "none"
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
        reg = read_relays(store[0], store[1], job_id)
    except StoreError as exc:
        raise TargetError(str(exc)) from None
    said = notes if notes is not None else []
    if reg.skipped:
        said.append(
            f"the store at {where}: {reg.skipped} line{'s' if reg.skipped != 1 else ''} of job {job_id}'s "
            f"relays not a relay's entry, left out ({reg.reasons[0] if reg.reasons else 'past the limit'})"
        )
    if not reg.entries:
        raise TargetError(
            f"no relay of job {job_id} registered in its store at {where} (relays start with "
            "the ranks' agents unless TORCHTOP_RELAY=0): name the nodes instead (ssh://host ..., --hosts FILE)"
        )
    return job_id, node_targets(reg.entries, said)


def node_targets(entries: list[RelayInfo], notes: list[str]) -> list[str]:
    """A target for each node of these registrations (in the store's order), conflicts said."""
    by_node: dict[str, list[RelayInfo]] = {}
    for e in entries:
        regs = by_node.setdefault(e.node, [])
        if e not in regs:
            regs.append(e)
    out: list[str] = []
    unreached: list[str] = []
    for node, regs in by_node.items():
        direct = [t for t in map(direct_target, regs) if t is not None]
        hosts = list(dict.fromkeys(f"ssh://{e.reach}" for e in regs if e.reach))
        chosen = direct[-1:] or hosts[:MAX_NODE_HOSTS]  # a known key's latest: a relay that restarted
        claims = len(dict.fromkeys((e.reach, e.server_key) for e in regs))  # a restart: the same again
        if claims > 1:
            how = (
                "using the one whose key is known"
                if direct
                else f"none with a known server key: over ssh to {', '.join(h[6:] for h in chosen)}"
            )
            notes.append(f"{node[:80]}: {claims} relay registrations; {how}")
        if not chosen:
            unreached.append(node)
        for t in chosen:
            if t in out:
                continue
            if len(out) >= MAX_STORE_HOSTS:
                unreached.append(node)
                break
            out.append(t)
    if unreached:
        names = ", ".join(n[:40] for n in unreached[:8]) + (
            f" and {len(unreached) - 8:,} more" if len(unreached) > 8 else ""
        )
        notes.append(
            f"{len(unreached):,} node{'s' if len(unreached) != 1 else ''} of the store not reached "
            f"(at most {MAX_STORE_HOSTS:,} hosts from a store; name them with --hosts FILE): {names}"
        )
    return out


DIRECT = "relay+"  # a relay reached over TCP with CURVE: relay+<its 40-character public key><tcp://host:port>


def direct_target(entry: RelayInfo) -> str | None:
    """A relay on TCP (CURVE) that this monitor reaches directly: its server key is one the user's
    own keys directory holds (curve_keys.known_server_keys: never a key only the store gives)
    and this monitor has a client key (`torchtop keys`); None: through ssh. Opt out with
    TORCHTOP_RELAY_SSH=1."""
    from torchtop.contract import curve_keys

    address, server_key = entry.tcp_address, entry.server_key
    if os.environ.get("TORCHTOP_RELAY_SSH") == "1" or address is None or server_key is None:
        return None
    if len(server_key) != curve_keys.Z85_KEY_LEN or not address.startswith("tcp://"):
        return None
    if server_key not in curve_keys.known_server_keys():
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
