#!/usr/bin/env python3
"""Bisectability: every prefix of a variant builds and is no worse than the unpatched tree.

A maintainer bisecting llama.cpp through our series lands on any prefix of it
(0001; 0001+0002; ...). Each must build, and on the smoke table no scenario
that passes on the unpatched tree may fail with the prefix. This script checks
that on a proof's work dir (`dfbuild prove --base bN --work WORK` first: it
leaves the unpatched smoke's verdicts, the tree and its build dir), so only the
in-between prefixes are built (incrementally, in the proof's build dir) and
smoked here; the empty prefix and the whole series are the proof's own runs.

    python bench/prefixes.py --work WORK [--jobs N] [--out prefixes-bN.json]
    python bench/prefixes.py --record prefixes-bN.json... --measured "WHEN, WHERE"   # into bench/prefixes.json

It prints one JSON object: per prefix, the concerns in it, the runs that failed
and the regressions (failed here, passed unpatched). Exit 1 when any prefix
regresses or does not build.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dfbuild import series, smoke
from dfbuild.build import tree as build
from dfbuild.build.request import BuildRequest
from dfbuild.core import state
from dfbuild.host import backends as backend_table
from dfbuild.series import carry

GIT_ENV = {"GIT_AUTHOR_NAME": "dfbuild", "GIT_AUTHOR_EMAIL": "dfbuild@localhost",
           "GIT_COMMITTER_NAME": "dfbuild", "GIT_COMMITTER_EMAIL": "dfbuild@localhost",
           "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000"}


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


def failed_runs(section: dict) -> set[str]:
    return set(section.get("failed", []))


RECORD = Path(__file__).resolve().parent / "prefixes.json"


def record(reports: list[Path], measured: str, into: Path = RECORD) -> None:
    """Each report (--out's JSON) into INTO's releases, as it keeps them: failure counts, where and when."""
    data = json.loads(into.read_text())
    for path in reports:
        report = json.loads(path.read_text())
        data["releases"][report["release"]] = {
            "variant": report["variant"], "rule": report["rule"], "ok": report["ok"], "measured": measured,
            "prefixes": [{"concerns": e["concerns"], "failed": len(e.get("failed", [])),
                          "runs": e.get("runs", report["runs"]), "regressions": e["regressions"], "built": e["built"]}
                         for e in report["prefixes"]]}
    data["releases"] = dict(sorted(data["releases"].items(), key=lambda item: int(item[0].lstrip("b"))))
    state.atomic_write_text(into, json.dumps(data, indent=1) + "\n")  # (a crash leaves the old record)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record", type=Path, nargs="+", default=None,
                   help="reports (--out's JSON) to record in bench/prefixes.json, then exit")
    p.add_argument("--measured", default=None, help="with --record: when and where they were measured")
    p.add_argument("--work", type=Path, help="a `dfbuild prove` work dir (cpu backend)")
    p.add_argument("--jobs", "-j", type=int, default=None)
    p.add_argument("--no-ui", action="store_true", help="build without the web UI, as the proof was (prove --no-ui)")
    p.add_argument("--out", type=Path, default=None)
    opts = p.parse_args(argv)
    if opts.record:
        if not opts.measured:
            p.error("--record needs --measured")
        record(opts.record, opts.measured)
        return 0
    if opts.work is None:
        p.error("--work is required")

    work = opts.work.resolve()
    proofs = json.loads((work / "proof-cpu.json").read_text())
    proof = next(iter(proofs.values())) if "outcome" not in proofs else proofs
    tree = work / "src"
    start = proof["unpatched_commit"]
    release = carry.tree_build(tree, start)
    curated = series.load_series()
    _base, steps = series.plan(curated, tree)
    # the prefixes are of the patch files the release gets, in series order (upstream concerns add nothing)
    patched = [s for s in steps if s.variant is not None and s.variant.file]
    unpatched_failed = set(proof["unpatched"]["failed"])
    runs = proof["unpatched"]["runs"]
    report = {"release": f"b{release}" if release else None, "variant": patched[0].variant.base if patched else None,
              "rule": patched[0].rule if patched else None, "runs": runs,
              "prefixes": [{"concerns": [], "failed": sorted(unpatched_failed), "regressions": [], "built": True,
                            "from": "the proof's unpatched run"}]}
    how = backend_table.get("cpu")
    fixtures_dir = work / "fixtures"
    for k in range(1, len(patched)):
        started = time.monotonic()
        git(tree, "checkout", "-q", "--detach", start)
        for step in patched[:k]:
            git(tree, "apply", "--index", str(series.patch_path(curated, step.variant)))
            git(tree, "commit", "-q", "-m", step.concern.id)
        entry = {"concerns": [s.concern.id for s in patched[:k]]}
        try:
            request = BuildRequest("cpu", cpu_variants=("x64",), jobs=opts.jobs, web_ui=not opts.no_ui)
            build.build_tree(tree, request, work / "build-cpu")
            entry["built"] = True
        except Exception as exc:  # a prefix that does not build is the finding itself
            entry.update({"built": False, "error": str(exc)})
            report["prefixes"].append(entry)
            continue
        plan = smoke.plan(how, work / "build-cpu", release=release)
        section = smoke.run_smoke(work / "build-cpu", fixtures_dir, log_dir=work / f"smoke-prefix-{k}",
                                  **plan.run_kwargs())
        failed = failed_runs(section)
        entry.update({"failed": sorted(failed), "regressions": sorted(failed - unpatched_failed),
                      "runs": sum(len(r) for r in section["results"].values()),
                      "wall_s": round(time.monotonic() - started, 1)})
        report["prefixes"].append(entry)
    whole = proof.get("patched") or {}
    report["prefixes"].append({"concerns": [s.concern.id for s in patched], "built": True,
                               "failed": sorted(whole.get("failed", [])),
                               "regressions": sorted(set(whole.get("failed", [])) - unpatched_failed),
                               "from": "the proof's patched run"})
    git(tree, "checkout", "-q", "--detach", proof["patched_commit"])
    report["ok"] = all(e["built"] and not e["regressions"] for e in report["prefixes"])
    text = json.dumps(report, indent=2)
    if opts.out:
        opts.out.write_text(text + "\n")
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
