// ---------------------------------------------------------------------------------------
// Grouped GEMM over experts: the parts both engines share (tile schedule, row sources,
// stage loads, epilogue), then the mma.sync engine (m16n8k16, ldmatrix, cp.async ring).
//
// Tiles are (expert, n-tile, m-tile), numbered expert-major so that the tiles sharing one
// weight panel run close together and find it in L2. The grid is persistent: each block
// loops over tile ids. Rows past an expert's count are zero-filled on load and never
// stored.
//   GEMM_UP:   intermediate[row] = act(x[token(row)] · W1[e]ᵀ + b1[e])       (gather + activation)
//   GEMM_DOWN: slot[pair(row)]   = weight(pair) · (intermediate[row] · W2[e]ᵀ + b2[e])
// (on one GPU the shared slices are experts too, their rows every token, their weight 1).
// (the expert biases b1, b2 only where the config's BIAS says the layer has them).
//
// Every size comes from a per-GEMM config struct `G` written from the plan (see the regimes
// below); the static_asserts check that the layout the code uses adds up to the plan's.
// ---------------------------------------------------------------------------------------
enum GemmKind { GEMM_UP = 1, GEMM_DOWN = 2 };

// The single-GPU GEMMs: one group of rows per expert, no peers.
struct SingleGpu {
    enum : bool { EP = false };
    enum : int { EXPERTS_HERE = GEMM_EXPERTS, PHASES = 1, RANKS = 1 };
    enum : int { SLOTS = 1, CHUNK = 1, CHUNKS = 1, OWN_ROW_BASE = 0 };
    enum : int { PEER_BUFFER_COUNT = 0, PEER_COMBINE_SLOTS = 0, PEER_COMBINE_COUNTERS = 0 };
    enum : bool { RANK_PARTIALS = false };
};

// What a GEMM of the expert-parallel path needs beyond the single-GPU one (empty there).
// GEMM1 waits for the dispatch chunks its rows sit in; GEMM2 stores each row into its
// origin rank's combine slot and releases that rank's per-token counter.
struct EpContext {
    const u32* chunk_flags = nullptr;    // GEMM1: per source chunk, the epoch it arrived in
    const bf16_t* own_rows = nullptr;    // GEMM1: this rank's x, its own tokens' rows
    const float* row_weights = nullptr;  // GEMM2: routing weight of each GEMM row
    const u64* peers = nullptr;          // GEMM2: every rank's peer buffers
    const int* row_origins = nullptr;    // GEMM2: the rank each row came from
    int* error_word = nullptr;
    int rank = 0;
    u32 epoch = 0;
};

// Stream-K (single-GPU mma.sync GEMMs, a call whose last wave of whole tiles is short, see
// STREAM_K_MAX_LAST_WAVE): the buffers in which the blocks sharing a tile meet.
struct StreamKBuffers {
    float* partials = nullptr;  // [2 * gridDim.x][BM * B_ROWS]: per block, its first and its last partial tile
    u32* tiles_done = nullptr;  // [tiles]: per tile, the blocks done with their part (zero between calls)
};

// The call's routing as given, for the single-GPU mma.sync GEMMs, which route calls of at
// most BLOCK_ROUTING_MAX_PAIRS (token, k) pairs in their blocks where the runtime left out
// the route launch (`routes`, the same for both GEMMs of a call: the plan's regime says
// whether both can): each block then lays out the routing in its own shared memory
// (route_in_block) and reads the expert offsets and row table from there. GEMM1, the
// call's first kernel then, passes the error word: its block 0 clears it and reports ids
// out of range.
struct CallRouting {
    bool routes = false;
    const int* topk_ids = nullptr;
    int tokens = 0;
    int* error_word = nullptr;
};

// A routing table (expert offsets or row table) as a single-GPU mma.sync GEMM reads it:
// the route's, in global memory and unchanged while the GEMMs run (read through the
// read-only path), or the block's own in shared memory where it routes the call. The
// block decides once per call; every load then takes its own kind of instruction (one
// pointer that may be either made every load a generic one: DeepSeek-V3's GEMM2 was 0.5%
// slower at 64 tokens, Nsight Compute, one H200, 2026-12-03).
struct RoutingTable {
    const int* entries;
    bool in_block;
    __device__ __forceinline__ int operator[](int i) const { return in_block ? entries[i] : __ldg(entries + i); }
};

// Ints of the static tables a GEMM block routes a call in (none where MAX_PAIRS is 0): each
// expert's first row (GEMM_EXPERTS + 1), fill counts (GEMM_EXPERTS), and the row table
// (every pair, and every token once per shared slice).
template <int MAX_PAIRS>
__host__ __device__ constexpr int block_routing_ints() {
    return MAX_PAIRS == 0 ? 0 : 2 * GEMM_EXPERTS + 1 + MAX_PAIRS + MAX_PAIRS / TOP_K * SHARED_SLICES;
}

// A stream-K call's k-tiles, every tile's in tile order, dealt to the blocks in contiguous
// runs of nearly equal length. With fewer k-tiles than blocks only that many work, one
// k-tile each, so that no run is empty.
struct StreamKShare {
    int iterations, blocks;
    __device__ __forceinline__ StreamKShare(int k_tiles, int grid)
        : iterations(k_tiles), blocks(max(1, min(grid, k_tiles))) {}
    // The first k-tile of block b's run (which ends where block b + 1's starts).
    __device__ __forceinline__ int start(int b) const { return (int)((long long)b * iterations / blocks); }
    // The block whose run holds k-tile `it`: the last b with start(b) <= it.
    __device__ __forceinline__ int block_of(int it) const {
        return (int)(((long long)(it + 1) * blocks + iterations - 1) / iterations) - 1;
    }
};

