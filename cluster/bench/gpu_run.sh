#!/usr/bin/env bash
# ralmspec gpu-check on an offline GPU host (written into the bundle by `make gpu-bundle`).
#
# The host needs Python 3.12 with torch, transformers and triton (a CUDA build of torch
# ships triton). The wheels next to this script (pydantic and its dependencies, for
# CPython 3.12 on manylinux x86-64) are unpacked into a temporary folder, without any
# package index, and put on PYTHONPATH with the checkout; nothing is installed into the
# host's Python. Arguments go to gpu-check, for example:
#     gpu-bundle/run.sh --quick --out gpu-check-out
set -euo pipefail
bundle="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$bundle/.." && pwd)"
py="${PYTHON:-python3}"
target="$(mktemp -d "${TMPDIR:-/tmp}/ralmspec-gpu-bundle.XXXXXX")"
trap 'rm -rf "$target"' EXIT
# a wheel is a zip of its installed files: unpacking needs no pip and no index
for whl in "$bundle"/wheels/*.whl; do
  "$py" -m zipfile -e "$whl" "$target"
done
cd "$root"
export PYTHONPATH="$root:$target${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$py" -m cluster.bench.gpu_check "$@"
