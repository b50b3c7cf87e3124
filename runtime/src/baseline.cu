// The unfused baseline the bench compares against: permute -> GEMM -> activation -> GEMM
// -> weighted un-permute -> combine, with the GEMMs done by cuBLAS one expert at a time.
// These are the element-wise steps around the cuBLAS calls; sizes are run-time arguments.
typedef unsigned short bf16_t;
typedef unsigned int u32;

struct __align__(16) Vec16 { u32 x, y, z, w; };

__device__ __forceinline__ float to_float(bf16_t v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ bf16_t to_bf16(float f) {
    const u32 bits = __float_as_uint(f);
    return (bf16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Rows name combine slots, `slots` per token: its top_k routed pairs, then its shared
// slices (weight 1).
// permuted[row] = x[row_pair[row] / slots]; one block per row.
extern "C" __global__ void baseline_gather(const bf16_t* x, const int* row_pair, int slots, int hidden, bf16_t* permuted) {
    const int row = blockIdx.x;
    const int token = row_pair[row] / slots;
    const Vec16* src = reinterpret_cast<const Vec16*>(x + (size_t)token * hidden);
    Vec16* dst = reinterpret_cast<Vec16*>(permuted + (size_t)row * hidden);
    for (int c = threadIdx.x; c < hidden / 8; c += blockDim.x) dst[c] = src[c];
}

// act[row, f] = silu(h[row, f]) * h[row, ffn + f]; one block per row.
extern "C" __global__ void baseline_swiglu(const bf16_t* h, int ffn, bf16_t* act) {
    const int row = blockIdx.x;
    for (int f = threadIdx.x; f < ffn; f += blockDim.x) {
        const float gate = to_float(h[(size_t)row * 2 * ffn + f]);
        const float up = to_float(h[(size_t)row * 2 * ffn + ffn + f]);
        act[(size_t)row * ffn + f] = to_bf16(gate / (1.0f + __expf(-gate)) * up);
    }
}

// slot[row_pair[row]] = weight * out[row]; one block per row.
extern "C" __global__ void baseline_unpermute(const bf16_t* out, const int* row_pair, const float* topk_weights, int slots_per_token, int top_k, int hidden, bf16_t* slots) {
    const int row = blockIdx.x;
    const int slot = row_pair[row];
    const int token = slot / slots_per_token, k = slot % slots_per_token;
    const float w = k < top_k ? topk_weights[token * top_k + k] : 1.f;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        slots[(size_t)slot * hidden + c] = to_bf16(w * to_float(out[(size_t)row * hidden + c]));
    }
}

// y[t] = sum over k of slots[t, k]; one block per token.
extern "C" __global__ void baseline_combine(const bf16_t* slots, int slots_per_token, int hidden, bf16_t* y) {
    const int token = blockIdx.x;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        float sum = 0.f;
        for (int k = 0; k < slots_per_token; ++k) sum += to_float(slots[((size_t)token * slots_per_token + k) * hidden + c]);
        y[(size_t)token * hidden + c] = to_bf16(sum);
    }
}
