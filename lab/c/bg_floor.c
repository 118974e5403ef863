// bg_floor: what a background move of ONE block id must cost its caller at the least, and
// whether handing the move to a thread is the part to cut (#31: host time per call <= 2 us +
// 0.05 us per block; pinstage's background move of 1 id measured 4.0 us from Python on the
// H200, `plan()` of the same id, no driver call, 1.5 us).
//
// The move: block i of 64 device tensors (one allocation [64][NB][4 KiB]) into block j of the
// host tensors (pinned, the same shape): one cuMemcpy2DAsync of 64 rows, as pinstage issues it.
// Rows, host ns per call (median, p10, p90 of N calls), each call timed right after the move
// before it completed and was checked (the bench's pattern: wait, then call):
//  record     cuEventRecord(fork, caller's stream) alone
//  wake       hand a job word to a worker parked in futex_wait (store + FUTEX_WAKE): the
//             handover's floor when the issuing thread sleeps between moves
//  spin       hand it to a worker spinning on the word (a store): no system call (control)
//  bg-parked  the whole background move in C: record the fork, hand over to the parked worker;
//             the worker waits for the fork on its stream, issues the 2D copy, records `done`
//  bg-spin    the same with the worker spinning
//  inline     the same move issued on the calling thread: fork record, cuStreamWaitEvent on a
//             side stream, the 2D copy, record `done` (the alternative with no handover)
// Every move is checked: the device block holds a value new to each call (written before the
// timed part), the host block is poisoned before it, and after the wait all 64 rows of the host
// block hold the value and the block after it still holds the poison.
//
// Shared parts: probe.h. Build: nvcc -O2 -o bg_floor bg_floor.c -lcuda -lpthread
#include "probe.h"
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>

#define L 64
#define NB 1024
#define BW 1024 /* int32 words per block: 4 KiB */
#define N 2000

static CUstream caller, side;
static CUevent fork_ev, done_ev;
static CUdeviceptr dev;
static uint32_t *host;
static size_t pitch = (size_t)NB * BW * 4;
static _Atomic uint32_t job, parked, finished;
static int spin_mode, bad;
static size_t cur_i, cur_j;

static long futex(_Atomic uint32_t *w, int op, uint32_t v) {
    return syscall(SYS_futex, (uint32_t *)w, op, v, NULL, NULL, 0);
}

static void issue_move(CUstream s) {
    CUDA_MEMCPY2D c;
    memset(&c, 0, sizeof c);
    c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    c.srcDevice = dev + cur_i * BW * 4;
    c.srcPitch = pitch;
    c.dstMemoryType = CU_MEMORYTYPE_HOST;
    c.dstHost = host + cur_j * BW;
    c.dstPitch = pitch;
    c.WidthInBytes = BW * 4;
    c.Height = L;
    CHECK(cuMemcpy2DAsync(&c, s));
}

static void *worker(void *arg) {
    CUcontext ctx = arg;
    CHECK(cuCtxSetCurrent(ctx));
    for (;;) {
        uint32_t j;
        if (spin_mode) {
            while ((j = atomic_load_explicit(&job, memory_order_acquire)) == 0) __builtin_ia32_pause();
        } else {
            while ((j = atomic_load_explicit(&job, memory_order_acquire)) == 0) {
                atomic_store(&parked, 1);
                futex(&job, FUTEX_WAIT_PRIVATE, 0);
                atomic_store(&parked, 0);
            }
        }
        atomic_store(&job, 0);
        if (j == 2) return NULL;
        if (j == 3) continue; /* a bare handover (rows wake, spin) */
        CHECK(cuStreamWaitEvent(side, fork_ev, 0));
        issue_move(side);
        CHECK(cuEventRecord(done_ev, side));
        atomic_store_explicit(&finished, 1, memory_order_release);
    }
}

static void hand(uint32_t what) {
    atomic_store_explicit(&job, what, memory_order_release);
    if (!spin_mode) futex(&job, FUTEX_WAKE_PRIVATE, 1);
}

