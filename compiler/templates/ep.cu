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
{%- if ep.fused_decode %}
// A call of a few tokens per rank runs all of this as one kernel per rank instead, on every
// rank (the rank regime's `<layer>_<regime>_ep_fused`, ep_fused_decode at the end).
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
// Across nodes ({{ network.nodes }} nodes of {{ network.gpus_per_node }} GPUs; ranks fill nodes in order): a rank reaches its
// peers on other nodes through NCCL, which the runtime runs on a network stream beside
// these kernels, and hierarchically: a token's row crosses to each other node it visits
// once, to the sender's rail peer there (the rank with its local index), which forwards it
// to the ranks of its node the token visits (the visit mask: a bit per rank of the node)
// and sums their partials of the token into one node partial, which returns. What leaves
// is staged in this rank's outboxes (net_send_*), each piece followed by a release of its
// ready flag, which the network stream waits on (cuStreamWaitValue32) before it sends it;
// what arrives lands in this rank's inboxes, and the network stream releases their flags
// (cuStreamWriteValue32). Rows for a node travel packed per token chunk (the chunk's
// visiting tokens in token order), so NCCL moves only those; the relay copies each row to
// its token's index at the ranks it visits, and node partials return packed as the rows
// went.
enum : int { GPUS_PER_NODE = {{ network.gpus_per_node }}, OTHER_NODES = {{ network.nodes }} - 1, NETWORK_PEERS = {{ network.peers }} };
__device__ __forceinline__ int node_of(int rank) { return rank / GPUS_PER_NODE; }
// `peer`'s slot among `rank`'s network peers (its receive-index outboxes), -1 on its node.
__device__ __forceinline__ int network_slot(int rank, int peer) {
    const int first = node_of(rank) * GPUS_PER_NODE;
    return peer < first ? peer : peer < first + GPUS_PER_NODE ? -1 : peer - GPUS_PER_NODE;
}
// The slot of `peer`'s node among `rank`'s other nodes (the per-node outboxes and inboxes),
// -1 on its node. Every rank of a node numbers the other nodes alike.
__device__ __forceinline__ int node_slot(int rank, int peer) {
    const int mine = node_of(rank), theirs = node_of(peer);
    return theirs < mine ? theirs : theirs == mine ? -1 : theirs - 1;
}
// `rank`'s rail peer on the other node in `slot`: the rank there with its local index.
__device__ __forceinline__ int rail_peer(int rank, int slot) {
    return (slot < node_of(rank) ? slot : slot + 1) * GPUS_PER_NODE + rank % GPUS_PER_NODE;
}
// net_ready: per network peer the epoch its metadata was staged in, then per other node
// each token chunk's.
__device__ __forceinline__ int chunk_ready_index(int slot, int chunk) { return NETWORK_PEERS + slot * CHUNKS + chunk; }
// The relay of `source`'s rail on `rank`'s node: the rank there with `source`'s local index.
__device__ __forceinline__ int rail_relay(int rank, int source) {
    return node_of(rank) * GPUS_PER_NODE + source % GPUS_PER_NODE;
}
// Packs the `count` tokens of a chunk from `first` on that visit a node (a nonzero mask),
// in token order: each one's row is `first` plus the visiting tokens before it. The
// sender, the relay and the results' way back all pack alike. One whole warp calls it.
__device__ __forceinline__ void pack_visiting_rows(const u32* visits, int first, int count, int* row_of) {
    const int lane = threadIdx.x % 32;
    int packed = 0;
    for (int base = 0; base < count; base += 32) {
        const int token = first + base + lane;
        const bool visiting = base + lane < count && visits[token] != 0;
        const u32 ballot = __ballot_sync(0xffffffffu, visiting);
        if (visiting) row_of[token] = first + packed + __popc(ballot & ((1u << lane) - 1u));
        packed += __popc(ballot);
    }
}
{%- endif %}
{%- if ep.rank_partials %}
// Rank partials: per own token, the slot of each rank that stores its partial here (its
// index on this node: another node's partials come back through the network).
{%- if let Some(network) = ep.network %}
enum : int { PARTIAL_SLOTS = GPUS_PER_NODE };
{%- else %}
enum : int { PARTIAL_SLOTS = RANKS };
{%- endif %}
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
    const int slot = network_slot(rank, destination);
    if (slot >= 0) {
        const size_t base = (size_t)slot * LOCAL_EXPERTS * SEGMENT_ROWS;
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
    const int slot = network_slot(rank, destination);
    if (slot >= 0) return net_send_counts + slot * (LOCAL_EXPERTS + 1);
{%- endif %}
    return peer_buffer<int>(peer_table, destination, PEER_RECV_COUNTS) + rank * (LOCAL_EXPERTS + 1);
}

