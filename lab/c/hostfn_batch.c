// hostfn_batch: does the FIRST cuMemcpyBatchAsync of a process, or of a thread, block its caller
// while a host function holds the stream? (gpu_step: a new thread's first commit, the first
// batched copy of that test, waited for a whole 300 ms host-function stall; its later commits
// did not. hostfn_hold.c and hostfn_thread.c found no blocking call, but every batch there
// came after an unheld one.)
//
// Rows in this order, each timed 30 ms into a fresh 300 ms hold of stream S:
//  1  the process's first cuMemcpyBatchAsync (3 x 4 KiB, pinned -> device), main thread, on S
//  2  a new thread's first batch on S (3 times, a new thread each)
//  3  a new thread's first batch on S2, an unheld stream (3 times)
//  4  the main thread's later batch on S (3 times)
//  rows 1-4 with no location hints (as pinstage issues them), 5-7 as 2-4 with hints
// A call that blocks reads ~270 ms. Every copy is checked after the hold (poisoned before).
//
// Shared parts: probe.h. Build: nvcc -O2 -o hostfn_batch hostfn_batch.c -lcuda -lpthread
#include "probe.h"
#include <pthread.h>

#define SPAN (4 << 10)

static batch_fn_t batch;
static CUcontext ctx;
static CUstream s, s2;
static uint8_t *h;
static CUdeviceptr d;
static int bad;

static void prepare(unsigned tag) {
    for (int i = 0; i < 3 * SPAN; i++) h[i] = (uint8_t)(tag * 13 + i * 7 + 5);
    CHECK(cuMemsetD8(d, 0xEE, 3 * SPAN));
    CHECK(cuCtxSynchronize());
    CHECK(cuLaunchHostFunc(s, probe_holder, NULL));
    usleep(30000);
}

static void verify(void) {
    static uint8_t back[3 * SPAN];
    CHECK(cuCtxSynchronize());
    CHECK(cuMemcpyDtoH(back, d, 3 * SPAN));
    if (memcmp(back, h, 3 * SPAN) != 0) bad++;
}

static int hints; /* set srcLocHint/dstLocHint (pinstage leaves them zero: no hint) */

static double one_batch(CUstream on) {
    CUdeviceptr dsts[3] = {d, d + SPAN, d + 2 * SPAN};
    CUdeviceptr srcs[3] = {(CUdeviceptr)h, (CUdeviceptr)(h + SPAN), (CUdeviceptr)(h + 2 * SPAN)};
    size_t sizes[3] = {SPAN, SPAN, SPAN}, aidx = 0, fail = 0;
    CUmemcpyAttributes a;
    memset(&a, 0, sizeof a);
    a.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    if (hints) {
        a.srcLocHint.type = CU_MEM_LOCATION_TYPE_HOST;
        a.dstLocHint.type = CU_MEM_LOCATION_TYPE_DEVICE;
    }
    double t0 = now_ms();
    CHECK(batch(dsts, srcs, sizes, 3, &a, &aidx, 1, &fail, on));
    return now_ms() - t0;
}

struct arg { CUstream on; double ms; };

static void *new_thread(void *p) {
    struct arg *a = p;
    CHECK(cuCtxSetCurrent(ctx));
    a->ms = one_batch(a->on);
    return NULL;
}

int main(void) {
    probe_hold_ms = 300;
    ctx = probe_init();
    batch = probe_batch_fn();
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    CHECK(cuMemHostAlloc((void **)&h, 3 * SPAN, 0));
    CHECK(cuMemAlloc(&d, 3 * SPAN));
    unsigned tag = 1;
    prepare(tag++);
    printf("1 process's first batch, main thread, held S, no hints: %9.3f ms\n", one_batch(s));
    verify();
    for (int row = 2; row <= 7; row++) {
        hints = row >= 5;
        static const char *names[] = {"", "", "2 new thread's first batch, held S, no hints:  ",
            "3 new thread's first batch, unheld S2, no hints:",
            "4 main thread's later batch, held S, no hints: ",
            "5 new thread's first batch, held S, hints:     ",
            "6 new thread's first batch, unheld S2, hints:  ",
            "7 main thread's later batch, held S, hints:    "};
        printf("%s", names[row]);
        for (int r = 0; r < 3; r++) {
            prepare(tag++);
            double ms;
            if (row == 4 || row == 7) {
                ms = one_batch(s);
            } else {
                struct arg a = {(row == 2 || row == 5) ? s : s2, 0};
                pthread_t t;
                pthread_create(&t, NULL, new_thread, &a);
                pthread_join(t, NULL);
                ms = a.ms;
            }
            printf(" %9.3f", ms);
            verify();
        }
        printf(" ms\n");
        fflush(stdout);
    }
    printf("checks: %s (%d bad copies)\n", bad ? "FAILED" : "ALL PASSED", bad);
    return bad != 0;
}
