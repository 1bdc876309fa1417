"""Launcher for the patched llama-server shipped in this wheel."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from ._version import __version__

BIN_DIR = Path(__file__).resolve().parent / "bin"


def binary(name: str = "llama-server") -> Path:
    """Path of a shipped program (llama-server by default)."""
    return BIN_DIR / (name + (".exe" if os.name == "nt" else ""))


def manifest() -> dict:
    """The dfbuild manifest of this build (source, series, build, smoke)."""
    path = Path(__file__).resolve().parent / "manifest.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def main() -> None:
    program = binary()
    if not program.is_file():
        sys.exit(f"llama-dflash: {program} is missing; reinstall the wheel")
    if os.name != "nt" and not os.access(program, os.X_OK):
        # an installer that dropped the executable bit: restore it once
        program.chmod(program.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    args = [str(program), *sys.argv[1:]]
    if os.name == "nt":  # no exec on Windows: wait for the child and pass its status on
        sys.exit(subprocess.call(args))
    os.execv(args[0], args)
