// Baseline (b) of the expert-parallel bench: the two element-wise steps around NCCL's
// all-to-alls and moeforge's single-GPU GEMMs (runtime/src/nccl_pipeline.rs). Sizes are
// run-time arguments; the host works out where every (token, k) pair goes.
typedef unsigned short bf16_t;
typedef unsigned int u32;

// Rows move as 16-byte vectors of 8 bf16 (every layer size is a multiple of 64).
struct __align__(16) Vec16 { u32 x, y, z, w; };
#define BF16_PER_VEC 8

__device__ __forceinline__ float to_float(bf16_t v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ bf16_t to_bf16(float f) {
    const u32 bits = __float_as_uint(f);
    return (bf16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Dispatch, source side, before the all-to-all. Send row `row` carries the pair
// p = send_pairs[row] = t * top_k + k: token t's row of x, p's expert as an index among its
// destination rank's experts (experts are placed contiguously, experts_per_rank each), and
// p's routing weight. One block per send row.
extern "C" __global__ void nccl_pipeline_pack(
    const bf16_t* x, const int* topk_ids, const float* topk_weights, const int* send_pairs,
    int top_k, int hidden, int experts_per_rank,
    bf16_t* send_x, int* send_local_ids, float* send_weights)
{
    const int row = blockIdx.x;
    const int pair = send_pairs[row];
    const int token = pair / top_k;
    if (threadIdx.x == 0) {
        send_local_ids[row] = topk_ids[pair] % experts_per_rank;
        send_weights[row] = topk_weights[pair];
    }
    const Vec16* src = reinterpret_cast<const Vec16*>(x + (size_t)token * hidden);
    Vec16* dst = reinterpret_cast<Vec16*>(send_x + (size_t)row * hidden);
    for (int v = threadIdx.x; v < hidden / BF16_PER_VEC; v += blockDim.x) dst[v] = src[v];
}

// Combine, origin side, after the all-to-all back. `returned` holds the experts' weighted
// rows in send-row order; pair_rows[t * top_k + k] is pair (t, k)'s send row. y[t] is the
// sum of token t's top_k rows in k order, accumulated in f32 and rounded once (the same
// order every call: deterministic). One block per token.
extern "C" __global__ void nccl_pipeline_combine(
    const bf16_t* returned, const int* pair_rows, int top_k, int hidden, bf16_t* y)
{
    const int token = blockIdx.x;
    for (int v = threadIdx.x; v < hidden / BF16_PER_VEC; v += blockDim.x) {
        float sum[BF16_PER_VEC] = {};
        for (int k = 0; k < top_k; ++k) {
            const size_t row = (size_t)pair_rows[token * top_k + k];
            const Vec16 in = reinterpret_cast<const Vec16*>(returned + row * hidden)[v];
            const u32 words[4] = {in.x, in.y, in.z, in.w};
            for (int i = 0; i < BF16_PER_VEC; ++i) {
                sum[i] += to_float((bf16_t)(words[i / 2] >> (16 * (i % 2))));
            }
        }
        u32 out[4];
        for (int i = 0; i < 4; ++i) {
            out[i] = (u32)to_bf16(sum[2 * i]) | ((u32)to_bf16(sum[2 * i + 1]) << 16);
        }
        reinterpret_cast<Vec16*>(y + (size_t)token * hidden)[v] = Vec16{out[0], out[1], out[2], out[3]};
    }
}
