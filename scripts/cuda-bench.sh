#!/usr/bin/env bash
# The series' CUDA speed figures and issue 43's side-by-side run, for the lent GPU machine (no network,
# 16 cores, nvcc, no ccache). Two steps:
#
#   bash scripts/cuda-bench.sh prepare [BASE]   # HERE, in the repo root, with network (PyPI)
#   bash scripts/cuda-bench.sh run [BASE]       # THERE; carry [".whl", ".carry"]
#
# prepare is cuda-release.sh's (the wheels in .whl/, the base's sdist in .carry/). run builds BASE
# unpatched and with today's series (`dfbuild prove` through bench/spec_images.py --build-missing:
# CUDA arch 90, CPU variant x64, no web UI, release flags), then in the same run:
#   - bench/spec_images.py --shape large (the 1.3 B agree target, -ngl 99): spec/none, text/image,
#     patched/unpatched, the goals;
#   - bench/draft_vs_fill.py (the tiny agree and random sets): (a) the patched build with the plain-rope
#     draft (zero rows) against (b) the unpatched build with the fixed draft (jump), text and image.
# $OUT gets bench.tar.gz: results.json (bench/results.json with the two runs merged in), the summary,
# both scripts' output and the server logs. The builds stay in /tmp/dfbuild-tests/work/BASE, where
# `WORK=/tmp/dfbuild-tests/work/BASE bash scripts/cuda-release.sh run BASE` (the next call, on the same
# warm machine) finds them and adds the rest of the tools. Budget: about 8 minutes (prove 5, benches 3).
set -euo pipefail
mode=${1:-}
base=${2:-${BASE:-b11434}}
here=$(pwd)
[ -f "$here/pyproject.toml" ] && [ -d "$here/src/dfbuild" ] || { echo "run it from the dfbuild repo root" >&2; exit 2; }

# shellcheck source=scripts/device-lib.sh
. "$(dirname "$0")/device-lib.sh"

case "$mode" in
prepare)
    # (cuda-release.sh's prepare is prepare_carry and the sdist)
    bash "$here/scripts/cuda-release.sh" prepare "$base"
    echo "carry: [\".whl\", \".carry\"]; on the device: bash scripts/cuda-bench.sh run $base"
    ;;
run)
    require_carry .carry
    begin_run bench
    unset DFBUILD_CMAKE_ARGS  # (begin_run's -O1 is the proofs'; the bench measures what a release ships)
    install_carry say
    export DFBUILD_TEST_CACHE=/tmp/dfbuild-tests
    seed_sdists
    cp bench/results.json "$results/results.json"
    { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true; nvcc --version | tail -1; } >> "$report" 2>&1
    work=$DFBUILD_TEST_CACHE/work/$base
    gpu=(--server-arg="-ngl 99 -ngld 99")
    say "spec_images $base: prove (cuda, arch 90, x64, no UI), then the large shape"
    code=0
    python3 bench/spec_images.py --backend cuda --base "$base" --shape large --build-missing \
        --prove-arg=--cuda-arch=90 --prove-arg=--cpu-variants=x64 --prove-arg=--no-ui \
        --threads 8 "${gpu[@]}" --reps 8 --n-predict 512 --fixtures /tmp/benchfx \
        --log-dir "$results/logs-spec" --results "$results/results.json" > "$results/spec_images.txt" 2>&1 || code=$?
    say "spec_images exit $code"
    tail -12 "$results/spec_images.txt" >> "$report"
    say "draft_vs_fill: zero rows (patched) against a fixed draft (unpatched), agree and random sets"
    python3 bench/draft_vs_fill.py --patched-build "$work/build-cuda" --unpatched-build "$work/unpatched/build-cuda" \
        --reps 5 --n-predict 64 --threads 8 "${gpu[@]}" --label cuda --fixtures /tmp/dvffx \
        --results "$results/results.json" > "$results/draft_vs_fill.txt" 2>&1 || code=$?
    cp -r /tmp/dvffx/logs-draft-vs-fill "$results/" 2>/dev/null || true
    say "draft_vs_fill exit $code"
    cat "$results/draft_vs_fill.txt" >> "$report"
    exit "$code"
    ;;
*)
    echo "usage: bash scripts/cuda-bench.sh prepare|run [BASE]" >&2
    exit 2
    ;;
esac
