"""Which device a GPU backend's smoke runs on: `llama-server --list-devices`, and exit 45 when none is of its kind."""

from __future__ import annotations

import os
import re
from pathlib import Path

from dfbuild.core import errors, proc
from dfbuild.smoke.server import _cross_runner, launcher_for

LIST_DEVICES_TIMEOUT = 120.0


class DeviceLines(list):
    """list_devices' answer: the device lines, and (said) the server's own stderr lines about its backends."""

    said: tuple[str, ...] = ()


# e.g. "ggml_cuda_init: failed to initialize ROCm: no ROCm-capable device is detected",
# "ggml_vulkan: No devices found.": a line that names a backend and says what failed
_SAID = re.compile(r"\b(?:fail\w*|no\b|not found|cannot|unable)", re.IGNORECASE)


def backend_said(how, said) -> list[str]:
    """The lines of SAID (list_devices' stderr lines) in which HOW's backend says why it found no device."""
    names = [n.lower() for n in (*how.smoke_device.get("names", ()), how.name)]
    return [line for line in said if any(n in line.lower() for n in names) and _SAID.search(line)][:3]


def list_devices(binary: Path, env: dict | None = None, timeout: float = LIST_DEVICES_TIMEOUT) -> DeviceLines:
    """The device lines of `llama-server --list-devices` (e.g. "Vulkan0: llvmpipe (LLVM 19.1.7, 256 bits) ..."),
    as a DeviceLines whose `said` holds the server's stderr lines (a backend says there why it has no device).

    Raises OSError or a proc.SubprocessError when the binary cannot say.
    """
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    prefix, launch_env = launcher_for(binary)
    command = [*prefix, str(binary), "--list-devices"]
    done = proc.run(command, env=base_env | launch_env | (env or {}), stdin=proc.DEVNULL, errors="replace",
                    timeout=timeout)
    if done.returncode != 0:  # subprocess's own error: its message is what the smoke record says
        raise proc.CalledProcessError(done.returncode, command, done.stdout, done.stderr)
    lines = done.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Available devices:"), None)
    if start is None:
        raise OSError("no 'Available devices:' in its output")
    # "(none)" is how llama-server says the list is empty
    found = DeviceLines(line.strip() for line in lines[start + 1:]
                        if line.startswith(" ") and line.strip() and line.strip() != "(none)")
    found.said = tuple(line.strip() for line in (done.stderr or "").splitlines() if line.strip())
    return found


_MEMORY = re.compile(r"\s*\(\d+ MiB, \d+ MiB free\)\s*$")


def device_name(line: str) -> str:
    """A device line without its memory figures (free memory changes from run to run):
    "Vulkan0: NVIDIA H200 (NVIDIA) (143771 MiB, 142000 MiB free)" -> "Vulkan0: NVIDIA H200 (NVIDIA)"."""
    return _MEMORY.sub("", line).strip()


def backend_devices(how, lines: list[str]) -> list[str]:
    """The device lines that are HOW's own devices (CUDA0, Vulkan1, ROCm0: a name of its table, then a number)."""
    names = how.smoke_device.get("names", ())
    pattern = re.compile(r"^(?:" + "|".join(re.escape(n) for n in names) + r")\d*:", re.IGNORECASE)
    return [line for line in lines if names and pattern.match(line)]


def _vk_driver_files_missing(env: dict) -> list[str]:
    """ICD files that VK_DRIVER_FILES / VK_ICD_FILENAMES name and that do not exist (the loader then finds none)."""
    missing = []
    for var in ("VK_DRIVER_FILES", "VK_ICD_FILENAMES"):
        value = env.get(var, os.environ.get(var, ""))
        for item in filter(None, value.split(os.pathsep)):
            if not Path(item).exists():
                missing.append(f"{var} names {item}, which does not exist")
    return missing


def no_device_error(how, why: str, env: dict, binary: Path | None = None) -> errors.NoDeviceError:
    """Exit 45: HOW's smoke found no device of its kind; the hint names what is missing."""
    hint = how.smoke_device.get("missing", f"install the {how.name} driver")
    module, host = _cross_runner(binary) if binary is not None else (None, None)
    under = module.device_hint(host, how.name) if module is not None and hasattr(module, "device_hint") else None
    if under:  # a Windows .exe under Wine reaches this machine's driver through Wine's own path
        hint = under + "; " + hint
    if how.name == "vulkan":
        named = _vk_driver_files_missing(env)
        if named:
            hint = "; ".join(named) + "; " + hint
    return errors.NoDeviceError(
        f"no {how.name} device: {why}, so the smoke would run on the CPU and prove nothing about the "
        f"{how.name} build", hint + "; or pass --allow-cpu-fallback to run it on the CPU backend, "
                                    "which the manifest then records")