// Checks every GEMM config against the layout the code below assumes.
template <class G>
__device__ __forceinline__ void assert_gemm_layout() {
    static_assert(G::ROW_BYTES == G::BK * (int)sizeof(bf16_t), "plan: a stage row is BK bf16");
    static_assert(G::ROW_BYTES == SMEM_ROW_BYTES || (G::PRODUCER_THREADS == 0 && G::ROW_BYTES == 2 * SMEM_ROW_BYTES),
                  "plan: 128-byte rows (wgmma's swizzle), or 256-byte rows on the mma.sync engine");
    static_assert(G::B_ROWS == (G::GATED ? 2 * G::BN : G::BN), "plan: B rows per tile");
    static_assert(G::A_BYTES == G::BM * G::ROW_BYTES, "plan: A bytes per stage");
    static_assert(G::STAGE_BYTES == (G::BM + G::B_ROWS) * G::ROW_BYTES, "plan: stage bytes");
    static_assert(G::ROW_SOURCE_OFFSET == G::STAGES * G::STAGE_BYTES, "plan: row table after the ring");
    static_assert(G::BARRIER_OFFSET == G::ROW_SOURCE_OFFSET + G::BM * (int)sizeof(int), "plan: barriers after the row table");
    // Two mbarriers per stage (full, empty) for the warp-specialised engine, then its
    // STAGES + 1 unit slots (an mbarrier and a unit each); none otherwise.
    constexpr int BARRIER_BYTES =
        G::PRODUCER_THREADS > 0 ? 2 * G::STAGES * (int)sizeof(u64) + (G::STAGES + 1) * ((int)sizeof(u64) + (int)sizeof(int)) : 0;
    static_assert(G::DYNAMIC_SMEM_BYTES == G::ALIGN_SLACK + G::BARRIER_OFFSET + BARRIER_BYTES, "plan: dynamic shared memory");
    static_assert(G::THREADS == G::PRODUCER_THREADS + 32 * G::WARPS_M * G::WARPS_N, "plan: threads per block");
    static_assert(G::N % G::BN == 0, "plan: tiles divide N");
    static_assert(G::KD % G::BK == 0 || (G::PRODUCER_THREADS == 0 && G::KD % (SMEM_ROW_BYTES / 2) == 0),
                  "plan: k-tiles divide KD, or (mma.sync) the last 128-deep one is half full");
}

// k-tiles along the reduction: a 128-deep mma.sync stage may end past KD by 64, whose
// loads then zero-fill (adding nothing).
template <class G>
__host__ __device__ constexpr int k_tiles() {
    return (G::KD + G::BK - 1) / G::BK;
}

// Chunk c (16 bytes) of shared-memory row r sits at chunk c ^ (r & 7), so the 8 rows one
// ldmatrix reads fall in 8 different bank groups; wgmma's 128-byte swizzle is the same XOR.
// A row of ROW_BYTES = 256 (the mma.sync engine's 128-deep k-tiles) is two such 128-byte
// halves side by side, each swizzled alike.
template <int ROW_BYTES = SMEM_ROW_BYTES>
__device__ __forceinline__ u32 swizzle(int row, int chunk) {
    static_assert(ROW_BYTES == SMEM_ROW_BYTES || ROW_BYTES == 2 * SMEM_ROW_BYTES, "128- or 256-byte rows");
    if constexpr (ROW_BYTES == SMEM_ROW_BYTES) {
        return (u32)(row * ROW_BYTES + ((chunk ^ (row & 7)) << 4));
    } else {
        return (u32)(row * ROW_BYTES + ((chunk >> 3) << 7) + (((chunk & 7) ^ (row & 7)) << 4));
    }
}

// Where one tile of a grouped GEMM sits: its expert, first output column, first row in
// the expert-major order, and how many of its BM rows are real (the rest are masked);
// whether a cluster pair's other block works on the same weight panel beside it.
struct GemmTile {
    int expert, n0, row0, rows;
    bool weights_shared;
    // No other m-tile of this call reads the tile's weight panel.
    bool weights_read_once;
};

// Tile schedule. `row_offsets` holds, per expert here, the start of each of its PHASES
// runs of rows, then the end: [EXPERTS_HERE * PHASES + 1]. On one GPU PHASES = 1 (the
// expert's rows). On the expert-parallel path phase p is the p-th source in receive order
// (this rank first, then by arrival), and a tile belongs to the phase of its last row: it
// can start once that source's rows are here. Tiles are numbered phase-major, then expert
// (shared slices first, see expert_in_tile_order), then n-tile, then m-tile: every tile on
// local rows comes before any tile that waits for a peer, and the m-tiles sharing one
// weight panel run next to each other (L2).
// Group g = (phase g / EXPERTS_HERE, expert expert_in_tile_order(g % EXPERTS_HERE)) holds
// (m_end(e, p) - m_end(e, p - 1)) * N_TILES tiles, where m_end(e, p) counts the m-tiles of
// e whose last row is in phase p or before: the whole tiles, or every tile once no later
// phase has rows. s_tile_start[g] is group g's first work unit (a tile, or a cluster pair's
// two, see group_units), s_tile_start[EXPERTS_HERE * PHASES] the total.
// The expert at position i of the tile order. The shared slices (the last SHARED_SLICES
// experts here, on both paths) come first: each has a row per token, so its many m-tiles
// share one weight panel; started together by fresh blocks, they share it through L2 and
// leave no heavy expert for the tail (DeepSeek-V3 at 128 tokens, against them last: 63 MB
// less read from HBM and 54 us less in GEMM1, Nsight Compute, 2026-11-30).
template <int EXPERTS_HERE>
__device__ __forceinline__ int expert_in_tile_order(int i) {
    return (i + EXPERTS_HERE - SHARED_SLICES) % EXPERTS_HERE;
}

template <int BM, int PHASES, class Offsets>
__device__ __forceinline__ int m_tiles_done(const Offsets& row_offsets, int expert, int phase) {
    if (phase < 0) return 0;
    const int first = row_offsets[expert * PHASES];
    const int rows = row_offsets[expert * PHASES + phase + 1] - first;
    const int total = row_offsets[expert * PHASES + PHASES] - first;
    return rows == total ? (total + BM - 1) / BM : rows / BM;
}

// Work units of a group of `m_tiles` x N_TILES tiles. A block alone takes one tile per
// unit. A cluster pair takes two: two m-tiles of one n-tile (the pair shares the weight
// panel) or, for an odd count of m-tiles, the last m-tile of two n-tiles (the second block
// of a unit past the last n-tile gets no rows); see locate_pair_tile for their order.
template <int N_TILES, int CLUSTER>
__device__ __forceinline__ int group_units(int m_tiles) {
    static_assert(CLUSTER == 1 || CLUSTER == 2, "plan: clusters of 1 or 2 blocks");
    if constexpr (CLUSTER == 1) return m_tiles * N_TILES;
    else return m_tiles / 2 * N_TILES + m_tiles % 2 * ((N_TILES + 1) / 2);
}

