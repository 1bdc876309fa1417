"""Reading llama.cpp's own release workflow from a tree (upstream_release.py), and the build using it.

The workflows here are written for these tests: they have the shape of llama.cpp's
.github/workflows/release.yml (a CMAKE_ARGS env, jobs with a matrix, a configure
step with id cmake_build, a pack step), not its text.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dfbuild.build import tree as build
from dfbuild.build import upstream_release
from dfbuild.host.backends import Host

WORKFLOW = """\
name: Release
on:
  workflow_dispatch:
env:
  CMAKE_ARGS: "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DGGML_RPC=ON"
jobs:
  ubuntu-cpu:
    strategy:
      matrix:
        include:
          - build: 'x64'
            os: ubuntu-22.04
          - build: 'arm64'
            os: ubuntu-24.04-arm
    runs-on: ${{ matrix.os }}
    steps:
      - name: Build
        id: cmake_build
        run: |
          cmake -B build \\
            -DCMAKE_INSTALL_RPATH='$ORIGIN' \\
            -DGGML_NATIVE=OFF \\
            -DLLAMA_FATAL_WARNINGS=ON \\
            -DHF_UI_VERSION=${{ needs.get-version.outputs.ui_version }} \\
            ${{ env.CMAKE_ARGS }}
          cmake --build build --config Release -j $(nproc)
      - name: Pack
        run: |
          cp LICENSE ./build/bin/
          tar -czvf llama-${{ steps.tag.outputs.name }}-bin-ubuntu-${{ matrix.build }}.tar.gz --transform "s,^\\.,llama-${{ steps.tag.outputs.name }}," -C ./build/bin .
  ubuntu-cuda:
    strategy:
      matrix:
        include:
          - build: 'x64'
            label: '12.8'
            defines: '-DGGML_CUDA_CCCL_VERSION=v3.4.3'
          - build: 'x64'
            label: '13.4'
            defines: ''
    steps:
      - name: Build
        id: cmake_build
        run: |
          cmake -B build -DGGML_CUDA=ON -DGGML_CUDA_NCCL=OFF ${{ env.CMAKE_ARGS }} ${{ matrix.defines }}
      - name: Pack CUDA runtime
        run: |
          major="${{ matrix.label }}"
          cp -L /usr/local/cuda/lib64/libcudart.so.${major} ./cudart/
          cp -L /usr/local/cuda/lib64/libcublas.so.${major} ./cudart/
          tar -czvf cudart-llama-${{ steps.tag.outputs.name }}-bin-ubuntu-cuda-${{ matrix.label }}-${{ matrix.build }}.tar.gz -C ./cudart .
  windows-cpu:
    strategy:
      matrix:
        include:
          - arch: 'x64'
          - arch: 'arm64'
    steps:
      - name: Build
        shell: cmd
        run: |
          cmake -S . -B build -G "Ninja Multi-Config" ^
            -DGGML_CPU_ALL_VARIANTS=${{ matrix.arch == 'x64' && 'ON' || 'OFF' }} ^
            -DGGML_OPENMP_FETCH=ON ^
            ${{ env.CMAKE_ARGS }}
      - name: Pack
        run: |
          Copy-Item "C:\\Program Files\\Redist\\${{ matrix.arch }}\\" .\\build\\bin\\Release\\
          7z a -snl llama-bin-win-cpu-${{ matrix.arch }}.zip .\\build\\bin\\Release\\*
  windows:
    strategy:
      matrix:
        include:
          - backend: 'vulkan'
            arch: 'x64'
            defines: '-DGGML_VULKAN=ON'
          - backend: 'opencl'
            arch: 'arm64'
            defines: '-DGGML_OPENCL=ON'
    steps:
      - name: OpenCL headers
        if: ${{ matrix.backend == 'opencl' && matrix.arch == 'arm64' }}
        run: |
          cmake -B build -DBUILD_TESTING=OFF
      - name: Build
        run: |
          cmake -S . -B build ${{ matrix.defines }} -DGGML_CPU=OFF
  ubuntu-sycl:
    strategy:
      matrix:
        include:
          - build: fp16
            fp16: OFF
    steps:
      - run: cmake -B build -DGGML_SYCL_F16=${{ matrix.fp16 }}
