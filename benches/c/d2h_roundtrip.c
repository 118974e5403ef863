// The driver's floor for one small device-to-host copy and learning that it landed, from C:
// cuMemcpyDtoHAsync into pinned memory on a non-blocking stream, then either cuEventRecord +
// cuEventSynchronize, or cuStreamWriteValue32 of a pinned flag after the copy and a spin on it.
// Each on a non-blocking stream of its own and on the legacy default stream (where torch's
// default current stream issues its work, and so pinstage's copies from torch tensors).
// Prints the median host microseconds per round trip for each size. The source holds a pattern
// (no byte of it is the poison); the whole destination is poisoned before every round trip and
// compared with the pattern after it (both outside the timing).
// Build: nvcc -O2 -o d2h_roundtrip benches/c/d2h_roundtrip.c -lcuda (with -DSEEDED_BUG it must
// stop with "wrong result")
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_; \
    cuGetErrorName(r_, &s_); fprintf(stderr, "%s: %s\n", #x, s_); exit(1); } } while (0)

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(void) {
    enum { N = 5000 };
    static double ts[N];
    size_t sizes[] = {1024, 65536, 1 << 20};
    CUdevice dev;
    CUcontext ctx;
    CUstream s;
    CUevent ev;
    CUdeviceptr src;
    unsigned char *dst;
    volatile unsigned int *flag;
    CUdeviceptr flag_dev;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CHECK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    CHECK(cuMemAlloc(&src, 1 << 20));
    unsigned char *want = malloc(1 << 20);
    if (!want) return 1;
    for (size_t i = 0; i < (1 << 20); i++) want[i] = (unsigned char)(i * 7 + 3 + (i >> 9)) | 1;
    CHECK(cuMemcpyHtoD(src, want, 1 << 20));
    CHECK(cuMemHostAlloc((void **)&dst, 1 << 20, CU_MEMHOSTALLOC_PORTABLE));
    CHECK(cuMemHostAlloc((void **)&flag, 4096, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP));
    CHECK(cuMemHostGetDevicePointer(&flag_dev, (void *)flag, 0));
    CHECK(cuCtxSynchronize());
    for (int k = 0; k < 3; k++) {
        size_t n = sizes[k];
        for (int mode = 0; mode < 4; mode++) {
            CUstream st = mode < 2 ? s : CU_STREAM_LEGACY;
            for (int i = -200; i < N; i++) {
                memset(dst, 0x00, n);  // the poison: every byte of the pattern is odd
                *flag = 0;
                double t0 = now_us();
#ifdef SEEDED_BUG  // -DSEEDED_BUG: one trip copies a byte short; the check must catch it
                CHECK(cuMemcpyDtoHAsync(dst, src, (i == 7 && k == 0) ? n - 1 : n, st));
#else
                CHECK(cuMemcpyDtoHAsync(dst, src, n, st));
#endif
                if (mode % 2 == 0) {
                    CHECK(cuEventRecord(ev, st));
                    CHECK(cuEventSynchronize(ev));
                } else {
                    CHECK(cuStreamWriteValue32(st, flag_dev, 1, CU_STREAM_WRITE_VALUE_DEFAULT));
                    while (*flag != 1) { }
                }
                double t1 = now_us();
                if (memcmp(dst, want, n) != 0) { fprintf(stderr, "wrong result: %zu B, mode %d, trip %d\n", n, mode, i); return 1; }
                if (i >= 0) ts[i] = t1 - t0;
            }
            qsort(ts, N, sizeof(double), cmp);
            printf("C d2h %zu B %s%s: %.2f us\n", n, mode % 2 == 0 ? "event sync" : "spin on a written flag",
                   mode < 2 ? "" : " legacy stream", ts[N / 2]);
        }
    }
    return 0;
}
