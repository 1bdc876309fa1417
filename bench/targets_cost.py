#!/usr/bin/env python3
"""What does shipping every tool cost against llama-server alone (issue 36)?

`dfbuild release` builds `all` since issue 36, as llama.cpp's release workflow does;
`dfbuild build` and `prove` keep `llama-server` as their default. This measures the
difference side by side in one run, through the `dfbuild` command line:

* for each target (llama-server, then all): a fresh work dir, `dfbuild apply` of BASE,
  then `dfbuild build --target T` in it, with ccache
  - `--ccache cold` (the default): off for both (CCACHE_DISABLE=1), so neither run is
    helped by the other or by the shared cache;
  - `--ccache warm`: the shared CCACHE_DIR for both, primed first by an untimed
    `--target all` build in a third work dir (so both find every object they compile);
* then the archive: `dfbuild release --target T --skip-smoke` in the same work dir (a
  ninja no-op, then packaging), or, for a base whose proof series.toml does not record
  (`--skip-smoke` is refused there), `dfbuild release --target T` in `--release-work W`,
  a work dir where BASE was already released (proven, built with every tool; its smoke
  pass is reused, since the smoke's key is llama-server and the libraries);
* figures per target: ninja's steps (all, and the compile/link ones), the build's wall
  time, configure and compile time, the programs and libraries built, the archive's
  and the wheel's size and file count; and the ratios all / llama-server.

One command (cold, about 30 minutes on 2 idle cores with --cpu-variants x64):

    python bench/targets_cost.py --base b11434 --cpu-variants x64

Results merge into bench/results.json under "targets_cost"; `python bench/report.py`
redraws the table in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

import benchlib
from benchlib import log
from build_cost import Runner, dfbuild_command

TARGETS = ("llama-server", "all")


def archive_files(path: Path) -> int:
    if path.name.endswith(".zip"):
        with zipfile.ZipFile(path) as zf:
            return sum(1 for i in zf.infolist() if not i.is_dir())
    with tarfile.open(path) as tar:
        return sum(1 for m in tar.getmembers() if not m.isdir())


def measure(runner: Runner, work: Path, base: str, target: str, variants: list[str], jobs: int | None,
            ccache_env: dict, release_work: Path | None) -> dict:
    dfb = dfbuild_command()
    name = target.replace("llama-", "")
    folder = work / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    runner.run(f"apply-{name}", [*dfb, "apply", "--base", base, "--dir", str(folder / "src")])
    args = [*dfb, "build", "--dir", str(folder / "src"), "--backend", "cpu", "--target", target, "--json",
            *variants, *(["-j", str(jobs)] if jobs else [])]
    wall, out = runner.run(f"build-{name}", args, env_extra=ccache_env)
    section = json.loads(out)
    if release_work is None:
        release_args = ["--work", str(folder), "--skip-smoke", "--out", str(folder / "dist")]
        dist = folder / "dist"
    else:
        dist = work / f"dist-{name}"
        if dist.exists():
            shutil.rmtree(dist)
        release_args = ["--work", str(release_work), "--out", str(dist)]
    _, out = runner.run(f"release-{name}", [*dfb, "release", "--base", base, "--backend", "cpu", "--target", target,
                                            "--json", *release_args, *variants], env_extra=ccache_env)
    full = json.loads(out)
    rel = full["release"]
    sizes = {a["kind"]: a["size"] for a in rel["artifacts"]}
    archive = dist / rel["archive"]
    return {
        "target": target,
        "build_wall_s": round(wall, 2),
        "configure_s": section["configure_s"],
        "compile_s": section["compile_s"],
        "steps": section["steps"],
        "compiled_steps": section["compiled_steps"],
        "programs": len(section["binaries"]),
        "libraries": len(section["libraries"]),
        "program_names": sorted(Path(b).name for b in section["binaries"]),
        "archive": rel["archive"],
        "archive_bytes": sizes.get("archive"),
        "archive_files": archive_files(archive),
        "archive_programs": len((full.get("build") or {}).get("binaries") or []),
        "wheel_bytes": sizes.get("wheel"),
        "released_in": "its own work dir (--skip-smoke)" if release_work is None else "--release-work",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="b11434")
    parser.add_argument("--cpu-variants", default="x64", help="passed to dfbuild (default x64: one variant)")
    parser.add_argument("--work-dir", type=Path, default=benchlib.DEFAULT_CACHE / "targets-cost")
    parser.add_argument("--nice", type=int, default=5)
    parser.add_argument("-j", "--jobs", type=int, default=None)
    parser.add_argument("--results", type=Path, default=benchlib.RESULTS_JSON)
    parser.add_argument("--ccache", choices=("cold", "warm"), default="cold",
                        help="cold: ccache off for both builds; warm: the shared CCACHE_DIR, primed first")
    parser.add_argument("--release-work", type=Path, default=None,
                        help="a work dir where BASE was released with every tool (for a base series.toml does not "
                             "record as proven: --skip-smoke is refused there)")
    opts = parser.parse_args()

    import os

    variants = ["--cpu-variants", opts.cpu_variants] if opts.cpu_variants else []
    machine = benchlib.machine_info()
    runner = Runner(opts.work_dir / "logs", opts.nice, dict(os.environ))
    started = benchlib.now_iso()
    ccache_env = {"CCACHE_DISABLE": "1"} if opts.ccache == "cold" else {}
    if opts.ccache == "warm":  # every object either build compiles, in the shared ccache before either is timed
        prime = opts.work_dir / "prime"
        if prime.exists():
            shutil.rmtree(prime)
        runner.run("apply-prime", [*dfbuild_command(), "apply", "--base", opts.base, "--dir", str(prime / "src")])
        runner.run("build-prime", [*dfbuild_command(), "build", "--dir", str(prime / "src"), "--backend", "cpu",
                                   "--target", "all", *variants])
        shutil.rmtree(prime)
    runs = [measure(runner, opts.work_dir, opts.base, target, variants, opts.jobs, ccache_env,
                    opts.release_work.resolve() if opts.release_work else None) for target in TARGETS]
    machine["load_average_at_end"] = benchlib.load_average()
    server, every = runs

    def ratio(key: str) -> float | None:
        return round(every[key] / server[key], 3) if server.get(key) and every.get(key) else None

    section = {
        "date": started,
        "command": benchlib.command_line(),
        "base": opts.base,
        "cpu_variants": opts.cpu_variants,
        "ccache": ("off for both (CCACHE_DISABLE=1): both builds cold" if opts.ccache == "cold" else
                   "warm for both: the shared ccache, primed by an untimed build of every target"),
        "machine": machine,
        "runs": runs,
        "ratios_all_over_server": {key: ratio(key) for key in ("steps", "compiled_steps", "build_wall_s",
                                                                "compile_s", "archive_bytes", "wheel_bytes",
                                                                "archive_files")},
    }
    benchlib.merge_results("targets_cost", None, section, opts.results)
    log(json.dumps(section["ratios_all_over_server"], indent=2))
    log(f"merged into {opts.results} under targets_cost")


if __name__ == "__main__":
    sys.exit(main())
