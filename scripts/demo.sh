#!/usr/bin/env bash
# Set everything up, then run the main job on the built-in demo workload:
# a per-layer memory report of one training step of the demo CNN, printed and written as a
# standalone HTML file (opens offline).
#
#   bash scripts/demo.sh                    # -> artifacts/report.html
#   bash scripts/demo.sh --model gpt        # extra arguments go to `memsave-nb report`
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/setup.sh
mkdir -p artifacts
# Defaults first; arguments given later win (argparse keeps the last value).
.venv/bin/memsave-nb report --model cnn --out artifacts/report.html "$@"
