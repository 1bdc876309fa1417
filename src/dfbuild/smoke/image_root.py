"""Run an image before it is published: its root filesystem unpacked, its entrypoint started in it.

`podman run` cannot start a container on machines like dfbuild's (crun needs
CAP_SYS_RESOURCE for RLIMIT_NOFILE, and refuses hybrid cgroups), so the image
is run the way a runtime would, minus the runtime: the OCI archive that will be
published is unpacked (GNU tar), `umoci unpack` makes the runtime bundle
(`rootfs/` and the runtime's `config.json`: the entrypoint, environment and
working folder umoci derived from the image's config), and the entrypoint is
started in that root in a private mount namespace (`unshare --mount`, chroot:
platforms.rocm_root's way in), with only the image's environment and the
folders its arguments name (the smoke's fixture models) bound in.

The smoke's image request then goes to it through DFlash (image.smoke_bundle:
smoke.run_smoke with the image scenarios on a set whose draft breaks unpatched): the patched image
must pass, and the same recipe around an unpatched build fails.

What this does not test: the container runtime's own setup, i.e. its cgroups
and resource limits, user namespaces, seccomp and capabilities, its network
namespace and port publishing (`-p 8080:8080`; the server runs in this
machine's network namespace, on 127.0.0.1), the image's HEALTHCHECK (OCI's
config carries none) and the NVIDIA container toolkit's driver mounts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dfbuild.core import proc
from dfbuild.core.errors import ImageRunError, ImageToolError
from dfbuild.host.platforms import rocm_root

MARKER = "dfbuild-image-bundle.json"   # in a bundle: its rootfs/app/llama-server runs as the image's entrypoint
# what a smoke run passes from this machine's environment into the image (the device and backend knobs);
# anything else comes from the image's config
PASSED_ENV = ("GGML_", "CUDA_", "NVIDIA_", "VK_", "MESA_", "HIP_", "ROCR_", "HSA_", "OMP_", "LLAMA_")
# the image scenarios, on the set whose plain-rope draft gets the hole unpatched (docs/images.md)
SCENARIOS = ("image", "pinned-image-hole")
SETS = ("qwen35-grid-plain-agree",)


def unpack(oci_archive: Path, ref: str, into: Path) -> Path:
    """The bundle (INTO/bundle: rootfs/ and config.json) of the image REF in OCI_ARCHIVE."""
    layout = into / "layout"
    layout.mkdir(parents=True)
    done = proc.run(["tar", "--extract", "--file", str(oci_archive), "--directory", str(layout), "--no-same-owner"],
                    errors="replace")
    if done.returncode != 0:
        raise ImageToolError(f"tar cannot unpack {oci_archive.name}: {done.stderr.strip()[-300:]}",
                             "the archive is damaged: make it again with dfbuild image")
    bundle = into / "bundle"
    done = proc.run(["umoci", "unpack", "--image", f"{layout}:{ref}", str(bundle)], errors="replace",
                    stdin=proc.DEVNULL)
    if done.returncode != 0:
        raise ImageToolError(f"umoci unpack failed for {oci_archive.name}: {done.stderr.strip()[-300:]}",
                             "umoci unpack runs as root here (it keeps the layers' owners)")
    (bundle / MARKER).write_text(json.dumps({"archive": oci_archive.name, "ref": ref}) + "\n", encoding="utf-8")
    return bundle


def entrypoint(bundle: Path) -> tuple[list[str], list[str], str]:
    """(process args, environment, working folder) of the bundle's runtime config (umoci's, from the image)."""
    spec = json.loads((bundle / "config.json").read_text(encoding="utf-8"))
    process = spec["process"]
    return list(process["args"]), list(process.get("env") or []), process.get("cwd") or "/"


def app_dir(bundle: Path) -> Path:
    """Where the smoke finds the entrypoint's program on this machine (the build dir it is given)."""
    args, _, _ = entrypoint(bundle)
    return bundle / "rootfs" / Path(args[0]).relative_to("/").parent


def launcher(binary: Path) -> list[str] | None:
    """The smoke's prefix for BINARY when it is the entrypoint of an unpacked image (its bundle's marker),
    else None: `PREFIX + [binary, args...]` starts the image's entrypoint with ARGS in its root."""
    bundle = Path(binary).parent
    while bundle != bundle.parent and bundle.name != "rootfs":
        bundle = bundle.parent
    bundle = bundle.parent
    if not (bundle / MARKER).is_file():
        return None
    return [sys.executable, "-m", "dfbuild.smoke.image_root", str(bundle)]


def binds_for(args: list[str]) -> list[str]:
    """The folders of this machine that ARGS name (the fixture models, a slot folder), bound at the same
    paths; never a system folder, never one the image has (its /app stays the image's)."""
    found = rocm_root.binds_for(args, cwd="/")
    return [b for b in found if b != "/" and not b.startswith("/app")]


def command(bundle: Path, binary: Path, args: list[str], environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(argument list, environment) that start the bundle's entrypoint with ARGS, as a runtime would."""
    process_args, env_list, cwd = entrypoint(bundle)
    rootfs = bundle / "rootfs"
    expected = rootfs / process_args[0].lstrip("/")
    if Path(binary).resolve() != expected.resolve():
        raise ImageRunError(f"{binary} is not the image's entrypoint ({process_args[0]})",
                            "the smoke of an image runs its entrypoint only")
    env = dict(item.split("=", 1) for item in env_list if "=" in item)
    env.update({k: v for k, v in environ.items() if k.startswith(PASSED_ENV) and not k.startswith("LLAMA_ARG_")})
    full = rocm_root.command(rootfs, [*process_args, *args], cwd=cwd, binds=binds_for(args))
    return full, env


def main(argv: list[str]) -> int:
    """`python -m dfbuild.smoke.image_root BUNDLE PROGRAM ARGS...`: the image's entrypoint with ARGS, in its root."""
    if len(argv) < 2:
        print("usage: python -m dfbuild.smoke.image_root BUNDLE PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    try:
        full, env = command(Path(argv[0]), Path(argv[1]), argv[2:], dict(os.environ))
    except (ImageRunError, ImageToolError, OSError, ValueError, KeyError) as exc:
        print(f"dfbuild.smoke.image_root: {exc}", file=sys.stderr)
        return 2
    proc.replace_with(full, env)
    return 127  # pragma: no cover - exec does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