/* Before each call (untimed): a new value in device block i, the poison in host blocks j, j+1. */
static uint32_t prepare(int k) {
    uint32_t v = 0x10000000u + (uint32_t)k * 2654435761u % 0x0fffffffu;
    cur_i = (size_t)(k * 7919) % NB;
    cur_j = (size_t)(k * 104729) % (NB - 1);
    for (int l = 0; l < L; l++) {
        CHECK(cuMemsetD32Async(dev + (size_t)l * pitch + cur_i * BW * 4, v, BW, caller));
        for (int w = 0; w < 2 * BW; w++) host[(size_t)l * NB * BW + cur_j * BW + w] = 0xDEADBEEFu;
    }
    CHECK(cuStreamSynchronize(caller));
    return v;
}

static void check(uint32_t v) {
    CHECK(cuEventSynchronize(done_ev));
    for (int l = 0; l < L; l++) {
        uint32_t *b = host + (size_t)l * NB * BW + cur_j * BW;
        for (int w = 0; w < BW; w++) if (b[w] != v) { bad++; return; }
        for (int w = BW; w < 2 * BW; w++) if (b[w] != 0xDEADBEEFu) { bad++; return; }
    }
}

static void row(const char *name, int mode) {
    static double t[N];
    int moves = mode >= 2;
    for (int k = 0; k < N; k++) {
        uint32_t v = moves ? prepare(k) : 0;
        if (!spin_mode) while (!atomic_load(&parked)) __builtin_ia32_pause();
        atomic_store(&finished, 0);
        double t0 = probe_now_ns();
        switch (mode) {
        case 0: CHECK(cuEventRecord(fork_ev, caller)); break;       /* record */
        case 1: hand(3); break;                                       /* wake / spin */
        case 2: CHECK(cuEventRecord(fork_ev, caller)); hand(1); break; /* bg */
        case 3:                                                        /* inline */
            CHECK(cuEventRecord(fork_ev, caller));
            CHECK(cuStreamWaitEvent(side, fork_ev, 0));
            issue_move(side);
            CHECK(cuEventRecord(done_ev, side));
            break;
        }
        t[k] = probe_now_ns() - t0;
        if (mode == 2) while (!atomic_load_explicit(&finished, memory_order_acquire)) __builtin_ia32_pause();
        if (mode == 1) while (atomic_load(&job)) __builtin_ia32_pause();
        if (moves) check(v);
        else CHECK(cuStreamSynchronize(caller));
        if (!spin_mode) usleep(50); /* the worker parks (and a move's wait takes at least this) */
    }
    qsort(t, N, sizeof t[0], probe_cmp_double);
    printf("  %-10s %8.2f us  p10 %6.2f  p90 %6.2f\n", name, t[N / 2] / 1e3, t[N / 10] / 1e3,
           t[N * 9 / 10] / 1e3);
    fflush(stdout);
}

int main(void) {
    CUcontext ctx = probe_init();
    CHECK(cuStreamCreate(&caller, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&side, CU_STREAM_NON_BLOCKING));
    CHECK(cuEventCreate(&fork_ev, CU_EVENT_DISABLE_TIMING));
    CHECK(cuEventCreate(&done_ev, CU_EVENT_DISABLE_TIMING));
    CHECK(cuMemAlloc(&dev, (size_t)L * pitch));
    CHECK(cuMemHostAlloc((void **)&host, (size_t)L * pitch, 0));
    memset(host, 0xAB, (size_t)L * pitch);
    printf("bg_floor: %d tensors x %d blocks of %d B, one block moved (one 2D copy of %d rows); "
           "host us per call of %d\n", L, NB, BW * 4, L, N);
    for (spin_mode = 0; spin_mode < 2; spin_mode++) {
        pthread_t th;
        atomic_store(&parked, 0);
        pthread_create(&th, NULL, worker, ctx);
        if (!spin_mode) {
            row("record", 0);
            row("wake", 1);
            row("bg-parked", 2);
            row("inline", 3);
        } else {
            row("spin", 1);
            row("bg-spin", 2);
        }
        hand(2);
        pthread_join(th, NULL);
    }
    printf("checks: %s (%d bad of %d moves)\n", bad ? "FAILED" : "all passed", bad, 3 * N);
    return bad != 0;
}
