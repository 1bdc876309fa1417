"""A Debian forky root with ROCm 6.4's development packages: where the hip backend builds and runs here.

The machine dfbuild runs on usually has no ROCm (Debian 12's HIP is 5.x, older
than llama.cpp's minimum 6.1), but Debian forky packages ROCm 6.4, the ROCm
line of the release matrix's rocm/dev-ubuntu-22.04:6.4.4 image. dfbuild makes
a forky root with mmdebstrap from Debian's own archive, from the recipe in
data/rocm_root.toml (suite, mirror, variant, packages), and runs CMake, ninja
and the built binaries inside it: a private mount namespace (`unshare
--mount`), the folders a command names bound in at the same paths, then
chroot. The binaries link forky's glibc and ROCm libraries, so they run only in
that root (or a system as new): `verify` says so, and the published archive
still comes from the matrix's 22.04 image.

The root is made once and kept in dfbuild's cache, in a folder keyed by the
recipe: a changed recipe is a new folder, the old one is never reused. It is
made in a `.partial` folder renamed into place only when complete, under a
lock, with its record (`dfbuild-root.json`: package versions, download size,
disk size, wall time) written last, so Ctrl-C, `kill -9` or two runs at once
never leave a half-made root that a later build would use.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from dfbuild.core import paths, proc, state, ui
from dfbuild.core.errors import BuildError, SourceError, ToolchainMissingError, UsageError
from dfbuild.host import backends

RECORD_NAME = "dfbuild-root.json"   # written last: a root without it is not a usable root
RECIPE_FILE = "rocm_root.toml"
MMDEBSTRAP_INSTALL = "apt-get install mmdebstrap"
# The folders a command inside the root never gets from the host: they are the root's own.
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt", "/var",
               "/proc", "/sys", "/dev", "/run", "/boot")
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TENSILE_FILE = re.compile(r"TensileLibrary_lazy_(gfx[0-9a-f]+)\.dat")
BUILT_IN_ROOT = "dfbuild-rocm-root.json"  # in a build dir: its binaries run inside this root (smoke, verify)

# Runs in the new mount namespace (`unshare --mount`, private propagation): binds each folder
# given before `--` at its own path inside the root, then /dev and /sys (ROCm's runtime finds AMD GPUs
# through /dev/kfd and the KFD topology in sysfs) and a fresh /proc, and becomes the command in the
# root, in the given working folder. A constant: every value is an argument.
_ENTER = r"""set -e
root=$1; cwd=$2; shift 2
while [ "$1" != "--" ]; do
    mkdir -p "$root$1"
    mount --rbind "$1" "$root$1"
    shift
done
shift
mount --rbind /dev "$root/dev"
mount --rbind /sys "$root/sys"
mount -t proc proc "$root/proc"
exec chroot "$root" /usr/bin/env --chdir="$cwd" "$@"
"""


@functools.cache
def recipe() -> dict:
    """data/rocm_root.toml's [root] table, checked for the fields the root needs."""
    root = backends.data_table(RECIPE_FILE)["root"]
    check_recipe(root)
    return root


def check_recipe(root: dict) -> None:
    """A recipe that cannot make a root is dfbuild's bug: say which field (no network needed)."""
    for key in ("name", "rocm", "suite", "mirror", "variant", "architecture", "packages"):
        if not root.get(key):
            raise BuildError(f"{RECIPE_FILE} has no [root] {key}", "this is a dfbuild bug: reinstall dfbuild")
    if not re.fullmatch(r"https?://[^\s]+", root["mirror"]):
        raise BuildError(f"{RECIPE_FILE}: mirror {root['mirror']!r} is not an http(s) URL", "reinstall dfbuild")
    for name in [*root["packages"], *root.get("expect", {})]:
        if not re.fullmatch(r"[a-z0-9][a-z0-9+.-]+", name):
            raise BuildError(f"{RECIPE_FILE}: {name!r} is not a Debian package name", "reinstall dfbuild")
    missing = [name for name in root.get("expect", {}) if name not in root["packages"]]
    if missing:
        raise BuildError(f"{RECIPE_FILE}: [root.expect] names {', '.join(missing)}, which the root does not install",
                         "reinstall dfbuild")


