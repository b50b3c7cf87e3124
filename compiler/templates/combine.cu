// ---------------------------------------------------------------------------------------
// Combine: y[t] = sum over k of slot[t, k], in k order (deterministic, no float atomics):
// the routed pairs, then the shared slices. Each thread sums 8 columns (one 16-byte
// vector) at a time; the single-GPU combine spreads a token's row over
// COMBINE_BLOCKS_PER_TOKEN blocks of one step each, so that a few tokens still use many SMs.
// ---------------------------------------------------------------------------------------
// Eight columns from `column` of the sum of SLOTS result rows, in k order; `rows[k]` is
// nullptr where the pair is absent (the routing reported it). THROUGH_L2: the rows were
// written by other blocks of the running kernel.
template <int SLOTS, bool THROUGH_L2 = false>
__device__ __forceinline__ Vec16 sum_slot_vectors(const bf16_t* const* rows, int column) {
    // A batch of slots' vectors at a time, loaded before they are summed so that their
    // loads are in flight together (left to itself, ptxas interleaved some with the sums:
    // Qwen3-30B-A3B's combine took 4.2 instead of 2.9 us at one token); every slot in one
    // batch up to 16 (DeepSeek-V3's 9 as 8 + 1 took 5.4 instead of 4.2 us), so that the
    // registers this holds stay bounded for a large K.
    constexpr int BATCH = SLOTS <= 16 ? SLOTS : 8;
    float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int first = 0; first < SLOTS; first += BATCH) {
        Vec16 v[BATCH];
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int k = first + j;
            if (k >= SLOTS || rows[k] == nullptr) continue;
            const Vec16* source = reinterpret_cast<const Vec16*>(rows[k] + column);
            if constexpr (THROUGH_L2) {
                asm volatile("ld.global.cg.v4.u32 { %0, %1, %2, %3}, [%4];\n"
                             : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w)
                             : "l"(source));
            } else {
                v[j] = *source;
            }
        }
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int k = first + j;
            if (k >= SLOTS || rows[k] == nullptr) continue;
            const u32 words[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                sum[2 * i] += bf16_to_float((bf16_t)(words[i] & 0xffffu));
                sum[2 * i + 1] += bf16_to_float((bf16_t)(words[i] >> 16));
            }
        }
    }
    Vec16 packed;
    packed.x = pack_bf16x2(sum[0], sum[1]);
    packed.y = pack_bf16x2(sum[2], sum[3]);
    packed.z = pack_bf16x2(sum[4], sum[5]);
    packed.w = pack_bf16x2(sum[6], sum[7]);
    return packed;
}

// The sum of one token's SLOTS result rows into its output row `y_row`, in k order, over
// columns [first_column, end_column) by COMBINE_THREADS threads, of which this is `thread`.
template <int SLOTS>
__device__ __forceinline__ void combine_rows(const bf16_t* const* rows, bf16_t* y_row, int thread,
                                             int first_column = 0, int end_column = HIDDEN) {
    for (int column = first_column + thread * 8; column < end_column; column += COMBINE_THREADS * 8) {
        *reinterpret_cast<Vec16*>(y_row + column) = sum_slot_vectors<SLOTS>(rows, column);
    }
}

// The sum of one token's SLOTS slots of `slots` that are `present` into its row of `y`,
// over columns [first_column, end_column), this being `thread` of COMBINE_THREADS.
template <int SLOTS>
__device__ __forceinline__ void combine_token(const bf16_t* slots, int token, const bool* present, bf16_t* y,
                                              int thread, int first_column = 0, int end_column = HIDDEN) {
    const bf16_t* rows[SLOTS];
#pragma unroll
    for (int k = 0; k < SLOTS; ++k) rows[k] = present[k] ? slots + ((size_t)token * SLOTS + k) * HIDDEN : nullptr;
    combine_rows<SLOTS>(rows, y + (size_t)token * HIDDEN, thread, first_column, end_column);
}

#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_{{ combine.name }})
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) {{ combine.name }}(
    {{ combine.params }}
)
{
{%- if combine.early_start %}
    start_after_previous_kernel();
{%- endif %}
    const int token = blockIdx.x / COMBINE_BLOCKS_PER_TOKEN;
    const int first_column = blockIdx.x % COMBINE_BLOCKS_PER_TOKEN * COMBINE_COLUMNS_PER_BLOCK;
    const int end_column = min(first_column + COMBINE_COLUMNS_PER_BLOCK, HIDDEN);
    bool present[SLOTS_PER_TOKEN];
#pragma unroll
    for (int k = 0; k < SLOTS_PER_TOKEN; ++k) {
        present[k] = k >= TOP_K || (unsigned)topk_ids[token * TOP_K + k] < (unsigned)EXPERTS;
    }
    combine_token<SLOTS_PER_TOKEN>(combine_slots, token, present, y, threadIdx.x, first_column, end_column);
}
#endif