template <int BM, int N_TILES, int EXPERTS_HERE, int PHASES, int CLUSTER = 1, class Offsets>
__device__ __forceinline__ void tile_schedule(const Offsets& row_offsets, int* s_tile_start) {
    if (threadIdx.x < 32) {
        warp_exclusive_scan(EXPERTS_HERE * PHASES, [&](int g) {
            const int expert = expert_in_tile_order<EXPERTS_HERE>(g % EXPERTS_HERE), phase = g / EXPERTS_HERE;
            return group_units<N_TILES, CLUSTER>(m_tiles_done<BM, PHASES>(row_offsets, expert, phase) -
                                                  m_tiles_done<BM, PHASES>(row_offsets, expert, phase - 1));
        }, s_tile_start);
    }
    __syncthreads();
}

// Unit `unit`'s group in the schedule: its expert, its first m-tile, its count of m-tiles,
// and the unit's number within it.
struct TileGroup {
    int expert, m_begin, m_tiles, local;
};

template <int BM, int EXPERTS_HERE, int PHASES, class Offsets>
__device__ __forceinline__ TileGroup find_group(int unit, const int* s_tile_start, const Offsets& row_offsets) {
    // The group owning this unit: the last g with s_tile_start[g] <= unit.
    int lo = 0, hi = EXPERTS_HERE * PHASES - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s_tile_start[mid] <= unit) lo = mid; else hi = mid - 1;
    }
    const int expert = expert_in_tile_order<EXPERTS_HERE>(lo % EXPERTS_HERE), phase = lo / EXPERTS_HERE;
    const int m_begin = m_tiles_done<BM, PHASES>(row_offsets, expert, phase - 1);
    return TileGroup{expert, m_begin, m_tiles_done<BM, PHASES>(row_offsets, expert, phase) - m_begin,
                     unit - s_tile_start[lo]};
}

// The tile at m-tile `m` (within the group) and n-tile `n` of group `g`.
template <int BM, int BN, int PHASES, class Offsets>
__device__ __forceinline__ GemmTile group_tile(const TileGroup& g, int m, int n, const Offsets& row_offsets) {
    const int expert_row0 = row_offsets[g.expert * PHASES];
    const int expert_end = row_offsets[(g.expert + 1) * PHASES];
    GemmTile t;
    t.expert = g.expert;
    t.n0 = n * BN;
    t.row0 = expert_row0 + (g.m_begin + m) * BM;
    t.rows = min(BM, expert_end - t.row0);
    t.weights_shared = false;
    t.weights_read_once = g.m_tiles == 1;
    return t;
}

// Tile `tile` of a block alone: m-tiles of one n-tile next to each other.
template <int BM, int BN, int EXPERTS_HERE, int PHASES, class Offsets>
__device__ __forceinline__ GemmTile locate_tile(int tile, const int* s_tile_start, const Offsets& row_offsets) {
    const TileGroup g = find_group<BM, EXPERTS_HERE, PHASES>(tile, s_tile_start, row_offsets);
    return group_tile<BM, BN, PHASES>(g, g.local % g.m_tiles, g.local / g.m_tiles, row_offsets);
}

// The tile of block `cta_rank` of a cluster pair in unit `unit` (see group_units).
template <int BM, int BN, int N_TILES, int EXPERTS_HERE, int PHASES, class Offsets>
__device__ __forceinline__ GemmTile locate_pair_tile(int unit, int cta_rank, const int* s_tile_start,
                                                     const Offsets& row_offsets) {
    const TileGroup g = find_group<BM, EXPERTS_HERE, PHASES>(unit, s_tile_start, row_offsets);
    const int pairs = g.m_tiles / 2;
    // Units come in blocks of two n-tiles: the pairs' units of the first, then of the
    // second, then (odd m-tiles) the last m-tile of both, so that, with units claimed in
    // order, it reads the two weight panels while the pairs' reads of them are in L2.
    const int block_units = 2 * pairs + g.m_tiles % 2;
    const int first_n = 2 * (g.local / block_units), within = g.local % block_units;
    const int pair_units = min(2, N_TILES - first_n) * pairs;
    if (within < pair_units) {
        GemmTile t = group_tile<BM, BN, PHASES>(g, 2 * (within % pairs) + cta_rank, first_n + within / pairs, row_offsets);
        t.weights_shared = true;
        return t;
    }
    const int n = first_n + cta_rank;
    GemmTile t = group_tile<BM, BN, PHASES>(g, g.m_tiles - 1, min(n, N_TILES - 1), row_offsets);
    if (n >= N_TILES) t.rows = 0;
    return t;
}

// The source row of each tile row: the gathered token (GEMM_UP; on the expert-parallel
// path a peer's row in recv_x, once the chunk it sits in has arrived, or from OWN_ROW_BASE
// on one of this rank's own tokens, read from x where it is) or the contiguous
// intermediate row (GEMM_DOWN); -1 marks rows past the group's count. Written by the
// LOADERS threads that load stages (`loader` is this thread's index among them); the
// caller makes the table visible to them.
template <class G, int LOADERS, class Pairs>
__device__ __forceinline__ void fill_row_sources(const GemmTile& t, const Pairs& row_pair, int* s_row_source,
                                                 const EpContext& ep, int loader) {
    for (int r = loader; r < G::BM; r += LOADERS) {
        int source = -1;
        if (r < t.rows) {
            if constexpr (G::KIND == GEMM_DOWN) {
                source = t.row0 + r;
            } else if constexpr (G::EP) {
                source = row_pair[t.row0 + r];
                if (source < G::OWN_ROW_BASE) {
                    const int chunk = source / G::SLOTS * G::CHUNKS + source % G::SLOTS / G::CHUNK;
                    wait_flag(ep.chunk_flags + chunk, ep.epoch, ep.error_word, ep.rank, FLAG_KIND_CHUNK, chunk);
                }
            } else {
                source = row_pair[t.row0 + r] / SLOTS_PER_TOKEN;
            }
        }
        s_row_source[r] = source;
    }
}

