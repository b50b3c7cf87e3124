# Usage: python3 l2sim_dyn.py (from this folder): static deal against units claimed in order,
# uniform and balanced routing; DeepSeek-V3 GEMM1 at 16384 tokens.
import random, sys
sys.path.insert(0, '.')
from l2sim import run
random.seed(7)
def uniform_rows(T, E, K):
    counts = [0]*E
    for _ in range(T):
        for e in random.sample(range(E), K): counts[e] += 1
    return counts
rows = [16384] + uniform_rows(16384, 256, 8)
bal = [16384] + [512]*256
for name, rr in (("uniform", rows), ("balanced", bal)):
  for tc, jit in ((1.0, 0.05), (0.8, 0.05), (1.3, 0.05), (1.0, 0.3)):
    for order in ("old", "new"):
      for dyn in (False, True):
        d = run(rr, 128, 16, 28, 64*1024, 128*1024, 50*2**20, 66, order, tc, jit, dynamic=dyn)
        print(f"{name} tail_cost {tc} jitter {jit} {order} {'dynamic' if dyn else 'static'}: DRAM {d/1e9:.1f} GB", flush=True)
