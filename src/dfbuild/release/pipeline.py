"""Stage 5, release: the whole pipeline in one command, and its artifacts.

`release()` runs checkout -> apply -> build -> smoke -> package and stops at the
first failing stage with that stage's own error. A rerun resumes: checkout keeps
the applied series, apply and ninja are no-ops, a smoke result is reused when
the shipped files (binaries *and* libraries: the fix lives in
libllama-common) and the fixtures are unchanged, and the artifacts are rewritten
only when what goes into them changed. What each stage recorded is kept in
WORK/release-<backend>.json, so an unchanged stage also keeps its manifest
section, and the archive (whose manifest.json holds those sections) stays
byte-identical.

Artifacts in OUT:
- llama-<tag>-bin-<os>[-<backend>]-<arch>.tar.gz (.zip on Windows), llama.cpp's
  own name and layout (as the base's .github/workflows/release.yml packs it): a
  tarball rooted at llama-<tag>/, a flat zip, with every program and shared
  library of the build at the top ($ORIGIN rpath), and beside them LICENSE,
  licenses/, patches/ (the applied patches and series.toml), manifest.json and
  (Linux) REQUIRES.txt. <tag> is `<base>-dflash-<series hash>`, e.g.
  b11434-dflash-e8448d4a: the llama.cpp base, the marker, and the first 8 hex
  of a hash over the series as applied to it.
- beside a CUDA archive, the CUDA runtime: cudart-llama-<tag>-bin-ubuntu-cuda-
  <x.y>-<arch>.tar.gz on Linux, cudart-llama-bin-win-cuda-<x.y>-<arch>.zip on
  Windows, as llama.cpp ships them.
- llama_dflash-0.0.<build>+dflash.<series hash>.<backend>-py3-none-<platform>.whl,
  built through builder/ (scikit-build-core): `pip install` gives `llama-server`.
- SHA256SUMS (sha256sum -c format) over the archives and wheels in OUT.
- manifest.json: source, series, build, smoke, request, release (artifacts with
  sha256 and size, per-stage wall times).

Archives are reproducible (archive.py writes them): sorted entries, one mtime
(SOURCE_DATE_EPOCH, else the patched commit's date), uid/gid 0 with no names,
fixed modes, and a gzip header with mtime 0 and no file name. verify.py checks
an OUT directory before it is published.

This module is the pipeline; the jobs it runs have their own: release_record
(names, versions, SHA256SUMS, the portable sections, the stage record),
wheel_build (the wheel), cudart (the CUDA runtime archives), release_package
(the payload, its layout, and package()). Callers import the stage's names from
here.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from dfbuild import series, smoke
from dfbuild.build import tree as build
from dfbuild.build.request import BuildRequest
from dfbuild.core import manifest, owned, paths, ui
from dfbuild.core.errors import ReleaseError, SmokeFailedError, StillBrokenError
from dfbuild.core.state import fault_point  # (package()'s `state` is the release's record, not this module)
from dfbuild.host import backends
from dfbuild.release import prove
from dfbuild.release.cudart import CUDA_NOTICE, cuda_runtime_libraries, cuda_toolkit_root, cudart_bundle, cudart_linux
from dfbuild.release.package import archive_layout, collect_payload, package, runtime_requirements, source_date_epoch
from dfbuild.release.record import (
    MANIFEST_NAME,
    OWN_FILES,
    REQUIRES_NAME,
    SUMS_NAME,
    TAG_MARKER,
    WHEEL_DIST,
    _digest,
    _State,
    parse_wheel_name,
    payload_records,
    portable,
    read_sha256sums,
    release_files,
    release_tag,
    series_hash,
    toolkit_version,
    wheel_package,
    wheel_version,
    write_sha256sums,
)
from dfbuild.release.wheel import (
    build_wheel,
    builder_dir,
    bundle_system_libraries,
    check_wheel_tools,
    repair_wheel,
    stage_wheel_bin,
)
from dfbuild.series import carry
from dfbuild.smoke import fixtures
from dfbuild.source import checkout as source

STAGES = ("checkout", "apply", "build", "smoke", "package")


RELEASE_TARGETS = (build.ALL_TARGETS,)  # what a release builds and ships: every tool, as llama.cpp's archives


def default_work_dir(base: str) -> Path:
    return paths.default_work_dir(base)


def run_smoke_stage(build_dir: Path, fixtures_dir: Path, log_dir: Path,
                    backend: backends.Backend | str = "cpu", plan: smoke.Plan | None = None) -> dict:
    """The smoke stage as release runs it (one place, so tests can stand in for it).

    PLAN (smoke.plan) says which table, timeout and identity rule; the backend's defaults without it.
    """
    how = backends.resolve(backend)
    plan = plan or smoke.plan(how, build_dir)

    def progress(result: dict) -> None:
        verdict = "[green]pass[/green]" if result.get("passed") else "[red]FAIL[/red]"
        ui.info(f"    {result.get('scenario')} / {result.get('set')}: {verdict}")

    return smoke.run_smoke(build_dir, fixtures_dir, log_dir=log_dir, on_result=progress, **plan.run_kwargs())


def _say_plan(plan: smoke.Plan) -> None:
    if plan.note:
        ui.warn(plan.note)
    ui.info(f"    smoke runs on: {plan.ran_on}")
    if plan.table == "software":
        ui.info(f"    software device ({plan.device}): the software smoke table, "
                f"{len(plan.sets)} sets x {len(plan.scenarios)} scenarios (--smoke-table full runs all)")


@contextmanager
def _timed(stages: dict, name: str, title: str):
    record: dict[str, float | bool | None] = {"wall_s": None, "reused": False}
    stages[name] = record
    start = time.monotonic()
    with ui.step(title):
        yield record
    record["wall_s"] = round(time.monotonic() - start, 2)


def release(base: str, *, request: BuildRequest, pr: int | None = None, repo: str | None = None,
            out: Path | None = None, work: Path | None = None, skip_smoke: bool = False,
            patches_dir: Path | None = None, reprove: bool = False) -> dict:
    """checkout -> apply -> build -> smoke -> package; returns the full manifest (also OUT/manifest.json).

    The request's TARGETS: the CLI asks for every tool unless --target says otherwise (RELEASE_TARGETS:
    `all`, as llama.cpp's release workflow builds); a proof the release needs builds llama-server only
    (the smoke runs it) and the build stage then adds the rest to the same build dir.

    A carried base whose proof series.toml records is not proven again unless REPROVE.

    REQUEST (the CLI makes it once) says what to build and how to smoke it, for the proof as for
    the build and smoke stages; llama-server is added to its targets (the smoke and the wheel need it).
    The manifest records it (request), as the stages' sections. The returned and written manifest holds
    the portable() sections: no path of this machine; the work dir keeps the full ones.
    """
    base = source.canonical_base(base, quiet=True, repo=repo)  # b10359 is pydist-0.94.0's tree (the CLI says so)
    spec = request.spec
    backend = spec.name
    check_wheel_tools()
    if build.ALL_TARGETS not in request.targets and "llama-server" not in request.targets:
        request = request.with_targets(["llama-server", *request.targets])  # the smoke stage and the wheel need it
    work = Path(work or default_work_dir(base)).resolve()
    out = Path(out or Path.cwd() / "dist").resolve()
    owned.check(out, [SUMS_NAME, MANIFEST_NAME], ReleaseError, legacy=release_files)  # fail before building
    work.mkdir(parents=True, exist_ok=True)
    tree = work / "src"
    # build-cpu, or build-cpu-windows for a cross build (--os windows): one work dir holds both
    label = build.dir_label(backend, request.cross_host)
    build_dir = work / f"build-{label}"
    stages: dict[str, dict] = {}

    with paths.locked(work / f"release-{label}"):
        state = _State(work / f"release-{label}.json")

        with _timed(stages, "checkout", f"checkout {base}"):
            src = source.checkout(base, pr=pr, repo=repo, dest=tree, keep_descendants=True)
            tree = Path(src["dir"])
            manifest.update_tree_manifest(tree, "source", src)
            manifest.update_tree_manifest(tree, "request", request.to_dict())

        with _timed(stages, "apply", "apply the patch series") as record:
            curated = series.load_series(patches_dir)
            applied = series.apply_series(curated, tree)
            record["reused"] = not applied.get("changed", True)
            # what series.toml records of this code's proof is part of the record: a new proof is not a no-op
            ser, _ = state.reuse("series", _digest([applied["head"], applied.get("recorded_proof"),
                                                    applied.get("stale_proof")]), applied)
            manifest.update_tree_manifest(tree, "series", ser)

        proof = None
        if ser.get("derived") and ser.get("proven") and not reprove:
            # series.toml records a proof of this release (as `series epochs` says): it is not proven again
            recorded = ser.get("recorded_proof") or {}
            ui.info(f"    {base}: proven {recorded.get('outcome')} by the proof recorded in "
                    f"{recorded.get('recorded_in')} ({recorded.get('when') or 'date unrecorded'}); "
                    "--reprove proves it again")
        elif ser.get("derived"):
            # a base the series was carried to: behaviour decides what is released (prove.py)
            if skip_smoke:
                raise ReleaseError(f"{base}: the series was carried to this base and is unproven, so it cannot be "
                                   "released without smoke tests", "drop --skip-smoke")
            with _timed(stages, "prove", "prove the carried series: build and smoke it unpatched and patched"):
                proof = prove.prove(base, request=request.with_targets(_proof_targets(list(request.targets))),
                                    work=work, repo=repo, pr=pr, patches_dir=patches_dir)
            build_dir, ser = _proven_release(proof, ser, work, label)
        # fixed upstream: the release is the unpatched binaries the proof kept, not the tree's HEAD
        as_is = build_dir == prove.unpatched_dir(work, label)

        with _timed(stages, "build", f"build {backend}") as record:
            if as_is:  # the proof's copy, or the base built again in the tree's build dir when it is gone
                built = prove.build_unpatched(tree, request, work, ser["head"])
                record["reused"] = bool(built.pop("reused", False))
            else:
                built = build.build_tree(tree, request, build_dir)
                record["reused"] = bool(built.get("up_to_date"))
            shipped = build.payload_digest(built)
            bld, _ = state.reuse("build", _digest([shipped, built.get("flags"), built.get("source_commit")]), built)
            if not as_is:  # the tree's own record describes its HEAD, the patched commit
                manifest.update_tree_manifest(tree, "build", bld)
        state.save()

        with _timed(stages, "smoke", "smoke tests" + (" (skipped: --skip-smoke)" if skip_smoke else "")) as record:
            if skip_smoke:
                ui.warn("--skip-smoke: this release is NOT smoke-tested; the manifest says so")
                smk: dict = {"skipped": True}
            else:
                fixtures_dir = work / "fixtures"
                fx = fixtures.ensure_fixtures(fixtures_dir)
                # which table (a software Vulkan device runs the smaller one), timeout and identity rule
                plan = smoke.plan(spec, build_dir, request.smoke,
                                  release=carry.tree_build(tree, series.series_start(tree)))
                _say_plan(plan)
                key = plan.memo_key(build.smoke_digest(built), fx)  # what the smoke runs: llama-server, libraries
                passed = state.cached("smoke", key)
                if passed is None:
                    # a proof of these very binaries, or a release of them from another work folder
                    passed = smoke.recall(key)
                    if passed is not None:
                        state.store("smoke", key, passed)
                record["reused"] = passed is not None
                if passed is not None:
                    smk = passed
                    ui.info("    binaries and fixtures already passed smoke: reusing that result")
                else:
                    smk = run_smoke_stage(build_dir, fixtures_dir, work / f"smoke-{label}", spec, plan)
                    if not smk.get("passed"):
                        failed = smk.get("failed") or ["?"]
                        raise SmokeFailedError(
                            f"smoke failed on {len(failed)} scenario(s): {', '.join(failed[:5])}",
                            f"logs in {smk.get('log_dir')}; rerun after fixing, or --skip-smoke (recorded) to package "
                            "anyway")
                    smoke.remember(key, smk)
                    state.store("smoke", key, smk)
            if not as_is:
                manifest.update_tree_manifest(tree, "smoke", smk)
        state.save()

        with _timed(stages, "package", f"package into {out}") as record:
            ser = series.released_form(ser)  # the tree's own manifest keeps how this run applied it
            rel = package({"source": src, "series": ser, "build": bld, "smoke": smk}, tree=tree,
                          patches_root=curated.root, out_dir=out, work_dir=work / f"package-{label}", state=state,
                          commit=ser.get("head") if as_is else None)
            record["reused"] = rel.pop("reused")
        state.save()

    rel["stages"] = stages
    full = {**{k: portable(v) for k, v in (("source", src), ("series", ser), ("build", bld), ("smoke", smk))},
            "request": portable(request.to_dict()), "release": rel}
    owned.claim(out, [MANIFEST_NAME], ReleaseError, legacy=release_files)
    fault_point("release: manifest.json claimed")
    manifest.save(full, out / MANIFEST_NAME)
    fault_point("release: manifest.json written")
    if not as_is:
        manifest.update_tree_manifest(tree, "release", rel)
    return full


def _proof_targets(targets: list[str]) -> list[str]:
    """What a release's proof builds: llama-server, which the smoke runs (and any other named target);
    `all` is left to the build stage, which adds every other tool to the proof's patched build dir."""
    named = [t for t in targets if t != build.ALL_TARGETS]
    return named if "llama-server" in named else ["llama-server", *named]


