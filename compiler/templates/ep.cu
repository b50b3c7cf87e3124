// ---------------------------------------------------------------------------------------
// Expert parallelism: {{ ep.ranks }} ranks ({{ ep.placement }}), {{ ep.local_experts }} experts each.
// One call, per rank (no barrier between ranks anywhere; flags carry the call's epoch):
{%- if ep.routes_itself %}
//   first:          router      a self-routed call only, on the compute stream: the layer's
//                               router on this rank's tokens (its launches for their count,
//                               no routing metadata); the kernels below read its choices as
//                               topk_ids/topk_weights
//   comm stream:    ep_route    metadata per destination (counts, receive index), one flag
{%- else %}
//   comm stream:    ep_route    metadata per destination (counts, receive index), one flag
{%- endif %}
//                   ep_dispatch token rows to peers, a chunk of CHUNK at a time, one flag per
//                               chunk (GEMM1 reads this rank's own rows from x)
//   compute stream: ep_arrange  waits for every source's metadata, lays out GEMM rows per
//                               local expert: every source's rows, local ones first;
//                               then one row per own token for each shared slice
//                               (a thread per row, on every compute SM)
//                   GEMM1       each tile waits for the chunks its rows sit in
{%- if ep.rank_partials %}
//                   GEMM2       keeps its weighted rows here (pair_results)
//                   ep_combine  sums each received token's rows into one partial, stored
//                               at its origin with a release of the origin's counter;
//                               then waits for each own token's counter and sums the
//                               partials of the ranks it visited, in rank order
{%- else %}
//                   GEMM2       stores weighted rows into the origin's combine slots and
//                               releases the origin's per-token counter
//                   ep_combine  waits for each token's counter, sums its K slots (and
//                               its shared slices')
{%- endif %}
// ---------------------------------------------------------------------------------------
enum : int { RANKS = {{ ep.ranks }} };
enum : int { LOCAL_EXPERTS = {{ ep.local_experts }} };     // E / RANKS, contiguous: expert e lives on rank e / LOCAL_EXPERTS
// (local expert, source) runs of GEMM rows, then a (shared slice, source) run per slice
// and source, holding rows only for this rank's own tokens.
enum : int { SEGMENTS = (LOCAL_EXPERTS + SHARED_SLICES) * RANKS };
enum : int { MAX_TOKENS = {{ ep.max_tokens }} };
enum : int { SLOTS = {{ ep.slots }} };                     // token slots per source in recv_x
enum : int { SEGMENT_ROWS = {{ ep.segment_rows }} };       // rows per (local expert, source) in recv_*
enum : int { CHUNK = {{ ep.chunk }} };                     // tokens per dispatch chunk
enum : int { CHUNKS = {{ ep.chunks }} };                   // chunk flags per source
enum : int { OWN_ROW_BASE = RANKS * SLOTS };               // GEMM1 rows from here on: this rank's own tokens, read from x
enum : int { MIN_PIECE = {{ ep.piece }} };                  // fewest tokens per dispatch work item (divides CHUNK)
enum : int { COPY_UNROLL = 8 };                            // 16-byte loads in flight per thread while copying (8: 1.1-1.7x the rate of 4, measured)
enum : int { COMM_THREADS = {{ ep.comm_threads }} };
enum : int { META_THREADS = {{ ep.meta_threads }} };
enum : int { COMBINE_LANES = {{ ep.combine_lanes }} };     // token lanes (of COMBINE_THREADS threads) per combine block
{%- if ep.rank_partials %}
enum : int { PARTIALS_PER_RELEASE = {{ ep.partials_per_release }} };  // rank partials a combine lane releases together
{%- endif %}
enum : int { EP_ROUTE_STATIC_SMEM_BYTES = {{ ep.route.static_smem }} };
enum : int { EP_ARRANGE_STATIC_SMEM_BYTES = {{ ep.arrange.static_smem }} };
enum : int { EP_COMBINE_STATIC_SMEM_BYTES = {{ ep.combine.static_smem }} };
// Each rank's row of the peer table: addresses of the buffers other ranks write.
enum : int { PEER_BUFFER_COUNT = {{ ep.peer_buffers.len() }} };
{%- for buffer in ep.peer_buffers %}
enum : int { {{ buffer.constant }} = {{ buffer.index }} };
{%- endfor %}
// Per source rank, the destinations in the order it sends to them (itself first).
__device__ const int SEND_ORDER[RANKS][RANKS] = { {{ ep.send_order }} };
// Per destination rank, the sources in the order its GEMM rows take them (itself first).
__device__ const int RECEIVE_ORDER[RANKS][RANKS] = { {{ ep.receive_order }} };
{%- if let Some(network) = ep.network %}
// Across nodes ({{ network.nodes }} nodes of {{ network.gpus_per_node }} GPUs): a rank reaches its peers on other nodes through
// NCCL, which the runtime runs on a network stream beside these kernels. What such a peer
// is sent is staged in this rank's outboxes (net_send_*), each piece followed by a release
// of its ready flag, which the network stream waits on (cuStreamWaitValue32) before it
// sends it; what arrives lands where a peer on the node would have stored it, and the
// network stream releases the same flags (cuStreamWriteValue32). Results for such a peer
// go into this rank's return outbox (its combine slots in the peer table) and come back
// into net_returned_x, released per (source, token chunk) in net_return_flags.
enum : int { NETWORK_PEERS = {{ network.peers }} };
enum : int { READY_STRIDE = 1 + CHUNKS };                  // per network peer: the metadata's ready flag, then each chunk's
enum : size_t { MAX_PAIRS = (size_t)MAX_TOKENS * SLOTS_PER_TOKEN };  // result rows per network peer in net_returned_x
// Per rank, each peer's slot among its network peers in its outboxes and inboxes (-1: the
// same node, reached through IPC).
__device__ const int NETWORK_SLOT[RANKS][RANKS] = { {{ network.slots }} };
{%- endif %}

