"""Packaging a built release: what the archive ships (the payload, licences, patches, REQUIRES.txt),
its layout as llama.cpp's release workflow of the base packs it, the reproducible archive, the wheel
and the CUDA runtime beside it, and SHA256SUMS; unchanged inputs keep the artifacts already made.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path, PurePosixPath

from dfbuild.core import elf, gitrun, manifest, owned, ui
from dfbuild.core.archive import Entry, write_archive
from dfbuild.core.errors import ReleaseError
from dfbuild.core.paths import sha256_file
from dfbuild.core.state import fault_point  # (package()'s `state` is the release's record, not this module)
from dfbuild.host import backends, matrix
from dfbuild.release.cudart import cuda_runtime_libraries, cuda_toolkit_root, cudart_bundle, cudart_linux
from dfbuild.release.record import (
    MANIFEST_NAME,
    OWN_FILES,
    REQUIRES_NAME,
    SUMS_NAME,
    _digest,
    _State,
    parse_wheel_name,
    payload_records,
    portable,
    release_files,
    release_tag,
    series_hash,
    toolkit_version,
    wheel_package,
    wheel_version,
    write_sha256sums,
)
from dfbuild.release.wheel import build_wheel, builder_dir, bundle_system_libraries, stage_wheel_bin


def source_date_epoch(tree: Path, commit: str | None = None) -> int:
    """$SOURCE_DATE_EPOCH when set, else the commit date of COMMIT (default: the tree's HEAD, the patched
    commit; a fixed-upstream release names the base it ships)."""
    override = os.environ.get("SOURCE_DATE_EPOCH")
    if override:
        try:
            return int(override)
        except ValueError:
            raise ReleaseError(f"SOURCE_DATE_EPOCH={override!r} is not a number of seconds",
                               "unset it or give an integer") from None
    result = gitrun.run(tree, "log", "-1", "--format=%ct", commit or "HEAD", check=False)
    if result.returncode != 0 or not result.stdout.strip().isdigit():
        raise ReleaseError(f"cannot read the commit date of {tree}", "release a tree made by `dfbuild apply`")
    return int(result.stdout.strip())


def _sibling_link(path: Path) -> str:
    """The target of a library version link, which must stay in its own directory."""
    target = os.readlink(path)
    if "/" in target or "\\" in target or target in (".", ".."):
        raise ReleaseError(f"{path} links to {target}, outside its directory",
                           "the build dir looks tampered with; rebuild with --fresh")
    return target


def collect_payload(build_section: dict, tree: Path, patches_root: Path, series_section: dict,
                    extra_licenses: dict[str, Path] | None = None, prefix: str = "") -> list[Entry]:
    """What the archive ships besides manifest.json, sorted by path.

    The binaries and libraries go under PREFIX: "" (llama.cpp's layout: at the top of the archive's
    folder, or of a flat zip, as its release workflow packs build/bin), or "bin/" (dfbuild's layout
    before issue 36). EXTRA_LICENSES ({name in licenses/: file}): those of shipped toolchain runtimes
    (a cross build's DLLs).
    """
    build_dir = Path(build_section["build_dir"])
    entries: dict[str, Entry] = {}
    own = {*OWN_FILES, MANIFEST_NAME, REQUIRES_NAME}

    for rel in [*build_section["binaries"], *build_section["libraries"]]:
        path = build_dir / rel
        arcname = f"{prefix}{Path(rel).name}"
        if arcname in own:  # never here: llama.cpp's build/bin has no file of these names
            raise ReleaseError(f"the build's {rel} has the name of a file dfbuild ships beside the binaries",
                               "this is a dfbuild bug; please report it")
        if path.is_symlink():
            entries[arcname] = Entry(arcname, 0o777, link=_sibling_link(path))
        elif path.is_file():
            entries[arcname] = Entry(arcname, 0o755, source=path)
        else:
            raise ReleaseError(f"{path} is missing from the build dir", "run the build again")

    license_path = Path(tree) / "LICENSE"
    if not license_path.is_file():
        raise ReleaseError(f"{tree} has no LICENSE", "release a llama.cpp tree; it ships its MIT LICENSE")
    entries["LICENSE"] = Entry("LICENSE", source=license_path)
    third_party = Path(tree) / "licenses"
    if third_party.is_dir():
        for path in sorted(third_party.iterdir()):
            if path.is_file():
                entries[f"licenses/{path.name}"] = Entry(f"licenses/{path.name}", source=path)
    for name, path in sorted((extra_licenses or {}).items()):
        entries[f"licenses/{name}"] = Entry(f"licenses/{name}", source=Path(path))

    for concern in series_section.get("concerns", []):
        if concern.get("status") in ("applied", "already-present") and concern.get("file"):
            patch = Path(patches_root) / concern["file"]
            entries[f"patches/{patch.name}"] = Entry(f"patches/{patch.name}", source=patch)
    series_file = Path(patches_root) / "series.toml"
    if series_file.is_file():
        entries["patches/series.toml"] = Entry("patches/series.toml", source=series_file)
    return [entries[key] for key in sorted(entries)]


def runtime_requirements(entries: list[Entry]) -> dict[str, str]:
    """{soname: package} of the system libraries the shipped ELF files need; checks their RUNPATH.

    Every ELF must have no RUNPATH or exactly $ORIGIN: an empty entry means the
    current directory, anything else the build machine.
    """
    shipped = {PurePosixPath(e.path).name for e in entries}
    packages = backends.table().get("runtime_packages", {})
    needs: dict[str, str] = {}
    for entry in entries:
        if entry.link is not None:
            continue
        data = entry.read()
        if not elf.is_elf(data):
            continue
        info = elf.read(data)
        problem = elf.search_path_problem(info)
        if problem:
            raise ReleaseError(f"{entry.path} {problem}; it could load libraries from the current directory "
                               "or the build machine",
                               "rebuild with dfbuild's flags (CMAKE_BUILD_WITH_INSTALL_RPATH=ON)")
        for name in info.needed:
            if name not in shipped and not elf.SYSTEM_CORE.match(name):
                needs[name] = packages.get(name, "a system library (not shipped)")
    return dict(sorted(needs.items()))


def _requires_text(requires: dict[str, str]) -> bytes:
    lines = ["System libraries these binaries load (not shipped), and the packages that provide them:", ""]
    lines += [f"{name}: {package}" for name, package in requires.items()] or ["(none beyond the C/C++ runtime)"]
    return ("\n".join(lines) + "\n").encode()


def package(sections: dict, *, tree: Path, patches_root: Path, out_dir: Path, work_dir: Path,
            state: _State | None = None, commit: str | None = None) -> dict:
    """Write the archive, the wheel and SHA256SUMS into OUT_DIR; return the release section.

    SECTIONS holds source, series, build and smoke. When STATE says the same
    inputs made the artifacts already in OUT_DIR, they are left as they are.
    What goes into the archive's manifest.json is the portable() form of the
    sections: no path of this machine, no timings.
    """
    build_section = sections["build"]
    host = build_section.get("host") or {}
    os_name = host.get("os") or backends.current_host().os
    arch = host.get("arch") or backends.current_host().arch
    backend = build_section["backend"]
    base = sections["source"].get("base") or sections["series"].get("base")
    tag = release_tag(base, sections["series"])
    toolkit = toolkit_version(build_section)
    name = matrix.artifact_name(tag, os_name, backend, arch, toolkit)
    # as the base's own release workflow packs it: binaries at the top of llama-<tag>/, or a flat zip
    layout, root, layout_record = archive_layout(tree, os_name, backend, arch, toolkit, tag)
    cudart_libraries = cuda_runtime_libraries(tree, os_name, arch, toolkit) if backend == "cuda" else []
    epoch = source_date_epoch(tree, commit)
    version = wheel_version(build_section.get("build_number", 0), series_hash(sections["series"]), backend)

    cross_host = _cross_host(build_section)
    extra_licenses = {}
    if cross_host is not None:
        from dfbuild.host import platforms  # the shipped runtime DLLs' licenses (Windows); none for arm64

        extra_licenses = platforms.cross(cross_host).license_files(cross_host)
    entries = collect_payload(build_section, tree, patches_root, sections["series"], extra_licenses)
    payload = {Path(rel).name for rel in [*build_section["binaries"], *build_section["libraries"]]}
    requires = runtime_requirements(entries) if os_name == "linux" else {}
    if os_name == "linux":
        entries = sorted([*entries, Entry(REQUIRES_NAME, data=_requires_text(requires))], key=lambda e: e.path)
    wheel_bin = stage_wheel_bin(entries, work_dir / "bin", payload)  # every tool, as the archive
    # the wheel carries this machine's libssl/libgomp: only for a wheel of this machine's kind (none is
    # built for a cross target, whose libraries this machine's loader does not have)
    bundled = bundle_system_libraries(wheel_bin) if os_name == "linux" and cross_host is None else []
    packed = {
        "tag": tag,
        "os": os_name,
        "arch": arch,
        "backend": backend,
        "toolkit": toolkit,
        "archive": name,
        "layout": layout,        # top: the binaries at the top of ROOT/; flat: a zip without a folder
        "root": root,            # llama-<tag> (as llama.cpp's tarballs), or None for a flat zip
        "layout_from": layout_record,
        "source_date_epoch": epoch,
        "cpu_variants": build_section.get("cpu_variants", []),
        # a cross build's toolchain DLLs, shipped as the distribution built them (verify names them apart)
        **({"runtime_dlls": list((build_section.get("cross") or {}).get("runtime_dlls", []))}
           if cross_host is not None else {}),
        "requires": requires,
        "wheel_dist": wheel_package(backend).replace("_", "-"),
        "wheel_version": version,
        "wheel_bundled": bundled,
        "files": payload_records(entries),
    }
    embedded = {**{k: portable(sections[k]) for k in ("source", "series", "build", "smoke")}, "release": packed}
    manifest_bytes = (manifest.dumps(embedded) + "\n").encode()
    for local in {str(Path(work_dir).resolve().parent), str(Path(tree).resolve()), str(Path.home())}:
        if len(local) > 1 and local.encode() in manifest_bytes:
            raise ReleaseError(f"the archive's manifest would name {local}, a path of this machine",
                               "this is a dfbuild bug; please report it")
    all_entries = sorted([*entries, Entry(MANIFEST_NAME, data=manifest_bytes)], key=lambda e: e.path)
    builder_files = {str(p.relative_to(builder_dir())): sha256_file(p)
                     for p in sorted(builder_dir().rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
    key = _digest([hashlib.sha256(manifest_bytes).hexdigest(), builder_files, sys.version_info[:2]])

    previous = state.cached("package", key) if state else None
    extras: dict = {}  # what else the release section records of an artifact (the Linux cudart archive)
    if previous and all((out_dir / a["name"]).is_file() and sha256_file(out_dir / a["name"]) == a["sha256"]
                        for a in previous["artifacts"]):
        ui.info("    inputs unchanged: keeping the artifacts already in place")
        artifacts, reused = previous["artifacts"], True
        extras = {k: v for k, v in previous.items() if k != "artifacts"}
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        owned.claim(out_dir, [name], ReleaseError, legacy=release_files)
        made = [(write_archive(out_dir / name, root, all_entries, epoch), "archive")]
        fault_point("release: archive written")
        owned.record_produced(made[0][0])  # verify runs binaries by default only from archives made here
        fault_point("release: archive recorded as produced")
        # a cross build ships its archive only: a wheel is built where it runs; so does a hip build made in
        # the forky root (platforms/rocm_root.py): its binaries need forky's glibc and libraries, which
        # this machine's auditwheel would graft from the host; the wheel comes from the matrix's image
        if build_section.get("rocm_root"):
            ui.info("    no wheel: built in the Debian forky ROCm root (docs/hip.md); the archive only")
        if cross_host is None and not build_section.get("rocm_root"):
            made.append((build_wheel(bin_dir=wheel_bin, version=version, manifest_bytes=manifest_bytes,
                                     license_path=Path(tree) / "LICENSE", out_dir=out_dir, work_dir=work_dir,
                                     epoch=epoch, backend=backend, os_name=os_name), "wheel"))
        if os_name == "windows" and backend == "cuda":
            made.append((cudart_bundle(out_dir, toolkit or "", arch), "cudart"))
        if os_name == "linux" and backend == "cuda":  # as llama.cpp's ubuntu-cuda job, from b11063 on
            cudart_path, extras["cudart"] = cudart_linux(
                out_dir, tag=tag, toolkit=toolkit or "", arch=arch, archive=name, libraries=cudart_libraries,
                toolkit_root=cuda_toolkit_root(build_section), epoch=epoch)
            made.append((cudart_path, "cudart"))
        fault_point("release: wheel built")
        artifacts = [{"name": path.name, "kind": kind, "sha256": sha256_file(path), "size": path.stat().st_size}
                     for path, kind in made]
        reused = False
        if state:
            state.store("package", key, {"artifacts": artifacts, **extras})
            fault_point("release: package stage recorded")
    write_sha256sums(out_dir, [a["name"] for a in artifacts])
    fault_point("release: SHA256SUMS written")
    wheel_name = next((a["name"] for a in artifacts if a["kind"] == "wheel"), None)
    return {**packed, **extras, "artifacts": artifacts, "wheel": parse_wheel_name(wheel_name) if wheel_name else None,
            "sha256sums": SUMS_NAME, "reused": reused}


def archive_layout(tree: Path, os_name: str, backend: str, arch: str, toolkit: str | None,
                   tag: str) -> tuple[str, str | None, dict]:
    """(layout, root folder, record) of an archive, as the base's release workflow packs it (its
    .github/workflows/release.yml), else as backends.toml [upstream_release.layout] says llama.cpp
    packs that OS: "top" (a tarball rooted at llama-<tag>/ with the binaries at its top) or "flat"
    (a zip of the binaries, no folder)."""
    from dfbuild.build import upstream_release

    reading = upstream_release.read(Path(tree), os_name, backend, arch, toolkit)
    fallback = backends.table()["upstream_release"]["layout"][os_name]
    layout = reading.layout if reading.found and reading.layout in ("top", "flat") else fallback
    if reading.found and reading.layout:
        record = {"file": reading.file, "job": reading.job}
    else:
        why = reading.note if not reading.found else f"its {reading.job} job packs no archive dfbuild can read"
        record = {"file": reading.file, "note": f"{why}; the {os_name} layout of backends.toml"}
    if layout == "flat":
        return layout, None, record
    root = f"llama-{tag}"  # every base's tarballs: --transform "s,^\.,llama-<tag>,"
    read = (reading.root or "").replace(upstream_release.TAG, tag) if reading.found else ""
    if read and read != root:  # a folder of another form: dfbuild packs (and verify expects) llama-<tag>
        record["note"] = f"its tarball's folder is {read!r}; dfbuild's is {root!r}"
    return layout, root, record


def _cross_host(build_section: dict) -> backends.Host | None:
    """The cross target a build section was made for (--os windows, --arch arm64 on Linux x64), or None for a
    native build."""
    host = build_section.get("host") or {}
    if not host.get("build_os"):
        return None
    here = backends.current_host()
    made = backends.Host(host["os"], host.get("arch") or here.arch, here.distro, here.distro_version,
                         build_os=host["build_os"], build_arch=host.get("build_arch"))
    return made if made.cross else None
