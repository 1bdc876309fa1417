"""`dfbuild verify`: check a release directory before publishing it.

`verify()` checks an OUT directory: SHA256SUMS, each archive's members against
the file list in its manifest, OUT/manifest.json against the archives, the
wheel's binaries against the archive's, and that the unpacked llama-server's
`--version` names the patched commit. It reports the highest GLIBC_ symbol
version each shipped ELF needs, and fails a wheel whose manylinux tag promises
an older glibc than one of its ELFs needs.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import stat
import subprocess
import zipfile
from pathlib import Path, PurePosixPath

from . import backends, locks, owned, source, state
from .archive import (ARCHIVE_SUFFIXES, Member, archive_root, extract_members, read_members, unsafe_member,
                      zip_member_problem)
from .errors import VerifyError
from .paths import sha256_file
from . import elf
from .release import MANIFEST_NAME, SUMS_NAME, parse_wheel_name, read_sha256sums


# "version: 0.2.0-dev (build 10359, commit <sha>)" or, in other releases, "version: 10355 (<sha>)"
_COMMIT_IN_VERSION = (re.compile(r"commit ([0-9A-Za-z]+(?:-dirty)?)"),
                      re.compile(r"version: \d+ \(([0-9A-Fa-f]{7,}(?:-dirty)?)\)"))


def _commit_matches(found: str, expected: str) -> bool:
    return found == expected or (len(found) >= 7 and not found.endswith("-dirty") and expected.startswith(found))


RUN_OPT_IN = "--run"


def _check_archive(path: Path, problems: list[str], notes: list[str], run_binaries: bool,
                   host: backends.Host, *, not_run_why: str = "not run (--no-run)",
                   limits: source.Limits | None = None, glibc: dict | None = None,
                   run_later: list[str] | None = None) -> dict | None:
    """Check one archive; return its embedded manifest (None when it cannot be read).

    Its llama-server runs only when RUN_BINARIES and the archive passed every check before that.
    GLIBC, when given, gets {archive name: {member: highest GLIBC_ version it needs}}.
    """
    problems_before = len(problems)
    members = read_members(path, limits)
    root = archive_root(path.name)
    bad = False
    for member in members:
        why = unsafe_member(member.name)
        if why:
            problems.append(f"{path.name}: unsafe member {why}")
            bad = True
        elif member.name != root and not member.name.startswith(root + "/"):
            problems.append(f"{path.name}: member {member.name!r} is outside the root directory {root}/")
            bad = True
        if member.kind == "link" and (unsafe_member(member.link) or "/" in member.link):
            problems.append(f"{path.name}: {member.name} links outside its directory ({member.link})")
            bad = True
        if member.kind == "other":
            problems.append(f"{path.name}: {member.name} is neither a file, a directory nor a symlink")
            bad = True
    seen: set[str] = set()
    for member in members:
        key = member.name.rstrip("/")
        while key.startswith("./"):
            key = key[2:]
        if key in seen:  # which copy an unpacker keeps (first or last) depends on the tool: nothing vouches
            problems.append(f"{path.name}: member {member.name!r} appears more than once")
            bad = True
        seen.add(key)
    if bad:
        return None
    by_name = {m.name[len(root) + 1:]: m for m in members if m.name != root}
    for name_, member in sorted(by_name.items()):
        why = _link_problem(name_, member, by_name)
        if why:
            problems.append(f"{path.name}: {name_} {why}")
            bad = True
    if bad:
        return None
    embedded_member = by_name.get(MANIFEST_NAME)
    if embedded_member is None or embedded_member.kind != "file":
        problems.append(f"{path.name}: no {root}/{MANIFEST_NAME}")
        return None
    try:
        embedded = json.loads(embedded_member.data)
    except ValueError:
        problems.append(f"{path.name}: {MANIFEST_NAME} is not JSON")
        return None
    packed = embedded.get("release") if isinstance(embedded, dict) else None
    files = packed.get("files") if isinstance(packed, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("path"), str) for f in files):
        problems.append(f"{path.name}: {MANIFEST_NAME} does not have the shape of a dfbuild manifest")
        return None
    why = manifest_field_problem(embedded)
    if why:
        problems.append(f"{path.name}: {MANIFEST_NAME}: {why}")
        return None
    expected = {f["path"]: f for f in packed.get("files", [])}
    actual = {n: m for n, m in by_name.items() if m.kind != "dir" and n != MANIFEST_NAME}
    for name_ in sorted(set(expected) - set(actual)):
        problems.append(f"{path.name}: {name_} is in the manifest but not in the archive")
    for name_ in sorted(set(actual) - set(expected)):
        problems.append(f"{path.name}: {name_} is in the archive but not in the manifest")
    zipped = path.name.endswith(".zip")
    for name_ in sorted(set(expected) & set(actual)):
        record, member = expected[name_], actual[name_]
        if "link" in record:
            if zipped:  # zips carry the link's target as a copy
                continue
            if member.kind != "link" or member.link != record["link"]:
                problems.append(f"{path.name}: {name_} should link to {record['link']}")
            continue
        if member.kind != "file" or hashlib.sha256(member.data).hexdigest() != record.get("sha256"):
            problems.append(f"{path.name}: {name_} does not match its sha256 in the manifest")
        elif os.name != "nt" and f"{member.mode & 0o777:04o}" != record.get("mode"):
            problems.append(f"{path.name}: {name_} has mode {member.mode & 0o777:04o}, not {record.get('mode')}")
    needs: dict[str, tuple[int, ...]] = {}
    # every ELF file is for the archive's machine (an x64 library in an arm64 archive would never load)
    want_machine = elf.ARCH_MACHINES.get(packed.get("arch")) if packed.get("os") == "linux" else None
    elf_count = 0
    for name_, member in sorted(actual.items()):
        if member.kind == "file" and member.data:
            elf_count += _elf_problems(path.name, name_, member.data, problems, needs, want_machine)
    if want_machine and elf_count:
        notes.append(f"{path.name}: {elf_count} ELF files checked: machine {want_machine}, RUNPATH $ORIGIN or none")
    third_party = [n for n in packed.get("runtime_dlls", []) if isinstance(n, str)]
    driver_users: list[str] = []
    pe_count = _pe_problems(path.name, actual, packed.get("arch"), problems, third_party,
                            backend=packed.get("backend") if packed.get("os") == "windows" else None,
                            driver_users=driver_users)
    if pe_count:
        notes.append(f"{path.name}: {pe_count} PE files are {packed.get('arch')}, import only DLLs in the archive "
                     "or Windows system DLLs, and name no build path"
                     + (f" (the toolchain's {', '.join(PurePosixPath(n).name for n in third_party)} keep the paths "
                        "their distribution built them in)" if third_party else ""))
    if driver_users:
        notes.append(f"{path.name}: {', '.join(driver_users)} import{'s' if len(driver_users) == 1 else ''} "
                     f"{_driver_dll(packed)}, the GPU driver's own, which the archive does not ship")
    notes.append(f"{path.name}: {len(actual)} files match its manifest")
    notes.append(f"{path.name}: {smoke_statement(embedded)}")
    if glibc is not None and needs:
        glibc[path.name] = {n: elf.version_text(v) for n, v in sorted(needs.items())}
        notes.append(_glibc_note(path.name, needs))

    series_, build_ = (embedded.get(k) if isinstance(embedded.get(k), dict) else {} for k in ("series", "build"))
    in_root = build_.get("rocm_root") if isinstance(build_.get("rocm_root"), dict) else None
    launcher = None
    if in_root:  # a hip build made in dfbuild's Debian forky root: its glibc floor is forky's
        notes.append(_root_note(path.name, in_root, needs))
        launcher = _root_launcher(in_root)
    patched = series_.get("head") or build_.get("source_commit")
    if patched is not None and not isinstance(patched, str):
        patched = None
    if not patched:
        problems.append(f"{path.name}: the manifest names no patched commit")
        return embedded
    exe = "bin/llama-server" + (".exe" if packed.get("os") == "windows" else "")
    if len(problems) > problems_before:
        why = "not run: the archive failed the checks above"
    elif run_later is not None:  # the caller runs it once every other check of the directory has passed
        run_later.append(path.name)
        return embedded
    elif not run_binaries:
        why = not_run_why
    elif (packed.get("os"), packed.get("arch")) != (host.os, host.arch) and not _runs_here(packed, host):
        why = f"built for {packed.get('os')}/{packed.get('arch')}, not run on {host.os}/{host.arch}"
    elif in_root and launcher is None:
        why = (f"not run: it runs only inside the Debian {in_root.get('suite')} root it was built in, "
               "which is not on this machine")
    else:
        why = _run_version(path, members, root, exe, patched, problems, notes, launcher=launcher)
    if why:
        # Cannot run it here: the version stamp must at least be compiled into the shipped files.
        holders = sorted(n for n, m in actual.items() if m.kind == "file" and patched.encode() in m.data)
        if holders:
            notes.append(f"{path.name}: {exe} {why}; the patched commit {patched[:12]} is stamped into "
                         f"{', '.join(holders)}")
        else:
            problems.append(f"{path.name}: {exe} {why}, and no shipped file holds the patched commit {patched[:12]}")
    return embedded


def _link_problem(name: str, member: Member, by_name: dict[str, Member]) -> str | None:
    """Why the link NAME cannot be vetted: it loops, dangles, or ends at a directory (None for a non-link)."""
    if member.kind != "link":
        return None
    hops, current, seen = 0, member, {name}
    where = name
    while current.kind == "link":
        where = str(PurePosixPath(where).parent / current.link).removeprefix("./")
        if where in seen:
            return f"is a symlink loop (it comes back to {where})"
        seen.add(where)
        current = by_name.get(where)
        hops += 1
        if current is None:
            return f"links to {where}, which the archive does not hold"
        if hops > len(by_name):
            return "is a symlink loop"
    if current.kind != "file":
        return f"links to {where}, which is not a file"
    return None


def _str_or_none(value) -> bool:
    return value is None or isinstance(value, str)


def manifest_field_problem(embedded: dict) -> str | None:
    """The first field of an archive's manifest that is not what dfbuild writes (a crafted or damaged
    manifest), named, or None. Every field verify reads is checked here, so no check meets a wrong type."""
    rel = embedded.get("release")
    for key in ("os", "arch", "wheel_dist", "wheel_version", "tag", "backend"):
        if not _str_or_none(rel.get(key)):
            return f"release.{key} is {type(rel.get(key)).__name__}, not text"
    for number, entry in enumerate(rel["files"]):
        for key in ("sha256", "link", "mode"):
            if not _str_or_none(entry.get(key)):
                return f"release.files[{number}].{key} ({entry['path']}) is {type(entry.get(key)).__name__}, not text"
    bundled = rel.get("wheel_bundled")
    if bundled is not None and not (isinstance(bundled, list) and all(
            isinstance(b, dict) and isinstance(b.get("name"), str) and isinstance(b.get("sha256"), str)
            for b in bundled)):
        return "release.wheel_bundled is not a list of {name, sha256}"
    for section in ("build", "series", "source", "smoke"):
        if embedded.get(section) is not None and not isinstance(embedded.get(section), dict):
            return f"{section} is {type(embedded.get(section)).__name__}, not a section (an object)"
    build_ = embedded.get("build") or {}
    binaries = build_.get("binaries")
    if binaries is not None and not (isinstance(binaries, list) and all(isinstance(b, str) for b in binaries)):
        return f"build.binaries is {type(binaries).__name__}, not a list of names"
    for section, key in (("build", "source_commit"), ("series", "head"), ("smoke", "ran_on"), ("smoke", "device")):
        if not _str_or_none((embedded.get(section) or {}).get(key)):
            return f"{section}.{key} is not text"
    if not isinstance((embedded.get("smoke") or {}).get("cpu_fallback", False), bool):
        return "smoke.cpu_fallback is not true or false"
    return None


GPU_BACKENDS = ("cuda", "vulkan", "hip")


def smoke_statement(embedded: dict) -> str:
    """Where an archive's smoke ran, in words, from its manifest (what verify and the release notes say)."""
    section = embedded.get("smoke") or {}
    backend = (embedded.get("release") or {}).get("backend")
    if section.get("skipped"):
        return "smoke skipped (--skip-smoke): not smoke-tested"
    if section.get("ran_on"):
        verdict = "passed" if section.get("passed") else "ran"
        if section.get("cpu_fallback"):
            return f"smoke {verdict} on the CPU backend, not on a {backend} device ({section['ran_on']})"
        return f"smoke {verdict} on {section['ran_on']}"
    if backend in GPU_BACKENDS:
        return "smoke: where it ran is not recorded (packaged before dfbuild recorded the device)"
    return "smoke passed on the CPU backend" if section.get("passed") else "smoke: no result recorded"


