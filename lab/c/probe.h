// probe.h: what the probes of lab/c share (hostfn_*.c, bg_floor.c, slot_stores.c, h2d_floor.c,
// blocks2d.c, fill_dma.c, host_pool*.c, step_floor.c, step_k.c, engines_pair.c, host_pair.c):
// the driver API, CHECK (exits naming the call and its error), monotonic clocks in ms and ns, a
// row of rates (median, min-max, a ratio), the time-stamp counter (calibrated, a busy wait on
// it), qsort orders, SSE2 non-temporal copies, a host function that
// holds the stream it is launched on for `probe_hold_ms` milliseconds, device 0's context, and
// cuMemcpyBatchAsync of the ABI pinstage calls.
#ifndef PINSTAGE_PROBE_H
#define PINSTAGE_PROBE_H
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <cuda.h>
#include <emmintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHECK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_; \
    cuGetErrorName(r_, &s_); fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); \
    exit(1); } } while (0)

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* A monotonic clock in ns, and the order of doubles for qsort (medians of timed calls). */
static double probe_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static int probe_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* A row of rates: sorts `t[0..n)`, prints "name median (min-max)", the ratio to `alone` when it
 * is positive and WRONG when `bad`; returns the median. */
static double probe_row(const char *name, double *t, int n, double alone, int bad) {
    qsort(t, n, sizeof t[0], probe_cmp_double);
    printf("  %-10s %6.2f GB/s (%.2f-%.2f)", name, t[n / 2], t[0], t[n - 1]);
    if (alone > 0) printf("  = %.2fx the faster alone", t[n / 2] / alone);
    printf("%s\n", bad ? "  WRONG" : "");
    fflush(stdout);
    return t[n / 2];
}

/* The time-stamp counter (x86) and its ticks per ns (probe_tsc_calibrate: 0.2 s against
   CLOCK_MONOTONIC); a busy wait of `ns` on it; the order of uint64_t for qsort. */
static double tsc_per_ns;
static inline uint64_t tsc(void) { return __builtin_ia32_rdtsc(); }

static void probe_tsc_calibrate(void) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    uint64_t t0 = tsc();
    do clock_gettime(CLOCK_MONOTONIC, &b); while ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec) < 2e8);
    tsc_per_ns = (tsc() - t0) / ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec));
}

static void busy_ns(double ns) {
    uint64_t end = tsc() + (uint64_t)(ns * tsc_per_ns);
    while (tsc() < end) __builtin_ia32_pause();
}

static int probe_cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* How long probe_holder holds its stream. */
static int probe_hold_ms = 300;

static void CUDA_CB probe_holder(void *arg) {
    (void)arg;
    double t0 = now_ms();
    while (now_ms() - t0 < probe_hold_ms) usleep(100);
}

/* The CUDA 12.8 ABI of cuMemcpyBatchAsync (with failIdx): what cudarc's cuda-12080 bindings
 * load, so what pinstage calls. */
typedef CUresult (*batch_fn_t)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
                               CUmemcpyAttributes *, size_t *, size_t, size_t *, CUstream);

static batch_fn_t probe_batch_fn(void) {
    void *p = NULL;
    CUdriverProcAddressQueryResult q;
    CHECK(cuGetProcAddress("cuMemcpyBatchAsync", &p, 12080, CU_GET_PROC_ADDRESS_DEFAULT, &q));
    return (batch_fn_t)p;
}

/* Copies n bytes by SSE2 non-temporal stores (the destination 16-byte aligned), then a store
 * fence so a DMA issued next reads every byte (pinstage's src/host/bounce.rs `fill`). */
static void probe_nt_copy(unsigned char *d, const unsigned char *s, size_t n) {
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i)), b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32)), e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
    _mm_sfence();
}

/* Device 0's primary context, made current on this thread. */
static CUcontext probe_init(void) {
    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    return ctx;
}

/* A pool of page-locked HOST memory on NUMA node `numa` (cuMemPoolCreate with a HOST_NUMA
 * location, drivers 12.6+), mapped for device `dev`, keeping freed memory until trimmed (release
 * threshold: all). Returns CUDA_SUCCESS, or the first refusal with its call's name in *call (a
 * driver without host pools refuses the first). host_pool.c, host_pool_range.c. */
static CUresult probe_host_pool(CUmemoryPool *pool, int numa, CUdevice dev, const char **call) {
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = CU_MEM_HANDLE_TYPE_NONE;
    props.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    props.location.id = numa;
    CUresult r = cuMemPoolCreate(pool, &props);
    *call = "cuMemPoolCreate";
    if (r != CUDA_SUCCESS) return r;
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = dev;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    *call = "cuMemPoolSetAccess";
    if ((r = cuMemPoolSetAccess(*pool, &acc, 1)) != CUDA_SUCCESS) return r;
    cuuint64_t keep = ~(cuuint64_t)0;
    *call = "cuMemPoolSetAttribute(RELEASE_THRESHOLD)";
    return cuMemPoolSetAttribute(*pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep);
}

#endif
