"""End to end: `dfbuild release --base b10359 --backend cpu`, then use what it made.

The release runs the way a user runs it (a subprocess, offline: the source is
the sdist) in a fresh work dir; the shared ccache keeps the build near a
minute. Then, away from the build dir: the unpacked archive's llama-server
passes the image scenario, the wheel installs into a fresh venv and its
llama-server names the patched commit, `dfbuild verify` passes, and fails on a
one-byte tamper. A rerun resumes and gives byte-identical artifacts.
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

from dfbuild import archive, release, smoke

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the offline b10359 CPU release is checked on Linux"),
]


def dfbuild(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfbuild.cli", *args], capture_output=True, text=True, cwd=cwd)


def release_into(out: Path, work: Path) -> dict:
    result = dfbuild("release", "--base", "b10359", "--backend", "cpu", "--out", str(out), "--work", str(work),
                     "-j", "2", "--json")
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("release-e2e")
    work, out = tmp / "work", tmp / "out"
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
    assert rel["archive"] == f"llama-{rel['tag']}-dflash-bin-linux-cpu-{rel['arch']}.tar.gz"
    assert rel["tag"].startswith("b10359-")
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([rel["archive"], artifact(released, "wheel").name, "SHA256SUMS", "manifest.json"])
    assert json.loads((out / "manifest.json").read_text()) == full
    # the pipeline really ran, and says so
    assert full["source"]["kind"] == "sdist" and full["source"]["base"] == "b10359"
    assert [c["status"] for c in full["series"]["concerns"]] == ["applied"] * 4
    assert full["build"]["source_commit"] == full["series"]["head"]
    assert full["build"]["flags"]["LLAMA_BUILD_COMMIT"] == full["series"]["head"]
    assert full["build"]["toolchain"]
    assert full["smoke"]["passed"] is True and not full["smoke"].get("skipped")
    assert "image" in full["smoke"]["scenarios"]
    assert set(rel["stages"]) == set(release.STAGES)
    assert not rel["stages"]["smoke"]["reused"] and not rel["stages"]["package"]["reused"]
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    wheel = release.parse_wheel_name(artifact(released, "wheel").name)
    assert wheel["version"] == rel["wheel_version"] and wheel["version"].startswith("0.0.10359+dflash.")
    assert (wheel["python"], wheel["abi"]) == ("py3", "none") and wheel["platform"].startswith("linux_")


def test_the_unpacked_archive_passes_the_image_scenario(released, tmp_path):
    rel = released["manifest"]["release"]
    unpacked = tmp_path / "unpacked"
    with tarfile.open(artifact(released, "archive")) as tar:
        for member in tar.getmembers():
            assert archive.unsafe_member(member.name) is None
        tar.extractall(unpacked, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(unpacked)
    root = unpacked / rel["root"]
    assert sorted(p.name for p in root.iterdir()) == ["LICENSE", "bin", "licenses", "manifest.json", "patches"]
    assert len(list((root / "patches").glob("*.patch"))) == 4
    server = smoke.server_binary(root)
    our_libraries_resolve_inside(server, root / "bin")  # $ORIGIN: nothing from the build dir

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
    assert f"commit {released['manifest']['series']['head']}" in result.stdout + result.stderr
    shipped = next((venv / "lib").glob("python3*/site-packages/llama_dflash/bin/llama-server"))
    our_libraries_resolve_inside(shipped, shipped.parent)


def test_verify_passes_and_fails_on_a_one_byte_tamper(released, tmp_path):
    result = dfbuild("verify", str(released["out"]))
    assert result.returncode == 0, result.stderr
    assert "names the patched commit" in result.stderr
    tampered = tmp_path / "tampered"
    shutil.copytree(released["out"], tampered)
    archive = tampered / artifact(released, "archive").name
    data = bytearray(archive.read_bytes())
    data[len(data) // 3] ^= 0x01
    archive.write_bytes(bytes(data))
    result = dfbuild("verify", str(tampered))
    assert result.returncode == 51, result.stderr
    assert "sha256" in result.stderr


def test_a_rerun_resumes_and_gives_byte_identical_artifacts(released, tmp_path):
    again = release_into(tmp_path / "out", released["work"])
    stages = again["release"]["stages"]
    assert stages["apply"]["reused"] and stages["build"]["reused"] and stages["smoke"]["reused"]
    for first, second in zip(released["manifest"]["release"]["artifacts"], again["release"]["artifacts"]):
        assert first["name"] == second["name"]
        assert (released["out"] / first["name"]).read_bytes() == (tmp_path / "out" / second["name"]).read_bytes()
    assert {k: again[k] for k in ("source", "series", "build", "smoke")} == \
           {k: released["manifest"][k] for k in ("source", "series", "build", "smoke")}
