#!/usr/bin/env bash
# Build a llama.cpp base with CUDA, unpatched and patched, and run the smoke
# scenarios on the GPU (-ngl 99) for both. BACKEND=cpu does the same on the CPU
# (a many-core machine builds a stand-in tree quickly). Meant for a GPU machine without
# network or ccache: the unpatched build is copied aside, then the series is
# applied in place and only what it touches is rebuilt.
#
# usage: scripts/cuda-smoke.sh SOURCE_ARCHIVE BASE WORK FIXTURES OUT [CUDA_ARCH] [SCENARIO...]
#   SOURCE_ARCHIVE  tarball of the base tree (e.g. `git archive` of b10359, docs/media/tests left out)
#   BASE            its base name (b10359)
#   WORK            scratch dir; FIXTURES: `dfbuild fixtures` output; OUT: where JSON results go
set -euo pipefail
archive=$1 base=$2 work=$3 fixtures=$4 out=$5 arch=${6:-90}
shift $(( $# < 6 ? $# : 6 ))
scenario_args=()
for s in "$@"; do scenario_args+=(--scenario "$s"); done

dfbuild() { python3 -m dfbuild.cli "$@"; }
backend=${BACKEND:-cuda}
build_args=(--backend "$backend")
[ "$backend" = cuda ] && build_args+=(--cuda-arch "$arch" --cmake-arg=-DGGML_CUDA_NCCL=OFF)
mkdir -p "$work" "$out"
jobs=$(nproc)

[ -d "$work/imported" ] || dfbuild import "$archive" --tag "$base" --dir "$work/imported"
dfbuild checkout --base "$base" --repo "$work/imported" --dir "$work/tree/src"

start=$(date +%s)
dfbuild build --dir "$work/tree/src" "${build_args[@]}" -j "$jobs" --json > "$out/build-unpatched.json"
echo "unpatched $backend build: $(( $(date +%s) - start )) s"
rm -rf "$work/unpatched" && mkdir -p "$work/unpatched" && cp -a "$work/tree/build-$backend/bin" "$work/unpatched/bin"

dfbuild apply --base "$base" --repo "$work/imported" --dir "$work/tree/src" --json > "$out/apply.json"
start=$(date +%s)
dfbuild build --dir "$work/tree/src" "${build_args[@]}" -j "$jobs" --json > "$out/build-patched.json"
echo "patched $backend rebuild: $(( $(date +%s) - start )) s"

for variant in unpatched patched; do
    dir="$work/unpatched"; [ "$variant" = patched ] && dir="$work/tree/build-$backend"
    start=$(date +%s)
    set +e
    dfbuild smoke --build-dir "$dir" --fixtures "$fixtures" --log-dir "$work/logs-$variant" \
        --backend "$backend" "${scenario_args[@]}" --json > "$out/smoke-$variant.json"
    echo "$variant smoke: exit $? in $(( $(date +%s) - start )) s"
    set -e
done
tar -C "$work" -czf "$out/smoke-logs.tar.gz" logs-unpatched logs-patched
