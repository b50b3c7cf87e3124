b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
for round in 1 2; do
 for mode in off tuned; do
  for spec in "gpt_oss_120b 1,23,128,512" "mixtral_8x7b 65,129,256"; do
   set -- $spec
   if [ $mode = off ]; then env MOEFORGE_TUNING=off moeforge bench dsl-examples/$1.moe --tokens $2 --seed 7 --out /tmp/b > $OUT/${1}_${mode}_$round.txt 2>&1
   else env MOEFORGE_TUNING_CACHE=$PWD/.device/h100_tuning.json moeforge bench dsl-examples/$1.moe --tokens $2 --seed 7 --out /tmp/b > $OUT/${1}_${mode}_$round.txt 2>&1; fi
   echo "== $1 $mode round $round"; grep -E "^\| +[0-9]+ \|" $OUT/${1}_${mode}_$round.txt | cut -d'|' -f2-4
  done
 done
done
