"""The proof: behaviour, not text, decides what the series does for a base.

A textual check cannot say "fixed upstream": upstream may fix the bug in its
own words. So dfbuild builds the base twice, as it is and with the series
(carried or not), and runs the smoke scenarios on both:

- fixed:          the unpatched tree fails with the upstream symptom and the patched one passes;
- fixed-upstream: the unpatched tree already passes every scenario: the tree is released as it is,
                  and every concern the series would add is recorded as no longer needed;
- still-broken:   the patched tree fails: nothing is released; the first failing scenario and its
                  log line are named;
- not-applicable: the tree has no DFlash; nothing is applied or built;
- conflict:       the series cannot be carried to the tree (the concern and hunk are named).

Layout under WORK (the same as `dfbuild release`, so a release after a proof
reuses the build): ONE source tree, src, and its build dir build-<backend>.
The two trees differ only in common/speculative.cpp, so the proof does not
compile the world twice (without ccache, that was two cold builds):

1. src is put back on the base commit (`git checkout --detach`) and built in
   build-<backend>: the one cold build;
2. what smoke runs of it (llama-server and the shared libraries it loads, found
   through their $ORIGIN RUNPATH) is copied into unpatched/build-<backend>/bin,
   with a record of the commit it was built from and the build request; it is
   written beside and renamed into place, so an interrupted run leaves either
   no copy or a whole one, and only a build whose HEAD was the base (clean) is
   ever copied: a patched build is never labelled unpatched;
3. src goes back to the patched commit and build-<backend> is rebuilt
   incrementally: speculative.cpp and the version stamp (build-info.cpp)
   compile, the rest relinks (the stamp is split for this: build.py).

A rerun reuses the unpatched copy while its record matches (base commit,
backend, targets, build options) and its files are intact. A proof is recorded
in WORK/proof-<backend>.json under a key of both commits, the fixtures and the
scenarios, so a rerun recomputes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dfbuild import series, smoke
from dfbuild.build import tree as build
from dfbuild.build.request import BuildRequest
from dfbuild.core import gitrun, manifest, state, ui
from dfbuild.core.errors import BuildDirMismatchError, BuildError, FixtureError, NotApplicableError, PatchConflictError
from dfbuild.core.paths import sha256_file
from dfbuild.host.backends import machine_facts
from dfbuild.host.platforms import rocm_root
from dfbuild.series import carry
from dfbuild.smoke import fixtures
from dfbuild.source import checkout as source

OUTCOMES = ("fixed", "fixed-upstream", "still-broken", "not-applicable", "conflict")
UNPATCHED_RECORD = "dfbuild-unpatched.json"
# part of a proof's key: proofs made with the two-tree layout (WORK/unpatched/src built on its own) are
# redone once, so every record says how its builds went (proof["builds"])
LAYOUT = "one-tree"
def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def smoke_summary(section: dict) -> dict:
    """What the proof keeps of a smoke run: the verdict, the failures and the first failure's log line."""
    failed = section.get("failed", [])
    results = section.get("results", {})
    first = None
    symptom = False
    for name in failed:
        scenario, _, fixture_set = name.partition("/")
        result = results.get(scenario, {}).get(fixture_set, {})
        symptom = symptom or smoke.upstream_symptom(result) if result else symptom
        if first is None:
            line = next((f["text"] for f in result.get("log_findings", [])), None)
            first = {"scenario": name, "log_line": line or (result.get("failures") or [None])[0]}
    return {"passed": bool(section.get("passed")), "runs": sum(len(r) for r in results.values()),
            "failed": failed, "upstream_symptom": symptom, "first_failure": first,
            "wall_s": section.get("wall_s"), "log_dir": section.get("log_dir")}


# what a request's outcome is made of, for holding a patched run to the unpatched one
_SAME_KEYS = ("label", "status", "content", "draft_n", "draft_n_accepted")


