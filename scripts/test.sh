#!/usr/bin/env bash
# Set everything up (venv, package, test extra, headless chromium) and run the whole test suite.
#
#   bash scripts/test.sh                 # everything, as CI does
#   bash scripts/test.sh -m "not browser" tests/test_x.py   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh --browser
mkdir -p artifacts

rc=0
.venv/bin/python -m pytest -q "$@" || rc=$?
if [[ $rc == 5 ]]; then
    echo "[test] pytest collected no tests: that is a failure here" >&2
    exit 1
fi
exit "$rc"
