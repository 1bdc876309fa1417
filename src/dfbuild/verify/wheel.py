"""verify's checks of a wheel: what pip would install, and that it is the archive's build.

The wheel is read by the strict zip reader (readers.read_zip), so pip, unzip and
verify see the same files. Then, as pip checks it: one NAME-VERSION.dist-info
whose WHEEL and METADATA parse and agree with the file name, and a RECORD
listing every file with a hash and a size that match. Then, as dfbuild builds
it: nothing but the launcher (byte for byte this dfbuild's builder), its
manifest (the archive's) and bin/ (the archive's files, or the system libraries
the manifest records); a module, a .pth or a script anywhere else would run
code the archive never vouched for.
"""

from __future__ import annotations

import base64
import hashlib
import re
from email.parser import HeaderParser
from pathlib import Path, PurePosixPath

from dfbuild.core import elf, readers
from dfbuild.core.archive import payload_prefix
from dfbuild.release.record import MANIFEST_NAME, WHEEL_DIST, parse_wheel_name
from dfbuild.release.wheel import builder_dir

_RECORD_HASHES = {"sha256", "sha384", "sha512"}  # PEP 376/427: no md5 or sha1
# what the builder (scikit-build-core, then auditwheel) puts in the dist-info folder, besides RECORD
_DIST_INFO_FILES = {"WHEEL", "METADATA", "RECORD", "entry_points.txt"}
_DIST_INFO_LICENSES = re.compile(r"(licenses/)?(LICEN[CS]E|COPYING|NOTICE)[\w.-]*")


def wheel_platform(platform_tag: str) -> tuple[str | None, str | None]:
    """(os, arch) in dfbuild's names for a wheel platform tag: linux_x86_64 -> (linux, x64)."""
    os_name = ("linux" if "linux" in platform_tag else "macos" if platform_tag.startswith("macosx")
               else "windows" if platform_tag.startswith("win") else None)
    arch = ("x64" if platform_tag.endswith(("x86_64", "amd64")) else
            "arm64" if platform_tag.endswith(("aarch64", "arm64")) else None)
    return os_name, arch


_MANYLINUX = re.compile(r"manylinux_(\d+)_(\d+)_\w+")
_LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}  # PEP 600


def manylinux_glibc(platform_tag: str) -> tuple[int, ...] | None:
    """The glibc a wheel's platform tag promises to run on: manylinux_2_35_x86_64 -> (2, 35).

    A compressed tag set (manylinux_2_17_x86_64.manylinux2014_x86_64) promises its lowest;
    None when no tag is manylinux.
    """
    promised = []
    for tag in platform_tag.split("."):
        match = _MANYLINUX.fullmatch(tag)
        if match:
            promised.append((int(match.group(1)), int(match.group(2))))
        elif tag.partition("_")[0] in _LEGACY_MANYLINUX:
            promised.append(_LEGACY_MANYLINUX[tag.partition("_")[0]])
    return min(promised) if promised else None


