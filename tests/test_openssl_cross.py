"""The OpenSSL a Windows cross build links (platforms/openssl.py): pinned source, one build, never half of one.

A fake OpenSSL tarball (a Configure script and a Makefile that make the two
libraries and a header in a second) is served from 127.0.0.1, so the download,
the sha256 pin, the build, the cache and every way it can go wrong run in
seconds. The real OpenSSL, cross-built and linked into llama-server.exe, is
checked by test_windows_real.py.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time

import pytest

from dfbuild.core.errors import BuildError, SourceError
from dfbuild.host.backends import Host
from dfbuild.host.platforms import openssl, windows

WINDOWS_ON_LINUX = Host("windows", "x64", "debian", "12", build_os="linux")
needs_make = pytest.mark.skipif(not (shutil.which("make") and shutil.which("perl")), reason="needs make and perl")

CONFIGURE = """#!/usr/bin/perl
# a fake OpenSSL Configure: records its arguments, writes the Makefile's config
open(my $f, '>', 'configured.txt') or die; print $f join("\\n", @ARGV), "\\n"; close($f);
exit($ENV{FAKE_CONFIGURE_FAILS} ? 1 : 0);
"""
MAKEFILE = """build_libs:
\t@if [ -n "$$FAKE_MAKE_SLEEPS" ]; then sleep $$FAKE_MAKE_SLEEPS; fi
\t@if [ -n "$$FAKE_MAKE_FAILS" ]; then echo "cc: error: oh no"; exit 2; fi
\tprintf 'ssl' > libssl.a
\tprintf 'crypto' > libcrypto.a
\tprintf '/* built on: %s */' "$$SOURCE_DATE_EPOCH" > include/openssl/ssl.h
"""


def fake_tarball(version: str = "9.9.9") -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        def add(name: str, data: bytes, mode: int = 0o644, mtime: int = 1_700_000_000):
            info = tarfile.TarInfo(f"openssl-{version}/{name}")
            info.size, info.mode, info.mtime = len(data), mode, mtime
            tar.addfile(info, io.BytesIO(data))
        add("Configure", CONFIGURE.encode(), 0o755)
        add("Makefile", MAKEFILE.encode())
        add("VERSION.dat", b"MAJOR=9\n", mtime=1_234_567_890)
        add("LICENSE.txt", b"Apache License 2.0 (fake)\n")
        add("include/openssl/opensslv.h", b"/* fake */\n")
    return raw.getvalue()


@pytest.fixture
def served(tmp_path):
    """A directory served over http://127.0.0.1:PORT/ (the tarball's pool), and the requests it saw."""
    root = tmp_path / "pool"
    root.mkdir()
    seen = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            seen.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFBUILD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def spec_for(data: bytes, urls: list[str]) -> dict:
    return {"library": "OpenSSL", "version": "9.9.9", "sha256": hashlib.sha256(data).hexdigest(), "urls": urls,
            "configure_target": "mingw64", "configure_options": ["no-shared", "no-autoload-config"],
            "license": "LICENSE.txt", "license_name": "OpenSSL-LICENSE.txt"}


TOOLS = {"CC": "x86_64-w64-mingw32-gcc-posix", "AR": "x86_64-w64-mingw32-ar"}


# --- the table ------------------------------------------------------------------------------------


def test_the_windows_target_pins_openssl_and_keeps_its_windows_paths_safe():
    spec = windows.entry(WINDOWS_ON_LINUX)["tls"]
    assert len(spec["sha256"]) == 64 and "deb.debian.org" in spec["urls"][0]  # the one reachable here, first
    assert spec["version"].startswith("3.")  # llama.cpp's FindOpenSSL check wants OpenSSL 3
    command = openssl.configure_command(spec, windows._openssl_tools(WINDOWS_ON_LINUX))
    assert command[:3] == ["perl", "Configure", "mingw64"]
    # static, no openssl.cnf read on its own, OPENSSLDIR from HKLM's registry (not C:\usr\local\ssl)
    for option in ("no-shared", "no-autoload-config", "-DOSSL_WINCTX=dfbuild", "no-asm"):
        assert option in command
    assert "CC=x86_64-w64-mingw32-gcc-posix" in command and "AR=x86_64-w64-mingw32-ar" in command
    # llama.cpp's own TLS path, on, for the cross build
    assert windows.entry(WINDOWS_ON_LINUX)["flags"]["LLAMA_OPENSSL"] == "ON"