// One k-tile into a stage by the LOADERS threads that load (`loader`: this one's index):
// BM rows of A (masked rows zero-filled), then the B rows. Gated: B rows [0, BN) are gate
// rows n0.., rows [BN, 2BN) the matching up rows. A loader copies the same 16-byte chunk
// of every ROW_STEP-th row, so its weight addresses step by a constant from one pointer
// (few registers: the warp-specialised producer has few).
template <class G, int LOADERS>
struct StageLoader {
    enum : unsigned { CHUNKS = G::ROW_BYTES / 16 };  // 16-byte cp.async pieces per row
    static_assert(LOADERS % CHUNKS == 0, "plan: the loaders cover whole rows");
    enum : int { ROW_STEP = LOADERS / CHUNKS };
    // The last k-tile ends past KD (see k_tiles): chunks beyond it zero-fill.
    enum : bool { RAGGED = G::KD % G::BK != 0 };
    int chunk, first_row;
    // Unsigned, so that dividing by the power-of-two CHUNKS is a shift.
    __device__ __forceinline__ explicit StageLoader(unsigned loader) : chunk(loader % CHUNKS), first_row(loader / CHUNKS) {}

    // Where this loader's chunk of k-tile `k_tile` starts within a row.
    __device__ __forceinline__ int k_offset(int k_tile) const { return k_tile * G::BK + chunk * 8; }
    // Whether that chunk lies within the row (a chunk past it reads nothing, at the row's start).
    __device__ __forceinline__ static bool within_row(int k_offset) { return !RAGGED || k_offset < G::KD; }

    __device__ __forceinline__ void a_rows(u32 stage_base, int k_offset, const int* s_row_source,
                                           const bf16_t* __restrict__ rows, const bf16_t* __restrict__ own_rows) const {
        const bool inside = within_row(k_offset);
        const int row_offset = inside ? k_offset : 0;
#pragma unroll
        for (int step = 0; step < (G::BM + ROW_STEP - 1) / ROW_STEP; ++step) {
            const int r = first_row + step * ROW_STEP;
            if (G::BM % ROW_STEP != 0 && r >= G::BM) break;
            const int source = s_row_source[r];
            const bf16_t* base = rows;
            if constexpr (G::EP && G::KIND == GEMM_UP) {
                // Index OWN_ROW_BASE + t is row t of this rank's own x.
                if (source >= G::OWN_ROW_BASE) base = own_rows - (size_t)G::OWN_ROW_BASE * G::KD;
            }
            cp_async_16(stage_base + swizzle<G::ROW_BYTES>(r, chunk), base + (size_t)max(source, 0) * G::KD + row_offset,
                        source >= 0 && inside);
        }
    }

    // The tile's weight rows. On one GPU a panel that no other m-tile reads streams through
    // L2 evict-first: it would otherwise push out the A rows that every n-tile of an expert
    // reads again (x's rows for GEMM_UP, the intermediate's for GEMM_DOWN). A panel another
    // m-tile reads again keeps plain copies, as do the expert-parallel GEMMs (not measured).
    __device__ __forceinline__ void b_rows(u32 stage_base, int k_offset, const GemmTile& t,
                                           const bf16_t* __restrict__ w_expert) const {
        if (!G::EP && t.weights_read_once) {
            const u64 policy = evict_first_policy();
            b_rows_with(stage_base, k_offset, t, w_expert,
                        [&](u32 dst, const bf16_t* src, bool valid) { cp_async_16(dst, src, valid, policy); });
        } else {
            b_rows_with(stage_base, k_offset, t, w_expert,
                        [](u32 dst, const bf16_t* src, bool valid) { cp_async_16(dst, src, valid); });
        }
    }

    template <class Copy>
    __device__ __forceinline__ void b_rows_with(u32 stage_base, int k_offset, const GemmTile& t,
                                                const bf16_t* __restrict__ w_expert, Copy copy) const {
        const u32 b_base = stage_base + G::A_BYTES;
        const bool loads = within_row(k_offset);
        const bf16_t* gate_rows = w_expert + (size_t)(t.n0 + first_row) * G::KD + (loads ? k_offset : 0);
#pragma unroll
        for (int step = 0; step < (G::BN + ROW_STEP - 1) / ROW_STEP; ++step) {
            const int r = first_row + step * ROW_STEP;
            if (G::BN % ROW_STEP != 0 && r >= G::BN) break;
            copy(b_base + swizzle<G::ROW_BYTES>(r, chunk), gate_rows + (size_t)step * ROW_STEP * G::KD, loads);
            if constexpr (G::GATED) {
                const bf16_t* up_rows = gate_rows + (size_t)G::N * G::KD;
                copy(b_base + swizzle<G::ROW_BYTES>(G::BN + r, chunk), up_rows + (size_t)step * ROW_STEP * G::KD, loads);
            }
        }
    }
};

// Epilogue, shared by both engines: where tile row r goes, with which scale and which
// expert's bias, then one pair of adjacent output columns at a time. GEMM_UP adds the bias
// to the gate and up accumulators and applies the activation; GEMM_DOWN adds the bias,
// scales by the routing weight and writes the (token, k) slot.
struct EpilogueRow {
    bf16_t* out;  // the output row
    float scale;
    const float* bias;  // the expert's bias row (GEMM_UP: N gate columns, then N up columns); G::BIAS only
};


// The routing weights of one GPU's combine slots, which its GEMM2 scales its rows by: a
// routed pair's from the caller (or the router), a shared slice's 1, or, where the shared
// expert is gated (SHARED_GATED), its token's sigmoid(x · w_gate) from the shared gate
// launch. Other GEMMs take none (SlotWeights{}).
struct SlotWeights {
    const float* routed = nullptr;       // [T, K]
    const float* shared_gate = nullptr;  // [T]; SHARED_GATED only

    __device__ __forceinline__ float of(int slot) const {
        if constexpr (SHARED_SLICES == 0) {
            return routed[slot];
        } else {
            const int token = slot / SLOTS_PER_TOKEN, k = slot % SLOTS_PER_TOKEN;
            if (k < TOP_K) return routed[token * TOP_K + k];
            return SHARED_GATED ? shared_gate[token] : 1.f;
        }
    }
};

