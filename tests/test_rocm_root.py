"""The Debian forky root with ROCm 6.4 (platforms/rocm_root.py): its recipe, and making it once, never half.

Fast and offline (`.ci/run` runs them): the recipe in data/rocm_root.toml is
checked for form (it parses, names Debian packages, pins the ROCm line it
builds), `--gpu-targets` for what ROCm 6.4 knows, and the making of a root
with a fake mmdebstrap (a script on PATH that lays out what the real one
leaves: dpkg's status, the package lists, rocBLAS's Tensile files) against an
archive served from 127.0.0.1: once, under a lock, in a `.partial` folder that
a failure, a kill or a second run at the same time never leaves behind as a
root. The real root and a real HIP build are test_hip_real.py's (opt-in).
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dfbuild.core.errors import BuildError, SourceError, ToolchainMissingError, UsageError
from dfbuild.host import backends
from dfbuild.host.backends import Host
from dfbuild.host.platforms import rocm_root

FAKE_MMDEBSTRAP = r'''#!/usr/bin/env python3
# a fake mmdebstrap: lays out what the real one leaves in the target folder
import os, sys, time
args = sys.argv[1:]
suite, target, mirror = args[-3:]
with open(os.environ["FAKE_MMDEBSTRAP_CALLS"], "a") as f:
    f.write(" ".join(args) + "\n")
if os.environ.get("FAKE_MMDEBSTRAP_SLEEPS"):
    with open(os.environ["FAKE_MMDEBSTRAP_CALLS"] + ".pid", "w") as f:
        f.write(str(os.getpid()))  # as this machine sees it: the fake may run in its own PID namespace
    os.makedirs(os.path.join(target, "usr", "bin"), exist_ok=True)
    time.sleep(float(os.environ["FAKE_MMDEBSTRAP_SLEEPS"]))
if os.environ.get("FAKE_MMDEBSTRAP_FAILS"):
    print("E: " + os.environ["FAKE_MMDEBSTRAP_FAILS"])
    sys.exit(1)
versions = {"hipcc": "7.0.2+dfsg-3", "libamdhip64-dev": os.environ.get("FAKE_HIP_VERSION", "6.4.3-5"),
            "libhipblas-dev": "6.4.4-1", "librocblas-dev": "6.4.4-4", "libc6": "2.43-7", "cmake": "4.3.4-1"}
def put(rel, text):
    path = os.path.join(target, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
put("usr/bin/hipconfig", "#!/bin/sh\n")
put("var/lib/dpkg/status", "\n".join(f"Package: {p}\nStatus: install ok installed\nVersion: {v}\n"
                                      for p, v in versions.items()))
put("var/lib/apt/lists/deb_dists_forky_main_binary-amd64_Packages",
    "\n".join(f"Package: {p}\nVersion: {v}\nSize: 1000\n" for p, v in versions.items())
    + "\nPackage: hipcc\nVersion: 0.1\nSize: 99999\n")
TENSILE = "gfx803 gfx900 gfx906 gfx908 gfx90a gfx1010 gfx1030 gfx1100 gfx1101 gfx1102"
for gfx in os.environ.get("FAKE_TENSILE", TENSILE).split():
    put(f"usr/lib/x86_64-linux-gnu/rocblas/6.4.4/library/TensileLibrary_lazy_{gfx}.dat", "x")
'''


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def archive(tmp_path):
    """A Debian archive on 127.0.0.1 that has dists/forky/InRelease (what check_reachable asks)."""
    served = tmp_path / "archive"
    (served / "dists" / "forky").mkdir(parents=True)
    (served / "dists" / "forky" / "InRelease").write_text("signed\n")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake mmdebstrap first on PATH and a cache of the test's own; returns the calls file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "mmdebstrap"
    script.write_text(FAKE_MMDEBSTRAP.replace("#!/usr/bin/env python3", f"#!{sys.executable}"))
    script.chmod(0o755)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MMDEBSTRAP_CALLS", str(calls))
    monkeypatch.setenv("DFBUILD_CACHE_DIR", str(tmp_path / "cache"))
    return calls


def recipe_for(mirror: str) -> dict:
    return {**rocm_root.recipe(), "mirror": mirror}


# --- the recipe (what .ci/run checks of the forky root: no network) --------------------------------


def test_the_recipe_is_well_formed_and_names_rocm_6_4s_development_packages():
    root = rocm_root.recipe()
    rocm_root.check_recipe(root)
    assert (root["suite"], root["rocm"], root["variant"]) == ("forky", "6.4", "apt")
    for package in ("hipcc", "libamdhip64-dev", "libhipblas-dev", "librocblas-dev", "rocm-cmake", "cmake",
                    "ninja-build", "g++", "libssl-dev"):
        assert package in root["packages"]
    assert set(root["expect"]) <= set(root["packages"])
    command = rocm_root.mmdebstrap_command(root, Path("/tmp/target"))
    assert command[0] == "mmdebstrap" and command[-3:] == ["forky", "/tmp/target", root["mirror"]]
    assert f"--include={','.join(root['packages'])}" in command and "--variant=apt" in command


@pytest.mark.parametrize("field, value, says", [
    ("packages", ["hipcc", "Not A Package"], "not a Debian package name"),
    ("mirror", "ftp:/nowhere", "not an http(s) URL"),
    ("suite", "", "no [root] suite"),
])
def test_a_broken_recipe_is_refused_saying_which_field(field, value, says):
    with pytest.raises(BuildError, match=r".*") as caught:
        rocm_root.check_recipe({**rocm_root.recipe(), field: value})
    assert says in caught.value.message


def test_the_recipe_key_changes_with_what_changes_the_root():
    root = rocm_root.recipe()
    key = rocm_root.recipe_key(root)
    assert rocm_root.recipe_key(dict(root)) == key
    assert rocm_root.recipe_key({**root, "packages": [*root["packages"], "git"]}) != key
    assert rocm_root.recipe_key({**root, "suite": "trixie"}) != key
    assert rocm_root.root_path(root).name == f"debian-forky-rocm-6.4-{key}"


# --- GPU targets ---------------------------------------------------------------------------------


def test_the_matrix_default_gpu_targets_are_all_known_to_rocm_6_4():
    default = backends.parse_gpu_targets(backends.get("hip").raw["default_gpu_targets"])
    assert rocm_root.check_gpu_targets(default) == default.split(";")


@pytest.mark.parametrize("target", ["gfx1250", "gfx1036", "gfx9999"])
def test_a_gpu_target_rocm_6_4_does_not_know_is_refused_before_anything_is_downloaded(target, fake, archive):
    with pytest.raises(UsageError) as caught:
        rocm_root.check_gpu_targets(backends.parse_gpu_targets(target))
    assert caught.value.exit_code == 2
    assert target in caught.value.message and "gfx1100" in caught.value.hint
    assert not fake.exists()


def test_a_target_forkys_rocblas_has_no_kernels_for_builds_with_a_warning(capsys):
    assert rocm_root.check_gpu_targets("gfx1100;gfx1201") == ["gfx1100", "gfx1201"]
    err = capsys.readouterr().err
    assert "no kernels for gfx1201" in err and "gfx1100" not in err.split("no kernels for")[1].split(":")[0]


def test_a_hip_build_uses_the_root_only_where_the_host_has_no_rocm(monkeypatch):
    linux = Host("linux", "x64", "debian", "12")
    monkeypatch.setattr(rocm_root, "runs_here", lambda: False)  # not root: no namespace, no chroot
    monkeypatch.setenv(rocm_root.ROOT_ENV, "forky")
    with pytest.raises(ToolchainMissingError):
        rocm_root.wanted("hip", linux)
    monkeypatch.delenv(rocm_root.ROOT_ENV)
    assert not rocm_root.wanted("hip", linux)
    monkeypatch.setattr(rocm_root, "runs_here", lambda: True)
    monkeypatch.setenv(rocm_root.ROOT_ENV, "forky")
    assert rocm_root.wanted("hip", linux)
    assert not rocm_root.wanted("cpu", linux)
    assert not rocm_root.wanted("hip", Host("linux", "arm64", "debian", "12"))
    monkeypatch.setenv(rocm_root.ROOT_ENV, "host")
    assert not rocm_root.wanted("hip", linux)
    monkeypatch.setenv(rocm_root.ROOT_ENV, "maybe")
    with pytest.raises(UsageError):
        rocm_root.wanted("hip", linux)


# --- making it -----------------------------------------------------------------------------------


def test_the_root_is_made_once_with_its_record_written_last(fake, archive):
    root = recipe_for(archive)
    path = rocm_root.ensure(root)
    assert rocm_root.is_made(path) and path == rocm_root.root_path(root)
    made = rocm_root.record(path)
    assert made["rocm"]["libamdhip64-dev"] == "6.4.3-5" and made["packages"]["hipcc"] == "7.0.2+dfsg-3"
    assert made["download_bytes"] == 6000  # the Size of each installed version, once
    assert made["disk_bytes"] > 0 and made["wall_s"] >= 0
    assert "gfx1100" in made["gpu_targets"]
    assert not list(path.parent.glob("*.partial"))
    assert not list((path / "var" / "lib" / "apt" / "lists").glob("*_Packages"))  # read, then removed
    assert rocm_root.ensure(root) == path
    assert len(fake.read_text().splitlines()) == 1  # made once
    assert "--skip=cleanup/apt/lists" in fake.read_text()


def test_mmdebstrap_missing_is_the_toolchain_missing_code_with_the_apt_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    monkeypatch.setenv("DFBUILD_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ToolchainMissingError) as caught:
        rocm_root.ensure(recipe_for("http://127.0.0.1:9/debian"))
    assert caught.value.exit_code == 30 and "apt-get install mmdebstrap" in caught.value.hint


def test_an_unreachable_archive_is_a_source_error_and_leaves_nothing(fake, tmp_path):
    root = recipe_for("http://127.0.0.1:9/debian")  # nothing listens on the discard port
    with pytest.raises(SourceError) as caught:
        rocm_root.ensure(root)
    assert caught.value.exit_code == 11 and "127.0.0.1:9" in caught.value.message
    assert not fake.exists()  # mmdebstrap never started
    path = rocm_root.root_path(root)
    assert not path.exists() and not path.with_name(path.name + ".partial").exists()


def test_a_download_failure_midway_is_a_source_error_and_leaves_no_root(fake, archive, monkeypatch):
    monkeypatch.setenv("FAKE_MMDEBSTRAP_FAILS", "Failed to fetch http://deb.debian.org/debian/pool/x.deb")
    root = recipe_for(archive)
    with pytest.raises(SourceError) as caught:
        rocm_root.ensure(root)
    assert "Failed to fetch" in caught.value.message
    path = rocm_root.root_path(root)
    assert not path.exists() and not path.with_name(path.name + ".partial").exists()
    monkeypatch.delenv("FAKE_MMDEBSTRAP_FAILS")
    assert rocm_root.is_made(rocm_root.ensure(root))  # the next run makes it


def test_an_archive_that_moved_to_another_rocm_line_is_refused(fake, archive, monkeypatch):
    monkeypatch.setenv("FAKE_HIP_VERSION", "7.1.0-1")
    root = recipe_for(archive)
    with pytest.raises(BuildError) as caught:
        rocm_root.ensure(root)
    assert "libamdhip64-dev 7.1.0-1 is not 6.4.x" in caught.value.message
    assert not rocm_root.root_path(root).exists()


def test_a_rocblas_that_differs_from_the_recipes_list_is_refused(fake, archive, monkeypatch):
    monkeypatch.setenv("FAKE_TENSILE", "gfx1100")
    with pytest.raises(BuildError) as caught:
        rocm_root.ensure(recipe_for(archive))
    assert "are not those this root's rocBLAS has kernels for (gfx1100)" in caught.value.message


def _ensure_in_child(mirror: str, env: dict) -> subprocess.Popen:
    code = ("import sys, json; from dfbuild.host.platforms import rocm_root; "
            "print(rocm_root.ensure({**rocm_root.recipe(), 'mirror': sys.argv[1]}))")
    return subprocess.Popen([sys.executable, "-c", code, mirror], start_new_session=True, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _host_pid(pid_file: Path) -> int:
    """The fake's PID as this machine sees it (it wrote its own, which in a PID namespace is 1 or 2)."""
    written = int(pid_file.read_text())
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ns_pids = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
            if b"mmdebstrap" in cmdline and ns_pids and int(ns_pids[-1]) == written:
                return int(entry.name)
    return written if Path(f"/proc/{written}").is_dir() and b"mmdebstrap" in \
        Path(f"/proc/{written}/cmdline").read_bytes() else -1


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return " Z " not in state and "zombie" not in state


