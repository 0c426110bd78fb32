"""Odd input on the command line (issue 26, item 6): one line that says what is wrong, exit 2,
never a traceback; an ssh destination never read as an option; host lists capped."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from torchtop.monitor.commands.cli import main
from torchtop.monitor.link import hosts, ssh
from torchtop.monitor.link.targets import TargetError


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's own errors
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


ODD = [
    ("report", "²"),
    ("report", "ünï:80"),
    ("report", "127.0.0.1:" + "9" * 5000),
    ("report", "h" * 100_000 + ":80"),
    ("report", "ssh://" + "h" * 5000),
    ("report", "9" * 40),
    ("report", "--hosts", "hosts\0file"),
    ("report", "--hosts", "/dev/zero"),
    ("report", "--slurm", ",".join(f"n{k}[1-9999]" for k in range(10))),
    ("report", "--seconds", "nan"),
    ("report", "--seconds", "inf"),
    ("report", "--seconds", "-1"),
    ("export", "--prometheus", ":99999", "--seconds", "1"),
    ("export", "--prometheus", "9" * 5000),
    ("export", "--seconds", "nan"),
    ("export", "--window", "nan"),
    ("capture", "--seconds", "nan"),
    ("replay", "--speed", "nan", "x.ttrec"),
    ("trace", "-o", "/nonexistent/x.json", "x.ttrec"),
    ("report", "ssh://-oProxyCommand=touch%20/tmp/pwned"),
    ("ls", "ssh://-oProxyCommand=x"),
    ("report", "ssh://-l@host"),
    ("report", "ssh://user@-host"),
    ("report", "ssh://host/²"),
]


@pytest.mark.parametrize("argv", ODD, ids=[" ".join(a)[:40] for a in ODD])
def test_odd_arguments_get_one_line_and_exit_2(argv: tuple[str, ...]) -> None:
    code, out, err = _cli(*argv)
    assert code == 2, (code, err)
    assert "Traceback" not in err and out == ""
    assert err.count("\n") == 1 and len(err) < 400, err


def test_hosts_file_with_binary_data_and_too_many_hosts(tmp_path: Path) -> None:
    binary = tmp_path / "hosts"
    binary.write_bytes(b"node1\nno\x00de2\n")
    with pytest.raises(TargetError, match="line 2"):
        hosts.read_hosts_file(str(binary))
    many = tmp_path / "many"
    many.write_text("".join(f"node{k}\n" for k in range(hosts.MAX_HOSTS + 1)))
    with pytest.raises(TargetError, match="over 1024 hosts"):
        hosts.read_hosts_file(str(many))
    with pytest.raises(TargetError, match="over 1024 hosts"):
        hosts.expand_nodelist("a[1-600],b[1-600]")
    assert len(hosts.expand_nodelist("a[1-512],b[1-512]")) == 1024


def test_replay_at_nan_is_not_a_time() -> None:
    from torchtop.monitor.model.playback import parse_when

    for text in ("nan", "inf", "-inf", "1e400", "nan:00"):
        with pytest.raises(ValueError):
            parse_when(text)
    assert parse_when("1:30") == 90.0


def test_the_ssh_destination_comes_after_a_double_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_run(cmd, **kw):  # type: ignore[no-untyped-def]
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "[]", "")

    monkeypatch.setattr(ssh.subprocess, "run", fake_run)
    monkeypatch.setattr(ssh.shutil, "which", lambda name: "/usr/bin/ssh")
    assert ssh.remote_agents(ssh.parse("ssh://me@node-1.lab:2222")) == []
    (cmd,) = seen
    assert cmd[cmd.index("--") + 1 :] == ["me@node-1.lab", "torchtop ls --json"]


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path) -> None:
    """Issue 39: `torchtop ls | head` ended in a BrokenPipeError traceback. The pipe's reader is
    gone before the command writes: no traceback, the exit status of a program SIGPIPE ended."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, TORCHTOP_RUNTIME_DIR=str(runtime))
    cmd = [sys.executable, "-m", "torchtop.monitor.commands.cli", "ls"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # `head` has read what it wanted
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and err == "", err
