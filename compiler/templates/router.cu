// ---------------------------------------------------------------------------------------
// Router: chooses each token's TOP_K experts and their weights from x, for a call that
// routes itself (a caller-routed call passes topk_ids and topk_weights instead).
//   gate    router_logits[t, e] = x[t] · W_gate[e], f32 accumulation; a tiled mma.sync
//           GEMM, blocks numbered token-tile major so that the expert tiles of one token
//           tile run together and share its x rows through L2. WARPS_K groups of warps
//           split the reduction (group g: k-tiles g, g + WARPS_K, ..., its own ring),
//           summed in group order: a few tokens' grid has few blocks, each needing many
//           loads in flight. A fused router splits it over blocks as well (below). A
//           split router's gate for large calls on sm_90a runs on wgmma instead
//           (router_gate_warp_specialized: a producer warpgroup, TMA for W_gate).
//   select  one warp per token: {{ router.rule }}.
// A regime's router is fused (one kernel in place of the route kernel: gate in every
// block; select by the last block of each token tile to finish its gate blocks; the
// routing metadata by the last token tile's selecting block; a counter per token tile and,
// with several token tiles, one over them say which block came last, and it resets the
// counter for the next call; no block waits for another) or split (gate kernel, then
// select kernel, then the whole table) for calls too large for one block's tails. A call
// whose tiles leave SMs without a block splits each tile over `splits` blocks along the
// reduction (as many as the grid's size says: the plan splits so that every SM takes a
// piece), each writing its partial logits to its own [T, E] slice of router_logits; a fused
// router's select, or a split router's last block of the tile, adds them up in split order
// into the first slice, so every call of a given size sums the same way. A split router's
// cluster gate (sm_90) runs one thread-block cluster per token tile across every expert,
// each block of it a fixed slice of the reduction; the blocks sum their partial logits in
// distributed shared memory, in block order, and each then selects its share of the
// tile's tokens (no select launch).
// Ties go to the lower expert index; NaN counts as below every number.
// ---------------------------------------------------------------------------------------
enum RouterScoring { ROUTER_SOFTMAX = 1, ROUTER_SIGMOID = 2, ROUTER_TOPK_SOFTMAX = 3 };
enum RouterBias { ROUTER_BIAS_NONE = 0, ROUTER_BIAS_LOGITS = 1, ROUTER_BIAS_SCORE_CORRECTION = 2 };
enum : int { ROUTER_SCORING = {{ router.scoring }} };
enum : int { ROUTER_BIAS = {{ router.bias }} };
enum : int { ROUTER_GROUPS = {{ router.groups }} };            // 0: no group limit
enum : int { ROUTER_GROUPS_KEPT = {{ router.groups_kept }} };
enum : bool { ROUTER_NORMALIZE = {{ router.normalize }} };
enum : int { ROUTER_PER_LANE = (EXPERTS + 31) / 32 };     // experts a lane holds: lane, lane + 32, ...
enum : int { ROUTER_K_PER_LANE = (TOP_K + 31) / 32 };     // chosen experts a lane writes
enum : int { ROUTER_GROUP_SIZE = ROUTER_GROUPS > 0 ? EXPERTS / ROUTER_GROUPS : EXPERTS };
enum : int { ROUTER_GROUPS_PER_LANE = ROUTER_GROUPS > 0 ? (ROUTER_GROUPS + 31) / 32 : 1 };
// A group limit whose groups are not whole entries of every lane ranks its groups from
// each warp's selection values in shared memory (EXPERTS floats a warp); the plan says which.
enum : bool { ROUTER_GROUPS_IN_SMEM = {{ router.groups_in_smem }} };
static_assert(ROUTER_GROUPS == 0 || ROUTER_GROUPS_IN_SMEM || ROUTER_GROUP_SIZE % 32 == 0,
              "plan: groups ranked by warp reductions are whole entries of every lane");
static_assert(ROUTER_PER_LANE <= 32, "plan: a lane's experts fit one 32-bit mask");
static_assert(ROUTER_GROUPS == 0 || EXPERTS % ROUTER_GROUPS == 0, "plan: groups divide the experts");
// A fused router's select scratch (its token tile's logits; the rule's bias, with one; a
// warp's selection values, with a group limit) and its routing scratch (counts and
// offsets per GEMM expert), both in the gate's rings.
enum : int { ROUTER_BIAS_FLOATS = ROUTER_BIAS != ROUTER_BIAS_NONE ? EXPERTS : 0 };
template <class G>
__host__ __device__ constexpr int router_scratch_bytes() {
    const int selection = 4 * (G::BM * EXPERTS + ROUTER_BIAS_FLOATS) + (ROUTER_GROUPS_IN_SMEM ? 4 * EXPERTS * (G::THREADS / 32) : 0);
    const int routing = 4 * (2 * GEMM_EXPERTS + 1);
    return selection > routing ? selection : routing;
}

// Starts bringing the 128-byte line at `p` into L2.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

// Checks a gate config against the layout the code below assumes.
template <class G>
__device__ __forceinline__ void assert_gate_layout() {
    static_assert(G::BM % (16 * G::WARPS_M) == 0 && G::BN % (16 * G::WARPS_N) == 0, "plan: warp tiles are whole 16x16 pieces");
    static_assert(G::THREADS == 32 * G::WARPS_M * G::WARPS_N * G::WARPS_K, "plan: threads per block");
    static_assert(G::STAGE_BYTES == (G::BM + G::BN) * SMEM_ROW_BYTES, "plan: a stage is BM x rows then BN W_gate rows");
    constexpr int RINGS = G::WARPS_K * G::STAGES * G::STAGE_BYTES;
    constexpr int SCRATCH = G::FUSED ? router_scratch_bytes<G>() : 0;
    static_assert(G::CLUSTER > 0 || G::SMEM_BYTES == (RINGS > SCRATCH ? RINGS : SCRATCH),
                  "plan: the gate's shared memory holds its rings and a fused router's scratch");
    static_assert((HIDDEN / (SMEM_ROW_BYTES / (int)sizeof(bf16_t))) % G::WARPS_K == 0, "plan: the groups split the k-tiles evenly");
    static_assert((HIDDEN / (SMEM_ROW_BYTES / (int)sizeof(bf16_t)) / G::WARPS_K) % G::MOST_SPLITS == 0,
                  "plan: the blocks of the split take a group's k-tiles evenly");
    static_assert(G::EXPERT_TILES == (EXPERTS + G::BN - 1) / G::BN, "plan: expert tiles cover every expert");
    static_assert(G::STAGES >= 2, "plan: at least two stages");
}

// Which gate tile (token tile major, then expert tile), and which block of the split of its
// reduction, this block of a gate computes; the split is the plan's for the call's tiles
// (the grid's size says it).
struct GateBlock {
    int tile, split, splits;
};
template <class G>
__device__ __forceinline__ GateBlock gate_block(int tokens) {
    const int token_tiles = (tokens + G::BM - 1) / G::BM;
    const int splits = gridDim.x / (token_tiles * G::EXPERT_TILES);
    return GateBlock{(int)blockIdx.x / splits, (int)blockIdx.x % splits, splits};
}

