// ---------------------------------------------------------------------------------------
// Grouped GEMM on wgmma with warp specialisation (sm_90a). Same tiles, schedule, masking,
// stage layout and epilogue as the mma.sync engine above; the roles are split:
//   - warpgroup 0, the producer, is the one place that waits for data (on the
//     expert-parallel path, for the dispatch chunks a tile reads) and loads stages: the
//     gathered A rows with cp.async, each producer thread's copies arriving on the stage's
//     "full" mbarrier when they land (cp.async.mbarrier.arrive.noinc), and the weight rows
//     with the tensor memory accelerator (TMA): one thread sets the stage's expected bytes
//     and copies boxes of a tile's rows x 64 columns, which complete on the same barrier
//     (with A_TILES, the A rows come the same way, one box per stage: GEMM2's from the
//     intermediate, GEMM1's from x sorted into the expert-major order);
//   - the consumer warpgroups (64 rows each) wait on "full", multiply (a gated tile's gate
//     and up rows in one wgmma), and arrive on the stage's "empty" mbarrier once the
//     wgmma group reading it has retired; the producer refills a stage after waiting on
//     "empty";
//   - no block-wide barrier inside the tile loop: the ring runs across tiles, so the
//     producer loads the next tile while the consumers store this one;
//   - setmaxnreg moves registers from the producer (addresses only) to the consumers
//     (accumulators), as the plan splits them;
//   - the blocks claim their work units in order from a ticket (see UnitSlots), so the
//     units in flight stay a contiguous run and the tiles sharing a weight panel or an
//     expert's rows read them from L2 (and, on the expert-parallel path, the units whose
//     chunks arrive first run first);
//   - in a cluster pair (CLUSTER = 2) the two blocks walk one list of work units (see
//     group_units): on two m-tiles of one weight panel, each producer loads half of every
//     stage's weight rows and multicasts it into both blocks' stage, halving the weight
//     bytes each block reads from L2. A stage is then refilled only once the consumers of
//     both blocks have read it: each consumer warp arrives on both blocks' "empty" barrier.
// A barrier's phase flips each time all its arrivals are in; a thread tracks the phase of
// its next use of a stage by one bit that flips whenever it wraps around the ring.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(u32 barrier, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(u32 barrier) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(barrier) : "memory");
}
// Returns once the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(u32 barrier, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(barrier), "r"(parity) : "memory");
}
// One arrival on `barrier` when every cp.async this thread has issued so far has landed.
__device__ __forceinline__ void cp_async_arrive(u32 barrier) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(barrier) : "memory");
}
// The stage's weight bytes the next phase of `barrier` waits for besides its arrivals.
__device__ __forceinline__ void mbarrier_expect_bytes(u32 barrier, u32 bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(bytes) : "memory");
}

// A TMA tensor map (CUtensorMap), built by the runtime, passed by value.
struct __align__(64) TensorMap {
    u64 opaque[16];
};
static_assert(sizeof(TensorMap) == {{ tensor_map_bytes }} && alignof(TensorMap) == {{ tensor_map_align }}, "plan: tensor map parameter");

// The box at (column, row) of `map` into shared memory at `destination`, completing on
// `barrier` with the box's bytes.
__device__ __forceinline__ void tma_load_box(u32 destination, const TensorMap* map, int column, int row, u32 barrier) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3 }], [%4];\n"
        ::"r"(destination), "l"(reinterpret_cast<u64>(map)), "r"(column), "r"(row), "r"(barrier)
        : "memory");
}

// The box at (column, row) of `map` into shared memory at `destination` in every block of
// the cluster in `blocks` (a bit per rank), completing on the barrier at `barrier`'s offset
// in each of them.
__device__ __forceinline__ void tma_load_box_multicast(u32 destination, const TensorMap* map, int column, int row,
                                                       u32 barrier, unsigned short blocks) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, { %2, %3 }], [%4], %5;\n"
        ::"r"(destination), "l"(reinterpret_cast<u64>(map)), "r"(column), "r"(row), "r"(barrier), "h"(blocks)
        : "memory");
}

