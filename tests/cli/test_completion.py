"""Shell completion for ``llmgw`` (typer's): shown, installed, and completing in a real bash.

Each command runs under ``sh``, as make and provisioning scripts run it: typer's own
``--show-completion`` would detect that shell and refuse it, the named shell must win.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LLMGW = Path(sys.executable).with_name("llmgw")


def run(*argv: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(["sh", "-c", '"$0" "$@"', *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_bash_completes_commands_and_options_from_the_shown_script(tmp_path: Path) -> None:
    script = run(str(LLMGW), "completion", "bash")
    assert "_LLMGW_COMPLETE=complete_bash" in script
    assert script.strip().endswith("complete -o default -F _llmgw_completion llmgw")
    (tmp_path / "llmgw-completion.sh").write_text(script)
    # What bash does on TAB after `llmgw ctl us`, with the script sourced.
    completed = run("bash", "--norc", "-c", (
        f"source {tmp_path / 'llmgw-completion.sh'}; COMP_WORDS=(llmgw ctl us); COMP_CWORD=2; "
        '_llmgw_completion llmgw; printf "%s\\n" "${COMPREPLY[@]}"'),
        env={"PATH": f"{LLMGW.parent}:{os.environ['PATH']}"})
    assert completed.split() == ["usage"]


def test_install_completion_writes_the_script_and_sources_it(tmp_path: Path) -> None:
    out = run(str(LLMGW), "completion", "bash", "--install",
              env={"HOME": str(tmp_path), "SHELL": "/bin/bash"})
    installed = tmp_path / ".bash_completions" / "llmgw.sh"
    assert str(installed) in out
    assert "_llmgw_completion" in installed.read_text()
    assert f"source '{installed}'" in (tmp_path / ".bashrc").read_text()
