#!/usr/bin/env bash
# Three builds interleaved: 838b004 (base), 74bf6bb (route and combine in the GEMMs), this build (route in the GEMMs' blocks).
export MOEFORGE_CACHE_DIR=/tmp/mf-cache-ab3
out=${OUT:-/tmp}/ab3; mkdir -p $out
for round in 1 2; do
  order="base combine new"; [ $round = 2 ] && order="new combine base"
  for m in qwen3_30b_a3b gpt_oss_120b deepseek_v3 mixtral_8x7b; do
    for b in $order; do
      case $b in base) bin=.device/moeforge-base;; combine) bin=.device/moeforge-74bf6bb;; new) bin=.device/bin/moeforge;; esac
      f=$out/$b-$m-$round.txt
      timeout 200 $bin bench dsl-examples/$m.moe --tokens ${TOKENS:-1,2,4,16,64} --seed 7 --iterations 30 > $f 2>&1
      echo "$m $b r$round: $(grep -E '^\|\s+[0-9]' $f | awk -F'|' '{printf "%s=%s/%s/%s ", $2+0, $4+0, $12+0, $14+0}')"
    done
  done
done
