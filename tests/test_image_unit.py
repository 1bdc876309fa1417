"""The image stage's pieces that need no root, no umoci and no build: the Dockerfile reader, names, the
/app selection, the launcher of an unpacked image (issue 46)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dfbuild.core import archive
from dfbuild.core.errors import ImageInputError, ImageRunError
from dfbuild.image import build as image_build
from dfbuild.image import make as image
from dfbuild.image import recipe as image_recipe
from dfbuild.smoke import image_root as image_run

# A Dockerfile of the shape llama.cpp's .devops/ files have (written for this test): a build stage, a base
# stage with the runtime packages, and the server stage on it.
DOCKERFILE = """\
ARG UBUNTU_VERSION=24.04
FROM docker.io/ubuntu:$UBUNTU_VERSION AS build
RUN apt-get update && apt-get install -y gcc-14 cmake

FROM docker.io/ubuntu:$UBUNTU_VERSION AS base
LABEL org.opencontainers.image.title="x" \\
      org.opencontainers.image.version=$APP_VERSION
RUN apt-get update \\
    && apt-get install -y libgomp1 curl \\
    # a comment inside the continued line
    ffmpeg \\
    && apt clean -y
COPY --from=build /app/lib/ /app

FROM base AS full
RUN apt-get install -y python3 git
ENTRYPOINT ["/app/tools.sh"]