def check_wheel(path: Path, embedded_by_version: dict[tuple, dict], problems: list[str], notes: list[str],
                glibc: dict | None = None) -> None:
    """Check the wheel PATH against the archive manifest of its version and platform (EMBEDDED_BY_VERSION:
    {(wheel_version, os, arch): manifest}); problems and notes are appended."""
    fields = parse_wheel_name(path.name)
    if not fields:
        problems.append(f"{path.name}: not a wheel file name")
        return
    platform_tag = fields["platform"]
    if platform_tag == "any" or fields["abi"] != "none" or fields["python"] != "py3":
        problems.append(f"{path.name}: tags {fields['python']}-{fields['abi']}-{platform_tag} "
                        "are not py3-none-<platform>")
    os_name, arch = wheel_platform(platform_tag)
    if os_name == "linux" and not all(tag.startswith("manylinux") for tag in platform_tag.split(".")):
        problems.append(f"{path.name}: platform tag {platform_tag} is not manylinux (PyPI refuses linux_*)")
    embedded = embedded_by_version.get((fields["version"], os_name, arch))
    if embedded is None:
        problems.append(f"{path.name}: no archive here has wheel version {fields['version']} for {os_name}/{arch}")
        return
    package = fields["dist"].lower()
    expected_dist = (embedded["release"].get("wheel_dist") or "").replace("-", "_")
    if expected_dist and package != expected_dist:
        problems.append(f"{path.name}: distribution {fields['dist']} is not {expected_dist}, the archive's backend")
    files = {f["path"]: f for f in embedded["release"]["files"]}
    bundled = {b["name"]: b["sha256"] for b in embedded["release"].get("wheel_bundled") or []}
    try:
        members = readers.read_zip(path)
    except readers.FormatError as exc:
        problems.append(exc.message if exc.message.startswith(path.name) else f"{path.name}: {exc.message}")
        return
    except OSError as exc:
        problems.append(f"{path.name}: cannot be read: {exc.strerror or exc}")
        return
    # read with data (read_zip's default), so every file has its bytes: the test only narrows the type
    contents = {m.name: m.data for m in members if m.kind == "file" and m.data is not None}
    if not wheel_format_ok(path.name, contents, fields, problems):
        return  # what pip would refuse (or install otherwise than vetted) is not read further
    if not _layout_ok(path.name, contents, fields, package, problems):
        return
    shipped = {n[len(f"{package}/bin/"):]: data for n, data in contents.items() if n.startswith(f"{package}/bin/")}
    try:
        wheel_manifest = readers.loads_json(contents[f"{package}/{MANIFEST_NAME}"])
    except (KeyError, ValueError) as exc:
        problems.append(f"{path.name}: {package}/{MANIFEST_NAME} is missing or not a JSON record ({exc})")
        return
    if wheel_manifest != embedded:
        problems.append(f"{path.name}: its manifest differs from the archive's")
    needs: dict[str, tuple[int, ...]] = {}
    for name_, data in sorted(shipped.items()):
        elf.check_file(path.name, f"bin/{name_}", data, problems, needs)
        if name_ in bundled:  # a system library the manylinux wheel carries (recorded in the manifest)
            if hashlib.sha256(data).hexdigest() != bundled[name_]:
                problems.append(f"{path.name}: bin/{name_} differs from the library the manifest records")
            continue
        # the archive's copy: at the top of its folder (llama.cpp's layout), or in bin/ (dfbuild's before)
        prefix = payload_prefix(embedded["release"])
        record, hops = files.get(f"{prefix}{name_}"), 0
        while record and "link" in record and hops <= len(files):
            record, hops = files.get(f"{prefix}{record['link']}"), hops + 1
        if record is None or "link" in record or hashlib.sha256(data).hexdigest() != record.get("sha256"):
            problems.append(f"{path.name}: bin/{name_} differs from the archive's")
    binaries = [f"bin/{Path(b).name}" for b in (embedded.get("build") or {}).get("binaries") or []]
    for binary in binaries:
        if binary[len("bin/"):] not in shipped:
            problems.append(f"{path.name}: {binary} is missing")
    notes.append(f"{path.name}: {len(shipped)} files match the archive"
                 + (f" ({len(bundled)} bundled system libraries)" if bundled else ""))
    _check_wheel_glibc(path.name, platform_tag, needs, problems, notes, glibc)


def _launcher(version: str) -> dict[str, bytes]:
    """The Python files the builder puts in the package, as this dfbuild's build_wheel writes them."""
    source = builder_dir() / "src" / WHEEL_DIST
    made = {p.name: p.read_bytes() for p in sorted(source.glob("*.py"))}
    made["_version.py"] = f'__version__ = "{version}"\n'.encode()
    return made


def _layout_ok(label: str, contents: dict[str, bytes], fields: dict, package: str, problems: list[str]) -> bool:
    """Nothing in the wheel but what dfbuild's builder puts there, and its launcher byte for byte (pip would
    install anything else: a .pth or a module beside the package runs when Python starts)."""
    before = len(problems)
    dist_info = f"{fields['dist']}-{fields['version']}.dist-info/"
    launcher = _launcher(fields["version"])
    for name, data in sorted(contents.items()):
        if name.startswith(dist_info):
            rest = name[len(dist_info):]
            if rest not in _DIST_INFO_FILES and not _DIST_INFO_LICENSES.fullmatch(rest):
                problems.append(f"{label}: {name} is not part of a dfbuild wheel's metadata")
            elif rest == "entry_points.txt" and data.decode("utf-8", "replace").split() != [
                    "[console_scripts]", "llama-server", "=", f"{package}:main"]:
                problems.append(f"{label}: {name} is not the one console script dfbuild's builder declares "
                                f"(llama-server = {package}:main)")
            continue
        if name.startswith(f"{package}/bin/") and "/" not in name[len(f"{package}/bin/"):]:
            continue  # compared with the archive by the caller
        if name == f"{package}/{MANIFEST_NAME}":
            continue  # compared with the archive's by the caller
        if name.startswith(f"{package}/") and PurePosixPath(name).name in launcher and name.count("/") == 1:
            if data != launcher[PurePosixPath(name).name]:
                problems.append(f"{label}: {name} is not the launcher this dfbuild builds (a wheel made by another "
                                "dfbuild version: verify it with that one)")
            continue
        problems.append(f"{label}: {name} is not part of a dfbuild wheel (pip would install it; "
                        "a module or .pth outside bin/ runs code nothing here vouches for)")
    for module in sorted(launcher):
        if f"{package}/{module}" not in contents:
            problems.append(f"{label}: {package}/{module} is missing")
    return len(problems) == before


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _read_headers(contents: dict[str, bytes], name: str) -> dict[str, str] | None:
    """A dist-info file in RFC 822 header form (WHEEL, METADATA) as pip reads it; None when absent or unreadable."""
    try:
        text = contents[name].decode("utf-8")
    except (KeyError, UnicodeDecodeError):
        return None
    headers = HeaderParser().parsestr(text)
    if headers.defects:
        return None
    return {key: value for key, value in headers.items()}


