"""``llmgw completion SHELL``: the completion script for a named shell.

typer's own ``--show-completion`` and ``--install-completion`` ask the process
tree which shell they run under and ignore a shell named after them, so from a
Dockerfile, a provisioning script or make (all ``sh``) they fail with "Shell sh
not supported". Naming the shell is what those callers need.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

# typer.completion imports these without exporting them; this is where they live.
from typer._completion_shared import get_completion_script, install

PROG = "llmgw"
# typer's name for the variable the script sets when it asks llmgw to complete.
COMPLETE_VAR = "_LLMGW_COMPLETE"


class Shell(StrEnum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"
    powershell = "powershell"
    pwsh = "pwsh"


def completion(
    shell: Annotated[Shell, typer.Argument(help="The shell to complete in.")],
    install_it: Annotated[bool, typer.Option(
        "--install", help="Write the script where the shell loads it (bash: ~/.bash_completions/"
        "llmgw.sh, sourced from ~/.bashrc) instead of printing it.")] = False,
) -> None:
    """Print (or --install) the shell completion script for SHELL."""
    if install_it:
        _, path = install(shell=shell.value, prog_name=PROG, complete_var=COMPLETE_VAR)
        typer.echo(f"{shell.value} completion installed in {path}; open a new shell to use it")
        return
    typer.echo(get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR,
                                     shell=shell.value))
