"""`dfbuild verify`: check a release directory before publishing it.

`verify()` checks an OUT directory: SHA256SUMS, each archive's members against
the file list in its manifest and its layout (llama.cpp's: the binaries at the
top of `llama-<tag>/` or of a flat zip; or dfbuild's older one: `bin/` inside a
folder named like the archive), OUT/manifest.json against the archives, the
wheel's binaries against the archive's, that the unpacked llama-server's
`--version` names the patched commit, and that every other shipped program
starts. It reports the highest GLIBC_ symbol
version each shipped ELF needs, and fails a wheel whose manylinux tag promises
an older glibc than one of its ELFs needs.

The checks of an archive's members are verify_members', the runs of its
programs verify_run's, a wheel's wheelcheck's; this module walks the directory
and says what it found (and writes the release notes).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections import Counter
from pathlib import Path, PurePosixPath
from typing import Any

from dfbuild.core import elf, locks, owned, readers
from dfbuild.core.archive import (
    ARCHIVE_SUFFIXES,
    payload_prefix,
    read_members,
    unsafe_member,
)
from dfbuild.core.errors import VerifyError
from dfbuild.core.paths import sha256_file
from dfbuild.host import backends
from dfbuild.release.record import MANIFEST_NAME, SUMS_NAME
from dfbuild.source import checkout as source
from dfbuild.verify import wheel as wheelcheck
from dfbuild.verify.image import IMAGE_SUFFIX
from dfbuild.verify.members import (
    _NO_ROOT,
    _SPECIAL_BITS,
    _driver_dll,
    _link_problem,
    _link_target_record,
    _pe_problems,
    allowed_roots,
    layout_problem,
    layout_root,
    manifest_field_problem,
    member_problem,
    smoke_statement,
)
from dfbuild.verify.programs import (
    _root_launcher,
    _root_note,
    _run_version,
    _runs_here,
)
from dfbuild.verify.wheel import manylinux_glibc, wheel_platform  # noqa: F401 - verify's API before the split

_elf_problems = elf.check_file  # the name tests and older callers use


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
    members = read_members(path, limits)  # the strict reader: names, kinds and duplicates are vetted there
    root = layout_root(path.name, [m.name for m in members])
    if root is _NO_ROOT:  # name the members outside the folder most of them are in
        tops = Counter(m.name.split("/", 1)[0] for m in members)
        most = tops.most_common(1)[0][0] if tops else ""
        stray = [m.name for m in members if m.name.split("/", 1)[0] != most]
        problems.append(f"{path.name}: its members are not all in one folder the archive may have "
                        f"({' or '.join(f'{r}/' for r in allowed_roots(path.name))}"
                        f"{', or none: a flat zip' if path.name.endswith('.zip') else ''}): "
                        f"{', '.join(repr(n) for n in stray[:3])}{' ...' if len(stray) > 3 else ''}")
        return None
    bad = False
    for member in members:
        why = member_problem(member, root)
        if why:
            problems.append(f"{path.name}: {why}")
            bad = True
    if bad:
        return None
    by_name = ({m.name[len(root) + 1:]: m for m in members if m.name != root} if root
               else {m.name.rstrip("/"): m for m in members})
    for name_, member in sorted(by_name.items()):
        why = _link_problem(name_, member, by_name)
        if why:
            problems.append(f"{path.name}: {name_} {why}")
            bad = True
    if bad:
        return None
    embedded_member = by_name.get(MANIFEST_NAME)
    if embedded_member is None or embedded_member.kind != "file":
        problems.append(f"{path.name}: no {root + '/' if root else ''}{MANIFEST_NAME}")
        return None
    try:
        embedded = readers.loads_json(embedded_member.data or b"")
    except ValueError as exc:
        problems.append(f"{path.name}: {MANIFEST_NAME} is not a JSON record dfbuild writes ({exc})")
        return None
    packed = embedded.get("release") if isinstance(embedded, dict) else None
    files = packed.get("files") if isinstance(packed, dict) else None
    if not isinstance(packed, dict) or not isinstance(files, list) or not all(
            isinstance(f, dict) and isinstance(f.get("path"), str) for f in files):
        problems.append(f"{path.name}: {MANIFEST_NAME} does not have the shape of a dfbuild manifest")
        return None
    why = manifest_field_problem(embedded)
    if why:
        problems.append(f"{path.name}: {MANIFEST_NAME}: {why}")
        return None
    why = layout_problem(path.name, root, packed)
    if why:
        problems.append(f"{path.name}: {why}")
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
        if "link" in record and not zipped:
            if member.kind != "link" or member.link != record["link"]:
                problems.append(f"{path.name}: {name_} should link to {record['link']}")
            continue
        if "link" in record:  # a zip carries a link as a copy of its target: the target's bytes and mode
            record = _link_target_record(name_, expected)
            if record is None:
                problems.append(f"{path.name}: {name_} is a link in the manifest to no file it lists")
                continue
        mode = "none" if member.mode is None else f"{member.mode:04o}"
        if member.kind != "file" or hashlib.sha256(member.data or b"").hexdigest() != record.get("sha256"):
            problems.append(f"{path.name}: {name_} does not match its sha256 in the manifest")
        elif os.name != "nt" and mode != record.get("mode"):
            problems.append(f"{path.name}: {name_} has mode {mode}, not {record.get('mode')}")
    needs: dict[str, tuple[int, ...]] = {}
    # every ELF file is for the archive's machine (an x64 library in an arm64 archive would never load)
    want_machine = elf.ARCH_MACHINES.get(packed.get("arch") or "") if packed.get("os") == "linux" else None
    elf_count = 0
    for name_, member in sorted(actual.items()):
        if member.kind == "file" and member.data:
            elf_count += elf.check_file(path.name, name_, member.data, problems, needs, want_machine)
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
        notes.append(elf.glibc_note(path.name, needs))

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
    suffix = ".exe" if packed.get("os") == "windows" else ""
    exe = payload_prefix(packed) + "llama-server" + suffix
    # every other program the build shipped: each must start (--version or --help) where llama-server runs
    programs = sorted({payload_prefix(packed) + PurePosixPath(b).name + ("" if b.endswith(suffix) else suffix)
                       for b in build_.get("binaries") or []} - {exe})
    programs = [p for p in programs if p in actual]
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
        why = _run_version(path, members, root, exe, patched, problems, notes, launcher=launcher,
                           programs=programs)
    if why:
        # Cannot run it here: the version stamp must at least be compiled into the shipped files.
        holders = sorted(n for n, m in actual.items() if m.kind == "file" and patched.encode() in (m.data or b""))
        if holders:
            notes.append(f"{path.name}: {exe} {why}; the patched commit {patched[:12]} is stamped into "
                         f"{', '.join(holders)}")
        else:
            problems.append(f"{path.name}: {exe} {why}, and no shipped file holds the patched commit {patched[:12]}")
    return embedded


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
        record = entry in (SUMS_NAME, MANIFEST_NAME, owned.MARKER_NAME) or _MERGED_MANIFEST.fullmatch(entry)
        if record and _is_regular(path):
            why = _marker_problem(path) if entry == owned.MARKER_NAME else None
            if why:
                problems.append(why)
            continue
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue  # gone since it was listed
        kind = "" if stat.S_ISREG(mode) else f" ({locks.kind_of(mode)}, not followed)"
        problems.append(f"{entry} is not listed in {SUMS_NAME}{kind}")
    return problems


_SUMS_MAX = 1 << 20       # bytes: a SHA256SUMS of 10,000 artifacts is under 1 MiB


_RECORD_MAX = 16 << 20    # bytes: a manifest.json


def _read_sums(path: Path) -> dict[str, str]:
    if os.lstat(path).st_size > _SUMS_MAX:
        raise readers.FormatError(f"{SUMS_NAME} is over {_SUMS_MAX} bytes")
    return readers.read_sha256sums(path)


def _read_record_file(path: Path):
    """A release dir's JSON record (manifest.json, manifest-ID.json, the ownership marker), strictly."""
    if os.lstat(path).st_size > _RECORD_MAX:
        raise readers.FormatError(f"over {_RECORD_MAX} bytes")
    return readers.loads_json(path.read_bytes())


