"""dfbuild's version, as installed (a module of its own, so about.py never imports the package itself)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dfbuild")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"