def test_the_toolchain_file_makes_the_built_openssl_a_find_root(tmp_path):
    built = tmp_path / "cache" / "tls" / "openssl-3.5.7-mingw64-abc"
    text = windows.toolchain_text(WINDOWS_ON_LINUX, tmp_path / "rules.cmake", None, [built])
    assert f"set(CMAKE_FIND_ROOT_PATH /usr/x86_64-w64-mingw32 {built.as_posix()})" in text
    plain = windows.toolchain_text(WINDOWS_ON_LINUX, tmp_path / "rules.cmake", None)
    assert "set(CMAKE_FIND_ROOT_PATH /usr/x86_64-w64-mingw32)" in plain


def test_the_build_key_changes_with_what_changes_the_bytes():
    spec = spec_for(b"x", ["http://x"])
    key = openssl.build_key(spec, "gcc 12")
    assert openssl.build_key(spec, "gcc 13") != key
    assert openssl.build_key({**spec, "configure_options": ["no-shared"]}, "gcc 12") != key
    assert openssl.build_key({**spec, "sha256": "0" * 64}, "gcc 12") != key
    assert openssl.build_key({**spec, "urls": ["http://elsewhere"]}, "gcc 12") == key  # where from: same bytes


# --- download, build, cache -------------------------------------------------------------------------


@needs_make
def test_built_once_from_the_pinned_tarball_then_reused(served, cache):
    root, url, seen = served
    data = fake_tarball()
    (root / "openssl_9.9.9.orig.tar.gz").write_bytes(data)
    spec = spec_for(data, [f"{url}/gone.tar.gz", f"{url}/openssl_9.9.9.orig.tar.gz"])  # the first URL 404s
    prefix = openssl.ensure(spec, TOOLS, "gcc 12")
    assert openssl.is_built(prefix) and prefix.parent == cache / "tls"
    assert (prefix / "lib" / "libssl.a").read_text() == "ssl"
    assert (prefix / "LICENSE.txt").read_text().startswith("Apache")
    # the tarball's own date, not the clock: a rebuild gives the same bytes
    assert "built on: 1234567890" in (prefix / "include" / "openssl" / "ssl.h").read_text()
    assert not list((cache / "tls").glob("*.partial"))
    requests = len(seen)
    assert openssl.ensure(spec, TOOLS, "gcc 12") == prefix and len(seen) == requests  # no download, no build


@needs_make
def test_a_tarball_that_is_not_the_pinned_one_is_never_kept_or_built(served, cache):
    root, url, _ = served
    (root / "openssl_9.9.9.orig.tar.gz").write_bytes(fake_tarball())
    spec = spec_for(b"what the pin says", [f"{url}/openssl_9.9.9.orig.tar.gz"])
    with pytest.raises(SourceError) as caught:
        openssl.ensure(spec, TOOLS, "gcc 12")
    assert "does not match the sha256" in caught.value.message
    assert str(openssl.tarball_path(spec)) in caught.value.hint  # where a user may put the right file
    assert not openssl.tarball_path(spec).exists()
    assert not [p for p in (cache / "tls").glob("openssl-9.9.9-*") if p.is_dir()]  # no build, no partial


@needs_make
def test_a_corrupt_cached_tarball_is_downloaded_again(served, cache):
    root, url, seen = served
    data = fake_tarball()
    (root / "openssl_9.9.9.orig.tar.gz").write_bytes(data)
    spec = spec_for(data, [f"{url}/openssl_9.9.9.orig.tar.gz"])
    openssl.tarball_path(spec).parent.mkdir(parents=True)
    openssl.tarball_path(spec).write_bytes(data[:100])  # a truncated copy
    assert openssl.is_built(openssl.ensure(spec, TOOLS, "gcc 12"))
    assert seen == ["/openssl_9.9.9.orig.tar.gz"]


