// hostfn_thread: while a host function holds stream S for 300 ms, which driver calls block the
// thread that makes them? (gpu_step: the FIRST commit of a new thread waited for the whole
// stall; later commits did not. gpu_d2h: a copy issued while a host function held its stream
// hung the test.) hostfn_hold.c found no call blocking on a thread whose context was current.
//
// Rows, each run 3 times, each timed 30 ms into a fresh 300 ms hold of S:
//  A  a NEW thread: cuCtxSetCurrent, then cuMemcpyHtoDAsync 4 KiB on S2 (another stream)
//  B  a NEW thread: cuCtxPushCurrent, then the same copy on S
//  C  the main thread while ANOTHER thread sits in cuCtxSynchronize (waiting for the hold):
//     cuMemcpyHtoDAsync on S2, cuEventCreate, cuEventRecord on S2, cuMemHostAlloc 64 KiB,
//     cuMemAlloc 64 KiB, cuStreamGetId(S), cuStreamQuery(S2)
//  D  the main thread, nobody synchronizing: the same calls (control)
// A call that blocks reads ~270 ms. Every copy is checked after the hold (poisoned before).
//
// Shared parts: probe.h. Build: nvcc -O2 -o hostfn_thread hostfn_thread.c -lcuda -lpthread
#include "probe.h"
#include <pthread.h>

#define NB (4 << 10)

static CUcontext ctx;
static CUstream s, s2;
static uint8_t *h;
static CUdeviceptr d;
static int bad;

static void hold(void) {
    CHECK(cuLaunchHostFunc(s, probe_holder, NULL));
    usleep(30000);
}

static void poison(unsigned tag) {
    for (int i = 0; i < NB; i++) h[i] = (uint8_t)(tag * 11 + i * 7 + 3);
    CHECK(cuMemsetD8(d, 0xEE, NB));
    CHECK(cuCtxSynchronize());
}

static void verify(void) {
    uint8_t back[NB];
    CHECK(cuCtxSynchronize());
    CHECK(cuMemcpyDtoH(back, d, NB));
    if (memcmp(back, h, NB) != 0) bad++;
}

struct newt { int push; double enter_ms, copy_ms; };

static void *new_thread(void *p) {
    struct newt *n = p;
    double t0 = now_ms();
    if (n->push) CHECK(cuCtxPushCurrent(ctx)); else CHECK(cuCtxSetCurrent(ctx));
    double t1 = now_ms();
    CHECK(cuMemcpyHtoDAsync(d, h, NB, n->push ? s : s2));
    n->enter_ms = t1 - t0;
    n->copy_ms = now_ms() - t1;
    return NULL;
}

static void *syncer(void *p) {
    (void)p;
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuCtxSynchronize());
    return NULL;
}

enum { C_HTOD, C_EVCREATE, C_EVRECORD, C_HOSTALLOC, C_MEMALLOC, C_STREAMID, C_STREAMQUERY, NC };
static const char *cn[] = {"cuMemcpyHtoDAsync 4K on S2", "cuEventCreate", "cuEventRecord on S2",
                           "cuMemHostAlloc 64K", "cuMemAlloc 64K", "cuStreamGetId(S)",
                           "cuStreamQuery(S2)"};

static double one_call(int c) {
    double t0 = now_ms();
    switch (c) {
    case C_HTOD: CHECK(cuMemcpyHtoDAsync(d, h, NB, s2)); break;
    case C_EVCREATE: { CUevent e; CHECK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
        double t = now_ms() - t0; cuEventDestroy(e); return t; }
    case C_EVRECORD: { static CUevent e; if (!e) CHECK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
        t0 = now_ms(); CHECK(cuEventRecord(e, s2)); break; }
    case C_HOSTALLOC: { void *p; CHECK(cuMemHostAlloc(&p, 64 << 10, 0));
        double t = now_ms() - t0; cuMemFreeHost(p); return t; }
    case C_MEMALLOC: { CUdeviceptr p; CHECK(cuMemAlloc(&p, 64 << 10));
        double t = now_ms() - t0; cuMemFree(p); return t; }
    case C_STREAMID: { unsigned long long id; CHECK(cuStreamGetId(s, &id)); break; }
    case C_STREAMQUERY: { CUresult r = cuStreamQuery(s2);
        if (r != CUDA_SUCCESS && r != CUDA_ERROR_NOT_READY) CHECK(r); break; }
    }
    return now_ms() - t0;
}

int main(void) {
    probe_hold_ms = 300;
    ctx = probe_init();
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    CHECK(cuMemHostAlloc((void **)&h, NB, 0));
    CHECK(cuMemAlloc(&d, NB));
    unsigned tag = 1;
    for (int push = 0; push < 2; push++) {
        printf("%s", push ? "B new thread cuCtxPushCurrent + copy on S (held):" :
                            "A new thread cuCtxSetCurrent + copy on S2:       ");
        for (int r = 0; r < 3; r++) {
            poison(tag++);
            hold();
            struct newt n = {push, 0, 0};
            pthread_t t;
            pthread_create(&t, NULL, new_thread, &n);
            pthread_join(t, NULL);
            printf("  enter %.3f copy %.3f ms;", n.enter_ms, n.copy_ms);
            verify();
        }
        printf("\n");
    }
    for (int with_sync = 1; with_sync >= 0; with_sync--) {
        for (int c = 0; c < NC; c++) {
            printf("%s %-28s", with_sync ? "C another thread in cuCtxSynchronize:" :
                                           "D nobody synchronizing:             ", cn[c]);
            for (int r = 0; r < 3; r++) {
                poison(tag++);
                hold();
                pthread_t t;
                if (with_sync) { pthread_create(&t, NULL, syncer, NULL); usleep(10000); }
                double ms = one_call(c);
                if (with_sync) pthread_join(t, NULL);
                printf(" %9.3f", ms);
                if (c == C_HTOD) verify(); else CHECK(cuCtxSynchronize());
            }
            printf(" ms\n");
            fflush(stdout);
        }
    }
    printf("checks: %s (%d bad copies)\n", bad ? "FAILED" : "ALL PASSED", bad);
    return bad != 0;
}
