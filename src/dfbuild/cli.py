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

def source_options(func):
    """--base/--pr/--repo/--dir/--force, shared by every command that starts from a checkout."""
    for option in reversed([
        click.option("--base", required=True, help="Base revision: a known base (5ecbe1a, b10359, b11312) or any rev with --repo."),
        click.option("--pr", type=int, default=None, help="Pull request whose refs/pull/N/head must contain the base."),
        click.option("--repo", default=None, help="Repository URL or path (default: implied by a known base)."),
        click.option("--dir", "dest", type=click.Path(path_type=Path), default=None,
                     help="Working tree to create or reuse (default: ./llama.cpp-BASE)."),
        click.option("--force", is_flag=True, help="Reuse a DIR with local changes after stashing them."),
    ]):
        func = option(func)
    return func


@main.command()
@source_options
@json_option
@handle_errors
def checkout(base, pr, repo, dest, force, as_json):
    """Check out llama.cpp at a PR head or commit."""
    from . import manifest, source

    with ui.step(f"checkout {base}"):
        section = source.checkout(base, pr=pr, repo=repo, dest=dest, force=force)
    manifest.update_tree_manifest(Path(section["dir"]), "source", section)
    if as_json:
        ui.emit_json(section)
    else:
        ui.info(f"{section['dir']}: {section['commit']} on branch {section['branch']}")


@main.command("import")
@click.argument("archive", type=click.Path(path_type=Path))
@click.option("--tag", required=True, help="Tag (base name) to give the imported commit, e.g. b10359.")
@click.option("--dir", "dest", type=click.Path(path_type=Path), default=None,
              help="Directory to create (default: ./llama.cpp-TAG).")
@json_option
@handle_errors
def import_(archive, tag, dest, as_json):
    """Import a llama.cpp tree from a .tar.gz/.zip or a PyPI sdist that vendors one."""
    from . import manifest, source

    with ui.step(f"import {archive}"):
        section = source.import_archive(archive, tag, dest or Path.cwd() / f"llama.cpp-{tag}")
    manifest.update_tree_manifest(Path(section["dir"]), "source", section)
    if as_json:
        ui.emit_json(section)
    else:
        ui.info(f"{section['dir']}: {section['commit']} tagged {tag}")


# --- series -------------------------------------------------------------------

# --- build --------------------------------------------------------------------

# --- fixtures & smoke ---------------------------------------------------------

# --- release ------------------------------------------------------------------

# --- matrix -------------------------------------------------------------------


if __name__ == "__main__":  # pragma: no cover
    main()
