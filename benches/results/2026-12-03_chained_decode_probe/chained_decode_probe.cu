// Chained-decode probe (issue 8, 2026-12-03; build: nvcc -O3 -arch=sm_90a -std=c++17
// chained_decode_probe.cu). One token of Qwen3-30B-A3B's routed experts (H = 2048,
// F = 768, E = 128, top-8, SwiGLU, bf16 weights, f32 sums), computed two ways:
//
//   two launches (what the table does): GEMM1 blocks of one expert x 64 intermediates write
//   h; GEMM2 blocks of one expert x 128 output rows read all of h; a third kernel sums the
//   8 slots into y.
//   chained (NS = 64, 32, 16): one launch; a block owns one expert x NS intermediates: it
//   streams its gate and up rows, forms its NS values of h in shared memory, then streams
//   the matching NS columns of W2 (every output row) and writes an f32 partial of y for
//   its slice; the third kernel sums slots x slices into y. One weight stream per block
//   instead of two dependent launches; no block waits for another.
//
// Both stream weights with cp.async.cg 16 B into a ring of 16 KB stages (the ring runs on
// from gate/up into W2 in the chained kernel) and multiply on CUDA cores (one token: 2
// flops per weight byte pair). Times: CUDA events around one call (median of 60, each on
// an expert set the call before did not read: 16 sets rotate over 128 experts, 1.2 GB),
// and 60 calls back to back (mean). Every variant is checked against a host f64 reference.
// "PDL": the kernels after the first launched with programmatic dependent launch, as
// moeforge launches them (GEMM2 issues its first weight stages before it waits for h).
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#define CK(x) do { cudaError_t ck_ = (x); if (ck_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(ck_)); exit(1); } } while (0)

constexpr int H = 2048, F = 768, E = 128, TOP_K = 8;
constexpr int THREADS = 256, STAGE_BYTES = 16384, CHUNKS = STAGE_BYTES / 16;

__device__ __forceinline__ void cp16(void* s, const void* g) {
  unsigned a = (unsigned)__cvta_generic_to_shared(s);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(a), "l"(g));
}
__device__ __forceinline__ float dot8(const uint4& w, const float* x) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&w);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 f = __bfloat1622float2(p[i]); s += f.x * x[2 * i] + f.y * x[2 * i + 1]; }
  return s;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }
// Programmatic dependent launch, as moeforge's kernels use it: wait for the kernel before
// (a no-op without the launch attribute), then let the next one launch.
__device__ __forceinline__ void after_previous_kernel() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// A ring of STAGES stages over `total` stages; `load(stage_index, smem)` issues one stage's
// copies, `use(stage_index, smem)` consumes it after a block-wide barrier.
template <int STAGES, class Load, class Use, class AfterPrologue>
__device__ __forceinline__ void ring(int total, char* smem, Load load, Use use, AfterPrologue after_prologue) {
  for (int s = 0; s < STAGES - 1; ++s) { if (s < total) load(s, smem + s * STAGE_BYTES); asm volatile("cp.async.commit_group;\n"); }
  after_prologue();
  for (int k = 0; k < total; ++k) {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(STAGES - 2));
    __syncthreads();
    use(k, smem + (k % STAGES) * STAGE_BYTES);
    const int next = k + STAGES - 1;
    if (next < total) load(next, smem + (next % STAGES) * STAGE_BYTES);
    asm volatile("cp.async.commit_group;\n");
  }
  asm volatile("cp.async.wait_group 0;\n");
  __syncthreads();
}

