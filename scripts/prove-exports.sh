#!/usr/bin/env bash
# `dfbuild series export --upstream` proven at many bases (bench/export_proofs.py), for a machine with many
# cores and no network (the lent H200 machine: 16 cores, Python 3.12, pytest in its image, no ccache). Two steps:
#
#   bash scripts/prove-exports.sh prepare [BASE...]                   # HERE, in the repo root, dfbuild's venv active
#   bash scripts/prove-exports.sh run [--backend cuda] [BASE...]      # THERE, in the repo root of its copy of the tree
#
# prepare fills two folders that git ignores (it adds them to .git/info/exclude), which the run must carry
# (the device tool's carry list: [".whl", ".carry"]):
#   .whl/            wheels of dfbuild's dependencies that the GPU image lacks (device-lib.sh), and of what the
#                    bases' tools/server/tests harness imports that the image lacks: wget (utils.py; built here,
#                    PyPI has only its sdist). The image has pytest, requests, filelock, numpy and PyYAML, which
#                    the harness, the test and the tree's gguf-py import; the run uses the image's python3 with
#                    them (DFBUILD_UPSTREAM_PYTHON), so no venv is made there. The rest of the requirements files
#                    (openai, aiohttp, prometheus-client) are for other tests of the suite.
#   .carry/trees.git every BASE's imported tree, packed together (device-lib.sh pack_trees): about 30 MiB for the
#                    11 default bases.
# The default bases: bench/export_proofs.py's (every epoch's last release, three drawn with seed 44).
#
# run seeds dfbuild's cache with those imports (every checkout offline) and runs bench/export_proofs.py on the
# bases it is given (default: all that were carried), PARALLEL at a time (default: all, at most 8; the cores
# shared among them: -j 2 each for 8 on 16 cores), CPU,
# x64, the tests' -O1; with --backend cuda, one base at a time with -j $(nproc) and CUDA_ARCH (default 90: the
# H200). It writes into $OUT one export-proofs.tar.gz: the record (export-proofs.json), the table, each export
# (patches, PR.md, .dfbuild-export.json), each export's log and both pytest logs. One export is a cold build of
# llama-server at the base (-O1, x64) plus an incremental one and two pytest runs: about 5 minutes at -j 2 there,
# so 8 bases fit one 10-minute call:
#   run b10159 b10338 b10644 b10705 b10894 b10901 b11223 b10662
#   run b10936 b10991 b11434
#   run --backend cuda BASE
# Back here: tar -xzf export-proofs.tar.gz; python bench/export_proofs.py --report export-proofs/export-proofs.json
# prints its rows; each base's record goes to bench/upstream/export-proofs-device[-cuda]-BASE.json (the record
# with that base's row alone), and docs/export.md's table is `--report bench/upstream/export-proofs-*.json`.
set -euo pipefail
mode=${1:-}
[ $# -gt 0 ] && shift
here=$(pwd)
if [ ! -f "$here/pyproject.toml" ] || [ ! -d "$here/src/dfbuild" ]; then echo "run it from the dfbuild repo root" >&2; exit 2; fi

# the image's packages, the carried wheels, prepare_carry, install_carry, pack_trees, seed_imports
# shellcheck source=scripts/device-lib.sh
. "$(dirname "$0")/device-lib.sh"
HARNESS_WHEELS=(wget==3.2)

default_bases() {  # bench/export_proofs.py's: the epochs' last releases and three drawn at random
    python3 - "$here" <<'EOF'
import sys
sys.path.insert(0, sys.argv[1] + "/bench")
import export_proofs
print(" ".join(export_proofs.epoch_lasts() + export_proofs.random_releases(44)))
EOF
}

case "$mode" in
prepare)
    python3 -c "import dfbuild" 2> /dev/null || { echo "activate dfbuild's venv first (. .venv/bin/activate)" >&2; exit 2; }
    prepare_carry
    python3 -m pip wheel -q --no-deps -w .whl "${HARNESS_WHEELS[@]}"
    read -r -a bases <<< "${*:-$(default_bases)}"
    pack_trees "${bases[@]}"
    printf '%s\n' "${bases[@]}" > .carry/bases
    du -sh .whl .carry
    echo "carry: [\".whl\", \".carry\"]; on the device: bash scripts/prove-exports.sh run [--backend cuda] [BASE...]"
    ;;
run)
    require_carry .carry/trees.git
    backend=cpu
    if [ "${1:-}" = --backend ]; then backend=$2; shift 2; fi
    read -r -a bases <<< "${*:-$(tr '\n' ' ' < .carry/bases)}"
    begin_run export-proofs  # /tmp/export-proofs, $OUT/export-proofs.tar.gz, say, the tests' -O1
    install_carry say
    export DFBUILD_UPSTREAM_PYTHON=${DFBUILD_UPSTREAM_PYTHON:-$(command -v python3)}
    seed_imports "${bases[@]}"
    python3 -m dfbuild.cli --version >> "$report" 2>&1
    "$DFBUILD_UPSTREAM_PYTHON" -m pytest --version >> "$report" 2>&1
    if [ "$backend" = cuda ]; then
        say "export proofs ${bases[*]}: cuda (arch ${CUDA_ARCH:-90}), -O1, one at a time, -j $(nproc)"
        set -- --backend cuda --cuda-arch "${CUDA_ARCH:-90}" --parallel 1 -j "$(nproc)" \
            --where "device CUDA (arch ${CUDA_ARCH:-90}), -j $(nproc)"
    else
        parallel=${PARALLEL:-$(( ${#bases[@]} < 8 ? ${#bases[@]} : 8 ))}
        jobs=$(( $(nproc) / parallel > 1 ? $(nproc) / parallel : 1 ))  # every core busy: 8 at a time, -j 2 each
        say "export proofs ${bases[*]}: cpu, x64, -O1, -j $jobs, $parallel at a time on $(nproc) cores"
        set -- --parallel "$parallel" -j "$jobs" --where "device CPU, $(nproc) cores, $parallel at a time at -j $jobs"
    fi
    code=0
    python3 bench/export_proofs.py "${bases[@]}" "$@" --cpu-variants x64 --work /tmp/w \
        --out "$results/export-proofs.json" > "$results/table.md" 2>> "$report" || code=$?
    cat "$results/table.md" >> "$report"
    say "done: exit $code (0: every export failed unpatched and passed patched)"
    ;;
*)
    echo "usage: bash scripts/prove-exports.sh prepare [BASE...] | run [--backend cuda] [BASE...]" >&2
    exit 2
    ;;
esac
