#!/usr/bin/env bash
# The project's one test command (README): installs what the tests need, then runs them all.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."

export DFBUILD_TEST_CACHE="${DFBUILD_TEST_CACHE:-$HOME/.cache/dfbuild-tests}"
mkdir -p "$DFBUILD_TEST_CACHE"

# Debian packages the integration tests use (CI machines run Debian 12 or 13):
# libssl-dev (llama-server's TLS for -hf), qemu-user (runs the archived server as
# an old CPU), python3-venv (the second venv below), and the Windows cross
# toolchain with Wine (`--os windows`: `dfbuild doctor --backend cpu --os windows`
# names the same packages; targets.toml holds them; make and perl build the
# OpenSSL the Windows build links), and the Linux arm64 cross compilers (`--arch arm64`,
# docs/arm64.md: 56 MB to download, 207 MB on disk; qemu-user runs what they build), and the
# container image tools (`dfbuild image`, docs/images.md: umoci, skopeo, mmdebstrap; podman loads).
debian_packages=(ccache git libssl-dev qemu-user python3-venv
                 g++-mingw-w64-x86-64-posix gcc-mingw-w64-x86-64-posix wine wine64 make perl
                 g++-aarch64-linux-gnu gcc-aarch64-linux-gnu
                 umoci skopeo mmdebstrap podman)
# The browser test (opt-in, release runs: DFBUILD_BROWSER_TESTS=1) drives Debian's Chromium with
# Playwright's Python package (the `browser` extra); .ci/run does not opt in, so CI installs neither.
extras="test"
if [ "${DFBUILD_BROWSER_TESTS:-}" = 1 ]; then
    debian_packages+=(chromium)
    extras="test,browser"
fi
missing=()
for pkg in "${debian_packages[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing Debian packages: ${missing[*]} (Debian $(cat /etc/debian_version 2>/dev/null || echo '?'))"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "missing Debian packages: ${missing[*]}; install them with: sudo apt-get install ${missing[*]}" >&2
    fi
fi

# A venv the tests own, so the package and its test dependencies install the same way everywhere.
venv="$DFBUILD_TEST_CACHE/venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[$extras]"

# The linter and the type checker on every module of src/, with the rules pyproject.toml keeps
# ([tool.ruff], [tool.mypy]); either failing fails the run, after the tests have run too.
set +e
"$venv/bin/ruff" check src
lint_rc=$?
"$venv/bin/mypy" --cache-dir "$DFBUILD_TEST_CACHE/mypy-cache"
types_rc=$?
"$venv/bin/python" -m pytest "$@"
rc=$?
set -e

# The machine's own Python, when older than the venv's (Debian 12: 3.11.2, which
# lacks tarfile's extraction filter): the import and release-unit tests again.
system_python=/usr/bin/python3
if [ "$rc" = 0 ] && [ -x "$system_python" ] && [ "$#" = 0 ] &&
   "$system_python" -c 'import sys; sys.exit(0 if sys.version_info[:3] < tuple(map(int, sys.argv[1].split("."))) else 1)' \
       "$("$venv/bin/python" -c 'import platform; print(platform.python_version())')"; then
    sys_venv="$DFBUILD_TEST_CACHE/venv-system-python"
    echo "also running the import and release-unit tests under $("$system_python" --version) ($system_python)"
    [ -x "$sys_venv/bin/python" ] || "$system_python" -m venv "$sys_venv"
    "$sys_venv/bin/python" -m pip install --quiet --disable-pip-version-check -e '.[test]'
    set +e
    "$sys_venv/bin/python" -m pytest -p no:cacheprovider tests/test_import.py tests/test_release_unit.py \
        -m "not integration and not slow and not vulkan"
    rc=$?
    set -e
fi
if [ "$rc" = 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
fi
if [ "$rc" = 0 ] && { [ "$lint_rc" != 0 ] || [ "$types_rc" != 0 ]; }; then
    echo "ruff (exit $lint_rc) or mypy (exit $types_rc) found problems in src/ (see above)" >&2
    exit 1
fi
exit "$rc"
