// host_pool_range: the two questions run 2026-12-06-h100-f left about blocks of a host memory
// pool (cuMemPoolCreate, HOST_NUMA location), which pinstage's branch next/host-pool hands out
// as pinned memory:
// 1. What does the driver say is the allocation holding a pool block? pinstage's block mover
//    takes 2D copies only when each side's tensors lie in one allocation, and asks
//    cuPointerGetAttributes (RANGE_START_ADDR, RANGE_SIZE); on pool blocks it never took them
//    (11 pytest failures). Printed per block size: both attributes and cuMemGetAddressRange at
//    the block's first and last byte, as offsets from the block and sizes against the request,
//    and what the driver says for a cuMemHostAlloc block (the control).
// 2. Does the life of a pool block as the branch lives it crash or corrupt? probe_pinned.py
//    segfaulted in its first loop in the branch's pool mode: each round a 4 MiB block from the
//    pool (allocated on the pool's stream, that stream synchronized), a D2H copy of 4 MiB into
//    it on another stream, waited for, every 4 KiB and the last byte checked against the
//    round's values (never the poison 0xEE written first), then cuMemFreeAsync on the pool's
//    stream, its synchronize and cuMemPoolTrimTo(0). 200 rounds on one thread; then 200 more
//    with a second thread trimming the pool in a loop meanwhile (the branch trims on its reaper
//    thread while other threads allocate). Printed: rounds done, wrong bytes, and how often the
//    block came back at the address of the round before.
// 1b. Do 2D copies accept host rows spread over a whole pool block (what the strided way of
//    the block mover issues), both ways, every row checked and the byte past each row untouched?
// A driver without host pools is reported (exit 0). Usage: host_pool_range
#include "probe.h"
#include <pthread.h>

static CUmemoryPool pool;
static volatile int trimming;

#define SOFT(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_ = NULL; \
    cuGetErrorName(r_, &s_); printf("%s: %s (refused)\n", #x, s_ ? s_ : "unknown error"); } } while (0)

// What the driver says holds `p`: RANGE_START_ADDR / RANGE_SIZE and cuMemGetAddressRange, as
// an offset from `base` and a size.
static void range(const char *what, CUdeviceptr base, CUdeviceptr p, size_t asked) {
    CUdeviceptr start = 0;
    size_t size = 0;
    CUpointer_attribute attrs[2] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE};
    void *data[2] = {&start, &size};
    CUresult r = cuPointerGetAttributes(2, attrs, data, p);
    const char *e = NULL;
    cuGetErrorName(r, &e);
    if (start)
        printf("  %-28s asked %10zu: attributes %-14s start %+lld size %zu", what, asked, e ? e : "?",
               (long long)(start - base), size);
    else  // an address the driver does not know: it answers zeros
        printf("  %-28s asked %10zu: attributes %-14s start 0 size %zu", what, asked, e ? e : "?", size);
    CUdeviceptr s2 = 0;
    size_t n2 = 0;
    r = cuMemGetAddressRange(&s2, &n2, p);
    cuGetErrorName(r, &e);
    if (s2)
        printf("; cuMemGetAddressRange %s start %+lld size %zu\n", e ? e : "?", (long long)(s2 - base), n2);
    else
        printf("; cuMemGetAddressRange %s start 0 size %zu\n", e ? e : "?", n2);
}

static void *trimmer(void *ctx) {
    CHECK(cuCtxSetCurrent((CUcontext)ctx));
    while (trimming) CHECK(cuMemPoolTrimTo(pool, 0));
    return NULL;
}