// The gate tile `b.tile`, block `b.split` of the `b.splits` its reduction is split over
// (k-tiles [split, split + 1) · K_TILES / splits): its logits, or their partial sums over
// its k-tiles, each handed to store(token, expert, value) for the call's tokens and the
// experts below EXPERTS.
template <class G, class Store>
__device__ __forceinline__ void router_gate(const bf16_t* __restrict__ x, const bf16_t* __restrict__ gate_weight,
                                            int tokens, const GateBlock& b, Store store) {
    assert_gate_layout<G>();
    constexpr int WM = G::BM / G::WARPS_M;  // tokens per warp
    constexpr int WN = G::BN / G::WARPS_N;  // experts per warp
    constexpr int MI = WM / 16;             // m16 fragments per warp
    constexpr int NJ = WN / 8;              // n8 fragments per warp
    constexpr int BK = SMEM_ROW_BYTES / (int)sizeof(bf16_t);
    constexpr int K_TILES = HIDDEN / BK;
    constexpr int GROUP_K_TILES = K_TILES / G::WARPS_K;  // k-tiles of one group of warps, unsplit
    constexpr int GROUP_THREADS = 32 * G::WARPS_M * G::WARPS_N;
    constexpr int ROW_CHUNKS = SMEM_ROW_BYTES / 16;  // 16-byte cp.async pieces per row
    static_assert(HIDDEN % BK == 0, "plan: HIDDEN is whole 64-column k-tiles");
    static_assert(MI * NJ * 4 * (int)sizeof(float) * GROUP_THREADS <= G::STAGES * G::STAGE_BYTES,
                  "a group's partial sums fit its ring");

    extern __shared__ __align__(128) unsigned char smem[];
    const int lane = threadIdx.x & 31;
    const int group = threadIdx.x / GROUP_THREADS;  // which k-tiles: group, group + WARPS_K, ...
    const int group_thread = threadIdx.x % GROUP_THREADS;
    const int warp = group_thread >> 5;
    const int warp_m = warp / G::WARPS_N;
    const int warp_n = warp % G::WARPS_N;
    const u32 smem_base = smem_address(smem) + group * G::STAGES * G::STAGE_BYTES;
    const int token0 = b.tile / G::EXPERT_TILES * G::BM;
    const int expert0 = b.tile % G::EXPERT_TILES * G::BN;
    const int group_steps = GROUP_K_TILES / b.splits;                   // this block's k-tiles per group
    const int first_k_tile = b.split * group_steps * G::WARPS_K + group;  // step i: first_k_tile + i · WARPS_K

    // Phase 1 (per stage, by the group's threads into its ring): BM rows of x, then BN rows
    // of W_gate (stage rows [first_row, end_row) of those); tokens past the call and experts
    // past EXPERTS are zero-filled.
    auto stage_load = [&](int stage, int k_tile, int first_row = 0, int end_row = G::BM + G::BN) {
        const u32 base = smem_base + stage * G::STAGE_BYTES;
        for (int piece = first_row * ROW_CHUNKS + group_thread; piece < end_row * ROW_CHUNKS; piece += GROUP_THREADS) {
            const int r = piece / ROW_CHUNKS;
            const int chunk = piece % ROW_CHUNKS;
            const bool is_x = r < G::BM;
            const int row = is_x ? token0 + r : expert0 + (r - G::BM);
            const bool valid = row < (is_x ? tokens : EXPERTS);
            const bf16_t* matrix = is_x ? x : gate_weight;
            // Rows of BM (a multiple of 16) keep the swizzle of W_gate's own row index.
            cp_async_16(base + swizzle(r, chunk), matrix + (size_t)(valid ? row : 0) * HIDDEN + k_tile * BK + chunk * 8, valid);
        }
    };

    float acc[MI][NJ][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

    // Phase 2: the group's k loop, STAGES - 1 of its k-tiles in flight (every group takes
    // the same steps). A fused router that started early loads its first stages' W_gate
    // rows (fixed weights) before it waits for the kernel ahead, which may still be writing
    // x; then their x rows.
    if constexpr (G::WEIGHTS_BEFORE_WAIT) {
#pragma unroll
        for (int s = 0; s < G::STAGES - 1; ++s) {
            if (s < group_steps) stage_load(s, first_k_tile + s * G::WARPS_K, G::BM);
        }
        if constexpr (G::NEXT_STARTS_EARLY) {
            start_after_previous_kernel();
        } else {
            wait_for_previous_kernel();
        }
    }
#pragma unroll
    for (int s = 0; s < G::STAGES - 1; ++s) {
        if (s < group_steps) {
            stage_load(s, first_k_tile + s * G::WARPS_K, 0, G::WEIGHTS_BEFORE_WAIT ? G::BM : G::BM + G::BN);
        }
        cp_async_commit();
    }
    for (int step = 0; step < group_steps; ++step) {
        cp_async_wait<G::STAGES - 2>();
        __syncthreads();  // stage `step` landed for everyone; stage step-1 is free
        const int next = step + G::STAGES - 1;
        if (next < group_steps) stage_load(next % G::STAGES, first_k_tile + next * G::WARPS_K);
        cp_async_commit();

        const u32 a_base = smem_base + (step % G::STAGES) * G::STAGE_BYTES;
        const u32 b_base = a_base + G::BM * SMEM_ROW_BYTES;
#pragma unroll
        for (int k16 = 0; k16 < BK / 16; ++k16) {
            u32 a_frag[MI][4];
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                const int r = warp_m * WM + i * 16 + (lane & 15);
                ldmatrix_x4(a_frag[i][0], a_frag[i][1], a_frag[i][2], a_frag[i][3], a_base + swizzle(r, k16 * 2 + (lane >> 4)));
            }
#pragma unroll
            for (int j2 = 0; j2 < NJ / 2; ++j2) {
                const int r = warp_n * WN + j2 * 16 + (lane & 7) + ((lane >> 4) << 3);
                u32 b_frag[2][2];
                ldmatrix_x4(b_frag[0][0], b_frag[0][1], b_frag[1][0], b_frag[1][1],
                            b_base + swizzle(r, k16 * 2 + ((lane >> 3) & 1)));
#pragma unroll
                for (int i = 0; i < MI; ++i) {
                    mma_bf16_m16n8k16(acc[i][2 * j2], a_frag[i], b_frag[0]);
                    mma_bf16_m16n8k16(acc[i][2 * j2 + 1], a_frag[i], b_frag[1]);
                }
            }
        }
    }
    cp_async_wait<0>();

    // Phase 3: the groups' partial sums, added in group order (deterministic): groups
    // 1.. leave theirs in their rings, group 0 adds them and stores.
    if constexpr (G::WARPS_K > 1) {
        __syncthreads();  // every ring is done with its stages
        float* partial = reinterpret_cast<float*>(smem + group * G::STAGES * G::STAGE_BYTES);
        constexpr int VALUES = MI * NJ * 4;
        if (group > 0) {
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < NJ; ++j)
#pragma unroll
                    for (int c = 0; c < 4; ++c) partial[((i * NJ + j) * 4 + c) * GROUP_THREADS + group_thread] = acc[i][j][c];
        }
        __syncthreads();
        if (group > 0) return;  // group 0 stores; the others go on to the caller's next phase
        for (int g = 1; g < G::WARPS_K; ++g) {
            const float* theirs = reinterpret_cast<const float*>(smem + g * G::STAGES * G::STAGE_BYTES);
#pragma unroll
            for (int v = 0; v < VALUES; ++v) {
                acc[v / (NJ * 4)][v / 4 % NJ][v % 4] += theirs[v * GROUP_THREADS + group_thread];
            }
        }
    }

    // A cluster gate's partial logits take the place of the first group's ring: with one
    // group, every warp must be done reading it first (with several, phase 3 saw to that).
    if constexpr (G::CLUSTER > 0 && G::WARPS_K == 1) __syncthreads();

    // Phase 4: store the logits; each thread holds rows lane/4 and lane/4 + 8 of every
    // fragment, two adjacent experts each.
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int token = token0 + warp_m * WM + i * 16 + (lane >> 2) + half * 8;
            if (token >= tokens) continue;
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const int expert = expert0 + warp_n * WN + j * 8 + (lane & 3) * 2;
                if (expert < EXPERTS) store(token, expert, acc[i][j][half * 2]);
                if (expert + 1 < EXPERTS) store(token, expert + 1, acc[i][j][half * 2 + 1]);
            }
        }
    }
}

