"""The thin Click layer: parse options, call one stage, render its section.

Each command maps DfbuildError to its documented exit code (see errors.py and
README.md); everything below this layer raises, never exits.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from . import __version__, errors, ui


def handle_errors(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except errors.DfbuildError as exc:
            ui.console.print(f"[red]error:[/red] {exc.message}")
            if exc.hint:
                ui.console.print(f"  [dim]hint:[/dim] {exc.hint}")
            sys.exit(exc.exit_code)

    return wrapper


json_option = click.option("--json", "as_json", is_flag=True, help="Print the manifest section as JSON on stdout.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dfbuild")
def main() -> None:
    """Turn a llama.cpp PR head into fixed, tested, releasable DFlash binaries.

    Pipeline: checkout -> apply (patch series) -> build -> smoke -> release.
    """


# --- source -------------------------------------------------------------------

# --- series -------------------------------------------------------------------

# --- build --------------------------------------------------------------------

# --- fixtures & smoke ---------------------------------------------------------

# --- release ------------------------------------------------------------------

# --- matrix -------------------------------------------------------------------


if __name__ == "__main__":  # pragma: no cover
    main()
