#!/usr/bin/env bash
cd "$(dirname "$0")/.."
for r in 1 2; do
python3 .device/loadprobe.py plain .device/syn/tiny.cubin .device/syn/many.cubin .device/syn/init.cubin .device/syn/big2000.cubin .device/syn/big8000.cubin .device/syn/big20000.cubin | tr '|' '\n'
done
