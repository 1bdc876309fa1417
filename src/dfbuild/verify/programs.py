"""verify's runs of what an archive ships, unpacked: llama-server --version (it must name the patched
commit) and every other program started with --version or --help, natively, under Wine or qemu for a
foreign archive, or inside the ROCm root a hip build was made in; a missing library is named.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from dfbuild.core import elf, proc, state
from dfbuild.core.archive import (
    Member,
    extract_members,
)
from dfbuild.host import backends
from dfbuild.verify.wheel import manylinux_glibc, wheel_platform  # noqa: F401 - verify's API before the split

# "version: 0.2.0-dev (build 10359, commit <sha>)" or, in other releases, "version: 10355 (<sha>)"
_COMMIT_IN_VERSION = (re.compile(r"commit ([0-9A-Za-z]+(?:-dirty)?)"),
                      re.compile(r"version: \d+ \(([0-9A-Fa-f]{7,}(?:-dirty)?)\)"))


def _commit_matches(found: str, expected: str) -> bool:
    return found == expected or (len(found) >= 7 and not found.endswith("-dirty") and expected.startswith(found))


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

    from dfbuild.host import platforms

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
    from dfbuild.host.platforms import rocm_root

    try:
        made = rocm_root.root_path()
    except Exception:
        return None
    recorded = str(in_root.get("path", ""))
    if made.name != PurePosixPath(recorded).name:
        return None
    for candidate in (made, Path(recorded)):
        if candidate.is_absolute() and rocm_root.is_made(candidate):
            return rocm_root.launcher_for_root(candidate)
    return None


def _run_version(path: Path, members: list[Member], root: str | None, exe: str, patched: str,
                 problems: list[str], notes: list[str], launcher: list[str] | None = None,
                 programs: Sequence[str] = ()) -> str | None:
    """Unpack and run `llama-server --version` (with LAUNCHER in front, when given), then start every
    other of PROGRAMS (start_programs). Returns why llama-server could not run here, else None."""
    with state.temp_dir("verify") as tmp:
        extract_members(members, Path(tmp))
        folder = Path(tmp) / root if root else Path(tmp)
        binary = folder / exe
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH")}
        from dfbuild.smoke import launcher_for  # a Windows .exe on Linux runs through Wine

        prefix, launch_env = (launcher, {}) if launcher else launcher_for(binary)
        try:
            result = proc.run([*prefix, binary, "--version"], timeout=RUN_TIMEOUT_S if prefix else 120, cwd=tmp,
                              env=env | launch_env, errors="replace")
        except (OSError, proc.TimeoutExpired) as exc:
            problems.append(f"{path.name}: the unpacked {exe} does not run: {exc}")
            return None
        output = result.stdout + result.stderr
        started: list[str] = []
        if result.returncode == 0 and programs:  # llama-server starts: so must every other program
            start_programs(path.name, folder, programs, prefix, env | launch_env, problems, started)
    missing = _MISSING_LIBRARY.search(output) or _MISSING_DLL.search(output)
    shipped = {PurePosixPath(m.name).name for m in members}
    if result.returncode != 0 and missing and missing.group(1) not in shipped:
        # e.g. libcuda.so.1 comes with the GPU driver, which this machine lacks
        return f"needs {missing.group(1)} from the system, which is missing here"
    found = version_commit(output)
    if result.returncode != 0:
        problems.append(f"{path.name}: the unpacked {exe} --version exited {result.returncode}: "
                        f"{output.strip()[-300:]}")
    elif not found or not _commit_matches(found, patched):
        problems.append(f"{path.name}: {exe} --version says {found or 'no commit'}, "
                        f"not the patched commit {patched[:12]}")
    else:
        notes.append(f"{path.name}: unpacked {exe} --version names the patched commit {found[:12]}")
    notes.extend(started)
    return None


PROGRAM_TIMEOUT_S = 60          # one program's --version/--help, natively


PROGRAM_TIMEOUT_RUNNER_S = 180  # ... under Wine or qemu (the prefix exists by now: llama-server ran first)


# a loader's own words for a program that cannot start (beside a missing library): a bad ELF or PE, a
# symbol missing from a shipped library, Windows' STATUS_DLL_NOT_FOUND / STATUS_ENTRYPOINT_NOT_FOUND
_CANNOT_START = re.compile(r"error while loading shared libraries|cannot execute binary file|exec format error|"
                           r"symbol lookup error|undefined symbol|err:module:import_dll|"
                           r"c0000135|c0000139", re.IGNORECASE)


_WINDOWS_LOADER_CODES = {0xC0000135, 0xC0000139, 0xC0000142}  # DLL not found, entry point, DLL init failed


def start_programs(label: str, folder: Path, programs: Sequence[str], prefix: list[str], env: dict,
                   problems: list[str], notes: list[str]) -> None:
    """Start each of PROGRAMS (paths under FOLDER) with --version, else --help, and fail the one that does
    not start: the loader refuses it (a library or DLL missing, a bad binary), it dies of a signal, or
    it does not exit in time. A program that runs and prints its usage with a non-zero exit has started
    (llama-quantize and mtmd's deprecated llama-*-cli stubs know no --version)."""
    timeout = PROGRAM_TIMEOUT_RUNNER_S if prefix else PROGRAM_TIMEOUT_S
    ok: list[str] = []
    for rel in programs:
        binary = folder / rel
        how = None
        for flag in ("--version", "--help"):
            try:
                result = proc.run([*prefix, binary, flag], timeout=timeout, cwd=folder, env=env, stdin=proc.DEVNULL,
                                  errors="replace")
            except proc.TimeoutExpired:
                how = f"did not exit within {timeout} s of {flag}"
                break
            except OSError as exc:
                how = f"cannot be started: {exc.strerror or exc}"
                break
            output = (result.stdout + result.stderr).strip()
            code = result.returncode
            if code < 0 or (code & 0xFFFFFFFF) in _WINDOWS_LOADER_CODES or _CANNOT_START.search(output) \
                    or code in (126, 127):
                why = (next((line for line in output.splitlines() if _CANNOT_START.search(line)), "")
                       or (f"killed by signal {-code}" if code < 0 else f"exit {code:#x}" if code > 255 else
                           f"exit {code}"))
                how = f"does not start ({flag}): {why.strip()[:200]}"
                break
            if code == 0:
                ok.append(f"{PurePosixPath(rel).name} {flag}")
                how = None
                break
            how = ""  # it ran and answered with its usage: try --help, else it started all the same
        if how:
            problems.append(f"{label}: the unpacked {rel} {how}")
        elif how == "":
            ok.append(f"{PurePosixPath(rel).name} (usage, exit {code})")
    if ok:
        notes.append(f"{label}: {len(ok)} more programs start: {', '.join(ok)}")
