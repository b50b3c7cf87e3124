"""Where cuModuleLoadData's time goes: images dumped by moeforge-dump, loaded in a fresh
process, after a large allocation, through cuLibraryLoadData, eager and lazy."""
import ctypes, sys, time, os, glob
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
dev = ctypes.c_int(); cu.cuDeviceGet(ctypes.byref(dev), 0)
ctx = ctypes.c_void_p(); assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
cu.cuCtxSetCurrent(ctx)
mode, files = sys.argv[1], sys.argv[2:]
if mode == "bigalloc":
    big = ctypes.c_void_p(); assert cu.cuMemAlloc_v2(ctypes.byref(big), 24 << 30) == 0
    cu.cuMemsetD8_v2(big, 0, 24 << 30); cu.cuCtxSynchronize()
scratch = ctypes.c_void_p(); cu.cuMemAlloc_v2(ctypes.byref(scratch), 1 << 20)
out = []
if mode == "all":
    bufs = [ctypes.create_string_buffer(open(f, "rb").read()) for f in files]
    for rep in range(3):
        t = time.perf_counter()
        for buf in bufs:
            m = ctypes.c_void_p(); assert cu.cuModuleLoadData(ctypes.byref(m), buf) == 0
        out.append(f"{len(files)} modules in {(time.perf_counter() - t) * 1e3:.2f} ms")
    print("all       " + " | ".join(out)); sys.exit(0)
for f in files:
    data = open(f, "rb").read()
    buf = ctypes.create_string_buffer(data)
    ts = []
    for _ in range(4):
        t = time.perf_counter()
        if mode == "library":
            lib = ctypes.c_void_p()
            r = cu.cuLibraryLoadData(ctypes.byref(lib), buf, None, None, 0, None, None, 0)
        else:
            m = ctypes.c_void_p()
            r = cu.cuModuleLoadData(ctypes.byref(m), buf)
        ts.append((time.perf_counter() - t) * 1e3)
        assert r == 0, r
    out.append(f"{os.path.basename(f)} ({len(data)//1024} KiB): " + " ".join(f"{t:.2f}" for t in ts))
print(f"{mode:9s} " + " | ".join(out))