__device__ __forceinline__ u32* metadata_flag_at(const u64* peer_table, int rank, int destination{% if ep.network.is_some() %}, u32* net_ready{% endif %}) {
{%- if ep.network.is_some() %}
    const int slot = network_slot(rank, destination);
    if (slot >= 0) return net_ready + slot;
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

// Which of a token's slots have a combine row to wait for (`present`), and the count its
// counter reaches once they are all stored: HIDDEN columns per such slot.
__device__ __forceinline__ u32 combine_target(const int* topk_ids, int token, bool (&present)[SLOTS_PER_TOKEN]) {
    u32 valid = 0;
#pragma unroll
    for (int k = 0; k < SLOTS_PER_TOKEN; ++k) {
        present[k] = pair_combined(topk_ids, token, k);
        valid += present[k];
    }
    return valid * HIDDEN;
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
        if (network_slot(rank, destination) >= 0) continue;
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
                destination_of[k] = destination;
                s_pair_rank[pair] = (unsigned short)atomicAdd(&s_expert_rows[expert], 1);
{%- if ep.network.is_some() %}
                // A destination on another node reads the row at its token's index (the
                // rail peer there forwards it): no slot.
                if (network_slot(rank, destination) >= 0) {
                    s_pair_slot[pair] = 0;
                    continue;
                }
{%- endif %}
                bool first = true;
#pragma unroll
                for (int j = 0; j < k; ++j) {
                    if (first && destination_of[j] == destination) {
                        slot_of[k] = slot_of[j] & ~OWNER_BIT;
                        first = false;
                    }
                }
                if (first) slot_of[k] = (u32)atomicAdd(&s_destination_slots[destination], 1) | OWNER_BIT;
                s_pair_slot[pair] = slot_of[k];
            }
{%- if ep.network.is_some() %}
            // The token's visit mask of each other node (0 where it visits none): the rail
            // peer there forwards its row and sums its partials by it.
            for (int slot = 0; slot < OTHER_NODES; ++slot) {
                u32 visits = 0;
#pragma unroll
                for (int k = 0; k < TOP_K; ++k) {
                    const int destination = destination_of[k];
                    if (destination >= 0 && node_slot(rank, destination) == slot) visits |= 1u << (destination % GPUS_PER_NODE);
                }
                net_send_mask[(size_t)slot * MAX_TOKENS + first_token + t] = visits;
            }
{%- endif %}
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
            const int token = first_token + pair / TOP_K;
{%- if ep.network.is_some() %}
            index.slot[row] = network_slot(rank, destination) >= 0
                                  ? token
                                  : s_destination_base[destination] + (int)(s_pair_slot[pair] & ~OWNER_BIT);
{%- else %}
            index.slot[row] = s_destination_base[destination] + (int)(s_pair_slot[pair] & ~OWNER_BIT);
{%- endif %}
            index.pair[row] = token * SLOTS_PER_TOKEN + pair % TOP_K;
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
{%- if ep.network.is_some() %}
        // Across nodes the rows sit at their token's index: the destination walks this many.
        receive_counts_at(peer_table, rank, destination, net_send_counts)[LOCAL_EXPERTS] =
            network_slot(rank, destination) >= 0 ? tokens : slots;
{%- else %}
        receive_counts_at(peer_table, rank, destination)[LOCAL_EXPERTS] = slots;
{%- endif %}
        send_counts[destination] = slots;
    }
{%- if ep.network.is_some() %}
    // Per other node, the rows of each token chunk (its tokens visiting the node), a warp
    // per chunk: the metadata step carries them to the rail peer there, and the host sizes
    // the chunk's transfers by them (unless the call moves whole chunks). Every block's
    // masks are ordered before its count; read past L1.
    for (int i = threadIdx.x / 32; i < OTHER_NODES * CHUNKS; i += META_THREADS / 32) {
        const int first = i % CHUNKS * CHUNK, end = min(first + CHUNK, tokens);
        const u32* visits = net_send_mask + (size_t)(i / CHUNKS) * MAX_TOKENS;
        u32 rows = 0;
        for (int base = first; base < end; base += 32) {
            const int token = base + threadIdx.x % 32;
            rows += __popc(__ballot_sync(0xffffffffu, token < end && __ldcg(visits + token) != 0));
        }
        if (threadIdx.x % 32 == 0) net_send_rows[i] = rows;
    }
{%- endif %}
    if (threadIdx.x == 0) metadata_counters[COUNTER_BLOCKS_DONE] = 0;
    __syncthreads();  // every count is written before the releases
    for (int destination = threadIdx.x; destination < RANKS; destination += META_THREADS) {
        u32* metadata_flag = metadata_flag_at(peer_table, rank, destination{% if ep.network.is_some() %}, net_ready{% endif %});
        fence_flags();
        flag_store(metadata_flag, epoch);
    }
}
#endif

{%- if ep.network.is_some() %}
// Across nodes, a block's copy of `vectors` 16-byte vectors, COPY_UNROLL loads in flight
// per thread before its stores (as the copies to peers on the node, written out below and
// left so: their registers are the ones measured): `load(i, value)` reads vector i
// (false: vector i is not copied), then `store(i, value)` writes it.
template <typename Load, typename Store>
__device__ __forceinline__ void copy_vectors(unsigned vectors, Load load, Store store) {
    for (unsigned base = threadIdx.x; base < vectors; base += COMM_THREADS * COPY_UNROLL) {
        Vec16 value[COPY_UNROLL];
        bool loaded[COPY_UNROLL];
#pragma unroll
        for (int u = 0; u < COPY_UNROLL; ++u) {
            const unsigned i = base + u * COMM_THREADS;
            loaded[u] = i < vectors && load(i, value[u]);
        }
#pragma unroll
        for (int u = 0; u < COPY_UNROLL; ++u) {
            if (loaded[u]) store(base + u * COMM_THREADS, value[u]);
        }
    }
}
{%- endif %}

