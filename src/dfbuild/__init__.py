"""dfbuild: fixed, tested, releasable llama.cpp DFlash binaries."""

import sys

if sys.argv and (sys.argv[0] == "-m"
                 or sys.argv[0].replace("\\", "/").rsplit("/", 1)[-1] in ("dfbuild", "dfbuild.exe")):
    # Run as the command (`python -m dfbuild` imports this package first, then runpy finds __main__; the
    # console script imports it too): Ctrl-C from here on exits 130 quietly, as _entry explains. Imported
    # as a library, dfbuild leaves the process's signal handlers alone. The C module _signal, not signal:
    # importing signal builds its enums (milliseconds), and a Ctrl-C in them was a traceback.
    import os as _os

    try:
        import _signal  # type: ignore[import-not-found]  # a C module without stubs
    except ImportError:  # pragma: no cover - every CPython has it
        import signal as _signal

    def _interrupted_early(signum, frame):
        _os.write(2, b"interrupted: stopped (Ctrl-C) with nothing left half done\n")
        _os._exit(130)

    _signal.signal(_signal.SIGINT, _interrupted_early)
    from dfbuild._entry import catch_early_interrupt

    catch_early_interrupt()

from dfbuild._version import __version__  # noqa: F401 - after the handler: it takes a while
