"""The root filesystem an image stands on: Debian packages, made once with mmdebstrap, kept in the cache.

llama.cpp's images stand on `ubuntu:24.04` (or a vendor's image) from Docker
Hub, with the runtime packages its Dockerfile installs. dfbuild has neither a
daemon nor Docker Hub: it makes the same kind of root from Debian's archive with
mmdebstrap (`--variant=minbase` plus the Dockerfile's packages, no recommends,
no manual pages or documentation but the copyright files, apt's lists and
caches removed), and packs it as one uncompressed layer tar with GNU tar,
entries sorted, owners numeric, times clamped, no device nodes (a runtime
mounts /dev).

The layer is made once per recipe (suite, mirrors, architecture, variant, dpkg
options, packages) and kept in dfbuild's cache (`image-base/`), as the web UI
and the ROCm root are: made in a `.partial` folder under the entry's lock,
renamed into place when its record (`record.json`: the package versions, the
layer's sha256 and size) is written, so Ctrl-C, `kill -9` or two runs at once
leave nothing a later image would use. Once cached, images are made offline,
and the same release gives the same image digest: the base layer's bytes are
those of the cache entry. A new Debian point release is a new layer only when
the entry is removed (`dfbuild cache clean`, or its folder under `image-base/`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

from dfbuild.core import paths, proc, state, ui
from dfbuild.core.errors import ImageToolError
from dfbuild.host.platforms import rocm_root
from dfbuild.image.recipe import table

FORMAT = 1                       # of the entry; a new format is a new entry
RECORD_NAME = "record.json"      # written last: an entry without it is not a layer
LAYER_NAME = "rootfs.tar"
LOCK_WAIT_S = 3600               # a cold root took 2.5 min here; a slow mirror, far longer
DEBIAN_ARCH = {"x64": "amd64", "arm64": "arm64"}


def base_table(name: str | None = None) -> dict:
    """images.toml's [base] (bookworm), or [bases.NAME] over it (an image whose runtime bookworm lacks)."""
    base = dict(table()["base"])
    if name:
        base.update(table()["bases"][name])
    return base


def recipe(packages: list[str], arch: str, base_name: str | None = None) -> dict:
    """The base root of an image with PACKAGES for ARCH (x64, arm64): what decides its bytes."""
    base = base_table(base_name)
    renamed = base.get("renamed", {})
    wanted = sorted({renamed.get(p, p) for p in [*base.get("packages", []), *packages]})
    if arch not in DEBIAN_ARCH:
        raise ImageToolError(f"no Debian architecture for {arch!r}", "images are made for x64 and arm64")
    mirrors = [f"deb {base['mirror']} {suite} main" for suite in [base["suite"], *base.get("extra_suites", [])]]
    if base.get("security_mirror"):
        mirrors.append(f"deb {base['security_mirror']} {base['security_suite']} main")
    spec = {"format": FORMAT, "suite": base["suite"], "variant": base["variant"], "architecture": DEBIAN_ARCH[arch],
            "mirrors": mirrors, "dpkg_options": list(base.get("dpkg_options", [])), "packages": wanted}
    if base.get("apt_options"):  # only where set: the bookworm key stays what it was
        spec["apt_options"] = list(base["apt_options"])
    return spec