def version_commit(output: str) -> str | None:
    """The commit that llama-server's --version output names, in either format above."""
    found = next((m for m in (p.search(output) for p in _COMMIT_IN_VERSION) if m), None)
    return found.group(1) if found else None


_MISSING_LIBRARY = re.compile(r"error while loading shared libraries: ([^:\s]+)")
# Wine: "err:module:import_dll Library libwinpthread-1.dll (which is needed by ...) not found"
_MISSING_DLL = re.compile(r"Library (\S+\.dll) \(which is needed by [^)]*\) not found", re.IGNORECASE)
RUN_TIMEOUT_S = 300  # Wine's first start makes its prefix


def _runs_here(packed: dict, host: backends.Host) -> bool:
    """A Windows x64 archive runs on a Linux x64 host through Wine, a Linux arm64 one through qemu-aarch64
    (targets.toml: the cross entry's runner). No runner installed: the stamp is checked instead."""
    import shutil

    from . import platforms

    if host.os != "linux":
        return False
    if packed.get("os") == "windows" and packed.get("arch") == host.arch:
        runner = platforms.table()["targets"]["windows"].get("cross", {}).get(host.os, {}).get("runner")
    elif packed.get("os") == "linux" and packed.get("arch") != host.arch:
        cross_ = (platforms.table()["targets"]["linux"].get("arch", {}).get(packed.get("arch"), {})
                  .get("cross", {}).get(host.os, {}))
        runner = cross_.get("runner") if cross_.get("build_arch", host.arch) == host.arch else None
    else:
        return False
    return bool(runner) and shutil.which(runner[0]) is not None