template <class G, class Pairs>
__device__ __forceinline__ EpilogueRow epilogue_row(const GemmTile& t, int r, const Pairs& row_pair,
                                                    const SlotWeights& slot_weights,
                                                    const float* __restrict__ expert_bias, bf16_t* __restrict__ out,
                                                    const EpContext& ep) {
    constexpr int BIAS_WIDTH = G::GATED ? 2 * G::N : G::N;
    const float* bias = G::BIAS ? expert_bias + (size_t)t.expert * BIAS_WIDTH : nullptr;
    if constexpr (G::KIND == GEMM_UP) {
        return EpilogueRow{out + (size_t)(t.row0 + r) * G::N, 1.f, bias};
    } else if constexpr (G::EP && G::RANK_PARTIALS) {
        return EpilogueRow{out + (size_t)(t.row0 + r) * G::N, ep.row_weights[t.row0 + r], bias};
    } else if constexpr (G::EP) {
        const u64* peer = ep.peers + ep.row_origins[t.row0 + r] * G::PEER_BUFFER_COUNT;
        bf16_t* slots = reinterpret_cast<bf16_t*>(peer[G::PEER_COMBINE_SLOTS]);
        return EpilogueRow{slots + (size_t)row_pair[t.row0 + r] * G::N, ep.row_weights[t.row0 + r], bias};
    } else {
        const int slot = row_pair[t.row0 + r];
        return EpilogueRow{out + (size_t)slot * G::N, slot_weights.of(slot), bias};
    }
}

// Expert-parallel GEMM2, after a tile's stores (and the barrier among the STORERS threads
// that made them; `storer` is this one's index): each row releases BN columns to its
// token's counter at the origin. An origin on another node has no counter here (its peer
// table entry is null): its rows go back through NCCL once GEMM2 is done. With rank
// partials nothing is released here: the combine sums the rows here first.
template <class G, int STORERS, class Pairs>
__device__ __forceinline__ void epilogue_release(const GemmTile& t, const Pairs& row_pair, const EpContext& ep,
                                                 int storer) {
    if constexpr (G::EP && G::KIND == GEMM_DOWN && !G::RANK_PARTIALS) {
        for (int r = storer; r < t.rows; r += STORERS) {
            const u64* peer = ep.peers + ep.row_origins[t.row0 + r] * G::PEER_BUFFER_COUNT;
            u32* counters = reinterpret_cast<u32*>(peer[G::PEER_COMBINE_COUNTERS]);
            if (counters == nullptr) continue;
            fence_flags();
            flag_add(counters + row_pair[t.row0 + r] / SLOTS_PER_TOKEN, G::BN);
        }
    }
}

// A stream-K tile that this block covers only in part: store this block's partial sums
// in its slot (slot 0 for the tile its run starts in, 1 for the one it ends in), count
// the block in, and if it is the tile's last block (which resets the count), load the sum
// of every block's part, in block order (the result does not depend on which block came
// last), and return true: this block stores the tile.
template <class G, int MI, int NJ>
__device__ __forceinline__ bool stream_k_meet(float (&acc)[MI][NJ][4],
                                              float (&acc_up)[G::GATED ? MI : 1][G::GATED ? NJ : 1][4],
                                              const StreamKShare& share, int tile, const StreamKBuffers& buffers) {
    constexpr int K_TILES = k_tiles<G>();
    constexpr int REGISTERS = MI * NJ * 4;  // one accumulator set per thread
    constexpr int PARTIAL = G::BM * G::B_ROWS;  // floats of one partial tile, in the threads' order
    static_assert(REGISTERS * (G::GATED ? 2 : 1) * G::THREADS == PARTIAL, "plan: a partial tile is every thread's accumulators");
    const int first = share.block_of(tile * K_TILES);
    const int last = share.block_of(tile * K_TILES + K_TILES - 1);
    auto part = [&](int block) {
        const int slot = 2 * block + (share.start(block) / K_TILES == tile ? 0 : 1);
        return buffers.partials + (size_t)slot * PARTIAL + threadIdx.x;
    };
    // Register r of every thread lies together: the stores and loads are coalesced.
    float* mine = part(blockIdx.x);
#pragma unroll
    for (int r = 0; r < REGISTERS; ++r) {
        __stcg(mine + r * G::THREADS, acc[r / (NJ * 4)][r / 4 % NJ][r % 4]);
        if constexpr (G::GATED) __stcg(mine + (REGISTERS + r) * G::THREADS, acc_up[r / (NJ * 4)][r / 4 % NJ][r % 4]);
    }
    if (!last_arrival(buffers.tiles_done + tile, (u32)(last - first + 1))) return false;
#pragma unroll
    for (int r = 0; r < REGISTERS; ++r) {
        acc[r / (NJ * 4)][r / 4 % NJ][r % 4] = 0.f;
        if constexpr (G::GATED) acc_up[r / (NJ * 4)][r / 4 % NJ][r % 4] = 0.f;
    }
    for (int block = first; block <= last; ++block) {
        const float* p = part(block);
#pragma unroll
        for (int r = 0; r < REGISTERS; ++r) {
            acc[r / (NJ * 4)][r / 4 % NJ][r % 4] += __ldcg(p + r * G::THREADS);
            if constexpr (G::GATED) acc_up[r / (NJ * 4)][r / 4 % NJ][r % 4] += __ldcg(p + (REGISTERS + r) * G::THREADS);
        }
    }
    return true;
}

// The pair of output columns (column, column + 1) of `row`, packed as two bf16.
template <class G>
__device__ __forceinline__ u32 epilogue_pack(const EpilogueRow& row, int column,
                                             float v0, float v1, float up0, float up1) {
    if constexpr (G::BIAS) {
        v0 += row.bias[column];
        v1 += row.bias[column + 1];
        if constexpr (G::GATED) {
            up0 += row.bias[G::N + column];
            up1 += row.bias[G::N + column + 1];
        }
    }
    if constexpr (G::KIND == GEMM_UP) {
        v0 = activate(v0, up0);
        v1 = activate(v1, up1);
    } else {
        v0 *= row.scale;
        v1 *= row.scale;
    }
    return pack_bf16x2(v0, v1);
}

