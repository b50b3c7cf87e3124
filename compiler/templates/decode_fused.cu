// ---------------------------------------------------------------------------------------
// Fused decode: a call of a few tokens as one persistent kernel, in place of route ->
// gemm1 -> gemm2 -> combine. A decode call is mostly ramps (each launch's start, first
// loads and last wave), so this kernel keeps one grid busy from the first weight load to
// the last sum:
//   1. every block lays out the call's routing in its own shared memory (no block waits
//      for another to route);
//   2. work units, first every GEMM1 tile, then every GEMM2 tile, each claimed from a
//      ticket counter (a block claims its next unit while it works on the current one).
//      A GEMM1 tile counts itself in at its expert once stored. A GEMM2 tile issues its
//      first weight stages, then waits only for its own expert's GEMM1 tiles, not the
//      whole GEMM1;
//   3. the last GEMM2 tile to store a column tile sums that column tile of every token's
//      slots into y, in k order, as the combine kernel does.
// Units are claimed in increasing order and GEMM1 tiles never wait, so every tile a GEMM2
// tile waits for has been claimed by a running block that will finish it: no deadlock,
// whether or not every block of the grid is resident (the plan sizes the grid so that
// they are, for speed). Each wait is bounded all the same (a time-out names the expert,
// FLAG_KIND_EXPERT_ROWS). The counters are zero between calls: the last user of each
// puts it back, by taking off what the call added, so that even a call whose wait timed
// out leaves them right for the next.
// ---------------------------------------------------------------------------------------

// Columns [first_column, first_column + COLUMNS) of every token's output: the sum of its
// slots in k order, by the whole block. The slots were stored by other blocks of this
// kernel: read through L2.
template <int THREADS, int COLUMNS>
__device__ __forceinline__ void combine_columns(const bf16_t* slots, const int* topk_ids, int tokens, int first_column,
                                                bf16_t* __restrict__ y) {
    constexpr int VECTORS = COLUMNS / 8;
    static_assert(COLUMNS % 8 == 0, "plan: a column tile is whole 16-byte vectors");
    for (int v = threadIdx.x; v < tokens * VECTORS; v += THREADS) {
        const int token = v / VECTORS, column = first_column + v % VECTORS * 8;
        const bf16_t* rows[SLOTS_PER_TOKEN];
#pragma unroll
        for (int k = 0; k < SLOTS_PER_TOKEN; ++k) {
            const bool present = k >= TOP_K || (unsigned)topk_ids[token * TOP_K + k] < (unsigned)EXPERTS;
            rows[k] = present ? slots + ((size_t)token * SLOTS_PER_TOKEN + k) * HIDDEN : nullptr;
        }
        *reinterpret_cast<Vec16*>(y + (size_t)token * HIDDEN + column) = sum_slot_vectors<SLOTS_PER_TOKEN, true>(rows, column);
    }
}

