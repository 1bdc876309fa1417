"""What dfbuild writes for others to read follows the umask (issue 47): a release dir served by a web
server showed its archives (0644) but hid SHA256SUMS and manifest.json (0600, tempfile.mkstemp's mode
kept by state's atomic writes). The release itself onto a tmpfs checks every file of its dir too
(test_release_e2e)."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from dfbuild.core import manifest, owned, state
from dfbuild.core.errors import DfbuildError
from dfbuild.release import record as release_record

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes")


@pytest.fixture
def umask():
    old = os.umask(0o022)
    try:
        yield os.umask
    finally:
        os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_writes_follow_the_umask(tmp_path, umask):
    state.atomic_write_text(tmp_path / "record.json", "{}\n")
    (tmp_path / "plain").write_text("x")  # what any program makes under this umask
    assert mode(tmp_path / "record.json") == 0o644 == mode(tmp_path / "plain")
    umask(0o077)
    state.atomic_write_bytes(tmp_path / "private", b"x")
    umask(0o002)
    state.atomic_write_bytes(tmp_path / "group", b"x", durable=False)
    assert mode(tmp_path / "private") == 0o600 and mode(tmp_path / "group") == 0o664


def test_a_release_dirs_sums_and_marker_are_readable_by_all(tmp_path, umask):
    out = tmp_path / "dist"
    out.mkdir()
    owned.claim(out, ["llama-b1-bin-ubuntu-x64.tar.gz", release_record.MANIFEST_NAME], DfbuildError)
    (out / "llama-b1-bin-ubuntu-x64.tar.gz").write_bytes(b"archive")
    release_record.write_sha256sums(out, ["llama-b1-bin-ubuntu-x64.tar.gz"])
    manifest.save({}, out / release_record.MANIFEST_NAME)  # as release writes it
    assert {p.name: mode(p) for p in out.iterdir()} == {
        "llama-b1-bin-ubuntu-x64.tar.gz": 0o644, release_record.SUMS_NAME: 0o644,
        release_record.MANIFEST_NAME: 0o644, owned.MARKER_NAME: 0o644}
