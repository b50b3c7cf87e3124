// ---------------------------------------------------------------------------------------
// Flags between ranks: written with release and read with acquire at .{{ flag_scope }} scope.
// A flag holds the epoch (call counter) it was last released in, so consecutive calls need
// no reset; a counter counts up within a call and its reader takes its count back off.
// Every wait is bounded: past SPIN_LIMIT_CYCLES it records which rank waited for which
// flag and returns, so a lost peer is an error the runtime reports, never a hang.
// ---------------------------------------------------------------------------------------
enum : long long { SPIN_LIMIT_CYCLES = {{ spin_limit_cycles }}LL };
enum : int { ERROR_FLAG_TIMEOUT = {{ error_flag_timeout }} };
enum : int { FLAG_KIND_META = {{ flag_kind_meta }}, FLAG_KIND_CHUNK = {{ flag_kind_chunk }}, FLAG_KIND_COMBINE = {{ flag_kind_combine }} };
enum : int { FLAG_KIND_CREDIT = {{ flag_kind_credit }}, FLAG_KIND_RETURN = {{ flag_kind_return }}, FLAG_KIND_EXPERT_ROWS = {{ flag_kind_expert_rows }} };
enum : int { FLAG_KIND_NODE_PARTIALS = {{ flag_kind_node_partials }}, FLAG_KIND_ARRIVED = {{ flag_kind_arrived }} };

__device__ __forceinline__ u32 flag_load(const u32* flag) {
    u32 value;
    asm volatile("ld.acquire.{{ flag_scope }}.global.u32 %0, [%1];\n" : "=r"(value) : "l"(flag) : "memory");
    return value;
}
__device__ __forceinline__ void flag_store(u32* flag, u32 value) {
    asm volatile("st.release.{{ flag_scope }}.global.u32 [%0], %1;\n" ::"l"(flag), "r"(value) : "memory");
}
__device__ __forceinline__ void flag_add(u32* flag, u32 value) {
    asm volatile("red.release.{{ flag_scope }}.global.add.u32 [%0], %1;\n" ::"l"(flag), "r"(value) : "memory");
}
// Orders this block's earlier writes (made visible to this thread by a barrier) before
// the release that follows.
__device__ __forceinline__ void fence_flags() { asm volatile("fence.acq_rel.{{ flag_scope }};\n" ::: "memory"); }
// Epochs wrap around: compare by signed difference.
__device__ __forceinline__ bool flag_reached(u32 value, u32 target) { return (int)(value - target) >= 0; }

// Spins until `*flag` reaches `target`; on time-out records (rank, kind << 24 | index,
// target) in the error word and returns false. Once this rank has timed out in this call,
// later waits give up at once: a lost peer costs one bound, not one per token. Waits of a
// kernel that clears the error word itself while others may already wait (the fused
// decode) pass GIVE_UP_AFTER_A_TIMEOUT = false: an earlier call's code is no time-out of
// theirs.
__device__ __forceinline__ bool timed_out_already(const int* error_word) {
    return *reinterpret_cast<const volatile int*>(error_word) == ERROR_FLAG_TIMEOUT;
}
// Inlined: the expert-parallel GEMM1s wait here, and ptxas may serialise a kernel's wgmma
// around a call (C7509; it did in relocatable code).
template <bool GIVE_UP_AFTER_A_TIMEOUT = true>
__device__ __forceinline__ bool wait_flag(const u32* flag, u32 target, int* error_word, int rank, int kind, int index) {
    const long long start = clock64();
    while (!flag_reached(flag_load(flag), target)) {
        if (GIVE_UP_AFTER_A_TIMEOUT && timed_out_already(error_word)) return false;
        if (clock64() - start > SPIN_LIMIT_CYCLES) {
            report_error(error_word, ERROR_FLAG_TIMEOUT, rank, (kind << 24) | index, (int)target);
            return false;
        }
    }
    return true;
}