// Stores into `logits` [tokens, EXPERTS] for router_gate.
struct LogitsStore {
    float* __restrict__ logits;
    __device__ __forceinline__ void operator()(int token, int expert, float value) const {
        logits[(size_t)token * EXPERTS + expert] = value;
    }
};

// No toolkit header defines INFINITY here: its bits.
__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000); }

// Selection compares (value, expert): the higher value, then the lower index; NaN is below
// every number, and an entry a lane does not offer is (-inf, INT_MAX).
__device__ __forceinline__ float router_comparable(float v) { return v != v ? negative_infinity() : v; }
__device__ __forceinline__ bool router_better(float v, int i, float best_v, int best_i) {
    return v > best_v || (v == best_v && i < best_i);
}
enum : int { ROUTER_NONE = 0x7fffffff };

// A float's bits as an unsigned integer of the same order (-0 as +0, which compare
// equal), and back.
__device__ __forceinline__ u32 router_ordered_bits(float v) {
    const u32 bits = __float_as_uint(v) == 0x80000000u ? 0u : __float_as_uint(v);
    return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}
__device__ __forceinline__ float router_from_ordered_bits(u32 key) {
    return __uint_as_float(key & 0x80000000u ? key & 0x7fffffffu : ~key);
}

// The warp's best (value, index) pair; every lane gets it. Two warp reductions
// (redux.sync) rather than five rounds of shuffles: the best value, then the lowest index
// among the lanes that offer it. Values are never NaN here (router_comparable).
__device__ __forceinline__ void router_warp_best(float& value, int& index) {
    const u32 key = router_ordered_bits(value);
    u32 best_key, best_index;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;\n" : "=r"(best_key) : "r"(key));
    const u32 offered = key == best_key ? (u32)index : 0xffffffffu;
    asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;\n" : "=r"(best_index) : "r"(offered));
    value = router_from_ordered_bits(best_key);
    index = (int)best_index;
}

// This lane's entries (value, expert), those `unavailable` leaves open best first, then
// (-inf, ROUTER_NONE) for the rest: sorted once, so that each round of the top-k only
// compares the lanes' heads. An odd-even transposition sort, ROUTER_PER_LANE passes.
__device__ __forceinline__ void router_lane_sorted(const float (&selection)[ROUTER_PER_LANE], u32 unavailable, int lane,
                                                   float (&v)[ROUTER_PER_LANE], int (&e)[ROUTER_PER_LANE]) {
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; ++i) {
        const bool open = !(unavailable >> i & 1u);
        v[i] = open ? selection[i] : negative_infinity();
        e[i] = open ? lane + 32 * i : ROUTER_NONE;
    }
#pragma unroll
    for (int pass = 0; pass < ROUTER_PER_LANE; ++pass) {
#pragma unroll
        for (int i = pass % 2; i + 1 < ROUTER_PER_LANE; i += 2) {
            if (router_better(v[i + 1], e[i + 1], v[i], e[i])) {
                const float tv = v[i];
                const int te = e[i];
                v[i] = v[i + 1];
                e[i] = e[i + 1];
                v[i + 1] = tv;
                e[i + 1] = te;
            }
        }
    }
}

// The sum of the two best values over the warp, each lane offering its own two best
// (`best` >= `second`, -inf where it has fewer): a value the warp holds twice is both.
__device__ __forceinline__ float router_warp_best_two_sum(float best, float second, int lane) {
    const u32 key = router_ordered_bits(best);
    u32 best_key, holder, second_key;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;\n" : "=r"(best_key) : "r"(key));
    asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;\n" : "=r"(holder) : "r"(key == best_key ? (u32)lane : 0xffffffffu));
    const u32 runner_up = router_ordered_bits((u32)lane == holder ? second : best);
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;\n" : "=r"(second_key) : "r"(runner_up));
    return router_comparable(router_from_ordered_bits(best_key) + router_from_ordered_bits(second_key));
}

__device__ __forceinline__ float router_warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float router_warp_max(float v) {
    u32 best_key;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;\n" : "=r"(best_key) : "r"(router_ordered_bits(v)));
    return router_from_ordered_bits(best_key);
}

// One warp routes one token, whose logit of expert e is logit_of(e) and the rule's bias
// bias_of(e) (not called without one); `s_selection` is this warp's EXPERTS floats of
// shared memory (used with a group limit whose groups are ranked there,
// ROUTER_GROUPS_IN_SMEM).
template <class LogitOf, class BiasOf>
__device__ __forceinline__ void router_select(LogitOf logit_of, BiasOf bias_of, int token, int* routed_ids,
                                              float* routed_weights, float* s_selection) {
    constexpr float ROUTER_SCALE = {{ router.scale }};
    constexpr float ROUTER_NORMALIZE_EPSILON = {{ router.normalize_epsilon }};  // DeepSeek-V3's guard against 0/0
    const int lane = threadIdx.x & 31;

    // Phase 1: logits, the gate bias added when the rule says so.
    float logit[ROUTER_PER_LANE];
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        logit[i] = negative_infinity();
        if (e < EXPERTS) {
            logit[i] = logit_of(e);
            if constexpr (ROUTER_BIAS == ROUTER_BIAS_LOGITS) logit[i] += bias_of(e);
        }
    }

    // Phase 2: scores (softmax over all experts, sigmoid, or the logits themselves).
    float score[ROUTER_PER_LANE];
    if constexpr (ROUTER_SCORING == ROUTER_SOFTMAX) {
        float max_logit = negative_infinity();
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; ++i) max_logit = fmaxf(max_logit, logit[i]);
        max_logit = router_warp_max(max_logit);
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; ++i) {
            score[i] = lane + 32 * i < EXPERTS ? expf(logit[i] - max_logit) : 0.f;
            sum += score[i];
        }
        sum = router_warp_sum(sum);
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; ++i) score[i] /= sum;
    } else if constexpr (ROUTER_SCORING == ROUTER_SIGMOID) {
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; ++i) score[i] = 1.f / (1.f + expf(-logit[i]));
    } else {
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; ++i) score[i] = logit[i];
    }

    // Phase 3: selection values, the score correction added when the rule says so; a set
    // bit of `unavailable` marks an entry that cannot be chosen (past EXPERTS, or outside
    // the kept groups).
    float selection[ROUTER_PER_LANE];
    u32 unavailable = 0;