def _driver_dll(packed: dict) -> str | None:
    from . import pe

    return pe.backend_driver_dll(packed.get("backend")) if packed.get("os") == "windows" else None


def _pe_problems(label: str, actual: dict[str, Member], arch: str | None, problems: list[str],
                 third_party: list[str] = (), *, backend: str | None = None,
                 driver_users: list[str] | None = None) -> int:
    """Every PE file of an archive: the archive's machine, every imported DLL inside the archive or a
    Windows system DLL, no absolute build path. Returns how many PE files there were.

    THIRD_PARTY: the toolchain's runtime DLLs (the manifest's release.runtime_dlls), shipped as their
    distribution built them: Debian's libgomp names Debian's /build/... tree, which is no path of ours.

    A GPU driver's DLL (vulkan-1.dll, nvcuda.dll) never ships: a copy beside the .exe would be loaded
    instead of the driver's own. BACKEND's driver DLL (targets.toml backend_driver_dlls: vulkan-1.dll
    for a Vulkan build) must be imported by some PE file: else the build never talks to the GPU.
    The files that import it go into DRIVER_USERS.
    """
    from . import pe

    files = {n: m for n, m in actual.items() if m.kind == "file" and m.data}
    shipped = {PurePosixPath(n).name for n in files}
    _, _, drivers = pe.system_dlls()
    for name_ in sorted(files):
        if PurePosixPath(name_).name.lower() in drivers:
            problems.append(f"{label}: {name_} is the GPU driver's own DLL, which an archive must not ship "
                            "(Windows would load this copy instead of the installed driver's)")
    wanted = pe.backend_driver_dll(backend)
    users: list[str] = []
    count = 0
    for name_, member in sorted(files.items()):
        if not pe.is_pe(member.data):
            continue
        count += 1
        try:
            info = pe.read(member.data)
        except Exception as exc:  # noqa: BLE001 - a damaged PE is a finding, not a crash
            problems.append(f"{label}: {name_} cannot be read as PE ({exc})")
            continue
        if arch and info.machine != arch:
            problems.append(f"{label}: {name_} is a {info.machine} PE file, not {arch}")
        missing = pe.unresolved_imports(info, shipped)
        if missing:
            problems.append(f"{label}: {name_} imports {', '.join(missing)}, which is neither in the archive nor "
                            "a Windows system DLL (Windows would refuse to start it)")
        if wanted and wanted.lower() in {d.lower() for d in [*info.imports, *info.delay_imports]}:
            users.append(PurePosixPath(name_).name)
        paths_found = pe.absolute_paths(member.data) if name_ not in third_party else []
        if paths_found:
            problems.append(f"{label}: {name_} names an absolute build path: {', '.join(paths_found)}")
    if wanted and count and not users:
        problems.append(f"{label}: no file imports {wanted}: this {backend} build would never reach the GPU "
                        f"driver (is ggml-{backend}.dll missing?)")
    if driver_users is not None:
        driver_users.extend(users)
    return count


