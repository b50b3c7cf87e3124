b=$(cat .device/root); [ -e "$b" ] || { mkdir -p "$(dirname "$b")"; ln -s "$PWD" "$b"; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}; export PATH=$PWD/.device/bin:/usr/local/cuda/bin:$PATH
export MOEFORGE_CACHE_DIR=/tmp/jit
nvidia-smi --query-gpu=name --format=csv,noheader
for v in tall256 tall192; do
  for t in 1024 3000; do moeforge run .device/specs/mixtral_$v.moe --tokens $t --seed 7 --check 2>&1 | tail -2 | sed "s/^/$v $t: /"; done
done
for round in 1 2; do for r in balanced uniform; do for v in base tall256 tall192; do
  moeforge bench .device/specs/mixtral_$v.moe --tokens 1024,4096,16384 --routing $r --seed 7 --out /tmp/b > $OUT/${v}_${r}_$round.txt 2>&1
  echo "== $v $r $round"; grep -E "^\| +[0-9]+ \|" $OUT/${v}_${r}_$round.txt | cut -d'|' -f2,4,5,8
done; done; done
