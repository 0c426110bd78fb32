#!/usr/bin/env bash
# Issue 27's renames, run once by the lead after every branch of the round is merged (no branch
# renames files itself, so the parallel work merges cleanly). One word for one thing:
#   - the four job.py, named by what they hold: the job's state (model), the link to its ranks
#     (link), its diagnosis and report (diagnosis), the command's job arguments (commands);
#   - bindings.py for the keyboard's keys, curve_keys.py for CURVE keys (the `keys` command keeps
#     its name: it is the command's);
#   - "playback" for a recording played back (tui/replay_app.py -> playback_app.py, ReplayApp ->
#     PlaybackApp); "replay" stays the log -> steps replay (model/replay.py). The `torchtop replay`
#     command and commands/replay.py keep the user's word;
#   - the contract's import name belongs to neither side: torchtop.agent.contract -> torchtop.contract
#     (the folder stays agent/contract: the top level is fixed; pyproject maps the name to it);
#   - and, as mechanical, THRESHOLDS a frozen dataclass (`T.input_high` for `T["input_high"]`).
# Then: `pip install -e .` again (the package map changed), ruff, the fast tests.
# Usage: bash RENAMES.sh   (from the repository root, on a clean tree; it commits nothing)
set -euo pipefail
cd "$(dirname "$0")"

if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    echo "RENAMES.sh: the tree has uncommitted changes; commit or stash them first" >&2
    exit 1
fi
if [ ! -f monitor/model/job.py ]; then
    echo "RENAMES.sh: monitor/model/job.py is gone: already run?" >&2
    exit 1
fi

# every text file git tracks where a module path or import name may be written
files() { git ls-files -- '*.py' '*.md' '*.toml' '*.json' '*.pth' '*.cfg' '*.txt' '*.tcss' '.ci/run' | grep -v '^RENAMES.sh$'; }
# sed -E over those files: one expression
rewrite() { files | xargs sed -i -E "$1"; }
# sed -E over the given files only
rewrite_in() { local expr="$1"; shift; sed -i -E "$expr" "$@"; }

# -- the four job.py ----------------------------------------------------------------------------
git mv monitor/model/job.py monitor/model/job_state.py
git mv monitor/link/job.py monitor/link/job_link.py
git mv monitor/diagnosis/job.py monitor/diagnosis/job_diagnosis.py
git mv monitor/commands/job.py monitor/commands/job_cli.py
rewrite 's/torchtop\.monitor\.model\.job\b/torchtop.monitor.model.job_state/g'
rewrite 's/torchtop\.monitor\.link\.job\b/torchtop.monitor.link.job_link/g'
rewrite 's/torchtop\.monitor\.diagnosis\.job\b/torchtop.monitor.diagnosis.job_diagnosis/g'
rewrite 's/torchtop\.monitor\.commands\.job\b/torchtop.monitor.commands.job_cli/g'
rewrite 's/from torchtop\.monitor\.commands import job as job_cli/from torchtop.monitor.commands import job_cli/g'
rewrite 's#monitor/model/job\.py#monitor/model/job_state.py#g; s#monitor/link/job\.py#monitor/link/job_link.py#g'
rewrite 's#monitor/diagnosis/job\.py#monitor/diagnosis/job_diagnosis.py#g; s#monitor/commands/job\.py#monitor/commands/job_cli.py#g'
rewrite 's#\(link/job\.py\)#(link/job_link.py)#g'

# -- keys: the keyboard's, and CURVE's ----------------------------------------------------------
git mv monitor/tui/keys.py monitor/tui/bindings.py
tui_keys=$(git grep -l -E 'from torchtop\.monitor\.tui import keys$' -- '*.py' || true)
rewrite 's/torchtop\.monitor\.tui\.keys\b/torchtop.monitor.tui.bindings/g'
if [ -n "$tui_keys" ]; then
    # shellcheck disable=SC2086
    rewrite_in 's/^from torchtop\.monitor\.tui import keys$/from torchtop.monitor.tui import bindings/; s/\bkeys\.(BINDINGS|Leaving|LeaveMode|QUIT_WORDS|help_rows|[A-Z_a-z]+)\b/bindings.\1/g' $tui_keys
fi
rewrite 's#monitor/tui/keys\.py#monitor/tui/bindings.py#g; s#\(keys\.help_rows#(bindings.help_rows#g'

git mv agent/contract/keys.py agent/contract/curve_keys.py
curve_users=$(git grep -l -E '^from torchtop\.agent\.contract import .*\bkeys\b' -- '*.py' || true)
rewrite 's/torchtop\.agent\.contract\.keys\b/torchtop.agent.contract.curve_keys/g'
if [ -n "$curve_users" ]; then
    # shellcheck disable=SC2086
    rewrite_in 's/^(from torchtop\.agent\.contract import .*)\bkeys\b/\1curve_keys/; s/\bkeys\.(py\b)/agent\/contract\/curve_keys.\1/g; s/\bkeys\.([A-Za-z_]+)/curve_keys.\1/g' $curve_users