// The expert-parallel GEMMs: one group of rows per local expert, holding the rows of
// every source (so each weight panel is read once however many sources there are).
struct ExpertParallel {
    enum : bool { EP = true };
    enum : int { EXPERTS_HERE = LOCAL_EXPERTS + SHARED_SLICES, PHASES = ::RANKS, RANKS = ::RANKS };
    enum : int { SLOTS = ::SLOTS, CHUNK = ::CHUNK, CHUNKS = ::CHUNKS, OWN_ROW_BASE = ::OWN_ROW_BASE };
    enum : int { PEER_BUFFER_COUNT = ::PEER_BUFFER_COUNT };
    enum : int { PEER_COMBINE_SLOTS = ::PEER_COMBINE_SLOTS, PEER_COMBINE_COUNTERS = ::PEER_COMBINE_COUNTERS };
    // GEMM2 keeps its rows here for the combine's rank partials (else stores them at their origins).
    enum : bool { RANK_PARTIALS = {{ ep.rank_partials }} };
};

template <typename T>
__device__ __forceinline__ T* peer_buffer(const u64* peer_table, int rank, int buffer) {
    return reinterpret_cast<T*>(peer_table[rank * PEER_BUFFER_COUNT + buffer]);
}

__device__ __forceinline__ EpContext ep_gemm1_context(const u32* chunk_flags, const bf16_t* x, int* error_word, int rank,
                                                      u32 epoch) {
    EpContext ep;
    ep.chunk_flags = chunk_flags;
    ep.own_rows = x;
    ep.error_word = error_word;
    ep.rank = rank;
    ep.epoch = epoch;
    return ep;
}

__device__ __forceinline__ EpContext ep_gemm2_context(const float* segment_weights, const int* row_origins,
                                                      const u64* peer_table, int* error_word, int rank) {
    EpContext ep;
    ep.row_weights = segment_weights;
    ep.row_origins = row_origins;
    ep.peers = peer_table;
    ep.error_word = error_word;
    ep.rank = rank;
    return ep;
}

// Metadata: the call's tokens in tiles of META_TILE_TOKENS, block b taking tiles b, b + grid,
// ... Every (token, destination) with an expert there gets a send slot (a token crosses once
// however many of its experts live there); every valid (token, k) pair gets a row of its
// expert's receive index at the destination. A tile counts its slots and rows in shared
// memory, reserves them with one global atomic per destination and per expert it touches
// (metadata_counters), stages its pairs sorted by expert and writes each expert's rows as
// one run (so a warp's stores to a peer land side by side). The last block done writes
// every destination's counts and releases this rank's metadata flag there. Before writing
// to a destination, a block waits for its credit: the destination's arrange kernel of the
// previous call has consumed what this rank wrote then (without this, a rank that sent
// nothing to a destination could run a call ahead and overwrite its counts before they
// were read).
enum : int { META_TILE_TOKENS = {{ ep.meta_tile_tokens }} };
enum : int { META_TILE_PAIRS = META_TILE_TOKENS * TOP_K };
enum : u32 { OWNER_BIT = 0x80000000u };                  // in a pair's slot: the first pair of its (token, destination)
enum : unsigned short { NO_PAIR = 0xFFFFu };             // a pair's rank in its expert when its id is out of range
// metadata_counters: rows per expert, slots per destination and blocks done (each back to
// zero after a call), then the last epoch whose error word block 0 has cleared.
enum : int { COUNTER_EXPERT_ROWS = 0, COUNTER_DESTINATION_SLOTS = EXPERTS, COUNTER_BLOCKS_DONE = EXPERTS + RANKS };
enum : int { COUNTER_ERRORS_CLEARED = COUNTER_BLOCKS_DONE + 1 };
static_assert(META_TILE_PAIRS < NO_PAIR, "plan: a tile's pairs are counted in 16 bits");

// Where this rank's receive index rows for `destination` go.
struct ReceiveIndexRows {
    int* slot;
    int* pair;
    float* weight;
    size_t segment_stride;  // between local experts' segments
};