// The fused call, with the regime's two GEMM configurations: G1 (GEMM_UP) and G2
// (GEMM_DOWN), both mma.sync with the same threads; the kernel's dynamic shared memory
// is the larger ring. A gated shared expert's gate (shared_expert_gate; nullptr for
// other layers) weighs the shared slices' rows, each of their GEMM2 tiles computing the
// call's weights in its block's shared memory. `counters`: [GEMM_EXPERTS] GEMM1 tiles
// stored per expert, then [GEMM_EXPERTS] GEMM2 tiles that have read them, then [N / BN of
// G2] GEMM2 tiles stored per column tile, then the next unit's ticket and the blocks done
// claiming.
template <class G1, class G2, int MAX_ROWS, int STATIC_SMEM>
__device__ __forceinline__ void fused_decode(
    const bf16_t* __restrict__ x, const bf16_t* __restrict__ w1, const float* __restrict__ w1_bias,
    const bf16_t* __restrict__ w2, const float* __restrict__ w2_bias, const bf16_t* __restrict__ shared_expert_gate,
    const int* __restrict__ topk_ids, const float* __restrict__ topk_weights, int tokens, bf16_t* __restrict__ intermediate,
    bf16_t* __restrict__ combine_slots, u32* __restrict__ counters, int* __restrict__ error_word,
    bf16_t* __restrict__ y)
{
    assert_gemm_layout<G1>();
    assert_gemm_layout<G2>();
    static_assert(G1::KIND == GEMM_UP && G2::KIND == GEMM_DOWN && !G1::EP && !G2::EP, "plan: one GPU's GEMM1 and GEMM2");
    static_assert(G1::THREADS == G2::THREADS && G1::PRODUCER_THREADS == 0 && G2::PRODUCER_THREADS == 0,
                  "plan: both GEMMs mma.sync, with the same threads");
    static_assert(G1::RING_ALIGN == G2::RING_ALIGN && G1::ALIGN_SLACK >= G1::RING_ALIGN - 16 &&
                      G2::ALIGN_SLACK >= G2::RING_ALIGN - 16,
                  "plan: one ring alignment, and slack to reach it");
    constexpr int THREADS = G1::THREADS;
    constexpr int K_TILES1 = k_tiles<G1>(), N_TILES1 = G1::N / G1::BN;
    constexpr int K_TILES2 = k_tiles<G2>(), N_TILES2 = G2::N / G2::BN;
    u32* expert_rows_done = counters;                         // GEMM1 tiles stored, per expert
    u32* expert_rows_read = counters + GEMM_EXPERTS;          // GEMM2 tiles that waited for them
    u32* columns_done = counters + 2 * GEMM_EXPERTS;          // GEMM2 tiles stored, per column tile
    u32* next_unit = counters + 2 * GEMM_EXPERTS + N_TILES2;  // the next unit's ticket
    u32* blocks_done = next_unit + 1;                         // blocks that claimed past the last unit

    unsigned char* smem = aligned_ring<G1>();
    __shared__ int s_offsets[GEMM_EXPERTS + 1];
    __shared__ int s_row_pair[MAX_ROWS];
    __shared__ int s_fill[GEMM_EXPERTS];
    __shared__ int s_tiles1[GEMM_EXPERTS + 1];
    __shared__ int s_tiles2[GEMM_EXPERTS + 1];
    __shared__ int s_unit;
{%- if shared_gated %}
    __shared__ float s_gate[MAX_ROWS / SLOTS_PER_TOKEN];  // the call's tokens' shared-slice weights
    const SlotWeights slot_weights{topk_weights, s_gate};
{%- else %}
    const SlotWeights slot_weights{topk_weights};
{%- endif %}
    enum : int { GATE_BYTES = SHARED_GATED ? (int)sizeof(float) * (MAX_ROWS / SLOTS_PER_TOKEN) : 0 };
    static_assert(static_smem_reserved(sizeof(s_offsets) + sizeof(s_row_pair) + sizeof(s_fill) + sizeof(s_tiles1) +
                                       sizeof(s_tiles2) + sizeof(s_unit) + GATE_BYTES) == STATIC_SMEM,
                  "plan: the fused decode's static shared memory");

    // The routing ids come from the caller or from the router launched just before. The
    // first unit is claimed while the block routes.
    start_after_previous_kernel();
    if (threadIdx.x == 0) s_unit = (int)atomicAdd(next_unit, 1u);
    route_in_block<THREADS>(topk_ids, tokens, error_word, s_offsets, s_row_pair, s_fill);
    tile_schedule<G1::BM, N_TILES1, GEMM_EXPERTS, 1>(s_offsets, s_tiles1);
    tile_schedule<G2::BM, N_TILES2, GEMM_EXPERTS, 1>(s_offsets, s_tiles2);
    const int tiles1 = s_tiles1[GEMM_EXPERTS], tiles2 = s_tiles2[GEMM_EXPERTS];
    const EpContext none{};

    // No GEMM2 tile, so no combine (every id out of range, reported): y is zeros, as the
    // combine kernel would write.
    if (tiles2 == 0) {
        Vec16* out = reinterpret_cast<Vec16*>(y);
        for (int i = blockIdx.x * THREADS + threadIdx.x; i < tokens * HIDDEN / 8; i += gridDim.x * THREADS) {
            out[i] = Vec16{0u, 0u, 0u, 0u};
        }
    }

    for (int unit = s_unit; unit < tiles1 + tiles2; unit = s_unit) {
        __syncthreads();  // every thread has read this unit's ticket
        if (threadIdx.x == 0) s_unit = (int)atomicAdd(next_unit, 1u);
        if (unit < tiles1) {
            GemmTile t;
            mma_sync_run<G1>(x, w1, w1_bias, SlotWeights{}, s_offsets, s_row_pair, intermediate, none, StreamKBuffers{}, smem,
                             s_tiles1, KRun{unit, 0, K_TILES1}, KRun::none(), RingState{0, false}, nullptr, false,
                             [](const GemmTile&) {}, &t);
            // Every thread's stores are done (mma_sync_run ends on a barrier).
            if (threadIdx.x == 0) {
                fence_flags();
                flag_add(expert_rows_done + t.expert, 1);
            }
            __syncthreads();  // the next ticket is in s_unit
            continue;
        }
        // GEMM2: the expert's rows are every GEMM1 tile of that expert.
        GemmTile t;
        mma_sync_run<G2>(
            intermediate, w2, w2_bias, slot_weights, s_offsets, s_row_pair, combine_slots, none, StreamKBuffers{}, smem,
            s_tiles2, KRun{unit - tiles1, 0, K_TILES2}, KRun::none(), RingState{0, false}, nullptr, true, [&](const GemmTile& tile) {
{%- if shared_gated %}
                // A shared slice's rows weigh their tokens' gate: the block's warps compute
                // every token's (x's rows are in L2) before thread 0 waits.
                if (tile.expert >= EXPERTS) {
                    block_shared_gate_weights<THREADS>(x, shared_expert_gate, tokens,
                                                       [&](int token, float weight) { s_gate[token] = weight; });
                }
{%- endif %}
                if (threadIdx.x == 0) {
                    const int rows = s_offsets[tile.expert + 1] - s_offsets[tile.expert];
                    // Not giving up on a time-out code recorded earlier: block 0 clears an
                    // earlier call's error word while the other blocks may already wait.
                    wait_flag<false>(expert_rows_done + tile.expert, (u32)((rows + G1::BM - 1) / G1::BM * N_TILES1),
                                     error_word, 0, FLAG_KIND_EXPERT_ROWS, tile.expert);
                }
                __syncthreads();
            },
            &t);
        if (threadIdx.x == 0) {
            // The expert's last GEMM2 tile has read its rows: both counts go back to zero
            // (the stores counted by taking off this call's count).
            const int rows = s_offsets[t.expert + 1] - s_offsets[t.expert];
            const u32 readers = (u32)((rows + G2::BM - 1) / G2::BM * N_TILES2);
            if (atomicAdd(expert_rows_read + t.expert, 1u) == readers - 1) {
                atomicSub(expert_rows_done + t.expert, (u32)((rows + G1::BM - 1) / G1::BM * N_TILES1));
                expert_rows_read[t.expert] = 0;
            }
        }
        // Every token's slots of these columns are stored once every expert's tiles of this
        // column tile are: the last of them sums them. (last_arrival ends on a barrier, and
        // the combine does not touch s_unit.)
        const int column_tile = t.n0 / G2::BN;
        if (last_arrival(columns_done + column_tile, (u32)(tiles2 / N_TILES2))) {
            combine_columns<THREADS, G2::BN>(combine_slots, topk_ids, tokens, t.n0, y);
        }
        __syncthreads();  // the next ticket is in s_unit
    }
    // This block claimed past the last unit: the last block to do so puts the ticket back
    // (last_arrival puts blocks_done back).
    if (last_arrival(blocks_done, gridDim.x) && threadIdx.x == 0) *next_unit = 0;
}