def recipe_key(root: dict) -> str:
    """What decides the root's contents: a new value is a new folder."""
    fields = [root["suite"], root["mirror"], root["variant"], root["architecture"], *root.get("components", ()),
              *root.get("apt_options", ()), *root["packages"]]
    return hashlib.sha256("\0".join(fields).encode()).hexdigest()[:12]


def root_path(root: dict | None = None) -> Path:
    root = root or recipe()
    return paths.cache_dir() / "roots" / f"{root['name']}-{recipe_key(root)}"


def is_made(path: Path) -> bool:
    return (path / RECORD_NAME).is_file() and (path / "usr" / "bin" / "hipconfig").exists()


def record(path: Path) -> dict:
    return json.loads((path / RECORD_NAME).read_text(encoding="utf-8"))


# --- GPU targets ----------------------------------------------------------------------------


def known_gpu_targets(root: dict | None = None) -> list[str]:
    """What ROCm 6.4 builds for, and what this root's rocBLAS has kernels for (the recipe's lists)."""
    lists = (root or recipe()).get("gpu_targets", {})
    return sorted(set(lists.get("rocm", ())) | set(lists.get("rocblas", ())))


def check_gpu_targets(targets: str, root: dict | None = None) -> list[str]:
    """TARGETS ('gfx1100;gfx1201', as backends.parse_gpu_targets gives them) that this ROCm knows, or UsageError.

    Checked against the recipe's lists before anything is downloaded; the rocBLAS list itself is
    checked against the made root (tensile_targets) when the root is made. A target ROCm knows but
    this root's rocBLAS has no kernels for is built, with a warning.
    """
    root = root or recipe()
    known = known_gpu_targets(root)
    items = [t for t in targets.split(";") if t]
    unknown = [t for t in items if t not in known]
    if unknown:
        raise UsageError(f"ROCm {root['rocm']} does not know the GPU target(s) {', '.join(unknown)}",
                         f"choose --gpu-targets among: {', '.join(known)} (or a family of backends.toml)")
    no_kernels = [t for t in items if t not in root.get("gpu_targets", {}).get("rocblas", ())]
    if no_kernels:
        ui.warn(f"the Debian {root['suite']} root's rocBLAS has no kernels for {', '.join(no_kernels)}: ggml's own "
                f"HIP kernels are compiled for them, but on such a GPU the binaries need a rocBLAS that has "
                f"them (AMD's ROCm {root['rocm']} has)")
    return items


def tensile_targets(path: Path) -> list[str]:
    """The gfx ids the root's rocBLAS ships Tensile kernels for (its TensileLibrary_lazy_<gfx>.dat files)."""
    found = set()
    for library in (path / "usr" / "lib").glob("*/rocblas/*/library"):
        for entry in library.iterdir():
            match = TENSILE_FILE.fullmatch(entry.name)
            if match:
                found.add(match.group(1))
    return sorted(found)


# --- making the root ---------------------------------------------------------------------------


def mmdebstrap_command(root: dict, target: Path) -> list[str]:
    """mmdebstrap's argument list for ROOT into TARGET (a folder)."""
    args = ["mmdebstrap", f"--variant={root['variant']}", f"--architectures={root['architecture']}",
            f"--components={','.join(root.get('components', ['main']))}",
            f"--include={','.join(root['packages'])}",
            # keep the package lists: dfbuild reads the download size from them, then removes them
            "--skip=cleanup/apt/lists"]
    args += [f"--aptopt={option}" for option in root.get("apt_options", ())]
    return [*args, root["suite"], str(target), root["mirror"]]


def contained(args: list[str]) -> list[str]:
    """ARGS in their own mount and PID namespaces: the mounts mmdebstrap makes in the root it builds
    (/proc, /sys, /dev) are never seen by this machine and vanish with it, and when it is killed every
    process it started dies too (the namespace's first process), so nothing writes into a `.partial`
    folder that the next run removes."""
    if os.geteuid() != 0:  # mmdebstrap's own unshare mode: its mounts are in its own namespace already
        return list(args)
    return ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child", "--", *args]


def check_reachable(root: dict, timeout: float = 30) -> None:
    """The archive answers for the suite (its InRelease), or SourceError before mmdebstrap starts."""
    url = f"{root['mirror'].rstrip('/')}/dists/{root['suite']}/InRelease"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout) as answer:
            if answer.status != 200:
                raise OSError(f"HTTP {answer.status}")
    except (OSError, urllib.error.URLError) as exc:
        raise SourceError(f"cannot reach Debian's archive for the ROCm root: {url}: {exc}",
                          f"check the network (or a proxy) to {root['mirror']}; nothing was made") from None