def _differences(unpatched: dict, patched: dict) -> list[str]:
    """How PATCHED's run of a scenario differs from UNPATCHED's: request by request (status, output, draft
    counters), in what the draft proposed (the -v candidate lines) and in any zero-fill (unpatched has none)."""
    problems = []
    before, after = unpatched.get("requests", []), patched.get("requests", [])
    if len(before) != len(after):
        problems.append(f"{len(after)} requests, unpatched {len(before)}")
    for old, new in zip(before, after, strict=False):  # a count that differs is said above; the rest compared
        changed = [key for key in _SAME_KEYS if old.get(key) != new.get(key)]
        if changed:
            problems.append(f"{new.get('label')}: " + ", ".join(
                f"{key} {new.get(key)!r}, unpatched {old.get(key)!r}" for key in changed))
    if unpatched.get("draft_trace") != patched.get("draft_trace"):
        problems.append(f"the draft proposed other candidates (-v): {patched.get('draft_trace')}, unpatched "
                        f"{unpatched.get('draft_trace')}")
    if patched.get("fills"):
        problems.append("zero-filled draft positions " + ", ".join(f"[{a}, {b})" for a, b, _ in patched["fills"])
                        + ", which the unpatched build left as they were")
    return problems


def hold_to_unpatched(unpatched: dict, patched: dict) -> dict:
    """Issue 37: each scenario says what the unpatched build does in its case (smoke.Scenario.unpatched).

    "same" (the case works unpatched: an M-RoPE draft, an empty draft cache, a linear target): wherever
    the unpatched run passed, the patched run must match it (_differences). "fails" (the bug's case): the
    patched run must show the image's span zero-filled; an unpatched run that passes there
    is recorded (the case no longer fails at this base). A mismatch fails that patched result, so PATCHED's
    verdict (updated here) follows. Returns what was held, for the proof record.
    """
    held: dict[str, list] = {"same": [], "differ": [], "not_failing_unpatched": []}
    for name, by_set in patched.get("results", {}).items():
        scenario = smoke.SCENARIOS.get(name)
        expectation = scenario.unpatched if scenario else ""
        for set_name, result in by_set.items():
            base = unpatched.get("results", {}).get(name, {}).get(set_name)
            if base is None or not expectation:
                continue
            run_name = f"{name}/{set_name}"
            if expectation == "same":
                if not base.get("passed"):
                    continue  # the case does not work unpatched at this base: nothing to match
                problems = _differences(base, result)
                held["same"].append(run_name)
                why = "differs from the unpatched build, where this case works: "
            else:
                if base.get("passed") or not smoke.upstream_symptom(base):
                    held["not_failing_unpatched"].append(run_name)
                problems = [] if result.get("fills") else ["no zero-fill of the left-out image's span"]
                why = "the bug's case: "
            if problems:
                result["passed"] = False
                result["failures"].extend(why + problem for problem in problems)
                held["differ"].append({"run": run_name, "problems": problems})
    patched["failed"] = [f"{sc}/{st}" for sc, by_set in patched.get("results", {}).items()
                         for st, r in by_set.items() if not r["passed"]]
    patched["passed"] = not patched["failed"]
    return held


def verdict(unpatched: dict, patched: dict | None) -> str:
    if unpatched["passed"]:
        return "fixed-upstream"
    return "fixed" if patched and patched["passed"] else "still-broken"