__device__ __forceinline__ ReceiveIndexRows receive_index_rows(const u64* peer_table, int rank, int destination{% if ep.network.is_some() %},
                                                                int* net_send_slot, int* net_send_pair, float* net_send_weight{% endif %}) {
    ReceiveIndexRows rows;
{%- if ep.network.is_some() %}
    // A destination on another node gets this rank's part of its receive index through
    // NCCL: staged in this rank's outbox (reused only once the network stream has sent the
    // last call's, by stream order: no credit), then handed over by a ready flag.
    const int network_slot = NETWORK_SLOT[rank][destination];
    if (network_slot >= 0) {
        const size_t base = (size_t)network_slot * LOCAL_EXPERTS * SEGMENT_ROWS;
        rows.slot = net_send_slot + base;
        rows.pair = net_send_pair + base;
        rows.weight = net_send_weight + base;
        rows.segment_stride = SEGMENT_ROWS;
        return rows;
    }
{%- endif %}
    const size_t base = (size_t)rank * SEGMENT_ROWS;
    rows.slot = peer_buffer<int>(peer_table, destination, PEER_RECV_SLOT) + base;
    rows.pair = peer_buffer<int>(peer_table, destination, PEER_RECV_PAIR) + base;
    rows.weight = peer_buffer<float>(peer_table, destination, PEER_RECV_WEIGHT) + base;
    rows.segment_stride = (size_t)RANKS * SEGMENT_ROWS;
    return rows;
}

// Where this rank's counts for `destination` go (rows per local expert, then tokens sent),
// and the flag that hands them over.
__device__ __forceinline__ int* receive_counts_at(const u64* peer_table, int rank, int destination{% if ep.network.is_some() %}, int* net_send_counts{% endif %}) {
{%- if ep.network.is_some() %}
    const int network_slot = NETWORK_SLOT[rank][destination];
    if (network_slot >= 0) return net_send_counts + network_slot * (LOCAL_EXPERTS + 1);
{%- endif %}
    return peer_buffer<int>(peer_table, destination, PEER_RECV_COUNTS) + rank * (LOCAL_EXPERTS + 1);
}

__device__ __forceinline__ u32* metadata_flag_at(const u64* peer_table, int rank, int destination{% if ep.network.is_some() %}, u32* net_ready{% endif %}) {
{%- if ep.network.is_some() %}
    const int network_slot = NETWORK_SLOT[rank][destination];
    if (network_slot >= 0) return net_ready + network_slot * READY_STRIDE;
{%- endif %}
    return peer_buffer<u32>(peer_table, destination, PEER_META_FLAGS) + rank;
}

// Whether choice k of a token (`ids`: its TOP_K expert ids) names an expert an earlier
// choice already named. Such a pair is neither dispatched nor combined, and is reported: a
// (local expert, source) segment of the receive index holds each token at most once.
__device__ __forceinline__ bool repeats_earlier_choice(const int* ids, int k) {
    for (int j = 0; j < k; ++j) {
        if (ids[j] == ids[k]) return true;
    }
    return false;
}

// Whether choice k of `token` has a combine slot to wait for: a shared slice, or a routed
// expert in range that no earlier choice repeats.
__device__ __forceinline__ bool pair_combined(const int* topk_ids, int token, int k) {
    if (k >= TOP_K) return true;
    const int* ids = topk_ids + (size_t)token * TOP_K;
    return (unsigned)ids[k] < (unsigned)EXPERTS && !repeats_earlier_choice(ids, k);
}

// Block 0 clears the call's error word; another block reports an error only once it has
// (a rare path: the wait is bounded like every other).
// Out of line (the path is rare) and `static` (internal: it needs no device symbol).
static __device__ __noinline__ void report_after_clear(int* error_word, const u32* errors_cleared, u32 epoch, int code,
                                                       int a, int b, int c) {
    if (blockIdx.x != 0) {
        const long long start = clock64();
        while (!flag_reached(flag_load(errors_cleared), epoch) && clock64() - start < SPIN_LIMIT_CYCLES) {
        }
    }
    report_error(error_word, code, a, b, c);
}