#pragma unroll
    for (int i = 0; i < ROUTER_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        float v = score[i];
        if (e < EXPERTS) {
            if constexpr (ROUTER_BIAS == ROUTER_BIAS_SCORE_CORRECTION) v += bias_of(e);
        } else {
            unavailable |= 1u << i;
        }
        selection[i] = router_comparable(v);
    }

    // Phase 4: group limit. A group's value is the sum of its two best selection values;
    // the ROUTER_GROUPS_KEPT best groups hold the only eligible experts.
    if constexpr (ROUTER_GROUPS > 0 && !ROUTER_GROUPS_IN_SMEM) {
        // A group is whole entries of every lane (group g: entries [g · ENTRIES, (g + 1) ·
        // ENTRIES)), so warp reductions give every lane every group's value, and each lane
        // keeps the same groups: no shared memory, and no lane scanning its group's members
        // one after another.
        constexpr int ENTRIES = ROUTER_GROUP_SIZE >= 32 ? ROUTER_GROUP_SIZE / 32 : 1;  // (not instantiated otherwise)
        float group_value[ROUTER_GROUPS > 0 ? ROUTER_GROUPS : 1];
#pragma unroll
        for (int g = 0; g < ROUTER_GROUPS; ++g) {
            float best = negative_infinity(), second = negative_infinity();
#pragma unroll
            for (int i = g * ENTRIES; i < (g + 1) * ENTRIES; ++i) {
                if (selection[i] > best) {
                    second = best;
                    best = selection[i];
                } else if (selection[i] > second) {
                    second = selection[i];
                }
            }
            group_value[g] = router_warp_best_two_sum(best, second, lane);
        }
        u32 kept_groups = 0;
#pragma unroll
        for (int kept = 0; kept < ROUTER_GROUPS_KEPT; ++kept) {
            int best_g = -1;
            float best_v = 0.f;
#pragma unroll
            for (int g = 0; g < ROUTER_GROUPS; ++g) {
                if (!(kept_groups >> g & 1u) && (best_g < 0 || group_value[g] > best_v)) {
                    best_g = g;
                    best_v = group_value[g];
                }
            }
            kept_groups |= 1u << best_g;
        }
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; ++i) {
            if (!(kept_groups >> (i / ENTRIES) & 1u)) unavailable |= 1u << i;
        }
    } else if constexpr (ROUTER_GROUPS_IN_SMEM) {
        // Member m of group g sits at s_selection[m · GROUPS + g], so that the lanes summing
        // groups read adjacent words, not one bank.
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; ++i) {
            const int e = lane + 32 * i;
            if (e < EXPERTS) s_selection[e % ROUTER_GROUP_SIZE * ROUTER_GROUPS + e / ROUTER_GROUP_SIZE] = selection[i];
        }
        __syncwarp();
        float group_value[ROUTER_GROUPS_PER_LANE];
#pragma unroll
        for (int j = 0; j < ROUTER_GROUPS_PER_LANE; ++j) {
            const int g = lane + 32 * j;
            float best = negative_infinity(), second = negative_infinity();
            if (g < ROUTER_GROUPS) {
                for (int m = 0; m < ROUTER_GROUP_SIZE; ++m) {
                    const float v = s_selection[m * ROUTER_GROUPS + g];
                    if (v > best) {
                        second = best;
                        best = v;
                    } else if (v > second) {
                        second = v;
                    }
                }
            }
            group_value[j] = router_comparable(ROUTER_GROUP_SIZE > 1 ? best + second : best);
        }
        u32 groups_taken = 0;
        u32 eligible = 0;
        for (int kept = 0; kept < ROUTER_GROUPS_KEPT; ++kept) {
            float best_v = negative_infinity();
            int best_g = ROUTER_NONE;
#pragma unroll
            for (int j = 0; j < ROUTER_GROUPS_PER_LANE; ++j) {
                const int g = lane + 32 * j;
                if (g < ROUTER_GROUPS && !(groups_taken >> j & 1u) && router_better(group_value[j], g, best_v, best_g)) {
                    best_v = group_value[j];
                    best_g = g;
                }
            }
            router_warp_best(best_v, best_g);
            if (best_g % 32 == lane) groups_taken |= 1u << (best_g / 32);
#pragma unroll
            for (int i = 0; i < ROUTER_PER_LANE; ++i) {
                if ((lane + 32 * i) / ROUTER_GROUP_SIZE == best_g) eligible |= 1u << i;
            }
        }
        unavailable |= ~eligible;
    }

    // Phase 5: top-k by selection value, best first. A round takes the best of the lanes'
    // heads (each lane's entries sorted once); the lane whose head won drops it. The lane
    // that holds slot k (k % 32) keeps the chosen id.
    float head_v[ROUTER_PER_LANE];
    int head_e[ROUTER_PER_LANE];
    router_lane_sorted(selection, unavailable, lane, head_v, head_e);
    int chosen_id[ROUTER_K_PER_LANE] = {};
    for (int k = 0; k < TOP_K; ++k) {
        float best_v = head_v[0];
        int best_e = head_e[0];
        router_warp_best(best_v, best_e);
        if (head_e[0] == best_e) {
#pragma unroll
            for (int i = 0; i + 1 < ROUTER_PER_LANE; ++i) {
                head_v[i] = head_v[i + 1];
                head_e[i] = head_e[i + 1];
            }
            head_v[ROUTER_PER_LANE - 1] = negative_infinity();
            head_e[ROUTER_PER_LANE - 1] = ROUTER_NONE;
        }
#pragma unroll
        for (int j = 0; j < ROUTER_K_PER_LANE; ++j) {
            if (k == lane + 32 * j) chosen_id[j] = best_e;
        }
    }
    // Each chosen expert's logit and score, from the lane that holds it: one shuffle per
    // entry of a lane, after the rounds rather than in each.
    float chosen_logit[ROUTER_K_PER_LANE] = {}, chosen_score[ROUTER_K_PER_LANE] = {};
#pragma unroll
    for (int j = 0; j < ROUTER_K_PER_LANE; ++j) {
        const int owner = chosen_id[j] % 32, slot = chosen_id[j] / 32;
#pragma unroll
        for (int i = 0; i < ROUTER_PER_LANE; ++i) {
            const float their_logit = __shfl_sync(0xffffffffu, logit[i], owner);
            const float their_score = __shfl_sync(0xffffffffu, score[i], owner);
            if (i == slot) {
                chosen_logit[j] = their_logit;
                chosen_score[j] = their_score;
            }
        }
    }

    // Phase 6: weights: the chosen scores, or a softmax over the chosen logits; then
    // renormalised when the rule says so, and scaled.
    float weight[ROUTER_K_PER_LANE];
    if constexpr (ROUTER_SCORING == ROUTER_TOPK_SOFTMAX) {
        float max_logit = negative_infinity();
#pragma unroll
        for (int j = 0; j < ROUTER_K_PER_LANE; ++j) {
            if (lane + 32 * j < TOP_K) max_logit = fmaxf(max_logit, chosen_logit[j]);
        }
        max_logit = router_warp_max(max_logit);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < ROUTER_K_PER_LANE; ++j) {
            weight[j] = lane + 32 * j < TOP_K ? expf(chosen_logit[j] - max_logit) : 0.f;
            sum += weight[j];
        }
        sum = router_warp_sum(sum);
#pragma unroll
        for (int j = 0; j < ROUTER_K_PER_LANE; ++j) weight[j] /= sum;
    } else {
#pragma unroll
        for (int j = 0; j < ROUTER_K_PER_LANE; ++j) weight[j] = lane + 32 * j < TOP_K ? chosen_score[j] : 0.f;
    }
    if constexpr (ROUTER_NORMALIZE) {
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < ROUTER_K_PER_LANE; ++j) sum += weight[j];
        sum = router_warp_sum(sum) + ROUTER_NORMALIZE_EPSILON;
#pragma unroll
        for (int j = 0; j < ROUTER_K_PER_LANE; ++j) weight[j] /= sum;
    }
#pragma unroll
    for (int j = 0; j < ROUTER_K_PER_LANE; ++j) {
        const int k = lane + 32 * j;
        if (k < TOP_K) {
            routed_ids[(size_t)token * TOP_K + k] = chosen_id[j];
            routed_weights[(size_t)token * TOP_K + k] = weight[j] * ROUTER_SCALE;
        }
    }
}

enum : int { FUSED_SUM_LOADS = 128 };  // a fused router's sum: loads in flight per thread

