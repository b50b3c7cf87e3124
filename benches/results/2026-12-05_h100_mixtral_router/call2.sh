b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
for round in 1 2; do for c in shipped g2; do
  if [ $c = g2 ]; then export MOEFORGE_TUNING_CACHE=$PWD/.device/mx_g2.json; else export MOEFORGE_TUNING_CACHE=/tmp/none.json; fi
  moeforge bench dsl-examples/mixtral_8x7b.moe --tokens 1,2,16 --seed 7 --out /tmp/b > $OUT/${c}_$round.txt 2>&1; echo "== $c $round"; grep -E "^\| +[0-9]+ \|" $OUT/${c}_$round.txt | cut -d'|' -f2,4,12,15
done; done
