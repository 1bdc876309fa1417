"""What `dfbuild --version` says: the version, the series it ships (its hash) and, from a checkout, the commit."""

from __future__ import annotations

from pathlib import Path

from dfbuild._version import __version__
from dfbuild.core import gitrun, paths, proc


def series_hash(patches_dir: Path | None = None) -> str | None:
    """8 hex of the series as shipped: series.toml, which pins every patch file's sha256 and decision, without
    its proof records (the key `dfbuild track` keeps its outcomes by: recording a proof changes no patch)."""
    from dfbuild import series
    from dfbuild.core.errors import DfbuildError
    from dfbuild.release import track

    try:
        return track.series_digest(series.load_series(patches_dir))[:8]
    except (DfbuildError, OSError, ValueError):
        return None


def checkout_commit() -> str | None:
    """The git commit dfbuild runs from, when it runs from a checkout (an editable install or src/ on the
    path); '+dirty' when the checkout has changes. None for an installed copy."""
    root = paths.CHECKOUT_DIR
    if not (root / ".git").exists() or not (root / "src" / "dfbuild").is_dir():
        return None
    try:
        head = gitrun.run(root, "rev-parse", "--short=12", "HEAD", check=False, timeout=10)
        if head.returncode != 0:
            return None
        dirty = gitrun.run(root, "status", "--porcelain", "--untracked-files=no", check=False, timeout=10)
    except (OSError, proc.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def version_text() -> str:
    parts = [f"dfbuild, version {__version__}"]
    digest = series_hash()
    parts.append(f"series {digest}" if digest else "series unreadable")
    commit = checkout_commit()
    if commit:
        parts.append(f"commit {commit}")
    return ", ".join(parts)
