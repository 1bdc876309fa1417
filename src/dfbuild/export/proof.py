"""The export's proof: its test file, run at its base under the base's own server test harness, unpatched and patched.

`series export --upstream` (unless --no-prove) checks the base out into a work dir of dfbuild's (default: the
cache's export-proofs/BASE), applies the export's own patch files there with `git am`, as a reviewer would, and
builds llama-server twice in one build dir, as `dfbuild prove` does: the base commit (kept in WORK/unpatched,
reused by the next export of that base) and the patched tree (an incremental build, the shared ccache for the
rest). Then the base's `tools/server/tests` runs the exported test file under pytest against each binary, in a
Python with that harness's own requirements (a venv made once per requirements file, or $DFBUILD_UPSTREAM_PYTHON).

Offline: the base's conftest.py preloads the presets' models (ServerPreset.load_all), which needs the network.
No upstream file is edited to get past it: pytest loads dfbuild's plugin (`-p dfbuild_offline_presets`, from
data/upstream/pytest_plugin on PYTHONPATH), which makes that preload a no-op; the exported test uses no preset.

The proof holds when the test fails unpatched, with the bug's symptom in the server's log, and passes patched;
anything else is ExportProofError (exit 28), which says what each build did, and the export is not written.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import sys
import time
from contextlib import ExitStack
from importlib import resources
from pathlib import Path

from dfbuild.build import tree as build
from dfbuild.core import gitrun, paths, proc, state, ui
from dfbuild.core.errors import ExportError, ExportProofError
from dfbuild.export.text import REQUIREMENTS, TEST_NAME
from dfbuild.source import checkout as source

PLUGIN = "dfbuild_offline_presets"
PYTHON_ENV = "DFBUILD_UPSTREAM_PYTHON"  # a Python that has the harness's requirements: no venv is made
TESTS_DIR = "tools/server/tests"
PYTEST_TIMEOUT_S = 900
# what llama-server logs when the bug happens: the draft batch is refused (and the request answered HTTP 500)
SYMPTOM = "inconsistent sequence positions"
_HTTP_ERROR = re.compile(r"'code': (\d{3}), 'message': '([^']*)'")
_POSITIONS = re.compile(r"\bX = (\d+)\b.*?\bY = (\d+)\b", re.S)
_SUMMARY_LINE = re.compile(r"^(FAILED|ERROR|PASSED|XFAIL|XPASS|SKIPPED) ")
_FINAL_LINE = re.compile(r"^=+ (.*\b(passed|failed|error|errors|skipped|no tests ran)\b.*) =+$")


def plugin_dir() -> Path:
    """The folder that holds dfbuild's pytest plugin (what PYTHONPATH gets for `-p dfbuild_offline_presets`)."""
    return Path(str(resources.files("dfbuild.data").joinpath("upstream").joinpath("pytest_plugin")))


def default_work(base: str) -> Path:
    """dfbuild's own work dir for BASE's export proofs: one tree, one build dir and the unpatched copy."""
    return paths.cache_dir() / "export-proofs" / re.sub(r"[^A-Za-z0-9._-]+", "-", base)


# --- the harness's Python --------------------------------------------------------------------