// A fused router's token tile of logits, `tile_logits` floats from `tile_partials`: the
// sum of its `splits` partial sums (a [T, E] slice `slice` floats apart), in split order,
// into `s_logits` and, when split, into the first slice. The partial sums are read through
// L2 (ld.cg): other blocks wrote them. BATCH elements of the thread at a time, all their
// splits' loads (the loop over SPLITS, the most a call has, unrolled) issued before any is
// added: the stores into the first slice may alias the next elements' loads, so the
// compiler would keep one element's round trip to L2 after another's. The instructions,
// not only the round trips, set the pace: a batch of 2 over DeepSeek-V3's 14 splits made
// 8 round trips of its 16-element share at 16 tokens (4.5 us on an H100), and calls of
// one split, each element one load among 14 predicated ones, took as long (4.0 us at 256
// tokens, 4.9 at 512). So the caller gives calls of one split SPLITS = 1 (0.5 us at 256
// and 512), a call of one token BATCH = 1 (one element a thread), and the rest batches of
// FUSED_SUM_LOADS loads (3.5 us at 16 tokens).
template <class G, int BATCH, int SPLITS>
__device__ __forceinline__ void router_sum_tile_logits(float* tile_partials, int tile_logits, size_t slice, int splits,
                                                       float* s_logits) {
    for (int first = threadIdx.x; first < tile_logits; first += G::THREADS * BATCH) {
        float part[BATCH][SPLITS];
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int i = first + j * G::THREADS;
#pragma unroll
            for (int s = 0; s < SPLITS; ++s) {
                part[j][s] = i < tile_logits && s < splits ? __ldcg(tile_partials + i + s * slice) : 0.f;
            }
        }
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int i = first + j * G::THREADS;
            if (i >= tile_logits) break;
            float logit = part[j][0];
#pragma unroll
            for (int s = 1; s < SPLITS; ++s) {
                if (s < splits) logit += part[j][s];
            }
            s_logits[i] = logit;
            if (splits > 1) tile_partials[i] = logit;
        }
    }
}

// A fused router: gate tile (or its split's part), then (last block of its token tile)
// select, then (last token tile) routing metadata. router_tiles_done: [0] token tiles
// selected, [1 + tile] gate blocks done of each token tile.
template <class G>
__device__ __forceinline__ void router_fused(const bf16_t* __restrict__ x, const bf16_t* __restrict__ gate_weight,
                                            const float* __restrict__ gate_bias, int tokens, float* router_logits,
                                            u32* router_tiles_done, int* routed_ids, float* routed_weights,
                                            int lays_out_routing, int* __restrict__ expert_offsets,
                                            int* __restrict__ row_pair, int* __restrict__ error_word) {
    constexpr int WARPS = G::THREADS / 32;
    static_assert(G::FUSED && G::SMEM_BYTES >= router_scratch_bytes<G>(), "plan: the later phases' scratch fits the rings");
    extern __shared__ __align__(128) unsigned char smem[];
    const int token_tiles = (tokens + G::BM - 1) / G::BM;
    const GateBlock b = gate_block<G>(tokens);
    const int token_tile = b.tile / G::EXPERT_TILES;
    const size_t slice = (size_t)tokens * EXPERTS;  // floats of one split's partial logits
    // The rule's bias is a fixed weight that the select reads after every wait: bring it
    // into L2 now (the call's weights have pushed it out).
    if constexpr (ROUTER_BIAS != ROUTER_BIAS_NONE) {
        if (blockIdx.x == 0) {
            for (int e = 32 * threadIdx.x; e < EXPERTS; e += 32 * G::THREADS) prefetch_l2(gate_bias + e);
            if (threadIdx.x == 0) prefetch_l2(gate_bias + EXPERTS - 1);  // the last line, however aligned
        }
    }

    router_gate<G>(x, gate_weight, tokens, b, LogitsStore{router_logits + b.split * slice});
    // The rule's bias, for the select: loaded now, so that its round trip overlaps the
    // fence of the arrival below (in the block that selects; the others drop it).
    constexpr int BIAS_PER_THREAD = (ROUTER_BIAS_FLOATS + G::THREADS - 1) / G::THREADS;
    float bias[BIAS_PER_THREAD > 0 ? BIAS_PER_THREAD : 1];
#pragma unroll
    for (int j = 0; j < BIAS_PER_THREAD; ++j) {
        const int e = threadIdx.x + j * G::THREADS;
        bias[j] = e < ROUTER_BIAS_FLOATS ? gate_bias[e] : 0.f;
    }
    if (!last_arrival(&router_tiles_done[1 + token_tile], G::EXPERT_TILES * b.splits)) return;

    // Sum: this token tile's logits, its splits' partial sums added in split order, into
    // shared memory for the select and, when split, into the first slice (which then holds
    // the call's logits); see router_sum_tile_logits.
    const int tile_first = token_tile * G::BM;
    const int tile_end = min(tokens, tile_first + G::BM);
    const int tile_logits = (tile_end - tile_first) * EXPERTS;
    float* s_logits = reinterpret_cast<float*>(smem);  // [BM, EXPERTS]
    float* s_bias = s_logits + G::BM * EXPERTS;        // [ROUTER_BIAS_FLOATS]
    float* tile_partials = router_logits + (size_t)tile_first * EXPERTS;
#pragma unroll
    for (int j = 0; j < BIAS_PER_THREAD; ++j) {
        const int e = threadIdx.x + j * G::THREADS;
        if (e < ROUTER_BIAS_FLOATS) s_bias[e] = bias[j];
    }
    constexpr int ELEMENTS_PER_THREAD = (G::BM * EXPERTS + G::THREADS - 1) / G::THREADS;
    if (b.splits == 1) {
        router_sum_tile_logits<G, ELEMENTS_PER_THREAD, 1>(tile_partials, tile_logits, slice, 1, s_logits);
    } else if (tile_logits <= G::THREADS) {
        router_sum_tile_logits<G, 1, G::MOST_SPLITS>(tile_partials, tile_logits, slice, b.splits, s_logits);
    } else {
        constexpr int BATCH_BY_LOADS = G::MOST_SPLITS >= FUSED_SUM_LOADS ? 1 : FUSED_SUM_LOADS / G::MOST_SPLITS;
        constexpr int BATCH = BATCH_BY_LOADS < ELEMENTS_PER_THREAD ? BATCH_BY_LOADS : ELEMENTS_PER_THREAD;
        router_sum_tile_logits<G, BATCH, G::MOST_SPLITS>(tile_partials, tile_logits, slice, b.splits, s_logits);
    }
    __syncthreads();

    // Select: this token tile's tokens, a warp each.
    const int warp = threadIdx.x >> 5;
    float* s_selection = s_bias + ROUTER_BIAS_FLOATS + warp * EXPERTS;
    for (int token = tile_first + warp; token < tile_end; token += WARPS) {
        const float* s_row = s_logits + (token - tile_first) * EXPERTS;
        router_select([&](int e) { return s_row[e]; }, [&](int e) { return s_bias[e]; }, token, routed_ids,
                      routed_weights, s_selection);
    }
    // The last token tile selected goes on; with one token tile, that is this block (its
    // choices are visible to it after the barrier, and the routing's counts may then reuse
    // the shared memory).
    if (token_tiles > 1) {
        if (!last_arrival(&router_tiles_done[0], token_tiles)) return;
    } else {
        __syncthreads();
    }

    // Routing metadata over every token's choices, unless something else routes the call:
    // the fused decode, the GEMMs' blocks or the expert-parallel kernels.
    if (!lays_out_routing) return;
    int* s_count = reinterpret_cast<int*>(smem);
    route_pairs<G::THREADS>(routed_ids, tokens, expert_offsets, row_pair, error_word, s_count, s_count + GEMM_EXPERTS);
}

