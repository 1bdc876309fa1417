"""What the commands share beyond their options: the locks they hold, the default dirs they make or
refuse, the table of concerns they print, the host a build is for.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from dfbuild.core import errors, ui


def _locks(*held: tuple[str, Path], no_wait: bool):
    """Hold the locks of the work tree / build dir / output dir for the whole command, always in this order."""
    from contextlib import ExitStack

    from dfbuild.core import state

    stack = ExitStack()
    try:
        for kind, path in held:
            stack.enter_context(state.hold_path(kind, path, wait=not no_wait))
    except BaseException:
        stack.close()
        raise
    return stack


def _default_dir_here(name: str) -> Path:
    """./llama.cpp-NAME (import's default), refused (exit 16) when the current dir cannot be written."""
    from dfbuild.source import checkout as source

    return _writable_here(source.default_dir(name))


def _writable_here(path: Path) -> Path:
    here = Path.cwd()
    if not path.exists() and not os.access(here, os.W_OK | os.X_OK):
        raise errors.CannotWriteError(f"cannot create {path}: the current directory {here} "
                                      "is not writable", "pass --dir DIR on a writable file system")
    return path


def default_tree_here(base: str) -> Path:
    """./dfbuild-BASE/src: the tree `checkout` and `apply` make, the very one `release` and `prove` use
    (their --work ./dfbuild-BASE), so apply, build, then release checks out and builds once.

    A ./llama.cpp-BASE an older dfbuild made is not used by default any more: it is named, with the --dir
    that keeps using it."""
    from dfbuild.core import paths
    from dfbuild.source import checkout as source

    tree = paths.default_work_dir(base) / "src"
    old = source.default_dir(base)
    if not tree.exists() and (old / ".git").exists():
        ui.warn(f"{old.name} (an older dfbuild's default dir) is not used: the default is now {tree.parent.name}/src; "
                f"pass --dir {old.name} to keep using the old one")
    return _writable_here(tree)


def shown(path: Path) -> str:
    """PATH as a command line to copy takes it: relative to the current dir when under it, quoted."""
    from shlex import quote

    try:
        text = str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        text = str(path)
    return quote(text)


@contextmanager
def removed_if_left_empty_handed(path: Path, kept):
    """PATH, when this run makes it, is removed again if the run fails before KEPT() says it holds
    something worth keeping (a checkout): an early failure leaves nothing behind, and touches nothing
    it did not make."""
    existed = os.path.lexists(path)
    try:
        yield
    except BaseException:
        if not existed and Path(path).is_dir() and not Path(path).is_symlink() and not kept():
            shutil.rmtree(path, ignore_errors=True)
        raise


def check_can_build(backend: str, target_os, vulkan_include_dir=None, target_arch=None) -> None:
    """Backend, OS, architecture and toolchain: refused at once (33, 30), before any checkout."""
    from dfbuild.host import doctor, platforms

    host = platforms.target_host(target_os, arch=target_arch)
    doctor.require(backend, host, extra_include_dirs=[Path(vulkan_include_dir)] if vulkan_include_dir else [])

STATUS_STYLE = {"clean": "green", "offset": "green", "3-way": "green", "applied": "cyan", "already-present": "cyan",
                "upstream": "blue", "not-needed": "blue", "skipped": "yellow", "conflict": "red", "no-variant": "red",
                "not-applicable": "yellow"}


def _render_concerns(rows: list[dict]) -> None:
    from rich.table import Table

    table = Table(show_header=True, header_style="bold")
    for column in ("concern", "status", "detail"):
        table.add_column(column)
    for row in rows:
        style = STATUS_STYLE.get(row["status"], "")
        table.add_row(row["id"], f"[{style}]{row['status']}[/{style}]", row.get("detail") or row.get("commit") or "")
    ui.result(table)


def say_request(request, *, smoke: bool = True) -> None:
    """The build request in words, on stderr, before the work starts (as cibuildwheel prints its options)."""
    ui.plain(request.summary(smoke=smoke))


def _dir_label(backend: str, host) -> str:
    from dfbuild.build import tree as build_stage

    return build_stage.dir_label(backend, host)


def _work_locks(work_dir: Path, backend: str) -> list[tuple[str, Path]]:
    from dfbuild.release import prove as prove_stage

    return prove_stage.work_locks(work_dir, backend)
