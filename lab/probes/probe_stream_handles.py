"""What an int stream handle points at, and which ints crash the driver.

Part 1 dumps the first words of real stream objects (the driver's own `cuStreamCreate`, torch and
cupy streams) and of an event, each word labelled: the current context's handle, a pointer into a
named mapping, or a plain value. Part 2 hands ints to `StepStager.stage(stream=...)`, each in a
child process, and reports whether the child raised a typed error, returned, or died, and where
the int lay in that child's memory map.

Usage (GPU machine): python3 lab/probes/probe_stream_handles.py
"""

import ctypes
import os
import subprocess
import sys


def mappings():
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, parts[1], parts[5] if len(parts) > 5 else ""))
    return out


def where(addr, maps):
    for lo, hi, perms, path in maps:
        if lo <= addr < hi:
            return f"{perms} {path or '[anon]'} +{addr - lo:#x}"
    return None


def words(addr, n=24):
    fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        data = os.pread(fd, n * 8, addr)
    except OSError as e:
        return f"unreadable ({e})"
    finally:
        os.close(fd)
    return [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]


def dump(name, addr, ctx, maps, depth=1):
    print(f"--- {name} {addr:#x} in {where(addr, maps)}")
    ws = words(addr, 24 if depth else 64)
    if isinstance(ws, str):
        print("   ", ws)
        return
    for i, w in enumerate(ws):
        label = "CTX" if w in ctx else (where(w, maps) or "")
        if depth or label:
            print(f"    [{i:2}] +{i * 8:#04x} {w:#018x} {label}")
    if depth and where(ws[0], maps):
        dump(f"{name} -> word 0", ws[0], ctx, maps, depth - 1)


def part1():
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    dev = ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    ctx = ctypes.c_void_p()
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert cuda.cuCtxSetCurrent(ctx) == 0
    print(f"primary context {ctx.value:#x}")
    ctxs = {ctx.value}
    handles = []
    own = ctypes.c_void_p()
    if cuda.cuCtxCreate_v2(ctypes.byref(own), 0, dev) == 0:
        ctxs.add(own.value)
        print(f"own context {own.value:#x}")
        s = ctypes.c_void_p()
        assert cuda.cuStreamCreate(ctypes.byref(s), 1) == 0
        handles.append(("cuStreamCreate in an own context", s.value))
        assert cuda.cuCtxSetCurrent(ctx) == 0
    for flags in (0, 1):
        s = ctypes.c_void_p()
        assert cuda.cuStreamCreate(ctypes.byref(s), flags) == 0
        handles.append((f"cuStreamCreate(flags={flags})", s.value))
    ev = ctypes.c_void_p()
    assert cuda.cuEventCreate(ctypes.byref(ev), 2) == 0
    import torch

    ts = [torch.cuda.Stream(), torch.cuda.Stream(priority=-1)]
    handles += [(f"torch.cuda.Stream #{i}", s.cuda_stream) for i, s in enumerate(ts)]
    try:
        import cupy

        cs = [cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream()]
        handles += [(f"cupy Stream #{i}", s.ptr) for i, s in enumerate(cs)]
    except Exception as e:  # noqa: BLE001
        print("cupy:", e)
    maps = mappings()
    for name, h in handles:
        dump(name, h, ctxs, maps)
    dump("cuEventCreate", ev.value, ctxs, maps)
    dump("id(object())", id(object()), ctxs, maps)


CHILD = r"""
import sys, numpy as np, pinstage, torch
keep = [bytearray(256) for _ in range(4)]
v = (id(keep[2]) & ~7) if sys.argv[1] == "obj" else int(sys.argv[1])
layout = pinstage.StepLayout({"ids": ("int32", 16)})
st = pinstage.StepStager(layout, depth=1)
st.stage({"ids": [5, 6, 7]})
maps = open("/proc/self/maps").read().splitlines()
at = [l for l in maps if int(l.split()[0].split("-")[0], 16) <= v < int(l.split()[0].split("-")[1], 16)]
print("maps:", at[0] if at else "unmapped", flush=True)
try:
    st.stage({"ids": [1]}, stream=v)
    print("RETURNED", flush=True)
except Exception as e:
    print("RAISED", type(e).__name__, str(e)[:100], flush=True)
"""


def part2():
    import random

    rnd = random.Random(1)
    values = [10**9, 2**31, 2**32, 0x10000, 0x400000, 0x600000, 0x1000000, 0x40000000]
    values += [rnd.randrange(0x10000, 0x80000000) & ~7 for _ in range(8)]
    for v in values + ["obj"]:
        arg = str(v)
        r = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True, timeout=120)
        lines = [l for l in r.stdout.splitlines() if l.startswith(("maps:", "RETURNED", "RAISED"))]
        shown = f"{v:#x}" if isinstance(v, int) else v
        print(f"stream={shown}: rc={r.returncode} " + " | ".join(lines))


if __name__ == "__main__":
    part1()
    if "--no-children" not in sys.argv:
        part2()
