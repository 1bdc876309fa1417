"""The build request (issue 38): one typed, frozen record of what a command asked, made once by the CLI,
printed before the work, handed to every stage, and recorded in the manifest."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_release_unit import fake_wheel, inputs, stub_stages  # noqa: F401  (fixtures)

from dfbuild.build import tree as build
from dfbuild.build.request import BuildRequest, SmokeOptions
from dfbuild.cli import main
from dfbuild.core.errors import UnsupportedBackendError
from dfbuild.host import backends
from dfbuild.release import pipeline as release
from dfbuild.release import prove

posix_only = pytest.mark.skipif(sys.platform.startswith("win"), reason="the release fixtures are POSIX")


def test_the_cli_options_make_one_typed_request():
    request = BuildRequest.from_options(
        backend="CPU", targets=("llama-server,llama-cli", "llama-cli"), cpu_variants="x64, haswell",
        cmake_args=["-DGGML_NATIVE=OFF"], jobs=3, no_ccache=True, no_ui=True, start_timeout=30.0,
        smoke_table="full", allow_cpu_fallback=True)
    assert request == BuildRequest(
        backend="cpu", targets=("llama-server", "llama-cli"), cpu_variants=("x64", "haswell"),
        extra_cmake_args=("-DGGML_NATIVE=OFF",), jobs=3, use_ccache=False, web_ui=False,
        smoke=SmokeOptions(table="full", start_timeout=30.0, allow_cpu_fallback=True))
    # what nobody asked for: the defaults, this machine (recorded as None: native dirs and records as before)
    plain = BuildRequest.from_options()
    assert plain == BuildRequest() and plain.targets == ("llama-server",) and plain.cpu_variants is None
    assert (plain.os, plain.arch, plain.cross_host) == (None, None, None)
    assert plain.host == backends.current_host()
    assert BuildRequest.from_options(cpu_variants="").cpu_variants is None  # nothing named: all


def test_an_unknown_backend_or_target_is_refused_when_the_request_is_made():
    with pytest.raises(UnsupportedBackendError):
        BuildRequest.from_options(backend="opencl")
    with pytest.raises(UnsupportedBackendError):
        BuildRequest.from_options(target_arch="riscv64")


@pytest.mark.skipif(backends.current_host().os != "linux", reason="the mingw-w64 cross target is Linux's")
def test_a_cross_target_is_recorded_by_os_and_arch():
    request = BuildRequest.from_options(target_os="windows")
    assert (request.os, request.arch) == ("windows", backends.current_host().arch)
    assert request.host.cross and request.cross_host == request.host
    assert build.dir_label(request.backend, request.cross_host) == "cpu-windows"


def test_a_request_is_frozen_and_hashable():
    request = BuildRequest(cpu_variants=["x64"], targets=["llama-server"], extra_cmake_args=["-DA=1"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.jobs = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.smoke.table = "full"  # type: ignore[misc]
    # lists given are kept as tuples: nothing in a request can change after it is made
    assert (request.cpu_variants, request.targets, request.extra_cmake_args) == (("x64",), ("llama-server",),
                                                                                ("-DA=1",))
    assert hash(request) == hash(BuildRequest(cpu_variants="x64", extra_cmake_args=("-DA=1",)))
    assert request.with_targets(["all"]).targets == ("all",) and request.targets == ("llama-server",)


def test_the_manifest_section_is_plain_data_and_reads_back_the_same_request(tmp_path):
    request = BuildRequest(backend="vulkan", targets=("all",), cpu_variants=("x64",), cuda_arch="86;90",
                           gpu_targets="gfx1201", vulkan_include_dir=tmp_path / "include",
                           extra_cmake_args=("-DX=1",), jobs=2, reconfigure=True, use_ccache=False,
                           smoke=SmokeOptions(table="software", start_timeout=900.0, allow_cpu_fallback=True))
    section = request.to_dict()
    assert json.loads(json.dumps(section)) == section  # JSON and nothing else
    assert section["vulkan_include_dir"] == str(tmp_path / "include") and section["targets"] == ["all"]
    assert section["smoke"] == {"table": "software", "start_timeout": 900.0, "allow_cpu_fallback": True}
    assert BuildRequest.from_dict(json.loads(json.dumps(section))) == request
    # a newer dfbuild's key is left out, not a crash
    assert BuildRequest.from_dict({**section, "webui": False, "smoke": {**section["smoke"], "x": 1}}) == request
    assert BuildRequest.from_dict(BuildRequest().to_dict()) == BuildRequest()


def test_the_summary_names_every_option_in_plain_words(monkeypatch):
    for name in ("DFBUILD_SMOKE_TABLE", "DFBUILD_START_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    here = backends.current_host()
    text = BuildRequest(cpu_variants=("x64", "haswell"), jobs=2).summary()
    assert text.splitlines() == [
        "build request:",
        "  backend:       cpu",
        f"  os, arch:      {here.os} {here.arch} (this machine)",
        "  targets:       llama-server",
        "  cpu variants:  x64, haswell",
        "  cmake args:    none",
        "  jobs:          2",
        "  ccache:        " + ("yes" if shutil.which("ccache") else "no: not installed (`dfbuild doctor` says how)"),
        "  web ui:        embedded",
        "  smoke table:   auto",
        "  start timeout: the backend table's",
        "  cpu fallback:  no",
    ]
    cuda = BuildRequest("cuda", cuda_arch="90", extra_cmake_args=("-DA=1", "-DB=2"), fresh=True).summary(smoke=False)
    assert "  cuda arch:    90" in cuda.splitlines() and "  cmake args:   -DA=1 -DB=2" in cuda.splitlines()
    assert "  build dir:    start over (--fresh)" in cuda.splitlines() and "smoke" not in cuda
    assert "[" not in text  # no markup: what a log shows is what was printed
    monkeypatch.setenv("DFBUILD_SMOKE_TABLE", "software")  # where the default comes from, said
    assert "  smoke table:   software ($DFBUILD_SMOKE_TABLE)" in BuildRequest().summary().splitlines()


def test_the_unpatched_copy_is_keyed_as_before_and_not_by_how_the_build_runs():
    """A work dir's kept unpatched binaries stay valid: the key is the one the build_options dicts made
    (the commit, backend, targets, the options that were set, DFBUILD_CMAKE_ARGS)."""
    known = backends.host_cpu_variants(backends.current_host())
    if not known:
        pytest.skip("no runtime-dispatched CPU variants on this host")
    commit = "c" * 40
    wanted = ",".join(reversed(known[:2]))
    before = prove._digest([commit, "cpu", ["llama-server"],
                            {"cpu_variants": build.parse_cpu_variants(wanted, backends.current_host()),
                             "web_ui": True}, build.env_cmake_args()])
    assert prove._request_key(commit, BuildRequest(cpu_variants=wanted)) == before
    assert prove._request_key(commit, BuildRequest(cpu_variants=wanted, jobs=8, use_ccache=False,
                                                   smoke=SmokeOptions(table="full"))) == before
    assert prove._request_key(commit, BuildRequest(cpu_variants=wanted, extra_cmake_args=("-DA=1",))) != before


@posix_only
def test_release_prints_the_request_first_hands_it_to_the_build_and_records_it(inputs, stub_stages,  # noqa: F811
                                                                                monkeypatch, tmp_path):
    """On main the options went as a dict, nothing was printed, and the manifest had no request."""
    seen = []
    real_build = build.build_tree

    def build_tree(tree, request, build_dir=None):
        seen.append(request)
        return real_build(tree, request, build_dir)  # stub_stages' stand-in

    monkeypatch.setattr(build, "build_tree", build_tree)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["release", "--base", "pydist-0.94.0", "--backend", "cpu", "--out", str(out),
                                       "--work", str(tmp_path / "work"), "--target", "llama-cli", "-j", "3",
                                       "--cmake-arg", "-DGGML_NATIVE=OFF", "--smoke-table", "full", "--json"])
    assert result.exit_code == 0, result.output
    # before the work: the summary, then the first step
    assert result.stderr.index("build request:\n  backend:") < result.stderr.index("==> checkout")
    assert "  targets:       llama-cli\n" in result.stderr and "  smoke table:   full\n" in result.stderr
    # the stage got the typed request (llama-server added: the smoke and the wheel need it)
    asked = BuildRequest(targets=("llama-server", "llama-cli"), extra_cmake_args=("-DGGML_NATIVE=OFF",), jobs=3,
                         smoke=SmokeOptions(table="full"))
    assert seen == [asked]
    full = json.loads(result.stdout)
    assert full["request"] == asked.to_dict()
    assert json.loads((out / release.MANIFEST_NAME).read_text())["request"] == asked.to_dict()
    tree = Path(inputs["tree"])
    from dfbuild.core import manifest

    assert manifest.load(manifest.tree_manifest_path(tree))["request"] == asked.to_dict()
    # the archive's own manifest is unchanged: what was built, not how this run was asked (-j is no part of
    # it, and two runs of one build give byte-identical archives)
    with tarfile.open(out / full["release"]["archive"]) as tar:
        embedded = json.load(tar.extractfile(f"{full['release']['root']}/manifest.json"))
    assert set(embedded) == {"source", "series", "build", "smoke", "release"}
    from dfbuild.verify import release_dir as verify

    report = verify.verify(out)
    assert report["ok"], report["problems"]


def test_quiet_leaves_the_summary_out(monkeypatch, capsys):
    from dfbuild.cli.common import say_request
    from dfbuild.core import ui

    say_request(BuildRequest())
    assert capsys.readouterr().err.startswith("build request:\n")
    monkeypatch.setattr(ui, "verbosity", -1)
    say_request(BuildRequest())
    assert capsys.readouterr().err == ""


# --- the request carries what its names mean (issue 45) ------------------------------------------


def _count_lookups(monkeypatch) -> list[str]:
    """Every lookup of a backend by its name (backends.get, resolve handed a str) from here on."""
    seen: list[str] = []
    get, resolve = backends.get, backends.resolve

    def counting_get(name):
        seen.append(f"get({name})")
        return get(name)

    def counting_resolve(backend):
        if isinstance(backend, str):
            seen.append(f"resolve({backend})")
        return resolve(backend)

    monkeypatch.setattr(backends, "get", counting_get)
    monkeypatch.setattr(backends, "resolve", counting_resolve)
    return seen


def test_the_request_resolves_its_backend_and_host_once_and_keeps_them_across_replace(monkeypatch):
    request = BuildRequest("cpu")
    assert request.spec.name == "cpu" and request.host == backends.current_host()
    seen = _count_lookups(monkeypatch)
    wider = request.with_targets(["all"])
    assert wider.spec is request.spec and wider.host is request.host
    assert wider.spec.name == "cpu" and seen == [], "replace() looked the backend up again"
    assert "spec" not in request.to_dict() and "host" not in request.to_dict()
    assert BuildRequest.from_dict(request.to_dict()) == request


@pytest.mark.skipif(sys.platform == "win32", reason="the fake tree's build runs a POSIX shell")
def test_a_build_looks_no_backend_up_by_its_name(tmp_path, monkeypatch):
    """build_tree reads the request's record: on cefdafb it looked 'cpu' up 4 times (request.spec, build_flags,
    upstream_options, doctor), bench/request_walk.py counts the same walk."""
    from test_build import make_fake_tree

    tree = make_fake_tree(tmp_path / "fake")
    request = BuildRequest("cpu", use_ccache=False)
    seen = _count_lookups(monkeypatch)
    build.build_tree(tree, request)
    assert seen == []