FROM base AS server
ENV LLAMA_ARG_HOST=0.0.0.0
COPY --from=build /app/full/llama /app/full/llama-server /app
WORKDIR /app
HEALTHCHECK CMD [ "curl", "-f", "http://localhost:8080/health" ]
ENTRYPOINT [ "/app/llama-server" ]
"""


def test_the_server_stage_and_its_base_are_read():
    recipe = image_recipe.read_text(DOCKERFILE, ".devops/cpu.Dockerfile")
    assert recipe.found and recipe.note is None
    # the base stage's packages only: not the build stage's compilers, not the full stage's python
    assert recipe.packages == ["libgomp1", "curl", "ffmpeg"]
    assert recipe.env == ["LLAMA_ARG_HOST=0.0.0.0"]
    assert recipe.entrypoint == ["/app/llama-server"] and recipe.workdir == "/app"
    assert recipe.healthcheck == ["CMD", "curl", "-f", "http://localhost:8080/health"]
    assert recipe.programs == ["llama", "llama-server"] and recipe.libraries
    assert "org.opencontainers.image.version" in recipe.labels


@pytest.mark.parametrize("text, why", [
    ("FROM x AS base\nRUN true\n", "no `server` stage"),
    ("FROM x AS server\nENTRYPOINT /app/llama-server --flag\n", "not in exec form"),
    ("FROM x AS server\nENTRYPOINT [\"/app/llama-server\"]\n", "copies no program"),
])
def test_a_dockerfile_of_another_shape_gives_the_fallback_and_says_why(text, why):
    recipe = image_recipe.read_text(text, ".devops/cpu.Dockerfile")
    assert not recipe.found and why in recipe.note
    assert recipe.entrypoint == ["/app/llama-server"] and "llama-server" in recipe.programs


def test_a_tree_without_the_dockerfile_gives_the_fallback(tmp_path):
    recipe = image_recipe.read(tmp_path, "vulkan")
    assert not recipe.found and recipe.file == ".devops/vulkan.Dockerfile" and "has no" in recipe.note
    with pytest.raises(KeyError):
        image_recipe.read(tmp_path, "metal")  # llama.cpp publishes no Metal image


def test_every_archive_backend_with_an_upstream_image_has_its_name():
    names = {b: image_recipe.image_for(b)["name"] for b in ("cpu", "vulkan", "cuda", "hip")}
    assert names == {"cpu": "server", "vulkan": "server-vulkan", "cuda": "server-cuda", "hip": "server-rocm"}
    assert image_recipe.image_for("cuda").get("runtime_archive")


def test_the_image_file_is_named_as_its_archive():
    assert (image.image_file_name("llama-b11434-dflash-e8448d4a-bin-ubuntu-cuda-12.8-x64.tar.gz")
            == "llama-b11434-dflash-e8448d4a-image-ubuntu-cuda-12.8-x64.oci.tar")
    assert image.image_ref({"name": "server"}, "b11434-dflash-e8448d4a") == \
        "llama.cpp-dflash:server-b11434-dflash-e8448d4a"
    with pytest.raises(ImageInputError):
        image.image_file_name("llama-b11434-dflash-e8448d4a-bin-win-cpu-x64.zip")


def _member(name: str, kind: str = "file", link: str | None = None) -> archive.Member:
    return archive.Member(name=name, kind=kind, mode=0o755 if kind == "file" else None,
                          data=b"x" if kind == "file" else None, link=link, size=1 if kind == "file" else 0)


def test_app_takes_the_libraries_the_named_programs_and_dfbuilds_files_only():
    root = "llama-b1-dflash-00000000"
    members = [_member(root, "dir"), _member(f"{root}/llama-server"), _member(f"{root}/llama-cli"),
               _member(f"{root}/libllama.so.0.6.0"), _member(f"{root}/libllama.so.0", "link", "libllama.so.0.6.0"),
               _member(f"{root}/libggml-cpu-haswell.so"), _member(f"{root}/LICENSE"),
               _member(f"{root}/licenses", "dir"), _member(f"{root}/licenses/curl.txt"),
               _member(f"{root}/manifest.json"), _member(f"{root}/REQUIRES.txt")]
    recipe = image_recipe.read_text(DOCKERFILE, "cpu.Dockerfile")
    app, missing = image_build.app_members(members, root, recipe)
    assert sorted(m.name for m in app) == ["LICENSE", "REQUIRES.txt", "libggml-cpu-haswell.so", "libllama.so.0",
                                           "libllama.so.0.6.0", "licenses/curl.txt", "llama-server",
                                           "manifest.json"]
    assert missing == ["llama"]  # a release of llama-server alone: said, not invented


def _bundle(tmp_path: Path) -> Path:
    bundle = tmp_path / "bundle"
    (bundle / "rootfs" / "app").mkdir(parents=True)
    (bundle / "rootfs" / "app" / "llama-server").write_bytes(b"\x7fELF")
    (bundle / "config.json").write_text(json.dumps({"process": {
        "args": ["/app/llama-server"], "env": ["PATH=/usr/bin:/bin", "LLAMA_ARG_HOST=0.0.0.0"], "cwd": "/app"}}))
    (bundle / image_run.MARKER).write_text("{}")
    return bundle


def test_the_smoke_starts_an_unpacked_images_entrypoint_through_its_launcher(tmp_path):
    bundle = _bundle(tmp_path)
    binary = bundle / "rootfs" / "app" / "llama-server"
    assert image_run.app_dir(bundle) == bundle / "rootfs" / "app"
    assert image_run.launcher(binary)[-2:] == ["dfbuild.smoke.image_root", str(bundle)]
    other = tmp_path / "build" / "bin" / "llama-server"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"")
    assert image_run.launcher(other) is None
    (tmp_path / "models").mkdir()
    args = ["-m", str(tmp_path / "models" / "t.gguf"), "--host", "127.0.0.1"]
    command, env = image_run.command(bundle, binary, args, {"LLAMA_ARG_HOST": "1.2.3.4", "HOME": "/root",
                                                            "GGML_VK_VISIBLE_DEVICES": "0"})
    # the image's environment, the device knobs passed, nothing else of this machine's
    assert env == {"PATH": "/usr/bin:/bin", "LLAMA_ARG_HOST": "0.0.0.0", "GGML_VK_VISIBLE_DEVICES": "0"}
    tail = command[command.index(str(bundle / "rootfs")):]
    assert tail == [str(bundle / "rootfs"), "/app", str(tmp_path / "models"), "--", "/app/llama-server", *args]
    with pytest.raises(ImageRunError):
        image_run.command(bundle, other, args, {})


def test_binds_never_cover_the_images_own_app_or_system_folders():
    assert image_run.binds_for(["/app/llama-server", "-m", "/usr/share/x", "--slot", "/app/slots"]) == []


def test_the_release_notes_give_each_image_its_load_and_run_lines():
    from dfbuild.verify.image import notes_lines

    record = {"name": "llama-b1-dflash-0-image-ubuntu-cuda-12.8-x64.oci.tar", "image": "server-cuda",
              "ref": "llama.cpp-dflash:server-cuda-b1-dflash-0", "platform": "linux/amd64", "digest": "sha256:ab"}
    text = "\n".join(notes_lines([record], "ghcr.io/owner"))
    assert "podman load -i llama-b1-dflash-0-image-ubuntu-cuda-12.8-x64.oci.tar" in text
    assert "podman run --rm -p 8080:8080 --device nvidia.com/gpu=all" in text
    assert "docker run --rm -p 8080:8080 --gpus all --health-cmd 'curl -f http://localhost:8080/health'" in text
    assert "ghcr.io/owner/llama.cpp-dflash:server-cuda-b1-dflash-0 -m /models/MODEL.gguf" in text
    assert notes_lines([]) == []


@pytest.mark.integration
def test_b11434s_own_dockerfiles_read_as_their_images(tmp_path):
    """Every image's Dockerfile of a real tree (b11434's sdist, cached) reads without the fallback: the
    server stage's entrypoint and programs, and each backend's own packages (vulkan's Mesa, none extra for
    cuda and rocm, whose vendor base images dfbuild replaces with the cudart archive / its HIP root)."""
    from dfbuild.source import pypi, sdist

    sdist.fetch_sdist(pypi.release_requirement(11434))
    recipes = {}
    for backend in ("cpu", "vulkan", "cuda", "hip"):
        file = f"{image_recipe.DEVOPS}/{image_recipe.image_for(backend)['dockerfile']}"
        tree = image.dockerfile_from_sdist("b11434", file, tmp_path / backend)
        assert tree is not None, file
        recipes[backend] = image_recipe.read(tree, backend)
    for backend, recipe in recipes.items():
        assert recipe.found, (backend, recipe.note)
        assert recipe.entrypoint == ["/app/llama-server"] and recipe.env == ["LLAMA_ARG_HOST=0.0.0.0"], backend
        assert recipe.programs == ["llama", "llama-server"] and recipe.libraries, backend
        assert recipe.healthcheck == ["CMD", "curl", "-f", "http://localhost:8080/health"], backend
        assert recipe.packages[:3] == ["libgomp1", "curl", "ffmpeg"], backend
    assert {"libvulkan1", "mesa-vulkan-drivers"} <= set(recipes["vulkan"].packages)
    assert recipes["cuda"].packages == recipes["cpu"].packages == recipes["hip"].packages


def test_the_rocm_image_stands_on_forky_whose_packages_hold_rocm_and_bookworms_key_is_unchanged():
    from dfbuild.image import rootfs as image_rootfs

    hip = image_rootfs.recipe(["libgomp1", "curl", "ffmpeg", "libamdhip64-6"], "x64",
                              image_recipe.image_for("hip").get("base"))
    assert hip["suite"] == "forky" and hip["apt_options"] and all("forky" in m for m in hip["mirrors"])
    sonames = image_rootfs.base_table("forky")["sonames"]
    assert sonames["librocblas.so.4"] == "librocblas4" and sonames["libssl.so.3"] == "libssl3t64"
    cpu = image_rootfs.recipe(["libgomp1", "curl", "ffmpeg", "libssl3"], "x64")
    assert cpu["suite"] == "bookworm" and "apt_options" not in cpu
    assert image_rootfs.key(cpu) == "892dbc4923b5357e"  # the key the measured CPU image's root was made under
    assert "--aptopt=Acquire::Check-Valid-Until \"false\"" in image_rootfs.mmdebstrap_command(hip, Path("/r"))


def test_every_system_library_a_release_names_has_a_package_in_the_roots_of_its_images():
    """A CUDA release of b11434 built on the lent GPU machine named libibverbs.so.1 (ggml-rpc's RDMA transport,
    which its CMake links wherever the build host has libibverbs) and its image stopped with 53: no package of
    the root was known for it. Every soname the releases describe (backends.toml's runtime_packages) has a
    package in bookworm's root, the ROCm ones in forky's, and libibverbs is among them."""
    from dfbuild.host import backends
    from dfbuild.image import rootfs as image_rootfs

    described = set(backends.table()["runtime_packages"])
    bookworm, forky = image_rootfs.base_table()["sonames"], image_rootfs.base_table("forky")["sonames"]
    rocm = {s for s in described if s.startswith(("libamdhip64", "libhipblas", "librocblas"))}
    assert described - rocm <= set(bookworm) and rocm <= set(forky)
    assert bookworm["libibverbs.so.1"] == forky["libibverbs.so.1"] == "libibverbs1"


def test_release_image_is_refused_before_building_where_llama_cpp_has_no_image(tmp_path):
    """--image on a Windows release: 53 at once, nothing checked out or built (no work dir made)."""
    import subprocess
    import sys

    work = tmp_path / "work"
    done = subprocess.run([sys.executable, "-m", "dfbuild.cli", "release", "--base", "b11434", "--backend", "cpu",
                           "--os", "windows", "--image", "--work", str(work), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    if done.returncode in (30, 33):
        pytest.skip(f"this machine cannot cross-build Windows: {done.stderr.strip()[-200:]}")
    assert done.returncode == 53, done.stderr[-2000:]
    assert "no container image" in done.stderr and not work.exists()


def test_release_image_runs_the_image_on_the_releases_terms(tmp_path, monkeypatch):
    """`release --backend cuda --allow-cpu-fallback --image` on a machine without the GPU: the release's smoke ran
    on the CPU (recorded), and its image stage then refused the same (45) because the option never reached it."""
    from helpers import dfbuild

    from dfbuild.cli import release_cmds
    from dfbuild.core import manifest
    from dfbuild.release import pipeline as release_stage
    from dfbuild.source import checkout as source

    asked = {}
    fake = {"release": {"tag": "t", "os": "linux", "arch": "x64", "backend": "cuda", "artifacts": [], "stages": {}},
            "series": {"head": "0" * 40}, "smoke": {"cpu_fallback": True, "ran_on": "the CPU backend"}}
    monkeypatch.setattr(release_cmds, "check_can_build", lambda *a, **k: None)
    monkeypatch.setattr(source, "check_known", lambda *a, **k: None)
    monkeypatch.setattr(release_stage, "check_wheel_tools", lambda: None)
    monkeypatch.setattr(image_build, "check_tools", lambda: None)
    monkeypatch.setattr(release_stage, "release", lambda *a, **k: fake)
    monkeypatch.setattr(image, "make_images", lambda directory, **kw: asked.update(kw) or [])
    monkeypatch.setattr(manifest, "load", lambda path: fake)
    for fallback in (True, False):
        result = dfbuild("release", "--base", "b11434", "--backend", "cuda", "--image", "--work", tmp_path / "w",
                         "--out", tmp_path / "out", *(["--allow-cpu-fallback"] if fallback else []))
        assert result.exit_code == 0, result.output
        assert asked["allow_cpu_fallback"] is fallback and asked["run"] is True
