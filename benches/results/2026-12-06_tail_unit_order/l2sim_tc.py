# Usage: python3 l2sim_tc.py (from this folder): static deal by block index, old and new
# tail order, an odd tail unit costing 0.5-2x a pair unit; DeepSeek-V3 GEMM1 at 16384 tokens.
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
for cap in (25, 50):
  for tc in (0.5, 0.8, 1.3, 2.0):
    for order in ("old", "new"):
        d = run(rows, 128, 16, 28, 64*1024, 128*1024, cap*2**20, 66, order, tc, 0.05)
        print(f"L2 {cap} MB tail_cost {tc} {order}: DRAM {d/1e9:.1f} GB", flush=True)