class ProofRecord:
    """WORK/proof-<backend>.json: outcomes by key, written whole each time (a crash keeps the old file)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except ValueError:
            ui.warn(f"{path} is unreadable; proving again")
            self.data = {}

    def get(self, key: str) -> dict | None:
        return self.data.get(key)

    def put(self, key: str, proof: dict) -> None:
        self.data[key] = proof
        state.atomic_write_text(self.path, manifest.dumps(self.data) + "\n")


# --- the unpatched build: the base commit, built in the patched tree's own build dir -----------


def work_locks(work: Path, backend: str) -> list[tuple[str, Path]]:
    """What `prove`, `release` and `track --prove` lock in a work dir: its one tree and build dir. The
    unpatched binaries a proof keeps (WORK/unpatched) are written only under the tree's lock.

    BACKEND here and below is the build dirs' label (build.dir_label): the backend, plus the
    target OS of a cross build (cpu-windows), so one work dir holds both."""
    return [("tree", Path(work) / "src"), ("build", Path(work) / f"build-{backend}")]


def unpatched_dir(work: Path, backend: str) -> Path:
    """WORK/unpatched/build-<label>: the copy of the unpatched binaries that smoke runs."""
    return Path(work) / "unpatched" / f"build-{backend}"


def _request_key(commit: str, request: BuildRequest) -> str:
    """What the unpatched binaries are made of: the commit and the build request (not how it ran)."""
    wanted = request.identity()
    if "cpu_variants" in wanted:
        try:  # "x64,haswell" and "haswell,x64" ask for the same build
            wanted["cpu_variants"] = build.parse_cpu_variants(wanted["cpu_variants"], request.host)
        except Exception:  # build_tree says what is wrong with them
            pass
    return _digest([commit, request.backend, list(request.targets), wanted, build.env_cmake_args()])


def _files_of(folder: Path, section: dict) -> dict[str, str]:
    files = {}
    for rel in [*section["binaries"], *section.get("libraries", [])]:
        path = folder / rel
        files[rel] = "link:" + os.readlink(path) if path.is_symlink() else sha256_file(path)
    return files


def read_unpatched(work: Path, backend: str, key: str | None = None, commit: str | None = None) -> dict | None:
    """The unpatched copy's build section when its record matches KEY (or COMMIT) and its files are intact."""
    folder = unpatched_dir(work, backend)
    try:
        record = json.loads((folder / UNPATCHED_RECORD).read_text(encoding="utf-8"))
        section = dict(record["build"], build_dir=str(folder))
        if (key is not None and record.get("key") != key) or (commit is not None and record.get("commit") != commit):
            return None
        if section.get("rocm_root") and not (folder / rocm_root.BUILT_IN_ROOT).is_file():
            return None  # kept before the root's marker was copied: its binaries would start on the host
        if _files_of(folder, section) != record["files"]:
            ui.warn(f"{folder} no longer holds the files it was made with; building the unpatched tree again")
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return section


def _git_or_build_error(tree: Path, *args: str, check: bool = True) -> str:
    """`git ARGS`'s stripped output; a failure (CHECK) is a BuildError naming the tree (a rerun mends it)."""
    result = gitrun.run(tree, *args, check=False, errors="replace")
    if check and result.returncode != 0:
        raise BuildError(f"git {' '.join(args)} failed in {tree}: {result.stderr.strip()}",
                         "check the tree with `git status`; a rerun puts it back on the patched commit")
    return result.stdout.strip()


def _keep_unpatched(built: dict, folder: Path, key: str, commit: str) -> dict:
    """Copy what smoke runs of BUILT (programs, shared libraries: bin/) into FOLDER, all or nothing."""
    source_dir = Path(built["build_dir"])
    staging = folder.with_name(f".{folder.name}.dfbuild-partial")
    trash = folder.with_name(f".{folder.name}.dfbuild-old")
    for debris in (staging, trash):  # a run stopped half-way left these; they are dfbuild's own
        if debris.exists():
            shutil.rmtree(debris)
    for rel in [*built["binaries"], *built.get("libraries", [])]:
        src, dst = source_dir / rel, staging / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)  # a library's soname link, within bin/
        else:
            shutil.copy2(src, dst)  # RUNPATH $ORIGIN: the copies find each other in bin/
    marker = source_dir / rocm_root.BUILT_IN_ROOT
    if marker.is_file():  # binaries built in the ROCm root run there, copied or not (smoke.launcher_for)
        shutil.copy2(marker, staging / rocm_root.BUILT_IN_ROOT)
    section = dict(built, build_dir=str(folder), built_in=built["build_dir"])
    record = {"commit": commit, "key": key, "files": _files_of(staging, section), "build": section}
    state.atomic_write_text(staging / UNPATCHED_RECORD, manifest.dumps(record) + "\n")
    if folder.exists():
        # an older copy, or a work dir of the two-tree layout (a real build dir of WORK/unpatched/src):
        # both dfbuild's; anything else there is not ours to delete
        if not ((folder / UNPATCHED_RECORD).is_file() or (folder / build.STAMP_NAME).is_file()):
            raise BuildDirMismatchError(f"{folder} holds files dfbuild did not write; nothing was touched",
                                        "move it away, or use another --work dir")
        state.move(folder, trash)
    state.move(staging, folder)
    shutil.rmtree(trash, ignore_errors=True)
    return section


