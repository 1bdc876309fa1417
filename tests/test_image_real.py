"""`dfbuild image` on a real CPU release of b11434 (issue 46's "how it is checked").

The release is the one test_release_e2e makes (llama-server only, the tests' CPU variants), made again
here in the same work dir (its builds and smoke are reused: seconds). Then, as root with umoci, skopeo
and mmdebstrap (scripts/test.sh installs them): the image is an OCI archive that skopeo inspect reads
and podman load accepts, whose config runs /app/llama-server with LLAMA_ARG_HOST=0.0.0.0 and exposes
8080; built twice it is the same bytes (the same digest); it was run before it was added (its
entrypoint in its unpacked root answered the image requests through DFlash, drafts accepted); the same
recipe around the unpatched build of the "any head" proof fails them (HTTP 500); `dfbuild verify`
passes the dir with the image in it, and fails on a tampered layer, a changed config, and an image
whose /app is not the archive's.

Costs (2 shared cores): the Debian root once, about 150 MB from Debian's archive and 1.5-2.5 min (then
cached in the test cache); each image build about 20 s, each run before publishing about 60 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from realtrees import CACHE, REAL_BASE, RELEASE_CPU_VARIANTS

from dfbuild.core import manifest, paths, state
from dfbuild.image import build as image_build
from dfbuild.image import make as image

TOOLS = ("umoci", "skopeo", "mmdebstrap", "podman")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                       reason="images are made as root on Linux (mmdebstrap, umoci unpack, chroot)"),
    pytest.mark.skipif(any(shutil.which(t) is None for t in TOOLS), reason=f"needs {', '.join(TOOLS)} "
                       "(apt-get install umoci skopeo mmdebstrap podman; scripts/test.sh does)"),
]


def dfbuild(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfbuild.cli", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("image-release") / "out"
    result = dfbuild("release", "--base", REAL_BASE, "--backend", "cpu", "--out", str(out),
                     "--work", str(CACHE / "work" / REAL_BASE),
                     *(["--cpu-variants", RELEASE_CPU_VARIANTS] if RELEASE_CPU_VARIANTS else []), "-j", "2",
                     "--target", "llama-server")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def imaged(release_dir, tmp_path_factory) -> dict:
    """The release dir with its image, and a copy imaged again from the same release."""
    twin = tmp_path_factory.mktemp("image-twin") / "out"
    shutil.copytree(release_dir, twin)
    result = dfbuild("image", str(release_dir), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads(result.stdout)["images"]
    again = dfbuild("image", str(twin), "--json", "--no-run")
    assert again.returncode == 0, again.stderr[-3000:]
    return {"dir": release_dir, "twin": twin, "record": records[0], "again": json.loads(again.stdout)["images"][0]}


def test_the_image_is_an_oci_archive_skopeo_reads_with_upstreams_config(imaged):
    record, path = imaged["record"], imaged["dir"] / imaged["record"]["name"]
    assert record["name"].endswith("-image-ubuntu-x64.oci.tar") and record["ref"].startswith("llama.cpp-dflash:server-")
    inspected = json.loads(subprocess.run(["skopeo", "inspect", f"oci-archive:{path}"], capture_output=True,
                                          text=True, check=True).stdout)
    assert inspected["Digest"] == record["digest"] and inspected["Architecture"] == "amd64"
    config = json.loads(subprocess.run(["skopeo", "inspect", "--config", f"oci-archive:{path}"], capture_output=True,
                                       text=True, check=True).stdout)["config"]
    assert config["Entrypoint"] == ["/app/llama-server"] and config["WorkingDir"] == "/app"
    assert "LLAMA_ARG_HOST=0.0.0.0" in config["Env"] and config["ExposedPorts"] == {"8080/tcp": {}}
    full = manifest.load(imaged["dir"] / "manifest.json")
    labels = config["Labels"]
    assert labels["dflash.base"] == REAL_BASE and labels["dflash.series"] == full["release"]["tag"].rsplit("-")[-1]
    assert labels["dflash.source-commit"] == full["source"]["commit"]
    assert labels["org.opencontainers.image.revision"] == full["series"]["head"]
    # read from the tree's .devops/cpu.Dockerfile, not the fallback
    assert record["recipe"]["found"] and record["recipe"]["file"] == ".devops/cpu.Dockerfile"
    assert record["healthcheck"][:2] == ["CMD", "curl"] and "ffmpeg" in record["base"]["recipe"]["packages"]
    # part of the release: SHA256SUMS and the manifest list it
    sums = (imaged["dir"] / "SHA256SUMS").read_text()
    assert f"{paths.sha256_file(path)}  {record['name']}\n" in sums
    assert any(a["kind"] == "image" and a["name"] == record["name"] for a in full["release"]["artifacts"])


def test_the_same_release_gives_the_same_image_twice(imaged):
    assert imaged["again"]["digest"] == imaged["record"]["digest"]
    name = imaged["record"]["name"]
    assert paths.sha256_file(imaged["twin"] / name) == paths.sha256_file(imaged["dir"] / name)


def test_podman_load_accepts_it(imaged, tmp_path):
    runroot = Path(tempfile.mkdtemp(prefix="dfb-podman-", dir="/tmp"))  # podman wants a runroot under 50 characters
    store = ["--root", str(tmp_path / "root"), "--runroot", str(runroot), "--storage-driver", "vfs"]
    loaded = subprocess.run(["podman", *store, "load", "-i", str(imaged["dir"] / imaged["record"]["name"])],
                            capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert f"localhost/{imaged['record']['ref']}" in loaded.stdout + loaded.stderr
    digest = subprocess.run(["podman", *store, "image", "inspect", "--format", "{{.Digest}}",
                             f"localhost/{imaged['record']['ref']}"], capture_output=True, text=True, check=True)
    assert digest.stdout.strip() == imaged["record"]["digest"]
    shutil.rmtree(runroot, ignore_errors=True)


def test_it_ran_before_it_was_added_and_drafts_were_accepted(imaged):
    run = imaged["record"]["run"]
    assert run["passed"] is True and {r["scenario"] for r in run["results"]} == {"image", "pinned-image-hole"}
    for result in run["results"]:
        assert result["passed"] and set(result["statuses"]) == {200}, result
        assert result["image_accepted"] > 0, result


def test_the_same_recipe_around_the_unpatched_build_fails(imaged, tmp_path):
    unpatched = CACHE / "work" / REAL_BASE / "unpatched" / "build-cpu" / "bin"
    if not (unpatched / "llama-server").is_file():
        pytest.skip("the unpatched build of the any-head proof (test_any_head) is not there")
    out = tmp_path / "unpatched.oci.tar"
    record = image.control_image(imaged["dir"], unpatched, out)
    assert record["digest"] != imaged["record"]["digest"]
    with state.temp_dir("image-test") as work:
        section = image.run_image(out, record["ref"], "cpu", work, CACHE / "fixtures")
        logs = "".join(p.read_text(errors="replace") for p in (work / "logs").rglob("*.log"))
    assert not section["passed"]
    statuses = {s for r in image.summarize(section) for s in r["statuses"]}
    assert 500 in statuses
    # it ran in the image's root: the CPU backend was loaded from the image's /app
    assert "/app/libggml-cpu-" in logs


def _rerecord(directory: Path, name: str, record: dict | None = None) -> None:
    """SHA256SUMS and manifest.json made true again for DIRECTORY/NAME, as a forger would."""
    full = manifest.load(directory / "manifest.json")
    digest = paths.sha256_file(directory / name)
    for artifact in full["release"]["artifacts"]:
        if artifact["name"] == name:
            artifact["sha256"], artifact["size"] = digest, (directory / name).stat().st_size
    if record is not None:
        full["images"] = [record if i["name"] == name else i for i in full["images"]]
    manifest.save(full, directory / "manifest.json")
    lines = [line for line in (directory / "SHA256SUMS").read_text().splitlines() if not line.endswith(name)]
    (directory / "SHA256SUMS").write_text("\n".join(sorted([*lines, f"{digest}  {name}"], key=lambda x: x[66:]))
                                          + "\n")


def _verify(directory: Path) -> subprocess.CompletedProcess:
    return dfbuild("verify", "--no-run", str(directory))


def test_verify_passes_the_release_with_its_image(imaged):
    result = _verify(imaged["dir"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 layers match their digests" in result.stdout


def _unpacked_layout(path: Path, into: Path) -> Path:
    into.mkdir()
    subprocess.run(["tar", "-xf", str(path), "-C", str(into)], check=True)
    return into


def test_verify_fails_an_image_whose_config_was_changed(imaged, tmp_path):
    tampered = tmp_path / "out"
    shutil.copytree(imaged["twin"], tampered)
    name = imaged["record"]["name"]
    layout = _unpacked_layout(tampered / name, tmp_path / "layout")
    ref = imaged["record"]["ref"]
    # a forger's image: another entrypoint, every digest made right again by umoci, the archive repacked
    subprocess.run(["umoci", "config", "--image", f"{layout}:{ref}", "--config.entrypoint", "/bin/sh"], check=True,
                   capture_output=True)
    subprocess.run(["umoci", "gc", "--layout", str(layout)], check=True)
    image_build.oci_archive(layout, tampered / name, 0)
    found = image_build.read_layout(layout)
    record = {**imaged["again"], "digest": found["digest"], "config_digest": found["config_digest"]}
    _rerecord(tampered, name, record)
    result = _verify(tampered)
    assert result.returncode == 51 and "Entrypoint" in result.stdout, result.stdout[-2000:]


def test_verify_fails_a_flipped_byte_in_a_layer(imaged, tmp_path):
    tampered = tmp_path / "out"
    shutil.copytree(imaged["twin"], tampered)
    name = imaged["record"]["name"]
    layout = _unpacked_layout(tampered / name, tmp_path / "layout")
    blob = layout / "blobs" / "sha256" / imaged["record"]["layers"][1]["digest"].split(":")[1]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    image_build.oci_archive(layout, tampered / name, 0)
    _rerecord(tampered, name)
    result = _verify(tampered)
    assert result.returncode == 51 and "does not have the sha256 it is named by" in result.stdout


def test_verify_fails_an_image_whose_app_is_not_the_archives(imaged, tmp_path):
    unpatched = CACHE / "work" / REAL_BASE / "unpatched" / "build-cpu" / "bin"
    if not (unpatched / "llama-server").is_file():
        pytest.skip("the unpatched build of the any-head proof (test_any_head) is not there")
    tampered = tmp_path / "out"
    shutil.copytree(imaged["twin"], tampered)
    name = imaged["record"]["name"]
    record = image.control_image(tampered, unpatched, tampered / name)  # all digests right, /app another build's
    _rerecord(tampered, name, {**record, "run": imaged["again"]["run"]})
    result = _verify(tampered)
    assert result.returncode == 51 and "differs from the archive's bytes" in result.stdout, result.stdout[-2000:]
