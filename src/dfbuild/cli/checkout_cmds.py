"""checkout, import and apply: a llama.cpp tree, and the series on it."""

from __future__ import annotations

from pathlib import Path

import click

from dfbuild.cli.app import main
from dfbuild.cli.common import (
    _default_dir_here,
    _locks,
    _render_concerns,
    default_tree_here,
    removed_if_left_empty_handed,
    shown,
)
from dfbuild.cli.exits import handle_errors
from dfbuild.cli.options import _utf8_path, json_option_for, no_wait_option, patches_option, source_options
from dfbuild.core import ui


@main.command()
@source_options
@no_wait_option
@json_option_for("the source section (commit, branch, dir)")
@handle_errors
def checkout(base, pr, repo, dest, force, no_wait, as_json):
    """Check out llama.cpp at a PR head or commit."""
    from dfbuild.core import manifest
    from dfbuild.series import curate
    from dfbuild.source import checkout as source

    source.check_known(base, repo)
    dest = dest or default_tree_here(base)
    with _made_by_this_run(dest), _locks(("tree", dest), no_wait=no_wait):
        curate.refuse_while_curating(dest, "checkout")
        with ui.step(f"checkout {base}"):
            section = source.checkout(base, pr=pr, repo=repo, dest=dest, force=force)
        manifest.update_tree_manifest(Path(section["dir"]), "source", section)
    if as_json:
        ui.emit_json(section)
    else:
        ui.result(f"{section['dir']}: {section['commit']} on branch {section['branch']}")


@main.command("import")
@click.argument("archive", type=click.Path(path_type=Path))
@click.option("--tag", required=True,
              help="Tag (base name) to give the imported commit, e.g. the release it is, bNNNNN.")
@click.option("--dir", "dest", type=click.Path(path_type=Path), default=None, callback=_utf8_path,
              help="Directory to create (default: ./llama.cpp-TAG).")
@click.option("--max-unpacked-size", "max_unpacked", default=None, metavar="SIZE",
              help="Raise the cap on the archive's unpacked size (default 4G, and 100x the archive), e.g. 16G.")
@no_wait_option
@json_option_for("the source section (commit, tag, dir)")
@handle_errors
def import_(archive, tag, dest, max_unpacked, no_wait, as_json):
    """Import a llama.cpp tree from a .tar.gz/.zip or a PyPI sdist that vendors one."""
    from dfbuild.source import checkout as source

    source.check_tag_name(tag)  # before the name makes a path: '..' may not leave the current dir
    limits = source.Limits.raised_to(source.parse_size(max_unpacked) if max_unpacked else None)
    dest = dest or _default_dir_here(tag.replace("/", "-"))
    with _locks(("tree", dest), no_wait=no_wait), ui.step(f"import {archive}"):
        section = source.import_archive(archive, tag, dest, limits=limits)
    if as_json:
        ui.emit_json(section)
    else:
        ui.result(f"{section['dir']}: {section['commit']} tagged {tag}")



@main.command()
@source_options
@patches_option
@click.option("--skip", "skip", multiple=True, help="Leave a concern out (for ablation experiments).")
@no_wait_option
@json_option_for("the source and series sections (proven, concerns, head)")
@handle_errors
def apply(base, pr, repo, dest, force, patches_dir, skip, no_wait, as_json):
    """Check out BASE, then apply the curated DFlash patch series."""
    from dfbuild import series
    from dfbuild.core import manifest, state
    from dfbuild.series import curate
    from dfbuild.source import checkout as source

    curated = series.load_series(patches_dir)
    series.check_skip(curated, tuple(skip))
    source.check_known(base, repo)
    dest = dest or default_tree_here(base)
    # one lock for checkout + apply + record: a second run waits, and never sees a half-applied tree
    with _made_by_this_run(dest), _locks(("tree", dest), no_wait=no_wait):
        curate.refuse_while_curating(dest, "apply")
        with ui.step(f"checkout {base}"):
            src = source.checkout(base, pr=pr, repo=repo, dest=dest, force=force, keep_descendants=True)
        tree = Path(src["dir"])
        manifest.update_tree_manifest(tree, "source", src)
        state.fault_point("apply: checked out")
        with ui.step("apply the patch series"):
            section = series.apply_series(curated, tree, skip=tuple(skip))
        full = manifest.update_tree_manifest(tree, "series", section)
        state.fault_point("apply: recorded")
    if as_json:
        ui.emit_json({"source": full["source"], "series": section})
        return
    _render_concerns(section["concerns"])
    if section["changed"]:
        ui.result(f"{tree}: patched commit {section['head']}")
    else:
        ui.result(f"{tree}: nothing to do, the series is already applied ({section['head']})")
    if section.get("derived") and section.get("proven"):
        recorded = section.get("recorded_proof") or {}
        ui.result(f"{section['base']}: carried {series.carried_from(section['concerns'])}; proven "
                  f"{recorded.get('outcome')} ({recorded.get('recorded_in')} records its proof)")
    elif section.get("derived") and section.get("stale_proof"):
        ui.warn(f"{section['base']}: carried {series.carried_from(section['concerns'])}; the proof "
                f"{section['stale_proof'].get('recorded_in')} records for it ran an earlier form of the "
                "variant's code, so it is unproven until `dfbuild prove` (or `dfbuild release`) has smoked both trees")
    elif section.get("derived"):
        ui.warn(f"{section['base']} is a base the series has no variant for: it was carried "
                f"{series.carried_from(section['concerns'])} and is unproven until `dfbuild prove` "
                "(or `dfbuild release`) has smoked both trees")
    ui.next_step(f"dfbuild build --dir {shown(tree)} --backend cpu")


def _made_by_this_run(dest: Path):
    """The work dir (./dfbuild-BASE) or DIR this run makes goes again if it fails before the checkout."""
    dest = Path(dest).absolute()
    top = dest.parent if dest.name == "src" and dest.parent.name.startswith("dfbuild-") else dest
    return removed_if_left_empty_handed(top, lambda: (dest / ".git").exists())
