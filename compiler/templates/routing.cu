// ---------------------------------------------------------------------------------------
// Routing: count (token, k) pairs per expert, derive each expert's first row, and write
// the expert-major row order as each row's combine slot (token · SLOTS_PER_TOKEN + k).
// The shared slices follow the routed experts, every token once each, in token order.
// route_pairs runs on one block (the route kernel's, or in a self-routed call the
// router's last); regimes with many pairs use the count and place kernels further down
// instead; calls of a few pairs need neither where every block that reads the metadata
// lays it out itself (route_in_block). No host synchronisation. Row order inside a routed
// expert depends on atomic order, which changes no result: every row is computed the same
// way wherever it sits (the GEMMs split k-loops by stream-K only where a routed expert's
// rows fit one m-tile), and the combine reads rows by (token, k) slot.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ void report_error(int* error_word, int code, int token, int k, int value) {
    if (atomicCAS(error_word, 0, code) == 0) {
        error_word[1] = token;
        error_word[2] = k;
        error_word[3] = value;
    }
}

// Ids a thread reads before it uses any: one block walks every pair of the call, and a
// read at a time waits out an L2 round trip per pair. Measured on an H200 (2026-11-30),
// Qwen3-30B-A3B's route: 44.8 -> 36.6 us at 4096 tokens, 171 -> 138 us at 16384; the rest
// is one SM's shared-memory atomics and scattered row stores.
enum : int { ROUTE_BATCH = 8 };

// Ids first + i·THREADS (i < ROUTE_BATCH) of the call's `pairs`, all read before any is
// used (coalesced across the block; -1 past the end, never used).
template <int THREADS>
__device__ __forceinline__ void load_route_batch(const int* topk_ids, int pairs, int first, int* ids) {
#pragma unroll
    for (int i = 0; i < ROUTE_BATCH; ++i) {
        const int p = first + i * THREADS;
        ids[i] = p < pairs ? __ldcg(topk_ids + p) : -1;
    }
}

// The routing metadata of one call, by one block of THREADS threads with `s_count` and
// `s_offset` (GEMM_EXPERTS and GEMM_EXPERTS + 1 ints) in its shared memory. The ids are read
// through L2 (ld.cg): a self-routed call's router wrote them earlier in the same kernel.
template <int THREADS>
__device__ __forceinline__ void route_pairs(const int* topk_ids, int tokens, int* __restrict__ expert_offsets,
                                            int* __restrict__ row_pair, int* __restrict__ error_word, int* s_count,
                                            int* s_offset) {
    const int pairs = tokens * TOP_K;

    // Phase 1: count pairs per expert; reject ids outside 0..EXPERTS. This runs first in
    // every call, so it clears the error word of the previous one.
    if (threadIdx.x < 4) error_word[threadIdx.x] = 0;
    for (int e = threadIdx.x; e < GEMM_EXPERTS; e += THREADS) s_count[e] = e < EXPERTS ? 0 : tokens;
    __syncthreads();
    for (int first = threadIdx.x; first < pairs; first += THREADS * ROUTE_BATCH) {
        int ids[ROUTE_BATCH];
        load_route_batch<THREADS>(topk_ids, pairs, first, ids);
#pragma unroll
        for (int i = 0; i < ROUTE_BATCH; ++i) {
            const int p = first + i * THREADS, expert = ids[i];
            if (p >= pairs) break;
            if ((unsigned)expert < (unsigned)EXPERTS) {
                atomicAdd(&s_count[expert], 1);
            } else {
                report_error(error_word, ERROR_EXPERT_ID_OUT_OF_RANGE, p / TOP_K, p % TOP_K, expert);
            }
        }
    }
    __syncthreads();

    // Phase 2: first row of each expert.
    if (threadIdx.x < 32) warp_exclusive_scan(GEMM_EXPERTS, [&](int e) { return s_count[e]; }, s_offset);
    __syncthreads();
    for (int e = threadIdx.x; e <= GEMM_EXPERTS; e += THREADS) expert_offsets[e] = s_offset[e];
    for (int e = threadIdx.x; e < EXPERTS; e += THREADS) s_count[e] = 0;
    __syncthreads();

    // Phase 3: place each pair at its expert's next free row.
    for (int first = threadIdx.x; first < pairs; first += THREADS * ROUTE_BATCH) {
        int ids[ROUTE_BATCH];
        load_route_batch<THREADS>(topk_ids, pairs, first, ids);
#pragma unroll
        for (int i = 0; i < ROUTE_BATCH; ++i) {
            const int p = first + i * THREADS, expert = ids[i];
            if (p >= pairs) break;
            if ((unsigned)expert < (unsigned)EXPERTS) {
                row_pair[s_offset[expert] + atomicAdd(&s_count[expert], 1)] = p / TOP_K * SLOTS_PER_TOKEN + p % TOP_K;
            }
        }
    }
    for (int i = threadIdx.x; i < tokens * SHARED_SLICES; i += THREADS) {
        const int slice = i / tokens, token = i % tokens;
        row_pair[s_offset[EXPERTS + slice] + token] = token * SLOTS_PER_TOKEN + TOP_K + slice;
    }
}