// Gate and up rows [n0, n0 + NS) of expert e: 2*NS rows of 4 KB, 4 rows a stage. Warp w
// takes row w / 2 of the stage, half w % 2; sums land in gu[2 * NS][2].
template <int NS>
__device__ __forceinline__ void gate_up_stage(int s, const char* smem, const float* x, float (*gu)[2]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = warp / 2, half = warp % 2;
  const uint4* r = reinterpret_cast<const uint4*>(smem + row * (H * 2));
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = half * 128 + lane + 32 * i;
    acc += dot8(r[c], x + c * 8);
  }
  acc = warp_sum(acc);
  if (lane == 0) gu[4 * s + row][half] = acc;
}
template <int NS>
__device__ __forceinline__ void gate_up_load(const __nv_bfloat16* wg, const __nv_bfloat16* wu, int e, int n0, int s, char* dst) {
  for (int c = threadIdx.x; c < CHUNKS; c += THREADS) {
    const int row = 4 * s + c / 256, off = (c % 256) * 8;
    const __nv_bfloat16* base = row < NS ? wg + ((size_t)e * F + n0 + row) * H : wu + ((size_t)e * F + n0 + row - NS) * H;
    cp16(dst + c * 16, base + off);
  }
}

template <int NS, int STAGES>
__global__ void __launch_bounds__(THREADS) chained(const __nv_bfloat16* x, const __nv_bfloat16* wg, const __nv_bfloat16* wu,
                                                   const __nv_bfloat16* w2, const int* ids, float* partial) {
  extern __shared__ __align__(128) char smem[];
  __shared__ float xs[H];
  __shared__ float gu[2 * NS][2];
  __shared__ float h[NS];
  constexpr int SLICES = F / NS, A = 2 * NS / 4, ROWS_B = STAGE_BYTES / (2 * NS), B = H / ROWS_B;
  constexpr int PIECES = NS / 8;  // 16 B pieces of a W2 row's slice
  after_previous_kernel();
  const int slot = blockIdx.x / SLICES, slice = blockIdx.x % SLICES, n0 = slice * NS;
  const int e = ids[slot];
  for (int i = threadIdx.x; i < H; i += THREADS) xs[i] = __bfloat162float(x[i]);
  float* out = partial + (size_t)blockIdx.x * H;
  ring<STAGES>(A + B, smem,
    [&](int s, char* dst) {
      if (s < A) { gate_up_load<NS>(wg, wu, e, n0, s, dst); return; }
      const int first = (s - A) * ROWS_B;
      for (int c = threadIdx.x; c < CHUNKS; c += THREADS) {
        const int row = first + c / PIECES, piece = c % PIECES;
        cp16(dst + c * 16, w2 + ((size_t)e * H + row) * F + n0 + piece * 8);
      }
    },
    [&](int s, const char* src) {
      if (s < A) { gate_up_stage<NS>(s, src, xs, gu); return; }
      if (s == A) {  // gu complete (the ring's barrier before this stage); h for the slice
        if (threadIdx.x < NS) h[threadIdx.x] = __bfloat162float(__float2bfloat16(silu(gu[threadIdx.x][0] + gu[threadIdx.x][1]) * (gu[NS + threadIdx.x][0] + gu[NS + threadIdx.x][1])));
        __syncthreads();
      }
      // This stage: ROWS_B rows x NS columns; each thread 4 pieces (32 values).
      const uint4* v = reinterpret_cast<const uint4*>(src);
      const int first = (s - A) * ROWS_B;
      if constexpr (PIECES >= 4) {
        constexpr int PER_ROW = PIECES / 4;  // threads per row
        const int row = threadIdx.x / PER_ROW, part = threadIdx.x % PER_ROW;
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) acc += dot8(v[row * PIECES + part * 4 + i], h + (part * 4 + i) * 8);
#pragma unroll
        for (int o = PER_ROW / 2; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (part == 0) out[first + row] = acc;
      } else {
        constexpr int ROWS_PER = 4 / PIECES;
#pragma unroll
        for (int r = 0; r < ROWS_PER; ++r) {
          const int row = threadIdx.x * ROWS_PER + r;
          float acc = 0.f;
#pragma unroll
          for (int p = 0; p < PIECES; ++p) acc += dot8(v[row * PIECES + p], h + p * 8);
          out[first + row] = acc;
        }
      }
    }, [] {});
}

