"""The one git helper: `git -C TREE ARGS` (or `--git-dir`) through proc, and one error family.

Every git command line dfbuild runs itself goes through `run()` (GitPython's Repo objects
remain for what they do well). A failure with check=True raises GitError, a subclass of
GitPython's GitCommandError, so a caller handles a failure of GitPython's calls and of ours
with one `except git.GitCommandError`. Each caller turns it into its own documented error
(a BuildError in prove, a PatchConflictError in apply...) where the failure is the user's.

Named gitrun, not git: `import git` in dfbuild's modules is GitPython.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from git.exc import GitCommandError

from dfbuild.core import proc


class GitError(GitCommandError):
    """`git ARGS` exited non-zero: the command line, its exit code, stderr and stdout (GitPython's fields)."""

    def __init__(self, command: list[str], status: int, stderr: str | bytes | None = None,
                 stdout: str | bytes | None = None):
        super().__init__(command, status, stderr or "", stdout or "")
        self.output_tail = proc.tail(stderr) or proc.tail(stdout)


Where = str | os.PathLike[str] | None   # a tree, a git dir or a working directory: a path, or none


def command(tree: Where, *args: str, git_dir: Where = None) -> list[str]:
    """The argument list of `git -C TREE ARGS` (`git --git-dir GIT_DIR ARGS`; plain `git ARGS` without either)."""
    if git_dir is not None:
        return ["git", "--git-dir", str(git_dir), *args]
    if tree is not None:
        return ["git", "-C", str(tree), *args]
    return ["git", *args]


def run(tree: Where, *args: str, check: bool = True, git_dir: Where = None,
        extra_env: Mapping[str, str] | None = None, input: str | bytes | None = None, text: bool = True,
        errors: str | None = None, timeout: float | None = None, cwd: Where = None) -> proc.CompletedProcess:
    """Run `git -C TREE ARGS` (output captured); CHECK raises GitError on a non-zero exit.

    The error names `git ARGS` (without -C TREE), as GitPython's own errors do.
    """
    result = proc.run(command(tree, *args, git_dir=git_dir), extra_env=extra_env, input=input, text=text,
                      errors=errors, timeout=timeout, cwd=cwd)
    if check and result.returncode != 0:
        raise GitError(["git", *args], result.returncode, result.stderr, result.stdout)
    return result


def out(tree: Where, *args: str, **options) -> str:
    """The stripped stdout of `git -C TREE ARGS`; GitError when it fails."""
    return run(tree, *args, **options).stdout.strip()


def ok(tree: Where, *args: str, **options) -> bool:
    """Whether `git -C TREE ARGS` exits 0 (its output is dropped)."""
    return run(tree, *args, check=False, text=False, **options).returncode == 0

