"""What the unit tests share: git with a fixed identity, a minimal llama.cpp tree, the CLI as a user runs it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from click.testing import CliRunner

from dfbuild import cli, series
from dfbuild.core import paths, state, ui

GIT_ENV = {
    "GIT_AUTHOR_NAME": "Upstream Dev",
    "GIT_AUTHOR_EMAIL": "dev@example.org",
    "GIT_COMMITTER_NAME": "Upstream Dev",
    "GIT_COMMITTER_EMAIL": "dev@example.org",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1",
}


def run_git(cwd: Path, *args: str, input: str | None = None) -> str:
    result = subprocess.run(["git", *args], cwd=cwd, env={**os.environ, **GIT_ENV},
                            capture_output=True, text=True, input=input, check=True)
    return result.stdout.strip()


def write_fake_llama(tree: Path, speculative: str = "// speculative decoding\n") -> None:
    """The smallest tree dfbuild accepts as llama.cpp."""
    (tree / "common").mkdir(parents=True, exist_ok=True)
    (tree / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.14)\nproject(llama.cpp)\n")
    (tree / "common" / "speculative.cpp").write_text(speculative)


def dfbuild(*args):
    """Run the CLI as a user would; stdout (JSON) and stderr (messages) stay apart."""
    result = CliRunner().invoke(cli.main, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def said(result) -> str:
    """What the user read (the result on stdout, then the talk on stderr), with rich's line wrapping undone.

    Tests of which stream a line goes to read result.stdout and result.stderr themselves."""
    return " ".join((result.stdout + "\n" + result.stderr).split())


def zeros(size: int):
    """A readable stream of SIZE zero bytes made on the fly: huge archive members without huge memory."""
    import io

    class Zeros(io.RawIOBase):
        left = size

        def readable(self):
            return True

        def readinto(self, buffer):
            n = min(len(buffer), self.left)
            buffer[:n] = bytes(n)
            self.left -= n
            return n

    return io.BufferedReader(Zeros(), 1 << 20)


def private_cache(tmp_path: Path, monkeypatch) -> Path:
    """A dfbuild cache dir of the test's own, no series or fault-injection override from the
    environment, and no wrapping of long paths in messages (for an autouse fixture)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(paths.CACHE_ENV, str(cache))
    monkeypatch.delenv(series.SERIES_ENV, raising=False)
    monkeypatch.delenv(state.STOP_AFTER_ENV, raising=False)
    monkeypatch.setattr(ui.console, "soft_wrap", True)
    return cache


def isolate_probes(monkeypatch, tmp_path: Path) -> tuple[dict, Path]:
    """A PATH and a backend probe table that see only what a test puts in the returned bin dir."""
    import copy

    from dfbuild.host import backends

    table = copy.deepcopy(backends.table())
    for spec in table["probes"].values():
        spec["dirs"] = []
        spec["dirs_env"] = []
        spec["path_lists_env"] = []
        spec["roots"] = []
    monkeypatch.setattr(backends, "table", lambda: table)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    return table, bin_dir
