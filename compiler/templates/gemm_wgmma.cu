// ---------------------------------------------------------------------------------------
// Hopper's warpgroup MMA (wgmma, sm_90a): what the warp-specialised engine below issues.
//   - each consumer warpgroup (4 warps) owns 64 rows of the tile and issues wgmma m64nNk16
//     with A and B read from shared memory through descriptors;
//   - the shared-memory layout is the 128-byte swizzle wgmma expects (the same XOR the
//     mma.sync path uses, and TMA's 128-byte swizzle), every stage on its 1024-byte period;
//   - the accumulators of one wgmma are spread as mma.sync's m16n8 fragments, so the
//     epilogue is the shared one, a pair of columns at a time.
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
// specialisation per width the plan uses, guarded by the entry points that use it.
template <int N>
__device__ __forceinline__ void wgmma_m64k16(float* d, u64 desc_a, u64 desc_b);
{%- for width in wgmma_widths %}
{%- let n = width.n %}
{{ width.guard }}
template <>
__device__ __forceinline__ void wgmma_m64k16<{{ n }}>(float* d, u64 desc_a, u64 desc_b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n{{ n }}k16.f32.bf16.bf16 { {{ self.wgmma_operands(n) }} }, %{{ n / 2 }}, %{{ n / 2 + 1 }}, 1, 1, 1, 0, 0;\n"
        : {{ self.wgmma_outputs(n) }}
        : "l"(desc_a), "l"(desc_b));
}
#endif
{%- endfor %}
// The four lanes of a quad hold one row two columns at a time: lane q holds columns 2q and
// 2q + 1 of each 8-column block. Given lane q's words of four consecutive blocks, returns
// block q's 8 columns in order, so that each lane stores 16 bytes and a quad 64 consecutive
// bytes of the row (4-byte stores spread over the row took a third of a short GEMM2's time).
// Two butterfly trades: with lane q ^ 1, then with lane q ^ 2.
__device__ __forceinline__ Vec16 quad_transpose(u32 p0, u32 p1, u32 p2, u32 p3) {
    const int q = threadIdx.x & 3;
    const bool b0 = (q & 1) != 0, b1 = (q & 2) != 0;
    // Keep the blocks whose low bit is q's, trade the others with lane q ^ 1.
    const u32 keep_lo = b0 ? p1 : p0, keep_hi = b0 ? p3 : p2;
    const u32 got_lo = __shfl_xor_sync(0xffffffffu, b0 ? p0 : p1, 1);
    const u32 got_hi = __shfl_xor_sync(0xffffffffu, b0 ? p2 : p3, 1);
    // Keep block q (this lane's and lane q ^ 1's words), trade block q ^ 2 with lane q ^ 2.
    const u32 from_0 = b1 ? keep_hi : keep_lo, from_1 = b1 ? got_hi : got_lo;
    const u32 from_2 = __shfl_xor_sync(0xffffffffu, b1 ? keep_lo : keep_hi, 2);
    const u32 from_3 = __shfl_xor_sync(0xffffffffu, b1 ? got_lo : got_hi, 2);
    // from_k came from lane q ^ k: put lane s's words at word s.
    const u32 e0 = b0 ? from_1 : from_0, e1 = b0 ? from_0 : from_1;
    const u32 e2 = b0 ? from_3 : from_2, e3 = b0 ? from_2 : from_3;
    Vec16 words;
    words.x = b1 ? e2 : e0;
    words.y = b1 ? e3 : e1;
    words.z = b1 ? e0 : e2;
    words.w = b1 ? e1 : e3;
    return words;
}

// Epilogue of one warpgroup's 64 rows from its accumulators (`acc_up`: the up half of a
// gated GEMM1): warp w of the warpgroup holds rows 16w + lane/4 (+8); n8 block j holds
// columns 8j + 2(lane%4) (+1), as in mma.sync's m16n8 fragments. With QUAD_STORES a quad
// trades its words (quad_transpose) and stores 16 bytes per lane: every lane takes part in
// the trades, and only the rows the tile has are stored.
template <class G>
__device__ __forceinline__ void wgmma_epilogue(const float* acc, const float* acc_up, const GemmTile& t, int warpgroup,
                                               const int* __restrict__ row_pair, const SlotWeights& slot_weights,
                                               const float* __restrict__ expert_bias, bf16_t* __restrict__ out,
                                               const EpContext& ep) {
    static_assert(!G::QUAD_STORES || G::BN % 32 == 0, "plan: a quad stores whole groups of four 8-column blocks");
    const int lane = threadIdx.x & 31;
    const int warp_in_group = (threadIdx.x >> 5) & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = warpgroup * 64 + warp_in_group * 16 + (lane >> 2) + half * 8;
        // This lane's first column of 8-column block j, and its pair of the row there, packed.
        const auto column = [&](int j) { return t.n0 + j * 8 + (lane & 3) * 2; };
        const auto pack = [&](const EpilogueRow& row, int j) {
            const int c = j * 4 + half * 2;
            const float up0 = G::GATED ? acc_up[G::GATED ? c : 0] : 0.f;
            const float up1 = G::GATED ? acc_up[G::GATED ? c + 1 : 0] : 0.f;
            return epilogue_pack<G>(row, column(j), acc[c], acc[c + 1], up0, up1);
        };
        if constexpr (G::QUAD_STORES) {
            const bool stored = r < t.rows;
            // A row past the tile's is packed (and never stored) from row 0's sources.
            const EpilogueRow row = epilogue_row<G>(t, stored ? r : 0, row_pair, slot_weights, expert_bias, out, ep);
#pragma unroll
            for (int group = 0; group < G::BN / 32; ++group) {
                const Vec16 block = quad_transpose(pack(row, group * 4), pack(row, group * 4 + 1),
                                                   pack(row, group * 4 + 2), pack(row, group * 4 + 3));
                if (stored) *reinterpret_cast<Vec16*>(row.out + t.n0 + (group * 4 + (lane & 3)) * 8) = block;
            }
        } else {
            if (r >= t.rows) continue;
            const EpilogueRow row = epilogue_row<G>(t, r, row_pair, slot_weights, expert_bias, out, ep);
#pragma unroll
            for (int j = 0; j < G::BN / 8; ++j) *reinterpret_cast<u32*>(row.out + column(j)) = pack(row, j);
        }
    }
}
