#!/usr/bin/env python3
"""Issue 37, measured: does a patched build leave the cases that work unpatched as they are?

Runs the smoke scenarios that say what the unpatched build does (smoke.Scenario.unpatched: "same" for the
cases that work unpatched, the M-RoPE draft, the empty draft cache, the linear target; "fails" for the bug's
own case) on one unpatched build and one or more patched builds of the same tree, and holds each patched build
to the unpatched one the way `dfbuild prove` does (prove.hold_to_unpatched): the same outputs, the same draft
counters, the same drafted candidates (-v), no fill, where the unpatched run passes; a debug-level fill of the
image's span in the bug's case.

    python bench/gated_identity.py --unpatched U --patched gated=G --patched ungated=O [--base b11434]

U, G, O are build dirs (each with bin/llama-server). Results: bench/gated_identity.json (per build, scenario
and set: passed, requests' outputs and draft counters, the drafted candidates' digest, fills, and what
differs from the unpatched run). The point of an ungated build (the series before issue 37) is to show that
the check can fail: where it fills a case that works unpatched, the comparison must say so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dfbuild import smoke
from dfbuild.release import prove
from dfbuild.smoke import fixtures

HERE = Path(__file__).resolve().parent
SCENARIOS = ("mrope-draft", "empty-draft-cache", "linear-image", "pinned-image-hole")
SETS = ("qwen35-grid-sections-random", "qwen35-grid-sections-agree", "qwen35-grid-plain-random",
        "qwen35-grid-plain-agree", "llama-mlp-agree", "llama-mlp-random")


def summary(section: dict) -> dict:
    """Per scenario and set, what the comparison looks at."""
    out = {}
    for name, by_set in section["results"].items():
        for set_name, r in by_set.items():
            out[f"{name}/{set_name}"] = {
                "passed": r["passed"], "failures": r["failures"],
                "requests": [{k: q.get(k) for k in ("label", "status", "content", "draft_n", "draft_n_accepted")}
                             for q in r["requests"]],
                "draft_trace": r.get("draft_trace"), "fills": r.get("fills"),
            }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--unpatched", type=Path, required=True, help="build dir of the unpatched tree")
    p.add_argument("--patched", action="append", required=True, metavar="LABEL=DIR",
                   help="a patched build dir, labelled (repeatable)")
    p.add_argument("--base", default="b11434", help="the release the builds are of (recorded)")
    p.add_argument("--work", type=Path, default=Path("gated-identity-work"), help="fixtures and logs")
    p.add_argument("--out", type=Path, default=HERE / "gated_identity.json")
    p.add_argument("--table", action="store_true",
                   help="the whole default smoke table (every proof's), not only the scenarios that say what "
                        "the unpatched build does")
    args = p.parse_args()
    sets, scenarios = (smoke.DEFAULT_SETS, smoke.DEFAULT_SCENARIOS) if args.table else (SETS, SCENARIOS)

    fx_dir = args.work / "fixtures"
    fixtures.ensure_fixtures(fx_dir)
    started = time.monotonic()

    def run(build: Path, label: str) -> dict:
        section = smoke.run_smoke(build, fx_dir, sets=list(sets), scenarios=list(scenarios),
                                  log_dir=args.work / f"logs-{label}",
                                  on_result=lambda r: print(f"{label}: {r['scenario']}/{r['set']}: "
                                                            f"{'pass' if r['passed'] else 'FAIL'}", file=sys.stderr))
        return section

    unpatched = run(args.unpatched, "unpatched")
    report = {"base": args.base, "scenarios": list(scenarios), "sets": list(sets),
              "unpatched": {"build": str(args.unpatched), "runs": summary(unpatched)}, "patched": {}}
    for item in args.patched:
        label, _, build = item.partition("=")
        section = run(Path(build), label)
        held = prove.hold_to_unpatched(unpatched, section)
        report["patched"][label] = {"build": build, "held": held, "passed": section["passed"],
                                    "runs": summary(section)}
        print(f"{label}: held {len(held['same'])} runs that work unpatched; {len(held['differ'])} differ; "
              f"passed: {section['passed']} ({len(section['failed'])} of "
              f"{sum(len(r) for r in section['results'].values())} failed)", file=sys.stderr)
    report["unpatched"]["failed"] = unpatched["failed"]
    report["wall_s"] = round(time.monotonic() - started, 1)
    args.out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