template <class G>
__device__ __forceinline__ void epilogue_store(const EpilogueRow& row, int column,
                                               float v0, float v1, float up0, float up1) {
    *reinterpret_cast<u32*>(row.out + column) = epilogue_pack<G>(row, column, v0, v1, up0, up1);
}

// The block's dynamic shared memory, moved up to the ring's alignment. The allocation is
// declared so aligned, but only 16 bytes are guaranteed (kernels linked from relocatable
// objects got no more).
template <class G>
__device__ __forceinline__ unsigned char* aligned_ring() {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 raw_base = smem_address(smem_raw);
    const u32 smem_base = (raw_base + (G::RING_ALIGN - 1)) & ~(u32)(G::RING_ALIGN - 1);
    return smem_raw + (smem_base - raw_base);
}

// Whether every routed expert's rows fit one m-tile (the shared slices may span many),
// block-wide. Stream-K splits a tile's k-loop where the tile's place in the call puts
// it, so a row's sums depend on its tile, and the route places a routed expert's rows in
// atomic order (the shared slices' in token order): only where no routed row can land in
// another m-tile from one call to the next does a call give the same result every time.
template <int EXPERTS_HERE, int N_TILES>
__device__ __forceinline__ bool routed_rows_fit_one_m_tile(const int* s_tile_start) {
    bool fits = true;
    for (int g = threadIdx.x; g < EXPERTS_HERE; g += blockDim.x) {
        if (expert_in_tile_order<EXPERTS_HERE>(g) < EXPERTS && s_tile_start[g + 1] - s_tile_start[g] > N_TILES) fits = false;
    }
    return __syncthreads_and(fits);
}

// A block's run of k-tiles [k_begin, k_begin + k_count) of one tile (tile < 0: none).
struct KRun {
    int tile, k_begin, k_count;
    static __device__ __forceinline__ KRun none() { return KRun{-1, 0, 0}; }
};

// Where a block's ring stands between runs: the stage the next run's first k-tile goes
// to (stages are used round the ring across runs), and whether that run's first weight
// stages are already on their way (issued at the end of the run before it).
struct RingState {
    int first_stage;
    bool weights_issued;
};

// The weight rows of the first STAGES - 1 k-tiles of run `run` (fewer for a shorter run)
// of tile `t`, into the ring from stage `first_stage` on. Not committed: they join the
// run's first cp.async group.
template <class G, int LOADERS>
__device__ __forceinline__ void issue_first_weights(const StageLoader<G, LOADERS>& load, u32 smem_base, const GemmTile& t,
                                                    const bf16_t* w_expert, const KRun& run, int first_stage) {
#pragma unroll
    for (int s = 0; s < G::STAGES - 1; ++s) {
        if (s < run.k_count) {
            load.b_rows(smem_base + (first_stage + s) % G::STAGES * G::STAGE_BYTES, load.k_offset(run.k_begin + s), t,
                        w_expert);
        }
    }
}