def _root_note(label: str, in_root: dict, needs: dict[str, tuple[int, ...]]) -> str:
    """What a build made in the ROCm root means for where it starts: forky's glibc, not 22.04's."""
    top = elf.version_text(max(needs.values())) if needs else "?"
    rocm = in_root.get("rocm")
    if isinstance(rocm, dict):  # the packages the build used, as the root's record names them
        rocm = ", ".join(f"{name} {version}" for name, version in rocm.items())
    return (f"{label}: built in dfbuild's Debian {in_root.get('suite')} root with ROCm ({rocm}) "
            f"(no ROCm on the build machine): its glibc floor is {in_root.get('suite')}'s "
            f"(glibc {in_root.get('glibc')}; the binaries need {top}), so it starts on {in_root.get('suite')} or "
            "newer only; the published archive comes from the release matrix's Ubuntu 22.04 image (glibc 2.35)")


def _root_launcher(in_root: dict) -> list[str] | None:
    """The prefix that runs an archive built in the ROCm root inside that root, when it is on this machine:
    the root of this cache, or the one the manifest names (made by dfbuild in another cache, e.g. another
    DFBUILD_CACHE_DIR) when it is a made root of today's recipe."""
    from .platforms import rocm_root

    try:
        made = rocm_root.root_path()
    except Exception:  # noqa: BLE001 - no recipe, no root: the stamp is checked instead
        return None
    recorded = str(in_root.get("path", ""))
    if made.name != PurePosixPath(recorded).name:
        return None
    for candidate in (made, Path(recorded)):
        if candidate.is_absolute() and rocm_root.is_made(candidate):
            return rocm_root.launcher_for_root(candidate)
    return None


def _run_version(path: Path, members: list[Member], root: str, exe: str, patched: str,
                 problems: list[str], notes: list[str], launcher: list[str] | None = None) -> str | None:
    """Unpack and run `llama-server --version` (with LAUNCHER in front, when given). Returns why it could
    not run here, else None."""
    with state.temp_dir("verify") as tmp:
        extract_members(members, Path(tmp))
        binary = Path(tmp) / root / exe
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH")}
        from .smoke import launcher_for  # a Windows .exe on Linux runs through Wine

        prefix, launch_env = (launcher, {}) if launcher else launcher_for(binary)
        try:
            result = subprocess.run([*prefix, str(binary), "--version"], capture_output=True, text=True,
                                    timeout=RUN_TIMEOUT_S if prefix else 120, cwd=tmp, env=env | launch_env,
                                    errors="replace")
        except (OSError, subprocess.TimeoutExpired) as exc:
            problems.append(f"{path.name}: the unpacked {exe} does not run: {exc}")
            return None
    output = result.stdout + result.stderr
    missing = _MISSING_LIBRARY.search(output) or _MISSING_DLL.search(output)
    shipped = {PurePosixPath(m.name).name for m in members}
    if result.returncode != 0 and missing and missing.group(1) not in shipped:
        # e.g. libcuda.so.1 comes with the GPU driver, which this machine lacks
        return f"needs {missing.group(1)} from the system, which is missing here"
    found = version_commit(output)
    if result.returncode != 0:
        problems.append(f"{path.name}: the unpacked {exe} --version exited {result.returncode}: {output.strip()[-300:]}")
    elif not found or not _commit_matches(found, patched):
        problems.append(f"{path.name}: {exe} --version says {found or 'no commit'}, "
                        f"not the patched commit {patched[:12]}")
    else:
        notes.append(f"{path.name}: unpacked {exe} --version names the patched commit {found[:12]}")
    return None


