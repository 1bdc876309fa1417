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
`own_group=True` starts the child as the leader of a session of its own (a build: ninja and its
compilers, npm and node): a signal sent to dfbuild's PID alone (a supervisor's SIGINT, `timeout`'s
SIGTERM) is then forwarded by `stop_group`, which waits a moment and kills whatever is left of it,
so no compiler outlives an interrupted dfbuild.

This module sits on the lowest floor: it imports nothing of dfbuild but errors. It is the only
module that imports subprocess; the names callers need from it (PIPE, DEVNULL, STDOUT,
TimeoutExpired, SubprocessError, CompletedProcess, Popen) are re-exported here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
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
# how long an interrupted build (ninja, npm) has to stop on the forwarded signal before it is killed
STOP_GRACE_S = 3.0


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
        die_with: int | None = None, own_group: bool = False) -> subprocess.CompletedProcess:
    """Run ARGS to its end; its CompletedProcess.

    CAPTURE (the default) keeps stdout and stderr, unless STDOUT / STDERR say where they go.
    TEXT decodes them (ERRORS as open() takes it); TEXT=False keeps bytes. CHECK raises
    CommandError on a non-zero exit. TIMEOUT kills the program and raises TimeoutExpired;
    a program that cannot start raises OSError, as subprocess does. OWN_GROUP: see stop_group;
    an interrupt (KeyboardInterrupt, errors.Terminated) stops the program and all it started.
    """
    if capture:
        stdout = PIPE if stdout is None else stdout
        stderr = PIPE if stderr is None else stderr
    if own_group:
        return _run_own_group(args, check=check, input=input, timeout=timeout, cwd=cwd,
                              env=_environment(env, extra_env), stdin=stdin, stdout=stdout, stderr=stderr,
                              text=text or None, errors=errors, preexec_fn=_preexec(die_with))
    result = subprocess.run([os.fspath(arg) for arg in args], input=input, cwd=cwd,
                            env=_environment(env, extra_env), timeout=timeout, stdin=stdin, stdout=stdout,
                            stderr=stderr, text=text or None, errors=errors, preexec_fn=_preexec(die_with))
    if check and result.returncode != 0:
        raise CommandError(args, result.returncode, result.stdout, result.stderr)
    return result


def _run_own_group(args: Sequence[Arg], *, check: bool, input: str | bytes | None, timeout: float | None,
                   **popen: Any) -> subprocess.CompletedProcess:
    if input is not None:
        popen["stdin"] = PIPE
    with subprocess.Popen([os.fspath(arg) for arg in args], start_new_session=True, **popen) as process:
        try:
            out, err = process.communicate(input, timeout=timeout)
        except BaseException as exc:
            stop_group(process, signal.SIGKILL if isinstance(exc, TimeoutExpired) else interrupt_signal(exc))
            raise
    if check and process.returncode != 0:
        raise CommandError(args, process.returncode, out, err)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def start(args: Sequence[Arg], *, cwd: Arg | None = None, env: Mapping[str, str] | None = None,
          extra_env: Mapping[str, str] | None = None, stdin: File = None, stdout: File = None,
          stderr: File = None, text: bool = False, errors: str | None = None, bufsize: int = -1,
          pass_fds: Iterable[int] = (), die_with: int | None = None, own_group: bool = False) -> subprocess.Popen:
    """Start ARGS and return at once: its Popen, which the caller waits for, stops or kills.

    OWN_GROUP: the leader of a new session (see stop_group)."""
    return subprocess.Popen([os.fspath(arg) for arg in args], cwd=cwd, env=_environment(env, extra_env),
                            stdin=stdin, stdout=stdout, stderr=stderr, text=text or None, errors=errors,
                            bufsize=bufsize, pass_fds=tuple(pass_fds), preexec_fn=_preexec(die_with),
                            start_new_session=own_group)


def dies_with_dfbuild() -> int | None:
    """die_with for a build's own session (own_group=True): SIGTERM when dfbuild dies, even by kill -9, which
    no longer reaches it through dfbuild's process group. Only from the main thread (see die_with_parent)."""
    import threading

    return signal.SIGTERM if threading.current_thread() is threading.main_thread() else None


def interrupt_signal(exc: BaseException) -> int:
    """The signal that stopped dfbuild, to forward: SIGTERM for errors.Terminated, else SIGINT (Ctrl-C)."""
    return signal.SIGTERM if getattr(exc, "signal_name", None) == "SIGTERM" else signal.SIGINT


def session_members(leader: int) -> list[int]:
    """The processes in the session LEADER started (own_group=True), itself included while it lives.

    A session, not a process group: ninja puts each compile in a process group of its own, and a
    compiler whose ninja died is still in the session. Read from /proc (Linux); elsewhere the
    leader's process group is all that is known.
    """
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return [leader] if _alive(leader) else []
    found = []
    for pid in pids:
        try:
            if os.getsid(pid) == leader and pid != os.getpid():
                found.append(pid)
        except OSError:  # gone since the listing
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _signal_all(leader: int, sig: int) -> None:
    try:
        os.killpg(leader, sig)
    except OSError:  # the group is gone (its compilers, in groups of their own, may not be)
        pass
    for pid in session_members(leader):
        try:
            os.kill(pid, sig)
        except OSError:  # gone since
            pass


def stop_group(process: subprocess.Popen, sig: int = signal.SIGINT, grace: float = STOP_GRACE_S) -> None:
    """Stop PROCESS, started with own_group=True, and everything it started.

    SIG goes to its process group and to every process of its session, as a terminal's Ctrl-C
    would reach them (ninja stops its compiles, npm its node); what has not ended after GRACE
    seconds is killed (SIGKILL), so nothing of it outlives dfbuild. PROCESS is reaped.
    """
    if os.name != "posix":  # no sessions nor process groups to signal (Windows): the program alone
        process.kill()
        process.wait()
        return
    leader = process.pid
    try:
        if sig != signal.SIGKILL:
            _signal_all(leader, sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                if process.poll() is not None and not session_members(leader):
                    return
                time.sleep(0.05)
    except KeyboardInterrupt:  # a second Ctrl-C while waiting: no more grace
        _signal_all(leader, signal.SIGKILL)
        raise
    _signal_all(leader, signal.SIGKILL)
    try:
        process.wait(timeout=grace)
    except TimeoutExpired:  # in uninterruptible sleep (a hung NFS read): nothing more can be done here
        pass


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