#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_{{ ep.route.name }})
extern "C" __global__ void __launch_bounds__(META_THREADS, 1) {{ ep.route.name }}(
    {{ ep.route.params }}
)
{
    __shared__ int s_expert_rows[EXPERTS];       // the tile's pairs per expert
    __shared__ int s_expert_start[EXPERTS + 1];  // where each expert's pairs start in s_staged
    __shared__ int s_expert_base[EXPERTS];       // the tile's first row in each expert's segment
    __shared__ int s_destination_slots[RANKS];   // the tile's tokens per destination
    __shared__ int s_destination_base[RANKS];    // the tile's first send slot per destination
    __shared__ u32 s_pair_slot[META_TILE_PAIRS];             // tile-local slot, OWNER_BIT on its first pair
    __shared__ unsigned short s_pair_rank[META_TILE_PAIRS];  // rank among the tile's pairs of its expert
    __shared__ unsigned short s_staged[META_TILE_PAIRS];     // the tile's pairs sorted by expert
    __shared__ int s_last_block;
    static_assert(static_smem_reserved(sizeof(s_expert_rows) + sizeof(s_expert_start) + sizeof(s_expert_base) +
                                       sizeof(s_destination_slots) + sizeof(s_destination_base) +
                                       sizeof(s_pair_slot) + sizeof(s_pair_rank) + sizeof(s_staged) +
                                       sizeof(s_last_block)) == EP_ROUTE_STATIC_SMEM_BYTES,
                  "plan: metadata kernel's static shared memory");
    u32* const expert_rows = metadata_counters + COUNTER_EXPERT_ROWS;
    u32* const destination_slots = metadata_counters + COUNTER_DESTINATION_SLOTS;
    u32* const errors_cleared = metadata_counters + COUNTER_ERRORS_CLEARED;
    // This kernel starts every call's communication: block 0 clears the error word of the last.
    if (blockIdx.x == 0 && threadIdx.x < 4) error_word[threadIdx.x] = 0;
    for (int destination = threadIdx.x; destination < RANKS; destination += META_THREADS) {
{%- if ep.network.is_some() %}
        if (NETWORK_SLOT[rank][destination] >= 0) continue;
{%- endif %}
        wait_flag(credits + destination, epoch - 1, error_word, rank, FLAG_KIND_CREDIT, destination);
    }
    __syncthreads();
    if (blockIdx.x == 0 && threadIdx.x == 0) flag_store(errors_cleared, epoch);

    const int tiles = (tokens + META_TILE_TOKENS - 1) / META_TILE_TOKENS;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int first_token = tile * META_TILE_TOKENS;
        const int tile_pairs = min(META_TILE_TOKENS, tokens - first_token) * TOP_K;
        const int* tile_ids = topk_ids + (size_t)first_token * TOP_K;
        for (int e = threadIdx.x; e < EXPERTS; e += META_THREADS) s_expert_rows[e] = 0;
        for (int d = threadIdx.x; d < RANKS; d += META_THREADS) s_destination_slots[d] = 0;
        __syncthreads();
        // Count, a thread per token: its slot per destination, each pair's rank in its expert.
        for (int t = threadIdx.x; t * TOP_K < tile_pairs; t += META_THREADS) {
            int destination_of[TOP_K];
            u32 slot_of[TOP_K];
#pragma unroll
            for (int k = 0; k < TOP_K; ++k) {
                const int pair = t * TOP_K + k;
                const int expert = tile_ids[pair];
                destination_of[k] = -1;
                slot_of[k] = 0;
                if ((unsigned)expert >= (unsigned)EXPERTS || repeats_earlier_choice(tile_ids + t * TOP_K, k)) {
                    report_after_clear(error_word, errors_cleared, epoch,
                                       (unsigned)expert >= (unsigned)EXPERTS ? ERROR_EXPERT_ID_OUT_OF_RANGE
                                                                              : ERROR_EXPERT_ID_REPEATED,
                                       first_token + t, k, expert);
                    s_pair_rank[pair] = NO_PAIR;
                    continue;
                }
                const int destination = expert / LOCAL_EXPERTS;
                bool first = true;
#pragma unroll
                for (int j = 0; j < k; ++j) {
                    if (first && destination_of[j] == destination) {
                        slot_of[k] = slot_of[j] & ~OWNER_BIT;
                        first = false;
                    }
                }
                if (first) slot_of[k] = (u32)atomicAdd(&s_destination_slots[destination], 1) | OWNER_BIT;
                destination_of[k] = destination;
                s_pair_slot[pair] = slot_of[k];
                s_pair_rank[pair] = (unsigned short)atomicAdd(&s_expert_rows[expert], 1);
            }
        }
        __syncthreads();
        // Reserve the tile's rows and slots; lay its pairs out by expert.
        if (threadIdx.x < 32) warp_exclusive_scan(EXPERTS, [&](int e) { return s_expert_rows[e]; }, s_expert_start);
        for (int e = threadIdx.x; e < EXPERTS; e += META_THREADS) {
            if (s_expert_rows[e] > 0) s_expert_base[e] = (int)atomicAdd(expert_rows + e, (u32)s_expert_rows[e]);
        }
        for (int d = threadIdx.x; d < RANKS; d += META_THREADS) {
            if (s_destination_slots[d] > 0) {
                s_destination_base[d] = (int)atomicAdd(destination_slots + d, (u32)s_destination_slots[d]);
            }
        }
        __syncthreads();
        for (int pair = threadIdx.x; pair < tile_pairs; pair += META_THREADS) {
            const unsigned short rank_in_expert = s_pair_rank[pair];
            if (rank_in_expert == NO_PAIR) continue;
            const int expert = tile_ids[pair];
            s_staged[s_expert_start[expert] + rank_in_expert] = (unsigned short)pair;
            const u32 slot = s_pair_slot[pair];
            if (slot & OWNER_BIT) {
                const int destination = expert / LOCAL_EXPERTS;
                send_slots[destination * MAX_TOKENS + s_destination_base[destination] + (slot & ~OWNER_BIT)] =
                    first_token + pair / TOP_K;
            }
        }
        __syncthreads();
        // Write: consecutive staged pairs of an expert are consecutive rows of its segment.
        for (int i = threadIdx.x; i < s_expert_start[EXPERTS]; i += META_THREADS) {
            const int pair = s_staged[i];
            const int expert = tile_ids[pair];
            const int destination = expert / LOCAL_EXPERTS;
            const ReceiveIndexRows index = receive_index_rows(peer_table, rank, destination{% if ep.network.is_some() %}, net_send_slot, net_send_pair, net_send_weight{% endif %});
            const size_t row = (size_t)(expert - destination * LOCAL_EXPERTS) * index.segment_stride +
                               s_expert_base[expert] + (i - s_expert_start[expert]);
            index.slot[row] = s_destination_base[destination] + (int)(s_pair_slot[pair] & ~OWNER_BIT);
            index.pair[row] = (first_token + pair / TOP_K) * SLOTS_PER_TOKEN + pair % TOP_K;
            index.weight[row] = topk_weights[(size_t)first_token * TOP_K + pair];
        }
        __syncthreads();  // the next tile reuses the shared arrays
    }

    // The last block done (every block's rows ordered before its count by its fence) writes
    // the counts, takes the counters back to zero and releases each destination's flag. A
    // lone block (the decode calls) is last without asking.
    if (threadIdx.x == 0) {
        if (gridDim.x == 1) {
            s_last_block = 1;
        } else {
            fence_flags();
            s_last_block = atomicAdd(metadata_counters + COUNTER_BLOCKS_DONE, 1u) == gridDim.x - 1;
            if (s_last_block) fence_flags();
        }
    }
    __syncthreads();
    if (!s_last_block) return;
    for (int e = threadIdx.x; e < EXPERTS; e += META_THREADS) {
        const int destination = e / LOCAL_EXPERTS, local = e - destination * LOCAL_EXPERTS;
        const int rows = (int)atomicExch(expert_rows + e, 0u);
        receive_counts_at(peer_table, rank, destination{% if ep.network.is_some() %}, net_send_counts{% endif %})[local] = rows;
    }
    for (int destination = threadIdx.x; destination < RANKS; destination += META_THREADS) {
        const int slots = (int)atomicExch(destination_slots + destination, 0u);
        receive_counts_at(peer_table, rank, destination{% if ep.network.is_some() %}, net_send_counts{% endif %})[LOCAL_EXPERTS] = slots;
        send_counts[destination] = slots;
    }
    if (threadIdx.x == 0) metadata_counters[COUNTER_BLOCKS_DONE] = 0;
    __syncthreads();  // every count is written before the releases
    for (int destination = threadIdx.x; destination < RANKS; destination += META_THREADS) {
        u32* metadata_flag = metadata_flag_at(peer_table, rank, destination{% if ep.network.is_some() %}, net_ready{% endif %});
        fence_flags();
        flag_store(metadata_flag, epoch);
    }
}
#endif

