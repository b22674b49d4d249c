#!/usr/bin/env bash
# bench.gpu on a GPU machine that has PyTorch but no network and no edgeflux install (the device tool's
# machines: torch, numpy, matplotlib, rich, psutil, pytest; no pydantic, no dataset). Three steps:
#
#   bash bench/gpu_run.sh prepare [EARLIER]   here: pydantic's wheels (for that machine's Python) and the
#                                             Fashion-MNIST files into .gpu/, the folder to carry; EARLIER: the
#                                             folder a cut-off run's files came back to, or "committed" for the
#                                             *_cuda results in bench/results (their complete parts are kept)
#   bash bench/gpu_run.sh run [LIMIT_S]       there, from the repository root: install the wheels, run
#                                             `python3 -m bench.gpu` inside LIMIT_S seconds (default 540),
#                                             pack every result into $OUT/gpu_results.tar.gz (+ the log)
#   bash bench/gpu_run.sh unpack DIR          here: the *_cuda results from DIR into bench/results/
#
# With the device tool: prepare, then run `bash bench/gpu_run.sh run 540` with carry [".gpu"], then unpack
# the folder its files came back to.
set -euo pipefail
cd "$(dirname "$0")/.."
GPU=.gpu
PY_VERSION=3.12    # the GPU machine's Python (its wheels must match)
WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5"

prepare() {
    mkdir -p "$GPU/wheels" "$GPU/data/FashionMNIST/raw"
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$GPU/wheels" $WHEELS
    local src=/usr/share/datasets/fashion-mnist
    [ -f "$src/train-images-idx3-ubyte.gz" ] || { echo "Fashion-MNIST missing: apt-get install -y dataset-fashion-mnist"; exit 1; }
    cp "$src"/*-ubyte.gz "$GPU/data/FashionMNIST/raw/"
    rm -f "$GPU/previous.tar.gz"
    if [ "${1:-}" = committed ]; then
        (cd bench/results && tar -czf "../../$GPU/previous.tar.gz" ./*_cuda.* ./*_cuda_seeds)
    elif [ -n "${1:-}" ]; then
        cp "$1/gpu_results.tar.gz" "$GPU/previous.tar.gz"
    fi
    [ -f "$GPU/previous.tar.gz" ] && echo "kept the parts of ${1} (there, a complete part is skipped)"
    du -sh "$GPU"
}

run() {
    local limit=${1:-540} out=${OUT:-$GPU/out} work=$GPU/results
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$GPU"/wheels/*.whl
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 EDGEFLUX_DATA_DIR=$PWD/$GPU/data
    mkdir -p "$work" "$out"
    [ -f "$GPU/previous.tar.gz" ] && tar -xzf "$GPU/previous.tar.gz" -C "$work"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    # The deadline leaves time for the longest unit (a NeuroFlux seed) to end before the limit kills it;
    # a short rerun (finishing a cut-off run's last parts) keeps less.
    local rc=0 margin=150
    [ "$limit" -lt 400 ] && margin=40
    timeout --signal=INT --kill-after=20 "$limit" \
        python3 -m bench.gpu --out "$work" --deadline $((limit - margin)) 2>&1 | tee "$work/gpu_log.txt" || rc=$?
    tar -czf "$out/gpu_results.tar.gz" -C "$work" --exclude=gpu_log.txt .
    cp "$work/gpu_log.txt" "$out/"
    [ -f "$work/gpu_cuda.md" ] && cp "$work/gpu_cuda.md" "$out/"
    return "$rc"
}

unpack() {
    local from=${1:?usage: bench/gpu_run.sh unpack DIR}
    tar -xzf "$from/gpu_results.tar.gz" -C bench/results
    # every run's log, in the order unpacked: a run that finished a cut-off one adds to it
    { echo "### $(grep -m1 -o '20[0-9-]*T[0-9:]*' "$from/gpu_cuda.md" 2>/dev/null || date -u +%FT%T) run"
      cat "$from/gpu_log.txt"; } >> bench/results/gpu_cuda_log.txt
    ls -d bench/results/*_cuda*
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    run) shift; run "$@" ;;
    unpack) shift; unpack "$@" ;;
    *) sed -n '2,16p' "$0"; exit 2 ;;
esac
