"""`dfbuild doctor`: which backends can build here, and exactly what to install.

Each backend in backends.toml names its toolchain probes; a probe says what to
look for (a program and its version, a header, a library) and what to install
per host when it is missing (probes.py answers each probe). `dfbuild build` runs the
same check first and fails fast with ToolchainMissingError.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

from dfbuild.core import proc
from dfbuild.core.errors import ToolchainMissingError, UnsupportedBackendError
from dfbuild.host import backends
from dfbuild.host.backends import Host

# The probes, through doctor as before the split (build.py and the tests call them here; phase 2 of
# issue 38 moves build.py to probes itself). check_backend's own calls go through these names too.
from dfbuild.host.probes import (  # noqa: F401
    MSVC_HINT,
    Probe,
    find_msvc,
    find_pypi_program,
    msvc_environment,
    probe,
    run_version,
    version_tuple,
    vswhere_path,
    vulkan_header_version,
)


def check_backend(backend: backends.Backend | str, host: Host | None = None, *,
                  extra_include_dirs: Sequence[Path] = (), _cache: dict | None = None) -> dict:
    """One backend's doctor entry (BACKEND: its table entry, or its name): can it build on HOST, what was
    found, what to install."""
    host = host or backends.current_host()
    spec = backends.resolve(backend)
    backend = spec.name
    cache = _cache if _cache is not None else {}
    entry: dict = {"backend": backend, "summary": spec.summary, "can_build": False, "reason": None,
                   "toolchain": [], "runtime": [], "missing": [], "install": []}
    if not spec.builds_on(host.os):
        entry["reason"] = spec.why_not_on(host.os)
        entry["install"] = [entry["reason"]]
        return entry

    common = backends.table()["common"]
    if host.cross:
        # a cross build (--os windows on Linux): the target's cross compilers instead of the native
        # ones, no host TLS library (targets.toml says why), and what runs the binaries here
        from dfbuild.host import platforms

        target = platforms.cross_entry(host)
        entry["target"] = {"os": host.os, "arch": host.arch, "build_os": host.build_os,
                           **({"build_arch": host.build_arch} if host.build_arch else {}),
                           "toolchain": target.get("toolchain")}
        if spec.name not in target.get("backends", ("cpu",)):
            entry["reason"] = target.get("not_backends", {}).get(
                spec.name, f"the {spec.name} backend is not cross-built for {host.os} here")
            entry["install"] = [entry["reason"]]
            return entry
        native = {"c-compiler", "cxx-compiler"}
        # a backend's cross build may need other tools than its native one (Vulkan for Windows: headers
        # and glslc, no Linux loader; a display to run): targets.toml backend_probes / backend_run_probes
        backend_probes = target.get("backend_probes", {}).get(spec.name, spec.probes)
        wanted = [(name, False) for name in (*target.get("probes", ()),
                                              *(p for p in common["probes"] if p not in native), *backend_probes)]
        run_probes = (*target.get("run_probes", ()), *target.get("backend_run_probes", {}).get(spec.name, ()))
    else:
        wanted = [(name, False) for name in (*common["probes"], *common.get("host_probes", {}).get(host.os, ()),
                                              *spec.probes)]
        run_probes = ()
    wanted += [(name, True) for name in common.get("optional_probes", ())]
    for name, optional in wanted:
        key = (name, tuple(map(str, extra_include_dirs)))
        if key not in cache:
            cache[key] = probe(name, host, optional=optional, extra_include_dirs=extra_include_dirs)
        entry["toolchain"].append(cache[key].as_dict())
    # what runs the binaries: this machine's own (a cross build's .exe reaches this host's Vulkan driver)
    run_host = backends.current_host() if host.cross else host
    for name in spec.runtime_probes:
        entry["runtime"].append(probe(name, run_host, optional=True).as_dict())
    for name in run_probes:  # not needed to build, needed to smoke, prove and verify --run: installed with it
        entry["runtime"].append(probe(name, host, optional=True).as_dict())

    blocking = [p for p in entry["toolchain"] if not p["ok"] and not p["optional"]]
    entry["missing"] = [p["name"] for p in blocking]
    if not host.cross:
        entry["install"] = _dedupe(p["install"] for p in blocking)
    else:
        from dfbuild.host import platforms

        unrunnable = [p for p in entry["runtime"] if p["name"] in run_probes and not p["ok"]]
        entry["missing_to_run"] = [p["name"] for p in unrunnable]
        # one line for the whole cross toolchain, as the user types it, but only when something it
        # installs is missing: a hint to install what is there already reads as if it were not
        in_line = {*target.get("probes", ()), *target.get("run_probes", ())}
        missed = (*blocking, *unrunnable)
        line = [platforms.cross(host).install_line(host)] if any(p["name"] in in_line for p in missed) else []
        entry["install"] = _dedupe(line + [p["install"] for p in missed if p["name"] not in in_line])
    entry["can_build"] = not blocking
    if blocking:
        entry["reason"] = "missing: " + "; ".join(
            p["what"] + (f" ({p['problem']})" if p["problem"] else "") for p in blocking)
    if blocking and spec.name == "hip":
        _hip_in_root(entry, host)
    return entry


def _hip_in_root(entry: dict, host: Host) -> None:
    """No ROCm here: a Linux x64 host builds hip in dfbuild's Debian forky root (platforms/rocm_root.py)."""
    from dfbuild.host.platforms import rocm_root

    if host.os != "linux" or host.arch != "x64" or host.cross or not rocm_root.runs_here() \
            or os.environ.get(rocm_root.ROOT_ENV, "").strip().lower() == "host":
        return
    root = rocm_root.recipe()
    made = rocm_root.root_path(root)
    have = shutil.which("mmdebstrap") is not None
    entry["rocm_root"] = {"suite": root["suite"], "rocm": root["rocm"], "path": str(made),
                          "made": rocm_root.is_made(made), "mmdebstrap": have}
    state = (f"made: {made}" if rocm_root.is_made(made)
             else "made once on the first hip build: about 550 MB to download, 5.3 GB on disk")
    where = f"the Debian {root['suite']} root with ROCm {root['rocm']} ({state}; docs/hip.md)"
    if have or rocm_root.is_made(made):
        entry["can_build"] = True
        entry["reason"] = f"no ROCm on this machine: builds in {where}"
        entry["install"] = []
    else:
        entry["install"] = [f"{rocm_root.MMDEBSTRAP_INSTALL} (dfbuild then builds hip in {where})",
                            *entry["install"]]


