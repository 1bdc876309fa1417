"""One OCI image archive from one release archive: its /app layer, the config, assembled by umoci.

The image is two layers, both uncompressed tars that umoci compresses and
describes (umoci writes the OCI JSON: the blobs, the manifest, the config, the
index):

1. the Debian root (image.rootfs: minbase plus the Dockerfile's runtime
   packages), cached: the same bytes for every image with the same packages;
2. /app: what the Dockerfile's `server` stage copies there, taken from the
   release archive's own members (read with the strict reader verify uses):
   the shared libraries (`COPY --from=build /app/lib/ /app`), the programs it
   names (`llama`, `llama-server`), and dfbuild's files beside them in the
   archive (LICENSE, licenses/, patches/, manifest.json, REQUIRES.txt). For a
   CUDA archive, the CUDA runtime libraries of its cudart archive go there too
   (the `$ORIGIN` RUNPATH finds them, as beside an unpacked archive).

The config takes the Dockerfile's ENTRYPOINT, ENV and WORKDIR, exposes 8080,
and carries OCI labels naming the base, the series, the source and patched
commits and the archive. OCI's image config has no health check (Docker's
own format does): the Dockerfile's HEALTHCHECK is recorded in the manifest and
the release notes give it as `--health-cmd`.

Reproducible: every time in the image is the release's SOURCE_DATE_EPOCH (the
layer's files, the config's `created`, its history), tars are written by GNU
tar with sorted names, numeric owners 0 and fixed times, and umoci's gzip has
no time in its header; the OCI archive is the layout packed the same way. The
same release and base layer give the same image digest and the same archive
bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath

from dfbuild.core import archive, proc
from dfbuild.core.errors import ImageCheckError, ImageInputError, ImageToolError
from dfbuild.image.recipe import Recipe, table

OWN_FILES = ("LICENSE", "licenses", "patches", "manifest.json", "REQUIRES.txt")
LABEL_PREFIX = "dflash."               # not dfbuild.X: that reads as a Python module path
TOOLS = ("umoci", "skopeo", "tar")
# set (to 1) where skopeo cannot be installed (the GPU machine of scripts/image-cuda.sh): the OCI archive is
# then not read back by skopeo, and the image's record says so
NO_SKOPEO_ENV = "DFBUILD_IMAGE_NO_SKOPEO"


def _tools() -> tuple[str, ...]:
    return tuple(t for t in TOOLS if not (t == "skopeo" and os.environ.get(NO_SKOPEO_ENV) == "1"))
DOCKER_ARCH = {"x64": "amd64", "arm64": "arm64"}


def check_tools() -> dict[str, str]:
    """{tool: version} of umoci and skopeo (and GNU tar), or ImageToolError naming what to install."""
    missing = [t for t in _tools() if shutil.which(t) is None]
    if missing:
        raise ImageToolError(f"{', '.join(missing)} not installed: images are assembled with umoci and checked "
                             "with skopeo", "apt-get install umoci skopeo mmdebstrap (Debian 12 has them)")
    versions = {}
    for tool in _tools():
        done = proc.run([tool, "--version"], errors="replace")
        versions[tool] = (done.stdout.strip().splitlines() or ["?"])[0]
    return versions


def _run(args: list[str], what: str) -> str:
    done = proc.run(args, errors="replace", stdin=proc.DEVNULL)
    if done.returncode != 0:
        raise ImageToolError(f"{what} failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-400:]}",
                             f"the command was: {' '.join(map(str, args))}")
    return done.stdout


def is_library(name: str) -> bool:
    return ".so" in PurePosixPath(name).name and PurePosixPath(name).name.startswith("lib")


def app_members(members: list[archive.Member], root: str | None, recipe: Recipe) -> tuple[list[archive.Member], list]:
    """(the members that go to /app, renamed relative to it; the programs the recipe names that the archive
    lacks). ROOT is the archive's top folder (llama-<tag>), None for a flat one."""
    prefix = f"{root}/" if root else ""
    picked, found = [], set()
    for member in members:
        if member.kind == "dir" or not member.name.startswith(prefix):
            continue
        rel = member.name[len(prefix):]
        top = rel.split("/", 1)[0]
        keep = (top in OWN_FILES or (recipe.libraries and "/" not in rel and is_library(rel))
                or ("/" not in rel and rel in recipe.programs))
        if keep:
            picked.append(archive.Member(name=rel, kind=member.kind, mode=member.mode, data=member.data,
                                         link=member.link, size=member.size))
            found.add(rel)
    missing = [p for p in recipe.programs if p not in found]
    return picked, missing