// Clusters (the rank and barrier are the prelude's): the fence that makes mbarrier
// initialisations visible to the other blocks, and one arrival on the barrier at
// `barrier`'s offset in block `rank`'s shared memory.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive_in_block(u32 barrier, int rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(barrier), "r"(rank));
    // Default (CTA-scope) release semantics: the arrival only says this block's wgmma reads of
    // a stage are done, which the wgmma wait already ordered. A cluster-scope release would
    // put a MEMBAR.ALL.GPU before every arrival (ptxas 13.0), and measured 53% slower GEMMs.
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}

// A consumer warp is done reading stage barrier `empty` guards: one arrival per warp (the
// wgmma wait before it is warp-wide), on the barrier of every block whose producer fills
// this block's stage.
template <int CLUSTER>
__device__ __forceinline__ void release_stage(u32 empty) {
    if ((threadIdx.x & 31) != 0) return;
    if constexpr (CLUSTER == 1) {
        mbarrier_arrive(empty);
    } else {
#pragma unroll
        for (int rank = 0; rank < CLUSTER; ++rank) mbarrier_arrive_in_block(empty, rank);
    }
}

// A barrier among `threads` threads of the block (whole warps), not the whole block.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int REGISTERS>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGISTERS)); }
template <int REGISTERS>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGISTERS)); }

// Returns once the phase of parity `parity` has completed, seeing what was written before
// arrivals from the other blocks of the cluster (release.cluster) too.
__device__ __forceinline__ void mbarrier_wait_cluster(u32 barrier, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(barrier), "r"(parity) : "memory");
}

// Work units claimed in order: the first block of a cluster takes each unit from the
// launch's ticket and hands it to every thread of the cluster's blocks through slot
// j % SLOTS (an mbarrier of one arrival, then the unit). SLOTS = STAGES + 1 suffice:
// the producer claims unit j + SLOTS after loading unit j + STAGES's last k-tile, for
// which both blocks' consumers released the stage of a k-tile STAGES before it, of unit
// j or later (a unit has at least one k-tile); so every thread of both blocks has read
// unit j, and a reader never waits on a slot two phases behind. The G clusters' claims
// are numbered 0 .. total + G - 1 (each cluster's last claim is past the end), so the one
// numbered total + G - 1 is the launch's last and resets the ticket for the next call.
template <int CLUSTER, int SLOTS>
struct UnitSlots {
    u32 barriers;  // [SLOTS] mbarriers
    u32 units;     // [SLOTS] ints

    __device__ __forceinline__ void claim(int j, unsigned int* ticket, int total_units, int clusters) const {
        const unsigned claimed = atomicAdd(ticket, 1u);
        if (claimed == (unsigned)(total_units + clusters - 1)) atomicExch(ticket, 0u);
        const int unit = min((int)claimed, total_units);
        const u32 slot = units + (j % SLOTS) * 4u, barrier = barriers + (j % SLOTS) * 8u;
#pragma unroll
        for (int rank = 1; rank < CLUSTER; ++rank) {
            u32 remote_slot, remote_barrier;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote_slot) : "r"(slot), "r"(rank));
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote_barrier) : "r"(barrier), "r"(rank));
            asm volatile("st.shared::cluster.u32 [%0], %1;\n" ::"r"(remote_slot), "r"(unit) : "memory");
            // Once a unit (rare beside the stages' arrivals): the cluster-scope release orders
            // the store before it.
            asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote_barrier) : "memory");
        }
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(slot), "r"(unit) : "memory");
        mbarrier_arrive(barrier);
    }

    // The unit of slot j % SLOTS once it is there; a unit at or past the total ends the loop.
    __device__ __forceinline__ int unit(int j, int cta_rank) const {
        const u32 barrier = barriers + (j % SLOTS) * 8u, parity = (j / SLOTS) & 1;
        if (CLUSTER > 1 && cta_rank > 0) mbarrier_wait_cluster(barrier, parity);
        else mbarrier_wait(barrier, parity);
        int unit;
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(unit) : "r"(units + (j % SLOTS) * 4u) : "memory");
        return unit;
    }
};

// Named barriers (0 is __syncthreads).
enum : int { PRODUCER_BARRIER_ID = 1 };
enum : int { CONSUMER_BARRIER_ID = 2 };

