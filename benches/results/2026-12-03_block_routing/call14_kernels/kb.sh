#!/usr/bin/env bash
for t in 1 64; do
  for b in base new; do
    bin=.device/bin/moeforge; [ $b = base ] && bin=.device/moeforge-base
    echo "== deepseek_v3 T=$t $b"
    MOEFORGE_BINARY=$bin timeout 200 bash benches/kernel_breakdown.sh deepseek_v3 $t 2>&1 | tail -8
  done
done