def wheel_platform(platform_tag: str) -> tuple[str | None, str | None]:
    """(os, arch) in dfbuild's names for a wheel platform tag: linux_x86_64 -> (linux, x64)."""
    os_name = ("linux" if "linux" in platform_tag else "macos" if platform_tag.startswith("macosx")
               else "windows" if platform_tag.startswith("win") else None)
    arch = ("x64" if platform_tag.endswith(("x86_64", "amd64")) else
            "arm64" if platform_tag.endswith(("aarch64", "arm64")) else None)
    return os_name, arch


def _elf_problems(label: str, name: str, data: bytes, problems: list[str],
                  glibc: dict[str, tuple[int, ...]] | None = None, machine: str | None = None) -> int:
    """RUNPATH must be exactly $ORIGIN (or absent): an empty entry would load libraries from the current dir.
    With MACHINE (x86-64, AArch64), the file must be an ELF file for it.

    GLIBC, when given, gets NAME's highest GLIBC_ symbol version (the oldest glibc it starts on).
    Returns 1 for an ELF file, 0 otherwise.
    """
    if not elf.is_elf(data):
        return 0
    try:
        info = elf.read(data)
        problem = elf.search_path_problem(info)
    except Exception as exc:  # noqa: BLE001 - a damaged ELF is a finding, not a crash
        info, problem = None, f"cannot be read as ELF ({exc})"
    if problem:
        problems.append(f"{label}: {name} {problem}")
    if machine and info is not None and info.machine != machine:
        problems.append(f"{label}: {name} is an ELF file for {info.machine}, not {machine}")
    if glibc is not None and info is not None and info.glibc:
        glibc[name] = info.glibc
    return 1


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


def _glibc_note(label: str, needs: dict[str, tuple[int, ...]]) -> str:
    """One line: the highest glibc any ELF of LABEL needs, and which one."""
    top = max(needs.values())
    which = sorted(name for name, version in needs.items() if version == top)
    return (f"{label}: needs glibc {elf.version_text(top)} or newer "
            f"(GLIBC_{elf.version_text(top)} in {', '.join(which[:3])}{' ...' if len(which) > 3 else ''})")


def _check_wheel(path: Path, embedded_by_version: dict[tuple, dict], problems: list[str], notes: list[str],
                 glibc: dict | None = None) -> None:
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
        with zipfile.ZipFile(path) as zf:
            if not wheel_format_ok(path.name, zf, fields, problems):
                return  # what pip would refuse (or install otherwise than vetted) is not read further
            names = set(zf.namelist())
            shipped = {n[len(f"{package}/bin/"):]: zf.read(n) for n in names
                       if n.startswith(f"{package}/bin/") and not n.endswith("/")}
            wheel_manifest = json.loads(zf.read(f"{package}/{MANIFEST_NAME}"))
    except (zipfile.BadZipFile, KeyError, ValueError, OSError, RuntimeError, NotImplementedError) as exc:
        problems.append(f"{path.name}: cannot be read as a dfbuild wheel: {exc}")
        return
    if wheel_manifest != embedded:
        problems.append(f"{path.name}: its manifest differs from the archive's")
    needs: dict[str, tuple[int, ...]] = {}
    for name_, data in sorted(shipped.items()):
        _elf_problems(path.name, f"bin/{name_}", data, problems, needs)
        if name_ in bundled:  # a system library the manylinux wheel carries (recorded in the manifest)
            if hashlib.sha256(data).hexdigest() != bundled[name_]:
                problems.append(f"{path.name}: bin/{name_} differs from the library the manifest records")
            continue
        record = files.get(f"bin/{name_}")
        while record and "link" in record:
            record = files.get(f"bin/{record['link']}")
        if record is None or hashlib.sha256(data).hexdigest() != record.get("sha256"):
            problems.append(f"{path.name}: bin/{name_} differs from the archive's")
    binaries = [f"bin/{Path(b).name}" for b in (embedded.get("build") or {}).get("binaries") or []]
    for binary in binaries:
        if binary[len("bin/"):] not in shipped:
            problems.append(f"{path.name}: {binary} is missing")
    notes.append(f"{path.name}: {len(shipped)} files match the archive"
                 + (f" ({len(bundled)} bundled system libraries)" if bundled else ""))
    _check_wheel_glibc(path.name, platform_tag, needs, problems, notes, glibc)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _read_headers(zf: zipfile.ZipFile, name: str) -> dict[str, str] | None:
    """A dist-info file in RFC 822 header form (WHEEL, METADATA) as pip reads it; None when absent or unreadable."""
    from email.parser import HeaderParser

    try:
        text = zf.read(name).decode("utf-8")
    except (KeyError, UnicodeDecodeError):
        return None
    headers = HeaderParser().parsestr(text)
    if headers.defects:
        return None
    return {key: value for key, value in headers.items()}