// The routing of one call, laid out by one block in its shared memory: the expert-major
// order of route_pairs (routed experts, then the shared slices), but each expert's rows in
// pair order, so that every block derives the same rows (a GEMM2 tile reads the rows that
// other blocks' GEMM1 tiles wrote). Blocks that route this way need no route launch ahead
// of them: the fused decode's, and the table GEMMs' in calls of at most
// BLOCK_ROUTING_MAX_PAIRS pairs. One warp places 32 pairs at a time: lanes with the same
// expert take consecutive rows in lane order. Ids out of range are left out; with an
// error word (the call's first kernel: the fused decode, GEMM1), its block 0 clears it
// and reports the first of them.
template <int THREADS>
__device__ __forceinline__ void route_in_block(const int* topk_ids, int tokens, int* __restrict__ error_word,
                                               int* s_offsets, int* s_row_pair, int* s_fill) {
    const int pairs = tokens * TOP_K;
    const bool reports = error_word != nullptr && blockIdx.x == 0;
    if (reports && threadIdx.x < 4) error_word[threadIdx.x] = 0;
    for (int e = threadIdx.x; e < GEMM_EXPERTS; e += THREADS) s_fill[e] = e < EXPERTS ? 0 : tokens;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += THREADS) {
        const int expert = topk_ids[p];
        if ((unsigned)expert < (unsigned)EXPERTS) {
            atomicAdd(&s_fill[expert], 1);
        } else if (reports) {
            report_error(error_word, ERROR_EXPERT_ID_OUT_OF_RANGE, p / TOP_K, p % TOP_K, expert);
        }
    }
    __syncthreads();
    if (threadIdx.x < 32) warp_exclusive_scan(GEMM_EXPERTS, [&](int e) { return s_fill[e]; }, s_offsets);
    __syncthreads();
    for (int e = threadIdx.x; e < EXPERTS; e += THREADS) s_fill[e] = 0;
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        for (int first = 0; first < pairs; first += 32) {
            const int p = first + lane;
            const int expert = p < pairs ? topk_ids[p] : -1;
            const bool placed = (unsigned)expert < (unsigned)EXPERTS;
            const u32 same = __match_any_sync(0xffffffffu, placed ? expert : -1);
            const int before = __popc(same & ((1u << lane) - 1));
            if (placed) s_row_pair[s_offsets[expert] + s_fill[expert] + before] = p / TOP_K * SLOTS_PER_TOKEN + p % TOP_K;
            __syncwarp();
            if (placed && before == 0) s_fill[expert] += __popc(same);
            __syncwarp();
        }
    }
    for (int i = threadIdx.x; i < tokens * SHARED_SLICES; i += THREADS) {
        const int slice = i / tokens, token = i % tokens;
        s_row_pair[s_offsets[EXPERTS + slice] + token] = token * SLOTS_PER_TOKEN + TOP_K + slice;
    }
    __syncthreads();
}

{%- if let Some(route) = route %}
#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_{{ route.name }})
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS) {{ route.name }}(
    {{ route.params }}
)
{
{%- if route.early_start %}
    start_after_previous_kernel();
{%- endif %}
    __shared__ int s_count[GEMM_EXPERTS];
    __shared__ int s_offset[GEMM_EXPERTS + 1];
    static_assert(static_smem_reserved(sizeof(s_count) + sizeof(s_offset)) == {{ route.static_smem }},
                  "plan: routing's static shared memory");
    route_pairs<ROUTE_THREADS>(topk_ids, tokens, expert_offsets, row_pair, error_word, s_count, s_offset);
}
#endif
{%- endif %}
{%- if let Some(count) = route_count %}
{%- if let Some(place) = route_place %}

