// ---------------------------------------------------------------------------------------
// Prelude: element types and PTX wrappers. No toolkit header is included, so NVRTC needs
// no include path.
// ---------------------------------------------------------------------------------------
typedef unsigned short bf16_t;  // raw bf16 bits
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float bf16_to_float(bf16_t v) { return __uint_as_float(((u32)v) << 16); }

// Two floats to a bf16x2 word (round to nearest even); `lo` lands in the low half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}

__device__ __forceinline__ u32 smem_address(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16-byte asynchronous copy global -> shared; when `valid` is false nothing is read and the
// destination is zero-filled (masked rows of a ragged tile).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// The L2 policy for data a kernel reads once: its lines leave L2 first, so that streaming
// it does not push out what is read again.
__device__ __forceinline__ u64 evict_first_policy() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
// cp_async_16 under an L2 policy (evict_first_policy).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid, u64 policy) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes), "l"(policy));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING)); }

__device__ __forceinline__ void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(address));
}

// D += A·B for one m16n8k16 bf16 fragment with f32 accumulators.
__device__ __forceinline__ void mma_bf16_m16n8k16(float* acc, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 { %0, %1, %2, %3}, { %4, %5, %6, %7}, { %8, %9}, "
        "{ %0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The fast division: IEEE division calls a slow path, a call around which ptxas may
// serialise wgmma (C7509; it did in relocatable code); measured no slower anywhere and
// 1-7% faster in some layers (one H200, 2026-12-01).
__device__ __forceinline__ float silu(float v) { return __fdividef(v, 1.0f + __expf(-v)); }
__device__ __forceinline__ float gelu_tanh(float v) {
    const float inner = 0.7978845608f * (v + 0.044715f * v * v * v);
    return 0.5f * v * (1.0f + tanhf(inner));
}

// Exclusive prefix sum by one warp: out[i] = sum of value(j) for j < i, out[n] = total.
// Each lane scans a contiguous run, then the runs' totals are scanned across the warp.
template <typename Value>
__device__ __forceinline__ void warp_exclusive_scan(int n, Value value, int* out) {
    const int lane = threadIdx.x & 31;
    const int per_lane = (n + 31) / 32;
    const int begin = min(n, lane * per_lane);
    const int end = min(n, begin + per_lane);
    int run_total = 0;
    for (int i = begin; i < end; ++i) run_total += value(i);
    int inclusive = run_total;
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    int running = inclusive - run_total;
    for (int i = begin; i < end; ++i) {
        out[i] = running;
        running += value(i);
    }
    if (lane == 31) out[n] = inclusive;
}

// Eight bf16 values moved as one 16-byte access.
struct __align__(16) Vec16 {
    u32 x, y, z, w;
};

// Arrival of this block at `counter`, one of `arrivals` blocks: true in every thread of
// the block that arrives last, which then sees the writes of all the others and resets the
// counter for the next call (stream order publishes the reset).
__device__ __forceinline__ bool last_arrival(u32* counter, u32 arrivals) {
    __threadfence();  // this thread's writes, before the count that publishes them
    __syncthreads();
    bool last = false;
    if (threadIdx.x == 0) {
        u32 before;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(before) : "l"(counter) : "memory");
        last = before == arrivals - 1;
        if (last) *counter = 0;
    }
    return __syncthreads_or(last);
}

// Thread-block clusters (sm_90 and later; a kernel launched without cluster dimensions is
// a cluster of one): this block's rank in its cluster; a barrier of every thread of the
// cluster that orders their memory accesses (release, then acquire), whole or in its two
// halves, so that a block can work between saying it is done with the others' shared
// memory and waiting until they are done with its own; and four f32 from block `rank`'s
// shared memory at the offset `address` has in this block's.
__device__ __forceinline__ int cluster_ctarank() {
    u32 rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return (int)rank;
}
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
    cluster_arrive();
    cluster_wait();
}
__device__ __forceinline__ float4 ld_shared_cluster_f32x4(u32 address, int rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(address), "r"(rank));
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 { %0, %1, %2, %3 }, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(remote)
                 : "memory");
    return v;
}

// A kernel launched to start early (the plan's `early_start`: programmatic stream
// serialization) may begin while the kernel ahead of it in the stream still runs. It
// waits for that kernel to finish and its writes to be visible before it reads them;
// launched the ordinary way, the wait is a no-op. The kernel behind it starts early once
// every block has let it (or exited).
__device__ __forceinline__ void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the kernel behind this one start early.
__device__ __forceinline__ void let_next_kernel_start() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Waits for the kernel ahead, then lets the kernel behind start early in turn (most
// kernels; a fused router or GEMM1 whose dependents cost them when resident beside them
// lets them start later or not at all).
__device__ __forceinline__ void start_after_previous_kernel() {
    wait_for_previous_kernel();
    let_next_kernel_start();
}
