"""The one way dfbuild runs another program: argument lists, a timeout, a clear error.

Every external program (git, compilers, pip, llama-server, apt-get...) starts here, as pip's
`call_subprocess` and cibuildwheel's `call()` are the one door in those tools:
- `run()` runs a program to its end and returns subprocess's CompletedProcess (returncode,
  stdout, stderr), output captured by default; `check=True` turns a non-zero exit into a
  CommandError that names the command and carries the tail of its output.
- `start()` starts a program that keeps running (a server, Xvfb) and returns its Popen.
- `stream()` runs a program and hands each line of its output to a callback as it comes
  (a fetch's progress), keeping the tail for the error.
- `replace_with()` execs a program in place of this process (a launcher).
Arguments are always a list, never a shell string. `extra_env` is merged over the caller's
environment (pip's extra_environ); `env` replaces it, as subprocess's does. `die_with=SIG`
makes the child get SIG when dfbuild dies, even by kill -9 (Linux's PR_SET_PDEATHSIG).

This module sits on the lowest floor: it imports nothing of dfbuild but errors. It is the only
module that imports subprocess; the names callers need from it (PIPE, DEVNULL, STDOUT,
TimeoutExpired, SubprocessError, CompletedProcess, Popen) are re-exported here.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO, Any, NoReturn

from dfbuild.core.errors import DfbuildError

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT
TimeoutExpired = subprocess.TimeoutExpired
SubprocessError = subprocess.SubprocessError
CalledProcessError = subprocess.CalledProcessError
CompletedProcess = subprocess.CompletedProcess
Popen = subprocess.Popen

Arg = str | os.PathLike[str]
File = int | IO[Any] | None

# how many lines of a failed command's output its error carries
TAIL_LINES = 20


def tail(output: str | bytes | None, lines: int = TAIL_LINES) -> str:
    """The last LINES non-empty lines of OUTPUT (bytes are decoded leniently)."""
    if output is None:
        return ""
    if isinstance(output, bytes):
        output = output.decode("utf-8", "replace")
    kept = [line.rstrip() for line in output.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


class CommandError(DfbuildError):
    """A program dfbuild ran exited non-zero (run(check=True)): the command and its output's tail.

    Exit 1 (an unexpected failure) unless a caller turns it into its own documented error.
    """

    def __init__(self, command: Sequence[Arg], returncode: int, stdout: str | bytes | None = None,
                 stderr: str | bytes | None = None):
        self.command = [os.fspath(arg) for arg in command]
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.output_tail = tail(stderr) or tail(stdout)
        message = f"`{' '.join(self.command)}` failed with exit code {returncode}"
        if self.output_tail:
            message += ":\n" + self.output_tail
        super().__init__(message)


def die_with_parent(sig: int) -> None:  # pragma: no cover - runs in the child between fork and exec
    """In a child, before exec: get SIG when dfbuild dies, even by kill -9 (no atexit runs then).
    Linux's PR_SET_PDEATHSIG; elsewhere (no prctl) nothing. The signal comes when the thread that
    started the child ends, so only the main thread should ask for it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def replace_with(args: Sequence[Arg], env: Mapping[str, str]) -> NoReturn:
    """Become ARGS (exec, found on PATH): this process's image is replaced and never returns.

    For a launcher whose whole job is to start one program in its place (rocm_root's `python -m`)."""
    command = [os.fspath(arg) for arg in args]
    os.execvpe(command[0], command, dict(env))


def _environment(env: Mapping[str, str] | None, extra_env: Mapping[str, str] | None) -> dict[str, str] | None:
    if extra_env is None:
        return None if env is None else dict(env)
    return {**(os.environ if env is None else env), **extra_env}


def _preexec(die_with: int | None) -> Callable[[], None] | None:
    if die_with is None:
        return None
    return lambda: die_with_parent(die_with)


def run(args: Sequence[Arg], *, check: bool = False, capture: bool = True, text: bool = True,
        errors: str | None = None, input: str | bytes | None = None, cwd: Arg | None = None,
        env: Mapping[str, str] | None = None, extra_env: Mapping[str, str] | None = None,
        timeout: float | None = None, stdin: File = None, stdout: File = None, stderr: File = None,
        die_with: int | None = None) -> subprocess.CompletedProcess:
    """Run ARGS to its end; its CompletedProcess.

    CAPTURE (the default) keeps stdout and stderr, unless STDOUT / STDERR say where they go.
    TEXT decodes them (ERRORS as open() takes it); TEXT=False keeps bytes. CHECK raises
    CommandError on a non-zero exit. TIMEOUT kills the program and raises TimeoutExpired;
    a program that cannot start raises OSError, as subprocess does.
    """
    if capture:
        stdout = PIPE if stdout is None else stdout
        stderr = PIPE if stderr is None else stderr
    result = subprocess.run([os.fspath(arg) for arg in args], input=input, cwd=cwd,
                            env=_environment(env, extra_env), timeout=timeout, stdin=stdin, stdout=stdout,
                            stderr=stderr, text=text or None, errors=errors, preexec_fn=_preexec(die_with))
    if check and result.returncode != 0:
        raise CommandError(args, result.returncode, result.stdout, result.stderr)
    return result


def start(args: Sequence[Arg], *, cwd: Arg | None = None, env: Mapping[str, str] | None = None,
          extra_env: Mapping[str, str] | None = None, stdin: File = None, stdout: File = None,
          stderr: File = None, text: bool = False, errors: str | None = None, bufsize: int = -1,
          pass_fds: Iterable[int] = (), die_with: int | None = None) -> subprocess.Popen:
    """Start ARGS and return at once: its Popen, which the caller waits for, stops or kills."""
    return subprocess.Popen([os.fspath(arg) for arg in args], cwd=cwd, env=_environment(env, extra_env),
                            stdin=stdin, stdout=stdout, stderr=stderr, text=text or None, errors=errors,
                            bufsize=bufsize, pass_fds=tuple(pass_fds), preexec_fn=_preexec(die_with))


def stream(args: Sequence[Arg], on_line: Callable[[str], None], *, cwd: Arg | None = None,
           env: Mapping[str, str] | None = None, extra_env: Mapping[str, str] | None = None,
           stdout: File = None, read_stderr: bool = True, errors: str = "replace",
           chunk: int = 256) -> tuple[int, str]:
    """Run ARGS to its end, calling ON_LINE with each line it writes as it comes.

    Lines end at '\\n' or '\\r' (progress meters redraw a line with '\\r'). READ_STDERR (the
    default) reads its stderr, and STDOUT says where its stdout goes (default: nowhere);
    otherwise its stdout and stderr are read together. Returns (exit code, the unfinished last
    line: text after the last line end, which ON_LINE did not see).
    """
    if read_stderr:
        process = start(args, cwd=cwd, env=env, extra_env=extra_env, stdout=DEVNULL if stdout is None else stdout,
                        stderr=PIPE, text=True, errors=errors)
        pipe = process.stderr
    else:
        process = start(args, cwd=cwd, env=env, extra_env=extra_env, stdout=PIPE, stderr=STDOUT, text=True,
                        errors=errors)
        pipe = process.stdout
    assert pipe is not None
    buffer = ""
    try:
        while True:
            data = pipe.read(chunk)
            if not data:
                break
            buffer += data
            *lines, buffer = buffer.replace("\r", "\n").split("\n")
            for line in lines:
                on_line(line)
    finally:
        pipe.close()
    return process.wait(), buffer
