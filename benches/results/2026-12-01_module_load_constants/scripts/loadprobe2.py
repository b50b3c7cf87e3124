"""Module API against library API, kernels forced loaded (cuFuncLoad) too."""
import ctypes, sys, time, os
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
dev = ctypes.c_int(); cu.cuDeviceGet(ctypes.byref(dev), 0)
ctx = ctypes.c_void_p(); assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
cu.cuCtxSetCurrent(ctx)
scratch = ctypes.c_void_p(); cu.cuMemAlloc_v2(ctypes.byref(scratch), 1 << 20)
cu.cuKernelGetName.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p]
mode, files = sys.argv[1], sys.argv[2:]
def now(): return time.perf_counter() * 1e3
for f in files:
    data = open(f, "rb").read(); buf = ctypes.create_string_buffer(data)
    res = []
    for rep in range(3):
        t0 = now()
        if mode == "module":
            m = ctypes.c_void_p(); assert cu.cuModuleLoadData(ctypes.byref(m), buf) == 0
            t1 = now()
            n = ctypes.c_uint(); assert cu.cuModuleGetFunctionCount(ctypes.byref(n), m) == 0
            fs = (ctypes.c_void_p * n.value)(); assert cu.cuModuleEnumerateFunctions(fs, n, m) == 0
            funcs = list(fs)
        else:
            lib = ctypes.c_void_p(); assert cu.cuLibraryLoadData(ctypes.byref(lib), buf, None, None, 0, None, None, 0) == 0
            t1 = now()
            n = ctypes.c_uint(); assert cu.cuLibraryGetKernelCount(ctypes.byref(n), lib) == 0
            ks = (ctypes.c_void_p * n.value)(); assert cu.cuLibraryEnumerateKernels(ks, n, lib) == 0
            funcs = []
            for k in ks:
                fn = ctypes.c_void_p(); assert cu.cuKernelGetFunction(ctypes.byref(fn), ctypes.c_void_p(k)) == 0
                funcs.append(fn.value)
        t2 = now()
        first = None
        for fn in funcs:
            r = cu.cuFuncLoad(ctypes.c_void_p(fn)); assert r == 0, r
            if first is None: first = now() - t2
        t3 = now()
        res.append(f"load {t1-t0:.2f} + handles {t2-t1:.2f} + cuFuncLoad x{len(funcs)} {t3-t2:.2f} (first {first:.2f}) = {t3-t0:.2f}")
    print(f"{mode:7s} {os.path.basename(f)} ({len(data)//1024} KiB): " + " | ".join(res))
