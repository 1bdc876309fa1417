"""`python -m dfbuild`, the same as the `dfbuild` command."""

from dfbuild._entry import main

main()