// One block's run `run` on the mma.sync engine: load and multiply its k-tiles, then store
// the tile (whole, or as the last of a split tile's blocks; `share`, the call's stream-K
// deal, only for a part of a tile). `smem` is the block's ring, aligned (the row table
// follows it), `s_tile_start` the tile schedule, `ring` where the ring stands. Once its
// last k-tile is multiplied, and before its epilogue, the run sends out the first weight
// stages of the block's next run `next` (weights depend on nothing another kernel
// writes), so that the block's loads do not stop between tiles; it returns the ring's
// state for that run. On return every thread's stores are done; `*tile_out` is the tile.
template <class G, class Offsets, class Pairs, class WaitForRows>
__device__ __forceinline__ RingState mma_sync_run(
    const bf16_t* __restrict__ a_rows, const bf16_t* __restrict__ weights, const float* __restrict__ expert_bias,
    const SlotWeights& slot_weights, const Offsets& row_offsets, const Pairs& row_pair,
    bf16_t* __restrict__ out, const EpContext& ep, const StreamKBuffers& stream_k, unsigned char* smem,
    const int* s_tile_start, const KRun& run, const KRun& next, RingState ring, const StreamKShare* share,
    bool weights_first, WaitForRows wait_for_a_rows, GemmTile* tile_out)
{
    constexpr int W_ROWS = G::GATED ? 2 * G::N : G::N;
    constexpr int WM = G::BM / G::WARPS_M;  // rows per warp
    constexpr int WN = G::BN / G::WARPS_N;  // output columns per warp
    constexpr int MI = WM / 16;             // m16 fragments per warp
    constexpr int NJ = WN / 8;              // n8 fragments per warp
    constexpr int K_TILES = k_tiles<G>();
    static_assert(WM % 16 == 0 && WN % 16 == 0, "plan: warp tile is whole 16x16 pieces");
    const u32 smem_base = smem_address(smem);
    int* s_row_source = reinterpret_cast<int*>(smem + G::ROW_SOURCE_OFFSET);  // [BM], -1 = padding
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int warp_m = warp / G::WARPS_N;
    const int warp_n = warp % G::WARPS_N;

    const int k_begin = run.k_begin, k_count = run.k_count;
    const GemmTile t = locate_tile<G::BM, G::BN, G::EXPERTS_HERE, G::PHASES>(run.tile, s_tile_start, row_offsets);
    const bf16_t* w_expert = weights + (size_t)t.expert * W_ROWS * G::KD;
    const StageLoader<G, G::THREADS> load((unsigned)tid);
    // Step k of the run multiplies k-tile k_begin + k from stage (first_stage + k) % STAGES.
    auto stage_of = [&](int k) { return (ring.first_stage + k) % G::STAGES; };
    // Stage `stage` gets k-tile `k_tile`: its A rows, and its weight rows unless they
    // went out already.
    auto stage_load = [&](int stage, int k_tile, bool weights_issued = false) {
        const u32 stage_base = smem_base + stage * G::STAGE_BYTES;
        const int k_offset = load.k_offset(k_tile);
        load.a_rows(stage_base, k_offset, s_row_source, a_rows, ep.own_rows);
        if (!weights_issued) load.b_rows(stage_base, k_offset, t, w_expert);
    };

    // Pipeline prologue: STAGES - 1 k-tiles in flight. Their weight rows go out first
    // (unless the run before sent them), before the row table is read and, with
    // `weights_first` (a GEMM2 whose A rows another kernel or other blocks are still
    // writing), before `wait_for_a_rows(t)` waits for the A rows; then the A rows go out.
    if (!ring.weights_issued) issue_first_weights<G>(load, smem_base, t, w_expert, run, ring.first_stage);
    if (weights_first) wait_for_a_rows(t);
    fill_row_sources<G, G::THREADS>(t, row_pair, s_row_source, ep, tid);
    __syncthreads();

    float acc[MI][NJ][4];
    float acc_up[G::GATED ? MI : 1][G::GATED ? NJ : 1][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                acc[i][j][c] = 0.f;
                if constexpr (G::GATED) acc_up[i][j][c] = 0.f;
            }

#pragma unroll
    for (int s = 0; s < G::STAGES - 1; ++s) {
        if (s < k_count) stage_load(stage_of(s), k_begin + s, true);
        cp_async_commit();
    }

    for (int k = 0; k < k_count; ++k) {
        cp_async_wait<G::STAGES - 2>();
        __syncthreads();  // stage k landed for everyone; stage k-1 is free
        const int ahead = k + G::STAGES - 1;
        if (ahead < k_count) stage_load(stage_of(ahead), k_begin + ahead);
        cp_async_commit();

        const u32 a_base = smem_base + stage_of(k) * G::STAGE_BYTES;
        const u32 b_base = a_base + G::A_BYTES;
#pragma unroll
        for (int k16 = 0; k16 < G::BK / 16; ++k16) {
            u32 a_frag[MI][4];
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                const int r = warp_m * WM + i * 16 + (lane & 15);
                ldmatrix_x4(a_frag[i][0], a_frag[i][1], a_frag[i][2], a_frag[i][3],
                            a_base + swizzle<G::ROW_BYTES>(r, k16 * 2 + (lane >> 4)));
            }
#pragma unroll
            for (int j2 = 0; j2 < NJ / 2; ++j2) {
                const int r = warp_n * WN + j2 * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int chunk = k16 * 2 + ((lane >> 3) & 1);
                u32 b_frag[2][2];
                ldmatrix_x4(b_frag[0][0], b_frag[0][1], b_frag[1][0], b_frag[1][1], b_base + swizzle<G::ROW_BYTES>(r, chunk));
#pragma unroll
                for (int i = 0; i < MI; ++i) {
                    mma_bf16_m16n8k16(acc[i][2 * j2], a_frag[i], b_frag[0]);
                    mma_bf16_m16n8k16(acc[i][2 * j2 + 1], a_frag[i], b_frag[1]);
                }
                if constexpr (G::GATED) {
                    u32 u_frag[2][2];
                    ldmatrix_x4(u_frag[0][0], u_frag[0][1], u_frag[1][0], u_frag[1][1],
                                b_base + swizzle<G::ROW_BYTES>(r + G::BN, chunk));
#pragma unroll
                    for (int i = 0; i < MI; ++i) {
                        mma_bf16_m16n8k16(acc_up[i][2 * j2], a_frag[i], u_frag[0]);
                        mma_bf16_m16n8k16(acc_up[i][2 * j2 + 1], a_frag[i], u_frag[1]);
                    }
                }
            }
        }
    }

    // Every thread has passed the last step's barrier, so every stage but the last step's
    // is free and holds no pending copy: the next run's first weight stages go there.
    const RingState next_ring{(ring.first_stage + k_count) % G::STAGES, next.tile >= 0};
    if (next_ring.weights_issued) {
        const GemmTile nt = locate_tile<G::BM, G::BN, G::EXPERTS_HERE, G::PHASES>(next.tile, s_tile_start, row_offsets);
        issue_first_weights<G>(load, smem_base, nt, weights + (size_t)nt.expert * W_ROWS * G::KD, next,
                               next_ring.first_stage);
    }

    // A tile split between blocks is stored by the last of them, with every part.
    bool stores = true;
    if constexpr (G::STREAM_K_MAX_TILES > 0) {
        if (k_count < K_TILES) stores = stream_k_meet<G>(acc, acc_up, *share, run.tile, stream_k);
    }

    // Epilogue: each thread holds rows lane/4 and lane/4 + 8 of every fragment, two
    // adjacent columns each.
    if (stores) {
#pragma unroll
        for (int i = 0; i < MI; ++i) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = warp_m * WM + i * 16 + (lane >> 2) + half * 8;
                if (r >= t.rows) continue;
                const EpilogueRow row = epilogue_row<G>(t, r, row_pair, slot_weights, expert_bias, out, ep);
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    const int column = t.n0 + warp_n * WN + j * 8 + (lane & 3) * 2;
                    const float up0 = G::GATED ? acc_up[G::GATED ? i : 0][G::GATED ? j : 0][half * 2] : 0.f;
                    const float up1 = G::GATED ? acc_up[G::GATED ? i : 0][G::GATED ? j : 0][half * 2 + 1] : 0.f;
                    epilogue_store<G>(row, column, acc[i][j][half * 2], acc[i][j][half * 2 + 1], up0, up1);
                }
            }
        }
    }
    // (The next run's weight copies are not committed yet, so this waits for none of them.)
    cp_async_wait<0>();
    __syncthreads();  // the next tile reuses the ring and the row table; every store is done
    if (stores) epilogue_release<G, G::THREADS>(t, row_pair, ep, tid);
    *tile_out = t;
    return next_ring;
}

