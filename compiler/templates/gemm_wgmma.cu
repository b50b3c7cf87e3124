// ---------------------------------------------------------------------------------------
// Grouped GEMM on Hopper's warpgroup MMA (wgmma, sm_90a). Same tiles, schedule, masking and
// epilogue as the mma.sync GEMM above; differences:
//   - each warpgroup (4 warps) owns 64 rows of the tile and issues wgmma m64nNk16 with A
//     and B read from shared memory through descriptors;
//   - the shared-memory layout is the 128-byte swizzle wgmma expects (the same XOR the
//     mma.sync path uses), with the ring and every stage on the swizzle's 1024-byte period;
//   - loads stay cp.async (gathered rows cannot use TMA on sm_90), so each thread fences
//     the generic->async proxy before the barrier that publishes a stage to wgmma;
//   - one wgmma group stays in flight while the next stage is published, so loads run
//     STAGES - 2 k-tiles ahead (the stage read two k-tiles ago is the one refilled).
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ u64 wgmma_descriptor(u32 smem_byte_address) {
    u64 desc = 0;
    desc |= (u64)((smem_byte_address & 0x3FFFF) >> 4);  // start address
    desc |= (u64)1 << 16;                                // leading byte offset (unused for SW128 K-major)
    desc |= (u64)(1024 >> 4) << 32;                      // stride byte offset: 8 rows x 128 B
    desc |= (u64)1 << 62;                                // 128-byte swizzle
    return desc;
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// D[64 x N] (+)= A[64 x 16] · B[N x 16]ᵀ, both K-major in shared memory; one
// specialisation per width the plan uses.
template <int N>
__device__ __forceinline__ void wgmma_m64k16(float* d, u64 desc_a, u64 desc_b);
{%- for n in wgmma_widths %}
template <>
__device__ __forceinline__ void wgmma_m64k16<{{ n }}>(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n{{ n }}k16.f32.bf16.bf16 { {{ self.wgmma_operands(n) }} }, %{{ n / 2 }}, %{{ n / 2 + 1 }}, 1, 1, 1, 0, 0;\n"
        : {{ self.wgmma_outputs(n) }}
        : "l"(desc_a), "l"(desc_b));
}
{%- endfor %}
// Epilogue of one warpgroup's 64 rows from its accumulators (`acc_up`: the up half of a
// gated GEMM1): warp w of the warpgroup holds rows 16w + lane/4 (+8); n8 block j holds
// columns 8j + 2(lane%4) (+1), as in mma.sync's m16n8 fragments.
template <class G>
__device__ __forceinline__ void wgmma_epilogue(const float* acc, const float* acc_up, const GemmTile& t, int warpgroup,
                                               const int* __restrict__ row_pair, const float* __restrict__ topk_weights,
                                               bf16_t* __restrict__ out, const EpContext& ep) {
    const int lane = threadIdx.x & 31;
    const int warp_in_group = (threadIdx.x >> 5) & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = warpgroup * 64 + warp_in_group * 16 + (lane >> 2) + half * 8;
        if (r >= t.rows) continue;
        const EpilogueRow row = epilogue_row<G>(t, r, row_pair, topk_weights, out, ep);
#pragma unroll
        for (int j = 0; j < G::BN / 8; ++j) {
            const int column = t.n0 + j * 8 + (lane & 3) * 2;
            const int c = j * 4 + half * 2;
            const float up0 = G::GATED ? acc_up[G::GATED ? c : 0] : 0.f;
            const float up1 = G::GATED ? acc_up[G::GATED ? c + 1 : 0] : 0.f;
            epilogue_store<G>(row, column, acc[c], acc[c + 1], up0, up1);
        }
    }
}
template <class G>
__device__ __forceinline__ void grouped_gemm_wgmma(
    const bf16_t* __restrict__ a_rows,
    const bf16_t* __restrict__ weights,
    const float* __restrict__ topk_weights,
    const int* __restrict__ expert_offsets,
    const int* __restrict__ row_pair,
    bf16_t* __restrict__ out,
    const EpContext& ep)
{
    assert_gemm_layout<G>();
    static_assert(G::WARPS_N == 1 && G::WARPS_M * 16 == G::BM, "plan: one warpgroup (4 warps) per 64 rows");
    static_assert(G::STAGE_BYTES % G::RING_ALIGN == 0 && G::RING_ALIGN == 1024,
                  "plan: every stage starts on the swizzle's 1024-byte period");
    static_assert(G::ALIGN_SLACK >= G::RING_ALIGN - 16, "plan: slack to align the ring");
    constexpr int W_ROWS = G::GATED ? 2 * G::N : G::N;
    constexpr int FRAG = G::BN / 2;  // accumulator floats per thread per wgmma
    constexpr int K_TILES = G::KD / G::BK;
    constexpr int N_TILES = G::N / G::BN;
    constexpr int PREFETCH = G::STAGES - 2;  // k-tiles loaded ahead of the one being multiplied
    static_assert(PREFETCH >= 1, "plan: wgmma needs at least 3 stages");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 raw_base = smem_address(smem_raw);
    const u32 smem_base = (raw_base + (G::RING_ALIGN - 1)) & ~(u32)(G::RING_ALIGN - 1);
    unsigned char* smem = smem_raw + (smem_base - raw_base);
    int* s_row_source = reinterpret_cast<int*>(smem + G::ROW_SOURCE_OFFSET);
    __shared__ int s_tile_start[G::GROUPS + 1];
    static_assert(static_smem_reserved(sizeof(s_tile_start)) == G::STATIC_SMEM_BYTES, "plan: static tile-start table");

    const int tid = threadIdx.x;
    const int warpgroup = tid >> 7;

    tile_schedule<G::BM, N_TILES, G::GROUPS>(expert_offsets, s_tile_start);
    const int total_tiles = s_tile_start[G::GROUPS];

    for (int tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
        const GemmTile t = locate_tile<G::BM, G::BN, G::GROUPS>(tile, s_tile_start, expert_offsets);
        fill_row_sources<G, G::THREADS>(t, row_pair, s_row_source, ep, tid);
        __syncthreads();
        const bf16_t* w_expert = weights + (size_t)(t.expert / G::GROUPS_PER_EXPERT) * W_ROWS * G::KD;
        auto stage_load = [&](int stage, int k_tile) {
            load_stage<G, G::THREADS>(smem_base + stage * G::STAGE_BYTES, k_tile, t, s_row_source, a_rows, w_expert, tid);
        };

        float acc[FRAG];
        float acc_up[G::GATED ? FRAG : 1];
#pragma unroll
        for (int i = 0; i < FRAG; ++i) {
            acc[i] = 0.f;
            if constexpr (G::GATED) acc_up[i] = 0.f;
        }

#pragma unroll
        for (int s = 0; s < PREFETCH; ++s) {
            if (s < K_TILES) stage_load(s, s);
            cp_async_commit();
        }

        for (int k_tile = 0; k_tile < K_TILES; ++k_tile) {
            cp_async_wait<PREFETCH - 1>();
            fence_proxy_async();  // this thread's cp.async writes become visible to wgmma
            // Everyone's are; and every warpgroup has retired the wgmma group of k-tile - 2,
            // whose stage the next load refills.
            __syncthreads();
            const int next = k_tile + PREFETCH;
            if (next < K_TILES) stage_load(next % G::STAGES, next);
            cp_async_commit();

            const u32 stage = smem_base + (k_tile % G::STAGES) * G::STAGE_BYTES;
            const u32 a_base = stage + warpgroup * 64 * G::ROW_BYTES;
            const u32 b_base = stage + G::A_BYTES;
            wgmma_fence();
#pragma unroll
            for (int k16 = 0; k16 < G::BK / 16; ++k16) {
                // Within a 128-byte swizzled row, the k16 step starts 32 bytes further.
                const u64 desc_a = wgmma_descriptor(a_base + k16 * 32);
                wgmma_m64k16<G::BN>(acc, desc_a, wgmma_descriptor(b_base + k16 * 32));
                if constexpr (G::GATED) {
                    wgmma_m64k16<G::BN>(acc_up, desc_a, wgmma_descriptor(b_base + G::BN * G::ROW_BYTES + k16 * 32));
                }
            }
            wgmma_commit();
            wgmma_wait<1>();  // keep this group in flight while the next stage is published
        }
        wgmma_wait<0>();

        wgmma_epilogue<G>(acc, acc_up, t, warpgroup, row_pair, topk_weights, out, ep);
        cp_async_wait<0>();
        __syncthreads();  // every store of the tile is done
        epilogue_release<G, G::THREADS>(t, row_pair, ep, tid);
    }
}