_RECORD_HASHES = {"sha256", "sha384", "sha512"}  # PEP 376/427: no md5 or sha1


def wheel_format_ok(label: str, zf: zipfile.ZipFile, fields: dict, problems: list[str]) -> bool:
    """The wheel as pip would install it: safe, readable members, one NAME-VERSION.dist-info with WHEEL and
    METADATA that parse and agree with the file name, and a RECORD that lists every file with a hash and a
    size that match, and nothing the wheel does not hold. Appends what is wrong; False when anything is."""
    before = len(problems)
    infos = zf.infolist()
    seen: set[str] = set()
    for info in infos:
        why = unsafe_member(info.filename) or zip_member_problem(info)
        if info.filename in seen:
            why = "appears more than once"
        seen.add(info.filename)
        if why:
            problems.append(f"{label}: member {info.filename!r} {why}")
    if len(problems) > before:
        return False
    dist_info = f"{fields['dist']}-{fields['version']}.dist-info"
    tops = {n.split("/", 1)[0] for n in seen if n.split("/", 1)[0].endswith(".dist-info")}
    if tops != {dist_info}:
        problems.append(f"{label}: needs exactly one {dist_info}/ (pip's rule); it has "
                        f"{', '.join(sorted(tops)) or 'none'}")
        return False
    wheel = _read_headers(zf, f"{dist_info}/WHEEL")
    if wheel is None or not re.fullmatch(r"1\.\d+", (wheel.get("Wheel-Version") or "").strip()) \
            or (wheel.get("Root-Is-Purelib") or "").strip().lower() not in ("true", "false"):
        problems.append(f"{label}: {dist_info}/WHEEL is missing or does not parse "
                        "(Wheel-Version 1.x and Root-Is-Purelib)")
    meta = _read_headers(zf, f"{dist_info}/METADATA")
    if meta is None or not all(meta.get(k) for k in ("Metadata-Version", "Name", "Version")):
        problems.append(f"{label}: {dist_info}/METADATA is missing or does not parse "
                        "(Metadata-Version, Name, Version)")
    elif _canonical(meta["Name"]) != _canonical(fields["dist"]) or meta["Version"].strip() != fields["version"]:
        problems.append(f"{label}: METADATA names {meta['Name']} {meta['Version']}, not the file name's "
                        f"{fields['dist']} {fields['version']}")
    record_name = f"{dist_info}/RECORD"
    try:
        text = zf.read(record_name).decode("utf-8")
        rows = list(csv.reader(io.StringIO(text)))
    except (KeyError, UnicodeDecodeError, csv.Error) as exc:
        problems.append(f"{label}: {record_name} is missing or not a CSV file ({type(exc).__name__})")
        return False
    listed: dict[str, tuple[str, str]] = {}
    for number, row in enumerate(rows, 1):
        if not row:
            continue
        if len(row) != 3 or unsafe_member(row[0]) or row[0] in listed:
            problems.append(f"{label}: {record_name} line {number} is not a new 'path,hash,size' row")
            return False
        listed[row[0]] = (row[1], row[2])
    files = {info.filename: info for info in infos if not info.is_dir()}
    unsigned = {record_name, f"{dist_info}/RECORD.jws", f"{dist_info}/RECORD.p7s"}
    for name in sorted(set(files) - set(listed)):
        problems.append(f"{label}: {name} is in the wheel but not in its RECORD")
    for name in sorted(set(listed) - set(files)):
        problems.append(f"{label}: {record_name} lists {name}, which the wheel does not hold")
    for name in sorted(set(files) & set(listed)):
        digest, size = listed[name]
        if name in unsigned and not digest and not size:
            continue
        algorithm, _, expected = digest.partition("=")
        if algorithm not in _RECORD_HASHES or not expected or not size.isdigit():
            problems.append(f"{label}: {record_name} gives {name} no sha256 hash and size")
            continue
        data = zf.read(name)
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
    notes.append(_glibc_note(label, needs))
    promised = manylinux_glibc(platform_tag)
    if promised is None:
        return
    for name_, version in sorted(needs.items()):
        if version > promised:
            problems.append(f"{label}: {name_} needs GLIBC_{elf.version_text(version)}, but the tag "
                            f"{platform_tag} promises it runs on glibc {elf.version_text(promised)}")


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def unlisted_entries(directory: Path, sums: dict[str, str]) -> list[str]:
    """A problem for every entry of DIRECTORY that SHA256SUMS does not list (a file, a directory, a
    symlink, anything), read with lstat: a link is named, never followed. The directory's own records
    (SHA256SUMS, manifest.json or a merged dir's manifest-ID.json, the ownership marker) are exempt
    when they are regular files."""
    problems = []
    for entry in sorted(os.listdir(directory)):
        if entry in sums:
            continue
        path = directory / entry
        record = entry in (SUMS_NAME, MANIFEST_NAME, owned.MARKER_NAME) or re.fullmatch(r"manifest-.+\.json", entry)
        if record and _is_regular(path):
            continue
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue  # gone since it was listed
        kind = "" if stat.S_ISREG(mode) else f" ({locks.kind_of(mode)}, not followed)"
        problems.append(f"{entry} is not listed in {SUMS_NAME}{kind}")
    return problems