@needs_make
def test_an_unreachable_source_says_where_to_put_the_tarball(cache):
    spec = spec_for(b"x", ["http://127.0.0.1:9/openssl.tar.gz"])  # discard port: nothing listens
    with pytest.raises(SourceError) as caught:
        openssl.ensure(spec, TOOLS, "gcc 12")
    assert "cannot get OpenSSL 9.9.9's source" in caught.value.message
    assert str(openssl.tarball_path(spec)) in caught.value.hint and spec["sha256"] in caught.value.hint


@needs_make
@pytest.mark.parametrize("failing", ["FAKE_CONFIGURE_FAILS", "FAKE_MAKE_FAILS"])
def test_a_failed_build_leaves_no_build_and_names_its_log(served, cache, monkeypatch, failing):
    root, url, _ = served
    data = fake_tarball()
    (root / "openssl_9.9.9.orig.tar.gz").write_bytes(data)
    spec = spec_for(data, [f"{url}/openssl_9.9.9.orig.tar.gz"])
    monkeypatch.setenv(failing, "1")
    with pytest.raises(BuildError) as caught:
        openssl.ensure(spec, TOOLS, "gcc 12")
    log = openssl.prefix_path(spec, "gcc 12").with_name(openssl.prefix_path(spec, "gcc 12").name + ".log")
    assert str(log) in caught.value.hint and log.is_file()
    assert not openssl.prefix_path(spec, "gcc 12").exists()
    assert not list((cache / "tls").glob("*.partial"))
    monkeypatch.delenv(failing)
    assert openssl.is_built(openssl.ensure(spec, TOOLS, "gcc 12"))  # the next run builds it


@needs_make
def test_a_build_killed_midway_is_never_linked_and_the_next_run_builds_it(served, cache, tmp_path):
    root, url, _ = served
    data = fake_tarball()
    (root / "openssl_9.9.9.orig.tar.gz").write_bytes(data)
    spec = spec_for(data, [f"{url}/openssl_9.9.9.orig.tar.gz"])
    code = ("import sys, json; from dfbuild.host.platforms import openssl; "
            "openssl.ensure(json.loads(sys.argv[1]), {}, 'gcc 12')")
    import json

    child = subprocess.Popen([sys.executable, "-c", code, json.dumps(spec)], start_new_session=True,
                             env={**os.environ, "FAKE_MAKE_SLEEPS": "30"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prefix = openssl.prefix_path(spec, "gcc 12")
    partial = prefix.with_name(prefix.name + ".partial")
    deadline = time.monotonic() + 30
    while not (partial / "src").is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # in make now
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    assert not openssl.is_built(prefix)
    assert openssl.is_built(openssl.ensure(spec, TOOLS, "gcc 12"))
    assert not partial.exists()


def test_license_files_name_the_openssl_license_once_it_is_built(cache, monkeypatch):
    spec = windows.entry(WINDOWS_ON_LINUX)["tls"]
    monkeypatch.setattr(windows, "_toolchain_id", lambda host: "gcc 12")
    assert "OpenSSL-LICENSE.txt" not in windows.license_files(WINDOWS_ON_LINUX)
    prefix = openssl.prefix_path(spec, "gcc 12")
    (prefix / "include" / "openssl").mkdir(parents=True)
    (prefix / "include" / "openssl" / "ssl.h").write_text("")
    (prefix / "lib").mkdir()
    for name in ("libssl.a", "libcrypto.a", "LICENSE.txt", openssl.BUILT_NAME):
        (prefix / ("lib" if name.endswith(".a") else ".") / name).write_text("x")
    assert windows.license_files(WINDOWS_ON_LINUX)["OpenSSL-LICENSE.txt"] == prefix / "LICENSE.txt"