// Dispatch: to every peer (a rank's own rows stay in x, where its GEMM1 reads them). Work
// items are pieces of a chunk, (destination in send order, piece); block b
// takes items b, b + gridDim.x, ... Each copies its token rows into this rank's segment
// of the destination's recv_x and counts itself in its chunk; the copier of a chunk's last
// piece releases that chunk's flag there (and puts the count back to zero for the next
// call). A piece is a whole chunk when the call has a chunk for every block; a call of
// fewer chunks splits them (down to MIN_PIECE tokens) so that every block copies. Each
// piece costs a fence that waits for its stores to land, so pieces stay as large as that
// allows.
#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_{{ ep.dispatch.name }})
extern "C" __global__ void __launch_bounds__(COMM_THREADS) {{ ep.dispatch.name }}(
    {{ ep.dispatch.params }}
)
{
    constexpr unsigned VECTORS = HIDDEN / 8;  // 16-byte vectors per row
    int chunks_in_call = 0;
    for (int destination = 0; destination < RANKS; ++destination) {
        if (destination != rank) chunks_in_call += (send_counts[destination] + CHUNK - 1) / CHUNK;
    }
    int piece_tokens = CHUNK;
    while ((piece_tokens / MIN_PIECE) % 2 == 0 && chunks_in_call * (CHUNK / piece_tokens) < (int)gridDim.x) {
        piece_tokens /= 2;
    }
    int item = blockIdx.x;
    int items_before = 0;
    for (int step = 0; step < RANKS; ++step) {
        const int destination = SEND_ORDER[rank][step];
        if (destination == rank) continue;
        const int sent = send_counts[destination];
        const int pieces = (sent + piece_tokens - 1) / piece_tokens;
{%- if ep.network.is_some() %}
        // Rows for a peer on another node are staged in this rank's outbox, and each chunk's
        // "flag" is its ready flag, which the network stream waits on before sending it.
        const int network_slot = NETWORK_SLOT[rank][destination];
        bf16_t* recv_x = network_slot >= 0
                             ? net_send_x + (size_t)network_slot * SLOTS * HIDDEN
                             : peer_buffer<bf16_t>(peer_table, destination, PEER_RECV_X) + (size_t)rank * SLOTS * HIDDEN;
        u32* chunk_flags = network_slot >= 0 ? net_ready + network_slot * READY_STRIDE + 1
                                             : peer_buffer<u32>(peer_table, destination, PEER_CHUNK_FLAGS) + rank * CHUNKS;
{%- else %}
        bf16_t* recv_x = peer_buffer<bf16_t>(peer_table, destination, PEER_RECV_X) + (size_t)rank * SLOTS * HIDDEN;
        u32* chunk_flags = peer_buffer<u32>(peer_table, destination, PEER_CHUNK_FLAGS) + rank * CHUNKS;
{%- endif %}
        u32* pieces_done = chunk_pieces + destination * CHUNKS;
        const int* slot_token = send_slots + destination * MAX_TOKENS;
        for (; item < items_before + pieces; item += gridDim.x) {
            const int piece = item - items_before;
            const int first = piece * piece_tokens;
            const unsigned vectors = min(piece_tokens, sent - first) * VECTORS;
            for (unsigned base = threadIdx.x; base < vectors; base += COMM_THREADS * COPY_UNROLL) {
                Vec16 value[COPY_UNROLL];
#pragma unroll
                for (int u = 0; u < COPY_UNROLL; ++u) {
                    const unsigned i = base + u * COMM_THREADS;
                    if (i < vectors) {
                        const int token = slot_token[first + i / VECTORS];
                        value[u] = reinterpret_cast<const Vec16*>(x + (size_t)token * HIDDEN)[i % VECTORS];
                    }
                }
#pragma unroll
                for (int u = 0; u < COPY_UNROLL; ++u) {
                    const unsigned i = base + u * COMM_THREADS;
                    if (i < vectors) {
                        reinterpret_cast<Vec16*>(recv_x + (size_t)(first + i / VECTORS) * HIDDEN)[i % VECTORS] = value[u];
                    }
                }
            }
            __syncthreads();  // the whole piece is written before it is counted
            if (threadIdx.x == 0) {
                const int chunk = first / CHUNK;
                const int chunk_rows = min(CHUNK, sent - chunk * CHUNK);
                const u32 chunk_piece_count = (chunk_rows + piece_tokens - 1) / piece_tokens;
                fence_flags();
                if (atomicAdd(pieces_done + chunk, 1u) == chunk_piece_count - 1) {
                    pieces_done[chunk] = 0;
                    fence_flags();  // every piece's rows (ordered by its copier's fence) first
                    flag_store(chunk_flags + chunk, epoch);
                }
            }
        }
        items_before += pieces;
    }
{%- if ep.network.is_some() %}
    // The network stream sends every chunk of a source's capacity (NCCL's counts are fixed
    // on the host): the chunks this call leaves empty are ready at once.
    if (blockIdx.x == 0) {
        for (int destination = 0; destination < RANKS; ++destination) {
            const int network_slot = NETWORK_SLOT[rank][destination];
            if (network_slot < 0) continue;
            const int first_empty = (send_counts[destination] + CHUNK - 1) / CHUNK;
            for (int chunk = first_empty + threadIdx.x; chunk < CHUNKS; chunk += COMM_THREADS) {
                flag_store(net_ready + network_slot * READY_STRIDE + 1 + chunk, epoch);
            }
        }
    }
{%- endif %}
}
#endif

