# The regimes whose entries the self-routed tuning changed, benched with the shipped
# entries (an empty cache) and with the new ones, two rounds in turns. Columns: T, caller-
# routed us, self-routed us, on its routing us.
b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
new=${NEW:-$PWD/benches/results/2026-12-05_tune_self_routed/h100_tuning.json}
for round in 1 2; do
 for mode in shipped new; do
  for spec in ${SPECS:-"mixtral_8x7b 1,8,64,256" "deepseek_v3 1,23,512" "gpt_oss_120b 2049,5794,16384"}; do
   set -- $spec
   if [ $mode = new ]; then cache=$new; else cache=/tmp/none.json; fi
   MOEFORGE_TUNING_CACHE=$cache timeout 150 moeforge bench dsl-examples/$1.moe --tokens $2 --seed 7 --iterations ${ITER:-20} --out /tmp/b > $OUT/${1}_${mode}_$round.txt 2>&1 || echo "bench $1 failed ($?)"
   echo "== $1 $mode round $round"; grep -E "^\| +[0-9]+ \|" $OUT/${1}_${mode}_$round.txt | cut -d'|' -f2,4,12,15
  done
 done
done
