#!/bin/sh
# The real-GPU check: on a machine with an NVIDIA GPU, its driver and bubblewrap, probe the
# GPUs, register this machine as a node, run one job per GPU bound to its own device, and
# print `nvidia-smi -L` from inside each job. Exit 0 when every job saw exactly its own GPU,
# 2 when there is no NVIDIA GPU here, 1 otherwise. Needs only this checkout and a Python with
# the project installed (`pip install -e .`); PYTHON picks the interpreter. Under 5 minutes.
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import control.plane, agents.agent' 2>/dev/null; then
    echo "gpu-check: the project is not installed for $PYTHON (pip install -e .)" >&2
    exit 1
fi
if ! "$PYTHON" -c 'import pynvml' 2>/dev/null; then
    echo "gpu-check: nvidia-ml-py is not installed for $PYTHON (pip install -e .)" >&2
    exit 1
fi
exec timeout 300 "$PYTHON" -m local.gpucheck "$@"
