"""verify's check of an image archive (`llama-<tag>-image-<platform>.oci.tar`, issue 46) against its record
in manifest.json and against the release archive it was made of.

An OCI archive is a tar of an OCI layout. It passes when:
- the tar holds only the layout's plain files (`oci-layout`, `index.json`, `blobs/sha256/<64 hex>`),
  each once, and every blob's sha256 is its name;
- `index.json` names one image, the manifest the record names (its digest and ref), whose config
  and layers are those recorded (digest, size) and present;
- each layer, decompressed, has the sha256 of the config's diff_id (what a runtime checks on pull);
- the config runs what the record says (entrypoint, environment, exposed ports, working dir, labels),
  and its labels name this release (archive, base, series, patched commit);
- the /app layer holds nothing but the archive's own files, byte for byte and mode for mode (a CUDA
  image: and its cudart archive's libraries), and the programs the record says it copied.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import tarfile
import zlib
from pathlib import Path

from dfbuild.core import archive

IMAGE_SUFFIX = ".oci.tar"           # llama-<tag>-image-<platform>.oci.tar
BLOB = re.compile(r"blobs/sha256/([0-9a-f]{64})")
LAYOUT_FILES = ("oci-layout", "index.json")
MAX_JSON = 1 << 20
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def _read_layout(path: Path, problems: list[str]) -> tuple[dict[str, bytes], dict[str, tuple[int, str]]] | None:
    """(small JSON files and blobs by name, {blob digest: (size, sha256)}) of the OCI archive, or None."""
    label = path.name
    small: dict[str, bytes] = {}
    blobs: dict[str, tuple[int, str]] = {}
    seen: set[str] = set()
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                name = member.name.removeprefix("./")
                if name in seen:
                    problems.append(f"{label}: {name} appears twice")
                    return None
                seen.add(name)
                if member.isdir() and name in ("blobs", "blobs/sha256"):
                    continue
                if not member.isfile():
                    problems.append(f"{label}: {name} is not a plain file of an OCI layout")
                    return None
                match = BLOB.fullmatch(name)
                if name not in LAYOUT_FILES and not match:
                    problems.append(f"{label}: {name} is not a file of an OCI layout")
                    return None
                handle = tar.extractfile(member)
                assert handle is not None
                digest = hashlib.sha256()
                kept = bytearray()
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
                    if len(kept) < MAX_JSON:
                        kept += chunk
                if match:
                    if digest.hexdigest() != match.group(1):
                        problems.append(f"{label}: blob {match.group(1)[:16]}... does not have the sha256 it is "
                                        "named by")
                        return None
                    blobs[match.group(1)] = (member.size, digest.hexdigest())
                if member.size <= MAX_JSON:
                    small[name] = bytes(kept)
    except (OSError, tarfile.TarError, EOFError) as exc:
        problems.append(f"{label} does not read as a tar ({exc})")
        return None
    missing = [n for n in LAYOUT_FILES if n not in small]
    if missing:
        problems.append(f"{label} has no {', '.join(missing)}: not an OCI layout")
        return None
    return small, blobs


def _json(small: dict[str, bytes], name: str):
    return json.loads(small[name].decode("utf-8"))


def _layer_members(path: Path, digest: str) -> tuple[str, dict[str, tarfile.TarInfo], dict[str, bytes]]:
    """(sha256 of the decompressed layer, its members by name, file contents) of one layer in the tar."""
    with tarfile.open(path, "r:") as outer:
        handle = outer.extractfile(f"blobs/sha256/{digest}")
        assert handle is not None
        raw = gzip.GzipFile(fileobj=handle).read()
    infos: dict[str, tarfile.TarInfo] = {}
    data: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        for member in tar:
            infos[member.name] = member
            if member.isfile():
                stream = tar.extractfile(member)
                data[member.name] = stream.read() if stream else b""
    return hashlib.sha256(raw).hexdigest(), infos, data


def _expected_app(directory: Path, rel: dict, record: dict) -> dict[str, archive.Member]:
    """What /app should hold, by path under app/: the archive's members the image took, and a CUDA image's
    runtime libraries from its cudart archive."""
    members = archive.read_members(directory / rel["archive"])
    root = rel.get("root")
    prefix = f"{root}/" if root else ""
    by_name = {m.name[len(prefix):]: m for m in members if m.name.startswith(prefix) and m.kind != "dir"}
    for artifact in rel.get("artifacts", []):
        if artifact.get("kind") == "cudart" and record.get("image") == "server-cuda":
            for member in archive.read_members(directory / artifact["name"]):
                if member.kind != "dir" and "/" in member.name:
                    by_name.setdefault(member.name.split("/", 1)[1], member)
    return by_name


def check_image(directory: Path, record: dict, full: dict, problems: list[str], notes: list[str]) -> None:
    """Check DIRECTORY/record[name] (an OCI archive) against RECORD (manifest.json's images entry) and FULL."""
    path = directory / record["name"]
    label = path.name
    before = len(problems)
    read = _read_layout(path, problems)
    if read is None:
        return
    small, blobs = read
    try:
        index = _json(small, "index.json")
        manifests = index.get("manifests") or []
        if len(manifests) != 1:
            problems.append(f"{label}: index.json names {len(manifests)} images, not one")
            return
        descriptor = manifests[0]
        if descriptor.get("digest") != record["digest"]:
            problems.append(f"{label}: its image is {descriptor.get('digest')}, the manifest records "
                            f"{record['digest']}")
            return
        ref = (descriptor.get("annotations") or {}).get("org.opencontainers.image.ref.name")
        if ref != record["ref"]:
            problems.append(f"{label}: its image is named {ref!r}, the manifest records {record['ref']!r}")
        manifest_hex = record["digest"].split(":", 1)[1]
        if manifest_hex not in blobs:
            problems.append(f"{label}: the image's manifest blob is missing")
            return
        image_manifest = _json(small, f"blobs/sha256/{manifest_hex}")
        config_desc = image_manifest["config"]
        if config_desc["digest"] != record["config_digest"]:
            problems.append(f"{label}: its config is {config_desc['digest']}, the manifest records "
                            f"{record['config_digest']}")
            return
        config = _json(small, f"blobs/sha256/{config_desc['digest'].split(':', 1)[1]}")
        layers = [{"digest": la["digest"], "size": la["size"], "media_type": la["mediaType"]}
                  for la in image_manifest["layers"]]
        if layers != [{k: la[k] for k in ("digest", "size", "media_type")} for la in record["layers"]]:
            problems.append(f"{label}: its layers are not those the manifest records")
            return
        for layer in layers:
            hexdigest = layer["digest"].split(":", 1)[1]
            if hexdigest not in blobs or blobs[hexdigest][0] != layer["size"] or layer["media_type"] != MEDIA_LAYER:
                problems.append(f"{label}: layer {hexdigest[:16]}... is missing or not of its recorded size")
                return
        cfg = config.get("config") or {}
        wanted = {"Entrypoint": record["entrypoint"], "Env": record["env"], "WorkingDir": record["workdir"],
                  "Labels": record["labels"], "ExposedPorts": {p: {} for p in record["exposed_ports"]}}
        for key, value in wanted.items():
            if cfg.get(key) != value:
                problems.append(f"{label}: the config's {key} is {cfg.get(key)!r}, not {value!r}")
        rel, series = full.get("release", {}), full.get("series", {})
        for name, value in (("dflash.archive", rel.get("archive")), ("dflash.base", (full.get("source") or {})
                            .get("base")), ("dflash.patched-commit", series.get("head")),
                            ("dflash.series", str(rel.get("tag", "")).rsplit("-", 1)[-1])):
            if (cfg.get("Labels") or {}).get(name) != value:
                problems.append(f"{label}: the label {name} does not name this release ({value})")
        if record.get("from_archive") != rel.get("archive"):
            problems.append(f"{label}: made of {record.get('from_archive')}, not this release's {rel.get('archive')}")
        diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
        if len(diff_ids) != len(layers):
            problems.append(f"{label}: the config names {len(diff_ids)} layers, the manifest {len(layers)}")
            return
        app = None
        for layer, diff_id, what in zip(layers, diff_ids, [la.get("holds") for la in record["layers"]], strict=True):
            hexdigest = layer["digest"].split(":", 1)[1]
            if what == "base":
                with tarfile.open(path, "r:") as outer:
                    handle = outer.extractfile(f"blobs/sha256/{hexdigest}")
                    assert handle is not None
                    digest = hashlib.sha256()
                    with gzip.GzipFile(fileobj=handle) as gz:
                        while chunk := gz.read(1 << 20):
                            digest.update(chunk)
                uncompressed = digest.hexdigest()
            else:
                uncompressed, infos, data = _layer_members(path, hexdigest)
                app = (infos, data)
            if f"sha256:{uncompressed}" != diff_id:
                problems.append(f"{label}: layer {hexdigest[:16]}... does not decompress to its diff_id")
                return
        if app is None:
            problems.append(f"{label}: the manifest records no /app layer")
            return
        _check_app(label, app[0], app[1], _expected_app(directory, rel, record), problems)
    except (KeyError, TypeError, ValueError, AttributeError, OSError, EOFError, zlib.error, tarfile.TarError) as exc:
        problems.append(f"{label}: cannot be checked ({type(exc).__name__}: {exc})")
        return
    if len(problems) == before:
        notes.append(f"{label}: image {record['digest'][:19]}... ({record['ref']}): {len(layers)} layers match "
                     f"their digests, the config runs {' '.join(record['entrypoint'])}, /app is "
                     f"{rel.get('archive')}'s own files")


def _check_app(label: str, infos: dict[str, tarfile.TarInfo], data: dict[str, bytes],
               expected: dict[str, archive.Member], problems: list[str]) -> None:
    """Every member of the /app layer is app/ or a file or link of the archive, the same bytes and mode."""
    files = 0
    for name, info in sorted(infos.items()):
        if name in ("app", "app/"):
            continue
        if not name.startswith("app/"):
            problems.append(f"{label}: the /app layer holds {name}, outside /app")
            continue
        rel = name[4:].rstrip("/")
        if info.isdir():
            continue
        if info.uid != 0 or info.gid != 0:
            problems.append(f"{label}: /{name} is not owned by root")
        source = expected.get(rel)
        if source is None:
            problems.append(f"{label}: /{name} is not a file of the release archive")
        elif info.issym():
            if source.kind != "link" or source.link != info.linkname:
                problems.append(f"{label}: /{name} is a link that the archive does not have")
        elif not info.isfile() or source.kind != "file":
            problems.append(f"{label}: /{name} is not what the archive holds there")
        elif data.get(name) != source.data:
            problems.append(f"{label}: /{name} differs from the archive's bytes")
        elif source.mode is not None and (info.mode & 0o7777) != (source.mode & 0o755):
            problems.append(f"{label}: /{name} has mode {info.mode & 0o7777:04o}, the archive {source.mode:04o}")
        else:
            files += 1
    if not files:
        problems.append(f"{label}: the /app layer holds no file of the archive")


def notes_lines(records: list[dict], registry: str | None = None) -> list[str]:
    """The release notes' part on images: each image, its digest, and the lines that load and run it."""
    from dfbuild.host.backends import data_table  # the image table itself: the image package stands above verify

    images = data_table("images.toml")["images"]

    if not records:
        return []
    health = "--health-cmd 'curl -f http://localhost:8080/health'"
    lines = ["", "Container images, laid out as llama.cpp's own of the same name (`/app/llama-server` as the "
                 "entrypoint, `LLAMA_ARG_HOST=0.0.0.0`, port 8080), built from the archives above and run before "
                 "publishing (each is an OCI archive: `podman load` / `docker load` read it, `skopeo copy` pushes it). "
                 "OCI images carry no health check: give llama.cpp's as "
                 f"`{health}`."]
    backend_of = {entry["name"]: key for key, entry in images.items()}
    for record in sorted(records, key=lambda r: r["name"]):
        entry = images.get(backend_of.get(record.get("image", ""), ""), {})
        ref = record["ref"]
        tag = ref.split(":", 1)[1]
        docker = " ".join(entry.get("run_docker", []))
        podman = " ".join(entry.get("run_podman", []))
        model = "-v \"$PWD/models:/models\" {image} -m /models/MODEL.gguf"
        lines += ["", f"- `{record['name']}`: `{ref}` ({record['platform']}), digest `{record['digest']}`", "",
                  "  ```sh",
                  f"  podman load -i {record['name']}",
                  f"  podman run --rm -p 8080:8080 {podman + ' ' if podman else ''}"
                  + model.format(image=f"localhost/{ref}"),
                  f"  docker load -i {record['name']}",
                  f"  docker run --rm -p 8080:8080 {docker + ' ' if docker else ''}{health} "
                  + model.format(image=ref)]
        if registry:
            repository = ref.split(":", 1)[0]
            lines.append(f"  docker run --rm -p 8080:8080 {docker + ' ' if docker else ''}"
                         + model.format(image=f"{registry.rstrip('/')}/{repository}:{tag}"))
        lines.append("  ```")
    return lines
