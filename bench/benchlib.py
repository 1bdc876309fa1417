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