def key(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def entry_path(spec: dict) -> Path:
    return paths.cache_dir() / "image-base" / f"debian-{spec['suite']}-{spec['architecture']}-{key(spec)}"


def read_record(entry: Path) -> dict | None:
    """The entry's record when it is complete (the layer there, of the size recorded), else None."""
    try:
        record = json.loads((entry / RECORD_NAME).read_text(encoding="utf-8"))
        size = (entry / LAYER_NAME).stat().st_size
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("size") != size:
        return None
    return record


def mmdebstrap_command(spec: dict, target: Path) -> list[str]:
    args = ["mmdebstrap", f"--variant={spec['variant']}", f"--architectures={spec['architecture']}",
            f"--include={','.join(spec['packages'])}", "--mode=root", "--format=directory"]
    args += [f"--dpkgopt={option}" for option in spec["dpkg_options"]]
    args += [f"--aptopt={option}" for option in spec.get("apt_options", [])]
    return [*args, spec["suite"], str(target), *spec["mirrors"]]


def tar_command(root: Path, layer: Path, epoch: int) -> list[str]:
    """GNU tar's argument list that packs ROOT into the layer tar reproducibly (no device nodes)."""
    return ["tar", "--create", "--file", str(layer), "--directory", str(root), "--sort=name", "--numeric-owner",
            "--format=posix", "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
            f"--mtime=@{epoch}", "--clamp-mtime", "--exclude=./dev/*", "--exclude=./proc/*", "--exclude=./sys/*",
            "."]


def check_tools() -> None:
    """mmdebstrap and GNU tar, and root (mmdebstrap's root mode, and the layer keeps the packages' owners)."""
    if shutil.which("mmdebstrap") is None:
        raise ImageToolError("mmdebstrap is not installed: it makes the Debian root an image stands on",
                             "apt-get install mmdebstrap (dfbuild doctor --image lists what images need)")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        raise ImageToolError("making an image's Debian root needs root (mmdebstrap's root mode keeps the "
                             "packages' owners and modes)", "run dfbuild image as root (sudo, or a container)")


def ensure(spec: dict) -> tuple[Path, dict]:
    """(the layer tar, its record) for SPEC: the cached one, or made now (network: Debian's archive)."""
    entry = entry_path(spec)
    record = read_record(entry)
    if record is not None:
        return entry / LAYER_NAME, record
    check_tools()
    with paths.locked(entry, timeout=LOCK_WAIT_S):
        record = read_record(entry)
        if record is None:  # not made by another dfbuild while this one waited
            record = _make(spec, entry)
    return entry / LAYER_NAME, record


def _make(spec: dict, entry: Path) -> dict:
    partial = entry.with_name(entry.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what a killed run left (we hold the lock)
    shutil.rmtree(entry, ignore_errors=True)    # a folder without its record is not a layer
    partial.mkdir(parents=True)
    try:
        record = _make_in(spec, entry, partial)
        state.move(partial, entry)
        return record
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _make_in(spec: dict, entry: Path, partial: Path) -> dict:
    log_path = entry.with_name(entry.name + ".log")
    root = partial / "root"
    command = mmdebstrap_command(spec, root)
    ui.info(f"making the image's Debian {spec['suite']} root once ({', '.join(spec['packages'])}; log: {log_path}); "
            "later images with the same packages reuse it offline")
    epoch = int(time.time())
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        done = proc.run(rocm_root.contained(command), stdout=log, stderr=proc.STDOUT, stdin=proc.DEVNULL,
                        die_with=signal.SIGKILL, env={**os.environ, "SOURCE_DATE_EPOCH": str(epoch)})
    if done.returncode != 0:
        text = log_path.read_text(encoding="utf-8", errors="replace")
        reason = next((line for line in text.splitlines() if line.startswith("E: ")), f"exit {done.returncode}")
        raise ImageToolError(f"mmdebstrap could not make the image's Debian root: {reason}",
                             f"check the network to Debian's archive; full log: {log_path}")
    versions = rocm_root.installed_versions(root)
    layer = partial / LAYER_NAME
    done = proc.run(tar_command(root, layer, epoch), errors="replace")
    if done.returncode != 0:
        raise ImageToolError(f"tar could not pack the image's Debian root: {done.stderr.strip()[-300:]}",
                             f"full log: {log_path}")
    shutil.rmtree(root)
    size = layer.stat().st_size
    record = {"format": FORMAT, "key": key(spec), "recipe": spec, "packages": versions, "epoch": epoch,
              "sha256": paths.sha256_file(layer), "size": size,
              "wall_s": round(time.monotonic() - start, 1)}
    (partial / RECORD_NAME).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    ui.info(f"made {entry.name}: {len(versions)} packages, layer {size / 1e6:.0f} MB, "
            f"{record['wall_s']:.0f} s")
    return record
