#!/usr/bin/env bash
# The long, opt-in fuzz run of the strict readers and the state readers (issue 39; docs/verify.md).
# The test suite runs the same Hypothesis properties derandomized and bounded (about a minute);
# this draws N fresh examples per property at random (default 5000), with every tar and zip mutant
# also unpacked by GNU tar and unzip. Usage: bash scripts/fuzz.sh [N] [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
examples="${1:-5000}"
shift || true
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] && python=.venv/bin/python
DFBUILD_FUZZ_EXAMPLES="$examples" exec "$python" -m pytest tests/test_fuzz_readers.py -p no:cacheprovider \
    --hypothesis-show-statistics -q "$@"