// The last block of a split gate tile to finish adds the parts up in split order into the
// first slice, which the select kernel reads: SUM_BATCH elements of the thread at a time,
// the loop over b.splits unrolled SPLITS_IN_FLIGHT times so that each round trip to L2
// brings that many b.splits' values (a split at a time, 16 b.splits of a 64-token wgmma gate
// tile took 16 round trips a pass, some 15 µs), the sums few registers (the whole tile's
// would cost the gate its second block per SM). The partial sums are read through L2
// (ld.cg): other blocks wrote them.
template <class G>
__device__ __forceinline__ void router_sum_split_tile(int tokens, const GateBlock& b, float* router_logits) {
    constexpr int SUM_BATCH = 16;
    constexpr int SPLITS_IN_FLIGHT = 4;
    constexpr int PER_THREAD = (G::BM * G::BN + G::THREADS - 1) / G::THREADS;
    const size_t slice = (size_t)tokens * EXPERTS;  // floats of one split's partial logits
    const int first_token = b.tile / G::EXPERT_TILES * G::BM, first_expert = b.tile % G::EXPERT_TILES * G::BN;
    const int rows = min(G::BM, tokens - first_token), columns = min(G::BN, EXPERTS - first_expert);
    float* base = router_logits + (size_t)first_token * EXPERTS + first_expert;
    // Element j of this thread: element threadIdx.x + j · THREADS of the tile, row-major;
    // those past the tile, the call's tokens or the experts are left alone.
    auto at = [&](int j) { return (threadIdx.x + j * G::THREADS) / G::BN * EXPERTS + (threadIdx.x + j * G::THREADS) % G::BN; };
    auto present = [&](int j) {
        const int i = threadIdx.x + j * G::THREADS;
        return i < G::BM * G::BN && i / G::BN < rows && i % G::BN < columns;
    };
    for (int first = 0; first < PER_THREAD; first += SUM_BATCH) {
        float sum[SUM_BATCH];
#pragma unroll
        for (int j = 0; j < SUM_BATCH; ++j) sum[j] = present(first + j) ? __ldcg(base + at(first + j)) : 0.f;
#pragma unroll SPLITS_IN_FLIGHT
        for (int s = 1; s < b.splits; ++s) {
            const float* part = base + s * slice;
#pragma unroll
            for (int j = 0; j < SUM_BATCH; ++j) {
                if (present(first + j)) sum[j] += __ldcg(part + at(first + j));
            }
        }
#pragma unroll
        for (int j = 0; j < SUM_BATCH; ++j) {
            if (present(first + j)) base[at(first + j)] = sum[j];
        }
    }
}

// A split router's gate: its tile, or, in a call split over blocks along the reduction,
// its part of the tile (its [T, E] slice of partial logits), the tile's last block then
// adding the parts up. router_tiles_done: [tile] blocks done of each tile of a split call.
template <class G>
__device__ __forceinline__ void router_gate_split(const bf16_t* __restrict__ x, const bf16_t* __restrict__ gate_weight,
                                                  int tokens, float* router_logits, u32* router_tiles_done) {
    static_assert(!G::FUSED, "plan: a split router's gate");
    const GateBlock b = gate_block<G>(tokens);
    router_gate<G>(x, gate_weight, tokens, b, LogitsStore{router_logits + b.split * (size_t)tokens * EXPERTS});
    if (b.splits == 1 || !last_arrival(&router_tiles_done[b.tile], b.splits)) return;
    router_sum_split_tile<G>(tokens, b, router_logits);
}

// A split router's cluster gate: the cluster takes token tile blockIdx.x / CLUSTER across
// every expert (one expert tile), this block (its rank in the cluster) k-tiles [rank,
// rank + 1) · K_TILES / CLUSTER; then, with no block waiting for any but its cluster:
//   - its partial logits into its own shared memory (in place of the first group's ring),
//     a cluster barrier;
//   - its share of the tile's tokens (rows [rank · BM / CLUSTER, (rank + 1) · BM /
//     CLUSTER)): their logits summed over the cluster's blocks in block order, four experts
//     at a time through distributed shared memory, into its shared memory and
//     router_logits; it says it is done reading the others' shared memory;
//   - those tokens selected, a warp each; it waits until the others are done with its own.
// Every call sums the same way, whatever its size.
template <class G>
__device__ __forceinline__ void router_gate_cluster(const bf16_t* __restrict__ x, const bf16_t* __restrict__ gate_weight,
                                                    const float* __restrict__ gate_bias, int tokens,
                                                    float* __restrict__ router_logits, int* __restrict__ routed_ids,
                                                    float* __restrict__ routed_weights) {
    constexpr int WARPS = G::THREADS / 32;
    constexpr int RINGS = G::WARPS_K * G::STAGES * G::STAGE_BYTES;
    constexpr int PARTIAL = 4 * G::BM * G::BN;                   // bytes of the block's partial logits
    constexpr int ROWS = (G::BM + G::CLUSTER - 1) / G::CLUSTER;  // most tokens of the tile a block selects
    constexpr int QUADS = EXPERTS / 4;                           // float4s of a token's logits
    static_assert(G::CLUSTER >= 2 && G::MOST_SPLITS == G::CLUSTER && !G::FUSED, "plan: a cluster gate splits over its cluster");
    static_assert(G::EXPERT_TILES == 1 && G::BN >= EXPERTS && EXPERTS % 4 == 0, "plan: one tile holds every expert, in whole float4s");
    static_assert(G::WARPS_K == 1 || PARTIAL <= G::STAGES * G::STAGE_BYTES, "plan: the partial logits fit the first group's ring");
    static_assert(G::SMEM_BYTES == (RINGS > PARTIAL ? RINGS : PARTIAL) +
                                       4 * (ROWS * EXPERTS + ROUTER_BIAS_FLOATS + (ROUTER_GROUPS_IN_SMEM ? WARPS * EXPERTS : 0)),
                  "plan: the rings (the partial logits in the first), then the block's tokens' logits, the bias and the selection values");
    extern __shared__ __align__(128) unsigned char smem[];
    float* s_partial = reinterpret_cast<float*>(smem);  // [BM, BN]: this block's partial logits, once its ring is done
    float* s_logits = reinterpret_cast<float*>(smem + (RINGS > PARTIAL ? RINGS : PARTIAL));  // [ROWS, EXPERTS]: its tokens' logits
    float* s_bias = s_logits + ROWS * EXPERTS;  // [ROUTER_BIAS_FLOATS]
    const int rank = cluster_ctarank();
    const GateBlock b{(int)blockIdx.x / G::CLUSTER, rank, G::CLUSTER};
    const int token0 = b.tile * G::BM;

    router_gate<G>(x, gate_weight, tokens, b,
                   [&](int token, int expert, float value) { s_partial[(token - token0) * G::BN + expert] = value; });
    for (int e = threadIdx.x; e < ROUTER_BIAS_FLOATS; e += G::THREADS) s_bias[e] = gate_bias[e];
    cluster_sync();  // every block's partial logits written, and seen by the cluster

    const int first_row = rank * G::BM / G::CLUSTER;
    const int rows = min((rank + 1) * G::BM / G::CLUSTER, tokens - token0) - first_row;  // may be none
    for (int i = threadIdx.x; i < rows * QUADS; i += G::THREADS) {
        const int row = i / QUADS, expert = i % QUADS * 4;
        const u32 address = smem_address(s_partial + (first_row + row) * G::BN + expert);
        float4 part[G::CLUSTER];
#pragma unroll
        for (int q = 0; q < G::CLUSTER; ++q) part[q] = ld_shared_cluster_f32x4(address, q);
        float4 sum = part[0];
#pragma unroll
        for (int q = 1; q < G::CLUSTER; ++q) {
            sum.x += part[q].x;
            sum.y += part[q].y;
            sum.z += part[q].z;
            sum.w += part[q].w;
        }
        *reinterpret_cast<float4*>(s_logits + row * EXPERTS + expert) = sum;
        *reinterpret_cast<float4*>(router_logits + (size_t)(token0 + first_row + row) * EXPERTS + expert) = sum;
    }
    cluster_arrive();  // done with the other blocks' shared memory
    __syncthreads();   // this block's tokens' logits are in place

    const int warp = threadIdx.x >> 5;
    float* s_selection = s_bias + ROUTER_BIAS_FLOATS + warp * EXPERTS;
    for (int row = warp; row < rows; row += WARPS) {
        const float* s_row = s_logits + row * EXPERTS;
        router_select([&](int e) { return s_row[e]; }, [&](int e) { return s_bias[e]; }, token0 + first_row + row,
                      routed_ids, routed_weights, s_selection);
    }
    cluster_wait();  // the other blocks are done with this block's partial logits
}
{%- if router.warp_specialized_gates %}

