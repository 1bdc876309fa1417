"""Windows from Linux, for real: b11434 cross-built with mingw-w64, proved and released, run under Wine.

The same tree as the other real tests (realtrees.REAL_BASE, in the "any head"
work dir CACHE/work/b11434), built for Windows beside the Linux build
(build-cpu-windows, the x64 CPU variant, the tests' -O1 flags), the way a user
runs it (subprocesses of the CLI):

- `dfbuild prove --base b11434 --os windows --cpu-variants x64`: unpatched,
  llama-server.exe under Wine fails with the upstream symptom; patched, every
  scenario passes: fixed (exit 0). The patched build compiles only the patch and
  the stamps, as on Linux;
- `dfbuild release ... --os windows` in that work dir: the zip users expect,
  whose smoke is the proof's (same binaries); SHA256SUMS and manifest.json;
- `dfbuild verify OUT` passes and runs the unpacked llama-server.exe --version
  under Wine, which names the patched commit and exits;
- a release from a second work folder gives the same bytes.

Skipped, saying why, without the cross toolchain or Wine (scripts/test.sh
installs them on Debian).
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from realtrees import CACHE, REAL_BASE

from dfbuild import smoke
from dfbuild.host import pe

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the cross build for Windows is checked on Linux"),
    pytest.mark.skipif(shutil.which("x86_64-w64-mingw32-g++-posix") is None or shutil.which("wine") is None,
                       reason="needs the mingw-w64 cross compilers and Wine: "
                              "apt-get install g++-mingw-w64-x86-64-posix gcc-mingw-w64-x86-64-posix wine wine64"),
]

WORK = CACHE / "work" / REAL_BASE
VARIANTS = "x64"   # the baseline: any x86-64 CPU (and Wine's)


def dfbuild(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dfbuild.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd)


@pytest.fixture(scope="module")
def proof():
    started = time.monotonic()
    result = dfbuild("prove", "--base", REAL_BASE, "--os", "windows", "--cpu-variants", VARIANTS,
                     "--work", WORK, "-j", "2", "--json")
    assert result.stdout, result.stderr[-4000:]
    return {"exit": result.returncode, "proof": json.loads(result.stdout), "stderr": result.stderr,
            "wall_s": time.monotonic() - started}


def release_into(out: Path, work: Path) -> dict:
    result = dfbuild("release", "--base", REAL_BASE, "--backend", "cpu", "--os", "windows",
                     "--cpu-variants", VARIANTS, "--out", out, "--work", work, "-j", "2",
                     "--target", "llama-server", "--json")  # llama-server only, for CI's time (docs/ci.md)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def released(proof, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("windows-release")
    full = release_into(tmp / "out", WORK)
    return {"tmp": tmp, "out": tmp / "out", "manifest": full}


def test_prove_under_wine_unpatched_fails_with_the_symptom_and_patched_passes(proof):
    p = proof["proof"]
    assert proof["exit"] == 0, proof["stderr"][-3000:]
    assert p["outcome"] == "fixed" and p["os"] == "windows"
    assert not p["unpatched"]["passed"] and p["unpatched"]["upstream_symptom"], p["unpatched"]
    assert p["patched"]["passed"] and p["patched"]["runs"] == p["unpatched"]["runs"]
    builds = p["builds"]
    assert builds["unpatched"]["build_dir"] == builds["patched"]["build_dir"] == str(WORK / "build-cpu-windows")
    compiled = {Path(o).name for o in builds["patched"]["compiled_objects"]}
    assert compiled <= {"speculative.cpp.obj", "build-info.cpp.obj", "ggml.c.obj"}, compiled


def test_the_zip_users_expect(released):
    rel = released["manifest"]["release"]
    name = rel["archive"]
    assert name.startswith(f"llama-{REAL_BASE}-dflash-") and name.endswith("-bin-win-cpu-x64.zip")
    assert sorted(p.name for p in released["out"].iterdir() if not p.name.startswith(".")) == sorted(
        [name, "SHA256SUMS", "manifest.json"])
    with zipfile.ZipFile(released["out"] / name) as zf:  # flat, as llama.cpp's Windows zips: no folder
        names = {n for n in zf.namelist() if not n.endswith("/")}
        data = {n: zf.read(n) for n in names}
    for needed in ("llama-server.exe", "ggml-cpu-x64.dll", "ggml-base.dll", "ggml.dll",
                   "llama.dll", "libwinpthread-1.dll", "libgomp-1.dll", "libgcc_s_seh-1.dll",
                   "LICENSE", "manifest.json"):
        assert needed in names, sorted(names)
    assert any(n.startswith("licenses/") for n in names) and any(n.startswith("patches/") for n in names)
    # every import resolves inside the zip or to Windows itself; no libgcc symbol re-exported by our DLLs
    shipped = {Path(n).name for n in names}
    for member, content in data.items():
        if pe.is_pe(content):
            info = pe.read(content)
            assert info.machine == "x64"
            assert pe.unresolved_imports(info, shipped) == [], (member, info.imports)
    built = released["manifest"]["build"]
    assert built["cross"]["compat"] == ["THREAD_POWER_THROTTLING_STATE"] or built["cross"]["compat"] == []
    # TLS for -hf, linked in (as BoringSSL in llama.cpp's zip): no OpenSSL DLL, its license shipped
    assert built["tls"].startswith("OpenSSL 3."), built["tls"]
    assert "licenses/OpenSSL-LICENSE.txt" in names
    assert not any("ssl" in Path(n).name.lower() or "crypto" in Path(n).name.lower()
                   for n in names if n.endswith(".dll")), sorted(names)


def test_verify_passes_and_runs_the_exe_under_wine(released):
    result = dfbuild("verify", released["out"], "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert any("llama-server.exe --version names the patched commit" in n for n in report["checked"]), report


def test_the_unzipped_server_names_the_patched_commit_and_exits_under_wine(released, tmp_path):
    name = released["manifest"]["release"]["archive"]
    with zipfile.ZipFile(released["out"] / name) as zf:
        zf.extractall(tmp_path)
    exe = tmp_path / "llama-server.exe"  # a flat zip
    prefix, env = smoke.launcher_for(exe)
    started = time.monotonic()
    result = subprocess.run([*prefix, str(exe), "--version"], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, **env})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-2000:]
    assert released["manifest"]["series"]["head"][:8] in output, output[-2000:]
    assert time.monotonic() - started < 60, "llama-server.exe --version did not exit promptly under Wine"


@pytest.fixture
def tls_listener(tmp_path):
    """A TLS server on 127.0.0.1 with a self-signed certificate: what it saw of each connection."""
    import socket
    import ssl
    import threading

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command (makes the self-signed certificate)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    seen = []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                try:
                    first = conn.recv(1, socket.MSG_PEEK)
                    seen.append({"client_hello": first == b"\x16"})  # a TLS handshake record
                    with context.wrap_socket(conn, server_side=True) as tls:
                        tls.recv(1)
                    seen[-1]["handshake"] = "completed"
                except (ssl.SSLError, OSError) as exc:
                    if seen:
                        seen[-1]["handshake"] = str(exc)

    threading.Thread(target=serve, daemon=True).start()
    yield f"https://127.0.0.1:{listener.getsockname()[1]}", seen
    listener.close()


def test_the_unzipped_server_speaks_tls_for_hf_under_wine(released, tmp_path, tls_listener):
    """-hf against a TLS server with a certificate Windows does not trust: a TLS handshake and a refused
    certificate, as llama.cpp's own zip does; before dfbuild linked OpenSSL the answer was "HTTPS is not supported"."""
    endpoint, seen = tls_listener
    name = released["manifest"]["release"]["archive"]
    with zipfile.ZipFile(released["out"] / name) as zf:
        zf.extractall(tmp_path)
    exe = tmp_path / "llama-server.exe"  # a flat zip
    prefix, env = smoke.launcher_for(exe)
    result = subprocess.run([*prefix, str(exe), "-hf", "someone/model-GGUF", "--port", "0"],
                            capture_output=True, text=True, timeout=180,
                            env={**__import__("os").environ, **env, "MODEL_ENDPOINT": endpoint + "/",
                                 "HF_ENDPOINT": endpoint + "/", "LLAMA_CACHE": str(tmp_path / "cache")})
    output = result.stdout + result.stderr
    assert "HTTPS is not supported" not in output, output[-3000:]
    assert "SSL server verification failed" in output, output[-3000:]
    assert seen and seen[0]["client_hello"], seen  # it spoke TLS to 127.0.0.1, and nowhere else
    assert result.returncode != 0  # no model: the server exits


