#!/usr/bin/env bash
# moeforge tune on an empty JIT cache: a5ddb2f (whole-unit cache keys) against this build
# (per-kernel shares). Whole wall time per run, and tune's own last lines.
for m in qwen3_30b_a3b:1 mixtral_8x7b:1; do
  for b in a5ddb2f new; do
    bin=.device/bin/moeforge; [ $b = a5ddb2f ] && bin=.device/moeforge-a5ddb2f
    rm -rf /tmp/jc-$b-${m%:*} /tmp/tune-$b-${m%:*}.json
    start=$(date +%s.%N)
    MOEFORGE_CACHE_DIR=/tmp/jc-$b-${m%:*} timeout 240 $bin tune dsl-examples/${m%:*}.moe --tokens ${m#*:} --seed 7 --cache /tmp/tune-$b-${m%:*}.json > /tmp/tune-$b-${m%:*}.log 2>&1
    rc=$?; end=$(date +%s.%N)
    echo "${m%:*} $b: rc $rc, $(awk "BEGIN{printf \"%.1f\", $end - $start}") s; $(grep -ciE 'compil' /tmp/tune-$b-${m%:*}.log) compile lines; $(tail -2 /tmp/tune-$b-${m%:*}.log | tr '\n' ' ' | cut -c1-260)"
  done
done
