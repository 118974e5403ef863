// hostfn_sizes: does a cuMemcpyBatchAsync or cuMemcpyHtoDAsync of SMALL spans (as a step commit
// sends: 64 B to 4 KiB, four spans) from pinned memory block its caller while a host function
// holds the stream? (hostfn_hold.c, hostfn_thread.c, hostfn_batch.c: 4 KiB spans never block;
// gpu_step's fresh-mode commits of 64-2560 B spans from mapped slots blocked for a whole
// 300 ms host-function stall, while a kernel-held stream blocks nothing.)
//
// For each source allocation (cuMemHostAlloc flags 0, DEVICEMAP|PORTABLE), span size (64, 600,
// 2560, 4096 B) and call (one batch of 4 spans, no location hints, srcAccessOrder STREAM, as
// pinstage issues it; 4 cuMemcpyHtoDAsync), 3 times: hold stream S 300 ms with a host function,
// 30 ms later time the call on the main thread. A call that blocks reads ~270 ms. Every copy is
// checked after the hold (destinations poisoned before).
//
// Shared parts: probe.h. Build: nvcc -O2 -o hostfn_sizes hostfn_sizes.c -lcuda -lpthread
#include "probe.h"

#define STRIDE (8 << 10)
#define NSPAN 4


int main(void) {
    probe_hold_ms = 300;
    (void)probe_init();
    batch_fn_t batch = probe_batch_fn();
    CUstream s;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUdeviceptr d;
    CHECK(cuMemAlloc(&d, NSPAN * STRIDE));
    static uint8_t back[NSPAN * STRIDE];
    const unsigned flags[2] = {0, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE};
    const size_t sizes_b[4] = {64, 600, 2560, 4096};
    int bad = 0;
    unsigned tag = 1;
    for (int f = 0; f < 2; f++) {
        uint8_t *h;
        CHECK(cuMemHostAlloc((void **)&h, NSPAN * STRIDE, flags[f]));
        for (int si = 0; si < 4; si++) {
            for (int call = 0; call < 2; call++) {
                size_t n = sizes_b[si];
                double t[3];
                for (int r = 0; r < 3; r++, tag++) {
                    for (int i = 0; i < NSPAN * STRIDE; i++) h[i] = (uint8_t)(tag * 13 + i * 7 + 5);
                    CHECK(cuMemsetD8(d, 0xEE, NSPAN * STRIDE));
                    CHECK(cuCtxSynchronize());
                    CHECK(cuLaunchHostFunc(s, probe_holder, NULL));
                    usleep(30000);
                    CUdeviceptr dsts[NSPAN], srcs[NSPAN];
                    size_t sz[NSPAN];
                    for (int k = 0; k < NSPAN; k++) {
                        dsts[k] = d + (size_t)k * STRIDE;
                        srcs[k] = (CUdeviceptr)(h + (size_t)k * STRIDE);
                        sz[k] = n;
                    }
                    double t0 = now_ms();
                    if (call == 0) {
                        CUmemcpyAttributes a;
                        memset(&a, 0, sizeof a);
                        a.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
                        size_t aidx = 0, fail = 0;
                        CHECK(batch(dsts, srcs, sz, NSPAN, &a, &aidx, 1, &fail, s));
                    } else {
                        for (int k = 0; k < NSPAN; k++)
                            CHECK(cuMemcpyHtoDAsync(dsts[k], h + (size_t)k * STRIDE, n, s));
                    }
                    t[r] = now_ms() - t0;
                    CHECK(cuCtxSynchronize());
                    CHECK(cuMemcpyDtoH(back, d, NSPAN * STRIDE));
                    for (int k = 0; k < NSPAN; k++) {
                        if (memcmp(back + (size_t)k * STRIDE, h + (size_t)k * STRIDE, n) != 0) bad++;
                        if (n < STRIDE && back[(size_t)k * STRIDE + n] != 0xEE) bad++;
                    }
                }
                printf("flags=%-18s %5zu B x %d %-26s %9.3f %9.3f %9.3f ms\n",
                       f ? "DEVICEMAP|PORTABLE" : "0", n, NSPAN,
                       call == 0 ? "cuMemcpyBatchAsync" : "cuMemcpyHtoDAsync each", t[0], t[1], t[2]);
                fflush(stdout);
            }
        }
        CHECK(cuMemFreeHost(h));
    }
    printf("checks: %s (%d bad spans)\n", bad ? "FAILED" : "ALL PASSED", bad);
    return bad != 0;
}
