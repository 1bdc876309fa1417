"""ROCm/HIP for real, in dfbuild's Debian forky root: the root made, llama.cpp built with GGML_HIP=ON, released.

Opt-in (a release or benchmark run, never `.ci/run`): set DFBUILD_HIP_TESTS=1, and
DFBUILD_HIP_TEST_CACHE_DIR to a dfbuild cache dir whose root is made already (else the
test cache gets its own).
Making the root downloads 553 MB and takes 5.3 GB of disk (docs/hip.md
has the measured figures), and ggml-hip compiles more than a hundred HIP files
for each GPU target: well over an hour on two cores. Needs root (the build runs
in a private mount namespace, chrooted into the root) and mmdebstrap.

On a release no issue names (DFBUILD_HIP_TEST_BASE, default b11393), for one
GPU target (gfx1100) and the x86-64 baseline CPU variant, the way a user runs it:

- the root holds ROCm 6.4 (hipcc 7.0, libamdhip64-dev/libhipblas-dev/librocblas-dev 6.4);
- `dfbuild release --backend hip --allow-cpu-fallback`: there is no AMD GPU here, so
  the smoke runs on the HIP build's CPU backend (without the flag it stops, exit 45),
  the server's log says that no ROCm device was found, and the manifest records it
  (device none, ran_on "no AMD device here, ran on the CPU backend", cpu_fallback true);
- the archive is named as llama.cpp names its ROCm build (`-bin-ubuntu-rocm-6.4-x64`);
- `dfbuild verify` passes, says the glibc floor is forky's and where the smoke ran;
- its `llama-server --version`, run inside the root, names the patched commit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from realtrees import CACHE

from dfbuild.host.platforms import rocm_root

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.hip,
    pytest.mark.skipif(os.environ.get("DFBUILD_HIP_TESTS") != "1",
                       reason="opt-in: DFBUILD_HIP_TESTS=1 makes the forky ROCm root (553 MB download, 5.3 GB on "
                              "disk) and builds ggml-hip (over an hour on 2 cores); see docs/hip.md"),
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("mmdebstrap") is None,
                       reason="needs Linux, root and mmdebstrap (apt-get install mmdebstrap)"),
]

BASE = os.environ.get("DFBUILD_HIP_TEST_BASE", "b11393")
TARGET = "gfx1100"
# DFBUILD_HIP_TEST_WORK: a release's --work dir to resume (its builds and remembered smoke passes are reused)
WORK = Path(os.environ.get("DFBUILD_HIP_TEST_WORK") or CACHE / "work-hip" / BASE)
FALLBACK = "no AMD device here, ran on the CPU backend"


def dfbuild(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, rocm_root.ROOT_ENV: "forky"}
    return subprocess.run([sys.executable, "-m", "dfbuild.cli", *map(str, args)], capture_output=True, text=True,
                          env=env)


# The tests' conftest points DFBUILD_CACHE_DIR at the test cache, where a second 5.3 GB root would be made:
# DFBUILD_HIP_TEST_CACHE_DIR names the dfbuild cache that holds (or is to hold) the root instead.
ROOT_CACHE = os.environ.get("DFBUILD_HIP_TEST_CACHE_DIR")


@pytest.fixture(scope="module", autouse=True)
def root_cache():
    before = os.environ.get("DFBUILD_CACHE_DIR")
    if ROOT_CACHE:
        os.environ["DFBUILD_CACHE_DIR"] = ROOT_CACHE
    yield
    if before is None:
        os.environ.pop("DFBUILD_CACHE_DIR", None)
    else:
        os.environ["DFBUILD_CACHE_DIR"] = before


@pytest.fixture(scope="module")
def root(root_cache) -> Path:
    return rocm_root.ensure()


@pytest.fixture(scope="module")
def released(root, tmp_path_factory):
    out = tmp_path_factory.mktemp("hip-out")
    result = dfbuild("release", "--base", BASE, "--backend", "hip", "--gpu-targets", TARGET, "--cpu-variants",
                     "x64", "--allow-cpu-fallback", "--work", WORK, "--out", out,
                     "--target", "llama-server", "--json")  # llama-server only, for CI's time (docs/ci.md)
    assert result.returncode == 0, result.stderr[-4000:]
    return out, json.loads(result.stdout)


def test_the_root_holds_rocm_6_4(root):
    made = rocm_root.record(root)
    assert made["rocm"]["hipcc"].startswith("7.0.")
    for package in ("libamdhip64-dev", "libhipblas-dev", "librocblas-dev"):
        assert made["rocm"][package].startswith("6.4.")
    assert rocm_root.run(root, ["hipconfig", "--version"]).startswith("6.4.")
    assert TARGET in made["gpu_targets"]


def test_the_archive_is_named_as_llama_cpps_rocm_build(released):
    out, _ = released
    names = [p.name for p in out.glob("*.tar.gz")]
    assert len(names) == 1 and names[0].endswith("-bin-ubuntu-rocm-6.4-x64.tar.gz") and "-dflash-" in names[0], names


def test_the_smoke_ran_on_the_cpu_backend_saying_no_rocm_device_was_found(released):
    out, _ = released
    logs = "\n".join(p.read_text(errors="replace") for p in WORK.rglob("*.log") if "smoke" in str(p))
    assert "no ROCm-capable device is detected" in logs or "no HIP device" in logs.lower()


def test_the_manifest_says_the_smoke_ran_on_the_cpu_backend_with_no_amd_device(released):
    out, manifest = released
    smoke = manifest["smoke"]
    assert smoke["passed"] is True
    assert smoke["device"] is None and smoke["cpu_fallback"] is True and smoke["ran_on"] == FALLBACK, smoke
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["smoke"]["ran_on"] == FALLBACK and on_disk["smoke"]["cpu_fallback"] is True


def test_verify_passes_and_states_the_forky_glibc_floor(released):
    out, _ = released
    result = dfbuild("verify", out, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert any("glibc floor is forky's" in line for line in report["checked"]), report["checked"]
    assert any("names the patched commit" in line for line in report["checked"]), report["checked"]
    assert any(f"not on a hip device ({FALLBACK})" in line for line in report["checked"]), report["checked"]


def test_the_unpacked_server_names_the_patched_commit_inside_the_root(released, root, tmp_path):
    out, manifest = released
    archive = next(out.glob("*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path, filter="data")
    server = next(tmp_path.glob("*/llama-server"))
    done = subprocess.run([*rocm_root.launcher_for_root(root), str(server), "--version"], capture_output=True,
                          text=True, cwd=tmp_path)
    patched = manifest["series"]["head"] if "series" in manifest else manifest["build"]["source_commit"]
    assert patched[:8] in done.stdout + done.stderr
