"""bases and cache: what the series knows and what is cached (tables on stdout, talk on stderr)."""

from __future__ import annotations

import click

from dfbuild.cli.app import main
from dfbuild.cli.exits import handle_errors
from dfbuild.cli.options import patches_option
from dfbuild.core import ui


def _table(rows: list[list[str]], header: list[str]) -> None:
    """Plain columns on stdout: no wrapping, no colour, one line per row (pipes and grep see whole lines)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        click.echo("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip())


@main.command()
@patches_option
@click.option("--json", "as_json", is_flag=True,
              help="Print every base (name, build, epoch, variant, proven and its proof, source, cached) as JSON.")
@handle_errors
def bases(patches_dir, as_json):
    """List the bases the series knows: epoch, variant, proof, cached.

    Per base: the epoch that holds it, the variant that serves it, the proof series.toml records,
    and whether its source is cached (it then checks out offline) or what it needs.

    Any other llama.cpp release works too, as --base bNNNN: the series is carried to it.
    """
    from dfbuild import series
    from dfbuild.series import bases as bases_stage

    curated = series.load_series(patches_dir)
    data = bases_stage.listing(curated)
    if as_json:
        ui.emit_json(data)
        return
    rows = []
    for base in data["bases"]:
        proof = base["proof"]
        proven = f"{proof['outcome']} ({proof.get('when') or 'when unrecorded'})" if proof else "no"
        rows.append([base["name"], base["epoch"] or "-", base["variant"] or "-", proven,
                     "yes" if base["cached"] else f"no: needs {base['network']}", base["source"]])
    _table(rows, ["base", "epoch", "variant", "proven", "cached", "source"])
    ui.info(f"proofs as recorded in {curated.record_name}; cache: {data['cache']}")
    ui.info(data["other_releases"])


@main.group("cache", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True,
              help="Print the cache dir, its total size and each kind's path, size and entries as JSON.")
@click.pass_context
@handle_errors
def cache_group(ctx, as_json):
    """Show the cache dir and its size by kind (clean: `cache clean`)."""
    if ctx.invoked_subcommand is not None:
        return
    from dfbuild.source import cache

    data = cache.show()
    if as_json:
        ui.emit_json(data)
        return
    click.echo(data["dir"])
    _table([[k["kind"], cache.human(k["bytes"]), str(k["entries"]), k["what"]] for k in data["kinds"]]
           + [["total", cache.human(data["bytes"]), "", ""]], ["kind", "size", "entries", "what"])
    if data["other"]:
        ui.warn(f"not dfbuild's, never cleaned: {', '.join(data['other'])}")


@cache_group.command("dir")
@handle_errors
def cache_dir_cmd():
    """Print the cache dir alone (for scripts: du -sh "$(dfbuild cache dir)")."""
    from dfbuild.core import paths

    click.echo(paths.cache_dir())


@cache_group.command("clean")
@click.option("--older-than", "older_than", type=click.FloatRange(min=0), default=None, metavar="DAYS",
              help="Only entries nothing changed for DAYS days.")
@click.option("--base", default=None,
              help="Only this base's source: its sdist and imported tree, e.g. b11434 (a git base: its URL's "
                   "cache repo).")
@click.option("--dry-run", "-n", "dry_run", is_flag=True, help="Say what would be removed; remove nothing.")
@click.option("--json", "as_json", is_flag=True,
              help="Print what was removed and skipped, and the bytes freed, as JSON.")
@handle_errors
def cache_clean(older_than, base, dry_run, as_json):
    """Remove what dfbuild cached: all, --older-than DAYS, or --base B.

    Entries a running dfbuild holds are skipped and named; lock files stay; anything in the
    cache dir that dfbuild did not make is left alone. A later checkout fetches again what it needs.
    """
    from dfbuild.source import cache

    report = cache.clean(older_than_days=older_than, base=base, dry_run=dry_run)
    if as_json:
        ui.emit_json(report)
        return
    for entry in report["removed"]:
        click.echo(f"{'would remove' if dry_run else 'removed'} {entry['path']} ({cache.human(entry['bytes'])})")
    for entry in report["skipped"]:
        ui.warn(f"kept {entry['path']}: {entry['why']}")
    verb = "would free" if dry_run else "freed"
    ui.info(f"{verb} {cache.human(report['freed'])} in {report['dir']} ({len(report['removed'])} entries"
            + (f", {len(report['skipped'])} kept in use" if report["skipped"] else "") + ")")