// ---------------------------------------------------------------------------------------
// Routing over several blocks, for regimes with many pairs (the same metadata as above):
//   count: block b counts the pairs of its slice per expert into route_block_counts[b];
//   place: every block sums those counts, all blocks' (each expert's first row) and the
//          blocks' before it (where its slice starts in each expert), then places its
//          slice; block 0 writes the expert offsets.
// The count launch clears the error word; the place launch reports ids out of range.
// ---------------------------------------------------------------------------------------
// The pairs [first, end) of `pairs` that block `block` of `blocks` takes.
__device__ __forceinline__ int2 route_slice(int pairs, int block, int blocks) {
    const long long per_block = ((long long)pairs + blocks - 1) / blocks;
    const int first = (int)min((long long)pairs, block * per_block);
    return make_int2(first, (int)min((long long)pairs, first + per_block));
}

#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_{{ count.name }})
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS) {{ count.name }}(
    {{ count.params }}
)
{
{%- if count.early_start %}
    start_after_previous_kernel();
{%- endif %}
    __shared__ int s_count[EXPERTS];
    static_assert(static_smem_reserved(sizeof(s_count)) == {{ count.static_smem }}, "plan: route count's static shared memory");
    if (blockIdx.x == 0 && threadIdx.x < 4) error_word[threadIdx.x] = 0;
    for (int e = threadIdx.x; e < EXPERTS; e += ROUTE_THREADS) s_count[e] = 0;
    __syncthreads();
    const int2 slice = route_slice(tokens * TOP_K, blockIdx.x, gridDim.x);
    for (int first = slice.x + threadIdx.x; first < slice.y; first += ROUTE_THREADS * ROUTE_BATCH) {
        int ids[ROUTE_BATCH];
        load_route_batch<ROUTE_THREADS>(topk_ids, slice.y, first, ids);
#pragma unroll
        for (int i = 0; i < ROUTE_BATCH; ++i) {
            if ((unsigned)ids[i] < (unsigned)EXPERTS) atomicAdd(&s_count[ids[i]], 1);
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < EXPERTS; e += ROUTE_THREADS) route_block_counts[blockIdx.x * EXPERTS + e] = s_count[e];
}
#endif

#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_{{ place.name }})
extern "C" __global__ void __launch_bounds__(ROUTE_THREADS) {{ place.name }}(
    {{ place.params }}
)
{
{%- if place.early_start %}
    start_after_previous_kernel();
{%- endif %}
    __shared__ int s_before[GEMM_EXPERTS];  // this expert's pairs in the blocks before this one
    __shared__ int s_next[GEMM_EXPERTS];    // every block's pairs of it, then this block's next row in it
    __shared__ int s_offset[GEMM_EXPERTS + 1];
    static_assert(static_smem_reserved(sizeof(s_before) + sizeof(s_next) + sizeof(s_offset)) == {{ place.static_smem }},
                  "plan: route place's static shared memory");
    for (int e = threadIdx.x; e < GEMM_EXPERTS; e += ROUTE_THREADS) {
        int total = tokens, before = 0;  // a shared slice: every token, this block places none
        if (e < EXPERTS) {
            total = 0;
#pragma unroll 8
            for (int b = 0; b < (int)gridDim.x; ++b) {
                const int pairs = route_block_counts[b * EXPERTS + e];
                total += pairs;
                before += b < (int)blockIdx.x ? pairs : 0;
            }
        }
        s_next[e] = total;
        s_before[e] = before;
    }
    __syncthreads();
    if (threadIdx.x < 32) warp_exclusive_scan(GEMM_EXPERTS, [&](int e) { return s_next[e]; }, s_offset);
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int e = threadIdx.x; e <= GEMM_EXPERTS; e += ROUTE_THREADS) expert_offsets[e] = s_offset[e];
    }
    for (int e = threadIdx.x; e < GEMM_EXPERTS; e += ROUTE_THREADS) s_next[e] = s_offset[e] + s_before[e];
    __syncthreads();

    const int2 slice = route_slice(tokens * TOP_K, blockIdx.x, gridDim.x);
    for (int first = slice.x + threadIdx.x; first < slice.y; first += ROUTE_THREADS * ROUTE_BATCH) {
        int ids[ROUTE_BATCH];
        load_route_batch<ROUTE_THREADS>(topk_ids, slice.y, first, ids);
#pragma unroll
        for (int i = 0; i < ROUTE_BATCH; ++i) {
            const int p = first + i * ROUTE_THREADS, expert = ids[i];
            if (p >= slice.y) break;
            if ((unsigned)expert < (unsigned)EXPERTS) {
                row_pair[atomicAdd(&s_next[expert], 1)] = p / TOP_K * SLOTS_PER_TOKEN + p % TOP_K;
            } else {
                report_error(error_word, ERROR_EXPERT_ID_OUT_OF_RANGE, p / TOP_K, p % TOP_K, expert);
            }
        }
    }
    for (int i = blockIdx.x * ROUTE_THREADS + threadIdx.x; i < tokens * SHARED_SLICES; i += gridDim.x * ROUTE_THREADS) {
        const int slice_index = i / tokens, token = i % tokens;
        row_pair[s_offset[EXPERTS + slice_index] + token] = token * SLOTS_PER_TOKEN + TOP_K + slice_index;
    }
}
#endif
{%- endif %}
{%- endif %}
{%- if let Some(sort) = sort_rows %}

