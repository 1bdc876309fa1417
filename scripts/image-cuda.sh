#!/usr/bin/env bash
# The CUDA image of a CUDA release, started on the GPU: for the lent GPU machine (no network, no
# umoci, no mmdebstrap, no skopeo). It runs after scripts/cuda-release.sh on the same warm machine,
# whose release dir (/tmp/dist: the CUDA archive, its cudart archive, SHA256SUMS, manifest.json) it
# makes the image of. Two steps:
#
#   bash scripts/image-cuda.sh prepare [BASE]   # HERE, in the repo root, as root, with network (Debian)
#   bash scripts/image-cuda.sh run              # THERE, after `bash scripts/cuda-release.sh run BASE`
#
# prepare runs `scripts/cuda-release.sh prepare BASE` (the wheels in .whl/, the sdist in .carry/:
# what the release call carries) and fills .carry-image/ (ignored by git) with what this call carries:
#   base/    the image's Debian root as dfbuild's cache keeps it (rootfs.tar.xz and record.json): a
#            slim root of the CUDA Dockerfile's packages without ffmpeg (libgomp1 curl, and the
#            archive's libssl3 and libibverbs1), 140 MB unpacked, about 26 MB as xz (the full root, 595 MB with
#            ffmpeg, does not fit the 64 MiB a call may carry);
#   umoci    Debian 12's umoci (a Go program that needs only libc), which assembles and unpacks it.
# The release call carries [".whl", ".carry"]; this one [".whl", ".carry-image"] (about 35 MB).
#
# run makes the image (`dfbuild image /tmp/dist --no-run`, with DFBUILD_IMAGE_PACKAGES naming the slim
# root and DFBUILD_IMAGE_NO_SKOPEO=1), verifies the dir with the image in it (--no-run), unpacks the
# image (umoci unpack), puts the host's NVIDIA driver libraries into its root (what the NVIDIA
# container toolkit mounts into a container: libcuda and the libraries it loads), and starts the
# image's entrypoint in its root on the GPU with the smoke's image scenarios through DFlash. $OUT gets
# report.txt, image.json (the image's record), run.json (the smoke section) and logs.tar.gz.
# Budget: about 3 minutes (image 30 s, verify 40 s, unpack 20 s, smoke 60 s on 16 cores).
#
# Tested here on CPU at small scale: DIST=<a CPU release dir> OUT=<dir> IMAGE_BACKEND=cpu run.
set -euo pipefail
mode=${1:-}
base=${2:-${BASE:-b11434}}
here=$(pwd)
[ -f "$here/pyproject.toml" ] && [ -d "$here/src/dfbuild" ] || { echo "run it from the dfbuild repo root" >&2; exit 2; }
# the CUDA Dockerfile's runtime packages without ffmpeg (docs/images.md: the slim root)
slim_packages=libgomp1,curl
dist=${DIST:-/tmp/dist}

# shellcheck source=scripts/device-lib.sh
. "$(dirname "$0")/device-lib.sh"