def wheel_format_ok(label: str, contents: dict[str, bytes], fields: dict, problems: list[str]) -> bool:
    """The wheel as pip would install it (CONTENTS: its files, read strictly): one NAME-VERSION.dist-info with
    WHEEL and METADATA that parse and agree with the file name, and a RECORD that lists every file with a hash
    and a size that match, and nothing the wheel does not hold. Appends what is wrong; False when anything is."""
    before = len(problems)
    dist_info = f"{fields['dist']}-{fields['version']}.dist-info"
    tops = {n.split("/", 1)[0] for n in contents if n.split("/", 1)[0].endswith(".dist-info")}
    if tops != {dist_info}:
        problems.append(f"{label}: needs exactly one {dist_info}/ (pip's rule); it has "
                        f"{', '.join(sorted(tops)) or 'none'}")
        return False
    wheel = _read_headers(contents, f"{dist_info}/WHEEL")
    if wheel is None or not re.fullmatch(r"1\.\d+", (wheel.get("Wheel-Version") or "").strip()) \
            or (wheel.get("Root-Is-Purelib") or "").strip().lower() not in ("true", "false"):
        problems.append(f"{label}: {dist_info}/WHEEL is missing or does not parse "
                        "(Wheel-Version 1.x and Root-Is-Purelib)")
    meta = _read_headers(contents, f"{dist_info}/METADATA")
    if meta is None or not all(meta.get(k) for k in ("Metadata-Version", "Name", "Version")):
        problems.append(f"{label}: {dist_info}/METADATA is missing or does not parse "
                        "(Metadata-Version, Name, Version)")
    elif _canonical(meta["Name"]) != _canonical(fields["dist"]) or meta["Version"].strip() != fields["version"]:
        problems.append(f"{label}: METADATA names {meta['Name']} {meta['Version']}, not the file name's "
                        f"{fields['dist']} {fields['version']}")
    record_name = f"{dist_info}/RECORD"
    try:
        listed = readers.read_record(contents[record_name].decode("utf-8"), record_name)
    except (KeyError, UnicodeDecodeError, readers.FormatError) as exc:
        why = exc.message if isinstance(exc, readers.FormatError) else type(exc).__name__
        problems.append(f"{label}: {record_name} is missing or not a RECORD pip reads ({why})")
        return False
    unsigned = {record_name, f"{dist_info}/RECORD.jws", f"{dist_info}/RECORD.p7s"}
    for name in sorted(set(contents) - set(listed)):
        problems.append(f"{label}: {name} is in the wheel but not in its RECORD")
    for name in sorted(set(listed) - set(contents)):
        problems.append(f"{label}: {record_name} lists {name}, which the wheel does not hold")
    for name in sorted(set(contents) & set(listed)):
        digest, size = listed[name]
        if name in unsigned and not digest and not size:
            continue
        algorithm, _, expected = digest.partition("=")
        if algorithm not in _RECORD_HASHES or not expected or not re.fullmatch(r"[0-9]{1,18}", size):
            problems.append(f"{label}: {record_name} gives {name} no sha256 hash and size")
            continue
        data = contents[name]
        actual = base64.urlsafe_b64encode(hashlib.new(algorithm, data).digest()).rstrip(b"=").decode()
        if actual != expected.rstrip("=") or int(size) != len(data):
            problems.append(f"{label}: {name} does not match its hash or size in {record_name}")
    return len(problems) == before


def _check_wheel_glibc(label: str, platform_tag: str, needs: dict[str, tuple[int, ...]], problems: list[str],
                       notes: list[str], glibc: dict | None) -> None:
    """A manylinux_2_X tag promises that the wheel runs on glibc 2.X: no ELF in it may need a newer one."""
    if not needs:
        return
    if glibc is not None:
        glibc[label] = {n: elf.version_text(v) for n, v in sorted(needs.items())}
    notes.append(elf.glibc_note(label, needs))
    promised = manylinux_glibc(platform_tag)
    if promised is None:
        return
    for name_, version in sorted(needs.items()):
        if version > promised:
            problems.append(f"{label}: {name_} needs GLIBC_{elf.version_text(version)}, but the tag "
                            f"{platform_tag} promises it runs on glibc {elf.version_text(promised)}")
