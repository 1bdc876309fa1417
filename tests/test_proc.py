"""The one subprocess runner (dfbuild.core.proc) and the one git helper (dfbuild.core.gitrun)."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import git
import pytest
from helpers import run_git

from dfbuild.core import errors, gitrun, proc

PY = sys.executable


def test_run_captures_both_streams_as_text():
    done = proc.run([PY, "-c", "import sys; print('out'); print('err', file=sys.stderr)"])
    assert (done.returncode, done.stdout, done.stderr) == (0, "out\n", "err\n")


def test_run_takes_paths_and_bytes_input():
    done = proc.run([Path(PY), "-c", "import sys; sys.stdout.buffer.write(sys.stdin.buffer.read()[::-1])"],
                    input=b"\x00ab", text=False)
    assert done.stdout == b"ba\x00"


def test_run_without_check_returns_a_failure():
    assert proc.run([PY, "-c", "raise SystemExit(3)"]).returncode == 3


def test_check_raises_an_error_naming_the_command_and_its_output_tail():
    script = "import sys\nfor i in range(30): print('line', i, file=sys.stderr)\nraise SystemExit(7)"
    with pytest.raises(proc.CommandError) as caught:
        proc.run([PY, "-c", script], check=True)
    exc = caught.value
    assert isinstance(exc, errors.DfbuildError) and exc.exit_code == 1
    assert exc.returncode == 7 and exc.command[0] == PY
    assert "failed with exit code 7" in exc.message and PY in exc.message
    assert exc.output_tail.splitlines() == [f"line {i}" for i in range(10, 30)]  # the last 20 lines
    assert "line 9\n" not in exc.message


def test_extra_env_is_merged_over_the_environment_and_env_replaces_it(monkeypatch):
    monkeypatch.setenv("DFBUILD_PROC_KEPT", "kept")
    show = [PY, "-c", "import os; print(os.environ.get('DFBUILD_PROC_KEPT'), os.environ.get('DFBUILD_PROC_NEW'))"]
    assert proc.run(show, extra_env={"DFBUILD_PROC_NEW": "new"}).stdout.split() == ["kept", "new"]
    assert proc.run(show, env={"DFBUILD_PROC_NEW": "only"}).stdout.split() == ["None", "only"]
    assert proc.run(show, env={"A": "1"}, extra_env={"DFBUILD_PROC_NEW": "x"}).stdout.split() == ["None", "x"]


def test_a_timeout_kills_the_program_and_raises():
    began = time.monotonic()
    with pytest.raises(proc.TimeoutExpired):
        proc.run([PY, "-c", "import time; time.sleep(60)"], timeout=0.5)
    assert time.monotonic() - began < 30


def test_a_program_that_does_not_exist_is_an_oserror():
    with pytest.raises(OSError):
        proc.run(["/nonexistent/dfbuild-no-such-program"])


def test_stream_hands_over_each_line_as_it_comes_and_the_unfinished_rest():
    seen = []
    script = "import sys; sys.stderr.write('one\\rtwo\\nthree\\n\\nrest'); print('to stdout')"
    code, rest = proc.stream([PY, "-c", script], seen.append)
    assert (code, rest) == (0, "rest")
    assert seen == ["one", "two", "three", ""]
    merged = []
    code, rest = proc.stream([PY, "-c", "import sys; print('a'); print('b', file=sys.stderr); sys.exit(2)"],
                             merged.append, read_stderr=False)
    assert code == 2 and sorted(merged) == ["a", "b"] and rest == ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_die_with_makes_the_child_go_when_its_parent_is_killed(tmp_path):
    """The parent starts a sleeper with die_with=SIGTERM and is killed with SIGKILL: the sleeper goes too."""
    pid_file = tmp_path / "child.pid"
    parent = textwrap.dedent(f"""
        import signal, sys, time
        from dfbuild.core import proc
        child = proc.start([{PY!r}, "-c", "import time; time.sleep(120)"], die_with=signal.SIGTERM)
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(120)
    """)
    runner = proc.start([PY, "-c", parent])
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # a zombie (reparented, not yet reaped) counts as gone
        if Path(f"/proc/{child}/stat").read_text().split(") ")[-1].startswith("Z"):
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived its parent")


def test_tail_decodes_bytes_and_drops_blank_lines():
    assert proc.tail(b"a\n\n\xffb\n  \n") == "a\n\ufffdb"
    assert proc.tail(None) == ""


# --- gitrun ----------------------------------------------------------------------------------


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    run_git(tmp_path, "init", "-q")
    (tmp_path / "f.txt").write_text("hello\n")
    run_git(tmp_path, "add", "f.txt")
    run_git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def test_git_runs_in_the_tree_and_out_strips(repo: Path):
    assert gitrun.out(repo, "log", "-1", "--format=%s") == "first"
    assert gitrun.run(repo, "cat-file", "-p", "HEAD:f.txt").stdout == "hello\n"
    assert gitrun.ok(repo, "rev-parse", "--verify", "--quiet", "HEAD")
    assert not gitrun.ok(repo, "rev-parse", "--verify", "--quiet", "nosuchref")


def test_git_by_git_dir_and_env_and_input(repo: Path):
    blob = gitrun.out(None, "hash-object", "-w", "--stdin", git_dir=repo / ".git", input="data\n")
    assert gitrun.out(repo, "cat-file", "-p", blob) == "data"
    assert gitrun.out(repo, "var", "GIT_AUTHOR_IDENT", extra_env={"GIT_AUTHOR_NAME": "Someone Else",
                                                                         "GIT_AUTHOR_EMAIL": "else@example.org"}) \
        .startswith("Someone Else")
    assert gitrun.command(repo, "status") == ["git", "-C", str(repo), "status"]
    assert gitrun.command(None, "status", git_dir="/x.git") == ["git", "--git-dir", "/x.git", "status"]


def test_git_failure_is_one_error_family_with_gitpython(repo: Path):
    with pytest.raises(git.GitCommandError) as caught:
        gitrun.run(repo, "rev-parse", "--verify", "nosuchref")
    exc = caught.value
    assert isinstance(exc, gitrun.GitError)
    assert exc.command == ["git", "rev-parse", "--verify", "nosuchref"] and exc.status == 128
    assert "fatal: Needed a single revision" in exc.stderr
    assert exc.output_tail == "fatal: Needed a single revision"
    # no check: the result, as it came
    assert gitrun.run(repo, "rev-parse", "--verify", "nosuchref", check=False).returncode == 128


@pytest.mark.parametrize("who", ["gitrun", "GitPython"])
def test_a_git_failure_reaches_the_user_in_gits_own_words(repo: Path, who):
    """cli/exits quotes git's last line, not GitPython's `stderr: '...'` wrapping of it, for both of the family."""
    from dfbuild.cli.exits import git_failure

    with pytest.raises(git.GitCommandError) as caught:
        if who == "gitrun":
            gitrun.run(repo, "rev-parse", "--verify", "nosuchref")
        else:
            git.Repo(repo).git.rev_parse("--verify", "nosuchref")
    known = git_failure(caught.value)
    assert known is not None and known.exit_code == 17
    assert known.message == "git rev-parse failed: fatal: Needed a single revision"


def test_replace_with_becomes_the_program_in_this_process(tmp_path):
    script = ("import os, sys\nfrom dfbuild.core import proc\n"
              f"proc.replace_with([{PY!r}, '-c', 'import os; print(os.getpid(), os.environ.get(\"MARK\"))'], "
              "{**os.environ, 'MARK': 'seen'})\nprint('not reached')\n")
    started = proc.start([PY, "-c", script], stdout=proc.PIPE, text=True)
    out, _ = started.communicate(timeout=60)
    pid, mark = out.split()
    assert int(pid) == started.pid and mark == "seen"  # the same process, now the other program