def members_from_dir(folder: Path) -> list[archive.Member]:
    """The plain files and links at the top of FOLDER (a build's bin/) as archive members."""
    found = []
    for path in sorted(folder.iterdir()):
        if path.is_symlink():
            found.append(archive.Member(name=path.name, kind="link", mode=0o777, link=str(path.readlink())))
        elif path.is_file():
            data = path.read_bytes()
            found.append(archive.Member(name=path.name, kind="file", mode=path.stat().st_mode & 0o755, data=data,
                                        size=len(data)))
    return found


def layer_tar(stage: Path, layer: Path, epoch: int, top: str = "app") -> None:
    """STAGE/TOP packed into LAYER reproducibly (GNU tar: sorted, owner 0, one mtime, no atime/ctime)."""
    _run(["tar", "--create", "--file", str(layer), "--directory", str(stage), "--sort=name", "--owner=0",
          "--group=0", "--numeric-owner", "--format=posix",
          "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime", f"--mtime=@{epoch}", top],
         "tar (the image's /app layer)")


def iso(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def labels(release: dict, source: dict, series: dict, image_name: str, extra: dict[str, str]) -> dict[str, str]:
    """The config's labels: OCI's annotations (as llama.cpp's Dockerfile sets them) and dfbuild's own."""
    found = {
        "org.opencontainers.image.created": iso(release["source_date_epoch"]),
        "org.opencontainers.image.version": release["tag"],
        "org.opencontainers.image.revision": series.get("head") or "",
        "org.opencontainers.image.title": f"llama.cpp {image_name} with the DFlash multimodal fix",
        "org.opencontainers.image.description": "llama-server of llama.cpp " + str(source.get("base"))
                                                + ", patched for DFlash drafts on image requests (dfbuild)",
        f"{LABEL_PREFIX}base": str(source.get("base") or ""),
        f"{LABEL_PREFIX}series": release["tag"].rsplit("-", 1)[-1],
        f"{LABEL_PREFIX}source-commit": str(source.get("commit") or ""),
        f"{LABEL_PREFIX}patched-commit": series.get("head") or "",
        f"{LABEL_PREFIX}archive": release["archive"],
    }
    found.update(extra)
    return found


def config_args(recipe: Recipe, entry: dict, label_map: dict[str, str], arch: str, epoch: int) -> list[str]:
    """umoci config's arguments: entrypoint, environment, ports, working dir, labels, platform, created."""
    cfg = table()["config"]
    env = [f"PATH={cfg['path']}", *recipe.env, *entry.get("env", [])]
    args = ["--created", iso(epoch), "--history.created", iso(epoch), "--history.created_by",
            "dfbuild image: " + " ".join(f"{k}" for k in ("ENTRYPOINT", "ENV", "EXPOSE", "WORKDIR", "LABEL")),
            "--architecture", DOCKER_ARCH[arch], "--os", "linux", "--config.workingdir", recipe.workdir]
    for word in recipe.entrypoint:
        args += ["--config.entrypoint", word]
    for pair in env:
        args += ["--config.env", pair]
    for port in cfg["exposed_ports"]:
        args += ["--config.exposedports", port]
    for name, value in sorted(label_map.items()):
        args += ["--config.label", f"{name}={value}"]
    return args


def oci_archive(layout: Path, out: Path, epoch: int) -> None:
    """The OCI layout packed as an OCI archive (what `podman load`, `docker load` and `skopeo copy
    oci-archive:` read): GNU tar, sorted, owner 0, one mtime."""
    tmp = out.with_name(out.name + ".tmp")
    _run(["tar", "--create", "--file", str(tmp), "--directory", str(layout), "--sort=name", "--owner=0", "--group=0",
          "--numeric-owner", "--format=posix", "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
          f"--mtime=@{epoch}", "--mode=u=rwX,go=rX", "oci-layout", "index.json", "blobs"], "tar (the OCI archive)")
    tmp.replace(out)


def read_layout(layout: Path) -> dict:
    """{manifest digest, config digest, config, layers [{digest, size, media_type}]} of a one-image layout."""
    index = json.loads((layout / "index.json").read_text(encoding="utf-8"))
    descriptor = index["manifests"][0]
    digest = descriptor["digest"]
    manifest = json.loads((layout / "blobs" / "sha256" / digest.split(":", 1)[1]).read_text(encoding="utf-8"))
    config_digest = manifest["config"]["digest"]
    config = json.loads((layout / "blobs" / "sha256" / config_digest.split(":", 1)[1]).read_text(encoding="utf-8"))
    return {"digest": digest, "manifest_size": descriptor["size"], "config_digest": config_digest, "config": config,
            "ref": (descriptor.get("annotations") or {}).get("org.opencontainers.image.ref.name"),
            "layers": [{"digest": la["digest"], "size": la["size"], "media_type": la["mediaType"]}
                       for la in manifest["layers"]]}


def build(*, work: Path, out: Path, base_layer: Path, base_record: dict, app: list[archive.Member], extra_app:
          list[archive.Member], recipe: Recipe, entry: dict, release: dict, source: dict, series: dict,
          ref: str, extra_labels: dict[str, str]) -> dict:
    """Assemble the image in WORK (a scratch folder) and write OUT (the OCI archive); returns its record."""
    epoch = int(release["source_date_epoch"])
    arch = release["arch"]
    if arch not in DOCKER_ARCH:
        raise ImageInputError(f"{release['archive']} is for {arch}; images are made for x64 and arm64",
                              "nothing to do for this archive")
    started = time.monotonic()
    stage = work / "stage"
    (stage / "app").mkdir(parents=True)
    archive.extract_members([*app, *extra_app], stage / "app")
    for folder in [stage / "app", *(p for p in (stage / "app").rglob("*") if p.is_dir() and not p.is_symlink())]:
        folder.chmod(0o755)
    app_tar = work / "app.tar"
    layer_tar(stage, app_tar, epoch)
    layout = work / "layout"
    image = f"{layout}:{ref}"
    when = iso(epoch)
    _run(["umoci", "init", "--layout", str(layout)], "umoci init")
    _run(["umoci", "new", "--image", image], "umoci new")
    base_by = (f"Debian {base_record['recipe']['suite']} {base_record['recipe']['variant']} with "
               f"{', '.join(base_record['recipe']['packages'])} (mmdebstrap; dfbuild image-base "
               f"{base_record['key']})")
    _run(["umoci", "raw", "add-layer", "--image", image, "--history.created", when, "--history.created_by", base_by,
          str(base_layer)], "umoci raw add-layer (the Debian root)")
    app_by = (f"COPY /app: {release['archive']} ({len(app)} files as {recipe.file}'s server stage copies them"
              + (f", and {len(extra_app)} of the CUDA runtime archive" if extra_app else "") + ")")
    _run(["umoci", "raw", "add-layer", "--image", image, "--history.created", when, "--history.created_by", app_by,
          str(app_tar)], "umoci raw add-layer (/app)")
    label_map = labels(release, source, series, entry["name"], extra_labels)
    _run(["umoci", "config", "--image", image, *config_args(recipe, entry, label_map, arch, epoch)], "umoci config")
    _run(["umoci", "gc", "--layout", str(layout)], "umoci gc")
    found = read_layout(layout)
    oci_archive(layout, out, epoch)
    read_back = "skopeo inspect" if "skopeo" in _tools() else f"not read back (${NO_SKOPEO_ENV}=1)"
    inspected = (json.loads(_run(["skopeo", "inspect", f"oci-archive:{out}"], "skopeo inspect"))
                 if "skopeo" in _tools() else {"Digest": found["digest"]})
    if inspected.get("Digest") != found["digest"]:
        raise ImageCheckError(f"skopeo reads {out.name} as {inspected.get('Digest')}, umoci wrote {found['digest']}",
                              "this is a dfbuild bug or a changed tool; please report it")
    config = found["config"]["config"]
    holds = ("base", "app")
    return {"name": out.name, "ref": ref, "image": entry["name"], "arch": arch,
            "platform": f"linux/{DOCKER_ARCH[arch]}", "from_archive": release["archive"], "digest": found["digest"],
            "config_digest": found["config_digest"],
            "layers": [{**layer, "holds": what} for layer, what in zip(found["layers"], holds, strict=True)],
            "entrypoint": config.get("Entrypoint"), "env": config.get("Env"),
            "exposed_ports": sorted(config.get("ExposedPorts", {})), "workdir": config.get("WorkingDir"),
            "labels": config.get("Labels"), "healthcheck": recipe.healthcheck, "recipe": recipe.summary(),
            "base": {"key": base_record["key"], "recipe": base_record["recipe"], "packages": base_record["packages"],
                     "sha256": base_record["sha256"], "size": base_record["size"]},
            "app_files": len(app) + len(extra_app), "read_back": read_back,
            "wall_s": round(time.monotonic() - started, 1)}