_MERGED_MANIFEST = re.compile(r"manifest-.+\.json")


def _top_manifests(directory: Path, problems: list[str]) -> tuple[list[Path], bool]:
    """The release dir's own manifests: manifest.json, or (CI's merged dir: each entry's manifest.json renamed
    manifest-ID.json) one per entry; never both kinds. Returns (paths, merged). Regular files only (lstat)."""
    names = sorted(os.listdir(directory))
    merged = [directory / n for n in names if _MERGED_MANIFEST.fullmatch(n) and _is_regular(directory / n)]
    if _is_regular(directory / MANIFEST_NAME):
        if merged:  # a stray manifest-X.json beside manifest.json would be exempt from SHA256SUMS, unchecked
            problems.append(f"{', '.join(p.name for p in merged)} beside {MANIFEST_NAME}: a release dir has "
                            "one or the other (a merged dir's manifest-ID.json files)")
        return [directory / MANIFEST_NAME], False
    if not merged:
        problems.append(f"no {MANIFEST_NAME} in {directory} (nor the manifest-ID.json files of a merged dir): "
                        "a dfbuild release dir has one beside its archives")
    return merged, True


def _check_flat_archive(path: Path, problems: list[str], limits) -> None:
    """A flat archive with no manifest (the Windows CUDA runtime bundle): it must read strictly, and hold
    plain files and folders only (its bytes are vouched for by SHA256SUMS alone)."""
    try:
        members = read_members(path, limits)
    except VerifyError as exc:
        problems.append(exc.message)
        return
    for member in members:
        if member.kind == "link" or (member.mode is not None and member.mode & _SPECIAL_BITS):
            problems.append(f"{path.name}: {member.name} is a link or has special mode bits")