// Arrange: once every source's metadata is here, lay the GEMM rows out per local expert,
// its sources in receive order (local rows first): the row each reads from recv_x, its
// origin rank and pair, and its routing weight (a row of this rank's own tokens reads x
// at OWN_ROW_BASE + token: nothing copies it). After the local experts, each shared slice
// has a row per own token (source = this rank), in token order, weight 1. Every block waits
// for the metadata and scans the (local expert, source) counts itself, then takes GEMM
// rows b, b + grid, ... (one thread a row, so the reads of the receive index all overlap).
// The last block done returns every source's credit.
#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_{{ ep.arrange.name }})
extern "C" __global__ void __launch_bounds__(META_THREADS, 1) {{ ep.arrange.name }}(
    {{ ep.arrange.params }}
)
{
    __shared__ int s_offsets[SEGMENTS + 1];
    __shared__ int s_arrived;
    __shared__ int s_last_block;
    static_assert(static_smem_reserved(sizeof(s_offsets) + sizeof(s_arrived) + sizeof(s_last_block)) ==
                      EP_ARRANGE_STATIC_SMEM_BYTES,
                  "plan: arrange kernel's static shared memory");
    if (threadIdx.x == 0) s_arrived = 1;
    __syncthreads();
    for (int source = threadIdx.x; source < RANKS; source += META_THREADS) {
        if (!wait_flag(meta_flags + source, epoch, error_word, rank, FLAG_KIND_META, source)) s_arrived = 0;
    }
    __syncthreads();
    // Without every source's counts the rows are unknown: compute none (the error is set).
    const int* order = RECEIVE_ORDER[rank];
    if (threadIdx.x < 32) {
        warp_exclusive_scan(SEGMENTS, [&](int g) {
            const int local = g / RANKS, source = order[g % RANKS];
            if (local >= LOCAL_EXPERTS) return source == rank ? tokens : 0;
            return s_arrived ? recv_counts[source * (LOCAL_EXPERTS + 1) + local] : 0;
        }, s_offsets);
    }
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int g = threadIdx.x; g <= SEGMENTS; g += META_THREADS) segment_offsets[g] = s_offsets[g];
{%- if ep.rank_partials %}
        // The combine walks the received tokens after the sources' next metadata may have
        // replaced recv_counts: it reads this copy.
        for (int source = threadIdx.x; source < RANKS; source += META_THREADS) {
            received_tokens[source] =
                source == rank ? tokens : s_arrived ? recv_counts[source * (LOCAL_EXPERTS + 1) + LOCAL_EXPERTS] : 0;
        }
{%- endif %}
    }
    const int rows = s_offsets[SEGMENTS];
    for (int row = blockIdx.x * META_THREADS + threadIdx.x; row < rows; row += gridDim.x * META_THREADS) {
        // The segment holding this row: the last g with s_offsets[g] <= row.
        int lo = 0, hi = SEGMENTS - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_offsets[mid] <= row) lo = mid; else hi = mid - 1;
        }
        const int source = order[lo % RANKS];
        if (lo / RANKS >= LOCAL_EXPERTS) {
            const int token = row - s_offsets[lo], slice = lo / RANKS - LOCAL_EXPERTS;
            segment_rows[row] = OWN_ROW_BASE + token;
            segment_pairs[row] = token * SLOTS_PER_TOKEN + TOP_K + slice;
            segment_weights[row] = 1.f;
            row_origins[row] = rank;
{%- if ep.rank_partials %}
            received_pair_rows[(size_t)(OWN_ROW_BASE + token) * SLOTS_PER_TOKEN + TOP_K + slice] = row + 1;
{%- endif %}
            continue;
        }
        const size_t from = ((size_t)(lo / RANKS) * RANKS + source) * SEGMENT_ROWS + (row - s_offsets[lo]);
        const int slot = recv_slot[from];
        const int received_row = source == rank ? OWN_ROW_BASE + send_slots[rank * MAX_TOKENS + slot] : source * SLOTS + slot;
        const int pair = recv_pair[from];
        segment_rows[row] = received_row;
        segment_pairs[row] = pair;
        segment_weights[row] = recv_weight[from];
        row_origins[row] = source;
{%- if ep.rank_partials %}
        received_pair_rows[(size_t)received_row * SLOTS_PER_TOKEN + pair % SLOTS_PER_TOKEN] = row + 1;
{%- endif %}
    }
    // Every source's counts and index are consumed once every block is done with them:
    // the last block gives each source its credit back.
    __syncthreads();
    if (threadIdx.x == 0) {
        fence_flags();  // this block's reads of the receive index are done
        s_last_block = atomicAdd(arrange_blocks_done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!s_last_block) return;
    if (threadIdx.x == 0) *arrange_blocks_done = 0;
    for (int source = threadIdx.x; source < RANKS; source += META_THREADS) {
{%- if ep.network.is_some() %}
        // A source on another node wrote nothing here: NCCL did, in this rank's stream order.
        if (NETWORK_SLOT[rank][source] >= 0) continue;
{%- endif %}
        fence_flags();
        flag_store(peer_buffer<u32>(peer_table, source, PEER_CREDITS) + rank, epoch);
    }
}
#endif

