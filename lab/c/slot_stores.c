// Why a step's values go into its pinned slot at ~11-14 GB/s (runs zs, zzi): the host's store
// rate into pinned memory, with and without the copy engine reading that memory between writes.
// The engine step's six fields (38404 bytes used, at 256-byte-aligned offsets of a 198912-byte
// slot) are written field by field with memcpy from one of S value sets (S = 1: the values hot
// in the core's caches; S = 64: 2.4 MiB, from L3, as bench_step.py / gpu_step.rs cycle them),
// into a ring of R slots. Rows (each median / mean ns of the timed writes alone, and GB/s):
//   - no copy: the slots are only written, never read by the copy engine;
//   - no copy, the same untimed work: as `copy` below, but the copy engine reads a decoy
//     pinned buffer instead of the slot (the control for the checking's own cache traffic);
//   - copy: after each write (untimed) one cuMemcpyHtoDAsync of the used span and a stream
//     synchronize, as a paced step; the device's bytes are checked after every copy against the
//     values' pattern (the device buffer poisoned before each copy);
//   - copy + prefetchw: the same, the slot's field lines prefetched for writing just before
//     the memcpy (timed with it);
//   - copy + rep movsb: the same, the copy done by `rep movsb`.
// Memory: cuMemHostAlloc(PORTABLE | DEVICEMAP) (the step's slots), malloc'd pageable (no copy
// rows only: the control), and mmap + cuMemHostRegister.
// Shared parts: probe.h. Build: nvcc -O2 -o slot_stores lab/c/slot_stores.c -lcuda
#define _GNU_SOURCE
#include "probe.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define NF 6
#define SLOT 198912
#define ITERS 2000
static const size_t off[NF] = {0, 32768, 98304, 163840, 164096, 164608};
static const size_t len[NF] = {1024, 2048, 2048, 256, 260, 32768};
// The used span: from the first field's start to the last field's end.
static size_t span(void) { return off[NF - 1] + len[NF - 1]; }
static size_t used(void) { size_t n = 0; for (int f = 0; f < NF; f++) n += len[f]; return n; }

static unsigned char pat(size_t set, size_t f, size_t j) {
    unsigned char v = (unsigned char)(set * 131u + f * 17u + j * 7u + 1u);
    return v == 0xEE ? 0x11 : v;  // never the poison
}

static unsigned char **srcs;  // S value sets, each field's values at its own offset
static unsigned char *back, *decoy;
static CUdeviceptr dev;
static CUstream stream;

static inline void prefetchw_range(unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i += 64) __asm__ volatile("prefetchw (%0)" ::"r"(p + i));
}
static inline void movsb(unsigned char *d, const unsigned char *s, size_t n) {
    __asm__ volatile("rep movsb" : "+D"(d), "+S"(s), "+c"(n)::"memory");
}

enum { PLAIN, PREFETCH, MOVSB };

static void row(const char *mem, unsigned char *slots, int R, int S, int copy, int how) {
    double t[ITERS];
    for (int i = 0; i < ITERS; i++) {
        unsigned char *slot = slots + (size_t)(i % R) * SLOT;
        const unsigned char *src = srcs[i % S];
        double t0 = probe_now_ns();
        if (how == PREFETCH)
            for (int f = 0; f < NF; f++) prefetchw_range(slot + off[f], len[f]);
        for (int f = 0; f < NF; f++) {
            if (how == MOVSB) movsb(slot + off[f], src + off[f], len[f]);
            else memcpy(slot + off[f], src + off[f], len[f]);
        }
        t[i] = probe_now_ns() - t0;
        if (copy) {
            // copy == 2: the decoy (set 0's values) is read instead of the slot.
            int set = copy == 2 ? 0 : i % S;
            CHECK(cuMemsetD8Async(dev, 0xEE, span(), stream));
            CHECK(cuMemcpyHtoDAsync(dev, copy == 2 ? decoy : slot, span(), stream));
            CHECK(cuStreamSynchronize(stream));
            CHECK(cuMemcpyDtoH(back, dev, span()));
            for (int f = 0; f < NF; f++)
                for (size_t j = 0; j < len[f]; j++)
                    if (back[off[f] + j] != pat(set, f, j)) {
                        fprintf(stderr, "WRONG RESULT: %s R=%d S=%d step %d field %d byte %zu\n",
                                mem, R, S, i, f, j);
                        exit(1);
                    }
        }
    }
    double mean = 0;
    for (int i = 0; i < ITERS; i++) mean += t[i];
    mean /= ITERS;
    qsort(t, ITERS, sizeof t[0], probe_cmp_double);
    double med = t[ITERS / 2];
    printf("  %-10s R=%-2d S=%-2d %-26s %8.0f / %8.0f ns   %6.1f GB/s\n", mem, R, S,
           !copy ? "no copy" : copy == 2 ? "no copy, same untimed work" : how == PREFETCH ? "copy + prefetchw" : how == MOVSB ? "copy + rep movsb" : "copy",
           med, mean, used() / med);
}

int main(void) {
    CUdevice d;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&d, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, d));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CHECK(cuMemAlloc(&dev, SLOT));
    CHECK(cuMemAllocHost((void **)&back, SLOT));
    CHECK(cuMemAllocHost((void **)&decoy, SLOT));
    srcs = malloc(64 * sizeof *srcs);
    for (int s = 0; s < 64; s++) {
        srcs[s] = aligned_alloc(4096, SLOT);
        for (int f = 0; f < NF; f++)
            for (size_t j = 0; j < len[f]; j++) srcs[s][off[f] + j] = pat(s, f, j);
    }
    for (int f = 0; f < NF; f++)
        for (size_t j = 0; j < len[f]; j++) decoy[off[f] + j] = pat(0, f, j);
    size_t ring = 8 * (size_t)SLOT;
    unsigned char *hostalloc, *pageable, *reg;
    CHECK(cuMemHostAlloc((void **)&hostalloc, ring, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP));
    pageable = aligned_alloc(4096, ring);
    size_t regn = (ring + (2u << 20) - 1) & ~((size_t)(2u << 20) - 1);
    reg = mmap(NULL, regn, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (reg == MAP_FAILED) { perror("mmap"); return 1; }
    memset(reg, 1, regn);
    CHECK(cuMemHostRegister(reg, regn, CU_MEMHOSTREGISTER_PORTABLE));
    memset(hostalloc, 1, ring);
    memset(pageable, 1, ring);
    printf("slot stores: %zu bytes in %d fields per step (span %zu), %d steps per row; "
           "median / mean ns of the writes alone\n", used(), NF, span(), ITERS);
    for (int rep = 0; rep < 2; rep++) {
        printf("round %d\n", rep + 1);
        for (int S = 1; S <= 64; S *= 64)
            for (int R = 1; R <= 8; R *= 8) {
                row("pageable", pageable, R, S, 0, PLAIN);
                row("hostalloc", hostalloc, R, S, 0, PLAIN);
                row("hostalloc", hostalloc, R, S, 2, PLAIN);
                row("hostalloc", hostalloc, R, S, 1, PLAIN);
                row("hostalloc", hostalloc, R, S, 1, PREFETCH);
                row("hostalloc", hostalloc, R, S, 1, MOVSB);
                row("registered", reg, R, S, 0, PLAIN);
                row("registered", reg, R, S, 2, PLAIN);
                row("registered", reg, R, S, 1, PLAIN);
                row("registered", reg, R, S, 1, PREFETCH);
            }
    }
    CHECK(cuMemHostUnregister(reg));
    printf("every copy checked: ok\n");
    return 0;
}