def _proven_release(proof: dict, ser: dict, work: Path, backend: str) -> tuple[Path, dict]:
    """What a proof lets `release` ship: (build dir, series section), or StillBrokenError.

    BACKEND is the build dirs' label (build.dir_label: cpu, cpu-windows).

    Both builds come from the one tree WORK/src (prove.py): fixed ships its build dir,
    fixed upstream the copy of the unpatched binaries (WORK/unpatched/build-<backend>).
    """
    outcome = proof["outcome"]
    # no proven_at: the summary goes into the archive's manifest, which must not depend on when or where
    # the proof ran (two work folders give byte-identical archives); WORK/proof-<backend>.json keeps the time
    summary = {k: proof.get(k) for k in ("outcome", "unpatched_commit", "patched_commit")}
    summary["unpatched_failed"] = len((proof.get("unpatched") or {}).get("failed", []))
    if outcome == "fixed":
        return work / f"build-{backend}", {**ser, "proven": True, "outcome": "fixed", "proof": summary}
    if outcome == "fixed-upstream":
        needless = proof.get("no_longer_needed", [])
        ui.warn(f"fixed upstream: the unpatched tree passes every scenario, so it is released as it is "
                f"(no longer needed: {', '.join(needless) or 'nothing'})")
        concerns = [{"id": c["id"], "status": "not-needed", "detail": "fixed upstream (proven by smoke)"}
                    for c in ser.get("concerns", [])]
        section = {"base": ser.get("base"), "derived": True, "proven": True, "outcome": "fixed-upstream",
                   "concerns": concerns, "head": proof["unpatched_commit"], "no_longer_needed": needless,
                   "proof": summary, "patches_dir": ser.get("patches_dir")}
        return prove.unpatched_dir(work, backend), section
    first = ((proof.get("patched") or {}).get("first_failure") or {})
    raise StillBrokenError(
        f"{proof['base']}: still broken with the series carried: {first.get('scenario', '?')} fails "
        f"({first.get('log_line') or 'see the log'}); nothing was released",
        f"logs in {(proof.get('patched') or {}).get('log_dir')}; the series needs a new variant for this base "
        "(dfbuild series refresh)")


# the stage's public names, those of the modules above included
__all__ = ["CUDA_NOTICE", "MANIFEST_NAME", "OWN_FILES", "RELEASE_TARGETS", "REQUIRES_NAME", "STAGES", "SUMS_NAME",
    "TAG_MARKER", "WHEEL_DIST", "archive_layout", "build_wheel", "builder_dir", "bundle_system_libraries",
    "check_wheel_tools", "collect_payload", "cuda_runtime_libraries", "cuda_toolkit_root", "cudart_bundle",
    "cudart_linux", "default_work_dir", "package", "parse_wheel_name", "payload_records", "portable",
    "read_sha256sums", "release", "release_files", "release_tag", "repair_wheel", "run_smoke_stage",
    "runtime_requirements", "series_hash", "source_date_epoch", "stage_wheel_bin", "toolkit_version", "wheel_package",
    "wheel_version", "write_sha256sums"]
