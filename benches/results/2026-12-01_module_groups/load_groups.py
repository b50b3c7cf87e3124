"""Module load cost against kernels per module: the four whole-program wgmma GEMMs of a
layer as four modules, as two (one per regime) and as one; NVRTC time of each grouping."""
import ctypes, re, sys, time, glob
from multiprocessing import Pool

def compile_group(args):
    src, kernels = args
    n = ctypes.CDLL(sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"))[0])
    prog = ctypes.c_void_p()
    assert n.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"unit.cu", 0, None, None) == 0
    flags = [b"--gpu-architecture=sm_90a", b"-std=c++17", b"-DMOEFORGE_ONE_KERNEL"] + \
            [("-DMOEFORGE_KERNEL_" + k).encode() for k in kernels]
    arr = (ctypes.c_char_p * len(flags))(*flags)
    t = time.time()
    r = n.nvrtcCompileProgram(prog, len(flags), arr)
    dt = time.time() - t
    assert r == 0, r
    sz = ctypes.c_size_t(); n.nvrtcGetCUBINSize(prog, ctypes.byref(sz))
    buf = ctypes.create_string_buffer(sz.value); n.nvrtcGetCUBIN(prog, buf)
    return kernels, buf.raw, dt

def main():
    src = open(sys.argv[1]).read()
    name = sys.argv[2]
    ks = [f"{name}_{r}_gemm{g}" for r in ("mid", "prefill") for g in (1, 2)]
    groupings = {"4 modules": [[k] for k in ks], "2 modules": [ks[:2], ks[2:]], "1 module": [ks]}
    compiled = {}
    with Pool(8) as p:
        for label, groups in groupings.items():
            t = time.time()
            compiled[label] = p.map(compile_group, [(src, g) for g in groups])
            print(f"{name} {label}: NVRTC wall {time.time() - t:.2f} s, longest {max(c[2] for c in compiled[label]):.2f} s, "
                  f"{sum(len(c[1]) for c in compiled[label]) // 1024} KiB")
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    dev = ctypes.c_int(); cu.cuDeviceGet(ctypes.byref(dev), 0)
    ctx = ctypes.c_void_p(); assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    cu.cuCtxSetCurrent(ctx)
    scratch = ctypes.c_void_p(); cu.cuMemAlloc_v2(ctypes.byref(scratch), 1 << 20)
    def load(modules):
        t = time.perf_counter()
        for kernels, image, _ in modules:
            m = ctypes.c_void_p()
            assert cu.cuModuleLoadData(ctypes.byref(m), ctypes.c_char_p(image)) == 0
            for k in kernels:
                f = ctypes.c_void_p()
                assert cu.cuModuleGetFunction(ctypes.byref(f), m, k.encode()) == 0
                cu.cuFuncSetAttribute(f, 8, 200 * 1024)
        return (time.perf_counter() - t) * 1e3
    times = {label: [] for label in groupings}
    for _ in range(5):
        for label in groupings:
            times[label].append(load(compiled[label]))
    for label, ts in times.items():
        print(f"{name} {label}: load " + " ".join(f"{t:.1f}" for t in ts) + " ms")

main()
