// Weight-layout probe (issue 8, 2026-12-02): blocks of 128 threads stream weight panels
// (ROWS rows x KBYTES, one (expert, column tile) of a decode GEMM) through a STAGES-deep
// cp.async ring, no math, as the mma.sync decode GEMM does, many panels per block.
// Layout 0: row-major [rows][K] (today). Layout G>0: rows in groups of G, each group's
// k-tiles contiguous: [rows/G][K/64][G][64] bf16, so a stage of ROWS rows is ROWS/G
// contiguous pieces of G*128 B. Layout -1: the whole stage contiguous (panel-tiled).
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s\n", cudaGetErrorString(e)); return 1; } } while (0)
__device__ __forceinline__ void cp16(unsigned s, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(g));
}
template <int STAGES, int ROWS, int G>
__global__ void __launch_bounds__(128) stream(const char* w, int kbytes, int panels_per_block, unsigned* sink) {
  extern __shared__ __align__(128) char smem[];
  constexpr int KB = G <= -256 ? -G : 128;  // bytes of a row per stage (row-major, G <= -256)
  constexpr int STAGE = ROWS * KB;
  const int ktiles = kbytes / KB;
  const size_t panel_bytes = (size_t)ROWS * kbytes;
  const unsigned sbase = (unsigned)__cvta_generic_to_shared(smem);
  unsigned acc = 0;
  for (int p = 0; p < panels_per_block; ++p) {
    const char* panel = w + (size_t)(blockIdx.x + p * gridDim.x) * panel_bytes;
    auto load = [&](int stage, int kt) {
      for (int c = threadIdx.x; c < ROWS * (KB / 16); c += 128) {
        const int r = c / (KB / 16), piece = c % (KB / 16);
        const char* g;
        if (G == 0 || G <= -256) g = panel + (size_t)r * kbytes + kt * KB + piece * 16;
        else if (G < 0) g = panel + (size_t)kt * STAGE + c * 16;
        else g = panel + (size_t)(r / G) * G * kbytes + (size_t)kt * G * 128 + (r % G) * 128 + piece * 16;
        cp16(sbase + stage * STAGE + c * 16, g);
      }
    };
    for (int s = 0; s < STAGES - 1; ++s) { if (s < ktiles) load(s, s); asm volatile("cp.async.commit_group;\n"); }
    for (int k = 0; k < ktiles; ++k) {
      asm volatile("cp.async.wait_group %0;\n" :: "n"(STAGES - 2));
      __syncthreads();
      acc += *(const unsigned*)(smem + (k % STAGES) * STAGE + threadIdx.x * 4);
      const int next = k + STAGES - 1;
      if (next < ktiles) load(next % STAGES, next);
      asm volatile("cp.async.commit_group;\n");
    }
    asm volatile("cp.async.wait_group 0;\n");
    __syncthreads();
  }
  if (acc == 0x12345678) sink[0] = acc;
}
template <int S, int ROWS, int layout>
float run(const char* w, size_t total, int blocks, int kbytes, int panels, unsigned* sink, const char* what) {
  const size_t used = (size_t)ROWS * kbytes * blocks * panels;
  const int smem = S * ROWS * (layout <= -256 ? -layout : 128);
  cudaFuncSetAttribute(stream<S, ROWS, layout>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  const int rotations = (int)(total / used);
  float best = 1e9, sum = 0; int n = 0;
  for (int it = 0; it < 24; ++it) {
    const char* base = w + (size_t)(it % rotations) * used;
    cudaEventRecord(a);
    stream<S, ROWS, layout><<<blocks, 128, smem>>>(base, kbytes, panels, sink);
    cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b);
    if (it >= 4) { if (ms < best) best = ms; sum += ms; ++n; }
  }
  printf("| %-28s | %4d | %3d | %6d | %2d | %5s | %9.1f | %9.1f | %6.0f |\n", what, blocks, ROWS, kbytes, panels,
         layout == 0 ? "rows" : layout == -256 ? "r256" : layout == -512 ? "r512" : layout < 0 ? "stage" : (layout == 8 ? "g8" : layout == 16 ? "g16" : layout == 32 ? "g32" : "g64"),
         best * 1e3, sum / n * 1e3, used / (best * 1e-3) / 1e9);
  return best;
}
#define RUNL(R, B, ...) do { run<5, R, 0>(w, total, B, __VA_ARGS__); run<5, R, 16>(w, total, B, __VA_ARGS__); run<5, R, 32>(w, total, B, __VA_ARGS__); run<5, R, 64>(w, total, B, __VA_ARGS__); run<5, R, -1>(w, total, B, __VA_ARGS__); } while (0)
int main() {
  const size_t total = (size_t)12 << 30;
  char* w; CK(cudaMalloc(&w, total)); CK(cudaMemset(w, 1, total));
  unsigned* sink; CK(cudaMalloc(&sink, 4));
  printf("| workload | blocks | rows | row bytes | panels/block | layout | best us | mean us | GB/s (best) |\n|---|---|---|---|---|---|---|---|---|\n");
  for (int round = 0; round < 2; ++round) {
    // same 16 KB stages: 128 rows x 128 B, 64 rows x 256 B, 32 rows x 512 B (row-major), and tiled
    run<5, 128, 0>(w, total, 264, 14336, 6, sink, "DSV3 GEMM1-like");
    run<5, 64, -256>(w, total, 264, 14336, 12, sink, "DSV3 GEMM1-like");
    run<5, 32, -512>(w, total, 264, 14336, 24, sink, "DSV3 GEMM1-like");
    run<5, 128, 64>(w, total, 264, 14336, 6, sink, "DSV3 GEMM1-like");
    run<5, 64, 0>(w, total, 528, 4096, 20, sink, "DSV3 GEMM2-like");
    run<5, 32, -256>(w, total, 528, 4096, 40, sink, "DSV3 GEMM2-like");
    run<5, 64, 64>(w, total, 528, 4096, 20, sink, "DSV3 GEMM2-like");
    run<5, 128, 0>(w, total, 264, 4096, 6, sink, "Qwen3 GEMM1-like");
    run<5, 64, -256>(w, total, 264, 4096, 12, sink, "Qwen3 GEMM1-like");
    run<5, 128, 64>(w, total, 264, 4096, 6, sink, "Qwen3 GEMM1-like");
  }
  return 0;
}
