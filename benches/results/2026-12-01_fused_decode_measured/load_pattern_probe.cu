// Load-pattern probe (issue 8, 2026-12-01; build: nvcc -O3 -arch=sm_90a load_pattern_probe.cu): blocks of 128 threads stream weight panels with cp.async.cg 16 B into a
// ring of STAGES smem stages, as the mma.sync decode GEMM does (no math). Pattern 0: each
// stage is ROWS rows x 128 B at one k offset of row-major [rows][K] (today's layout).
// Pattern 1: each stage is one contiguous ROWS*128 B block (a k-tile-major tiled layout).
// Pattern 2: as 0, each thread also prefetching its row DIST k-tiles ahead into L2
// (prefetch.global.L2::evict_last). Pattern 3: as 0, after one bulk L2 prefetch of every
// row of the panel (cp.async.bulk.prefetch.L2). Times are CUDA events around one launch,
// best of 18, each on weights not read by the launch before (no L2 reuse).
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s\n", cudaGetErrorString(e)); return 1; } } while (0)
__device__ __forceinline__ void cp16(void* s, const void* g) {
  unsigned a = (unsigned)__cvta_generic_to_shared(s);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(a), "l"(g));
}
template <int STAGES, int PATTERN, int DIST = 0>
__global__ void __launch_bounds__(128) stream(const char* w, int rows, int kbytes, size_t panel_stride, int panels_per_block, unsigned* sink) {
  extern __shared__ __align__(128) char smem[];
  const int stage_bytes = rows * 128;
  const int ktiles = kbytes / 128;
  unsigned acc = 0;
  for (int p = 0; p < panels_per_block; ++p) {
    const char* panel = w + (size_t)(blockIdx.x + p * gridDim.x) * panel_stride;
    auto load = [&](int stage, int kt) {
      char* s = smem + stage * stage_bytes;
      for (int c = threadIdx.x; c < rows * 8; c += 128) {
        const int r = c / 8, piece = c % 8;
        const char* g = PATTERN != 1 ? panel + (size_t)r * kbytes + kt * 128 + piece * 16
                                     : panel + (size_t)kt * stage_bytes + c * 16;
        cp16(s + c * 16, g);
      }
    };
    if (PATTERN == 3 && threadIdx.x < rows) {  // whole panel: one bulk L2 prefetch per row
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(panel + (size_t)threadIdx.x * kbytes), "r"(kbytes) : "memory");
    }
    if (PATTERN == 2 && threadIdx.x < rows) {
      for (int d = STAGES - 1; d < STAGES - 1 + DIST && d < ktiles; ++d)
        asm volatile("prefetch.global.L2::evict_last [%0];\n" :: "l"(panel + (size_t)threadIdx.x * kbytes + d * 128));
    }
    for (int s = 0; s < STAGES - 1; ++s) { if (s < ktiles) load(s, s); asm volatile("cp.async.commit_group;\n"); }
    for (int k = 0; k < ktiles; ++k) {
      asm volatile("cp.async.wait_group %0;\n" :: "n"(STAGES - 2));
      __syncthreads();
      acc += *(const unsigned*)(smem + (k % STAGES) * stage_bytes + threadIdx.x * 4);
      const int next = k + STAGES - 1;
      if (next < ktiles) load(next % STAGES, next);
      if (PATTERN == 2 && threadIdx.x < rows && next + DIST < ktiles)
        asm volatile("prefetch.global.L2::evict_last [%0];\n" :: "l"(panel + (size_t)threadIdx.x * kbytes + (next + DIST) * 128));
      asm volatile("cp.async.commit_group;\n");
    }
    asm volatile("cp.async.wait_group 0;\n");
    __syncthreads();
  }
  if (acc == 0x12345678) sink[0] = acc;
}
template <int S, int P, int D = 0>
int run(const char* w, size_t total, int blocks, int rows, int kbytes, int panels, unsigned* sink) {
  const size_t panel = (size_t)rows * kbytes;
  const int smem = S * rows * 128;
  CK(cudaFuncSetAttribute(stream<S, P, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  const size_t used = panel * blocks * panels;
  const int rotations = (int)(total / used);
  float best = 1e9;
  for (int it = 0; it < 20; ++it) {
    const char* base = w + (size_t)(it % rotations) * used;
    cudaEventRecord(a);
    stream<S, P, D><<<blocks, 128, smem>>>(base, rows, kbytes, panel, panels, sink);
    cudaEventRecord(b); CK(cudaEventSynchronize(b));
    float ms; cudaEventElapsedTime(&ms, a, b); if (it >= 2 && ms < best) best = ms;
  }
  printf("pattern %s D=%2d stages %d blocks %4d rows %3d row_bytes %5d panels/block %d: %7.1f us  %6.0f GB/s  %5.1f GB/s/block\n",
         P == 0 ? "strided" : P == 1 ? "tiled  " : P == 2 ? "pf-dist" : "pf-bulk", D, S, blocks, rows, kbytes, panels, best * 1e3, used / (best * 1e-3) / 1e9, used / panels / blocks / (best * 1e-3) / 1e9 * panels);
  return 0;
}
int main() {
  const size_t total = (size_t)8 << 30;
  char* w; CK(cudaMalloc(&w, total)); CK(cudaMemset(w, 1, total));
  unsigned* sink; CK(cudaMalloc(&sink, 4));
  // Call 4: layout and ring depth
  for (int blocks : {96, 132, 264}) { run<5, 0>(w, total, blocks, 128, 4096, 1, sink); run<5, 1>(w, total, blocks, 128, 4096, 1, sink); }
  run<8, 0>(w, total, 96, 128, 4096, 1, sink); run<8, 1>(w, total, 96, 128, 4096, 1, sink);
  run<8, 0>(w, total, 132, 128, 4096, 1, sink); run<8, 1>(w, total, 132, 128, 4096, 1, sink);
  run<5, 0>(w, total, 264, 128, 4096, 4, sink); run<5, 1>(w, total, 264, 128, 4096, 4, sink);
  run<5, 0>(w, total, 264, 128, 14336, 1, sink); run<5, 1>(w, total, 264, 128, 14336, 1, sink);
  run<5, 1>(w, total, 128, 128, 1536, 1, sink);
  // Call 5: L2 prefetch ahead of the ring (per thread, D k-tiles ahead) or of the whole panel (bulk)
  for (int blocks : {96, 132, 264}) {
    run<5, 0>(w, total, blocks, 128, 4096, 1, sink); run<5, 2, 8>(w, total, blocks, 128, 4096, 1, sink);
    run<5, 2, 16>(w, total, blocks, 128, 4096, 1, sink); run<5, 2, 28>(w, total, blocks, 128, 4096, 1, sink);
    run<5, 3>(w, total, blocks, 128, 4096, 1, sink);
  }
  // GEMM2-like: 128 rows x 1.5 KB (12 k-tiles)
  run<5, 0>(w, total, 128, 128, 1536, 1, sink); run<5, 2, 8>(w, total, 128, 128, 1536, 1, sink); run<5, 3>(w, total, 128, 128, 1536, 1, sink);
  // Mixtral GEMM2-like: 64 blocks x 128 rows x 28 KB
  run<5, 0>(w, total, 64, 128, 28672, 1, sink); run<5, 2, 16>(w, total, 64, 128, 28672, 1, sink); run<5, 2, 64>(w, total, 64, 128, 28672, 1, sink); run<5, 3>(w, total, 64, 128, 28672, 1, sink);
  // steady state
  run<5, 0>(w, total, 264, 128, 8192, 2, sink); run<5, 2, 16>(w, total, 264, 128, 8192, 2, sink);
  return 0;
}