// Combine: a token's slots are complete when its counter holds HIDDEN columns per valid
// pair and per shared slice; the sum runs in slot order (deterministic), then the counter
// is taken back to zero for the next call. A block is COMBINE_LANES token lanes of
// COMBINE_THREADS threads, each lane a token at a time with barriers of its own, so that a
// grid of one block per SM (virtual ranks, ranks beside NCCL) still has several tokens'
// loads in flight on each SM.

// The barrier of one token lane (named barrier 1 + lane; 0 is __syncthreads).
__device__ __forceinline__ void lane_sync(int lane) {
    asm volatile("bar.sync %0, %1;" ::"r"(lane + 1), "r"(COMBINE_THREADS) : "memory");
}

#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_{{ ep.combine.name }})
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS * COMBINE_LANES) {{ ep.combine.name }}(
    {{ ep.combine.params }}
)
{
    const int lane = threadIdx.x / COMBINE_THREADS;
    const int thread = threadIdx.x % COMBINE_THREADS;
    const int first_item = blockIdx.x * COMBINE_LANES + lane;
    const int item_stride = gridDim.x * COMBINE_LANES;
{%- if ep.rank_partials %}
    // First the partials: every token received here (each source's in slot order, then
    // this rank's own) has its rows summed in k order into one row at its origin, then
    // HIDDEN columns of the origin's counter released. Nothing in this part waits, so
    // every lane has sent its share before it waits on its own tokens below. Releases go
    // PARTIALS_PER_RELEASE at a time, a thread each, so their fences overlap.
    __shared__ int s_release_source[COMBINE_LANES][PARTIALS_PER_RELEASE];
    __shared__ int s_release_token[COMBINE_LANES][PARTIALS_PER_RELEASE];
    __shared__ int s_release_row[COMBINE_LANES][PARTIALS_PER_RELEASE];
    static_assert(static_smem_reserved(sizeof(s_release_source) + sizeof(s_release_token) + sizeof(s_release_row)) ==
                      EP_COMBINE_STATIC_SMEM_BYTES,
                  "plan: combine kernel's static shared memory");
    // Once every thread of the lane has stored its columns of the pending partials: thread
    // j clears the pair rows of pending partial j and releases it at its origin.
    const auto release_pending = [&](int pending) {
        lane_sync(lane);
        if (thread < pending) {
            int* pair_rows = received_pair_rows + (size_t)s_release_row[lane][thread] * SLOTS_PER_TOKEN;
            for (int k = 0; k < SLOTS_PER_TOKEN; ++k) pair_rows[k] = 0;
            fence_flags();
            flag_add(peer_buffer<u32>(peer_table, s_release_source[lane][thread], PEER_COMBINE_COUNTERS) +
                         s_release_token[lane][thread],
                     HIDDEN);
        }
        lane_sync(lane);  // the slots are free for the next partials
    };
    int received = 0;
    for (int source = 0; source < RANKS; ++source) received += received_tokens[source];
    int pending = 0;
    for (int item = first_item; item < received; item += item_stride) {
        int source = 0, index = item;
        while (index >= received_tokens[source]) index -= received_tokens[source++];
        const int received_row = source == rank ? OWN_ROW_BASE + index : source * SLOTS + index;
        const int* pair_rows = received_pair_rows + (size_t)received_row * SLOTS_PER_TOKEN;
        const bf16_t* rows[SLOTS_PER_TOKEN];
        int token = -1;
#pragma unroll
        for (int k = 0; k < SLOTS_PER_TOKEN; ++k) {
            const int row = pair_rows[k];
            rows[k] = row > 0 ? pair_results + (size_t)(row - 1) * HIDDEN : nullptr;
            if (row > 0 && token < 0) token = segment_pairs[row - 1] / SLOTS_PER_TOKEN;
        }
        if (token < 0) continue;  // an own token with no expert here (the same for the whole lane)
        combine_rows<SLOTS_PER_TOKEN>(rows, peer_buffer<bf16_t>(peer_table, source, PEER_COMBINE_SLOTS) +
                                                ((size_t)token * RANKS + rank) * HIDDEN,
                                      thread);
        if (thread == 0) {
            s_release_source[lane][pending] = source;
            s_release_token[lane][pending] = token;
            s_release_row[lane][pending] = received_row;
        }
        if (++pending == PARTIALS_PER_RELEASE) {
            release_pending(pending);
            pending = 0;
        }
    }
    release_pending(pending);
{%- else %}
    static_assert(EP_COMBINE_STATIC_SMEM_BYTES == 0, "plan: combine kernel's static shared memory");
{%- endif %}
    for (int token = first_item; token < tokens; token += item_stride) {
{%- if ep.network.is_some() %}
        // A pair computed on another node comes back through NCCL into net_returned_x (that
        // rank's slot), released per (source, token chunk); the counter counts the rest.
        const bf16_t* rows[SLOTS_PER_TOKEN];
        int network_source[SLOTS_PER_TOKEN];
        u32 counted = 0;
#pragma unroll
        for (int k = 0; k < SLOTS_PER_TOKEN; ++k) {
            const size_t pair = (size_t)token * SLOTS_PER_TOKEN + k;
            const bool present = pair_combined(topk_ids, token, k);
            const int source = k < TOP_K && present ? topk_ids[token * TOP_K + k] / LOCAL_EXPERTS : rank;
            const int network_slot = NETWORK_SLOT[rank][source];
            network_source[k] = present && network_slot >= 0 ? source : -1;
            rows[k] = !present             ? nullptr
                      : network_slot >= 0 ? net_returned_x + ((size_t)network_slot * MAX_PAIRS + pair) * HIDDEN
                                          : combine_slots + pair * HIDDEN;
            counted += present && network_slot < 0;
        }
        const u32 target = counted * HIDDEN;
        bool complete = false;
        if (thread == 0) {
            complete = wait_flag(combine_counters + token, target, error_word, rank, FLAG_KIND_COMBINE, token);
            for (int k = 0; k < TOP_K; ++k) {
                const int source = network_source[k];
                if (source < 0) continue;
                const int chunk = token / CHUNK;
                wait_flag(net_return_flags + NETWORK_SLOT[rank][source] * CHUNKS + chunk, epoch, error_word, rank,
                          FLAG_KIND_RETURN, source * CHUNKS + chunk);
            }
        }
        lane_sync(lane);
        combine_rows<SLOTS_PER_TOKEN>(rows, y + (size_t)token * HIDDEN, thread);
        lane_sync(lane);  // every thread read the rows before the counter is reset
        if (thread == 0 && complete) atomicSub(combine_counters + token, target);
    }
}
{%- else if ep.rank_partials %}
        bool present[RANKS];
        u32 visited = 0;
