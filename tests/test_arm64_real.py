"""Linux arm64 from Linux x64, for real: the real tree released with `--arch arm64`, run under qemu.

Opt-in (DFBUILD_TEST_ARM64=1), beside the integration and slow markers: a cold arm64
build of a llama.cpp tree is another cold build of the whole tree (no ccache entry
of the x64 builds serves it), which would take `.ci/run` past its budget on two
cores. The release or benchmark run sets the variable (docs/arm64.md).

The same tree as the other real tests (realtrees.REAL_BASE, in the work dir
CACHE/work/<base>), built for arm64 beside the x64 build (build-cpu-arm64, the
baseline variant armv8.0_1, the tests' -O1 flags), the way a user runs it:

- `dfbuild release --base <base> --backend cpu --arch arm64`: the proof (unpatched
  fails under qemu, patched passes) and the archive llama.cpp names
  `...-bin-ubuntu-arm64.tar.gz`, with no wheel;
- every ELF file in it is AArch64 with RUNPATH $ORIGIN, and `dfbuild verify` passes,
  running the unpacked llama-server --version under qemu-aarch64, which names the
  patched commit.

Skipped, saying why, without the cross toolchain, the arm64 OpenSSL or qemu-user.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from realtrees import CACHE, REAL_BASE

from dfbuild import smoke
from dfbuild.core import elf

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("DFBUILD_TEST_ARM64") != "1",
                       reason="the arm64 cross build is opt-in: DFBUILD_TEST_ARM64=1 (a cold build; docs/arm64.md)"),
    pytest.mark.skipif(not sys.platform.startswith("linux") or elf.host_machine() != "x86-64",
                       reason="--arch arm64 is a cross build on Linux x64"),
    pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None or shutil.which("qemu-aarch64") is None
                       or not Path("/usr/lib/aarch64-linux-gnu/libssl.so").exists(),
                       reason="needs the arm64 cross toolchain, its OpenSSL and qemu-user: dpkg --add-architecture "
                              "arm64 && apt-get update && apt-get install g++-aarch64-linux-gnu gcc-aarch64-linux-gnu "
                              "libc6-dev-arm64-cross qemu-user libssl-dev:arm64"),
]

WORK = CACHE / "work" / REAL_BASE
VARIANTS = "armv8.0_1"   # the baseline: any arm64 CPU (and qemu's)


def dfbuild(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfbuild.cli", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    out = tmp_path_factory.mktemp("arm64-release") / "out"
    started = time.monotonic()
    result = dfbuild("release", "--base", REAL_BASE, "--backend", "cpu", "--arch", "arm64",
                     "--cpu-variants", VARIANTS, "--out", out, "--work", WORK, "-j", "2",
                     "--target", "llama-server", "--json")  # llama-server only, for CI's time (docs/ci.md)
    assert result.returncode == 0, result.stderr[-4000:]
    return {"out": out, "manifest": json.loads(result.stdout), "wall_s": time.monotonic() - started}


def test_the_archive_llama_cpp_names_with_aarch64_binaries(released, tmp_path):
    rel = released["manifest"]["release"]
    name = rel["archive"]
    assert name.startswith(f"llama-{REAL_BASE}-dflash-") and name.endswith("-bin-ubuntu-arm64.tar.gz")
    assert (rel["os"], rel["arch"]) == ("linux", "arm64") and rel["wheel"] is None
    assert sorted(p.name for p in released["out"].iterdir() if not p.name.startswith(".")) == sorted(
        [name, "SHA256SUMS", "manifest.json"])
    with tarfile.open(released["out"] / name) as tar:
        tar.extractall(tmp_path, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(tmp_path)
    bin_dir = tmp_path / rel["root"]  # llama.cpp's layout: the binaries at the top of llama-<tag>/
    assert (bin_dir / f"libggml-cpu-{VARIANTS}.so").is_file()
    elves = [p for p in bin_dir.iterdir() if p.is_file() and not p.is_symlink() and elf.is_elf(p.read_bytes()[:64])]
    assert any(p.name == "llama-server" for p in elves)
    for path in elves:
        info = elf.read(path)
        assert info.machine == "AArch64" and info.runpath in (None, "$ORIGIN"), (path.name, info)
    assert "libssl.so.3" in rel["requires"]   # TLS as the x64 build: the system's OpenSSL 3
    # under qemu, the unpacked server names the patched commit
    server = bin_dir / "llama-server"
    prefix, env = smoke.launcher_for(server)
    assert Path(prefix[0]).name.startswith("qemu-aarch64")
    ran = subprocess.run([*prefix, str(server), "--version"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    head = released["manifest"]["series"]["head"]
    assert head[:8] in ran.stdout + ran.stderr, ran.stdout + ran.stderr


def test_verify_passes_and_runs_the_server_under_qemu(released):
    result = dfbuild("verify", released["out"], "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    checked = " ".join(report["checked"])
    assert "llama-server --version names the patched commit" in checked, report
    assert "machine AArch64" in checked, report