// ---------------------------------------------------------------------------------------
// Sorted rows: x's rows copied into the expert-major row order, sorted_x row p holding the
// token of row_pair[p], so that a warp-specialised GEMM1 loads its A rows as TMA tiles:
// gathered a 16-byte cp.async at a time, they cost its producer and consumers 13-24% of
// the GEMM (measured without them, one H200, 2026-12-01). Two launches:
//   - invert: pair_row[row_pair[p]] = p for each of the call's rows p, one block per token's
//     worth of rows;
//   - sort: one block per token, which reads its row of x once and writes it to each of its
//     rows (walking the rows in order instead read x once per copy, from HBM once x
//     outgrows L2). A pair the routing left out (it reported the id) has a stale pair_row
//     entry: its row's row_pair names another pair, and the copy skips it. Rows past the
//     call's are not written, and no GEMM tile stores them.
// ---------------------------------------------------------------------------------------
{{ self.sort_rows_guard() }}
enum : int { INVERT_ROWS_THREADS = {{ invert_rows_threads }} };
enum : int { SORT_ROWS_THREADS = {{ sort_rows_threads }} };
static_assert(HIDDEN % 8 == 0, "plan: rows of whole 16-byte vectors");
static_assert(SLOTS_PER_TOKEN <= SORT_ROWS_THREADS, "plan: a thread per row of a token looks it up");
#endif
{%- if let Some(invert) = invert_rows %}

#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_{{ invert.name }})
extern "C" __global__ void __launch_bounds__(INVERT_ROWS_THREADS) {{ invert.name }}(
    {{ invert.params }}
)
{
{%- if invert.early_start %}
    start_after_previous_kernel();
{%- endif %}
    const int rows = expert_offsets[GEMM_EXPERTS];
    for (int i = threadIdx.x; i < SLOTS_PER_TOKEN; i += INVERT_ROWS_THREADS) {
        const int row = blockIdx.x * SLOTS_PER_TOKEN + i;
        if (row < rows) pair_row[row_pair[row]] = row;
    }
}
#endif
{%- endif %}

#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_{{ sort.name }})
extern "C" __global__ void __launch_bounds__(SORT_ROWS_THREADS) {{ sort.name }}(
    {{ sort.params }}
)
{
{%- if sort.early_start %}
    start_after_previous_kernel();
{%- endif %}
    __shared__ int s_row[SLOTS_PER_TOKEN];  // this token's rows, -1 for a pair left out
    static_assert(static_smem_reserved(sizeof(s_row)) == {{ sort.static_smem }}, "plan: sort's static shared memory");
    const int token = blockIdx.x;
    if (threadIdx.x < SLOTS_PER_TOKEN) {
        const int pair = token * SLOTS_PER_TOKEN + threadIdx.x;
        const int row = pair_row[pair];
        const bool current = row >= 0 && row < expert_offsets[GEMM_EXPERTS] && row_pair[row] == pair;
        s_row[threadIdx.x] = current ? row : -1;
    }
    __syncthreads();
    for (int column = threadIdx.x * 8; column < HIDDEN; column += SORT_ROWS_THREADS * 8) {
        const Vec16 v = *reinterpret_cast<const Vec16*>(x + (size_t)token * HIDDEN + column);
#pragma unroll 4
        for (int k = 0; k < SLOTS_PER_TOKEN; ++k) {
            if (s_row[k] >= 0) *reinterpret_cast<Vec16*>(sorted_x + (size_t)s_row[k] * HIDDEN + column) = v;
        }
    }
}
#endif
{%- endif %}
{%- if shared_gated %}

