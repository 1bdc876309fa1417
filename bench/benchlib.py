"""Shared helpers of the benchmarks: machine facts, robust statistics, results.json merging.

Standard library only, so the benchmarks run anywhere dfbuild runs (the GPU
machine has python3 + numpy + gguf + dfbuild, no matplotlib).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_JSON = BENCH_DIR / "results.json"
DEFAULT_CACHE = Path(os.environ.get("DFBUILD_BENCH_CACHE", Path.home() / ".cache" / "dfbuild-bench"))
# the layout tests/realtrees.py builds: NAME/src with NAME/build-<backend> beside it
TEST_CACHE = Path(os.environ.get("DFBUILD_TEST_CACHE", Path.home() / ".cache" / "dfbuild-tests"))


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def command_line() -> str:
    """How this benchmark was started, as a shell line (for RESULTS.md)."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(BENCH_DIR.parent)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine_info() -> dict:
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        "gpus": gpus(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "load_average_at_start": load_average(),
    }


def summary(values: list[float]) -> dict | None:
    """Median and spread (min, max) of the repetitions; None when nothing was measured."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "n": len(values),
        "values": [round(v, 4) for v in values],
    }


def load_results(path: Path = RESULTS_JSON) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def merge_results(key: str, label: str | None, section: dict, path: Path = RESULTS_JSON) -> dict:
    """Put SECTION at results[key][label] (or results[key] when label is None), keeping the rest."""
    results = load_results(path)
    if label is None:
        results[key] = section
    else:
        results.setdefault(key, {})[label] = section
    path.write_text(json.dumps(results, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return results


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- which series a figure was measured with ---------------------------------------------


def expected_series_hash(base: str, patches_dir: Path | None = None) -> str | None:
    """The series hash (dfbuild.release.pipeline.series_hash) that applying today's patches/series.toml
    to BASE gives: the base's own variants when series.toml knows it, else those of the epoch
    that holds its build number. None when neither serves BASE (a hash cannot be predicted)."""
    from dfbuild import series
    from dfbuild.release import pipeline as release

    s = series.load_series(patches_dir)
    name = base if any(base in c.variants for c in s.concerns) else None
    if name is None:
        epoch = s.epoch_of(series.base_build(s, base))
        name = epoch.variant if epoch else None
    if name is None:
        return None
    concerns = []
    for concern in s.concerns:
        variant = concern.variants.get(name)
        if variant is None:
            return None
        concerns.append({"id": concern.id, "sha256": variant.sha256,
                         "status": "applied" if variant.file else variant.status})
    return release.series_hash({"concerns": concerns})


def series_record(patched_build: Path) -> dict:
    """What the PATCHED build was made of: the series section `dfbuild apply` left in its tree's
    manifest, its hash, and whether that is the hash today's series.toml gives for its base.

    `current` is False for a build of another series (an older series.toml, or a tree patched
    by hand: the tree's HEAD is not the series' head) and None when it cannot be told.
    """
    from dfbuild.build import tree as build
    from dfbuild.core import manifest
    from dfbuild.release import pipeline as release

    source_dir = build.read_cmake_cache(Path(patched_build)).get("CMAKE_HOME_DIRECTORY")
    section = manifest.load(manifest.tree_manifest_path(Path(source_dir))).get("series") if source_dir else None
    if not section:
        return {"base": None, "hash": None, "expected_hash": None, "current": None,
                "why": f"no series section in the manifest of {source_dir or patched_build}'s tree"}
    head = subprocess.run(["git", "-C", source_dir, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    digest = release.series_hash(section)
    expected = expected_series_hash(section.get("base") or "")
    record = {
        "base": section.get("base"),
        "hash": digest,
        "expected_hash": expected,
        "current": None if expected is None else (digest == expected and head == section.get("head")),
        "head": section.get("head"),
        "concerns": [{k: c.get(k) for k in ("id", "status", "variant", "file", "sha256", "how") if c.get(k)}
                     for c in section.get("concerns", [])],
    }
    if head != section.get("head"):
        record["why"] = f"the tree's HEAD {head[:12]} is not the series' head {str(section.get('head'))[:12]}"
    elif expected is not None and digest != expected:
        record["why"] = f"applied series {digest}, today's series.toml gives {expected} for {section.get('base')}"
    return record


def stale(run: dict) -> str | None:
    """Why a recorded result does not measure today's series ("" never; None when it does)."""
    rec = run.get("series")
    if not rec or not rec.get("hash") or not rec.get("base"):
        return "no series hash recorded (measured before results named their series)"
    today = expected_series_hash(rec["base"])
    if today is None:
        return f"today's series.toml does not serve {rec['base']}"
    if rec["hash"] != today:
        return f"measured with series {rec['hash']}, today's is {today} for {rec['base']}"
    return None