fi
rewrite 's#agent/contract/keys\.py#agent/contract/curve_keys.py#g; s#discovery\.py, keys\.py#discovery.py, curve_keys.py#g; s#agent/agent/contract/curve_keys#agent/contract/curve_keys#g'

# -- playback: a recording played back ----------------------------------------------------------
git mv monitor/tui/replay_app.py monitor/tui/playback_app.py
rewrite 's/torchtop\.monitor\.tui\.replay_app\b/torchtop.monitor.tui.playback_app/g; s#monitor/tui/replay_app\.py#monitor/tui/playback_app.py#g'
rewrite 's/\bReplayApp\b/PlaybackApp/g'

# -- the contract's import name: torchtop.contract (folder agent/contract) -----------------------
rewrite 's/torchtop\.agent\.contract\b/torchtop.contract/g'
python3 - <<'EOF'
import re
from pathlib import Path

p = Path("pyproject.toml")
s = p.read_text()
s = s.replace('"torchtop.agent" = "agent", ', '"torchtop.agent" = "agent", "torchtop.contract" = "agent/contract", ')
s = s.replace('"torchtop.agent", "torchtop.contract", ', '"torchtop.agent", ')  # the sed above renamed it in `packages`
s = s.replace('  "torchtop.monitor", "torchtop.monitor.model"', '  "torchtop.contract",\n  "torchtop.monitor", "torchtop.monitor.model"')
p.write_text(s)

p = Path("CONTRIBUTING.md")  # the layout names modules in their folder's lines (tests/test_layout.py)
s = p.read_text()
for old, new in (
    ("job.py (JobState)", "job_state.py (JobState)"),
    ("a job: job.py (its diagnosis", "a job: job_diagnosis.py (its diagnosis"),
    ("job.py (JobLink)", "job_link.py (JobLink)"),
    ("job.py (a job's targets)", "job_cli.py (a job's targets)"),
    ("keys.py (key bindings)", "bindings.py (key bindings)"),
    ("replay_app.py (a recording", "playback_app.py (a recording"),
):
    if old in s:
        s = s.replace(old, new)
    else:
        print(f"RENAMES.sh: CONTRIBUTING.md's layout no longer says {old!r}: rename it there by hand")
link = 'for d in agent monitor demos; do ln -sfn "../../../$d" "build/typecheck/torchtop/$d"; done'
s = s.replace(link + "\n", link + "\nln -sfn ../../../agent/contract build/typecheck/torchtop/contract\n", 1)
p.write_text(s)

p = Path("pyrightconfig.json")
if p.exists():
    p.write_text(p.read_text().replace("build/typecheck/torchtop/agent/contract", "build/typecheck/torchtop/contract"))
p = Path(".ci/run")
s = p.read_text()
if "torchtop/contract" not in s:
    s = s.replace(
        'for d in agent monitor demos; do ln -sfn "../../../$d" "build/typecheck/torchtop/$d"; done\n',
        'for d in agent monitor demos; do ln -sfn "../../../$d" "build/typecheck/torchtop/$d"; done\n'
        'ln -sfn ../../../agent/contract build/typecheck/torchtop/contract\n',
    )
    p.write_text(s)
assert re.search(r'"torchtop\.contract" = "agent/contract"', Path("pyproject.toml").read_text())
EOF

# -- not a rename, as mechanical: THRESHOLDS becomes a frozen dataclass (attributes, typed) ----
# after the merge, so that every branch's new thresholds and T["..."] reads are converted too
python3 - <<'PY'
import re
from pathlib import Path

p = Path("monitor/diagnosis/facts.py")
s = p.read_text()
start = s.index("THRESHOLDS: dict[str, float] = {")
end = s.index("\n}\n", start) + 3
out = [
    "@dataclass(frozen=True)",
    "class Thresholds:",
    '    """Every threshold of the diagnosis (README, docs/verdicts.md): `THRESHOLDS.input_high`."""',
    "",
]
for line in s[start:end].splitlines()[1:-1]:
    m = re.match(r'\s*"(\w+)": (.*?),(\s*#.*)?$', line)
    out.append(f"    {m.group(1)}: float = {m.group(2)}{m.group(3) or ''}" if m else "    " + line.strip())
out += ["", "", "THRESHOLDS = Thresholds()"]
p.write_text(s[:start] + "\n".join(out) + "\n" + s[end:])
PY
rewrite "s/\\b(T|THRESHOLDS)\\[\"([a-z_0-9]+)\"\\]/\\1.\\2/g; s/\\b(T|THRESHOLDS)\\['([a-z_0-9]+)'\\]/\\1.\\2/g"
if git grep -n -E '\b(T|THRESHOLDS)\[' -- '*.py'; then
    echo "RENAMES.sh: the THRESHOLDS reads above are not by a literal key: convert them by hand (getattr)" >&2
fi

# the import blocks the renames unsorted
python3 -m ruff check --select I --fix -q . || true
python3 -m ruff format -q . || true

echo "RENAMES.sh: done. Now: pip install -e '.[tui,dev]' (the package map changed); ruff check . --fix;"
echo "ruff format .; python -m pytest -q -m 'not slow'; then commit."