def _dedupe(items) -> list[str]:
    seen: list[str] = []
    for item in items:
        if item and item not in seen:
            seen.append(item)
    return seen


def doctor(backend: str | None = None, *, host: Host | None = None,
           extra_include_dirs: Sequence[Path] = ()) -> dict:
    """Per backend (or just BACKEND): what is present here and exactly what to install."""
    host = host or backends.current_host()
    chosen = [backend] if backend else backends.names()
    for name in chosen:
        backends.get(name)  # unknown backend -> UnsupportedBackendError before any probing
    cache: dict = {}
    return {
        "host": {"os": host.build_os or host.os, "arch": backends.current_host().arch if host.cross else host.arch,
                 "distro": host.distro, "distro_version": host.distro_version},
        **({"target": {"os": host.os, "arch": host.arch}} if host.cross else {}),
        "backends": {name: check_backend(name, host, extra_include_dirs=extra_include_dirs, _cache=cache)
                     for name in chosen},
        "webui": check_webui(),
        "images": check_images(),
    }


# what `dfbuild image` runs (image.rootfs, image.build, smoke.image_root): program -> (what for, Debian package)
IMAGE_TOOLS = {"mmdebstrap": ("makes the Debian root an image stands on (once per set of packages)", "mmdebstrap"),
               "umoci": ("assembles the OCI image and unpacks it to run it before publishing", "umoci"),
               "skopeo": ("reads the written OCI archive back (skopeo inspect)", "skopeo"),
               "tar": ("packs the layers and the OCI archive reproducibly (GNU tar)", "tar"),
               "unshare": ("starts the image's entrypoint in its unpacked root (with chroot)", "util-linux")}


def check_images() -> dict:
    """What `dfbuild image` needs here: its tools, and root (mmdebstrap's root mode, umoci unpack, chroot)."""
    found = [{"what": f"{name}: {why}", "ok": shutil.which(name) is not None, "install": f"apt-get install {pkg}"}
             for name, (why, pkg) in IMAGE_TOOLS.items()]
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    found.append({"what": "root privileges: mmdebstrap's root mode, umoci unpack, chroot", "ok": is_root,
                  "install": "run dfbuild image as root (sudo, or a container)"})
    missing = [p for p in found if not p["ok"]]
    return {"what": "container images of a release's archives (dfbuild image, release --image)",
            "can_build": not missing, "toolchain": found, "install": _dedupe(p["install"] for p in missing),
            "network": "Debian's archive once per set of packages (the root is cached), then offline",
            "also": "podman or docker to load the images (podman load); neither is needed to make them"}


def check_webui() -> dict:
    """The web UI's toolchain (Node.js and npm, on the machine that builds: this one), for every backend alike.

    Needed once per set of UI sources (dfbuild caches the built UI); never blocking: --no-ui builds without it."""
    from dfbuild.host import webui

    here = backends.current_host()
    found = [probe(name, here, spec=spec).as_dict() for name, spec in webui.table()["probes"].items()]
    missing = [p for p in found if not p["ok"]]
    if missing:  # what webui._tools then uses: Node.js from PyPI, fetched once into the cache
        from dfbuild.host import webui_node

        spec = webui.table()["pip_node"]
        for missed in missing:
            missed["install"] = f"(optional: for the machine's own) {missed['install']}" if missed["install"] else None
        found.append({"name": "node-pypi", "found": webui_node.cached(spec) is not None, "optional": False,
                      "what": f"instead, Node.js from PyPI ({spec['project']})", "path": None,
                      "version": webui_node.describe(spec), "problem": None, "install": None, "ok": True})
        missing = []
    return {"what": "llama-server's web UI (GET /), built from the tree's tools/ui with npm once per UI, then cached",
            "can_build": not missing, "toolchain": found, "install": _dedupe(p["install"] for p in missing),
            "without": "--no-ui builds llama-server without it; a UI already in dfbuild's cache needs neither"}


