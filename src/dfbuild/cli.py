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

patches_option = click.option("--patches", "patches_dir", type=click.Path(path_type=Path), default=None,
                              help="Patches directory holding series.toml (default: the shipped series).")

STATUS_STYLE = {"clean": "green", "offset": "green", "applied": "cyan", "already-present": "cyan",
                "upstream": "blue", "skipped": "yellow", "conflict": "red", "no-variant": "red"}


def _render_concerns(rows: list[dict]) -> None:
    from rich.table import Table

    table = Table(show_header=True, header_style="bold")
    for column in ("concern", "status", "detail"):
        table.add_column(column)
    for row in rows:
        style = STATUS_STYLE.get(row["status"], "")
        table.add_row(row["id"], f"[{style}]{row['status']}[/{style}]", row.get("detail") or row.get("commit") or "")
    ui.console.print(table)


@main.command()
@source_options
@patches_option
@click.option("--skip", "skip", multiple=True, help="Leave a concern out (for ablation experiments).")
@json_option
@handle_errors
def apply(base, pr, repo, dest, force, patches_dir, skip, as_json):
    """Check out BASE, then apply the curated DFlash patch series."""
    from . import manifest, series, source

    curated = series.load_series(patches_dir)
    with ui.step(f"checkout {base}"):
        src = source.checkout(base, pr=pr, repo=repo, dest=dest, force=force, keep_descendants=True)
    tree = Path(src["dir"])
    manifest.update_tree_manifest(tree, "source", src)
    with ui.step("apply the patch series"):
        section = series.apply_series(curated, tree, skip=tuple(skip))
    full = manifest.update_tree_manifest(tree, "series", section)
    if as_json:
        ui.emit_json({"source": full["source"], "series": section})
        return
    _render_concerns(section["concerns"])
    if section["changed"]:
        ui.info(f"{tree}: patched commit {section['head']}")
    else:
        ui.info(f"{tree}: nothing to do, the series is already applied ({section['head']})")


@main.group("series")
def series_group():
    """Inspect and maintain the curated patch series."""


@series_group.command("list")
@patches_option
@json_option
@handle_errors
def series_list(patches_dir, as_json):
    """Show the concerns and their variants per base."""
    from . import series

    curated = series.load_series(patches_dir)
    data = {
        "bug": curated.bug,
        "bases": curated.bases,
        "concerns": [
            {"id": c.id, "title": c.title, "dep3": c.dep3,
             "variants": {b: {"status": v.status, "file": v.file, "sha256": v.sha256, "note": v.note}
                          for b, v in c.variants.items()}}
            for c in curated.concerns
        ],
    }
    if as_json:
        ui.emit_json(data)
        return
    for number, concern in enumerate(data["concerns"], 1):
        ui.info(f"[bold]{number}. {concern['id']}[/bold]: {concern['title']}")
        for base, variant in concern["variants"].items():
            ui.info(f"     {base:8} {variant['file'] or variant['status'] + ': ' + variant['note']}")


@series_group.command("check")
@click.option("--dir", "tree", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True)
@patches_option
@json_option
@handle_errors
def series_check(tree, patches_dir, as_json):
    """Report per concern: clean, offset, applied, upstream, conflict or no-variant. Changes nothing."""
    from . import series

    curated = series.load_series(patches_dir)
    base, steps = series.plan(curated, tree)
    rows = [s.to_dict() for s in steps]
    if as_json:
        ui.emit_json({"dir": str(tree), "base": base, "concerns": rows})
        return
    ui.info(f"{tree}: base {base or 'not recognised'}")
    _render_concerns(rows)


@series_group.command("refresh")
@click.option("--dir", "tree", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True,
              help="Checkout with one commit per concern (each with a Dfbuild-Concern trailer) on top of the base.")
@click.option("--onto", required=True, help="The base revision the concern commits sit on.")
@patches_option
@json_option
@handle_errors
def series_refresh(tree, onto, patches_dir, as_json):
    """(Maintainers) Regenerate a base's variants as format-patch files and update series.toml."""
    from . import series

    result = series.refresh(series.load_series(patches_dir), tree, onto)
    if as_json:
        ui.emit_json(result)
        return
    for variant in result["variants"]:
        ui.info(f"wrote {variant['file']} ({variant['sha256'][:12]})")

# --- build --------------------------------------------------------------------

# --- fixtures & smoke ---------------------------------------------------------

# --- release ------------------------------------------------------------------

# --- matrix -------------------------------------------------------------------


if __name__ == "__main__":  # pragma: no cover
    main()