"""


def tree_with(tmp_path: Path, text: str | bytes | None) -> Path:
    tree = tmp_path / "tree"
    tree.mkdir(exist_ok=True)
    if text is not None:
        path = tree / upstream_release.WORKFLOW
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return tree


@pytest.fixture
def tree(tmp_path) -> Path:
    return tree_with(tmp_path, WORKFLOW)


def test_a_linux_job_gives_its_options_and_the_workflow_wide_ones(tree):
    reading = upstream_release.read(tree, "linux", "cpu", "x64")
    assert reading.found and reading.job == "ubuntu-cpu" and reading.matrix["build"] == "x64"
    taken, not_taken = upstream_release.cmake_options(reading)
    assert taken == {"CMAKE_INSTALL_RPATH": "$ORIGIN", "GGML_NATIVE": "OFF", "LLAMA_BUILD_EXAMPLES": "OFF",
                     "LLAMA_BUILD_TOOLS": "ON", "GGML_RPC": "ON"}
    # refused by the table with its reason; an expression it cannot evaluate is named, never guessed
    assert not_taken["LLAMA_FATAL_WARNINGS"].startswith("ON: warnings as errors")
    assert not_taken["HF_UI_VERSION"].startswith("${{ needs.get-version.outputs.ui_version }}: ")
    assert reading.layout == "top" and reading.root == "llama-<tag>"


def test_the_cuda_entry_is_picked_by_the_toolkit_and_its_fetching_option_is_not_taken(tree):
    exact = upstream_release.read(tree, "linux", "cuda", "x64", "12.8.1")
    assert exact.matrix["label"] == "12.8" and exact.note is None
    taken, not_taken = upstream_release.cmake_options(exact)
    assert taken["GGML_CUDA"] == "ON" and taken["GGML_RPC"] == "ON" and "GGML_CUDA_CCCL_VERSION" not in taken
    assert "network" in not_taken["GGML_CUDA_CCCL_VERSION"]
    assert exact.cudart == ["libcudart", "libcublas"]
    assert exact.cudart_name == "cudart-llama-<tag>-bin-ubuntu-cuda-12.8-x64.tar.gz"
    major = upstream_release.read(tree, "linux", "cuda", "x64", "13.0")  # the lent H200's nvcc
    assert major.matrix["label"] == "13.4" and "no label 13.0 entry" in major.note
    assert not upstream_release.read(tree, "linux", "cuda", "x64", "11.8").found


def test_windows_conditionals_and_the_flat_zip(tree):
    x64 = upstream_release.read(tree, "windows", "cpu", "x64")
    taken, not_taken = upstream_release.cmake_options(x64)
    assert taken["GGML_CPU_ALL_VARIANTS"] == "ON" and "GGML_OPENMP_FETCH" in not_taken
    assert x64.layout == "flat"  # the Copy-Item line's trailing backslash is no line continuation
    arm = upstream_release.read(tree, "windows", "cpu", "arm64")
    assert upstream_release.cmake_options(arm)[0]["GGML_CPU_ALL_VARIANTS"] == "OFF"


def test_a_step_whose_if_is_false_for_the_entry_is_not_read(tree):
    # (no step of this job has id cmake_build: the first configure line of a step that runs counts)
    vulkan = upstream_release.read(tree, "windows", "vulkan", "x64")
    taken, not_taken = upstream_release.cmake_options(vulkan)
    assert taken == {"GGML_VULKAN": "ON"} and "GGML_CPU" in not_taken
    assert "BUILD_TESTING" not in taken


def test_yaml_12_booleans_keep_off_as_text(tree):
    data, _ = upstream_release.load(tree)
    assert upstream_release.matrix_entries(data["jobs"]["ubuntu-sycl"]) == [{"build": "fp16", "fp16": "OFF"}]


def test_matrix_lists_and_include_expand_as_github_does():
    job = {"strategy": {"matrix": {"cuda": ["12.4", "13.3"], "include": [{"cuda": "12.4", "x": "1"},
                                                                         {"other": "y"}]}}}
    assert upstream_release.matrix_entries(job) == [{"cuda": "12.4", "x": "1", "other": "y"},
                                                    {"cuda": "13.3", "other": "y"}]
    only = {"strategy": {"matrix": {"include": [{"arch": "x64"}, {"arch": "arm64"}]}}}
    assert upstream_release.matrix_entries(only) == [{"arch": "x64"}, {"arch": "arm64"}]


@pytest.mark.parametrize("text, why", [
    (None, "the tree has no .github/workflows/release.yml"),
    ("jobs: [unclosed\n", "is not valid YAML (line"),
    ("- just\n- a list\n", "has no jobs"),
    ("jobs:\n  other: {}\n", "has no ubuntu-cpu job: llama.cpp released no linux cpu archive at this base"),
    ("jobs:\n  ubuntu-cpu:\n    steps:\n      - run: echo hi\n", "has no `cmake -B` configure step"),
    ("jobs:\n  ubuntu-cpu:\n    strategy: {matrix: {include: [{build: arm64}]}}\n", "has no matrix entry build=x64"),
    (b"jobs: !!python/object/apply:os.system ['true']\n", "is not valid YAML"),
    ("a: &a [*a]\n" + "b: " + "[" * 20000 + "\n", "nests too deeply"),
])
def test_a_file_that_lacks_what_is_needed_falls_back_with_a_note(tmp_path, text, why):
    reading = upstream_release.read(tree_with(tmp_path, text), "linux", "cpu", "x64")
    assert not reading.found and why in reading.note
    assert reading.summary() == {"file": ".github/workflows/release.yml", "found": False, "note": reading.note}
    assert upstream_release.cmake_options(reading) == ({}, {})


@pytest.mark.parametrize("text", [
    "jobs:\n  ubuntu-cpu:\n    steps: 5\n",
    "jobs:\n  ubuntu-cpu:\n    strategy: {matrix: {include: 5}}\n    steps:\n      - run: cmake -B build -DX=1\n",
    "jobs:\n  ubuntu-cpu:\n    strategy: {matrix: [1, 2]}\n    steps:\n      - run: cmake -B build -DX=1\n",
    "jobs:\n  ubuntu-cpu:\n    env: 5\n    steps:\n      - run: 5\n      - {if: 5, run: cmake -B build -DX=1}\n",
    "env: [1]\njobs:\n  7: {}\n  ubuntu-cpu:\n    steps:\n      - run: cmake -B build ${{ env.CMAKE_ARGS }}\n",
    b"\xff\xfe\x00 not text",
])
def test_odd_shapes_never_raise(tmp_path, text):
    reading = upstream_release.read(tree_with(tmp_path, text), "linux", "cpu", "x64")
    assert reading.found in (True, False) and (reading.found or reading.note)
    upstream_release.cmake_options(reading)


def test_an_oversized_file_is_not_read(tmp_path):
    reading = upstream_release.read(tree_with(tmp_path, "#" * (upstream_release.MAX_BYTES + 1)), "linux", "cpu", "x64")
    assert not reading.found and "larger than" in reading.note


def test_the_build_takes_the_options_over_the_table_and_records_where_they_came_from(tree):
    taken, record = build.upstream_options(tree, "cpu", Host("linux", "x64"), {"toolchain": []})
    assert record["job"] == "ubuntu-cpu" and record["taken"] == taken and "LLAMA_FATAL_WARNINGS" in record["not_taken"]
    flags = build.build_flags("cpu", Host("linux", "x64"), commit="c", number=1, entry={"toolchain": []},
                              upstream={**taken, "GGML_NATIVE": "ON"})
    assert flags["GGML_RPC"] == "ON" and flags["GGML_NATIVE"] == "ON"  # the workflow's word over the table's


def test_a_cross_build_keeps_its_own_flags_over_the_workflow(tree):
    windows = Host("windows", "x64", build_os="linux")
    taken, _ = build.upstream_options(tree, "cpu", windows, {"toolchain": []})
    flags = build.build_flags("cpu", windows, commit="c", number=1, entry={"toolchain": []},
                              upstream={**taken, "LLAMA_BUILD_BORINGSSL": "ON"}, use_ccache=False)
    assert flags["LLAMA_BUILD_BORINGSSL"] == "OFF" and flags["LLAMA_OPENSSL"] == "ON"  # targets.toml's TLS


def test_cuda_architectures_stay_the_users(tree):
    flags = build.build_flags("cuda", Host("linux", "x64"), commit="c", number=1, entry={"toolchain": []},
                              cuda_arch="90", upstream={"CMAKE_CUDA_ARCHITECTURES": "75-virtual"})
    assert flags["CMAKE_CUDA_ARCHITECTURES"] == "90"


def test_without_a_workflow_the_table_gives_every_tool_and_rpc(tmp_path):
    taken, record = build.upstream_options(tree_with(tmp_path, None), "cpu", Host("linux", "x64"), {"toolchain": []})
    assert taken == {} and record["note"].endswith("the flags are backends.toml's")
    flags = build.build_flags("cpu", Host("linux", "x64"), commit="c", number=1, entry={"toolchain": []})
    assert (flags["GGML_RPC"], flags["LLAMA_BUILD_TOOLS"], flags["LLAMA_BUILD_SERVER"],
            flags["LLAMA_BUILD_EXAMPLES"]) == ("ON", "ON", "ON", "OFF")