def harness_python(requirements: Path) -> Path:
    """A Python with REQUIREMENTS (the base's server test requirements) installed: $DFBUILD_UPSTREAM_PYTHON
    when set, else a venv made once per requirements file in dfbuild's cache. pip installs from PyPI, or from
    wherever the PIP_* variables point (PIP_NO_INDEX and PIP_FIND_LINKS on a machine without network)."""
    given = os.environ.get(PYTHON_ENV)
    if given:
        return Path(given)
    digest = hashlib.sha256(Path(requirements).read_bytes()).hexdigest()[:16]
    where = paths.cache_dir() / "upstream-venvs" / digest
    python = where / "bin" / "python"
    with paths.locked(where.with_name(where.name + ".lock")):
        if (where / "ready").is_file() and python.is_file():
            return python
        shutil.rmtree(where, ignore_errors=True)
        partial = where.with_name(f".{where.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            proc.run([sys.executable, "-m", "venv", partial], check=True)
            proc.run([partial / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check",
                      "-r", requirements], check=True)
            (partial / "ready").write_text("ok\n", encoding="utf-8")
            state.move(partial, where)  # beside it, so a rename: the venv's python links stay as they were
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return python


# --- one pytest run --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pytest_args(python: Path) -> list[str]:
    """The command run in TREE/tools/server/tests (LLAMA_SERVER_BIN_PATH names the binary)."""
    return [str(python), "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-p", PLUGIN, f"unit/{TEST_NAME}"]


def run_pytest(python: Path, tree: Path, server: Path, log: Path) -> dict:
    """The exported test under TREE's harness against SERVER; its output kept in LOG. Returns read_run's record."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    # COLUMNS: pytest fits its short summary to the terminal; wide enough to keep the assertion message
    env |= {"LLAMA_SERVER_BIN_PATH": str(server), "PORT": str(_free_port()), "COLUMNS": "200",
            "PYTHONPATH": os.pathsep.join([str(plugin_dir()), *filter(None, [env.get("PYTHONPATH")])])}
    start = time.monotonic()
    try:
        result = proc.run(pytest_args(python), cwd=Path(tree) / TESTS_DIR, env=env, timeout=PYTEST_TIMEOUT_S)
        code, output = result.returncode, (result.stdout or "") + (result.stderr or "")
    except proc.TimeoutExpired as exc:
        code, output = -1, f"{exc.output or ''}\n(pytest ran past {PYTEST_TIMEOUT_S} s and was stopped)"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(output if isinstance(output, str) else output.decode(errors="replace"), encoding="utf-8")
    return read_run(code, log.read_text(encoding="utf-8")) | {"wall_s": round(time.monotonic() - start, 1),
                                                             "log": str(log)}


def read_run(returncode: int, output: str) -> dict:
    """What a pytest run says: "passed" (exit 0, something passed) or "failed", pytest's own summary lines
    (the short test summary and the closing line), and the symptom when the server's log shows the bug."""
    lines = [line.rstrip() for line in output.splitlines()]
    summary = [line for line in lines if _SUMMARY_LINE.match(line)]
    finals = [m.group(1) for m in map(_FINAL_LINE.match, lines) if m]
    if finals:
        summary.append(finals[-1])
    passed = returncode == 0 and bool(finals) and " passed" in f" {finals[-1]}"
    return {"result": "passed" if passed else "failed", "returncode": returncode, "summary": summary,
            "symptom": symptom(output)}


def symptom(output: str) -> str | None:
    """The bug as the run shows it: the HTTP error the test saw and the server's refusal with its positions."""
    at = output.find(SYMPTOM)
    if at < 0:
        return None
    http = _HTTP_ERROR.search(output)
    positions = _POSITIONS.search(output, at, at + 2000)
    said = f"HTTP {http.group(1)} `{http.group(2)}`, after " if http else ""
    return said + f"`{SYMPTOM}`" + (f" (X = {positions.group(1)}, Y = {positions.group(2)})" if positions else "")


def verdict(base: str, unpatched: dict, patched: dict) -> None:
    """Nothing unless the test failed unpatched with the bug's symptom and passed patched: ExportProofError."""
    if unpatched["result"] == "failed" and unpatched["symptom"] and patched["result"] == "passed":
        return

    def did(name: str, run: dict) -> str:
        last = (run["summary"] or [f"pytest exit {run['returncode']}, no summary"])[-1]
        extra = "" if run["result"] == "passed" or run["symptom"] or name == "patched" else \
            ", but not with the bug's symptom"
        return f"{name} {run['result']} ({last}{extra})"

    raise ExportProofError(
        f"the exported test does not prove the fix at {base}: it must fail unpatched and pass patched; "
        f"{did('unpatched', unpatched)}, {did('patched', patched)}; nothing was written",
        f"pytest's output: {unpatched['log']} and {patched['log']}")


# --- the proof -------------------------------------------------------------------------------


def prove_export(base: str, patches: list[Path], *, request, work: Path, commit_env: dict[str, str],
                 repo: str | None = None) -> dict:
    """Build BASE unpatched and with PATCHES (`git am`) in WORK, run the exported test against both; the
    export record's proof section. ExportProofError (28) when it does not fail unpatched and pass patched."""
    from dfbuild import smoke  # the build and smoke stages: loaded when a proof runs, not with the export
    from dfbuild.release import prove  # the build and smoke stages: loaded when a proof runs, not with the export

    work = Path(work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    label = build.dir_label(request.backend, request.cross_host)
    tree, build_dir = work / "src", work / f"build-{label}"
    wall: dict[str, float] = {}
    with ExitStack() as held:
        for kind, path in prove.work_locks(work, label):
            held.enter_context(state.hold_path(kind, path))
        when = time.monotonic()
        if (tree / ".git" / "rebase-apply").is_dir():  # an earlier proof's git am, killed: dfbuild's own tree
            gitrun.run(tree, "am", "--abort", check=False)
        with ui.step(f"checkout {base} for the proof ({tree})"):
            checked = source.checkout(base, repo=repo, dest=tree, force=True)
        result = gitrun.run(tree, "am", "-q", "--no-gpg-sign", *map(str, patches), check=False, extra_env=commit_env)
        if result.returncode != 0:
            gitrun.run(tree, "am", "--abort", check=False)
            raise ExportError(f"git am of the export failed on a fresh {base} checkout: "
                              + (result.stderr.strip().splitlines() or ["(no message)"])[-1], None)
        wall["checkout_and_am"] = round(time.monotonic() - when, 1)
        when = time.monotonic()
        with ui.step(f"build llama-server unpatched ({base})"):
            plain = prove.build_unpatched(tree, request, work, checked["commit"])
        wall["build_unpatched"] = round(time.monotonic() - when, 1)
        when = time.monotonic()
        with ui.step("build llama-server with the export"):
            build.build_tree(tree, request, build_dir)
        wall["build_patched"] = round(time.monotonic() - when, 1)
        when = time.monotonic()
        with ui.step("the harness's Python (tools/server/tests/requirements.txt)"):
            python = harness_python(tree / REQUIREMENTS)
        wall["python"] = round(time.monotonic() - when, 1)
        with ui.step(f"pytest unit/{TEST_NAME}, unpatched"):
            unpatched = run_pytest(python, tree, smoke.server_binary(Path(plain["build_dir"])),
                                   work / "pytest-unpatched.log")
        with ui.step(f"pytest unit/{TEST_NAME}, with the export"):
            patched = run_pytest(python, tree, smoke.server_binary(build_dir), work / "pytest-patched.log")
    wall |= {"pytest_unpatched": unpatched["wall_s"], "pytest_patched": patched["wall_s"]}
    verdict(base, unpatched, patched)
    version = proc.run([python, "-m", "pytest", "--version"], check=False)
    return {
        "unpatched": unpatched["result"], "patched": patched["result"], "symptom": unpatched["symptom"],
        "summary": {"unpatched": unpatched["summary"], "patched": patched["summary"]},
        "backend": request.backend, "cpu_variants": list(request.cpu_variants or []) or None,
        "cmake_args": os.environ.get("DFBUILD_CMAKE_ARGS") or None,
        "pytest": ((version.stdout or "") + (version.stderr or "")).strip() or None,
        "command": f"LLAMA_SERVER_BIN_PATH=BUILD/bin/llama-server pytest -v unit/{TEST_NAME}",
        "offline_plugin": PLUGIN, "base_commit": checked["commit"], "work": str(work), "wall_s": wall,
    }