def test_a_run_killed_midway_leaves_no_root_and_the_next_run_makes_it(fake, archive):
    root = recipe_for(archive)
    path = rocm_root.root_path(root)
    partial = path.with_name(path.name + ".partial")
    child = _ensure_in_child(archive, {**os.environ, "FAKE_MMDEBSTRAP_SLEEPS": "30"})
    deadline = time.monotonic() + 30
    while not (partial / "usr" / "bin").is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert partial.is_dir()
    mmdebstrap = _host_pid(Path(str(fake) + ".pid"))
    assert _alive(mmdebstrap)
    os.kill(child.pid, signal.SIGKILL)  # dfbuild only: its mmdebstrap must die with it
    child.wait()
    deadline = time.monotonic() + 10
    while _alive(mmdebstrap) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(mmdebstrap), "mmdebstrap outlived the dfbuild that started it"
    assert not rocm_root.is_made(path)
    assert rocm_root.is_made(rocm_root.ensure(root))
    assert not partial.exists()


def test_two_runs_at_once_make_the_root_once(fake, archive):
    env = {**os.environ, "FAKE_MMDEBSTRAP_SLEEPS": "2"}
    first, second = _ensure_in_child(archive, env), _ensure_in_child(archive, env)
    outs = [p.communicate(timeout=120)[0].strip() for p in (first, second)]
    assert first.returncode == second.returncode == 0
    assert outs[0] == outs[1] == str(rocm_root.root_path(recipe_for(archive)))
    assert len(fake.read_text().splitlines()) == 1


