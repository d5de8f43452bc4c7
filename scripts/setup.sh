#!/usr/bin/env bash
# Set up memsave_nb for development: a .venv with a CPU torch and the package (editable, with
# the test extra). Idempotent: a second run only checks and returns in a few seconds.
#
#   bash scripts/setup.sh            # venv + torch==2.13.0 + pip install -e ".[test]"
#   bash scripts/setup.sh --browser  # also apt-get install chromium and gcc where missing (tests)
#
# Env: PYTHON (interpreter for the venv, default python3), MEMSAVE_FORCE_SETUP=1 (reinstall even
# when nothing changed).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
TORCH_PIN="torch==2.13.0"

browser=0
for arg in "$@"; do
    case "$arg" in
        --browser) browser=1 ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

say() { echo "[setup] $*"; }

LOG=$(mktemp "${TMPDIR:-/tmp}/memsave_setup.XXXXXX.log")
# Run a command quietly; on failure show what it said and stop.
quiet() {
    if ! "$@" >>"$LOG" 2>&1; then
        echo "[setup] FAILED: $*" >&2
        echo "[setup] last lines of $LOG:" >&2
        tail -n 40 "$LOG" >&2
        exit 1
    fi
}

# 1. The virtual environment (recreated if it is there but broken).
if [[ ! -x "$PY" ]] || ! "$PY" -c 'import sys' >/dev/null 2>&1; then
    base_python=${PYTHON:-python3}
    command -v "$base_python" >/dev/null || { echo "[setup] $base_python not found" >&2; exit 1; }
    "$base_python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || { echo "[setup] memsave_nb needs Python >= 3.10 ($base_python is older)" >&2; exit 1; }
    say "creating .venv with $("$base_python" --version)"
    "$base_python" -c 'import ensurepip' >/dev/null 2>&1 \
        || { echo "[setup] $base_python cannot create venvs (no ensurepip); on Debian: apt-get install -y python3-venv" >&2; exit 1; }
    rm -rf "$VENV"
    quiet "$base_python" -m venv "$VENV"
fi
PIP=("$PY" -m pip --disable-pip-version-check --no-input)

# 2. torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
if ! "$PY" -c 'import torch, sys; sys.exit(not torch.__version__.startswith("2.13.0"))' >/dev/null 2>&1; then
    say "installing $TORCH_PIN (CPU build)"
    quiet "${PIP[@]}" install -q --progress-bar off "$TORCH_PIN"
fi

# 3. The package and its test extra. Skipped when pyproject.toml is unchanged since the last
#    successful install and the package still imports from this checkout.
stamp="$VENV/.memsave_setup_stamp"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $ROOT"
installed_here() {
    "$PY" -I - "$ROOT" <<'PY' >/dev/null 2>&1
import importlib.util, os, sys
spec = importlib.util.find_spec("memsave_nb")
sys.exit(not (spec and spec.submodule_search_locations
              and os.path.realpath(list(spec.submodule_search_locations)[0]).startswith(os.path.realpath(sys.argv[1]))))
PY
}
if [[ "${MEMSAVE_FORCE_SETUP:-0}" == 1 || ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]] || ! installed_here; then
    say "installing memsave_nb (editable) with the test extra"
    quiet "${PIP[@]}" install -q --progress-bar off -e ".[test]"
    # A kernelspec inside the venv, so Jupyter started from it runs kernels with this Python.
    quiet "$PY" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (memsave_nb)"
    echo "$want" >"$stamp"
fi
"$PY" -c 'import torch, sys; sys.exit(not torch.__version__.startswith("2.13.0"))' \
    || { echo "[setup] torch is not 2.13.0 after install: $("$PY" -c 'import torch; print(torch.__version__)')" >&2; exit 1; }

# 4. Optionally the system packages the tests need: a headless browser for tests/browser
#    (Debian's chromium) and a C compiler for the layers' fused mask kernels
#    (memsave_nb/layers/_native.c; without one the layers run their numpy path, and
#    tests/layers/test_native.py fails in CI rather than skip). We are root here and in CI.
if [[ $browser == 1 ]]; then
    packages=()
    [[ -x /usr/bin/chromium ]] || packages+=(chromium)
    command -v cc >/dev/null || command -v gcc >/dev/null || packages+=(gcc libc6-dev)
    if (( ${#packages[@]} )); then
        sudo=()
        [[ $(id -u) != 0 ]] && command -v sudo >/dev/null && sudo=(sudo)
        say "installing ${packages[*]} (apt-get)"
        export DEBIAN_FRONTEND=noninteractive
        quiet "${sudo[@]}" apt-get -o Acquire::Retries=3 update -qq
        quiet "${sudo[@]}" apt-get -o Acquire::Retries=3 install -y -qq "${packages[@]}"
    fi
    [[ -x /usr/bin/chromium ]] || { echo "[setup] chromium install did not produce /usr/bin/chromium" >&2; exit 1; }
fi

rm -f "$LOG"
say "ready: $("$PY" -c 'import torch; print("torch", torch.__version__)'), venv $VENV"
