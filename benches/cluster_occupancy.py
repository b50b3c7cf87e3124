#!/usr/bin/env python3
"""How many thread-block clusters of each size run at once on this GPU, for blocks of a
given dynamic shared memory (the driver's cuOccupancyMaxActiveClusters on an empty
kernel with 256 threads), beside the SMs' count divided by the cluster size. A cluster's
blocks must share one GPC, so a GPU whose GPCs have SM counts that the cluster size does
not divide runs fewer clusters than that quotient.

Usage, on the GPU machine: python3 benches/cluster_occupancy.py [SMEM_KB ...]
(default 100 135 200 230). Needs only the driver (libcuda.so.1) through ctypes.
"""
import ctypes
import sys

PTX = b"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry probe()
{
    ret;
}
"""

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint),
    ]


def check(status, what):
    if status != 0:
        raise SystemExit(f"{what} failed: CUresult {status}")


def main():
    cuda = ctypes.CDLL("libcuda.so.1")
    check(cuda.cuInit(0), "cuInit")
    device = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    context = ctypes.c_void_p()
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    sms = ctypes.c_int()
    check(cuda.cuDeviceGetAttribute(ctypes.byref(sms), CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device), "SM count")
    module = ctypes.c_void_p()
    check(cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(PTX)), "cuModuleLoadData")
    function = ctypes.c_void_p()
    check(cuda.cuModuleGetFunction(ctypes.byref(function), module, b"probe"), "cuModuleGetFunction")
    sizes = [int(a) for a in sys.argv[1:]] or [100, 135, 200, 230]
    print(f"{sms.value} SMs; most clusters at once, 256 threads a block")
    print("| smem KB | " + " | ".join(f"c={c}" for c in range(1, 9)) + " |")
    print("|---|" + "---|" * 8)
    for kb in sizes:
        smem = kb * 1024
        check(cuda.cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem), "smem attribute")
        row = []
        for c in range(1, 9):
            attribute = LaunchAttribute()
            attribute.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attribute.value[0], attribute.value[1], attribute.value[2] = c, 1, 1
            config = LaunchConfig(c * 64, 1, 1, 256, 1, 1, smem, None, ctypes.pointer(attribute), 1)
            clusters = ctypes.c_int()
            status = cuda.cuOccupancyMaxActiveClusters(ctypes.byref(clusters), function, ctypes.byref(config))
            row.append(f"{clusters.value} ({sms.value // c})" if status == 0 else f"err {status}")
        print(f"| {kb} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