def ensure(root: dict | None = None) -> Path:
    """The made root for ROOT (the recipe), made once when absent. Returns its folder."""
    root = root or recipe()
    path = root_path(root)
    if is_made(path):
        return path
    if shutil.which("mmdebstrap") is None:
        raise ToolchainMissingError("mmdebstrap is not installed: it makes the Debian forky root with ROCm "
                                    f"{root['rocm']} that the hip backend builds in here",
                                    f"install it (Debian, Ubuntu: {MMDEBSTRAP_INSTALL})")
    with paths.locked(path, timeout=3600):
        if is_made(path):  # another dfbuild made it while this one waited
            return path
        check_reachable(root)
        _make(root, path)
    return path


def _make(root: dict, path: Path) -> None:
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what a killed run left (we hold the lock)
    shutil.rmtree(path, ignore_errors=True)     # a folder without its record is not a root
    try:
        _make_in(root, path, partial)
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # renamed into place when it worked


def _make_in(root: dict, path: Path, partial: Path) -> None:
    log_path = path.with_name(path.name + ".log")
    command = mmdebstrap_command(root, partial)
    ui.info(f"making the Debian {root['suite']} root with ROCm {root['rocm']} once (about 550 MB to download, "
            f"5.3 GB on disk; log: {log_path}); every later hip build reuses it")
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        done = proc.run(contained(command), stdout=log, stderr=proc.STDOUT, stdin=proc.DEVNULL,
                        die_with=signal.SIGKILL)  # --kill-child then ends mmdebstrap
    wall = time.monotonic() - start
    if done.returncode != 0:
        text = log_path.read_text(encoding="utf-8", errors="replace")
        reason = next((line for line in text.splitlines() if line.startswith("E: ")), f"exit {done.returncode}")
        if re.search(r"Failed to fetch|Could not resolve|Unable to connect|Temporary failure|Connection", text):
            raise SourceError(f"mmdebstrap could not download the ROCm root from {root['mirror']}: {reason}",
                              f"check the network to {root['mirror']}; full log: {log_path}")
        if re.search(r"Unable to locate package|has no installation candidate|unmet dependencies", text):
            raise BuildError(f"Debian {root['suite']} no longer has the ROCm root's packages as "
                             f"{RECIPE_FILE} names them: {reason}",
                             f"a newer dfbuild may know the new names; full log: {log_path}")
        raise BuildError(f"mmdebstrap failed to make the ROCm root: {reason}", f"full log: {log_path}")
    versions = installed_versions(partial)
    problems = [f"{name} {versions.get(name, 'missing')} is not {want}.x"
                for name, want in root.get("expect", {}).items()
                if not (versions.get(name, "").split(":")[-1] + ".").startswith(want + ".")]
    if problems:
        raise BuildError(f"the Debian {root['suite']} root does not hold ROCm {root['rocm']}: {'; '.join(problems)}",
                         f"the archive moved to another ROCm line; a newer dfbuild follows it (log: {log_path})")
    download = download_bytes(partial, versions)
    for lists in (partial / "var" / "lib" / "apt" / "lists").glob("*_Packages*"):
        lists.unlink()
    tensile = tensile_targets(partial)
    listed = sorted(root.get("gpu_targets", {}).get("rocblas", ()))
    if tensile != listed:
        raise BuildError(f"{RECIPE_FILE}'s rocblas GPU targets ({', '.join(listed)}) are not those this root's "
                         f"rocBLAS has kernels for ({', '.join(tensile) or 'none'})",
                         f"the archive's rocBLAS changed; a newer dfbuild follows it (log: {log_path})")
    (partial / RECORD_NAME).write_text(json.dumps({
        "name": root["name"], "suite": root["suite"], "mirror": root["mirror"], "variant": root["variant"],
        "recipe_key": recipe_key(root), "mmdebstrap": command[:-3], "packages": versions,
        "rocm": {name: versions.get(name) for name in root.get("expect", {})},
        "gpu_targets": tensile, "download_bytes": download, "disk_bytes": disk_bytes(partial),
        "wall_s": round(wall, 1)}, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    state.move(partial, path)
    made = record(path)
    ui.info(f"made {path}: {made['download_bytes'] / 1e6:.0f} MB downloaded, {made['disk_bytes'] / 1e9:.2f} GB "
            f"on disk, {made['wall_s']:.0f} s")


def installed_versions(path: Path) -> dict[str, str]:
    """{package: version} from the root's dpkg status file (read here: nothing runs in the root)."""
    versions = {}
    text = (path / "var" / "lib" / "dpkg" / "status").read_text(encoding="utf-8", errors="replace")
    for stanza in text.split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", stanza, flags=re.M))
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            versions[fields["Package"]] = fields.get("Version", "")
    return versions


def download_bytes(path: Path, versions: dict[str, str]) -> int:
    """The .deb bytes the root took (the Size of each installed package in the archive's lists)."""
    total = 0
    seen = set()
    for lists in sorted((path / "var" / "lib" / "apt" / "lists").glob("*_Packages")):
        text = lists.read_text(encoding="utf-8", errors="replace")
        for stanza in text.split("\n\n"):
            name = re.search(r"^Package: (\S+)$", stanza, flags=re.M)
            version = re.search(r"^Version: (\S+)$", stanza, flags=re.M)
            size = re.search(r"^Size: (\d+)$", stanza, flags=re.M)
            if name and version and size and versions.get(name.group(1)) == version.group(1) \
                    and name.group(1) not in seen:
                seen.add(name.group(1))
                total += int(size.group(1))
    return total


def disk_bytes(path: Path) -> int:
    """Bytes the folder takes on disk (blocks, as du; hard links counted once)."""
    total, seen = 0, set()
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


# --- running inside ------------------------------------------------------------------------------


def _is_system(path: str) -> bool:
    return path == "/" or any(path == d or path.startswith(d + "/") for d in SYSTEM_DIRS)


def binds_for(args: Iterable[str], cwd: Path | str, extra: Iterable[Path | str] = ()) -> list[str]:
    """The host folders a command needs inside the root: each absolute path its arguments name (a file's
    folder; `-DX=/path` and `--opt=/path` forms too), its working folder and EXTRA, outermost only.
    System folders (/usr, /etc, ...) are never bound: those are the root's own."""
    candidates = [str(cwd), *map(str, extra)]
    for arg in map(str, args):
        for piece in re.split(r"[=;,]", arg):
            if piece.startswith("/"):
                candidates.append(piece)
    folders = set()
    for candidate in candidates:
        path = Path(os.path.normpath(candidate))
        while not path.is_dir() and path != path.parent:
            path = path.parent
        text = str(path)
        if not _is_system(text):
            folders.add(text)
    outer = sorted(f for f in folders if not any(f != o and f.startswith(o.rstrip("/") + "/") for o in folders))
    return outer


def command(root: Path, args: list[str], *, cwd: Path | str, extra_binds: Iterable[Path | str] = (),
            binds: list[str] | None = None) -> list[str]:
    """The argument list that runs ARGS inside ROOT in CWD, with the folders it names bound in
    (BINDS, when given, are the folders bound, and nothing else: an image's root, smoke.image_root)."""
    if shutil.which("unshare") is None:  # util-linux: always there on Debian
        raise ToolchainMissingError("unshare (util-linux) is not installed", "apt-get install util-linux")
    binds = binds_for(args, cwd, extra_binds) if binds is None else binds
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _ENTER, "dfbuild-rocm-root",
            str(root), str(cwd), *binds, "--", *args]


def env(base: dict[str, str]) -> dict[str, str]:
    """BASE with the root's PATH (the host's venv and tools are not there)."""
    return {**base, "PATH": ROOT_PATH}


def run(root: Path, args: list[str], *, cwd: Path | str = "/", timeout: float = 120) -> str:
    """ARGS's output, run inside ROOT ('' when it cannot run)."""
    try:
        done = proc.run(command(root, args, cwd=cwd), errors="replace", timeout=timeout, env=env(dict(os.environ)),
                        stdin=proc.DEVNULL)
    except (OSError, proc.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


ROOT_ENV = "DFBUILD_HIP_ROOT"   # "forky": always build hip in the root; "host": never (the host's ROCm)


def wanted(backend: str, host) -> bool:
    """Whether a BACKEND build for HOST runs in the forky root: hip on Linux x64 when the host has no
    ROCm of its own (doctor's hip-clang probe), or when $DFBUILD_HIP_ROOT says so."""
    choice = os.environ.get(ROOT_ENV, "").strip().lower()
    if choice not in ("", "forky", "host"):
        raise UsageError(f"${ROOT_ENV}={choice!r} is neither 'forky' nor 'host'",
                         "unset it (dfbuild picks), or set forky (the Debian root) or host (the host's ROCm)")
    if backend != "hip" or host.os != "linux" or host.arch != "x64" or host.cross or choice == "host":
        return False
    if not runs_here():
        if choice == "forky":
            raise ToolchainMissingError(f"${ROOT_ENV}=forky: building in the Debian forky root needs root "
                                        "privileges (a private mount namespace and chroot)",
                                        "run dfbuild as root (sudo, or a container), or unset it")
        return False
    if choice == "forky":
        return True
    from dfbuild.host import probes

    return not probes.probe("hip-clang", host).found


def runs_here() -> bool:
    """Whether this process can run a command in the root: root privileges (unshare --mount, chroot)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def toolchain_entry(root: Path) -> dict:
    """A doctor-style entry for the root's toolchain (versions from dpkg, the HIP version from hipconfig),
    plus `hip_llvm_bin`: the clang that compiles HIP there (hipconfig -l)."""
    versions = installed_versions(root)
    rows = [("hip-clang", "/usr/bin/hipconfig", run(root, ["hipconfig", "--version"])),
            ("hipcc", "/usr/bin/hipcc", versions.get("hipcc")),
            ("hipblas", "/usr/include/hipblas/hipblas.h", versions.get("libhipblas-dev")),
            ("rocblas", "/usr/include/rocblas/rocblas.h", versions.get("librocblas-dev")),
            ("cxx-compiler", "/usr/bin/g++", versions.get("g++")),
            ("cmake", "/usr/bin/cmake", versions.get("cmake")),
            ("ninja", "/usr/bin/ninja", versions.get("ninja-build")),
            ("ccache", "/usr/bin/ccache", versions.get("ccache")),
            ("glibc", "/lib/x86_64-linux-gnu/libc.so.6", versions.get("libc6"))]
    llvm_bin = run(root, ["hipconfig", "-l"]).splitlines()
    return {"toolchain": [{"name": name, "found": bool(version), "path": path, "version": version or None}
                          for name, path, version in rows],
            "hip_llvm_bin": llvm_bin[-1].strip() if llvm_bin else None}


def mark_build_dir(build_dir: Path, root: Path) -> None:
    """Say in BUILD_DIR that its binaries run inside ROOT (smoke and verify read it)."""
    tmp = Path(build_dir) / (BUILT_IN_ROOT + ".tmp")
    tmp.write_text(json.dumps({"root": str(root), "record": record(root)["name"]}) + "\n", encoding="utf-8")
    state.move(tmp, Path(build_dir) / BUILT_IN_ROOT)


def launcher(build_dir: Path) -> list[str] | None:
    """The prefix that runs BUILD_DIR's binaries inside their root, or None for a build made on the host."""
    marker = Path(build_dir) / BUILT_IN_ROOT
    if not marker.is_file():
        return None
    try:
        root = Path(json.loads(marker.read_text(encoding="utf-8"))["root"])
    except (OSError, ValueError, KeyError):
        return None
    return launcher_for_root(root)


def launcher_for_root(root: Path) -> list[str]:
    """A prefix: `PREFIX + [binary, args...]` runs the binary inside ROOT, binding the folders named."""
    return [sys.executable, "-m", "dfbuild.host.platforms.rocm_root", str(root)]


def glibc_floor(root: Path) -> str | None:
    """The root's glibc version (libc6's Debian version, upstream part): the floor of what it builds."""
    version = installed_versions(root).get("libc6", "")
    match = re.match(r"(\d+\.\d+)", version)
    return match.group(1) if match else None


def main(argv: list[str]) -> int:
    """`python -m dfbuild.host.platforms.rocm_root ROOT PROGRAM ARGS...`: PROGRAM inside ROOT, in this folder
    (the smoke's launcher: the folders the arguments name are bound in when they are known)."""
    if len(argv) < 2:
        print("usage: python -m dfbuild.host.platforms.rocm_root ROOT PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    root, args = Path(argv[0]), argv[1:]
    full = command(root, args, cwd=os.getcwd())
    proc.replace_with(full, env(dict(os.environ)))
    return 127  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
