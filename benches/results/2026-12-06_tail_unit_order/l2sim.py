# A model of the DRAM reads of a cluster-paired grouped GEMM (the wgmma-ws engine's units):
# an LRU cache of L2's size over chunks of A rows (64 rows x 4 k-tiles) and weight panels
# (a panel's rows x 4 k-tiles); each cluster walks its units' k-chunks one step per time
# unit (a unit of the odd last m-tile `tail_cost` steps, every step jittered by
# +-jitter/2), units dealt by index (unit c, c + clusters, ...) or claimed in order from a
# counter (`dynamic`). Unit orders: "old" (694b2c6: an expert's odd m-tile units after all
# its pairs) and "new" (after the pairs of their two n-tiles). Session 56's question: why
# the new order read more, and what claiming would do (2026-12-06_tail_unit_order.md).
import heapq, random, sys
from collections import OrderedDict

def units_of(m, N, order):
    """(cta0 tile, cta1 tile, shared) per unit; tile = (m, n) or None."""
    pairs = m // 2; out = []
    if order == "old":
        for l in range(pairs * N):
            n = l // pairs; p = l % pairs
            out.append(((2*p, n), (2*p+1, n), True))
        if m % 2:
            for q in range((N + 1) // 2):
                out.append(((m-1, 2*q), (m-1, 2*q+1) if 2*q+1 < N else None, False))
    else:
        bu = 2*pairs + m % 2
        total = pairs*N + (m % 2)*((N+1)//2)
        for l in range(total):
            fn = 2*(l//bu); w = l % bu; pu = min(2, N-fn)*pairs
            if w < pu:
                n = fn + w//pairs; p = w % pairs
                out.append(((2*p, n), (2*p+1, n), True))
            else:
                out.append(((m-1, fn), (m-1, fn+1) if fn+1 < N else None, False))
    return out

def run(rows, BM, N, K_TILES, a_chunk, b_chunk, l2_bytes, clusters, order, tail_cost, jitter, seed=1, a_boxes=True, dynamic=False):
    random.seed(seed)
    units = []
    row0 = 0
    for e, r in enumerate(rows):
        m = (r + BM - 1) // BM
        for c0, c1, sh in units_of(m, N, order):
            units.append((e, row0, r, c0, c1, sh))
        row0 += r
    cap = l2_bytes // 1  # bytes
    lru = OrderedDict(); used = 0; dram = 0
    def touch(key, size):
        nonlocal used, dram
        if key in lru:
            lru.move_to_end(key); return
        dram += size; lru[key] = size; used += size
        while used > cap:
            _, s = lru.popitem(last=False); used -= s
    # event queue: (time, cluster, unit index, k)
    ev = [(0.0, c, c, 0) for c in range(min(clusters, len(units)))]
    heapq.heapify(ev)
    next_unit = [min(clusters, len(units))]
    while ev:
        t, c, u, k = heapq.heappop(ev)
        e, r0, r, c0, c1, sh = units[u]
        full = True
        for tile in (c0, c1):
            if tile is None: continue
            mt, n = tile
            trow = r0 + mt*BM
            if a_boxes or (mt+1)*BM <= r:
                # A box: 128 rows from trow, by 16-row granules of the global sorted rows
                for g in range(trow // 64, (trow + BM + 63) // 64):
                    touch(("a", g, k), a_chunk // (BM // 64))
            else:
                for g in range(trow // 64, (r0 + r + 63) // 64):
                    touch(("a", g, k), a_chunk // (BM // 64))
            if not sh:
                touch(("b", e, n, k), b_chunk)
        if sh:
            touch(("b", e, c0[1], k), b_chunk)
        step = 1.0 if sh else tail_cost
        step *= 1 + jitter * (random.random() - 0.5)
        if k + 1 < K_TILES:
            heapq.heappush(ev, (t + step, c, u, k + 1))
        elif dynamic:
            if next_unit[0] < len(units):
                heapq.heappush(ev, (t + step, c, next_unit[0], 0)); next_unit[0] += 1
        elif u + clusters < len(units):
            heapq.heappush(ev, (t + step, c, u + clusters, 0))
    return dram
