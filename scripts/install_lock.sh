#!/bin/sh
# Install one lock exactly as pinned: `install_lock.sh PIP LOCK`. Every pin carries sha256 hashes and is installed
# with --require-hashes --no-deps (the lock is the whole set; one PySpark distribution, not the Spark provider's
# pyspark-client too). With TORCH_INDEX set (e.g. https://download.pytorch.org/whl/cpu) torch comes from that index
# instead, pinned by version (its files are not on the public index the lock is checked against), and the CUDA
# libraries the public torch needs are left out. Used by the Makefile (the venv) and infra/image/Containerfile.
set -eu
pip=$1
lock=$2
if [ -z "${TORCH_INDEX:-}" ]; then
  exec "$pip" install -q --require-hashes --no-deps -r "$lock"
fi
torch=$(grep -oE '^torch==[^ ;]+' "$lock") || { echo "install_lock.sh: no torch pin in $lock" >&2; exit 2; }
rest=$(mktemp)
trap 'rm -f "$rest"' EXIT
awk '/^[^ #]/ {skip = ($0 ~ /^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z-]+)==/)} !skip' "$lock" > "$rest"
"$pip" install -q --require-hashes --no-deps -r "$rest"
"$pip" install -q --no-deps --index-url "$TORCH_INDEX" "$torch"