case "$mode" in
prepare)
    bash "$here/scripts/cuda-release.sh" prepare "$base"
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qxF /.carry-image/ "$exclude" 2>/dev/null || echo /.carry-image/ >> "$exclude"
    rm -rf .carry-image && mkdir -p .carry-image/base
    py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
    # the slim root through dfbuild's own cache (made once with mmdebstrap, as root)
    entry=$(PYTHONPATH="$here/src" "$py" -c "
import sys
from dfbuild.image import rootfs as image_rootfs
packages = sys.argv[1].split(',') + ['libssl3', 'libibverbs1']  # + the GPU machine's CUDA archive's system
# libraries (its release.requires: OpenSSL, and libibverbs, which b11434's CMake links where the host has it)
layer, _ = image_rootfs.ensure(image_rootfs.recipe(packages, 'x64'))
print(layer.parent)" "$slim_packages")
    xz -T0 -6 -c "$entry/rootfs.tar" > .carry-image/base/rootfs.tar.xz
    cp "$entry/record.json" .carry-image/base/
    basename "$entry" > .carry-image/base/entry
    cp "$(command -v umoci)" .carry-image/umoci
    du -sh .whl .carry .carry-image
    echo "first: carry [\".whl\", \".carry\"]: bash scripts/cuda-release.sh run $base"
    echo "then:  carry [\".whl\", \".carry-image\"]: bash scripts/image-cuda.sh run"
    ;;
run)
    : "${OUT:?run it on the device machine, where \$OUT is set}"
    [ -f "$dist/manifest.json" ] || { echo "no release in $dist: run scripts/cuda-release.sh run first" >&2; exit 2; }
    [ -f .carry-image/base/rootfs.tar.xz ] || { echo "carry .carry-image (prepare it here first)" >&2; exit 2; }
    start=$(date +%s) report="$OUT/report.txt" logs=/tmp/image-logs
    mkdir -p "$logs"
    say() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$report"; }
    # shellcheck disable=SC2329  # (run by the EXIT trap)
    finish() { ls -l "$dist" >> "$report" 2>&1; tar -czf "$OUT/logs.tar.gz" -C "$logs" . 2>/dev/null || true; }
    trap finish EXIT
    if ls .whl/*.whl > /dev/null 2>&1; then install_carry say; else export PYTHONPATH="$here/src"; fi
    export DFBUILD_CACHE_DIR=${DFBUILD_CACHE_DIR:-/tmp/dfbuild-cache}
    entry="$DFBUILD_CACHE_DIR/image-base/$(cat .carry-image/base/entry)"
    if [ ! -f "$entry/record.json" ]; then
        rm -rf "$entry" && mkdir -p "$entry"
        xz -d -c .carry-image/base/rootfs.tar.xz > "$entry/rootfs.tar"
        cp .carry-image/base/record.json "$entry/"   # written last: the entry is complete
    fi
    mkdir -p /tmp/image-bin && install -m 0755 .carry-image/umoci /tmp/image-bin/umoci
    export PATH="/tmp/image-bin:$PATH" DFBUILD_IMAGE_PACKAGES=$slim_packages
    command -v skopeo > /dev/null || export DFBUILD_IMAGE_NO_SKOPEO=1
    dfbuild() { python3 -m dfbuild.cli "$@"; }
    { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true; umoci --version; } >> "$report" 2>&1
    say "image of $dist (slim root: $slim_packages)"
    code=0
    dfbuild image "$dist" --no-run --json > "$OUT/image.json" 2> "$logs/image.log" || code=$?
    say "image exit $code"
    if [ "$code" != 0 ]; then tail -30 "$logs/image.log" | tee -a "$report"; exit "$code"; fi
    dfbuild verify --no-run "$dist" > "$logs/verify.txt" 2>&1 || code=$?
    say "verify --no-run exit $code: $(grep -c 'ok ' "$logs/verify.txt") checks ok"
    grep -i "image" "$logs/verify.txt" >> "$report" || true
    say "unpack the image, start its entrypoint in its root ${IMAGE_BACKEND:-on the GPU}"
    python3 - "$dist" "$OUT/run.json" "${IMAGE_BACKEND:-cuda}" "$logs" >> "$report" 2>&1 <<'PY' || code=$?
import glob, json, os, shutil, subprocess, sys
from pathlib import Path

from dfbuild.smoke import image_root as image_run
from dfbuild.image import make as image
from dfbuild.smoke import fixtures
from dfbuild.core import manifest, paths

dist, out, backend, logs = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
record = manifest.load(dist / "manifest.json")["images"][0]
work = Path("/tmp/image-run")
shutil.rmtree(work, ignore_errors=True)
bundle = image_run.unpack(dist / record["name"], record["ref"], work)
# what the NVIDIA container toolkit mounts into a container: the driver's libcuda and the libraries it loads
libdir = bundle / "rootfs" / "usr" / "lib" / "x86_64-linux-gnu"
listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
driver = sorted({line.split("=>")[-1].strip() for line in listing.splitlines()
                 if any(f"{n}.so" in line for n in ("libcuda", "libnvidia-ptxjitcompiler", "libnvidia-gpucomp",
                                                     "libnvidia-nvvm", "libnvidia-ml"))})
for lib in driver:
    shutil.copy2(os.path.realpath(lib), libdir / Path(lib).name)
print("driver libraries put in the image's root:", ", ".join(Path(d).name for d in driver) or "none")
fx = paths.cache_dir() / "fixtures"
fixtures.ensure_fixtures(fx)
section = image.smoke_bundle(bundle, fx, logs / "smoke", backend=backend)
out.write_text(json.dumps(section, indent=1, default=str))
for scenario, by_set in section["results"].items():
    for name, result in by_set.items():
        print(f"{scenario}/{name}: {'pass' if result['passed'] else 'FAIL'} statuses {result.get('statuses')} "
              f"image drafts {result.get('image_drafted')} accepted {result.get('image_accepted')} "
              f"{'; '.join(result.get('failures', [])[:2])}")
print("ran on:", section.get("ran_on"))
for log in sorted(glob.glob(str(logs / "smoke" / "*.log")))[:1]:
    print("first line of", Path(log).name, ":", open(log, errors="replace").readline()[:300])
sys.exit(0 if section["passed"] else 1)
PY
    say "run exit $code"
    exit "$code"
    ;;
*)
    echo "usage: bash scripts/image-cuda.sh prepare [BASE] | run" >&2
    exit 2
    ;;
esac
