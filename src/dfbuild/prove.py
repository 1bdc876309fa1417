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
reuses both builds): src + build-<backend> (patched) and unpatched/src +
unpatched/build-<backend>, whose paths relative to their parent are the same,
so the second build hits the ccache the first one filled. A proof is recorded
in WORK/proof-<backend>.json under a key of both commits, the fixtures and
the scenarios, so a rerun recomputes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

from . import backends, build, fixtures, manifest, series, smoke, source, state, ui
from .errors import NotApplicableError, PatchConflictError

OUTCOMES = ("fixed", "fixed-upstream", "still-broken", "not-applicable", "conflict")


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


def prove(base: str, *, backend: "backends.Backend | str" = "cpu", work: Path, repo: str | None = None, pr: int | None = None,
          patches_dir: Path | None = None, sets=None, scenarios=None, build_options: dict | None = None,
          targets=build.DEFAULT_TARGETS, smoke_options: dict | None = None) -> dict:
    """Check out BASE twice under WORK, apply the series to one, build both, smoke both; return the proof.

    SMOKE_OPTIONS (table, start_timeout) go to smoke.plan: a software Vulkan device runs its smaller table.
    """
    how = backends.resolve(backend)
    backend = how.name
    work = Path(work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    curated = series.load_series(patches_dir)
    times: dict[str, float] = {}
    proof = {"base": base, "backend": backend}

    @contextmanager
    def timed(name: str, title: str):
        started = time.monotonic()
        with ui.step(title):
            yield
        times[name] = round(time.monotonic() - started, 2)

    with timed("checkout", f"checkout {base} (patched and unpatched)"):
        src_section = source.checkout(base, pr=pr, repo=repo, dest=work / "src", keep_descendants=True)
        tree = Path(src_section["dir"])
        manifest.update_tree_manifest(tree, "source", src_section)
        plain_section = source.checkout(base, pr=pr, repo=repo, dest=work / "unpatched" / "src")
        plain = Path(plain_section["dir"])
        manifest.update_tree_manifest(plain, "source", plain_section)
    with timed("apply", "apply the patch series"):
        try:
            applied = series.apply_series(curated, tree, skip=())
        except NotApplicableError as exc:
            return {**proof, "outcome": "not-applicable", "reason": exc.message, "times": times}
        except PatchConflictError as exc:
            return {**proof, "outcome": "conflict", "reason": exc.message, "times": times}
    manifest.update_tree_manifest(tree, "series", applied)
    proof.update({"unpatched_commit": build.source_commit(plain)[0],
                  "patched_commit": applied["head"], "derived": bool(applied.get("derived")),
                  "concerns": applied["concerns"]})

    fixtures_dir = work / "fixtures"
    fx = fixtures.ensure_fixtures(fixtures_dir)
    smoke_options = smoke_options or {}
    # the asked-for table is part of what was proven (auto may pick the software one)
    table = smoke_options.get("table") or os.environ.get(smoke.TABLE_ENV, "").strip() or "auto"
    key = _digest([proof["unpatched_commit"], proof["patched_commit"], backend, sorted(sets or []),
                   sorted(scenarios or []), {n: f["sha256"] for n, f in fx.get("files", {}).items()}]
                  + ([table] if table != "auto" or how.smoke_software else []))
    record = ProofRecord(work / f"proof-{backend}.json")
    known = record.get(key)
    if known:
        ui.info(f"    already proven: {known['outcome']} (both commits, fixtures and scenarios unchanged)")
        _record_in_tree(tree, known)
        return known

    options = build_options or {}
    with timed("build_unpatched", f"build {backend} (unpatched)"):
        build.build_tree(plain, backend, plain.parent / f"build-{backend}", targets=targets, **options)
    with timed("build_patched", f"build {backend} (patched)"):
        built = build.build_tree(tree, backend, work / f"build-{backend}", targets=targets, **options)
    manifest.update_tree_manifest(tree, "build", built)

    # one plan for both trees, chosen on the unpatched build (the same device either way)
    plan = smoke.plan(how, plain.parent / f"build-{backend}", sets=sets, scenarios=scenarios, **smoke_options)
    if plan.note:
        ui.warn(plan.note)
    proof["smoke_table"] = {"table": plan.table, "device": plan.device, "sets": list(plan.sets),
                            "scenarios": list(plan.scenarios), "identity": plan.identity}

    def run(build_dir: Path, label: str) -> dict:
        def progress(result: dict) -> None:
            mark = "[green]pass[/green]" if result.get("passed") else "[red]FAIL[/red]"
            ui.info(f"    {label}: {result.get('scenario')} / {result.get('set')}: {mark}")

        return smoke.run_smoke(build_dir, fixtures_dir, log_dir=work / f"smoke-{label}-{backend}",
                               on_result=progress, **plan.run_kwargs())

    with timed("smoke_unpatched", "smoke the unpatched tree (it should fail)"):
        unpatched = smoke_summary(run(plain.parent / f"build-{backend}", "unpatched"))
    patched_section = None
    if not unpatched["passed"]:
        with timed("smoke_patched", "smoke the patched tree"):
            patched_section = run(work / f"build-{backend}", "patched")
    patched = smoke_summary(patched_section) if patched_section else None
    outcome = verdict(unpatched, patched)
    proof.update({"outcome": outcome, "unpatched": unpatched, "patched": patched, "times": times,
                  "proven_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "source": {k: src_section.get(k) for k in ("kind", "repo", "base", "commit")}})
    if outcome == "fixed-upstream":
        # what the series would have added; a concern already in the tree was upstream's own doing
        proof["no_longer_needed"] = [c["id"] for c in applied["concerns"]
                                     if c["status"] == "applied" or c.get("detail", "").startswith("already present")]
    if patched_section is not None:  # a release of these very binaries reuses a pass (smoke.recall)
        smoke.remember(plan.memo_key(build.payload_digest(built), fx), patched_section)
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
