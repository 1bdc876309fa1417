"""Running a build step (CMake, ninja): its output copied to the build log, ninja's [n/N] shown as a
progress bar (a line per 10% in CI logs), and the most telling error line when it fails.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dfbuild.core import proc, ui
from dfbuild.core.errors import BuildError

LOG_NAME = "dfbuild-build.log"


# ninja's status line, e.g. "[12/311] Building CXX object ..." (NINJA_STATUS is pinned below)
_NINJA_STATUS = re.compile(r"^\[(\d+)/(\d+)\] ?(.*)$")


# Steps that mean real work. llama.cpp re-runs an always-out-of-date "Provisioning UI
# assets" step on every build (it then changes nothing), so "ninja: no work to do."
# alone cannot tell an unchanged rebuild.
_WORK_STEP = re.compile(r"^(Building|Linking) ")


# The first line that names a compile error, best pattern first.
_ERROR_PATTERNS = (
    re.compile(r"^\S.*?:\d+(?::\d+)?: (?:fatal )?error: .+"),        # gcc / clang
    re.compile(r"^\S.*?\(\d+(?:,\d+)?\)\s*: (?:fatal )?error \w+: .+"),  # MSVC: file(12): error C2065: ...
    re.compile(r"^\S.*?\(\d+\): (?:catastrophic )?error: .+"),         # nvcc
    re.compile(r"^CMake Error.*"),
    re.compile(r"^ninja: error: .+"),
    re.compile(r"^.*\berror\b.*", re.IGNORECASE),
)


def first_error(lines: Iterable[str]) -> str | None:
    """The most telling error line of a build log (a compiler error before anything vaguer)."""
    lines = list(lines)
    for pattern in _ERROR_PATTERNS:
        for index, line in enumerate(lines):
            if pattern.match(line):
                if line.startswith("CMake Error"):  # its message is on the next lines
                    return f"{line.strip()} {_cmake_message(lines[index + 1:])}".strip()
                return line.strip()
    return None


def _cmake_message(after: list[str]) -> str:
    """The first sentence of a CMake error's indented message, which CMake wraps over several lines:
    `Target "ggml-cuda" links to:` / `CUDA::cuda_driver` / `but the target was not found.` (the target's
    name was lost when only the first line was kept)."""
    words: list[str] = []
    for line in after:
        if line.strip() and not line.startswith(" "):  # the message ends where CMake's indentation does
            break
        words.extend(line.split())
        text = " ".join(words)
        end = re.search(r"[.!?](?:\s|$)", text)
        if end:
            return text[:end.start() + 1]
        if len(words) > 40:  # no sentence end in sight: enough to say what failed
            break
    return " ".join(words)


def _run_logged(args: list[str], *, cwd: Path, env: dict, log,
                progress_title: str | None = None, compiled: list[str] | None = None,
                run_in=None) -> tuple[int, int, int]:
    """Run ARGS, copying its output to LOG; show ninja's [n/N] as a progress bar.

    Returns (exit code, total steps ninja announced, compile/link steps it ran).
    COMPILED, when given, gets the object file of each compile step ninja ran.
    RUN_IN, when given, turns (ARGS, CWD) into the command that runs them elsewhere (the ROCm root).
    """
    log.write("$ " + " ".join(args) + "\n")
    log.flush()
    ui.debug("    $ " + shlex.join(args))
    if run_in is not None:
        args = run_in(args, cwd)
    # a session of its own: a signal to dfbuild's PID alone reaches ninja and its compilers only through
    # stop_group below (a terminal's Ctrl-C as well); a dfbuild killed by -9 still stops ninja (SIGTERM)
    process = proc.start(args, cwd=cwd, env=env, stdout=proc.PIPE, stderr=proc.STDOUT, text=True, errors="replace",
                         bufsize=1, own_group=True, die_with=proc.dies_with_dfbuild())
    total = work = 0
    interactive = ui.console.is_terminal and progress_title is not None and not ui.quiet()
    progress = Progress(TextColumn("    {task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=ui.console, transient=True, disable=not interactive)
    task = None
    reported = -1
    try:
        with progress:
            for line in process.stdout or ():  # always a pipe here (stdout=PIPE)
                log.write(line)
                match = _NINJA_STATUS.match(line)
                if not match or progress_title is None:
                    continue
                done, total = int(match.group(1)), int(match.group(2))
                work += bool(_WORK_STEP.match(match.group(3)))
                if compiled is not None and match.group(3).startswith("Building "):
                    compiled.append(match.group(3).split()[-1])  # "Building CXX object DIR/x.cpp.o"
                if task is None:
                    task = progress.add_task(progress_title, total=total)
                progress.update(task, completed=done, total=total)
                if not interactive and total and done * 10 // total != reported:  # CI logs: every 10%
                    reported = done * 10 // total
                    ui.info(f"    [{done}/{total}]")
        return process.wait(), total, work
    except KeyboardInterrupt as exc:  # Ctrl-C, or errors.Terminated (SIGTERM)
        # forwarded to ninja and its compilers, which stop within a moment (ninja keeps what it finished, so
        # the next run resumes); what has not stopped after proc.STOP_GRACE_S is killed
        proc.stop_group(process, proc.interrupt_signal(exc))
        log.write("\n[dfbuild] interrupted\n")
        raise
    finally:
        log.flush()


def _fail(log_path: Path, stage: str) -> BuildError:
    lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    error = first_error(lines)
    message = f"{stage} failed" + (f": {error}" if error else "")
    return BuildError(message, f"full log: {log_path}")
