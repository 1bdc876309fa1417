#!/usr/bin/env bash
# Issue 43's proof on many releases at once, for a machine with many cores and no network (the lent H200
# machine: 16 cores, Python 3.12, no ccache): each release built UNPATCHED (dfbuild checkout + build, CPU,
# x64, -O1, llama-server alone, no web UI), then bench/fixed_draft.py on it: the bug's request fails with the
# fixtures' plain-rope drafts (HTTP 500) and, from b10662 on, passes with the same drafts after
# `dfbuild draft fix` (identical to --spec-type none, drafts accepted); before b10662 it still fails (the
# loader ignores the key), as `dfbuild draft check` says. Two steps:
#
#   bash scripts/prove-fixed-drafts.sh prepare [RELEASE...]   # HERE, in the repo root, dfbuild's venv active
#   bash scripts/prove-fixed-drafts.sh run [RELEASE...]       # THERE, in the repo root of its copy of the tree
#   bash scripts/prove-fixed-drafts.sh convert                # THERE: the converter patch, before and after
#
# The releases (default): the first release of every epoch of patches/series.toml from b10662 on, the last one
# before it (b10644) and the newest (b11434): 7 releases, one wave of PARALLEL (default 8) builds of -j 2.
# prepare fills .whl/ (wheels) and .carry/trees.git (the releases' imported trees, about 20 MiB): carry
# [".whl", ".carry"]. A cold unpatched CPU build took about 4 minutes there with 8 at a time (prove-epochs.sh:
# a proof, two builds of which one incremental, took 4.5 to 5), so one call of timeout_s 600 runs all 7.
# run writes into $OUT one fixed-drafts.tar.gz: fixed-drafts/fixed-draft-bNNNN.json (bench/fixed_draft.py's
# record), each release's build log and smoke logs, and summary.txt.
# convert runs bench/convert_drafts.py (a draft converted by b11434's convert_hf_to_gguf.py against each target
# config; the image's python3 has torch, safetensors and transformers) on b11434's converter before and after
# bench/upstream/converter-b11434's patch (prepare carries both, .carry/converter: convert_hf_to_gguf.py,
# conversion/ and gguf-py/ alone, about 3 MiB) and writes $OUT/convert_drafts-converter-fix.json (a minute).
# Back here: tar -xzf fixed-drafts.tar.gz; copy fixed-drafts/fixed-draft-bNNNN.json to bench/proofs/ and add a
# row per release to docs/drafts.md's "Proven" table (bench/fixed_draft.py --table prints the rows).
set -euo pipefail
mode=${1:-}
[ $# -gt 0 ] && shift
here=$(pwd)
[ -f "$here/pyproject.toml" ] && [ -d "$here/src/dfbuild" ] || { echo "run it from the dfbuild repo root" >&2; exit 2; }

# the image's packages, the carried wheels, prepare_carry, install_carry, pack_trees and seed_imports
# shellcheck source=scripts/device-lib.sh
. "$(dirname "$0")/device-lib.sh"

default_releases() {  # the first release of each epoch from b10662, the last before it, the newest
    python3 - "$here/patches/series.toml" <<'EOF'
import sys, tomllib
epochs = tomllib.load(open(sys.argv[1], "rb")).get("epoch", [])
number = lambda release: int(release.lstrip("b"))
before = [e["last"] for e in epochs if number(e["last"]) < 10662]
chosen = [max(before, key=number)] + [e["first"] for e in epochs if number(e["first"]) >= 10662]
newest = max((e["last"] for e in epochs), key=number)
print(" ".join(chosen + ([newest] if newest not in chosen else [])))
EOF
}

case "$mode" in
prepare)
    python3 -c "import dfbuild" 2> /dev/null || { echo "activate dfbuild's venv first (. .venv/bin/activate)" >&2; exit 2; }
    prepare_carry
    read -r -a releases <<< "${*:-$(default_releases)}"
    pack_trees "${releases[@]}"
    # b11434's converter as released and with the patch sent upstream (the measurement `convert` makes)
    mkdir -p .carry/converter/b11434-before
    git --git-dir=.carry/trees.git archive b11434 convert_hf_to_gguf.py conversion gguf-py \
        | tar -x -C .carry/converter/b11434-before
    cp -r .carry/converter/b11434-before .carry/converter/b11434-after
    patch -s -p1 -d .carry/converter/b11434-after < "$(ls "$here"/bench/upstream/converter-b11434/0001-*.patch)"
    du -sh .whl .carry
    echo "carry: [\".whl\", \".carry\"]; on the device: bash scripts/prove-fixed-drafts.sh run ${releases[*]}"
    ;;
run)
    require_carry .carry/trees.git
    read -r -a releases <<< "${*:-$(default_releases)}"
    begin_run fixed-drafts  # /tmp/fixed-drafts, $OUT/fixed-drafts.tar.gz, say, the tests' -O1
    install_carry say
    seed_imports "${releases[@]}"
    python3 -m dfbuild.cli --version >> "$report" 2>&1
    python3 -m dfbuild.cli -q fixtures --out "$results/fixtures" > /dev/null  # one set of fixtures for every run
    say "build unpatched and run fixed-draft on ${releases[*]}: cpu, x64, -O1, -j 2, ${PARALLEL:-8} at a time on $(nproc) cores"
    # shellcheck disable=SC2016  # (expanded by the inner bash, one release each)
    printf '%s\n' "${releases[@]}" | xargs -P "${PARALLEL:-8}" -I{} bash -c '
        work=${WORK_ROOT:-/tmp/w}/$1 results=$2 code=0
        { python3 -m dfbuild.cli checkout --base "$1" --dir "$work/src" &&
          python3 -m dfbuild.cli build --dir "$work/src" --backend cpu --cpu-variants x64 --no-ui -j 2; } \
            > "$results/build-$1.log" 2>&1 || code=$?
        if [ "$code" != 0 ]; then echo "$1 build exit $code (see build-$1.log)"; exit 0; fi
        python3 bench/fixed_draft.py --build-dir "$work/build-cpu" --base "$1" --fixtures "$results/fixtures" \
            --log-dir "$results/logs-$1" --out "$results/fixed-draft-$1.json" || code=$?
        echo "$1 fixed-draft exit $code (0: as draft check says)"' _ {} "$results" | tee -a "$report"
    say "done"
    ;;
convert)
    require_carry .carry/converter/b11434-after
    say() { echo "$*" >&2; }
    install_carry say  # bench/convert_drafts.py imports dfbuild (its fixtures), which needs the carried wheels
    python3 -c "import torch, safetensors, transformers" || { echo "python3 needs torch, safetensors, transformers" >&2; exit 2; }
    python3 bench/convert_drafts.py --python python3 --out "$OUT/convert_drafts-converter-fix.json" \
        .carry/converter/b11434-before .carry/converter/b11434-after
    ;;
*)
    echo "usage: bash scripts/prove-fixed-drafts.sh prepare [RELEASE...] | run [RELEASE...] | convert" >&2
    exit 2
    ;;
esac