// The table's two launches. GEMM1: one expert x 64 intermediates, writes h (bf16).
template <int STAGES>
__global__ void __launch_bounds__(THREADS) gemm1(const __nv_bfloat16* x, const __nv_bfloat16* wg, const __nv_bfloat16* wu,
                                                 const int* ids, __nv_bfloat16* hout) {
  constexpr int NS = 64, SLICES = F / NS, A = 2 * NS / 4;
  extern __shared__ __align__(128) char smem[];
  __shared__ float xs[H];
  __shared__ float gu[2 * NS][2];
  after_previous_kernel();
  const int slot = blockIdx.x / SLICES, n0 = (blockIdx.x % SLICES) * NS, e = ids[slot];
  for (int i = threadIdx.x; i < H; i += THREADS) xs[i] = __bfloat162float(x[i]);
  ring<STAGES>(A, smem, [&](int s, char* dst) { gate_up_load<NS>(wg, wu, e, n0, s, dst); },
               [&](int s, const char* src) { gate_up_stage<NS>(s, src, xs, gu); }, [] {});
  if (threadIdx.x < NS)
    hout[slot * F + n0 + threadIdx.x] = __float2bfloat16(silu(gu[threadIdx.x][0] + gu[threadIdx.x][1]) * (gu[NS + threadIdx.x][0] + gu[NS + threadIdx.x][1]));
}
// GEMM2: one expert x 128 output rows of W2 (128 x 1.5 KB), 8 rows a 12 KB stage, a warp a row.
template <int STAGES>
__global__ void __launch_bounds__(THREADS) gemm2(const __nv_bfloat16* hin, const __nv_bfloat16* w2, const int* ids, float* out) {
  constexpr int ROWS = 128, ROW_CHUNKS = F * 2 / 16, PER_STAGE = 8;
  extern __shared__ __align__(128) char smem[];
  __shared__ float hs[F];
  const int slot = blockIdx.x / (H / ROWS), r0 = (blockIdx.x % (H / ROWS)) * ROWS, e = ids[slot];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  ring<STAGES>(ROWS / PER_STAGE, smem,
    [&](int s, char* dst) {
      for (int c = threadIdx.x; c < PER_STAGE * ROW_CHUNKS; c += THREADS) {
        const int row = s * PER_STAGE + c / ROW_CHUNKS, piece = c % ROW_CHUNKS;
        cp16(dst + c * 16, w2 + ((size_t)e * H + r0 + row) * F + piece * 8);
      }
    },
    [&](int s, const char* src) {
      const uint4* v = reinterpret_cast<const uint4*>(src) + warp * ROW_CHUNKS;
      float acc = 0.f;
      for (int c = lane; c < ROW_CHUNKS; c += 32) acc += dot8(v[c], hs + c * 8);
      acc = warp_sum(acc);
      if (lane == 0) out[slot * H + r0 + s * PER_STAGE + warp] = acc;
    },
    [&] {  // the first weight stages are on their way: now wait for GEMM1's h
      after_previous_kernel();
      for (int i = threadIdx.x; i < F; i += THREADS) hs[i] = __bfloat162float(hin[slot * F + i]);
    });
}
// y = sum over slots (and slices) in order, weighted.
__global__ void combine(const float* parts, int per_slot, const float* weights, __nv_bfloat16* y) {
  after_previous_kernel();
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= H) return;
  float acc = 0.f;
  for (int k = 0; k < TOP_K; ++k) {
    float s = 0.f;
    for (int p = 0; p < per_slot; ++p) s += parts[((size_t)k * per_slot + p) * H + row];
    acc += weights[k] * s;
  }
  y[row] = __float2bfloat16(acc);
}
__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned v = (unsigned)(i * 2654435761u) ^ seed; v ^= v >> 13; v *= 0x5bd1e995u; v ^= v >> 15;
    p[i] = __float2bfloat16(((v & 0xffffff) / float(0xffffff) * 2.f - 1.f) * scale);
  }
}

// Launches `kernel`, with programmatic dependent launch when `pdl` (as moeforge launches
// every kernel after the first of a call).
template <class... Params, class... Args>
void launch(bool pdl, void (*kernel)(Params...), int grid, int threads, int smem, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&config, kernel, args...));
}

