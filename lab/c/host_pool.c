// host_pool: can page-locked host memory be freed without waiting for the device? pinstage
// frees cuMemHostAlloc memory on a background thread after a device synchronize, but a free
// whose synchronize returned just before other work was queued still waits for that work inside
// the driver and holds up every other thread's calls meanwhile (free_lock.c; run
// 2026-12-06-h200-b: a copy held up 20 s). Stream-ordered host memory pools (cuMemPoolCreate
// with a HOST_NUMA location, drivers 12.6+) free with cuMemFreeAsync instead. This probe asks:
// 1. does the driver make such a pool here, and what does cuPointerGetAttribute say its memory is;
// 2. do H2D and D2H copies of 64 MiB from / into it run at the rate of cuMemHostAlloc memory
//    (5 reps each, event-timed, every copy checked at one byte per 4 KiB, each odd, against a
//    destination poisoned with 0xEE);
// 3. with stream S1 held 300 ms by a host function, thread A frees (cuMemFreeAsync of a pool
//    block on an idle stream, the pool keeping its memory (release threshold: all); the same
//    then a synchronize of A's stream; the same then cuMemPoolTrimTo(0), which gives the memory
//    back to the OS; control: cuMemFreeHost of cuMemHostAlloc memory) and thread B, 50 ms later,
//    issues a 64 KiB copy on S2 and records an event: how long A's calls and B's two calls take,
//    and the pool's reserved bytes after the row. Rows with S1 idle too; 3 reps each; B's copy
//    checked. A driver that makes no host pool, or refuses its first uses, is reported (exit 0).
// Usage: host_pool [numa node id (default: the device's, else 0)]
#include "probe.h"
#include <pthread.h>

#define MB64 (64u << 20)
#define NB (64u << 10)

static CUcontext ctx;
static CUmemoryPool pool;

enum kind { POOL_FREE, POOL_FREE_SYNC, POOL_FREE_TRIM, FREE_HOST, NONE };
static const char *names[] = {"pool cuMemFreeAsync", "  + cuStreamSynchronize", "  + cuMemPoolTrimTo(0)",
                              "cuMemFreeHost (control)", "(no free)"};

// A call whose refusal answers the probe's question: reported, and the probe ends (exit 0).
#define SOFT(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_ = NULL; \
    cuGetErrorName(r_, &s_); printf("%s: %s: the driver refuses (no host pool here)\n", #x, \
    s_ ? s_ : "unknown error"); exit(0); } } while (0)

struct job { enum kind k; void *host; CUdeviceptr pooled; CUstream s3; double took; };

static void *freer(void *p) {
    struct job *j = p;
    CHECK(cuCtxSetCurrent(ctx));
    double t0 = now_ms();
    switch (j->k) {
    case POOL_FREE: CHECK(cuMemFreeAsync(j->pooled, j->s3)); break;
    case POOL_FREE_SYNC: CHECK(cuMemFreeAsync(j->pooled, j->s3)); CHECK(cuStreamSynchronize(j->s3)); break;
    case POOL_FREE_TRIM:
        CHECK(cuMemFreeAsync(j->pooled, j->s3));
        CHECK(cuStreamSynchronize(j->s3));  // a free not yet seen complete is not trimmed
        CHECK(cuMemPoolTrimTo(pool, 0));
        break;
    case FREE_HOST: CHECK(cuMemFreeHost(j->host)); break;
    case NONE: break;
    }
    j->took = now_ms() - t0;
    return NULL;
}

// A pool block of n bytes, usable from the host once this returns.
static unsigned char *pool_alloc(size_t n, CUstream s, CUdeviceptr *d) {
    SOFT(cuMemAllocFromPoolAsync(d, n, pool, s));
    CHECK(cuStreamSynchronize(s));
    return (unsigned char *)(uintptr_t)*d;
}

// Median GB/s of 5 event-timed copies of MB64 each way between `host` and `dev`, every copy
// checked (the destination poisoned first, the values differing per rep).
static void rate(const char *what, unsigned char *host, CUdeviceptr dev, CUstream s, unsigned char *check, int *bad) {
    CUevent a, b;
    CHECK(cuEventCreate(&a, 0));
    CHECK(cuEventCreate(&b, 0));
    for (int dir = 0; dir < 2; dir++) {
        double gbs[5];
        for (int rep = 0; rep < 5; rep++) {
            // Odd values: never the poison 0xEE.
            for (size_t i = 0; i < MB64; i += 4096) check[i] = (unsigned char)((i / 4096 * 31 + rep * 7 + dir) | 1);
            if (dir == 0) {  // H2D: host holds the values, the device is poisoned
                for (size_t i = 0; i < MB64; i += 4096) host[i] = check[i];
                CHECK(cuMemsetD8(dev, 0xEE, MB64));
            } else {  // D2H: the device holds the values, the host is poisoned
                for (size_t i = 0; i < MB64; i += 4096) host[i] = check[i];
                CHECK(cuMemcpyHtoD(dev, host, MB64));
                CHECK(cuCtxSynchronize());  // pool memory may count as device memory: no implicit wait
                memset(host, 0xEE, MB64);
            }
            CHECK(cuCtxSynchronize());
            CHECK(cuEventRecord(a, s));
            if (dir == 0) CHECK(cuMemcpyHtoDAsync(dev, host, MB64, s));
            else CHECK(cuMemcpyDtoHAsync(host, dev, MB64, s));
            CHECK(cuEventRecord(b, s));
            CHECK(cuEventSynchronize(b));
            float ms;
            CHECK(cuEventElapsedTime(&ms, a, b));
            gbs[rep] = MB64 / (ms * 1e6);
            if (dir == 0) {
                static unsigned char back[MB64];
                CHECK(cuMemcpyDtoH(back, dev, MB64));
                for (size_t i = 0; i < MB64; i += 4096) if (back[i] != check[i]) { (*bad)++; break; }
            } else {
                for (size_t i = 0; i < MB64; i += 4096) if (host[i] != check[i]) { (*bad)++; break; }
            }
        }
        qsort(gbs, 5, sizeof gbs[0], probe_cmp_double);
        printf("  %-28s %s 64 MiB: median %.2f GB/s (min %.2f max %.2f)\n", what, dir ? "D2H" : "H2D", gbs[2], gbs[0], gbs[4]);
    }
    CHECK(cuEventDestroy(a));
    CHECK(cuEventDestroy(b));
}

