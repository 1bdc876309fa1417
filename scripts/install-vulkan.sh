#!/usr/bin/env bash
# Install what the Vulkan backend needs to build and run here: glslc, the Vulkan
# loader and headers, the SPIR-V headers (ggml-vulkan's CMake asks for their
# config package), and Mesa's lavapipe (a Vulkan driver that runs on the CPU).
# Idempotent: when everything is in place it changes nothing and needs no root.
#
#   Debian 13+ : apt-get install glslc libvulkan-dev spirv-headers mesa-vulkan-drivers
#   Debian 12  : apt-get install glslc libvulkan-dev spirv-headers
#                apt-get install -t bookworm-backports mesa-vulkan-drivers
#                  (Mesa 25: Debian 12's own lavapipe, Mesa 22.3, crashes; the
#                   backports apt source is added, on this machine's mirror, if missing)
#                dfbuild doctor --fetch-vulkan-headers
#                  (Debian 13's headers into dfbuild's cache: Debian 12's 1.3.239
#                   lacks VK_EXT_layer_settings; build with --vulkan-include-dir)
#
# Environment: DFBUILD (the dfbuild command, default `dfbuild` on PATH) and
# DFBUILD_CACHE_DIR (where the headers go, dfbuild's usual cache otherwise).
# Prints the Vulkan include dir to pass to `dfbuild build` as its last line
# ("system" when the system headers are new enough).
set -euo pipefail

die() { echo "install-vulkan: $*" >&2; exit 1; }
say() { echo "install-vulkan: $*" >&2; }

[ -r /etc/os-release ] || die "no /etc/os-release: this script knows Debian 12 and 13 only"
# shellcheck source=/dev/null
. /etc/os-release
[ "${ID:-}" = debian ] || die "this script knows Debian 12 and 13 only (found ${PRETTY_NAME:-unknown}); install glslc, Vulkan headers >= 1.3.272, the Vulkan loader and Mesa >= 25's lavapipe yourself"
debian_major="${VERSION_ID:-99}"   # testing/sid have no VERSION_ID: treat them as new

packages=(glslc libvulkan-dev spirv-headers mesa-vulkan-drivers)
needs_backports=false
if [ "$debian_major" -lt 12 ]; then
    die "Debian $debian_major is too old; use Debian 12 or newer"
elif [ "$debian_major" = 12 ]; then
    needs_backports=true
fi

installed_version() {  # empty when not installed
    { dpkg-query -W -f='${Status} ${Version}' "$1" 2>/dev/null || true; } | sed -n 's/^install ok installed //p'
}

# What is missing (a package absent, or Debian 12's crashing Mesa where 25 is needed)?
missing=()
for pkg in "${packages[@]}"; do
    version="$(installed_version "$pkg")"
    if [ -z "$version" ]; then
        missing+=("$pkg")
    elif [ "$pkg" = mesa-vulkan-drivers ] && $needs_backports && dpkg --compare-versions "$version" lt 25; then
        missing+=("$pkg")
    fi
done

if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "missing ${missing[*]}: run this script as root (sudo bash $0)"
    export DEBIAN_FRONTEND=noninteractive
    if $needs_backports; then
        if ! grep -qs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; then
            # The mirror this machine already uses for Debian (deb822 first, then one-line sources).
            mirror="$(sed -n 's|^URIs:[[:space:]]*\([^[:space:]]*/debian\)/\{0,1\}\([[:space:]].*\)\{0,1\}$|\1|p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)"
            [ -n "$mirror" ] || mirror="$(sed -n 's|^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\{0,1\}\([^[:space:]]*/debian\)/\{0,1\}[[:space:]].*|\2|p' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -n1)"
            mirror="${mirror:-http://deb.debian.org/debian}"
            say "adding /etc/apt/sources.list.d/bookworm-backports.sources ($mirror)"
            cat > /etc/apt/sources.list.d/bookworm-backports.sources <<EOF
Types: deb
URIs: $mirror
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
        fi
        say "apt-get install glslc libvulkan-dev spirv-headers, and mesa-vulkan-drivers from bookworm-backports"
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends glslc libvulkan-dev spirv-headers >/dev/null
        apt-get install -y -qq --no-install-recommends -t bookworm-backports mesa-vulkan-drivers >/dev/null
    else
        say "apt-get install ${packages[*]}"
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
    fi
fi

for pkg in "${packages[@]}"; do
    say "$pkg $(installed_version "$pkg")"
done

if $needs_backports; then
    dfbuild_cmd="${DFBUILD:-dfbuild}"
    command -v "$dfbuild_cmd" >/dev/null || die "'$dfbuild_cmd' not found: install dfbuild first, or set DFBUILD=/path/to/dfbuild"
    include_dir="$("$dfbuild_cmd" doctor --fetch-vulkan-headers)"
    say "Debian 13's Vulkan headers: $include_dir (dfbuild build --backend vulkan --vulkan-include-dir $include_dir)"
    echo "$include_dir"
else
    echo system
fi