struct Buffers { __nv_bfloat16 *x, *wg, *wu, *w2, *h, *y; int* ids; float *w, *parts; };

template <class Call>
void time_variant(const char* name, Buffers& b, Call call, const std::vector<double>& ref, const std::vector<int>& sets) {
  std::vector<__nv_bfloat16> yh(H);
  // Check on set 0 (poisoned output first).
  CK(cudaMemset(b.y, 0xff, H * 2));
  CK(cudaMemcpy(b.ids, sets.data(), TOP_K * 4, cudaMemcpyHostToDevice));
  call(); CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(yh.data(), b.y, H * 2, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  for (int i = 0; i < H; ++i) { double d = __bfloat162float(yh[i]) - ref[i]; num += d * d; den += ref[i] * ref[i]; if (std::isnan(__bfloat162float(yh[i]))) num = INFINITY; }
  cudaEvent_t a, z; cudaEventCreate(&a); cudaEventCreate(&z);
  std::vector<float> per;
  for (int it = 0; it < 62; ++it) {
    CK(cudaMemcpy(b.ids, sets.data() + (it % 16) * TOP_K, TOP_K * 4, cudaMemcpyHostToDevice));
    cudaEventRecord(a); call(); cudaEventRecord(z); CK(cudaEventSynchronize(z));
    float ms; cudaEventElapsedTime(&ms, a, z); if (it >= 2) per.push_back(ms * 1e3f);
  }
  std::sort(per.begin(), per.end());
  // Back to back: the same expert set each call (as a layer's successive calls are not).
  cudaEventRecord(a); for (int it = 0; it < 60; ++it) call(); cudaEventRecord(z); CK(cudaEventSynchronize(z));
  float ms; cudaEventElapsedTime(&ms, a, z);
  printf("| %-22s | %7.1f | %7.1f | %7.1f | %.1e |\n", name, per[per.size() / 2], per[0], ms * 1e3f / 60, std::sqrt(num / den));
}

int main() {
  Buffers b;
  const size_t w1n = (size_t)E * F * H, w2n = (size_t)E * H * F;
  CK(cudaMalloc(&b.x, H * 2)); CK(cudaMalloc(&b.wg, w1n * 2)); CK(cudaMalloc(&b.wu, w1n * 2)); CK(cudaMalloc(&b.w2, w2n * 2));
  CK(cudaMalloc(&b.h, TOP_K * F * 2)); CK(cudaMalloc(&b.y, H * 2)); CK(cudaMalloc(&b.ids, TOP_K * 4)); CK(cudaMalloc(&b.w, TOP_K * 4));
  CK(cudaMalloc(&b.parts, (size_t)TOP_K * (F / 16) * H * 4));
  fill<<<1024, 256>>>(b.x, H, 1, 1.f); fill<<<4096, 256>>>(b.wg, w1n, 2, 0.05f); fill<<<4096, 256>>>(b.wu, w1n, 3, 0.05f); fill<<<4096, 256>>>(b.w2, w2n, 4, 0.05f);
  CK(cudaDeviceSynchronize());
  std::vector<int> sets(16 * TOP_K);
  for (int s = 0; s < 16; ++s) for (int k = 0; k < TOP_K; ++k) sets[s * TOP_K + k] = (s * TOP_K + k * 3 + 1) % E;
  const float wts[TOP_K] = {0.3f, 0.2f, 0.15f, 0.1f, 0.1f, 0.07f, 0.05f, 0.03f};
  CK(cudaMemcpy(b.w, wts, sizeof wts, cudaMemcpyHostToDevice));

  // Host f64 reference for set 0 (h rounded to bf16 as both kernels do).
  std::vector<__nv_bfloat16> xh(H), row(H);
  CK(cudaMemcpy(xh.data(), b.x, H * 2, cudaMemcpyDeviceToHost));
  std::vector<double> ref(H, 0.0);
  std::vector<__nv_bfloat16> w2e((size_t)H * F);
  for (int k = 0; k < TOP_K; ++k) {
    const int e = sets[k];
    std::vector<double> hv(F);
    for (int n = 0; n < F; ++n) {
      double g = 0, u = 0;
      CK(cudaMemcpy(row.data(), b.wg + ((size_t)e * F + n) * H, H * 2, cudaMemcpyDeviceToHost));
      for (int i = 0; i < H; ++i) g += (double)__bfloat162float(row[i]) * __bfloat162float(xh[i]);
      CK(cudaMemcpy(row.data(), b.wu + ((size_t)e * F + n) * H, H * 2, cudaMemcpyDeviceToHost));
      for (int i = 0; i < H; ++i) u += (double)__bfloat162float(row[i]) * __bfloat162float(xh[i]);
      hv[n] = __bfloat162float(__float2bfloat16((float)(g / (1 + std::exp(-g)) * u)));
    }
    CK(cudaMemcpy(w2e.data(), b.w2 + (size_t)e * H * F, (size_t)H * F * 2, cudaMemcpyDeviceToHost));
    for (int r = 0; r < H; ++r) { double s = 0; for (int n = 0; n < F; ++n) s += (double)__bfloat162float(w2e[(size_t)r * F + n]) * hv[n]; ref[r] += wts[k] * s; }
  }

  constexpr int S = 4;
  const int smem = S * STAGE_BYTES;
  CK(cudaFuncSetAttribute(gemm1<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(gemm2<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(chained<64, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(chained<32, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(chained<16, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(chained<32, 6>, cudaFuncAttributeMaxDynamicSharedMemorySize, 6 * STAGE_BYTES));
  const float* parts = b.parts;
  printf("| variant (%d MB of weights a call) | per call us (median) | best | back to back us | rel. error |\n|---|---|---|---|---|\n",
         (int)(TOP_K * (3.0 * F * H * 2) / 1e6));
  auto two = [&](bool pdl) {
    return [&, pdl] {
      launch(false, gemm1<S>, TOP_K * (F / 64), THREADS, smem, (const __nv_bfloat16*)b.x, (const __nv_bfloat16*)b.wg,
             (const __nv_bfloat16*)b.wu, (const int*)b.ids, b.h);
      launch(pdl, gemm2<S>, TOP_K * (H / 128), THREADS, smem, (const __nv_bfloat16*)b.h, (const __nv_bfloat16*)b.w2,
             (const int*)b.ids, b.parts);
      launch(pdl, combine, H / 128, 128, 0, parts, 1, (const float*)b.w, b.y);
    };
  };
  auto chain = [&](auto kernel, int ns, int sm, bool pdl) {
    return [&, kernel, ns, sm, pdl] {
      launch(false, kernel, TOP_K * (F / ns), THREADS, sm, (const __nv_bfloat16*)b.x, (const __nv_bfloat16*)b.wg,
             (const __nv_bfloat16*)b.wu, (const __nv_bfloat16*)b.w2, (const int*)b.ids, b.parts);
      launch(pdl, combine, H / 128, 128, 0, parts, F / ns, (const float*)b.w, b.y);
    };
  };
  for (int round = 0; round < 2; ++round) {
    time_variant("two launches (96+128)", b, two(false), ref, sets);
    time_variant("two launches, PDL", b, two(true), ref, sets);
    time_variant("chained NS=64 (96)", b, chain(chained<64, S>, 64, smem, false), ref, sets);
    time_variant("chained NS=32 (192)", b, chain(chained<32, S>, 32, smem, false), ref, sets);
    time_variant("chained NS=32 (192), PDL", b, chain(chained<32, S>, 32, smem, true), ref, sets);
    time_variant("chained NS=32 6 st (192)", b, chain(chained<32, 6>, 32, 6 * STAGE_BYTES, false), ref, sets);
    time_variant("chained NS=16 (384)", b, chain(chained<16, S>, 16, smem, false), ref, sets);
    time_variant("chained NS=16 (384), PDL", b, chain(chained<16, S>, 16, smem, true), ref, sets);
  }
  return 0;
}
