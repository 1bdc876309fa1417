#!/usr/bin/env bash
# The project's one test command (README): installs what the tests need, then runs them all.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."

export DFBUILD_TEST_CACHE="${DFBUILD_TEST_CACHE:-$HOME/.cache/dfbuild-tests}"
mkdir -p "$DFBUILD_TEST_CACHE"

# Debian packages the integration tests use (CI machines run Debian 12 or 13).
debian_packages=(ccache git)
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
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e '.[test]'

set +e
"$venv/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
fi
exit "$rc"