def verify(directory: Path, *, run_binaries: bool | None = None, host: backends.Host | None = None,
           limits: source.Limits | None = None) -> dict:
    """Check a release directory; returns {dir, ok, problems, checked}. Never raises on a mismatch.

    RUN_BINARIES: None (the default) runs an archive's llama-server --version only
    when the archive is one this dfbuild packaged (owned.was_produced); True also
    runs it from other archives (--run); False never runs anything (--no-run). No
    binary runs unless every other check of the directory (checksums, archives,
    wheels, manifest.json) has passed: the runs come last.
    """
    directory = Path(directory)
    host = host or backends.current_host()
    problems: list[str] = []
    notes: list[str] = []
    glibc: dict[str, dict[str, str]] = {}   # artifact -> ELF -> the highest GLIBC_ version it needs
    report = {"dir": str(directory), "problems": problems, "checked": notes, "glibc": glibc}
    sums_path = directory / SUMS_NAME
    if not sums_path.is_file():
        problems.append(f"no {SUMS_NAME} in {directory}")
        report["ok"] = False
        return report
    try:
        sums = read_sha256sums(sums_path)
    except VerifyError as exc:
        problems.append(exc.message)
        sums = {}
    for name, digest in sorted(sums.items()):
        if unsafe_member(name) or "/" in name:
            problems.append(f"{SUMS_NAME} names {name!r}, which is not a file of this directory")
        elif (directory / name).is_symlink():  # never followed: its sum would be of a file elsewhere
            problems.append(f"{name} is in {SUMS_NAME} but is a symbolic link, not a file of this directory")
        elif not (directory / name).is_file():
            problems.append(f"{name} is in {SUMS_NAME} but missing")
        elif sha256_file(directory / name) != digest:
            problems.append(f"{name}: sha256 does not match {SUMS_NAME}")
    problems.extend(unlisted_entries(directory, sums))
    # regular files only (lstat): a symlink is never followed, so a link loop cannot hang or crash the checks
    present = sorted(p.name for p in directory.iterdir()
                     if _is_regular(p) and (p.name.endswith(ARCHIVE_SUFFIXES) or p.name.endswith(".whl")))
    if sums and not problems:
        notes.append(f"{SUMS_NAME}: {len(sums)} artifacts match")
    checksums_ok = bool(sums) and not problems

    embedded_by_archive: dict[str, dict] = {}
    to_run: list[str] = []  # archives that passed their own checks and may run, once all else has passed
    for name in present:
        if name.startswith("cudart-"):  # the Windows CUDA runtime DLLs: covered by SHA256SUMS above
            continue
        if name.endswith(ARCHIVE_SUFFIXES):
            if not checksums_ok:
                allowed, why = False, f"not run: {SUMS_NAME} does not vouch for this directory"
            elif run_binaries is None:
                allowed = owned.was_produced(directory / name)
                why = f"not run: dfbuild did not package this archive here (pass {RUN_OPT_IN} to run it anyway)"
            else:
                allowed, why = run_binaries, "not run (--no-run)"
            try:
                # nothing runs yet: a binary runs last, once every check of the directory has passed
                embedded = _check_archive(directory / name, problems, notes, False, host, not_run_why=why,
                                          limits=limits, glibc=glibc, run_later=to_run if allowed else None)
            except VerifyError as exc:
                problems.append(exc.message)
                embedded = None
            except (TypeError, AttributeError, KeyError, ValueError) as exc:  # a field no check foresaw
                problems.append(f"{name}: its manifest cannot be checked ({type(exc).__name__}: {exc})")
                embedded = None
            if embedded:
                embedded_by_archive[name] = embedded
    # a wheel belongs to the archive of its version (base, series, backend) and platform
    by_version = {(e["release"].get("wheel_version"), e["release"].get("os"), e["release"].get("arch")): e
                  for e in embedded_by_archive.values() if isinstance(e.get("release"), dict)}
    for name in present:
        if name.endswith(".whl"):
            try:
                _check_wheel(directory / name, by_version, problems, notes, glibc)
            except (TypeError, AttributeError, KeyError, ValueError) as exc:  # a field no check foresaw
                problems.append(f"{name}: cannot be checked against its archive's manifest "
                                f"({type(exc).__name__}: {exc})")

    # a merged dir (CI's release job: each entry's manifest.json renamed manifest-ID.json) has one per entry
    tops = [directory / MANIFEST_NAME] if (directory / MANIFEST_NAME).is_file() else sorted(
        p for p in directory.glob("manifest-*.json") if p.is_file())
    if not tops:
        problems.append(f"no {MANIFEST_NAME} in {directory} (nor the manifest-ID.json files of a merged dir): "
                        "a dfbuild release dir has one beside its archives")
    for top in tops:
        label = top.name
        try:
            full = json.loads(top.read_text(encoding="utf-8"))
        except ValueError:
            problems.append(f"{label} is not JSON")
            full = {}
        rel = full.get("release") if isinstance(full, dict) else None
        artifacts = rel.get("artifacts", []) if isinstance(rel, dict) else None
        if not isinstance(artifacts, list) or not all(
                isinstance(a, dict) and isinstance(a.get("name"), str) and "sha256" in a and "size" in a
                for a in artifacts) or not isinstance(rel.get("archive", ""), str):
            problems.append(f"{label} does not have the shape of a dfbuild manifest")
            full, rel, artifacts = {}, {}, []
        for artifact in artifacts:
            if unsafe_member(artifact["name"]) or "/" in artifact["name"]:
                problems.append(f"{label} names {artifact['name']!r}, which is not a file of this directory")
                continue
            path = directory / artifact["name"]
            if not path.is_file():
                problems.append(f"{label} names {artifact['name']}, which is missing")
            elif sha256_file(path) != artifact["sha256"] or path.stat().st_size != artifact["size"]:
                problems.append(f"{artifact['name']}: sha256 or size does not match {label}")
            elif sums.get(artifact["name"]) != artifact["sha256"]:
                problems.append(f"{artifact['name']}: {label} and {SUMS_NAME} disagree")
        embedded = embedded_by_archive.get(rel.get("archive"))
        if rel.get("archive") and embedded is not None:
            for section in ("source", "series", "build", "smoke"):
                if full.get(section) != embedded.get(section):
                    problems.append(f"{label}: the {section} section differs from the one in {rel['archive']}")
            for key, value in embedded.get("release", {}).items():
                if rel.get(key) != value:
                    problems.append(f"{label}: release.{key} differs from the one in {rel['archive']}")
        elif rel.get("archive"):
            problems.append(f"{label} describes {rel['archive']}, which could not be checked")
        else:
            problems.append(f"{label} has no release section")
        if not any(p.startswith(label) for p in problems):
            notes.append(f"{label}: matches {rel.get('archive')}")
    checked_ok = not problems
    for name in to_run:
        again: list[str] = []  # its member checks were noted above; keep only what the run (or not) adds
        try:
            _check_archive(directory / name, problems, again, checked_ok, host, limits=limits,
                           not_run_why="not run: another check of this directory failed")
        except VerifyError as exc:
            problems.append(exc.message)
        notes.extend(n for n in again if n not in notes)  # the member checks again, and what the run adds
    report["ok"] = not problems
    return report