// The tile loops of grouped_gemm, over the call's routing tables (`row_offsets` and
// `row_pair`: the route's pointers, or RoutingTables).
template <class G, class Offsets, class Pairs>
__device__ __forceinline__ void grouped_gemm_tiles(
    const bf16_t* __restrict__ a_rows, const bf16_t* __restrict__ weights, const float* __restrict__ expert_bias,
    const SlotWeights& slot_weights, const Offsets& row_offsets, const Pairs& row_pair, bf16_t* __restrict__ out,
    const EpContext& ep, const StreamKBuffers& stream_k, unsigned char* smem, int* s_tile_start)
{
    constexpr int K_TILES = k_tiles<G>();
    constexpr int N_TILES = G::N / G::BN;
    tile_schedule<G::BM, N_TILES, G::EXPERTS_HERE, G::PHASES>(row_offsets, s_tile_start);
    const int total_tiles = s_tile_start[G::EXPERTS_HERE * G::PHASES];

    // WEIGHTS_BEFORE_WAIT: this kernel started early and has not yet waited for the one
    // ahead. Its first run then issues its first weight stages before it waits: its weights
    // and tile schedule were final before it launched (the routing ran two launches back, or
    // the ids it routes in its blocks were final before GEMM1 read them); only its A rows
    // are GEMM1's output. (Warming L2 with the rest of the run's weights as
    // well cost up to 15%: it competed with GEMM1 for HBM, 2026-12-01; still 1-10% with
    // GEMM1's weight lines marked evict-first so that they could not evict it, 2026-12-03.)
    bool waited = !G::WEIGHTS_BEFORE_WAIT;
    RingState ring{0, false};
    auto multiply_run = [&](const KRun& run, const KRun& next, const StreamKShare* share) {
        const bool weights_first = G::WEIGHTS_BEFORE_WAIT && !waited;
        waited = true;
        GemmTile t;
        ring = mma_sync_run<G>(a_rows, weights, expert_bias, slot_weights, row_offsets, row_pair, out, ep, stream_k,
                               smem, s_tile_start, run, next, ring, share, weights_first,
                               [](const GemmTile&) { start_after_previous_kernel(); }, &t);
    };

    // A call whose last wave of whole tiles is short runs stream-K: each block one run of
    // the call's k-tiles. Otherwise whole tiles are dealt round robin, with the k-loop's
    // bounds known at compile time.
    if constexpr (G::STREAM_K_MAX_TILES > 0) {
        const int last_wave = total_tiles % gridDim.x;
        if (total_tiles <= G::STREAM_K_MAX_TILES && last_wave >= 1 && last_wave <= G::STREAM_K_MAX_LAST_WAVE &&
            routed_rows_fit_one_m_tile<G::EXPERTS_HERE, N_TILES>(s_tile_start)) {
            const StreamKShare share(total_tiles * K_TILES, gridDim.x);
            if (blockIdx.x >= share.blocks) return;
            const int end = share.start(blockIdx.x + 1);
            // The block's run starting at k-tile `it` of the call (tile < 0 past its end).
            auto run_at = [&](int it) {
                if (it >= end) return KRun::none();
                const int k_begin = it % K_TILES;
                return KRun{it / K_TILES, k_begin, min(K_TILES - k_begin, end - it)};
            };
            for (KRun run = run_at(share.start(blockIdx.x)); run.tile >= 0;) {
                const KRun next = run_at(run.tile * K_TILES + run.k_begin + run.k_count);
                multiply_run(run, next, &share);
                run = next;
            }
            return;
        }
    }
    for (int tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
        const int next = tile + (int)gridDim.x;
        multiply_run(KRun{tile, 0, K_TILES}, next < total_tiles ? KRun{next, 0, K_TILES} : KRun::none(), nullptr);
    }
}

template <class G>
__device__ __forceinline__ void grouped_gemm(
    const bf16_t* __restrict__ a_rows,        // x [tokens, KD] (UP) or intermediate [pairs, KD] (DOWN)
    const bf16_t* __restrict__ weights,       // [EXPERTS, W_ROWS, KD]
    const float* __restrict__ expert_bias,    // [EXPERTS, W_ROWS] (UP) or [EXPERTS, N] (DOWN); BIAS only
    const SlotWeights slot_weights,           // one GPU's GEMM2 only
    const int* __restrict__ row_offsets,      // [EXPERTS_HERE * PHASES + 1]: see tile_schedule (unread where the block routes)
    const int* __restrict__ row_pair,         // [pairs] (unread where the block routes)
    bf16_t* __restrict__ out,                 // intermediate [pairs, N] (UP) or slots [pairs, N] (DOWN)
    const EpContext& ep,
    const StreamKBuffers& stream_k = StreamKBuffers{},
    const CallRouting& call = CallRouting{})
{
    assert_gemm_layout<G>();
    static_assert(G::RING_ALIGN == 128 && G::ALIGN_SLACK >= G::RING_ALIGN - 16, "plan: slack to align the ring");
    static_assert(G::BLOCK_ROUTING_MAX_PAIRS == 0 || !G::EP, "plan: only one GPU's GEMMs route in their blocks");
    constexpr int TILE_TABLE = G::EXPERTS_HERE * G::PHASES + 1;
    unsigned char* smem = aligned_ring<G>();
    __shared__ int s_tables[TILE_TABLE + block_routing_ints<G::BLOCK_ROUTING_MAX_PAIRS>()];
    static_assert(static_smem_reserved(sizeof(s_tables)) == G::STATIC_SMEM_BYTES,
                  "plan: static tile-start table (and routing tables)");
    int* s_tile_start = s_tables;

    // A call of few pairs was given no route launch: this block routes it (the ids were
    // final before this kernel launched, as the weights were). A GEMM that may reads either
    // kind of table through RoutingTable; the others read the route's directly.
    if constexpr (G::BLOCK_ROUTING_MAX_PAIRS > 0) {
        RoutingTable offsets{row_offsets, false}, pairs{row_pair, false};
        if (call.routes && call.tokens * TOP_K <= G::BLOCK_ROUTING_MAX_PAIRS) {
            int* s_offsets = s_tables + TILE_TABLE;
            int* s_fill = s_offsets + GEMM_EXPERTS + 1;
            int* s_row_pair = s_fill + GEMM_EXPERTS;
            route_in_block<G::THREADS>(call.topk_ids, call.tokens, call.error_word, s_offsets, s_row_pair, s_fill);
            offsets = RoutingTable{s_offsets, true};
            pairs = RoutingTable{s_row_pair, true};
        }
        grouped_gemm_tiles<G>(a_rows, weights, expert_bias, slot_weights, offsets, pairs, out, ep, stream_k, smem,
                              s_tile_start);
    } else {
        grouped_gemm_tiles<G>(a_rows, weights, expert_bias, slot_weights, row_offsets, row_pair, out, ep, stream_k, smem,
                              s_tile_start);
    }
}