def _marker_problem(path: Path) -> str | None:
    """Why the output dir's ownership marker is not the one dfbuild writes (it is exempt from SHA256SUMS as
    bookkeeping that never ships: CI uploads no dot files), or None."""
    try:
        data = _read_record_file(path)
    except (readers.FormatError, OSError) as exc:
        return f"{path.name} is not a JSON record dfbuild writes ({getattr(exc, 'message', exc)})"
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(data, dict) or set(data) != {"written_by", "files"} or data["written_by"] != "dfbuild" \
            or not isinstance(files, list) or not all(isinstance(f, str) and not unsafe_member(f) and "/" not in f
                                                      for f in files):
        return f"{path.name} is not dfbuild's ownership marker ({{written_by: dfbuild, files: [names]}})"
    return None


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
    report: dict[str, Any] = {"dir": str(directory), "problems": problems, "checked": notes, "glibc": glibc}
    sums_path = directory / SUMS_NAME
    if not _is_regular(sums_path):  # lstat: a symlinked SHA256SUMS would vouch with a file from elsewhere
        problems.append(f"no {SUMS_NAME} in {directory}")
        report["ok"] = False
        return report
    try:
        sums = _read_sums(sums_path)
    except (readers.FormatError, OSError) as exc:
        problems.append(getattr(exc, "message", None) or f"{SUMS_NAME} cannot be read: {exc}")
        sums = {}
    for name, digest in sorted(sums.items()):
        if (directory / name).is_symlink():  # never followed: its sum would be of a file elsewhere
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
        if name.startswith("cudart-"):  # the Windows CUDA runtime DLLs: a flat archive with no manifest
            _check_flat_archive(directory / name, problems, limits)
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
                wheelcheck.check_wheel(directory / name, by_version, problems, notes, glibc)
            except (TypeError, AttributeError, KeyError, ValueError) as exc:  # a field no check foresaw
                problems.append(f"{name}: cannot be checked against its archive's manifest "
                                f"({type(exc).__name__}: {exc})")

    tops, merged = _top_manifests(directory, problems)
    described: dict[str, list[str]] = {}  # artifact -> the top manifests that list it
    images: dict[str, tuple[dict, dict]] = {}  # image archive -> (its record, the top manifest naming it)
    for top in tops:
        label = top.name
        try:
            full = _read_record_file(top)
        except (readers.FormatError, OSError) as exc:
            problems.append(f"{label} is not a JSON record dfbuild writes ({getattr(exc, 'message', exc)})")
            full = {}
        rel = full.get("release") if isinstance(full, dict) else None
        artifacts = rel.get("artifacts", []) if isinstance(rel, dict) else None
        if not isinstance(rel, dict) or not isinstance(artifacts, list) or not all(
                isinstance(a, dict) and isinstance(a.get("name"), str) and "sha256" in a and "size" in a
                for a in artifacts) or not isinstance(rel.get("archive", ""), str):
            problems.append(f"{label} does not have the shape of a dfbuild manifest")
            full, rel, artifacts = {}, {}, []
        for artifact in artifacts:
            if unsafe_member(artifact["name"]) or "/" in artifact["name"]:
                problems.append(f"{label} names {artifact['name']!r}, which is not a file of this directory")
                continue
            described.setdefault(artifact["name"], []).append(label)
            path = directory / artifact["name"]
            if not path.is_file():
                problems.append(f"{label} names {artifact['name']}, which is missing")
            elif sha256_file(path) != artifact["sha256"] or path.stat().st_size != artifact["size"]:
                problems.append(f"{artifact['name']}: sha256 or size does not match {label}")
            elif sums.get(artifact["name"]) != artifact["sha256"]:
                problems.append(f"{artifact['name']}: {label} and {SUMS_NAME} disagree")
        for record in full.get("images", []) if isinstance(full.get("images"), list) else []:
            if isinstance(record, dict) and isinstance(record.get("name"), str):
                images[record["name"]] = (record, full)
        embedded = embedded_by_archive.get(rel.get("archive") or "")
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
    if merged:  # CI's merged dir: each entry's manifest-ID.json describes its own archive and wheel, all of them
        for name in sorted(sums):
            owners = described.get(name, [])
            if not owners and not name.startswith("cudart-"):
                problems.append(f"{name} is described by no manifest-ID.json (one was removed, or it was never "
                                "released with this dir)")
            elif len(owners) > 1:
                problems.append(f"{name} is described by {len(owners)} manifests ({', '.join(owners)})")
    _check_images(directory, images, problems, notes)
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