def check(directory: Path, *, run_binaries: bool | None = None) -> dict:
    """verify(), raising VerifyError (exit 51) on the first problem."""
    report = verify(directory, run_binaries=run_binaries)
    if not report["ok"]:
        count = len(report["problems"])
        raise VerifyError(report["problems"][0] + (f" (and {count - 1} more)" if count > 1 else ""),
                          "do not publish these files; rebuild them with `dfbuild release`")
    return report


def release_notes(directory: Path, base: str | None = None) -> str:
    """Markdown notes for a release dir: what it is, and where each archive's smoke ran, read from its
    manifest (manifest.json, or a merged dir's manifest-ID.json files). Run it after `verify`."""
    directory = Path(directory)
    tops = [directory / MANIFEST_NAME] if (directory / MANIFEST_NAME).is_file() else sorted(
        p for p in directory.glob("manifest-*.json") if p.is_file())
    if not tops:
        raise VerifyError(f"no {MANIFEST_NAME} in {directory} (nor the manifest-ID.json files of a merged dir)",
                          "give the directory `dfbuild release` wrote (or the merged dir CI's publish job makes)")
    where, fallback = [], False
    for top in tops:
        try:
            full = json.loads(top.read_text(encoding="utf-8"))
            archive = full["release"]["archive"]
            statement = smoke_statement(full)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise VerifyError(f"{top.name} is not a dfbuild manifest ({type(exc).__name__}: {exc})",
                              "run `dfbuild verify` on the directory first") from None
        fallback = fallback or bool((full.get("smoke") or {}).get("cpu_fallback"))
        where.append(f"- `{archive}`: {statement}")
    what = f"llama.cpp {base}" if base else "llama.cpp"
    lines = [f"Patched {what} with the DFlash multimodal fix (series in patches/). Verify with: sha256sum -c SHA256SUMS",
             "", "Where each archive's smoke tests ran:", *sorted(where)]
    if fallback:
        lines += ["", "An archive smoke-tested on the CPU backend was built for its GPU, but its smoke tests did "
                      "not run on a GPU: the runner that built it had none (GitHub's hosted runners have no GPU)."]
    return "\n".join(lines) + "\n"