// The gate tile `b.tile` (its part `b.split` of `b.splits`) on wgmma, warp-specialised as
// the expert GEMMs' engine (see there):
//   - warpgroup 0, the producer, fills a ring of STAGES stages, each 64 columns of the
//     reduction: the tile's BM x rows with cp.async (past the call's tokens, zeros), each
//     producer thread arriving on the stage's "full" mbarrier when its copies land, and its
//     BN W_gate rows as one TMA box on the same barrier (past E, zeros);
//   - consumer warpgroup w multiplies tokens [64w, 64w + 64) of the tile by all BN experts
//     (one wgmma per 16 columns), and arrives on the stage's "empty" mbarrier once the
//     wgmma reading it has retired; then it stores its logits (or partial sums) into
//     `logits` [tokens, EXPERTS].
template <class G>
__device__ __forceinline__ void router_gate_warp_specialized(const bf16_t* __restrict__ x, const TensorMap* gate_tiles,
                                                             int tokens, const GateBlock& b, float* __restrict__ logits) {
    static_assert(G::PRODUCER_THREADS == 128 && G::THREADS == G::PRODUCER_THREADS + 2 * G::BM,
                  "plan: a producer warpgroup and a consumer warpgroup per 64 tokens");
    static_assert(G::BM % 64 == 0 && G::BN % 16 == 0 && G::BN <= 256, "plan: whole warpgroups, one wgmma wide");
    static_assert(G::A_BYTES == G::BM * SMEM_ROW_BYTES && G::STAGE_BYTES == G::A_BYTES + G::BN * SMEM_ROW_BYTES,
                  "plan: a stage is BM x rows then BN W_gate rows");
    static_assert(G::RING_ALIGN == 1024 && G::A_BYTES % 1024 == 0 && G::STAGE_BYTES % 1024 == 0,
                  "plan: every stage and box starts on the swizzle's 1024-byte period");
    static_assert(G::BARRIER_OFFSET == G::STAGES * G::STAGE_BYTES &&
                      G::SMEM_BYTES == G::RING_ALIGN + G::BARRIER_OFFSET + 2 * G::STAGES * (int)sizeof(u64),
                  "plan: [slack][STAGES x (x rows, W_gate rows)][full, empty barriers]");
    constexpr int BK = SMEM_ROW_BYTES / (int)sizeof(bf16_t);
    constexpr int K_TILES = HIDDEN / BK;
    constexpr int ROW_CHUNKS = SMEM_ROW_BYTES / 16;  // 16-byte cp.async pieces per row
    constexpr int CONSUMER_THREADS = G::THREADS - G::PRODUCER_THREADS;
    static_assert(HIDDEN % BK == 0 && G::PRODUCER_THREADS % ROW_CHUNKS == 0, "plan: whole k-tiles, whole rows per pass");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 smem_base = (smem_address(smem_raw) + (G::RING_ALIGN - 1)) & ~(u32)(G::RING_ALIGN - 1);
    const u32 full_barriers = smem_base + G::BARRIER_OFFSET;           // [STAGES]: stage loaded
    const u32 empty_barriers = full_barriers + G::STAGES * sizeof(u64);  // [STAGES]: stage read
    const int tid = threadIdx.x;
    const int token0 = b.tile / G::EXPERT_TILES * G::BM;
    const int expert0 = b.tile % G::EXPERT_TILES * G::BN;
    const int steps = K_TILES / b.splits;  // this block's k-tiles: [first_k_tile, first_k_tile + steps)
    const int first_k_tile = b.split * steps;
    if (tid == 0) {
        for (int s = 0; s < G::STAGES; ++s) {
            mbarrier_init(full_barriers + s * sizeof(u64), G::PRODUCER_THREADS);
            mbarrier_init(empty_barriers + s * sizeof(u64), CONSUMER_THREADS / 32);
        }
    }
    __syncthreads();  // the barriers are initialised for every role

    if (tid < G::PRODUCER_THREADS) {
        if (tid == 0) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(gate_tiles)) : "memory");
        const int chunk = tid % ROW_CHUNKS, first_row = tid / ROW_CHUNKS;
        constexpr int ROW_STEP = G::PRODUCER_THREADS / ROW_CHUNKS;
        u32 phase = 0;
        for (int step = 0, stage = 0; step < steps; ++step) {
            const int k_tile = first_k_tile + step;
            const u32 full = full_barriers + stage * sizeof(u64);
            const u32 stage_address = smem_base + stage * G::STAGE_BYTES;
            mbarrier_wait(empty_barriers + stage * sizeof(u64), phase ^ 1);  // the first pass finds it free
            if (tid == 0) {
                mbarrier_expect_bytes(full, G::BN * SMEM_ROW_BYTES);
                tma_load_box(stage_address + G::A_BYTES, gate_tiles, k_tile * BK, expert0, full);
            }
#pragma unroll
            for (int r = first_row; r < G::BM; r += ROW_STEP) {
                const int token = token0 + r;
                const bool valid = token < tokens;
                cp_async_16(stage_address + swizzle(r, chunk), x + (size_t)(valid ? token : 0) * HIDDEN + k_tile * BK + chunk * 8,
                            valid);
            }
            cp_async_arrive(full);
            if (++stage == G::STAGES) { stage = 0; phase ^= 1; }
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");  // leave no copy in flight behind
    } else {
        const int consumer = tid - G::PRODUCER_THREADS;
        const int warpgroup = consumer >> 7;
        float acc[G::BN / 2];
#pragma unroll
        for (int i = 0; i < G::BN / 2; ++i) acc[i] = 0.f;
        u32 phase = 0;
        int previous = -1;  // the stage of the wgmma group still in flight
        // A block has at least one k-tile. Said as a do-while: with a loop that might not
        // run, ptxas (13.0) sees the zeroed accumulators reach the epilogue without a wgmma
        // and serialises every wgmma of the kernel.
        int step = 0, stage = 0;
        do {
            mbarrier_wait(full_barriers + stage * sizeof(u64), phase);
            fence_proxy_async();  // the producers' cp.async writes (x rows), seen by wgmma
            const u32 a_base = smem_base + stage * G::STAGE_BYTES + warpgroup * 64 * SMEM_ROW_BYTES;
            const u32 b_base = smem_base + stage * G::STAGE_BYTES + G::A_BYTES;
            wgmma_fence();
#pragma unroll
            for (int k16 = 0; k16 < BK / 16; ++k16) {
                wgmma_m64k16<G::BN>(acc, wgmma_descriptor(a_base + k16 * 32), wgmma_descriptor(b_base + k16 * 32));
            }
            wgmma_commit();
            wgmma_wait<1>();  // the previous group has read its stage
            if (previous >= 0) release_stage<1>(empty_barriers + previous * sizeof(u64));
            previous = stage;
            if (++stage == G::STAGES) { stage = 0; phase ^= 1; }
        } while (++step < steps);
        wgmma_wait<0>();
        // Warp w of the warpgroup holds tokens 16w + lane/4 (+8); its n8 block j experts
        // 8j + 2(lane%4) and the next, as mma.sync's m16n8 fragments.
        const int lane = tid & 31, warp_in_group = (tid >> 5) & 3;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int token = token0 + warpgroup * 64 + warp_in_group * 16 + (lane >> 2) + half * 8;
            if (token >= tokens) continue;
            float* out = logits + (size_t)token * EXPERTS;
#pragma unroll
            for (int j = 0; j < G::BN / 8; ++j) {
                const int expert = expert0 + j * 8 + (lane & 3) * 2;
                if (expert < EXPERTS) out[expert] = acc[j * 4 + half * 2];
                if (expert + 1 < EXPERTS) out[expert + 1] = acc[j * 4 + half * 2 + 1];
            }
        }
    }
}