def build_unpatched(tree: Path, request: BuildRequest, work: Path, commit: str) -> dict:
    """The unpatched build of TREE (its base COMMIT) in TREE's own build dir, kept in WORK/unpatched.

    TREE is checked out at COMMIT for the build and put back on its branch (or
    commit) afterwards, even after an error or Ctrl-C; a kill -9 in between leaves
    it detached at the base, and the next checkout + apply put it back (apply's
    commits are reproducible). Returns the build section of the copy.
    """
    label = build.dir_label(request.backend, request.cross_host)
    tree = Path(tree).resolve()
    folder = unpatched_dir(work, label)
    key = _request_key(commit, request)
    kept = read_unpatched(work, label, key)
    if kept is not None:
        ui.info(f"    unpatched binaries of {commit[:12]} already built ({folder})")
        return dict(kept, reused=True)
    head, dirty = build.source_commit(tree)
    if dirty:
        raise BuildError(f"{tree} has uncommitted changes, so its base cannot be built unpatched",
                         "commit or stash them (git stash), then rerun")
    branch = _git_or_build_error(tree, "symbolic-ref", "-q", "--short", "HEAD", check=False)
    if head != commit:
        _git_or_build_error(tree, "checkout", "-q", "--detach", commit)
    try:
        built = build.build_tree(tree, request, Path(work) / f"build-{label}")
        # only a clean build of the base commit is kept as unpatched
        if built.get("source_commit") != commit or built.get("source_dirty"):
            raise BuildError(f"the unpatched build of {tree} was of {built.get('source_commit')}"
                             f"{' (dirty)' if built.get('source_dirty') else ''}, not of the base {commit}",
                             "rerun; nothing was kept as unpatched")
        kept = _keep_unpatched(built, folder, key, commit)
    finally:
        if head != commit:  # back on the patched commit, whatever happened
            _git_or_build_error(tree, "checkout", "-q", *([branch] if branch else ["--detach", head]))
    return dict(kept, reused=False)


