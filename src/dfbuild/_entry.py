"""The `dfbuild` command's entry point: Ctrl-C while Python still imports exits 130, quietly.

Importing click, rich and the stages takes a noticeable fraction of a second.
A Ctrl-C in that time would print a KeyboardInterrupt traceback (or click's
"Aborted!" with exit 1). Nothing has been done yet then, so the handler set
here exits 130 at once; cli.handle_errors replaces it with Python's own (a
KeyboardInterrupt that rolls back) while a command does its work, and puts it
back once the command's outcome is decided (its report, click's teardown).
"""

import os
import signal
import sys


def _interrupted_early(signum, frame):
    os.write(2, b"interrupted: stopped (Ctrl-C) with nothing left half done\n")
    os._exit(130)


def catch_early_interrupt() -> None:
    signal.signal(signal.SIGINT, _interrupted_early)


def main() -> None:
    catch_early_interrupt()
    from dfbuild.cli import main as cli_main

    try:
        cli_main(prog_name="dfbuild")
    finally:
        # after the command (click's own teardown, interpreter exit) a Ctrl-C or SIGTERM has nothing left to undo
        signal.signal(signal.SIGINT, _interrupted_early)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    main()
    sys.exit()