// A split router's gate on wgmma: as router_gate_split.
template <class G>
__device__ __forceinline__ void router_gate_split_warp_specialized(const bf16_t* __restrict__ x, const TensorMap* gate_tiles,
                                                                   int tokens, float* router_logits, u32* router_tiles_done) {
    const GateBlock b = gate_block<G>(tokens);
    router_gate_warp_specialized<G>(x, gate_tiles, tokens, b, router_logits + b.split * (size_t)tokens * EXPERTS);
    if (b.splits == 1 || !last_arrival(&router_tiles_done[b.tile], b.splits)) return;
    router_sum_split_tile<G>(tokens, b, router_logits);
}
{%- endif %}
{%- if let Some(select) = router.select %}

// The split routers' select: one warp per token, ROUTER_SELECT_WARPS tokens per block.
enum : int { ROUTER_SELECT_WARPS = {{ router.select_warps }} };
enum : int { ROUTER_SELECT_STATIC_SMEM_BYTES = {{ select.static_smem }} };
#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_{{ select.name }})
extern "C" __global__ void __launch_bounds__({{ select.threads }}) {{ select.name }}(
    {{ select.params }}
)
{
    static_assert({{ select.threads }} == 32 * ROUTER_SELECT_WARPS, "plan: one warp per token");
    // Each warp's selection values, with a group limit ranked in shared memory.
    __shared__ float s_selection[ROUTER_SELECT_WARPS][ROUTER_GROUPS_IN_SMEM ? EXPERTS : 1];
    static_assert(!ROUTER_GROUPS_IN_SMEM || static_smem_reserved(sizeof(s_selection)) == ROUTER_SELECT_STATIC_SMEM_BYTES,
                  "plan: the select kernel's static shared memory");
    const int warp = threadIdx.x >> 5;
    const int token = blockIdx.x * ROUTER_SELECT_WARPS + warp;
    if (token >= tokens) return;  // whole warps leave: the warp reductions stay full-warp
    // The logits are read through L2 (ld.cg): the gate kernel wrote them.
    const float* row = router_logits + (size_t)token * EXPERTS;
    const float* bias = {{ router.bias_arg }};
    router_select([&](int e) { return __ldcg(row + e); }, [&](int e) { return bias[e]; }, token, routed_ids,
                  routed_weights, s_selection[warp]);
}
#endif
{%- endif %}
{%- for gate in router.gates %}

// Router of regime `{{ gate.regime }}` ({{ gate.min_tokens }}..={{ gate.max_tokens }} tokens): {% if gate.fused %}fused{% else if gate.cluster > 0 %}split, its gate for these calls, which selects{% else %}split, its gate for these calls{% endif %}; gate tile {{ gate.bm }} tokens x {{ gate.bn }} experts x 64, {{ gate.stages }} stages, {% if gate.warp_specialized %}wgmma: a producer warpgroup and {{ gate.warps_m / 4 }} consumer warpgroups{% else %}{{ gate.warps_m }}x{{ gate.warps_n }} warps x {{ gate.warps_k }} groups splitting the reduction{% endif %}, {% if gate.cluster > 0 %}clusters of {{ gate.cluster }} blocks splitting it further{% else %}{{ gate.expert_tiles }} expert tiles per token tile{% endif %}
#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_{{ gate.entry.name }})
struct {{ gate.config }} {
    enum : bool { FUSED = {{ gate.fused }} };
    enum : int { BM = {{ gate.bm }}, BN = {{ gate.bn }}, STAGES = {{ gate.stages }}, EXPERT_TILES = {{ gate.expert_tiles }} };
    enum : int { WARPS_M = {{ gate.warps_m }}, WARPS_N = {{ gate.warps_n }}, WARPS_K = {{ gate.warps_k }}, THREADS = {{ gate.threads }} };
    enum : int { MOST_SPLITS = {{ gate.most_splits }} };  // blocks a tile's reduction is split over, at most (a fused router's grid says how many)
    enum : int { CLUSTER = {{ gate.cluster }} };  // a cluster gate's blocks per cluster, which split every tile's reduction (0: not one)
{%- if gate.warp_specialized %}
    enum : int { PRODUCER_THREADS = {{ gate.producer_threads }} };
    // Shared memory, bytes: [slack][STAGES x (BM x rows, BN W_gate rows)][full, empty barriers].
    enum : int { A_BYTES = {{ gate.a_bytes }}, STAGE_BYTES = {{ gate.stage_bytes }}, RING_ALIGN = {{ gate.ring_align }}, BARRIER_OFFSET = {{ gate.barrier_offset }}, SMEM_BYTES = {{ gate.smem_bytes }} };
{%- else %}
    enum : int { STAGE_BYTES = {{ gate.stage_bytes }}, SMEM_BYTES = {{ gate.smem_bytes }} };  // dynamic: WARPS_K x STAGES x (BM x rows, BN W_gate rows), or a fused router's scratch, or then a cluster gate's
{%- if gate.entry.early_start %}
    // Started early: load the first stages' W_gate rows, then wait for the kernel ahead.
{%- else %}
    // Not started early: the kernel ahead has ended, load x and W_gate rows together.
{%- endif %}
    enum : bool { WEIGHTS_BEFORE_WAIT = {{ gate.entry.early_start }} };
{%- if gate.entry.early_start && !gate.next_starts_early %}
    // GEMM1 behind this router starts as its blocks finish, not as they start: resident
    // early beside it, GEMM1's blocks cost the call (measured on the H100).
{%- endif %}
    enum : bool { NEXT_STARTS_EARLY = {{ gate.entry.early_start && gate.next_starts_early }} };
{%- endif %}
};
{%- if gate.fused %}
// One block per SM (the plan counts a fused gate's grid so; its ring fills an SM's shared
// memory): told so, ptxas need not hold the select's registers to 64 and spill them.
{%- endif %}
extern "C" __global__ void __launch_bounds__({{ gate.threads }}{% if gate.fused %}, 1{% endif %}){% if gate.cluster > 1 %} __cluster_dims__({{ gate.cluster }}, 1, 1){% endif %} {{ gate.entry.name }}(
    {{ gate.entry.params }}
)
{
{%- if gate.fused %}
    router_fused<{{ gate.config }}>(x, gate_weight, {{ router.bias_arg }}, tokens, router_logits, router_tiles_done, routed_ids,
                                    routed_weights, lays_out_routing, expert_offsets, row_pair, error_word);
{%- else if gate.cluster > 0 %}
    router_gate_cluster<{{ gate.config }}>(x, gate_weight, {{ router.bias_arg }}, tokens, router_logits, routed_ids, routed_weights);
{%- else if gate.warp_specialized %}
    router_gate_split_warp_specialized<{{ gate.config }}>(x, &gate_weight_tiles, tokens, router_logits, router_tiles_done);
{%- else %}
    router_gate_split<{{ gate.config }}>(x, gate_weight, tokens, router_logits, router_tiles_done);
{%- endif %}
}
#endif
{%- endfor %}