#pragma unroll
        for (int r = 0; r < RANKS; ++r) present[r] = SHARED_SLICES > 0 && r == rank;
        for (int k = 0; k < TOP_K; ++k) {
            if (pair_combined(topk_ids, token, k)) present[topk_ids[token * TOP_K + k] / LOCAL_EXPERTS] = true;
        }
#pragma unroll
        for (int r = 0; r < RANKS; ++r) visited += present[r];
        const u32 target = visited * HIDDEN;
        bool complete = false;
        if (thread == 0) complete = wait_flag(combine_counters + token, target, error_word, rank, FLAG_KIND_COMBINE, token);
        lane_sync(lane);
        combine_token<RANKS>(combine_slots, token, present, y, thread);
        lane_sync(lane);  // every thread read the partials before the counter is reset
        if (thread == 0 && complete) atomicSub(combine_counters + token, target);
    }
}
{%- else %}
        bool present[SLOTS_PER_TOKEN];
        u32 valid = 0;
#pragma unroll
        for (int k = 0; k < SLOTS_PER_TOKEN; ++k) {
            present[k] = pair_combined(topk_ids, token, k);
            valid += present[k];
        }
        const u32 target = valid * HIDDEN;
        // Thread 0 of the lane waits for the token and later resets its counter: only it
        // needs to know whether the wait succeeded (a register, not shared memory every
        // thread would read).
        bool complete = false;
        if (thread == 0) complete = wait_flag(combine_counters + token, target, error_word, rank, FLAG_KIND_COMBINE, token);
        lane_sync(lane);
        combine_token<SLOTS_PER_TOKEN>(combine_slots, token, present, y, thread);
        lane_sync(lane);  // every thread read the slots before the counter is reset
        if (thread == 0 && complete) atomicSub(combine_counters + token, target);
    }
}
{%- endif %}
#endif
