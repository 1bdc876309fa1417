"""Downloads checked against a sha256 the caller already trusts (PyPI's listing, a pinned table entry)."""

from __future__ import annotations

import hashlib
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from dfbuild.core import ui
from dfbuild.core.errors import SourceError

TIMEOUT_S = 120


def download(url: str, dest: Path, *, sha256: str, name: str, size: int = 0, reach: str) -> None:
    """Stream URL to DEST (atomically), checking its sha256; progress every 10% (a line each, readable in CI logs).

    NAME is the file as messages call it; REACH is the hint when the server cannot be reached.
    A file that does not match SHA256 is never kept.
    """
    tmp = dest.with_name(dest.name + f".part-{os.getpid()}")
    digest = hashlib.sha256()
    started, reported, done = time.monotonic(), -1, 0
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, open(tmp, "wb") as out:
            total = int(response.headers.get("Content-Length") or size or 0)
            for block in iter(lambda: response.read(1 << 20), b""):
                out.write(block)
                digest.update(block)
                done += len(block)
                if total and done * 10 // total != reported:
                    reported = done * 10 // total
                    ui.info(f"    {name}: {done >> 20} of {total >> 20} MiB ({time.monotonic() - started:.1f}s)")
        if digest.hexdigest() != sha256:
            raise SourceError(f"{name} from {url} does not match the sha256 dfbuild expects ({sha256[:16]}...)",
                              "download it again; if this persists, the server is serving a different file")
        os.replace(tmp, dest)
    except (urllib.error.URLError, OSError) as exc:
        raise SourceError(f"cannot download {name} from {url}: {getattr(exc, 'reason', None) or exc}",
                          reach) from None
    finally:
        tmp.unlink(missing_ok=True)
