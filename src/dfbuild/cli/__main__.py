"""`python -m dfbuild.cli`, as before the split (the tests and scripts/cuda-smoke.sh run it)."""

from dfbuild.cli import main

main()