// ---------------------------------------------------------------------------------------
// The shared expert gate (a gated shared expert, as Qwen2-MoE's): token t's shared slices
// weigh sigmoid(x[t] · w_gate). One GPU's GEMM1 computes the weights before its tiles
// (GEMM2 reads them once GEMM1 is done), a rank's gate launch before arrange, which gives
// them to the shared rows; a fused decode's shared-slice GEMM2 tiles compute their own in
// shared memory. A warp per token: 16-byte loads of x's row and of the gate, f32 products,
// the lanes' sums added in a fixed order (the same weight every call, on every path).
// ---------------------------------------------------------------------------------------
// Tokens first, first + stride, ... below `tokens`, by a warp that numbers itself `first`
// among `stride`; lane 0 hands each weight to store(token, weight).
template <class Store>
__device__ __forceinline__ void shared_gate_weights_of(const bf16_t* __restrict__ x, const bf16_t* __restrict__ shared_expert_gate,
                                                       int tokens, int first, int stride, Store store) {
    static_assert(HIDDEN % 8 == 0, "plan: x's rows are whole 16-byte vectors");
    enum : int { VECTORS = HIDDEN / 8, VECTORS_PER_LANE = (VECTORS + 31) / 32 };
    const int lane = threadIdx.x & 31;
    const uint4* gate = reinterpret_cast<const uint4*>(shared_expert_gate);
    for (int token = first; token < tokens; token += stride) {
        const uint4* row = reinterpret_cast<const uint4*>(x + (size_t)token * HIDDEN);
        float sum = 0.f;
        // Four of a lane's vectors loaded at once, then multiplied: a dependent load per
        // vector made a prefill's GEMM1 wait out HIDDEN / 256 memory round trips per token.
        for (int first_vector = 0; first_vector < VECTORS_PER_LANE; first_vector += 4) {
            uint4 a[4], b[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int v = lane + 32 * (first_vector + j);
                a[j] = v < VECTORS ? row[v] : uint4{0u, 0u, 0u, 0u};
                b[j] = v < VECTORS ? __ldg(gate + v) : uint4{0u, 0u, 0u, 0u};
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 xa[4] = {a[j].x, a[j].y, a[j].z, a[j].w}, wb[4] = {b[j].x, b[j].y, b[j].z, b[j].w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    sum += bf16_to_float((bf16_t)(xa[i] & 0xffffu)) * bf16_to_float((bf16_t)(wb[i] & 0xffffu));
                    sum += bf16_to_float((bf16_t)(xa[i] >> 16)) * bf16_to_float((bf16_t)(wb[i] >> 16));
                }
            }
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        if (lane == 0) store(token, 1.f / (1.f + expf(-sum)));
    }
}

// Every token of the call by this block's warps, each weight handed to store(token,
// weight): a fused decode's shared-slice tile, into its block's shared memory.
template <int THREADS, class Store>
__device__ __forceinline__ void block_shared_gate_weights(const bf16_t* __restrict__ x, const bf16_t* __restrict__ shared_expert_gate,
                                                          int tokens, Store store) {
    shared_gate_weights_of(x, shared_expert_gate, tokens, (int)(threadIdx.x >> 5), THREADS / 32, store);
}

// Every token of the call by the grid's warps, spread over the blocks first (so that a
// small call delays one warp of a few blocks), into shared_gate.
__device__ __forceinline__ void shared_gate_weights(const bf16_t* __restrict__ x, const bf16_t* __restrict__ shared_expert_gate,
                                                    int tokens, float* __restrict__ shared_gate) {
    shared_gate_weights_of(x, shared_expert_gate, tokens, (int)(threadIdx.x >> 5) * (int)gridDim.x + (int)blockIdx.x,
                           (int)gridDim.x * (int)(blockDim.x >> 5), [&](int token, float weight) { shared_gate[token] = weight; });
}
{%- if let Some(gate) = shared_gate %}

// A rank's gate launch: SHARED_GATE_TOKENS_PER_BLOCK warps a block.
enum : int { SHARED_GATE_TOKENS_PER_BLOCK = {{ shared_gate_tokens_per_block }} };
#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_{{ gate.name }})
extern "C" __global__ void __launch_bounds__(32 * SHARED_GATE_TOKENS_PER_BLOCK) {{ gate.name }}(
    {{ gate.params }}
)
{
    shared_gate_weights(x, shared_expert_gate, tokens, shared_gate);
}
#endif
{%- endif %}
{%- endif %}