def _check_images(directory: Path, images: dict[str, tuple[dict, dict]], problems: list[str],
                  notes: list[str]) -> None:
    """Each image archive of the directory against its record (verify.image), and none without one."""
    from dfbuild.verify.image import check_image

    for path in sorted(directory.iterdir()):
        if _is_regular(path) and path.name.endswith(IMAGE_SUFFIX) and path.name not in images:
            problems.append(f"{path.name} is an image no manifest describes")
    for name, (record, full) in sorted(images.items()):
        if not _is_regular(directory / name):
            problems.append(f"the manifest describes the image {name}, which is missing")
            continue
        try:
            check_image(directory, record, full, problems, notes)
        except VerifyError as exc:  # its archive does not read (noted above as well)
            problems.append(f"{name}: {exc.message}")


def check(directory: Path, *, run_binaries: bool | None = None) -> dict:
    """verify(), raising VerifyError (exit 51) on the first problem."""
    report = verify(directory, run_binaries=run_binaries)
    if not report["ok"]:
        count = len(report["problems"])
        raise VerifyError(report["problems"][0] + (f" (and {count - 1} more)" if count > 1 else ""),
                          "do not publish these files; rebuild them with `dfbuild release`")
    return report


def release_notes(directory: Path, base: str | None = None, registry: str | None = None) -> str:
    """Markdown notes for a release dir: what it is, and where each archive's smoke ran, read from its
    manifest (manifest.json, or a merged dir's manifest-ID.json files). Run it after `verify`."""
    directory = Path(directory)
    found: list[str] = []
    tops, _ = _top_manifests(directory, found)
    if found:
        raise VerifyError(found[0], "give the directory `dfbuild release` wrote (or the merged dir CI's publish "
                          "job makes), and run `dfbuild verify` on it first")
    from dfbuild.host import webui

    where, served, fallback, laid_out, runtimes, images = [], [], False, False, [], []
    for top in tops:
        try:
            full = _read_record_file(top)
            archive = full["release"]["archive"]
            statement = smoke_statement(full)
            page = webui.describe((full.get("build") or {}).get("ui"))
            programs = sorted(PurePosixPath(b).name for b in (full.get("build") or {}).get("binaries") or [])
            laid_out = laid_out or bool(full["release"].get("layout"))
            runtimes += [a["name"] for a in full["release"].get("artifacts", []) if a.get("kind") == "cudart"]
            images += [i for i in full.get("images", []) if isinstance(i, dict)]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise VerifyError(f"{top.name} is not a dfbuild manifest ({type(exc).__name__}: {exc})",
                              "run `dfbuild verify` on the directory first") from None
        fallback = fallback or bool((full.get("smoke") or {}).get("cpu_fallback"))
        where.append(f"- `{archive}`: {statement}; {len(programs)} program{'s' if len(programs) != 1 else ''}")
        served.append(f"- `{archive}`: {page}")
    what = f"llama.cpp {base}" if base else "llama.cpp"
    lines = [f"Patched {what} with the DFlash multimodal fix (series in patches/). "
             "Verify with: sha256sum -c SHA256SUMS"]
    if laid_out:
        lines += ["", "Each archive is laid out as llama.cpp's own of the same name: its programs (every tool "
                      "llama.cpp ships: llama-server, llama-cli, llama-mtmd-cli, llama-bench, llama-quantize, "
                      "ggml-rpc-server, ...) and libraries at the top of `llama-<tag>/` in a tarball, at the top of a "
                      "Windows zip; manifest.json, patches/ and licenses/ beside them."]
    if runtimes:
        lines += ["", "The CUDA runtime libraries, to unpack beside the programs of the CUDA archive of the same "
                      "toolkit (as llama.cpp's cudart archives): " + ", ".join(f"`{n}`" for n in sorted(set(runtimes)))]
    lines += ["", "Where each archive's smoke tests ran:", *sorted(where),
              "", "What each archive's llama-server serves at GET / (its web UI):", *sorted(served)]
    from dfbuild.verify.image import notes_lines

    lines += notes_lines(images, registry)
    if fallback:
        lines += ["", "An archive smoke-tested on the CPU backend was built for its GPU, but its smoke tests did "
                      "not run on a GPU: the runner that built it had none (GitHub's hosted runners have no GPU)."]
    return "\n".join(lines) + "\n"