def require(backend: backends.Backend | str, host: Host | None = None, *,
            extra_include_dirs: Sequence[Path] = ()) -> dict:
    """check_backend, raising if BACKEND cannot build here.

    UnsupportedBackendError when the host can never build it (metal off macOS),
    ToolchainMissingError (what is missing + what to install) otherwise.
    """
    entry = check_backend(backend, host, extra_include_dirs=extra_include_dirs)
    backend = backend.name if isinstance(backend, backends.Backend) else backend  # the name, for the messages
    if not entry["can_build"] and not entry["toolchain"]:  # not a toolchain matter: this host never can
        raise UnsupportedBackendError(f"the {backend} backend cannot build here: {entry['reason']}",
                                      "build it on a runner of its kind (see `dfbuild matrix`)")
    if not entry["can_build"]:
        raise ToolchainMissingError(
            f"cannot build the {backend} backend here: {entry['reason']}",
            "\n".join(entry["install"]) or None,
        )
    return entry


def toolchain_versions(entry: dict) -> dict[str, str | None]:
    """{probe name: version or path} of what a build used, for the manifest."""
    return {p["name"]: (p["version"] or p["path"]) for p in entry["toolchain"] if p["found"]}


# --- Vulkan headers for Debian 12 ----------------------------------------------------------
# Debian 12's libvulkan-dev (1.3.239) predates VK_EXT_layer_settings, which
# ggml-vulkan uses. Debian 13's package (1.4.309) has it and its headers work
# with Debian 12's loader and glslc, so dfbuild can unpack just those headers
# into its cache (through apt, with a private state dir: the system's apt setup
# is not touched) and pass them as Vulkan_INCLUDE_DIR.


def debian_mirror(sources_dir: Path = Path("/etc/apt")) -> str | None:
    """The Debian archive URI this machine's apt already uses (deb822 or one-line sources)."""
    parts = sources_dir / "sources.list.d"
    files = sorted(parts.glob("*.sources")) if parts.is_dir() else []
    for path in files:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("URIs:"):
                for uri in line.split()[1:]:
                    if uri.rstrip("/").endswith("/debian"):
                        return uri.rstrip("/")
    lists = [sources_dir / "sources.list"]
    if (sources_dir / "sources.list.d").is_dir():
        lists += sorted((sources_dir / "sources.list.d").glob("*.list"))
    for path in lists:
        if not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            match = re.match(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+/debian)/?\s", line)
            if match:
                return match.group(1)
    return None


def fetch_debian_vulkan_headers(suite: str = "trixie") -> Path:
    """Unpack SUITE's libvulkan-dev headers into the cache; returns the include dir to pass."""
    from dfbuild.core.paths import cache_dir, locked

    root = cache_dir() / "vulkan-headers" / suite
    include = root / "usr" / "include"
    if (include / "vulkan" / "vulkan_core.h").is_file():
        return include
    mirror = debian_mirror()
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb") and mirror):
        raise ToolchainMissingError("fetching Debian's Vulkan headers needs apt-get, dpkg-deb and a Debian mirror",
                                    "on other systems install Vulkan headers >= 1.3.272 (or the LunarG SDK)")
    with locked(root):
        apt = root / "apt"
        for sub in ("lists/partial", "cache/archives/partial", "parts"):
            (apt / sub).mkdir(parents=True, exist_ok=True)
        (apt / "sources.list").write_text(
            f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {mirror} {suite} main\n")
        options = ["-o", f"Dir::Etc::SourceList={apt / 'sources.list'}", "-o", f"Dir::Etc::SourceParts={apt / 'parts'}",
                   "-o", f"Dir::State::Lists={apt / 'lists'}", "-o", f"Dir::Cache={apt / 'cache'}",
                   "-o", "Debug::NoLocking=1"]
        for args in (["update"], ["download", "libvulkan-dev"]):
            result = proc.run(["apt-get", "-q", *options, *args], cwd=apt, errors="replace")
            if result.returncode != 0:
                last = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:]
                raise ToolchainMissingError(f"apt-get {args[0]} for Debian {suite} failed: {' '.join(last)}",
                                            "check apt's access to the Debian mirror")
        debs = sorted(apt.glob("libvulkan-dev_*.deb"))
        if not debs:
            raise ToolchainMissingError(f"apt-get download gave no libvulkan-dev package for {suite}")
        proc.run(["dpkg-deb", "-x", str(debs[-1]), str(root)], capture=False, check=True)
    return include
