"""Which fix drafts better on an image request: the series' zero rows or a draft that jumps (issue 43)?

Side by side in one run, on the same requests (spec_images.py's text request and its image request, text
before and after the image, greedy, no prompt cache):

- (a) fill: the PATCHED build with the plain-rope draft (the image's span zero-filled in the draft's cache);
- (b) jump: the UNPATCHED build with the same draft after `dfbuild draft fix` (an M-RoPE draft: it jumps);
- (c) text-only requests through both;

each beside `--spec-type none` on its own build. Per configuration: tokens/s (the server's own
predicted_per_second, median over repetitions), drafted, accepted, acceptance rate, and whether the output
equals the no-spec output. On both kinds of fixture: the agree sets (every draft accepted by construction:
they show what each fix costs, not how well it drafts) and the random sets (drafts that depend on what the
draft's cache holds: where zero rows and a jump differ, their drafts differ; random weights show whether
the two paths draft the same, never which would draft better with a trained model).

    python bench/draft_vs_fill.py --patched-build P --unpatched-build U [--reps 5] [--n-predict 64]

The run names today's series hash (the patched build's, checked against patches/series.toml) and merges its
section into bench/results.json under draft_vs_fill.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import benchlib
import spec_images
from benchlib import log

from dfbuild import smoke
from dfbuild.draft import fix as draft_fix
from dfbuild.smoke import fixtures

FAMILIES = {"agree": ("qwen35-grid-plain-agree", "qwen35-grid-fixed-agree"),
            "random": ("qwen35-grid-plain-random", "qwen35-grid-fixed-random")}
KINDS = ("text", "image")


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def summarize(records: list[dict], families: dict = FAMILIES) -> list[dict]:
    rows = []
    for family in families:
        for fix in ("fill", "jump"):
            for kind in KINDS:
                mine = [r for r in records if (r["family"], r["fix"], r["kind"]) == (family, fix, kind)]
                spec, none = [r for r in mine if r["mode"] == "spec"], [r for r in mine if r["mode"] == "none"]
                ok = [r for r in spec if not r["error"]]
                drafted = sum(r["draft_n"] for r in ok)
                accepted = sum(r["draft_n_accepted"] for r in ok)
                none_hashes = {r["content_sha256"] for r in none if not r["error"]}
                speedups = [s["tokens_per_s"] / n["tokens_per_s"] for s in ok for n in none
                            if n["rep"] == s["rep"] and s["tokens_per_s"] and n["tokens_per_s"]]
                rows.append({
                    "family": family, "fix": fix, "kind": kind, "requests": len(spec),
                    "failed": len(spec) - len(ok),
                    "spec_tokens_per_s": _median([r["tokens_per_s"] for r in ok if r["tokens_per_s"]]),
                    "none_tokens_per_s": _median([r["tokens_per_s"] for r in none if r["tokens_per_s"]]),
                    "speedup": _median(speedups),
                    "drafted": drafted, "accepted": accepted,
                    "acceptance": round(accepted / drafted, 4) if drafted else None,
                    "identical_to_none": bool(ok) and len(none_hashes) == 1
                    and all(r["content_sha256"] in none_hashes for r in ok),
                })
    return rows


def table(section: dict) -> list[str]:
    series = section["series"]
    lines = [f"- fixtures: {section['fixture_shape']}; series: `{series['hash']}` on {series['base']} "
             f"(today's: {series['current']}); {section['reps']} repetitions x {section['n_predict']} "
             f"tokens; `-t {section['threads']}`, `--spec-draft-n-max {section['spec_draft_n_max']}`",
             "", "| fixtures | fix | request | spec tok/s | none tok/s | speed-up | drafted | accepted | acceptance "
             "| output = none |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in section["rows"]:
        fix = {"fill": "(a) patched, plain draft (zero rows)", "jump": "(b) unpatched, fixed draft (jump)"}[row["fix"]]
        failed = f" ({row['failed']} failed)" if row["failed"] else ""
        lines.append(f"| {row['family']} | {fix} | {row['kind']}{failed} | {row['spec_tokens_per_s']} | "
                     f"{row['none_tokens_per_s']} | {row['speedup']} | {row['drafted']} | {row['accepted']} | "
                     f"{row['acceptance']} | {'yes' if row['identical_to_none'] else 'no'} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--patched-build", type=Path, required=True)
    p.add_argument("--unpatched-build", type=Path, required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--n-predict", type=int, default=64)
    p.add_argument("--threads", "-t", type=int, default=1)
    p.add_argument("--spec-draft-n-max", type=int, default=3)
    p.add_argument("--server-arg", action="append", default=[])
    p.add_argument("--fixtures", type=Path, default=None)
    p.add_argument("--shape", choices=("smoke", "bench"), default="smoke",
                   help="smoke: the tiny fixtures, agree and random sets; bench: write_bench_fixtures' 163 M target "
                        "(agree only: the bench fixtures have no random set), its draft fixed beside it")
    p.add_argument("--label", default="cpu")
    p.add_argument("--results", type=Path, default=benchlib.RESULTS_JSON)
    args = p.parse_args(argv)
    series = benchlib.series_record(args.patched_build)
    opts = SimpleNamespace(ctx=2048, threads=args.threads, spec_draft_n_max=args.spec_draft_n_max,
                           extra_server_args=[a for arg in args.server_arg for a in arg.split()],
                           start_timeout=300.0, request_timeout=1800.0, n_predict=args.n_predict)
    fx_dir = args.fixtures or Path(tempfile.mkdtemp(prefix="draft-vs-fill-"))
    families = dict(FAMILIES)
    if args.shape == "bench":
        fx = spec_images.ensure_bench_fixtures(fx_dir, fixtures.BENCH_SHAPE)
        plain = fx["sets"][FAMILIES["agree"][0]]
        fixed = Path(fx_dir) / fixtures.FILES["draft-fixed-agree"]
        draft_fix.fix_draft(Path(plain["draft"]), Path(plain["target"]), fixed, force=True)
        fx["sets"][FAMILIES["agree"][1]] = dict(plain, draft=str(fixed), draft_rope="fixed")
        families = {"agree": FAMILIES["agree"]}
    else:
        fx = fixtures.ensure_fixtures(fx_dir)
    image = Path(fx["images"]["small"])
    logs = fx_dir / "logs-draft-vs-fill"
    logs.mkdir(parents=True, exist_ok=True)
    started = benchlib.now_iso()
    load_start = benchlib.load_average()
    records: list[dict] = []
    for family, (plain, fixed) in families.items():
        builds = {"fill": (smoke.server_binary(args.patched_build), fx["sets"][plain]),
                  "jump": (smoke.server_binary(args.unpatched_build), fx["sets"][fixed])}
        servers = {(fix, mode): spec_images.BenchServer(binary, spec_images.server_args(entry, mode, opts), logs,
                                                        f"{family}-{fix}-{mode}", opts, image)
                   for fix, (binary, entry) in builds.items() for mode in ("spec", "none")}
        try:
            for server in servers.values():
                server.start()
            order = [(fix, mode, kind) for fix in builds for mode in ("spec", "none") for kind in KINDS]
            for rep in range(args.reps):
                random.Random(rep).shuffle(order)
                for fix, mode, kind in order:
                    record = servers[(fix, mode)].measure(fix, mode, kind, rep)
                    records.append({**record, "family": family, "fix": fix})
            log(f"{family}: {args.reps} repetitions done")
        finally:
            for server in servers.values():
                server.stop()
    section = {"date": started, "command": benchlib.command_line(), "machine": benchlib.machine_info(),
               "load_average_at_start": load_start, "load_average_at_end": benchlib.load_average(),
               "series": series, "reps": args.reps, "n_predict": args.n_predict, "threads": args.threads,
               "spec_draft_n_max": args.spec_draft_n_max,
               "builds": {"patched": spec_images.server_version(smoke.server_binary(args.patched_build)),
                          "unpatched": spec_images.server_version(smoke.server_binary(args.unpatched_build))},
               "fixture_shape": args.shape, "target_params": fx.get("target_params"),
               "rows": summarize(records, families), "records": records}
    benchlib.merge_results("draft_vs_fill", f"{args.label}-{args.shape}", section, args.results)
    print("\n".join(table(section)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
