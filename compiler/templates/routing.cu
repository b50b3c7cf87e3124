// ---------------------------------------------------------------------------------------
// Routing: count (token, k) pairs per expert, derive each expert's first row, and write
// the expert-major row order as each row's combine slot (token · SLOTS_PER_TOKEN + k).
// The shared slices follow the routed experts, every token once each, in token order.
// One block (the route kernel's, or in a self-routed call the router's last); no host
// synchronisation. Row order inside an expert depends on atomic order,
// which changes no result: every row is computed the same way wherever it sits, and the
// combine reads rows by (token, k) slot.
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
constexpr int ROUTE_BATCH = 8;

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
    static_assert(static_smem_reserved(sizeof(s_count) + sizeof(s_offset)) == ROUTE_STATIC_SMEM_BYTES,
                  "plan: routing's static shared memory");
    route_pairs<ROUTE_THREADS>(topk_ids, tokens, expert_offsets, row_pair, error_word, s_count, s_offset);
}
#endif