template <class G>
__device__ __forceinline__ void grouped_gemm_warp_specialized(
    const bf16_t* __restrict__ a_rows,
    const TensorMap* weight_tiles,  // boxes of BN weight rows x BK columns
    const float* __restrict__ expert_bias,  // as grouped_gemm's; BIAS only
    const SlotWeights slot_weights,  // one GPU's GEMM2 only
    const int* __restrict__ row_offsets,
    const int* __restrict__ row_pair,
    bf16_t* __restrict__ out,
    const EpContext& ep,
    unsigned int* unit_ticket,  // this GEMM's ticket of work units, zero between calls
    const TensorMap* a_tiles = nullptr)  // A_TILES: boxes of BM rows x BK columns of the expert-major A rows
{
    assert_gemm_layout<G>();
    static_assert(G::WARPS_N == 1 && G::WARPS_M * 16 == G::BM, "plan: one consumer warpgroup (4 warps) per 64 rows");
    static_assert(G::PRODUCER_THREADS == 128, "plan: one producer warpgroup");
    static_assert(G::STAGE_BYTES % G::RING_ALIGN == 0 && G::RING_ALIGN == 1024,
                  "plan: every stage starts on the swizzle's 1024-byte period");
    static_assert(G::ALIGN_SLACK >= G::RING_ALIGN - 16, "plan: slack to align the ring");
    static_assert(G::BARRIER_OFFSET % 8 == 0, "plan: mbarriers are 8-byte aligned");
    constexpr int CONSUMER_THREADS = G::THREADS - G::PRODUCER_THREADS;
    constexpr int CLUSTER = G::CLUSTER;
    constexpr int W_ROWS = G::GATED ? 2 * G::N : G::N;
    constexpr int FRAG = G::BN / 2;  // accumulator floats per thread per BN columns
    // One wgmma per k16 step spans all of a stage's B rows (a gated tile's gate and up rows
    // together), so it reads the warpgroup's A rows once.
    constexpr int ACCUMULATORS = G::B_ROWS / 2;
    static_assert(G::B_ROWS % 16 == 0 && G::B_ROWS <= 256, "plan: a stage's B rows fit one wgmma");
    constexpr int K_TILES = G::KD / G::BK;
    constexpr int N_TILES = G::N / G::BN;
    constexpr u32 B_BYTES = G::B_ROWS * G::ROW_BYTES;  // the TMA boxes of one stage
    constexpr int B_BOXES = G::B_ROWS / G::B_BOX_ROWS;  // gate and up, or a pair's two halves
    constexpr u32 B_BOX_BYTES = G::B_BOX_ROWS * G::ROW_BYTES;
    static_assert(G::A_BYTES % 1024 == 0 && B_BOX_BYTES % 1024 == 0,
                  "plan: every box starts on the swizzle's 1024-byte period");
    static_assert(G::B_ROWS % G::B_BOX_ROWS == 0 && B_BOXES <= 2, "plan: one or two weight boxes per stage");
    static_assert(CLUSTER == 1 || (B_BOXES == CLUSTER && !G::EP), "plan: a pair's blocks load a box each, on one GPU");
    static_assert(!G::A_TILES || !G::EP, "plan: A as tiles only where rows are consecutive (one GPU)");
    constexpr u32 STAGE_TX_BYTES = B_BYTES + (G::A_TILES ? G::A_BYTES : 0);  // what TMA brings a stage

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 raw_base = smem_address(smem_raw);
    const u32 smem_base = (raw_base + (G::RING_ALIGN - 1)) & ~(u32)(G::RING_ALIGN - 1);
    unsigned char* smem = smem_raw + (smem_base - raw_base);
    int* s_row_source = reinterpret_cast<int*>(smem + G::ROW_SOURCE_OFFSET);
    const u32 full_barriers = smem_base + G::BARRIER_OFFSET;           // [STAGES]: stage loaded
    const u32 empty_barriers = full_barriers + G::STAGES * sizeof(u64);  // [STAGES]: stage read
    constexpr int UNIT_SLOTS = G::STAGES + 1;
    const u32 unit_barriers = empty_barriers + G::STAGES * 8u;  // [UNIT_SLOTS], then the units: see UnitSlots
    const UnitSlots<G::CLUSTER, UNIT_SLOTS> slots{unit_barriers, unit_barriers + UNIT_SLOTS * 8u};
    __shared__ int s_tile_start[G::EXPERTS_HERE * G::PHASES + 1];
    static_assert(static_smem_reserved(sizeof(s_tile_start)) == G::STATIC_SMEM_BYTES, "plan: static tile-start table");

    const int tid = threadIdx.x;
    if (tid == 0) {
        for (int s = 0; s < UNIT_SLOTS; ++s) mbarrier_init(slots.barriers + s * 8u, 1);
        for (int s = 0; s < G::STAGES; ++s) {
            mbarrier_init(full_barriers + s * sizeof(u64), G::PRODUCER_THREADS);
            mbarrier_init(empty_barriers + s * sizeof(u64), CLUSTER * CONSUMER_THREADS / 32);
        }
        if constexpr (CLUSTER > 1) fence_mbarrier_init();
    }
    tile_schedule<G::BM, N_TILES, G::EXPERTS_HERE, G::PHASES, CLUSTER>(row_offsets, s_tile_start);  // its barrier publishes the inits
    if constexpr (CLUSTER > 1) cluster_sync();  // and to the pair, before it multicasts or arrives here
    const int total_units = s_tile_start[G::EXPERTS_HERE * G::PHASES];
    const int cta_rank = CLUSTER > 1 ? cluster_ctarank() : 0;
    // This block's tile of work unit `unit` (one tile per unit for a block alone).
    const auto tile_of = [&](int unit) {
        if constexpr (CLUSTER == 1) {
            return locate_tile<G::BM, G::BN, G::EXPERTS_HERE, G::PHASES>(unit, s_tile_start, row_offsets);
        } else {
            return locate_pair_tile<G::BM, G::BN, N_TILES, G::EXPERTS_HERE, G::PHASES>(unit, cta_rank, s_tile_start,
                                                                                     row_offsets);
        }
    };
    const int clusters = gridDim.x / CLUSTER;

    if (tid < G::PRODUCER_THREADS) {
        // Producer: row sources, then every k-tile of every tile of this block into the ring.
        if constexpr (G::PRODUCER_REGISTERS > 0) setmaxnreg_dec<G::PRODUCER_REGISTERS>();
        if (tid == 0) {
            asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(weight_tiles)) : "memory");
            if constexpr (G::A_TILES) asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(a_tiles)) : "memory");
        }
        const StageLoader<G, G::PRODUCER_THREADS> load(tid);
        int stage = 0;
        u32 phase = 0;
        for (int j = 0;; ++j) {
            if (tid == 0 && cta_rank == 0) slots.claim(j, unit_ticket, total_units, clusters);
            const int unit = slots.unit(j, cta_rank);
            if (unit >= total_units) break;
            const GemmTile t = tile_of(unit);
            if constexpr (!G::A_TILES) {
                named_barrier_sync(PRODUCER_BARRIER_ID, G::PRODUCER_THREADS);  // last tile's loads are issued
                fill_row_sources<G, G::PRODUCER_THREADS>(t, row_pair, s_row_source, ep, tid);
                named_barrier_sync(PRODUCER_BARRIER_ID, G::PRODUCER_THREADS);  // the table is complete
            }
            const int weight_row = t.expert * W_ROWS + t.n0;  // gate rows; up rows N below
            for (int k_tile = 0; k_tile < K_TILES; ++k_tile) {
                const u32 full = full_barriers + stage * sizeof(u64);
                const u32 stage_address = smem_base + stage * G::STAGE_BYTES;
                mbarrier_wait(empty_barriers + stage * sizeof(u64), phase ^ 1);  // the first pass finds it free
                if (tid == 0) {
                    mbarrier_expect_bytes(full, STAGE_TX_BYTES);  // both weight boxes land here, whoever loads them
                    if constexpr (G::A_TILES) {
                        // Rows past the tile's (the next expert's, rows of an earlier call, or zeros
                        // past the buffer) are never stored.
                        tma_load_box(stage_address, a_tiles, k_tile * G::BK, t.row0, full);
                    }
#pragma unroll
                    for (int box = 0; box < B_BOXES; ++box) {
                        const u32 destination = stage_address + G::A_BYTES + box * B_BOX_BYTES;
                        const int row = weight_row + box * (G::GATED ? G::N : G::B_BOX_ROWS);
                        if (!t.weights_shared) {
                            tma_load_box(destination, weight_tiles, k_tile * G::BK, row, full);
                        } else if (box == cta_rank) {  // the other block multicasts the other box
                            tma_load_box_multicast(destination, weight_tiles, k_tile * G::BK, row, full,
                                                   (unsigned short)((1u << CLUSTER) - 1));
                        }
                    }
                }
                if constexpr (G::A_TILES) {
                    mbarrier_arrive(full);
                } else {
                    load.a_rows(stage_address, load.k_offset(k_tile), s_row_source, a_rows, ep.own_rows);
                    cp_async_arrive(full);
                }
                if (++stage == G::STAGES) { stage = 0; phase ^= 1; }
            }
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");  // leave no copy in flight behind
    } else {
        // Consumers: multiply each stage as it lands, release it once read, store the tile.
        if constexpr (G::CONSUMER_REGISTERS > 0) setmaxnreg_inc<G::CONSUMER_REGISTERS>();
        const int consumer = tid - G::PRODUCER_THREADS;
        const int warpgroup = consumer >> 7;
        int stage = 0;
        u32 phase = 0;
        for (int j = 0;; ++j) {
            const int unit = slots.unit(j, cta_rank);
            if (unit >= total_units) break;
            const GemmTile t = tile_of(unit);
            // A gated tile's up columns follow its gate columns, as its up rows follow its
            // gate rows in a stage.
            float acc[ACCUMULATORS];
#pragma unroll
            for (int i = 0; i < ACCUMULATORS; ++i) acc[i] = 0.f;
            // A warpgroup whose 64 rows are all past the tile's rows (an expert's last,
            // partly empty tile) only keeps the ring's count: its zeros would store nothing,
            // and the warpgroup that has rows gets the SM's tensor cores to itself.
            const bool multiplies = t.rows > warpgroup * 64;
            int previous = -1;  // the stage of the wgmma group still in flight
            for (int k_tile = 0; k_tile < K_TILES; ++k_tile) {
                mbarrier_wait(full_barriers + stage * sizeof(u64), phase);
                if (multiplies) {
                    if constexpr (!G::A_TILES) fence_proxy_async();  // the producers' cp.async writes (A), seen by wgmma
                    const u32 stage_address = smem_base + stage * G::STAGE_BYTES;
                    const u32 a_base = stage_address + warpgroup * 64 * G::ROW_BYTES;
                    const u32 b_base = stage_address + G::A_BYTES;
                    wgmma_fence();
#pragma unroll
                    for (int k16 = 0; k16 < G::BK / 16; ++k16) {
                        wgmma_m64k16<G::B_ROWS>(acc, wgmma_descriptor(a_base + k16 * 32),
                                                wgmma_descriptor(b_base + k16 * 32));
                    }
                    wgmma_commit();
                }
                wgmma_wait<1>();  // the previous group has read its stage
                if (previous >= 0) release_stage<CLUSTER>(empty_barriers + previous * sizeof(u64));
                previous = stage;
                if (++stage == G::STAGES) { stage = 0; phase ^= 1; }
            }
            wgmma_wait<0>();
            release_stage<CLUSTER>(empty_barriers + previous * sizeof(u64));
            wgmma_epilogue<G>(acc, acc + (G::GATED ? FRAG : 0), t, warpgroup, row_pair, slot_weights, expert_bias, out, ep);
            if constexpr (G::EP && G::KIND == GEMM_DOWN) {
                named_barrier_sync(CONSUMER_BARRIER_ID, CONSUMER_THREADS);  // every store of the tile is done
                epilogue_release<G, CONSUMER_THREADS>(t, row_pair, ep, consumer);
            }
        }
    }
    if constexpr (CLUSTER > 1) cluster_sync();  // stay until the pair no longer multicasts or arrives here
}