// `rounds` lives of a 4 MiB block; returns the wrong bytes seen.
static long lives(int rounds, CUstream ps, CUstream cs, CUdeviceptr src, unsigned char *want, int *same) {
    const size_t n = 4u << 20;
    long bad = 0;
    CUdeviceptr last = 0;
    for (int r = 0; r < rounds; r++) {
        for (size_t i = 0; i < n; i += 4096) want[i] = (unsigned char)((i / 4096 * 13 + r * 7) | 1);
        want[n - 1] = (unsigned char)(r | 1);
        CHECK(cuMemcpyHtoD(src, want, n));
        CUdeviceptr d;
        CHECK(cuMemAllocFromPoolAsync(&d, n, pool, ps));
        CHECK(cuStreamSynchronize(ps));
        if (d == last) (*same)++;
        last = d;
        unsigned char *h = (unsigned char *)(uintptr_t)d;
        memset(h, 0xEE, n);
        CHECK(cuMemcpyDtoHAsync(h, src, n, cs));
        CHECK(cuStreamSynchronize(cs));
        for (size_t i = 0; i < n; i += 4096) bad += h[i] != want[i];
        bad += h[n - 1] != want[n - 1];
        CHECK(cuMemFreeAsync(d, ps));
        CHECK(cuStreamSynchronize(ps));
        CHECK(cuMemPoolTrimTo(pool, 0));
    }
    return bad;
}

