"""The llama-server process handle: which binary and launcher, a free port, start, /health, stop.

It follows llama.cpp's tools/server/tests/utils.py: an argument list, /health polled while the
process is watched, and an unconditional stop (terminate, then kill) that keeps the log for the
failure message.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import BinaryIO

from dfbuild.core import errors, proc
from dfbuild.smoke.client import Response, parse_sse
from dfbuild.smoke.logscan import tail

# --- the server handle ----------------------------------------------------------

# The backend table sets each backend's start timeout (smoke.runtime.start_timeout_s);
# a user raises it with --start-timeout or this variable.
DEFAULT_START_TIMEOUT = 180.0
DEFAULT_REQUEST_TIMEOUT = 300.0
START_TIMEOUT_ENV = "DFBUILD_START_TIMEOUT"


def server_binary(build_dir: Path) -> Path:
    """`B/bin/llama-server` (`.exe` on Windows), as CMake lays it out; a Windows build made here
    (`--os windows` on Linux) has only the `.exe`, which runs through Wine (launcher_for). An unpacked
    release archive has it at the top (llama.cpp's layout: `llama-<tag>/llama-server`, a flat zip),
    so B itself is looked in when B/bin has none."""
    native, other = ("llama-server.exe", "llama-server") if sys.platform == "win32" else ("llama-server",
                                                                                           "llama-server.exe")
    for folder in (Path(build_dir) / "bin", Path(build_dir)):
        for name in (native, other):
            if (folder / name).is_file():
                return folder / name
    return Path(build_dir) / "bin" / native


def launcher_for(binary: Path) -> tuple[list[str], dict[str, str]]:
    """(command prefix, environment) that runs BINARY here: nothing for a native program; for a
    Windows .exe on Linux, Wine in a prefix of dfbuild's cache (platforms.windows); for a hip build
    made in the Debian forky root, that root (platforms.rocm_root); for the entrypoint of an unpacked
    image, the image's root (smoke.image_root); for an ELF program of another
    machine (arm64 on x64), qemu-user (platforms.linux_arm64)."""
    from dfbuild.host.platforms import rocm_root
    from dfbuild.smoke import image_root

    in_root = rocm_root.launcher(Path(binary).parent.parent) or image_root.launcher(Path(binary))
    if in_root:
        return in_root, {}
    module, host = _cross_runner(binary)
    if module is None:
        return [], {}
    env = module.run_env(host)
    if hasattr(module, "display_env"):  # a Windows Vulkan build: Wine with a display (platforms.windows)
        env.update(module.display_env(host, binary))
    return module.launcher(host), env


def _cross_runner(binary: Path):
    """(platform module, cross Host) whose runner starts BINARY here, or (None, None) for a native program."""
    from dfbuild.core import elf
    from dfbuild.host import platforms

    if Path(binary).suffix.lower() == ".exe":
        if sys.platform == "win32":
            return None, None
        from dfbuild.host.platforms import windows

        return windows, platforms.target_host("windows")  # refused (exit 33) where no cross entry says how
    try:
        with open(binary, "rb") as handle:
            head = handle.read(64)
    except OSError:
        return None, None
    machine = elf.machine(head)
    if machine is None or machine == elf.host_machine() or not sys.platform.startswith("linux"):
        return None, None
    host = platforms.by_elf_machine(machine)
    if host is None:
        raise errors.UnsupportedBackendError(f"{binary} is an ELF program for {machine}, which this "
                                             f"{elf.host_machine()} machine has no way to run",
                                             "run it on a machine of its kind")
    return platforms.cross(host), host


def exe_start_timeout(binary: Path) -> float | None:
    """The target's start timeout for a program that runs through a launcher (Wine's first start
    makes its prefix; qemu emulates every instruction), or None for a native one."""
    module, host = _cross_runner(binary)
    return module.start_timeout(host) if module is not None else None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class LlamaServer:
    """A llama-server process on 127.0.0.1, used as a context manager.

    `args` are the model/feature arguments; host, port and nothing else are added
    here. Inherited LLAMA_ARG_* variables are dropped so the user's shell cannot
    change what a smoke test runs.
    """

    def __init__(self, binary: Path, args: list[str], log_path: Path, *, env: dict | None = None,
                 start_timeout: float = DEFAULT_START_TIMEOUT, stop_timeout: float = 10.0, host: str = "127.0.0.1",
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT):
        self.binary = Path(binary)
        # a Windows .exe on Linux runs through Wine: that prefix, and Wine's environment
        self.launcher, launch_env = launcher_for(self.binary) if self.binary.is_file() else ([], {})
        self.args = [str(a) for a in args]
        self.log_path = Path(log_path)
        self.host = host
        self.port: int | None = None
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.request_timeout = request_timeout
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        self.env = base_env | launch_env | (env or {})
        self.process: proc.Popen | None = None
        self._log_file: BinaryIO | None = None

    @property
    def command(self) -> list[str]:
        return [*self.launcher, str(self.binary), *self.args, "--host", self.host, "--port", str(self.port)]

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    BIND_ATTEMPTS = 3

    def start(self) -> LlamaServer:
        """Start and wait for /health; a port taken between probe and bind gets a new port."""
        for attempt in range(1, self.BIND_ATTEMPTS + 1):
            try:
                return self._start_once()
            except errors.ServerStartError:
                if attempt == self.BIND_ATTEMPTS or "couldn't bind" not in self.log_text():
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_once(self) -> LlamaServer:
        if not self.binary.is_file():
            raise errors.ServerStartError(f"no llama-server at {self.binary}",
                                          hint="build it first (`dfbuild build`) or pass the right --build-dir")
        self.port = free_port(self.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - the server writes it until stop() closes it
        self._log_file.write(("$ " + " ".join(self.command) + "\n").encode())
        self._log_file.flush()
        self.process = proc.start(self.command, stdout=self._log_file, stderr=proc.STDOUT, stdin=proc.DEVNULL,
                                  env=self.env)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if not self.alive():
                code = self.process.returncode
                self.stop()
                raise errors.ServerStartError(
                    f"llama-server exited with code {code} before it was healthy; log {self.log_path}:\n"
                    + tail(self.log_text(), 15),
                    hint="read the log above: a model that does not load, or a flag this build does not know")
            try:
                if self.request("GET", "/health", timeout=5).status == 200:
                    return self
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                self.stop()
                raise errors.ServerStartError(
                    f"llama-server was not healthy after {self.start_timeout:.0f}s; log {self.log_path}:\n"
                    + tail(self.log_text(), 15),
                    hint=f"a slow device (a cold shader cache) or a hung load: read the log, or give it longer "
                         f"with --start-timeout SECONDS (or ${START_TIMEOUT_ENV}) on smoke, prove or release")
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> int | None:
        """Terminate, then kill; always safe to call. Returns the exit code."""
        code = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout=self.stop_timeout)
                except proc.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            code = self.process.returncode
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def log_text(self, offset: int = 0) -> str:
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")

    def request(self, method: str, path: str, payload: dict | None = None, timeout: float | None = None) -> Response:
        timeout = self.request_timeout if timeout is None else timeout
        data = json.dumps(payload).encode() if payload is not None else None
        req = urllib.request.Request(self.url(path), data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        text = raw.decode("utf-8", errors="replace")
        body, events = None, []
        if payload is not None and payload.get("stream"):
            events = parse_sse(text)
        else:
            try:
                body = json.loads(text)
            except ValueError:
                body = None
        return Response(status, body if isinstance(body, dict) else None, text, events)
