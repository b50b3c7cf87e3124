#!/usr/bin/env bash
cd "$(dirname "$0")/.."
for r in 1 2; do
python3 .device/loadprobe.py plain $(ls .device/syn/*.cubin) | tr '|' '\n'
done