# --- running inside ------------------------------------------------------------------------------


def test_a_command_in_the_root_gets_the_folders_it_names_and_never_the_systems(tmp_path):
    source, build, ccache = tmp_path / "w" / "src", tmp_path / "w" / "build-hip", tmp_path / "ccache"
    for folder in (source, build, ccache):
        folder.mkdir(parents=True)
    args = ["/usr/bin/cmake", "-S", str(source), "-B", str(build), "-DCMAKE_C_COMPILER_LAUNCHER=/usr/bin/ccache",
            f"-DX={ccache};/usr/lib/llvm-21/bin", f"--model={source}/missing.gguf"]
    binds = rocm_root.binds_for(args, build)
    assert binds == sorted({str(build), str(source), str(ccache)})
    assert rocm_root.binds_for(["ninja"], build, [tmp_path / "w"]) == [str(tmp_path / "w")]  # outermost only
    assert not any(b.startswith(("/usr", "/etc", "/lib")) for b in binds)
    command = rocm_root.command(Path("/r"), ["ninja"], cwd=build)
    assert command[:3] == ["unshare", "--mount", "--propagation"] and command[-2:] == ["--", "ninja"]
    assert rocm_root.env({"PATH": "/venv/bin:/usr/bin", "X": "1"}) == {"PATH": rocm_root.ROOT_PATH, "X": "1"}


