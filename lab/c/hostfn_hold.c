// hostfn_hold: which driver calls that a step commit makes block the CALLER while the stream
// they go to is held, by a host function (cuLaunchHostFunc) or by a kernel?
// (gpu_step's stalled-step test saw a fresh-mode, multi-span commit make no progress for 300 ms
// while a host function held its stream; with a kernel holding the stream a step took 8-30 µs.)
//
// For each hold (none, host function, kernel spinning on %globaltimer) and each call
// (cuMemcpyHtoDAsync of 4 KiB, cuMemcpyBatchAsync of 3 x 4 KiB with srcAccessOrder STREAM, the
// same with ANY, cuEventRecord, cuEventQuery, cuStreamIsCapturing), 3 times: the stream is
// held for 200 ms, 20 ms later the call is timed on the main thread, then the stream drains.
// A call that blocks reads ~180 ms. Every copy is checked after the drain (poisoned before).
//
// Shared parts: probe.h. Build: nvcc -O2 -o hostfn_hold hostfn_hold.c -lcuda -lpthread
#include "probe.h"

#define SPAN (4 << 10)


static const char *PTX =
    ".version 7.0\n.target sm_50\n.address_size 64\n"
    ".visible .entry spin(.param .u64 ns) {\n"
    "  .reg .u64 %t0, %t1, %d, %n;\n  .reg .pred %p;\n"
    "  ld.param.u64 %n, [ns];\n  mov.u64 %t0, %globaltimer;\n"
    "L: mov.u64 %t1, %globaltimer;\n  sub.u64 %d, %t1, %t0;\n"
    "  setp.lt.u64 %p, %d, %n;\n  @%p bra L;\n  ret;\n}\n";

enum hold { NONE, HOSTFN, KERNEL };
static const char *hold_names[] = {"none", "host function", "kernel"};
enum call { HTOD, BATCH_STREAM, BATCH_ANY, EV_RECORD, EV_QUERY, CAPTURE_INFO, NCALL };
static const char *call_names[] = {"cuMemcpyHtoDAsync 4 KiB", "cuMemcpyBatchAsync 3x4K STREAM",
                                   "cuMemcpyBatchAsync 3x4K ANY", "cuEventRecord",
                                   "cuEventQuery", "cuStreamIsCapturing"};

int main(void) {
    probe_hold_ms = 200;
    (void)probe_init();
    batch_fn_t batch = probe_batch_fn();
    CUmodule mod;
    CUfunction spin;
    CHECK(cuModuleLoadData(&mod, PTX));
    CHECK(cuModuleGetFunction(&spin, mod, "spin"));
    CUstream s;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUevent ev;
    CHECK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    uint8_t *h;
    CHECK(cuMemHostAlloc((void **)&h, 3 * SPAN, 0));
    CUdeviceptr d;
    CHECK(cuMemAlloc(&d, 3 * SPAN));
    uint8_t *back = malloc(3 * SPAN);
    int bad = 0;
    unsigned tag = 1;
    for (int hk = NONE; hk <= KERNEL; hk++) {
        for (int c = 0; c < NCALL; c++) {
            double t[3];
            for (int r = 0; r < 3; r++, tag++) {
                for (int i = 0; i < 3 * SPAN; i++) h[i] = (uint8_t)(tag * 7 + i * 13 + 1);
                CHECK(cuMemsetD8(d, 0xEE, 3 * SPAN));
                CHECK(cuCtxSynchronize());
                if (hk == HOSTFN) CHECK(cuLaunchHostFunc(s, probe_holder, NULL));
                if (hk == KERNEL) {
                    uint64_t ns = (uint64_t)probe_hold_ms * 1000000;
                    void *args[] = {&ns};
                    CHECK(cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
                }
                usleep(20000);
                double t0 = now_ms();
                switch (c) {
                case HTOD: CHECK(cuMemcpyHtoDAsync(d, h, 3 * SPAN, s)); break;
                case BATCH_STREAM:
                case BATCH_ANY: {
                    CUdeviceptr dsts[3] = {d, d + SPAN, d + 2 * SPAN};
                    CUdeviceptr srcs[3] = {(CUdeviceptr)h, (CUdeviceptr)(h + SPAN),
                                           (CUdeviceptr)(h + 2 * SPAN)};
                    size_t sizes[3] = {SPAN, SPAN, SPAN}, aidx = 0, fail = 0;
                    CUmemcpyAttributes a;
                    memset(&a, 0, sizeof a);
                    a.srcAccessOrder = c == BATCH_STREAM ? CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                                                         : CU_MEMCPY_SRC_ACCESS_ORDER_ANY;
                    a.srcLocHint.type = CU_MEM_LOCATION_TYPE_HOST;
                    a.dstLocHint.type = CU_MEM_LOCATION_TYPE_DEVICE;
                    a.dstLocHint.id = 0;
                    CHECK(batch(dsts, srcs, sizes, 3, &a, &aidx, 1, &fail, s));
                    break;
                }
                case EV_RECORD: CHECK(cuEventRecord(ev, s)); break;
                case EV_QUERY: {
                    CHECK(cuEventRecord(ev, s));
                    t0 = now_ms();
                    CUresult qr = cuEventQuery(ev);
                    if (qr != CUDA_SUCCESS && qr != CUDA_ERROR_NOT_READY) CHECK(qr);
                    break;
                }
                case CAPTURE_INFO: {
                    CUstreamCaptureStatus st;
                    CHECK(cuStreamIsCapturing(s, &st));
                    break;
                }
                }
                t[r] = now_ms() - t0;
                CHECK(cuStreamSynchronize(s));
                if (c <= BATCH_ANY) {
                    CHECK(cuMemcpyDtoH(back, d, 3 * SPAN));
                    if (memcmp(back, h, 3 * SPAN) != 0) bad++;
                }
            }
            printf("hold=%-13s %-32s %9.3f %9.3f %9.3f ms\n", hold_names[hk], call_names[c],
                   t[0], t[1], t[2]);
            fflush(stdout);
        }
    }
    printf("checks: %s (%d bad copies)\n", bad ? "FAILED" : "ALL PASSED", bad);
    return bad != 0;
}
