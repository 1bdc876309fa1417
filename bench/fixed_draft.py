"""Issue 43's proof on one release: does `dfbuild draft fix` take an UNPATCHED llama-server out of #27408?

On an unpatched build of release bN, the smoke table's bug scenario runs with the fixtures' plain-rope drafts
(`pinned-image-hole` on qwen35-grid-plain-{agree,random}) and its `fixed-draft` scenario with the same drafts
after `dfbuild draft fix` (qwen35-grid-fixed-{agree,random}): the bug's request, text, image and text in one
prompt, then a text request. What it must show:

- the original drafts fail with the upstream symptom (HTTP 500, "inconsistent sequence positions"), at every bN;
- the fixed drafts pass from b10662 on (output identical to --spec-type none, the agree set's drafts accepted,
  no zero-fill) and fail before it, where the loader ignores the key;
- `dfbuild draft check` of each fixed draft says the same for bN (affected on b9837 to b10644 only).

    python bench/fixed_draft.py --build-dir WORK/unpatched/build-cpu --base b11434 [--out FILE.json]

Exit 0 when bN behaves as `draft check` says and the original drafts fail, 1 otherwise; the record either way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORIGINAL_SETS = ("qwen35-grid-plain-agree", "qwen35-grid-plain-random")
FIXED_SETS = ("qwen35-grid-fixed-agree", "qwen35-grid-fixed-random")
SCENARIOS = ("pinned-image-hole", "fixed-draft")
KEPT = ("passed", "statuses", "drafted", "accepted", "image_drafted", "image_accepted", "identical_to_no_spec",
        "upstream_symptom", "zero_filled", "failures")


def _dfbuild(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfbuild", *args], capture_output=True, text=True)


def release_number(base: str) -> int:
    if not (base.startswith("b") and base[1:].isdigit()):
        raise SystemExit(f"--base {base!r}: name a llama.cpp release, bNNNNN")
    return int(base[1:])


def prove_release(build_dir: Path, base: str, fixtures_dir: Path, log_dir: Path | None = None) -> dict:
    """Run the two scenarios on BUILD_DIR (an unpatched build of BASE) and judge them; the record."""
    release = release_number(base)
    argv = ["smoke", "--build-dir", str(build_dir), "--fixtures", str(fixtures_dir), "--json"]
    for name in ORIGINAL_SETS + FIXED_SETS:
        argv += ["--set", name]
    for name in SCENARIOS:
        argv += ["--scenario", name]
    if log_dir is not None:
        argv += ["--log-dir", str(log_dir)]
    smoke = _dfbuild(*argv)
    if not smoke.stdout.strip():
        raise SystemExit(f"dfbuild smoke printed nothing (exit {smoke.returncode}):\n{smoke.stderr[-3000:]}")
    section = json.loads(smoke.stdout)
    index = json.loads((fixtures_dir / "fixtures.json").read_text(encoding="utf-8"))
    runs, checks = {}, {}
    for scenario, by_set in section.get("results", {}).items():
        for set_name, result in by_set.items():
            runs[f"{scenario}/{set_name}"] = {key: result.get(key) for key in KEPT}
    for set_name in FIXED_SETS:
        entry = index["sets"][set_name]
        check = _dfbuild("draft", "check", entry["draft"], "--target", entry["target"], "--json")
        checks[set_name] = json.loads(check.stdout)
    problems = []
    for set_name in ORIGINAL_SETS:
        run = runs.get(f"pinned-image-hole/{set_name}")
        if run is None or run["passed"] or not run["upstream_symptom"]:
            problems.append(f"pinned-image-hole/{set_name}: the original draft did not fail with the upstream symptom")
    for set_name in FIXED_SETS:
        run, check = runs.get(f"fixed-draft/{set_name}"), checks[set_name]
        start, end = check["affected_from"], check["affected_to"]
        predicted_fail = start is not None and release >= start and (end is None or release <= end)
        if run is None:
            problems.append(f"fixed-draft/{set_name} did not run")
        elif predicted_fail and (run["passed"] or not run["upstream_symptom"]):
            problems.append(f"fixed-draft/{set_name}: draft check says {base} fails ({check['affected_releases']}), "
                            "but it did not fail with the upstream symptom")
        elif not predicted_fail and not run["passed"]:
            problems.append(f"fixed-draft/{set_name}: draft check says {base} is not affected, but it failed: "
                            + "; ".join(run["failures"][:2]))
    server = Path(section.get("server") or build_dir / "bin" / "llama-server")
    version = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60)
    said = [line for line in (version.stdout + version.stderr).splitlines() if line.startswith("version:")]
    return {
        "base": base,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": ("python bench/fixed_draft.py " + " ".join(sys.argv[1:])) if __name__ == "__main__" else None,
        "machine": {"cores": os.cpu_count(), "os": f"{platform.system()} {platform.release()}"},
        "build_dir": str(build_dir),
        "server": str(server),
        "server_version": said[0] if said else None,
        "sections_loader_from": "b10662",
        "draft_check": {name: {k: checks[name][k] for k in ("draft_rope", "draft_sections", "target_mrope", "affected",
                                                             "affected_releases")} for name in FIXED_SETS},
        "runs": runs,
        "fixed_draft_works_unpatched": all(runs.get(f"fixed-draft/{s}", {}).get("passed") for s in FIXED_SETS),
        "as_draft_check_says": not problems,
        "problems": problems,
        "smoke_wall_s": section.get("wall_s"),
    }


def _cell(run: dict | None) -> str:
    if run is None:
        return "not run"
    statuses = ", ".join(str(s) for s in run["statuses"])
    if run["passed"]:
        return f"pass ({statuses}; {run['accepted']}/{run['drafted']} accepted, = none)"
    return f"fails ({statuses})" + (", upstream symptom" if run["upstream_symptom"] else "")


def table(folder: Path) -> list[str]:
    """docs/drafts.md's rows, one per recorded release: the original and the fixed agree and random drafts."""
    rows = ["| release (unpatched) | plain-rope draft, agree / random | fixed draft, agree / random | "
            "`draft check` of the fixed draft | as it says |", "| --- | --- | --- | --- | --- |"]
    records = [json.loads(p.read_text(encoding="utf-8")) for p in folder.glob("fixed-draft-b*.json")]
    for record in sorted(records, key=lambda r: release_number(r["base"])):
        runs = record["runs"]
        original = " / ".join(_cell(runs.get(f"pinned-image-hole/{s}")) for s in ORIGINAL_SETS)
        fixed = " / ".join(_cell(runs.get(f"fixed-draft/{s}")) for s in FIXED_SETS)
        check = record["draft_check"][FIXED_SETS[0]]
        says = f"affected on {check['affected_releases']}"
        rows.append(f"| {record['base']} | {original} | {fixed} | {says} | "
                    f"{'yes' if record['as_draft_check_says'] else 'NO'} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if "--table" in sys.argv:
        print("\n".join(table(HERE / "proofs")))
        return 0
    parser.add_argument("--table", action="store_true", help="print docs/drafts.md's table of bench/proofs/ and exit")
    parser.add_argument("--build-dir", type=Path, required=True, help="an UNPATCHED build of --base")
    parser.add_argument("--base", required=True, help="its release, bNNNNN")
    parser.add_argument("--fixtures", type=Path, default=None, help="fixtures dir (default: a temp dir)")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="default: bench/proofs/fixed-draft-BASE.json")
    args = parser.parse_args()
    fixtures_dir = args.fixtures or Path(tempfile.mkdtemp(prefix="fixed-draft-"))
    record = prove_release(args.build_dir, args.base, fixtures_dir, args.log_dir)
    out = args.out or HERE / "proofs" / f"fixed-draft-{args.base}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    verdict = "works unpatched" if record["fixed_draft_works_unpatched"] else "fails unpatched"
    print(f"{args.base}: the fixed draft {verdict}; as draft check says: {record['as_draft_check_says']} ({out})")
    for problem in record["problems"]:
        print("  " + problem)
    return 0 if record["as_draft_check_says"] else 1


if __name__ == "__main__":
    sys.exit(main())