def test_a_build_dir_made_in_the_root_runs_its_binaries_there(tmp_path):
    root = tmp_path / "root"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "hipconfig").write_text("")
    (root / rocm_root.RECORD_NAME).write_text(json.dumps({"name": "debian-forky-rocm-6.4"}))
    build = tmp_path / "build-hip"
    (build / "bin").mkdir(parents=True)
    assert rocm_root.launcher(build) is None
    rocm_root.mark_build_dir(build, root)
    assert rocm_root.launcher(build) == [sys.executable, "-m", "dfbuild.host.platforms.rocm_root", str(root)]
    from dfbuild import smoke

    assert smoke.launcher_for(build / "bin" / "llama-server") == (rocm_root.launcher(build), {})
    # and so do the unpatched binaries a proof keeps (WORK/unpatched): on the host they would not load
    # (forky's glibc 2.43; seen on b11393: every fixture set "exited with code 1 before it was healthy")
    from dfbuild.release import prove

    (build / "bin" / "llama-server").write_text("")
    kept = tmp_path / "work" / "unpatched" / "build-hip"
    prove._keep_unpatched({"build_dir": str(build), "binaries": ["bin/llama-server"]}, kept, "key", "0" * 40)
    assert smoke.launcher_for(kept / "bin" / "llama-server") == (rocm_root.launcher(build), {})


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs Linux, root and unshare (a private mount namespace and chroot)")
def test_a_program_in_the_root_sees_sysfs_where_rocm_finds_the_gpus(tmp_path):
    # ROCm's runtime finds AMD GPUs through /dev/kfd and the KFD topology in sysfs
    # (/sys/class/kfd, /sys/devices/virtual/kfd): a root without /sys lists no device on a machine that has one
    root = tmp_path / "root"
    for folder in ("dev", "proc", "sys", "usr/bin", "bin", "lib64", "lib/x86_64-linux-gnu"):
        (root / folder).mkdir(parents=True)
    for program in ("/usr/bin/env", "/bin/sh"):
        shutil.copy2(os.path.realpath(program), root / program.lstrip("/"))
    for library in ("/lib64/ld-linux-x86-64.so.2", "/lib/x86_64-linux-gnu/libc.so.6"):
        if not os.path.exists(library):
            pytest.skip(f"no {library} on this host")
        shutil.copy2(os.path.realpath(library), root / library.lstrip("/"))
    done = subprocess.run(rocm_root.command(root, ["/bin/sh", "-c", "test -d /sys/kernel && echo sysfs; "
                                                   "test -d /proc/self && echo proc"], cwd="/"),
                          capture_output=True, text=True, env=rocm_root.env(dict(os.environ)), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["sysfs", "proc"]


def test_build_runs_each_step_through_the_roots_command_when_given(tmp_path):
    from dfbuild.build import run as build_run

    log = tmp_path / "log.txt"
    with open(log, "w") as handle:
        code, _, _ = build_run._run_logged(["hello"], cwd=tmp_path, env=dict(os.environ), log=handle,
                                       run_in=lambda args, cwd: ["echo", "in-root", str(cwd), *args])
    assert code == 0 and f"in-root {tmp_path} hello" in log.read_text()


def test_verify_states_that_a_root_builds_glibc_floor_is_forkys():
    from dfbuild.verify import release_dir as verify

    note = verify._root_note("x.tar.gz", {"suite": "forky", "rocm": {"hipcc": "7.0.2"}, "glibc": "2.43",
                                          "path": "debian-forky-rocm-6.4-000000000000"}, {"a": (2, 38)})
    assert "glibc floor is forky's (glibc 2.43; the binaries need 2.38)" in note
    assert "root with ROCm (hipcc 7.0.2)" in note  # the packages in words, not a Python dict
    assert "Ubuntu 22.04 image (glibc 2.35)" in note
    # a root that is not on this machine: the binaries are not run, the stamp is checked instead
    assert verify._root_launcher({"path": "debian-forky-rocm-6.4-000000000000"}) is None


def test_verify_runs_the_archive_in_the_root_the_manifest_names_when_made_in_another_cache(monkeypatch, tmp_path):
    from dfbuild.verify import release_dir as verify

    monkeypatch.setenv("DFBUILD_CACHE_DIR", str(tmp_path / "this-cache"))   # no root made in this one
    name = rocm_root.root_path().name

    def made(path):
        (path / "usr" / "bin").mkdir(parents=True)
        (path / "usr" / "bin" / "hipconfig").write_text("")
        (path / rocm_root.RECORD_NAME).write_text("{}")
        return path

    other = made(tmp_path / "other-cache" / "roots" / name)
    assert verify._root_launcher({"path": str(other)}) == rocm_root.launcher_for_root(other)
    # a root of another recipe, or a folder that is no made root, is never chrooted into
    stale = made(tmp_path / "old-cache" / "roots" / "debian-forky-rocm-6.4-000000000000")
    assert verify._root_launcher({"path": str(stale)}) is None
    assert verify._root_launcher({"path": str(tmp_path / "nothing" / name)}) is None
    # this cache's own root comes first
    mine = made(rocm_root.root_path())
    assert verify._root_launcher({"path": str(other)}) == rocm_root.launcher_for_root(mine)


def test_doctor_says_hip_builds_in_the_root_here_or_which_apt_line_makes_it_possible(monkeypatch, tmp_path):
    from helpers import isolate_probes

    from dfbuild.host import doctor

    _, bin_dir = isolate_probes(monkeypatch, tmp_path)
    monkeypatch.setenv("DFBUILD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(rocm_root, "runs_here", lambda: True)
    linux = Host("linux", "x64", "debian", "12")
    entry = doctor.check_backend("hip", linux)
    assert not entry["can_build"] and entry["install"][0].startswith("apt-get install mmdebstrap")
    assert "forky root with ROCm 6.4" in entry["install"][0]
    (bin_dir / "mmdebstrap").write_text("#!/bin/sh\n")
    (bin_dir / "mmdebstrap").chmod(0o755)
    entry = doctor.check_backend("hip", linux)
    assert entry["can_build"] and "builds in the Debian forky root with ROCm 6.4" in entry["reason"]
    assert entry["rocm_root"]["made"] is False
    monkeypatch.setenv(rocm_root.ROOT_ENV, "host")  # the host's own ROCm or nothing
    assert not doctor.check_backend("hip", linux)["can_build"]
