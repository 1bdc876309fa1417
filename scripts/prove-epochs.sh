#!/usr/bin/env bash
# `dfbuild prove` on the first and the last release of every epoch of patches/series.toml, for a machine
# with many cores and no network (the lent H200 machine: 16 cores, Python 3.12, no ccache). Two steps:
#
#   bash scripts/prove-epochs.sh prepare              # HERE, in the repo root, dfbuild's venv active
#   bash scripts/prove-epochs.sh run [RELEASE...]     # THERE, in the repo root of its copy of the tree
#
# prepare fills two folders that git ignores (it adds them to .git/info/exclude), which the run must
# carry (the device tool's carry list: [".whl", ".carry"]):
#   .whl/            wheels of dfbuild's dependencies that the GPU image lacks, for CPython 3.12 manylinux;
#   .carry/trees.git one bare repo holding every epoch end's imported tree (the one commit `dfbuild
#                    checkout` makes of a release's sdist, tagged bNNNN), packed together: about 36 MiB for
#                    the 15 releases, where their sdists are 525 MB. It is made from dfbuild's cache
#                    (imports/bNNNN.git); a release not there is imported first (PyPI, about 35 MB each).
#   .carry/ungated   the series as it was before issue 37 gated it (patches/ at UNGATED_AT), to show
#                    that the proof's check can fail: see below.
# With the tree itself that is about 45 MB of the 64 MiB a call may carry.
#
# run seeds dfbuild's cache with those imports (so every checkout is offline), then proves the releases
# it is given (default: every epoch end), PARALLEL at a time (default 8, each with -j 2: 16 cores), with
# the tests' flags (-O1, one CPU variant, x64; no web UI: the UI's npm steps need the network, and a proof
# is of speculative.cpp), then checks every prefix of the release's variant in the
# proof's work dir (bench/prefixes.py: each builds, none regresses a run that passes unpatched), and
# writes into $OUT one proofs.tar.gz: each proof's JSON (`dfbuild prove --json`), its prefixes JSON, the
# logs, and a summary. A cold proof took 4.5 to 5 minutes there; one call
# may run 10, so prove the 15 epoch ends in two calls of 8 and 7 (timeout_s 600 each):
#   run b9837 b10159 b10173 b10338 b10355 b10644 b10662 b10705
#   run b10724 b10894 b10901 b10909 b11223 b11236 b11434
# When b11434 is among them and .carry/ungated is there, b11434 is proven once more with that older series,
# in the same work dir (only the patched build compiles again): a proof that must come out still-broken,
# because the ungated zero-fill changes what an M-RoPE draft and an empty draft cache get (its
# held_to_unpatched names the runs that differ). That one is evidence, not a record.
# Back here: tar -xzf proofs.tar.gz; copy each proofs/proof-bNNNN.json to bench/proofs/, record it
# (dfbuild series record-proof --proof bench/proofs/proof-bNNNN.json), take the release out of
# tests/test_drift_record.py's REPROVE_PENDING, and redo the drift report (python bench/drift.py --report-only).
set -euo pipefail
mode=${1:-}
[ $# -gt 0 ] && shift
here=$(pwd)
if [ ! -f "$here/pyproject.toml" ] || [ ! -d "$here/src/dfbuild" ]; then echo "run it from the dfbuild repo root" >&2; exit 2; fi

UNGATED_AT=f596d43f45590b666f9a9f092ed673d4a54d8161  # main before issue 37's series
# the image's packages, the carried wheels, prepare_carry and install_carry
# shellcheck source=scripts/device-lib.sh
. "$(dirname "$0")/device-lib.sh"

epoch_ends() {  # every [[epoch]]'s first and last release, oldest first
    python3 - "$here/patches/series.toml" <<'EOF'
import sys, tomllib
ends = []
for epoch in tomllib.load(open(sys.argv[1], "rb")).get("epoch", []):
    for release in (epoch["first"], epoch["last"]):
        if release not in ends:
            ends.append(release)
print(" ".join(ends))
EOF
}

case "$mode" in
prepare)
    python3 -c "import dfbuild" 2> /dev/null || { echo "activate dfbuild's venv first (. .venv/bin/activate)" >&2; exit 2; }
    prepare_carry
    read -r -a releases <<< "${*:-$(epoch_ends)}"
    pack_trees "${releases[@]}"
    mkdir -p .carry/ungated && git archive "$UNGATED_AT" patches | tar -x -C .carry/ungated
    du -sh .whl .carry
    echo "carry: [\".whl\", \".carry\"]; on the device: bash scripts/prove-epochs.sh run RELEASE..."
    ;;
run)
    require_carry .carry/trees.git
    read -r -a releases <<< "${*:-$(epoch_ends)}"
    begin_run proofs  # /tmp/proofs, $OUT/proofs.tar.gz, say, the tests' -O1
    install_carry say
    seed_imports "${releases[@]}"  # each import as dfbuild's cache keeps it: checkouts need no sdist
    python3 -m dfbuild.cli --version >> "$report" 2>&1
    say "prove ${releases[*]}: cpu, x64, -O1, -j 2, ${PARALLEL:-8} at a time on $(nproc) cores"
    # shellcheck disable=SC2016  # (expanded by the inner bash, one release each)
    printf '%s\n' "${releases[@]}" | xargs -P "${PARALLEL:-8}" -I{} bash -c '
        code=0
        python3 -m dfbuild.cli prove --base "$1" --backend cpu --cpu-variants x64 --no-ui -j 2 --work "/tmp/w/$1" --json \
            > "/tmp/proofs/proof-$1.json" 2> "/tmp/proofs/prove-$1.log" || code=$?
        echo "$1 exit $code (0 fixed, 44 fixed upstream, 43 still broken)"
        if [ "$code" = 0 ]; then
            code=0
            python3 bench/prefixes.py --work "/tmp/w/$1" -j 2 --no-ui --out "/tmp/proofs/prefixes-$1.json" \
                > /dev/null 2> "/tmp/proofs/prefixes-$1.log" || code=$?
            echo "$1 prefixes exit $code (0: every prefix builds, none regresses)"
        fi' _ {} | tee -a "$report"
    if [[ " ${releases[*]} " == *" b11434 "* ]] && [ -f .carry/ungated/patches/series.toml ]; then
        code=0
        python3 -m dfbuild.cli prove --base b11434 --backend cpu --cpu-variants x64 -j "$(nproc)" --work /tmp/w/b11434 \
            --patches .carry/ungated/patches --json > /tmp/proofs/ungated-b11434.json \
            2> /tmp/proofs/ungated-b11434.log || code=$?
        say "b11434 with the ungated series (before issue 37): exit $code (43 still broken is what it should be)"
    fi
    say "done"
    ;;
*)
    echo "usage: bash scripts/prove-epochs.sh prepare [RELEASE...] | run [RELEASE...]" >&2
    exit 2
    ;;
esac