int main(void) {
    CUcontext ctx = probe_init();
    CUdevice dev;
    CHECK(cuCtxGetDevice(&dev));
    int numa = 0;
    if (cuDeviceGetAttribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev) != CUDA_SUCCESS || numa < 0) numa = 0;
    const char *call = NULL;
    CUresult made = probe_host_pool(&pool, numa, dev, &call);
    if (made != CUDA_SUCCESS) {
        const char *s = NULL;
        cuGetErrorName(made, &s);
        printf("host_pool_range: %s: %s: no usable host pool on this driver\n", call, s ? s : "unknown error");
        return 0;
    }
    CUstream ps, cs;
    CHECK(cuStreamCreate(&ps, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&cs, CU_STREAM_NON_BLOCKING));

    printf("host_pool_range: host NUMA node %d\n1. the allocation the driver says holds a block "
           "(offsets from the block's start)\n", numa);
    size_t sizes[] = {4096, 100000, 1u << 20, 4u << 20, 64u << 20, 1u << 30};
    for (int i = 0; i < 6; i++) {
        size_t n = sizes[i];
        CUdeviceptr d, d2;
        CHECK(cuMemAllocFromPoolAsync(&d, n, pool, ps));
        CHECK(cuMemAllocFromPoolAsync(&d2, n, pool, ps));
        CHECK(cuStreamSynchronize(ps));
        range("pool block, first byte", d, d, n);
        range("pool block, last byte", d, d + n - 1, n);
        range("next pool block, first byte", d, d2, n);
        void *h;
        CHECK(cuMemHostAlloc(&h, n, CU_MEMHOSTALLOC_PORTABLE));
        range("cuMemHostAlloc (control)", (CUdeviceptr)(uintptr_t)h, (CUdeviceptr)(uintptr_t)h + n - 1, n);
        CHECK(cuMemFreeHost(h));
        CHECK(cuMemFreeAsync(d, ps));
        CHECK(cuMemFreeAsync(d2, ps));
        CHECK(cuStreamSynchronize(ps));
        CHECK(cuMemPoolTrimTo(pool, 0));
    }

    printf("1b. 2D copies whose host rows span a whole pool block (64 rows of 16 KiB, the pitch\n"
           "    the block's 64th part: the block mover's strided way)\n");
    CUdeviceptr dsrc, dback;
    CHECK(cuMemAlloc(&dsrc, 1u << 20));
    CHECK(cuMemAlloc(&dback, 1u << 20));
    unsigned char *rows = malloc(1u << 20), *got = malloc(1u << 20);
    if (!rows || !got) return 1;
    // Odd (never the poison 0xEE) and different from row to row (16 KiB rows).
    for (size_t i = 0; i < (1u << 20); i++) rows[i] = (unsigned char)((i * 31 + 7 + 2 * (i >> 14)) | 1);
    CHECK(cuMemcpyHtoD(dsrc, rows, 1u << 20));
    size_t blocks[] = {64u << 20, 1u << 30};
    for (int b = 0; b < 2; b++) {
        size_t n = blocks[b], pitch = n / 64, w = 16384;
        CUdeviceptr d;
        CHECK(cuMemAllocFromPoolAsync(&d, n, pool, ps));
        CHECK(cuStreamSynchronize(ps));
        unsigned char *h = (unsigned char *)(uintptr_t)d;
        memset(h, 0xEE, n);
        CUDA_MEMCPY2D c;
        memset(&c, 0, sizeof c);
        c.srcMemoryType = CU_MEMORYTYPE_DEVICE; c.srcDevice = dsrc; c.srcPitch = w;
        c.dstMemoryType = CU_MEMORYTYPE_HOST; c.dstHost = h; c.dstPitch = pitch;
        c.WidthInBytes = w; c.Height = 64;
        CUresult r1 = cuMemcpy2DAsync(&c, cs);
        if (r1 == CUDA_SUCCESS) CHECK(cuStreamSynchronize(cs));
        long wrong = 0;
        for (int row = 0; r1 == CUDA_SUCCESS && row < 64; row++) {
            wrong += memcmp(h + row * pitch, rows + row * w, w) != 0;
            wrong += h[row * pitch + w] != 0xEE;  // past the row: untouched
        }
        CHECK(cuMemsetD8(dback, 0xEE, 1u << 20));
        memset(&c, 0, sizeof c);
        c.srcMemoryType = CU_MEMORYTYPE_HOST; c.srcHost = h; c.srcPitch = pitch;
        c.dstMemoryType = CU_MEMORYTYPE_DEVICE; c.dstDevice = dback; c.dstPitch = w;
        c.WidthInBytes = w; c.Height = 64;
        if (r1 != CUDA_SUCCESS)  // the rows written by the CPU instead: H2D is tried anyway
            for (int row = 0; row < 64; row++) memcpy(h + row * pitch, rows + row * w, w);
        CUresult r2 = cuMemcpy2DAsync(&c, cs);
        if (r2 == CUDA_SUCCESS) {
            CHECK(cuStreamSynchronize(cs));
            CHECK(cuMemcpyDtoH(got, dback, 1u << 20));
            wrong += memcmp(got, rows, 1u << 20) != 0;
        }
        const char *e1 = NULL, *e2 = NULL;
        cuGetErrorName(r1, &e1);
        cuGetErrorName(r2, &e2);
        printf("  block %5zu MiB: D2H 2D %s, H2D 2D %s, %ld wrong rows\n", n >> 20, e1 ? e1 : "?", e2 ? e2 : "?", wrong);
        CHECK(cuMemFreeAsync(d, ps));
        CHECK(cuStreamSynchronize(ps));
        CHECK(cuMemPoolTrimTo(pool, 0));
    }
    free(rows);
    free(got);

    printf("2. lives of a 4 MiB block: alloc, D2H into it, check, free, trim\n");
    CUdeviceptr src;
    CHECK(cuMemAlloc(&src, 4u << 20));
    unsigned char *want = calloc(4u << 20, 1);
    if (!want) return 1;
    int same = 0;
    long bad = lives(200, ps, cs, src, want, &same);
    printf("  one thread:                 200 rounds, %ld wrong bytes, same address as the round before %d times\n", bad, same);
    pthread_t t;
    trimming = 1;
    if (pthread_create(&t, NULL, trimmer, ctx) != 0) return 1;
    same = 0;
    long bad2 = lives(200, ps, cs, src, want, &same);
    trimming = 0;
    pthread_join(t, NULL);
    printf("  a second thread trimming:   200 rounds, %ld wrong bytes, same address as the round before %d times\n", bad2, same);
    printf("%s\n", bad + bad2 ? "WRONG BYTES" : "all rounds checked, none wrong");
    free(want);
    return bad + bad2 ? 1 : 0;
}
