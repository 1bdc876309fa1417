"""`python -m dfbuild`, the same as the `dfbuild` command."""

from ._entry import main

main()