// Dispatch: to every peer (a rank's own rows stay in x, where its GEMM1 reads them). Work
// items are pieces of a chunk, (destination in send order, piece); block b
// takes items b, b + gridDim.x, ... Each copies its token rows into this rank's segment
// of the destination's recv_x and counts itself in its chunk; the copier of a chunk's last
// piece releases that chunk's flag there (and puts the count back to zero for the next
// call). A piece is a whole chunk when the call has a chunk for every block; a call of
// fewer chunks splits them (down to MIN_PIECE tokens) so that every block copies. Each
// piece costs a fence that waits for its stores to land, so pieces stay as large as that
// allows.
{%- if ep.network.is_some() %}
// Across nodes, first (the network is the slow path) the rows for each other node, a
// whole token chunk an item: the rows of the chunk's tokens that visit a rank there,
// packed in token order from the chunk's first row of the node's outbox (each token's row
// noted in net_send_row, where its node partial comes back), then the chunk's ready flag,
// which the network stream waits on before it sends the chunk's rows to the rail peer
// there. Last, as that relay, the rows the rail peers sent here: once a chunk has arrived
// (its flag, released by the network stream), the same packing of its visit masks finds
// each row's token (noted in net_recv_row, where the token's node partial goes), the row
// goes to the ranks of this node the token visits, itself too, at the token's index of
// their recv_x, and their flag of the chunk is released. One block per SM (as the plan's
// residency counts it) is stated here: left to aim at two, ptxas spilled the relay's copies
// (on one node its own choice is the one measured).
{%- endif %}
#if MOEFORGE_ALL_KERNELS || defined(MOEFORGE_KERNEL_{{ ep.dispatch.name }})
extern "C" __global__ void __launch_bounds__(COMM_THREADS{% if ep.network.is_some() %}, 1{% endif %}) {{ ep.dispatch.name }}(
    {{ ep.dispatch.params }}
)
{
    constexpr unsigned VECTORS = HIDDEN / 8;  // 16-byte vectors per row
    int chunks_in_call = 0;
    for (int destination = 0; destination < RANKS; ++destination) {
        if (destination != rank) chunks_in_call += (send_counts[destination] + CHUNK - 1) / CHUNK;
    }
{%- if ep.network.is_some() %}
    const int token_chunks = (tokens + CHUNK - 1) / CHUNK;
    chunks_in_call += OTHER_NODES * token_chunks;
{%- endif %}
    int piece_tokens = CHUNK;
    while ((piece_tokens / MIN_PIECE) % 2 == 0 && chunks_in_call * (CHUNK / piece_tokens) < (int)gridDim.x) {
        piece_tokens /= 2;
    }
    int item = blockIdx.x;
    int items_before = 0;
{%- if ep.network.is_some() %}
    // Chunk-major: the network stream's step for chunk c moves it to every other node at
    // once, so chunk c of every node is staged before chunk c + 1 of any.
    for (; item < OTHER_NODES * token_chunks; item += gridDim.x) {
        const int chunk = item / OTHER_NODES, slot = item % OTHER_NODES;
        const int first = chunk * CHUNK, chunk_tokens = min(CHUNK, tokens - first);
        const u32* visits = net_send_mask + (size_t)slot * MAX_TOKENS;
        int* row_of = net_send_row + (size_t)slot * MAX_TOKENS;
        bf16_t* outbox = net_send_x + (size_t)slot * MAX_TOKENS * HIDDEN;
        if (threadIdx.x < 32) pack_visiting_rows(visits, first, chunk_tokens, row_of);
        __syncthreads();  // every visiting token's row is known
        copy_vectors(
            chunk_tokens * VECTORS,
            [&](unsigned i, Vec16& value) {
                const int token = first + i / VECTORS;
                if (visits[token] == 0) return false;
                value = reinterpret_cast<const Vec16*>(x + (size_t)token * HIDDEN)[i % VECTORS];
                return true;
            },
            [&](unsigned i, const Vec16& value) {
                const int token = first + i / VECTORS;
                reinterpret_cast<Vec16*>(outbox + (size_t)row_of[token] * HIDDEN)[i % VECTORS] = value;
            });
        __syncthreads();  // the whole chunk is written before it is released
        if (threadIdx.x == 0) {
            fence_flags();
            flag_store(net_ready + chunk_ready_index(slot, chunk), epoch);
        }
    }
    items_before = OTHER_NODES * token_chunks;
{%- endif %}
    for (int step = 0; step < RANKS; ++step) {
        const int destination = SEND_ORDER[rank][step];
        if (destination == rank) continue;
        const int sent = send_counts[destination];
        const int pieces = (sent + piece_tokens - 1) / piece_tokens;
        bf16_t* recv_x = peer_buffer<bf16_t>(peer_table, destination, PEER_RECV_X) + (size_t)rank * SLOTS * HIDDEN;
        u32* chunk_flags = peer_buffer<u32>(peer_table, destination, PEER_CHUNK_FLAGS) + rank * CHUNKS;
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
    // The network stream runs a step for every chunk below the call's tokens bound: the
    // chunks this call leaves empty are ready at once, before any block waits for a relayed
    // chunk (whose step may wait on them).
    if (blockIdx.x == 0) {
        const int empty = CHUNKS - token_chunks;
        for (int i = threadIdx.x; i < OTHER_NODES * empty; i += COMM_THREADS) {
            flag_store(net_ready + chunk_ready_index(i / empty, token_chunks + i % empty), epoch);
        }
    }
    // Relay. Each rail peer's metadata first: how many tokens it has, and their visit masks.
    const int local = rank % GPUS_PER_NODE, node_first = rank - local;
    for (int slot = threadIdx.x; slot < OTHER_NODES; slot += COMM_THREADS) {
        const int source = rail_peer(rank, slot);
        wait_flag(meta_flags + source, epoch, error_word, rank, FLAG_KIND_META, source);
    }
    __syncthreads();
    const auto rail_tokens = [&](int slot) {
        return min(__ldcg(recv_counts + rail_peer(rank, slot) * (LOCAL_EXPERTS + 1) + LOCAL_EXPERTS), MAX_TOKENS);
    };
    int relayed_chunks = 0;
    for (int slot = 0; slot < OTHER_NODES; ++slot) relayed_chunks += (rail_tokens(slot) + CHUNK - 1) / CHUNK;
    for (; item < items_before + relayed_chunks; item += gridDim.x) {
        int slot = 0, chunk = item - items_before;
        for (int chunks; chunk >= (chunks = (rail_tokens(slot) + CHUNK - 1) / CHUNK); ++slot) chunk -= chunks;
        const int source = rail_peer(rank, slot), first = chunk * CHUNK;
        const int chunk_tokens = min(CHUNK, rail_tokens(slot) - first);
        const u32* visits = recv_mask + (size_t)slot * MAX_TOKENS;
        int* row_of = net_recv_row + (size_t)slot * MAX_TOKENS;
        if (threadIdx.x < 32) {
            if (threadIdx.x == 0) {
                wait_flag(net_arrived + slot * CHUNKS + chunk, epoch, error_word, rank, FLAG_KIND_ARRIVED,
                          source * CHUNKS + chunk);
            }
            pack_visiting_rows(visits, first, chunk_tokens, row_of);
        }
        __syncthreads();  // the chunk is here and every visiting token's row is known
        const bf16_t* inbox = net_recv_x + (size_t)slot * MAX_TOKENS * HIDDEN;
        copy_vectors(
            chunk_tokens * VECTORS,
            [&](unsigned i, Vec16& value) {
                const int token = first + i / VECTORS;
                if (visits[token] == 0) return false;
                value = reinterpret_cast<const Vec16*>(inbox + (size_t)row_of[token] * HIDDEN)[i % VECTORS];
                return true;
            },
            [&](unsigned i, const Vec16& value) {
                const int token = first + i / VECTORS;
                const size_t row = (size_t)source * SLOTS + token;
                for (u32 visited = visits[token]; visited != 0; visited &= visited - 1) {
                    const int to = node_first + __ffs(visited) - 1;
                    reinterpret_cast<Vec16*>(peer_buffer<bf16_t>(peer_table, to, PEER_RECV_X) + row * HIDDEN)[i % VECTORS] = value;
                }
            });
        __syncthreads();  // the chunk's rows are copied before its flags are released
        if (threadIdx.x < GPUS_PER_NODE) {
            fence_flags();
            flag_store(peer_buffer<u32>(peer_table, node_first + threadIdx.x, PEER_CHUNK_FLAGS) + source * CHUNKS + chunk, epoch);
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
{%- if shared_gated %}
            segment_weights[row] = shared_gate[token];  // the gated shared expert's weight of the token
{%- else %}
            segment_weights[row] = 1.f;
{%- endif %}
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
        if (network_slot(rank, source) >= 0) continue;
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
            const int source = s_release_source[lane][thread];
{%- if ep.network.is_some() %}
            // A network origin counts nothing here: its partials leave together, below.
            if (network_slot(rank, source) < 0) {
{%- else %}
            {
{%- endif %}
                fence_flags();
                flag_add(peer_buffer<u32>(peer_table, source, PEER_COMBINE_COUNTERS) + s_release_token[lane][thread], HIDDEN);
            }
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
{%- if ep.network.is_some() %}
        // A network origin's partial goes to the relay of its rail on this node (the rank with
        // its local index), which sums the node's partials of the token.
        const int origin_slot = node_slot(rank, source);
        bf16_t* partial = origin_slot >= 0
                              ? peer_buffer<bf16_t>(peer_table, rail_relay(rank, source), PEER_NODE_PARTIALS) +
                                    (((size_t)origin_slot * GPUS_PER_NODE + rank % GPUS_PER_NODE) * MAX_TOKENS + token) * HIDDEN
                              : peer_buffer<bf16_t>(peer_table, source, PEER_COMBINE_SLOTS) +
                                    ((size_t)token * PARTIAL_SLOTS + rank % PARTIAL_SLOTS) * HIDDEN;
{%- else %}
        bf16_t* partial = peer_buffer<bf16_t>(peer_table, source, PEER_COMBINE_SLOTS) + ((size_t)token * RANKS + rank) * HIDDEN;
{%- endif %}
        combine_rows<SLOTS_PER_TOKEN>(rows, partial, thread);
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
{%- if ep.network.is_some() %}
    // Every lane's partials for network origins are stored (release_pending ended on the
    // lane's barrier): the last lane of the grid tells each relay of this node so.
    const int local = rank % GPUS_PER_NODE, node_first = rank - local;
    if (thread == 0) {
        fence_flags();
        if (atomicAdd(net_partials_ready, 1u) == gridDim.x * COMBINE_LANES - 1) {
            net_partials_ready[0] = 0;
            fence_flags();
            for (int relay = node_first; relay < node_first + GPUS_PER_NODE; ++relay) {
                flag_store(peer_buffer<u32>(peer_table, relay, PEER_NODE_PARTIALS_READY) + local, epoch);
            }
        }
    }
    // As the relay of the rail peers' tokens: once every rank of this node has stored its
    // partials here, each token's node partial is the sum of its visited ranks' (in rank
    // order: deterministic), into the return outbox. The grid's last lane then releases
    // them to the network stream, which waits for net_partials_ready[2] before it sends.
    // Each lands at its token's row of the inbox (a chunk's rows packed as they came), so
    // the return steps move only the visiting tokens' (or whole chunks, whose rows past
    // them nobody reads).
    if (thread == 0) {
        for (int b = 0; b < GPUS_PER_NODE; ++b) {
            wait_flag(node_partials_ready + b, epoch, error_word, rank, FLAG_KIND_NODE_PARTIALS, node_first + b);
        }
    }
    lane_sync(lane);
    int relayed = 0;
    for (int slot = 0; slot < OTHER_NODES; ++slot) relayed += received_tokens[rail_peer(rank, slot)];
    for (int item = first_item; item < relayed; item += item_stride) {
        int slot = 0, token = item;
        while (token >= received_tokens[rail_peer(rank, slot)]) token -= received_tokens[rail_peer(rank, slot++)];
        const u32 visits = recv_mask[(size_t)slot * MAX_TOKENS + token];
        if (visits == 0) continue;  // the token visits no rank here (the same for the whole lane)
        const bf16_t* rows[GPUS_PER_NODE];
#pragma unroll
        for (int b = 0; b < GPUS_PER_NODE; ++b) {
            rows[b] = visits >> b & 1u ? node_partials + (((size_t)slot * GPUS_PER_NODE + b) * MAX_TOKENS + token) * HIDDEN
                                       : nullptr;
        }
        const int row = __ldcg(net_recv_row + (size_t)slot * MAX_TOKENS + token);
        combine_rows<GPUS_PER_NODE>(rows, net_return_x + ((size_t)slot * MAX_TOKENS + row) * HIDDEN, thread);
    }
    lane_sync(lane);  // every thread's node partials are stored before the lane counts itself
    if (thread == 0) {
        fence_flags();
        if (atomicAdd(net_partials_ready + 1, 1u) == gridDim.x * COMBINE_LANES - 1) {
            net_partials_ready[1] = 0;
            fence_flags();
            flag_store(net_partials_ready + 2, epoch);
        }
    }
{%- endif %}
{%- else %}
    static_assert(EP_COMBINE_STATIC_SMEM_BYTES == 0, "plan: combine kernel's static shared memory");
{%- endif %}
    for (int token = first_item; token < tokens; token += item_stride) {
{%- if ep.network.is_some() %}
        // One partial per rank of this node the token visited and one per other node: at
        // its first pair there (later pairs are in that partial), and this rank's for the
        // shared slices in the last slot when no pair chose it; summed in that order (fixed
        // by the token's choices; ranks can be many here, so no per-rank array). Another
        // node's comes back through NCCL into net_returned_x (that node's slot, at the row
        // the token's row had in the outbox), released per (node, token chunk); the counter
        // counts the partials of this node's ranks.
        int source_of[TOP_K];     // the rank of each pair, -1 where it is not combined
        int node_slot_of[TOP_K];  // the other node of each pair's rank, -1 for this node's
#pragma unroll
        for (int k = 0; k < TOP_K; ++k) {
            source_of[k] = pair_combined(topk_ids, token, k) ? topk_ids[token * TOP_K + k] / LOCAL_EXPERTS : -1;
            node_slot_of[k] = source_of[k] >= 0 ? node_slot(rank, source_of[k]) : -1;
        }
        const bf16_t* rows[TOP_K + 1];
        int returned_slot[TOP_K];  // where a first pair's node partial lands, -1 for none
        bool own_visited = false;
        u32 counted = 0;
#pragma unroll
        for (int k = 0; k < TOP_K; ++k) {
            const int source = source_of[k], slot = node_slot_of[k];
            bool first = source >= 0;
#pragma unroll
            for (int j = 0; j < k; ++j) first = first && (slot >= 0 ? node_slot_of[j] != slot : source_of[j] != source);
            // Another node's partial: its row is known once its return flag is (below).
            rows[k] = !first || slot >= 0
                          ? nullptr
                          : combine_slots + ((size_t)token * PARTIAL_SLOTS + source % PARTIAL_SLOTS) * HIDDEN;
            returned_slot[k] = first ? slot : -1;
            own_visited = own_visited || (first && source == rank);
            counted += first && slot < 0;
        }
        rows[TOP_K] = SHARED_SLICES > 0 && !own_visited
                          ? combine_slots + ((size_t)token * PARTIAL_SLOTS + rank % PARTIAL_SLOTS) * HIDDEN
                          : nullptr;
        counted += rows[TOP_K] != nullptr;
        const u32 target = counted * HIDDEN;
        bool complete = false;
        if (thread == 0) {
            complete = wait_flag(combine_counters + token, target, error_word, rank, FLAG_KIND_COMBINE, token);
            const int chunk = token / CHUNK;
#pragma unroll
            for (int k = 0; k < TOP_K; ++k) {
                if (returned_slot[k] < 0) continue;
                wait_flag(net_return_flags + returned_slot[k] * CHUNKS + chunk, epoch, error_word, rank,
                          FLAG_KIND_RETURN, rail_peer(rank, returned_slot[k]) * CHUNKS + chunk);
            }
        }
        lane_sync(lane);
        // The token's row in each node's results is its row in this rank's outbox, which
        // ep_dispatch packed before it released the chunk for the network stream: final
        // once the node's return flag is (read past L1).
#pragma unroll
        for (int k = 0; k < TOP_K; ++k) {
            const int slot = returned_slot[k];
            if (slot >= 0) {
                const int row = __ldcg(net_send_row + (size_t)slot * MAX_TOKENS + token);
                rows[k] = net_returned_x + ((size_t)slot * MAX_TOKENS + row) * HIDDEN;
            }
        }
        combine_rows<TOP_K + 1>(rows, y + (size_t)token * HIDDEN, thread);
        lane_sync(lane);  // every thread read the partials before the counter is reset
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
        const u32 target = combine_target(topk_ids, token, present);
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
{%- if ep.fused_decode %}

// ---------------------------------------------------------------------------------------
// Fused decode on a rank: a call of few tokens per rank as one persistent kernel, in
// place of ep_route -> ep_dispatch | ep_arrange -> GEMM1 -> GEMM2 -> ep_combine. Every
// rank of the call runs it (the runtime picks it for all ranks or for none). Per rank:
//   1. every block finds, from this rank's ids, the tokens each destination gets (a token
//      once however many of its experts live there), in token order: its slots there;
//   2. blocks 0.. each hand one destination this rank's ids and weights (its "mailbox":
//      this rank's part of the destination's receive index buffers), once the
//      destination's credit says it has read the last call's, then release the metadata
//      flag there;
//   3. work units claimed in increasing order from a ticket: first each token row a peer
//      gets (copied into its recv_x, the copier of a chunk's last row releasing the chunk
//      flag there), then every GEMM1 tile, then every GEMM2 tile;
//   4. before its first GEMM unit a block waits for every source's mailbox and lays out
//      the GEMM rows in its shared memory, as ep_arrange would (per local expert, sources
//      in receive order, rows in token order); the last block to do so gives every source
//      its credit back;
//   5. a GEMM1 tile waits for the chunks its rows sit in and counts itself in at its
//      expert; a GEMM2 tile issues its first weight stages, waits for its expert's GEMM1
//      tiles, and stores its weighted rows into the origin's combine slots, releasing the
//      origin's per-token counter (pair rows, whatever the table's combine route);
//   6. once past the last unit, block b sums this rank's tokens b, b + grid, ... as
//      ep_combine does, each once its counter is complete.
// Every block of every rank must be resident at once (the plan sizes the grid so): a
// GEMM1 tile waits for rows another rank's blocks copy. Waits are bounded as everywhere.
// ---------------------------------------------------------------------------------------
// A GEMM config of the rank regime with results stored at their origins, pair by pair.
template <class G>
struct PairRowsOf : G {
    enum : bool { RANK_PARTIALS = false };
};

// The ids a source handed this rank, and where its mailbox holds them.
__device__ __forceinline__ const int* mailbox_ids(const int* recv_pair, int source) {
    return recv_pair + (size_t)source * SEGMENT_ROWS;
}
__device__ __forceinline__ const float* mailbox_weights(const float* recv_weight, int source) {
    return recv_weight + (size_t)source * SEGMENT_ROWS;
}

// `counters`: [EXPERTS_HERE] GEMM1 tiles stored per local expert, [EXPERTS_HERE] GEMM2
// tiles that read them, then the next unit's ticket, the blocks done claiming and the
// blocks done laying out (each back to zero after a call).
template <class G1, class G2P, int MAX_TOKENS_FUSED, int MAX_ROWS, int STATIC_SMEM>
__device__ __forceinline__ void ep_fused_decode(
    const bf16_t* __restrict__ x, const bf16_t* __restrict__ w1, const float* __restrict__ w1_bias,
    const bf16_t* __restrict__ w2, const float* __restrict__ w2_bias, const bf16_t* __restrict__ shared_expert_gate,
    const int* __restrict__ topk_ids, const float* __restrict__ topk_weights, int tokens, int rank, u32 epoch,
    const u64* __restrict__ peer_table, const bf16_t* recv_x, const int* recv_counts, const int* recv_pair,
    const float* recv_weight, const u32* meta_flags, const u32* chunk_flags, u32* __restrict__ chunk_pieces,
    const u32* credits, bf16_t* __restrict__ intermediate, const bf16_t* combine_slots, u32* combine_counters,
    u32* __restrict__ counters, int* __restrict__ error_word, bf16_t* __restrict__ y)
{
    using G2 = PairRowsOf<G2P>;
    assert_gemm_layout<G1>();
    assert_gemm_layout<G2>();
    static_assert(G1::KIND == GEMM_UP && G2::KIND == GEMM_DOWN && G1::EP && G2::EP, "plan: a rank's GEMM1 and GEMM2");
    static_assert(G1::THREADS == G2::THREADS && G1::PRODUCER_THREADS == 0 && G2::PRODUCER_THREADS == 0,
                  "plan: both GEMMs mma.sync, with the same threads");
    static_assert(G1::RING_ALIGN == G2::RING_ALIGN, "plan: one ring alignment");
    constexpr int THREADS = G1::THREADS;
    static_assert(MAX_TOKENS_FUSED <= THREADS && THREADS % COMBINE_THREADS == 0 && RANKS <= 64,
                  "plan: a thread per token, whole combine lanes, a destination mask in 64 bits");
    static_assert(MAX_TOKENS_FUSED * TOP_K <= SEGMENT_ROWS, "plan: a mailbox fits a source's first segment");
    constexpr int K_TILES1 = k_tiles<G1>(), N_TILES1 = G1::N / G1::BN;
    constexpr int K_TILES2 = k_tiles<G2>(), N_TILES2 = G2::N / G2::BN;
    constexpr int EXPERTS_HERE = LOCAL_EXPERTS + SHARED_SLICES;
    u32* expert_rows_done = counters;
    u32* expert_rows_read = counters + EXPERTS_HERE;
    u32* next_unit = counters + 2 * EXPERTS_HERE;
    u32* blocks_done = next_unit + 1;
    u32* layouts_done = next_unit + 2;

    unsigned char* smem = aligned_ring<G1>();
    __shared__ unsigned long long s_visits[MAX_TOKENS_FUSED];  // per own token, the destinations it visits
    __shared__ int s_send_token[RANKS][MAX_TOKENS_FUSED];      // per destination, its slots' tokens
    __shared__ int s_send_count[RANKS];
    __shared__ int s_offsets[SEGMENTS + 1];
    __shared__ int s_fill[SEGMENTS];
    __shared__ int s_slot[MAX_TOKENS_FUSED];                   // a source's token's slot here
    __shared__ int s_tokens[RANKS];                            // per source (in receive order), its tokens
    __shared__ int s_local[RANKS][MAX_TOKENS_FUSED * TOP_K];   // per source pair, its local expert here or -1
    __shared__ int s_rows[MAX_ROWS];                           // GEMM1: each row's row of recv_x (or x)
    __shared__ int s_pairs[MAX_ROWS];                          // GEMM2: each row's (token, k) slot at its origin
    __shared__ int s_origins[MAX_ROWS];
    __shared__ float s_weights[MAX_ROWS];
    __shared__ int s_tiles1[SEGMENTS + 1];
    __shared__ int s_tiles2[SEGMENTS + 1];
    __shared__ int s_unit;
    static_assert(static_smem_reserved(sizeof(s_visits) + sizeof(s_send_token) + sizeof(s_send_count) +
                                       sizeof(s_offsets) + sizeof(s_fill) + sizeof(s_slot) + sizeof(s_tokens) +
                                       sizeof(s_local) + sizeof(s_rows) +
                                       sizeof(s_pairs) + sizeof(s_origins) + sizeof(s_weights) + sizeof(s_tiles1) +
                                       sizeof(s_tiles2) + sizeof(s_unit)) == STATIC_SMEM,
                  "plan: the rank's fused decode's static shared memory");

    start_after_previous_kernel();
    if (blockIdx.x == 0 && threadIdx.x < 4) error_word[threadIdx.x] = 0;
    if (threadIdx.x == 0) s_unit = (int)atomicAdd(next_unit, 1u);

    // 1. The destinations of each own token, then each destination's slots.
    for (int t = threadIdx.x; t < tokens; t += THREADS) {
        const int* ids = topk_ids + (size_t)t * TOP_K;
        unsigned long long visits = 0;
        for (int k = 0; k < TOP_K; ++k) {
            const int expert = ids[k];
            const bool repeated = repeats_earlier_choice(ids, k);
            if ((unsigned)expert < (unsigned)EXPERTS && !repeated) {
                visits |= 1ull << (expert / LOCAL_EXPERTS);
            } else if (blockIdx.x == 0) {
                report_error(error_word, repeated ? ERROR_EXPERT_ID_REPEATED : ERROR_EXPERT_ID_OUT_OF_RANGE, t, k, expert);
            }
        }
        s_visits[t] = visits;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < RANKS; d += THREADS) {
        int n = 0;
        for (int t = 0; t < tokens; ++t) {
            if (s_visits[t] >> d & 1) s_send_token[d][n++] = t;
        }
        s_send_count[d] = n;
    }
    __syncthreads();

    // 2. Mailboxes: this rank's ids and weights, whole, for each peer to route itself.
    for (int step = 1 + blockIdx.x; step < RANKS; step += gridDim.x) {
        const int destination = SEND_ORDER[rank][step];
        if (threadIdx.x == 0) wait_flag<false>(credits + destination, epoch - 1, error_word, rank, FLAG_KIND_CREDIT, destination);
        __syncthreads();
        int* ids = peer_buffer<int>(peer_table, destination, PEER_RECV_PAIR) + (size_t)rank * SEGMENT_ROWS;
        float* weights = peer_buffer<float>(peer_table, destination, PEER_RECV_WEIGHT) + (size_t)rank * SEGMENT_ROWS;
        for (int p = threadIdx.x; p < tokens * TOP_K; p += THREADS) {
            ids[p] = topk_ids[p];
            weights[p] = topk_weights[p];
        }
        if (threadIdx.x == 0) peer_buffer<int>(peer_table, destination, PEER_RECV_COUNTS)[rank * (LOCAL_EXPERTS + 1) + LOCAL_EXPERTS] = tokens;
        __syncthreads();
        if (threadIdx.x == 0) {
            fence_flags();
            flag_store(peer_buffer<u32>(peer_table, destination, PEER_META_FLAGS) + rank, epoch);
        }
    }

    // 3. Rows to peers, one unit each, in send order.
    int sends = 0;
    for (int d = 0; d < RANKS; ++d) sends += d == rank ? 0 : s_send_count[d];
    int unit = s_unit;  // (the barriers above published it)
    __syncthreads();    // every thread has read its first ticket
    while (unit < sends) {
        if (threadIdx.x == 0) s_unit = (int)atomicAdd(next_unit, 1u);
        int destination = 0, slot = unit;
        for (int step = 1; step < RANKS; ++step) {
            destination = SEND_ORDER[rank][step];
            if (slot < s_send_count[destination]) break;
            slot -= s_send_count[destination];
        }
        constexpr int VECTORS = HIDDEN / 8;
        const Vec16* from = reinterpret_cast<const Vec16*>(x + (size_t)s_send_token[destination][slot] * HIDDEN);
        Vec16* to = reinterpret_cast<Vec16*>(peer_buffer<bf16_t>(peer_table, destination, PEER_RECV_X) +
                                             ((size_t)rank * SLOTS + slot) * HIDDEN);
        for (int base = threadIdx.x; base < VECTORS; base += THREADS * COPY_UNROLL) {
            Vec16 value[COPY_UNROLL];
#pragma unroll
            for (int u = 0; u < COPY_UNROLL; ++u) {
                if (base + u * THREADS < VECTORS) value[u] = from[base + u * THREADS];
            }
#pragma unroll
            for (int u = 0; u < COPY_UNROLL; ++u) {
                if (base + u * THREADS < VECTORS) to[base + u * THREADS] = value[u];
            }
        }
        __syncthreads();  // the whole row is written before it is counted; the next ticket is in
        if (threadIdx.x == 0) {
            const int chunk = slot / CHUNK;
            const u32 chunk_rows = (u32)min(CHUNK, s_send_count[destination] - chunk * CHUNK);
            u32* rows_done = chunk_pieces + destination * CHUNKS + chunk;
            fence_flags();
            if (atomicAdd(rows_done, 1u) == chunk_rows - 1) {
                *rows_done = 0;
                fence_flags();
                flag_store(peer_buffer<u32>(peer_table, destination, PEER_CHUNK_FLAGS) + rank * CHUNKS + chunk, epoch);
            }
        }
        unit = s_unit;
        __syncthreads();  // every thread has read the ticket
    }

    // 4. The GEMM rows: every source's mailbox, laid out per (local expert, source).
    for (int source = threadIdx.x; source < RANKS; source += THREADS) {
        if (source != rank) wait_flag<false>(meta_flags + source, epoch, error_word, rank, FLAG_KIND_META, source);
    }
    for (int g = threadIdx.x; g < SEGMENTS; g += THREADS) s_fill[g] = 0;
    __syncthreads();
    const int* order = RECEIVE_ORDER[rank];
    // Every source's ids, staged in shared memory (a source's mailbox is read once, not
    // once per question asked of it): first as they came, then, per pair, the local expert
    // it lands on here, or -1 (another rank's, out of range, or repeating an earlier
    // choice). A source's count is bounded by MAX_TOKENS_FUSED: the runtime runs this
    // kernel on every rank or on none, for calls of at most that many tokens on each; the
    // bound only keeps a corrupt count within the shared arrays.
    for (int phase = threadIdx.x; phase < RANKS; phase += THREADS) {
        const int source = order[phase];
        s_tokens[phase] = source == rank ? tokens
                                         : min(__ldcg(recv_counts + source * (LOCAL_EXPERTS + 1) + LOCAL_EXPERTS),
                                               MAX_TOKENS_FUSED);
    }
    __syncthreads();
    for (int phase = 0; phase < RANKS; ++phase) {
        const int source = order[phase];
        for (int p = threadIdx.x; p < s_tokens[phase] * TOP_K; p += THREADS) {
            s_local[phase][p] = source == rank ? topk_ids[p] : __ldcg(mailbox_ids(recv_pair, source) + p);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < RANKS * MAX_TOKENS_FUSED; i += THREADS) {
        const int phase = i / MAX_TOKENS_FUSED, t = i % MAX_TOKENS_FUSED;
        if (t >= s_tokens[phase]) continue;
        int* ids = &s_local[phase][t * TOP_K];  // this thread's token only
        int local[TOP_K];
#pragma unroll
        for (int k = 0; k < TOP_K; ++k) {
            const int expert = ids[k];
            const bool lands = (unsigned)expert < (unsigned)EXPERTS && expert / LOCAL_EXPERTS == rank &&
                               !repeats_earlier_choice(ids, k);
            local[k] = lands ? expert - rank * LOCAL_EXPERTS : -1;
        }
#pragma unroll
        for (int k = 0; k < TOP_K; ++k) ids[k] = local[k];
    }
    __syncthreads();
    for (int phase = 0; phase < RANKS; ++phase) {
        for (int p = threadIdx.x; p < s_tokens[phase] * TOP_K; p += THREADS) {
            const int local = s_local[phase][p];
            if (local >= 0) atomicAdd(&s_fill[local * RANKS + phase], 1);
        }
    }
    for (int slice = threadIdx.x; slice < SHARED_SLICES; slice += THREADS) s_fill[(LOCAL_EXPERTS + slice) * RANKS] = tokens;
    __syncthreads();
    if (threadIdx.x < 32) warp_exclusive_scan(SEGMENTS, [&](int g) { return s_fill[g]; }, s_offsets);
    __syncthreads();
    for (int g = threadIdx.x; g < SEGMENTS; g += THREADS) s_fill[g] = 0;
    __syncthreads();
    for (int phase = 0; phase < RANKS; ++phase) {
        const int source = order[phase];
        const int* locals = s_local[phase];
        const float* weights = source == rank ? topk_weights : mailbox_weights(recv_weight, source);
        const int source_token_count = s_tokens[phase];
        // A peer's token's slot here: its place among that peer's tokens that visit this rank.
        if (threadIdx.x < 32) {
            int before = 0;
            for (int first = 0; first < source_token_count; first += 32) {
                const int t = first + threadIdx.x;
                bool visits = false;
                for (int k = 0; t < source_token_count && k < TOP_K; ++k) visits |= locals[t * TOP_K + k] >= 0;
                const u32 mask = __ballot_sync(0xffffffffu, visits);
                if (t < source_token_count) s_slot[t] = before + __popc(mask & ((1u << threadIdx.x) - 1));
                before += __popc(mask);
            }
        }
        __syncthreads();
        // Rows in pair order within each segment: one warp, 32 pairs at a time.
        if (threadIdx.x < 32) {
            const int pairs = source_token_count * TOP_K;
            for (int first = 0; first < pairs; first += 32) {
                const int p = first + threadIdx.x;
                const int local = p < pairs ? locals[p] : -1;
                const bool lands = local >= 0;
                const u32 same = __match_any_sync(0xffffffffu, local);
                if (lands) {
                    const int g = local * RANKS + phase;
                    const int row = s_offsets[g] + s_fill[g] + __popc(same & ((1u << threadIdx.x) - 1));
                    const int t = p / TOP_K;
                    s_rows[row] = source == rank ? OWN_ROW_BASE + t : source * SLOTS + s_slot[t];
                    s_pairs[row] = t * SLOTS_PER_TOKEN + p % TOP_K;
                    s_weights[row] = source == rank ? weights[p] : __ldcg(weights + p);
                    s_origins[row] = source;
                }
                __syncwarp();
                if (lands && __popc(same & ((1u << threadIdx.x) - 1)) == 0) s_fill[local * RANKS + phase] += __popc(same);
                __syncwarp();
            }
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < SHARED_SLICES * tokens; i += THREADS) {
        const int slice = i / tokens, t = i % tokens;
        const int row = s_offsets[(LOCAL_EXPERTS + slice) * RANKS] + t;
        s_rows[row] = OWN_ROW_BASE + t;
        s_pairs[row] = t * SLOTS_PER_TOKEN + TOP_K + slice;
        s_weights[row] = 1.f;  // a gated shared expert's GEMM2 tiles put its gate here
        s_origins[row] = rank;
    }
    tile_schedule<G1::BM, N_TILES1, EXPERTS_HERE, RANKS>(s_offsets, s_tiles1);
    tile_schedule<G2::BM, N_TILES2, EXPERTS_HERE, RANKS>(s_offsets, s_tiles2);
    // Every block has read the mailboxes once all have laid out: the last gives every
    // source its credit (this rank's own too, which the table's metadata kernel waits for).
    if (last_arrival(layouts_done, gridDim.x)) {
        for (int source = threadIdx.x; source < RANKS; source += THREADS) {
            fence_flags();
            flag_store(peer_buffer<u32>(peer_table, source, PEER_CREDITS) + rank, epoch);
        }
    }
    const int tiles1 = s_tiles1[SEGMENTS], tiles2 = s_tiles2[SEGMENTS];
    const EpContext gemm1_ep = ep_gemm1_context(chunk_flags, x, error_word, rank, epoch);
    const EpContext gemm2_ep = ep_gemm2_context(s_weights, s_origins, peer_table, error_word, rank);

    // 5. The GEMM tiles.
    for (; unit < sends + tiles1 + tiles2; unit = s_unit) {
        __syncthreads();  // every thread has read this unit's ticket
        if (threadIdx.x == 0) s_unit = (int)atomicAdd(next_unit, 1u);
        GemmTile t;
        if (unit < sends + tiles1) {
            mma_sync_run<G1>(recv_x, w1, w1_bias, SlotWeights{}, s_offsets, s_rows, intermediate, gemm1_ep, StreamKBuffers{},
                             smem, s_tiles1, KRun{unit - sends, 0, K_TILES1}, KRun::none(), RingState{0, false}, nullptr,
                             false, [](const GemmTile&) {}, &t);
            if (threadIdx.x == 0) {
                fence_flags();
                flag_add(expert_rows_done + t.expert, 1);
            }
            __syncthreads();  // the next ticket is in s_unit
            continue;
        }
        mma_sync_run<G2>(
            intermediate, w2, w2_bias, SlotWeights{}, s_offsets, s_pairs, nullptr, gemm2_ep, StreamKBuffers{}, smem, s_tiles2,
            KRun{unit - sends - tiles1, 0, K_TILES2}, KRun::none(), RingState{0, false}, nullptr, true,
            [&](const GemmTile& tile) {
{%- if shared_gated %}
                // A shared slice's rows (this rank's tokens, in order) weigh their tokens'
                // gate: the block's warps compute every own token's before thread 0 waits.
                if (tile.expert >= LOCAL_EXPERTS) {
                    const int first_row = s_offsets[tile.expert * RANKS];
                    block_shared_gate_weights<THREADS>(x, shared_expert_gate, tokens,
                                                       [&](int token, float weight) { s_weights[first_row + token] = weight; });
                }
{%- endif %}
                if (threadIdx.x == 0) {
                    const int rows = s_offsets[(tile.expert + 1) * RANKS] - s_offsets[tile.expert * RANKS];
                    wait_flag<false>(expert_rows_done + tile.expert, (u32)((rows + G1::BM - 1) / G1::BM * N_TILES1),
                                     error_word, rank, FLAG_KIND_EXPERT_ROWS, tile.expert);
                }
                __syncthreads();
            },
            &t);
        if (threadIdx.x == 0) {
            // The expert's last GEMM2 tile has read its rows: both counts go back to zero.
            const int rows = s_offsets[(t.expert + 1) * RANKS] - s_offsets[t.expert * RANKS];
            const u32 readers = (u32)((rows + G2::BM - 1) / G2::BM * N_TILES2);
            if (atomicAdd(expert_rows_read + t.expert, 1u) == readers - 1) {
                atomicSub(expert_rows_done + t.expert, (u32)((rows + G1::BM - 1) / G1::BM * N_TILES1));
                expert_rows_read[t.expert] = 0;
            }
        }
        __syncthreads();  // the next ticket is in s_unit
    }
    // The last block past the last unit puts the ticket back.
    if (last_arrival(blocks_done, gridDim.x) && threadIdx.x == 0) *next_unit = 0;

    // 6. This rank's tokens, each once every pair (and shared slice) of it is stored here.
    for (int token = blockIdx.x; token < tokens; token += gridDim.x) {
        bool present[SLOTS_PER_TOKEN];
        const u32 target = combine_target(topk_ids, token, present);
        if (threadIdx.x == 0) {
            s_unit = wait_flag<false>(combine_counters + token, target, error_word, rank, FLAG_KIND_COMBINE, token);
        }
        __syncthreads();
        const bool complete = s_unit != 0;
        const bf16_t* rows[SLOTS_PER_TOKEN];
#pragma unroll
        for (int k = 0; k < SLOTS_PER_TOKEN; ++k) {
            rows[k] = present[k] ? combine_slots + ((size_t)token * SLOTS_PER_TOKEN + k) * HIDDEN : nullptr;
        }
        for (int column = threadIdx.x * 8; column < HIDDEN; column += THREADS * 8) {
            *reinterpret_cast<Vec16*>(y + (size_t)token * HIDDEN + column) = sum_slot_vectors<SLOTS_PER_TOKEN, true>(rows, column);
        }
        __syncthreads();  // every thread read the slots before the counter is reset
        if (threadIdx.x == 0 && complete) atomicSub(combine_counters + token, target);
    }
}
{%- endif %}