def prove(base: str, *, request: BuildRequest | None = None, work: Path, repo: str | None = None,
          pr: int | None = None, patches_dir: Path | None = None, sets=None, scenarios=None) -> dict:
    """Check out BASE under WORK, apply the series, build the base and then the patched tree in one
    build dir (the second build is incremental), smoke both; return the proof.

    REQUEST says what both builds are (backend, target, targets, flags) and how the smoke runs
    (request.smoke goes to smoke.plan: a software Vulkan device runs its smaller table); the tree's
    manifest records it (its request section).
    """
    base = source.canonical_base(base, quiet=True, repo=repo)  # b10359 is pydist-0.94.0's tree (the CLI says so)
    request = request or BuildRequest()  # the default build: cpu, this machine, llama-server
    how = request.spec
    backend = how.name
    work = Path(work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    curated = series.load_series(patches_dir)
    times: dict[str, float] = {}
    host = request.cross_host
    label = build.dir_label(backend, host)  # cpu, or cpu-windows for a cross build: its own dirs and record
    proof: dict[str, Any] = {"base": base, "backend": backend}
    if host is not None:
        proof["os"] = host.os
        proof["arch"] = host.arch

    @contextmanager
    def timed(name: str, title: str):
        started = time.monotonic()
        with ui.step(title):
            yield
        times[name] = round(time.monotonic() - started, 2)

    with timed("checkout", f"checkout {base}"):
        src_section = source.checkout(base, pr=pr, repo=repo, dest=work / "src", keep_descendants=True)
        tree = Path(src_section["dir"])
        manifest.update_tree_manifest(tree, "source", src_section)
        manifest.update_tree_manifest(tree, "request", request.to_dict())
    with timed("apply", "apply the patch series"):
        try:
            applied = series.apply_series(curated, tree, skip=())
        except NotApplicableError as exc:
            return {**proof, "outcome": "not-applicable", "reason": exc.message, "times": times}
        except PatchConflictError as exc:
            return {**proof, "outcome": "conflict", "reason": exc.message, "times": times}
    manifest.update_tree_manifest(tree, "series", applied)
    proof.update({"unpatched_commit": build.stamp_base(tree),  # the commit below dfbuild's concern commits
                  "patched_commit": applied["head"], "derived": bool(applied.get("derived")),
                  "concerns": applied["concerns"]})

    fixtures_dir = work / "fixtures"
    fx = fixtures.ensure_fixtures(fixtures_dir)
    # the asked-for table is part of what was proven (auto may pick the software one)
    table = request.smoke.table or os.environ.get(smoke.TABLE_ENV, "").strip() or "auto"
    key = _digest([proof["unpatched_commit"], proof["patched_commit"], label, sorted(sets or []),
                   sorted(scenarios or []), {n: f["sha256"] for n, f in fx.get("files", {}).items()}, LAYOUT]
                  + ([table] if table != "auto" or how.smoke_software else []))
    record = ProofRecord(work / f"proof-{label}.json")
    known = record.get(key)
    if known and how.smoke_device and smoke.server_binary(unpatched_dir(work, label)).is_file():
        # a GPU backend: a proof is reused only where it ran on the same device (or the same CPU fallback)
        now = smoke.plan(how, unpatched_dir(work, label), request.smoke, sets=sets, scenarios=scenarios)
        if (known.get("smoke_table") or {}).get("ran_on") != now.ran_on:
            ui.info(f"    proven before on {(known.get('smoke_table') or {}).get('ran_on', 'another device')}, "
                    f"now on {now.ran_on}: proving again")
            known = None
    if known:
        ui.info(f"    already proven: {known['outcome']} (both commits, fixtures and scenarios unchanged)")
        # the evidence belongs to the commits; which variant carried the series here, and how, is today's
        # series' to say (renaming a variant changes neither commit, so the key still matches)
        known = {**known, "derived": proof["derived"], "concerns": proof["concerns"]}
        if known != record.get(key):
            record.put(key, known)
        _record_in_tree(tree, known)
        return known

    with timed("build_unpatched", f"build {backend} (unpatched: the base commit)"):
        plain = build_unpatched(tree, request, work, proof["unpatched_commit"])
    with timed("build_patched", f"build {backend} (patched: incremental, in the same build dir)"):
        built = build.build_tree(tree, request, work / f"build-{label}")
    manifest.update_tree_manifest(tree, "build", built)
    proof["builds"] = {which: {"build_dir": section.get("built_in", section["build_dir"]),
                               "commit": section.get("source_commit"), "reused": bool(section.get("reused")),
                               "compiled_steps": section.get("compiled_steps"),
                               "compiled_objects": section.get("compiled_objects"),
                               "wall_time_s": section.get("wall_time_s")}
                       for which, section in (("unpatched", plain), ("patched", built))}

    # one plan for both trees, chosen on the unpatched build (the same device either way)
    # the tree's release decides which scenarios apply (linear-image only from b10355)
    plan = smoke.plan(how, unpatched_dir(work, label), request.smoke, sets=sets, scenarios=scenarios,
                      release=carry.tree_build(tree, proof["unpatched_commit"]))
    if plan.note:
        ui.warn(plan.note)
    ui.info(f"    smoke runs on: {plan.ran_on}")
    proof["smoke_table"] = {"table": plan.table, "device": plan.device, "sets": list(plan.sets),
                            "scenarios": list(plan.scenarios), "identity": plan.identity, "ran_on": plan.ran_on,
                            "cpu_fallback": plan.cpu_fallback}

    # every set, except on a software device (minutes a server there): the sets its table runs
    load_sets = plan.sets if plan.table == "software" else sorted(fx["sets"])
    with timed("fixtures_load", "the fixture sets load in the unpatched llama-server"):
        refused = smoke.fixtures_that_do_not_load(smoke.server_binary(unpatched_dir(work, label)), fx,
                                                  work / f"smoke-load-{label}", sets=load_sets, env=plan.env,
                                                  extra_server_args=plan.server_args,
                                                  start_timeout=plan.start_timeout)
    if refused:
        # a loader that refuses a fixture fails that set's every scenario, patched or not: no proof
        raise FixtureError(f"{base}'s llama-server does not load fixture set(s) "
                           + "; ".join(f"{name}: {why}" for name, why in refused.items()),
                           hint=f"the fixtures must suit every DFlash loader; logs in {work / f'smoke-load-{label}'}")
    proof["fixtures_loaded"] = sorted(load_sets)

    def run(build_dir: Path, which: str) -> dict:
        def progress(result: dict) -> None:
            mark = "[green]pass[/green]" if result.get("passed") else "[red]FAIL[/red]"
            ui.info(f"    {which}: {result.get('scenario')} / {result.get('set')}: {mark}")

        return smoke.run_smoke(build_dir, fixtures_dir, log_dir=work / f"smoke-{which}-{label}",
                               on_result=progress, **plan.run_kwargs())

    with timed("smoke_unpatched", "smoke the unpatched tree (it should fail)"):
        unpatched_section = run(unpatched_dir(work, label), "unpatched")
        unpatched = smoke_summary(unpatched_section)
    patched_section = None
    if not unpatched["passed"]:
        with timed("smoke_patched", "smoke the patched tree"):
            patched_section = run(work / f"build-{label}", "patched")
            # where a case works unpatched the patched build must do the same (issue 37)
            proof["held_to_unpatched"] = hold_to_unpatched(unpatched_section, patched_section)
    patched = smoke_summary(patched_section) if patched_section else None
    outcome = verdict(unpatched, patched)
    proof.update({"outcome": outcome, "unpatched": unpatched, "patched": patched, "times": times,
                  "proven_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine_facts(),
                  "source": {k: src_section.get(k) for k in ("kind", "repo", "base", "commit")}})
    if outcome == "fixed-upstream":
        # what the series would have added; a concern already in the tree was upstream's own doing
        proof["no_longer_needed"] = [c["id"] for c in applied["concerns"]
                                     if c["status"] == "applied" or c.get("detail", "").startswith("already present")]
    if patched_section is not None:  # a release of these very binaries reuses a pass (smoke.recall)
        smoke.remember(plan.memo_key(build.smoke_digest(built), fx), patched_section)
    record.put(key, proof)
    _record_in_tree(tree, proof)
    return proof


def _record_in_tree(tree: Path, proof: dict) -> None:
    """The tree's own record says what the proof showed; `series adopt` reads it from there."""
    record = manifest.load(manifest.tree_manifest_path(tree))
    section = dict(record.get("series") or {})
    if section.get("head") == proof.get("patched_commit"):
        section["proven"] = proof["outcome"] in ("fixed", "fixed-upstream")
        section["outcome"] = proof["outcome"]
        manifest.update_tree_manifest(tree, "series", section)
    manifest.update_tree_manifest(tree, "proof", proof)
