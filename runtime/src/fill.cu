// Device-side fills for tests and benchmarks (compiled by moeforge's runtime, not generated).
typedef unsigned short bf16_t;
typedef unsigned long long u64;

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// out[i] = bf16(scale * u), u uniform in [-1, 1) from a hash of (seed, i): the same values
// whatever the grid.
extern "C" __global__ void fill_uniform_bf16(bf16_t* out, u64 count, u64 seed, float scale) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x) {
        const u64 bits = splitmix64(seed ^ (i * 0xd1b54a32d192ed03ull));
        const float u = (float)(bits >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
        const unsigned int f = __float_as_uint(scale * u);
        out[i] = (bf16_t)((f + 0x7fffu + ((f >> 16) & 1u)) >> 16);
    }
}

extern "C" __global__ void fill_bits_u16(bf16_t* out, u64 count, bf16_t value) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < count; i += (u64)gridDim.x * blockDim.x) {
        out[i] = value;
    }
}
