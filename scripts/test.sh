#!/usr/bin/env bash
# Set everything up (venv, package, test extra, headless chromium) and run the whole test suite.
#
#   bash scripts/test.sh                 # everything, as CI does
#   bash scripts/test.sh --fast          # the fast lane: a few minutes, before every commit
#   bash scripts/test.sh -m "not browser" tests/test_x.py   # extra arguments go to pytest
#
# The fast lane runs the files listed in scripts/fast_lane.txt, without the browser, notebook,
# CUDA and slow tests, and needs no browser set-up (docs/development.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ "${1:-}" == "--fast" ]]; then
    shift
    bash scripts/setup.sh
    mapfile -t lane < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' scripts/fast_lane.txt)
    set -- -m "not slow and not browser and not notebooks and not cuda" "${lane[@]}" "$@"
else
    bash scripts/setup.sh --browser
fi
mkdir -p artifacts

rc=0
.venv/bin/python -m pytest -q "$@" || rc=$?
if [[ $rc == 5 ]]; then
    echo "[test] pytest collected no tests: that is a failure here" >&2
    exit 1
fi
exit "$rc"