def test_the_built_openssl_trusts_what_windows_trusts_under_wine(released, tmp_path):
    """The Windows store loaded into the built OpenSSL as cpp-httplib loads it (tests/data/windows_root_store_probe.c):
    a public root the host trusts verifies, the self-signed test certificate does not. (The -hf test above can show
    only the refusal: Wine's root store is the host's, which a test must not change.)"""
    from dfbuild.host import platforms
    from dfbuild.host.platforms import windows

    public_root = Path("/etc/ssl/certs/ISRG_Root_X1.pem")
    if not public_root.is_file() or shutil.which("openssl") is None:
        pytest.skip("needs the host's ca-certificates (ISRG Root X1) and the openssl command")
    host = platforms.target_host("windows")
    prefix = windows.tls_prefix(host, build=False)
    assert prefix is not None, "the release built no OpenSSL"
    probe = tmp_path / "probe.exe"
    subprocess.run([windows.entry(host)["c_compiler"], "-O1", str(Path(__file__).parent / "data" /
                    "windows_root_store_probe.c"), f"-I{prefix / 'include'}", str(prefix / "lib" / "libssl.a"),
                    str(prefix / "lib" / "libcrypto.a"), "-lcrypt32", "-lws2_32", "-lgdi32", "-static", "-o",
                    str(probe)], check=True, capture_output=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / "k.pem"),
                    "-out", str(tmp_path / "self.pem"), "-days", "2", "-subj", "/CN=127.0.0.1"],
                   check=True, capture_output=True)
    shutil.copy(public_root, tmp_path / "root.pem")
    prefix_cmd, env = smoke.launcher_for(probe)
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**__import__("os").environ, **env})
    trusted = run([*prefix_cmd, str(probe), "root.pem"])
    untrusted = run([*prefix_cmd, str(probe), "self.pem"])
    assert trusted.returncode == 0 and "verify root.pem: 1" in trusted.stdout, trusted.stdout + trusted.stderr
    assert untrusted.returncode == 1 and "self-signed" in untrusted.stdout, untrusted.stdout + untrusted.stderr


def test_two_work_folders_give_the_same_zip(released, tmp_path):
    other = release_into(tmp_path / "out", tmp_path / "elsewhere" / "work")
    first = released["out"] / released["manifest"]["release"]["archive"]
    second = tmp_path / "out" / other["release"]["archive"]
    assert second.name == first.name
    if first.read_bytes() != second.read_bytes():
        with zipfile.ZipFile(first) as a, zipfile.ZipFile(second) as b:
            differ = sorted(n for n in set(a.namelist()) | set(b.namelist())
                            if n not in b.namelist() or n not in a.namelist() or a.read(n) != b.read(n))
        pytest.fail(f"the zip depends on the work folder: {differ}")