int main(int argc, char **argv) {
    ctx = probe_init();
    CUdevice dev;
    CHECK(cuCtxGetDevice(&dev));
    int numa = 0;
    if (argc > 1) numa = atoi(argv[1]);
    else if (cuDeviceGetAttribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev) != CUDA_SUCCESS || numa < 0) numa = 0;
    int drv = 0;
    CHECK(cuDriverGetVersion(&drv));
    printf("host_pool: driver API %d, host NUMA node %d\n", drv, numa);

    // The pool keeps freed memory until trimmed: a free alone gives nothing back to the OS.
    const char *call = NULL;
    CUresult r = probe_host_pool(&pool, numa, dev, &call);
    if (r != CUDA_SUCCESS) {
        const char *s = NULL;
        cuGetErrorName(r, &s);
        printf("%s (HOST_NUMA %d): %s: no host pool on this driver\n", call, numa, s ? s : "unknown error");
        return 0;
    }

    CUstream s1, s2, s3;
    CHECK(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&s3, CU_STREAM_NON_BLOCKING));

    // 1. What the driver says a pool block is.
    CUdeviceptr pd;
    unsigned char *ph = pool_alloc(MB64, s3, &pd);
    unsigned int mt = 0;
    SOFT(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, pd));
    printf("pool block at %p: memory type %u (1 host, 2 device, 3 array, 4 unified)\n", (void *)ph, mt);

    // 2. Copy rates, against cuMemHostAlloc memory.
    CUdeviceptr d64;
    CHECK(cuMemAlloc(&d64, MB64));
    unsigned char *pinned;
    CHECK(cuMemHostAlloc((void **)&pinned, MB64, CU_MEMHOSTALLOC_PORTABLE));
    memset(pinned, 1, MB64);
    memset(ph, 1, MB64);
    unsigned char *check = malloc(MB64);
    int bad = 0;
    printf("copy rates (event-timed, every copy checked):\n");
    rate("cuMemHostAlloc", pinned, d64, s2, check, &bad);
    rate("host pool (cuMemAllocFromPoolAsync)", ph, d64, s2, check, &bad);
    CHECK(cuMemFreeAsync(pd, s3));
    CHECK(cuStreamSynchronize(s3));

    // 3. Frees while another stream is held.
    unsigned char *src;
    CHECK(cuMemHostAlloc((void **)&src, NB, CU_MEMHOSTALLOC_PORTABLE));
    CUdeviceptr dst;
    CHECK(cuMemAlloc(&dst, NB));
    CUevent ev;
    CHECK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    unsigned char *back = malloc(NB);
    printf("%-26s %-10s %12s %16s %14s\n", "free on thread A", "S1", "A's calls ms", "B's copy+rec ms", "pool MiB after");
    for (int busy = 1; busy >= 0; busy--) {
        for (int k = POOL_FREE; k <= NONE; k++) {
            for (int rep = 0; rep < 3; rep++) {
                struct job j = {.k = k, .s3 = s3};
                if (k == FREE_HOST) {
                    CHECK(cuMemHostAlloc(&j.host, MB64, CU_MEMHOSTALLOC_PORTABLE));
                    memset(j.host, 2, MB64);
                }
                if (k <= POOL_FREE_SYNC) memset(pool_alloc(MB64, s3, &j.pooled), 2, MB64);
                for (unsigned i = 0; i < NB; i++) src[i] = (unsigned char)(i * 7 + rep * 13 + k + 1);
                CHECK(cuMemsetD8(dst, 0xEE, NB));
                CHECK(cuCtxSynchronize());
                probe_hold_ms = busy ? 300 : 0;
                if (busy) CHECK(cuLaunchHostFunc(s1, probe_holder, NULL));
                usleep(2000);
                pthread_t th;
                if (pthread_create(&th, NULL, freer, &j) != 0) { fprintf(stderr, "pthread_create failed\n"); return 1; }
                usleep(50000);
                double t0 = now_ms();
                CHECK(cuMemcpyHtoDAsync(dst, src, NB, s2));
                CHECK(cuEventRecord(ev, s2));
                double b = now_ms() - t0;
                pthread_join(th, NULL);
                CHECK(cuCtxSynchronize());
                CHECK(cuMemcpyDtoH(back, dst, NB));
                if (memcmp(back, src, NB) != 0) bad++;
                cuuint64_t reserved = 0;
                CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved));
                printf("%-26s %-10s %12.2f %16.3f %14.1f\n", names[k], busy ? "held 300ms" : "idle", j.took, b,
                       reserved / 1048576.0);
                fflush(stdout);
            }
        }
    }
    printf("copies checked: %d wrong\n", bad);
    return bad ? 2 : 0;
}
