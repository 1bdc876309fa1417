"""dfbuild: fixed, tested, releasable llama.cpp DFlash binaries."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dfbuild")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"
