// step_k: bench_step.py's k sweep done in C, the control for the goal "k = 32 fields costs at
// most 2x k = 1 per step". A step of k fields of 1 KiB (int32 x 256, as `kspec(k)` in
// benches/bench_step.py): claim the next slot of a ring of R pinned slots (FIFO; cuEventQuery of
// its event, spinning until its last copy completed), write the k fields' values (a memcpy of
// 1 KiB each from one of 64 value sets, then the step's own 8-byte number at each field's start),
// one cuMemcpyHtoDAsync of the k KiB, one cuEventRecord. The cheapest a step of k fields can be
// with these driver calls: what `stage` adds per field above it is pinstage's and Python's.
//
// Every step's bytes are checked (untimed), as in step_floor.c: each step's device destination
// is poisoned (0xEE) before the step;
//   paced: after each step synchronize, read the step back, compare; poison; busy-wait PACE ns;
//   loop:  steps back to back into KAR arenas; every KAR steps (clock stopped) read all back and
//          compare every step, poison again.
// Timed per step (rdtsc): claim | writes | copy + record. Each k runs WARM + N steps (WARM not
// counted) per round, rounds round-robin over k so drift hits all alike; the figure is the median
// over rounds of each round's median ns per step (min-max of the round medians).
//
// The value sets: 64 by default (2 MiB, hot in the caches, as an engine's freshly computed values);
// a fourth argument sets their number: 2100 makes k = 32's values 66 MiB, read from DRAM as
// bench_step.py's pre-generated values are (2000 steps of k rows of 1 KiB: 64 MiB at k = 32, 2 MiB
// at k = 1). Loop rows print the mean per step too (bench_step.py's loop figure is a mean).
//
// Build: nvcc -O2 -o step_k step_k.c -lcuda (probe.h beside it)  Run: ./step_k [N [rounds [R [sets]]]]
#include "probe.h"
#include <sched.h>

#define FB 1024          // a field's bytes
#define KMAX 32
#define NK 6
#define KAR 250
#define WARM 100
#define MAXREPS 9
#define MAXR 64
#define PACE_NS 30000.0
enum { P_STEP, P_CLAIM, P_WRITE, P_COPY, NP };

static const int KS[NK] = {1, 2, 4, 8, 16, 32};
static CUstream stream;
static CUdeviceptr arenas;  // KAR arenas of KMAX * FB
static unsigned char *back, *vals;
static uint64_t gstep = 1;
static int N = 4000, REPS = 5, R = 8, NSETS = 64;
static uint64_t *T[NP];
static uint64_t a_g[KAR];
static int a_set[KAR];
static long checked;
static double med[NK][2][MAXREPS][NP], mean[NK][2][MAXREPS];

static unsigned char pat(size_t set, size_t f, size_t j) {
    unsigned char b = (unsigned char)(set * 131u + f * 17u + j * 7u + 1u);
    return b == 0xEE ? 0x11 : b;
}
static inline uint64_t word(uint64_t g, int f) { return (g * 64 + (uint64_t)f) ^ 0x5A3C000000000000ull; }
static inline int done(CUevent e) {
    CUresult r = cuEventQuery(e);
    if (r == CUDA_ERROR_NOT_READY) return 0;
    CHECK(r);
    return 1;
}
static void check(int k, int paced, const unsigned char *img, uint64_t g, int set) {
    for (int f = 0; f < k; f++) {
        const unsigned char *got = img + (size_t)f * FB, *want = vals + ((size_t)set * KMAX + f) * FB;
        uint64_t w = word(g, f);
        if (memcmp(got, &w, 8) || memcmp(got + 8, want + 8, FB - 8)) {
            size_t j = 0;
            unsigned char ww[8];
            memcpy(ww, &w, 8);
            while (j < FB && got[j] == (j < 8 ? ww[j] : want[j])) j++;
            fprintf(stderr, "WRONG BYTE: k=%d %s, step %llu field %d byte %zu: 0x%02x, want 0x%02x\n", k,
                    paced ? "paced" : "loop", (unsigned long long)g, f, j, got[j], j < 8 ? ww[j] : want[j]);
            exit(2);
        }
    }
    checked++;
}

static void run(int ki, unsigned char *base, CUevent *ev, int paced, int rep) {
    const int k = KS[ki], total = WARM + N;
    const size_t span = (size_t)k * FB, stride = (size_t)KMAX * FB;
    int next = 0;
    CHECK(cuStreamSynchronize(stream));
    for (int i = 0; i < total; i++) {
        const int a = i % KAR, set = i % NSETS;
        const uint64_t g = gstep++;
        const CUdeviceptr dst = arenas + (CUdeviceptr)a * stride;
        if (paced) CHECK(cuMemsetD8Async(dst, 0xEE, span, stream));
        else if (a == 0) {
            CHECK(cuMemsetD8Async(arenas, 0xEE, KAR * stride, stream));
            CHECK(cuStreamSynchronize(stream));
        }
        if (paced) busy_ns(PACE_NS);
        // -------- the step (timed) --------
        const uint64_t t0 = tsc();
        const int s = next;
        next = next + 1 == R ? 0 : next + 1;
        while (!done(ev[s])) {}
        unsigned char *slot = base + (size_t)s * stride;
        const uint64_t t1 = tsc();
        const unsigned char *src = vals + (size_t)set * KMAX * FB;
        for (int f = 0; f < k; f++) {
            uint64_t w = word(g, f);
            memcpy(slot + (size_t)f * FB, src + (size_t)f * FB, FB);
            memcpy(slot + (size_t)f * FB, &w, 8);
        }
        const uint64_t t2 = tsc();
        CHECK(cuMemcpyHtoDAsync(dst, slot, span, stream));
        CHECK(cuEventRecord(ev[s], stream));
        const uint64_t t3 = tsc();
        // -------- untimed: checks --------
        a_g[a] = g;
        a_set[a] = set;
        if (paced) {
            CHECK(cuStreamSynchronize(stream));
            CHECK(cuMemcpyDtoH(back, dst, span));
            check(k, paced, back, g, set);
        } else if (a == KAR - 1 || i == total - 1) {
            CHECK(cuStreamSynchronize(stream));
            CHECK(cuMemcpyDtoH(back, arenas, (size_t)(a + 1) * stride));
            for (int j = 0; j <= a; j++) check(k, paced, back + (size_t)j * stride, a_g[j], a_set[j]);
        }
        if (i >= WARM) {
            const int c = i - WARM;
            T[P_STEP][c] = t3 - t0; T[P_CLAIM][c] = t1 - t0; T[P_WRITE][c] = t2 - t1; T[P_COPY][c] = t3 - t2;
        }
    }
    double sum = 0;
    for (int c = 0; c < N; c++) sum += (double)T[P_STEP][c];
    mean[ki][paced][rep] = sum / N / tsc_per_ns;
    for (int p = 0; p < NP; p++) {
        qsort(T[p], (size_t)N, sizeof(uint64_t), probe_cmp_u64);
        med[ki][paced][rep][p] = T[p][N / 2] / tsc_per_ns;
    }
    printf("  round %d k=%-2d %-6s step %6.0f ns  claim %5.0f  writes %5.0f  copy+rec %5.0f\n", rep + 1, k,
           paced ? "paced" : "loop", med[ki][paced][rep][P_STEP], med[ki][paced][rep][P_CLAIM],
           med[ki][paced][rep][P_WRITE], med[ki][paced][rep][P_COPY]);
}

static double over_rounds(int ki, int paced, int p, double *mn, double *mx) {  // p = NP: the mean
    double x[MAXREPS];
    for (int r = 0; r < REPS; r++) x[r] = p == NP ? mean[ki][paced][r] : med[ki][paced][r][p];
    qsort(x, (size_t)REPS, sizeof x[0], probe_cmp_double);
    if (mn) *mn = x[0];
    if (mx) *mx = x[REPS - 1];
    return x[REPS / 2];
}

int main(int argc, char **argv) {
    if (argc > 1) N = atoi(argv[1]);
    if (argc > 2) REPS = atoi(argv[2]);
    if (argc > 3) R = atoi(argv[3]);
    if (argc > 4) NSETS = atoi(argv[4]);
    if (N < 10 || REPS < 1 || REPS > MAXREPS || R < 1 || R > MAXR || NSETS < 1 || NSETS > 100000) {
        fprintf(stderr, "usage: step_k [N>=10 [rounds 1..%d [slots 1..%d [value sets 1..100000]]]]\n", MAXREPS,
                MAXR);
        return 64;
    }
    struct timespec w0, w1;
    clock_gettime(CLOCK_MONOTONIC, &w0);
    setvbuf(stdout, NULL, _IOLBF, 0);
    CUdevice d;
    CUcontext ctx;
    char name[256];
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&d, 0));
    CHECK(cuDeviceGetName(name, sizeof name, d));
    // One core for the whole run (a migration would move the slots' lines), unless STEP_K_NOPIN=1:
    // free to migrate, as the Python bench runs.
    const char *nopin = getenv("STEP_K_NOPIN");
    const int pinned = !(nopin && nopin[0] == '1');
    if (pinned) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(sched_getcpu(), &one);
        sched_setaffinity(0, sizeof one, &one);
    }
    probe_tsc_calibrate();
    printf("step_k: %s; tsc %.3f GHz; %d slots (FIFO), k fields of %d bytes, %d counted steps (+%d warm-up) x "
           "{loop, paced %.0f us} x %d rounds; %d value sets (%.1f MiB); %s\n", name, tsc_per_ns, R, FB, N, WARM,
           PACE_NS / 1000, REPS, NSETS, NSETS * (double)KMAX * FB / (1 << 20),
           pinned ? "pinned to one core" : "not pinned");
    CHECK(cuDevicePrimaryCtxRetain(&ctx, d));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CHECK(cuMemAlloc(&arenas, (size_t)KAR * KMAX * FB));
    CHECK(cuMemHostAlloc((void **)&back, (size_t)KAR * KMAX * FB, 0));
    vals = aligned_alloc(4096, (size_t)NSETS * KMAX * FB);
    if (!vals) { perror("aligned_alloc"); return 1; }
    for (size_t s = 0; s < NSETS; s++)
        for (size_t f = 0; f < KMAX; f++)
            for (size_t j = 0; j < FB; j++) vals[(s * KMAX + f) * FB + j] = pat(s, f, j);
    for (int p = 0; p < NP; p++) T[p] = calloc((size_t)N, sizeof(uint64_t));
    unsigned char *base[NK];
    CUevent ev[NK][MAXR];
    for (int ki = 0; ki < NK; ki++) {  // each k its own ring, as each bench row its own stager
        CHECK(cuMemHostAlloc((void **)&base[ki], (size_t)R * KMAX * FB, CU_MEMHOSTALLOC_PORTABLE));
        memset(base[ki], 0x5A, (size_t)R * KMAX * FB);
        for (int s = 0; s < R; s++) CHECK(cuEventCreate(&ev[ki][s], CU_EVENT_DISABLE_TIMING));
    }
    for (int rep = 0; rep < REPS; rep++) {
        printf("round %d\n", rep + 1);
        for (int j = 0; j < NK; j++) {
            const int ki = (j + rep) % NK;  // each k first in turn
            for (int paced = 0; paced < 2; paced++) run(ki, base[ki], ev[ki], paced, rep);
        }
    }
    printf("\nmedian over %d rounds of each round's median ns per step (min-max of the round medians)\n", REPS);
    printf("%-5s %-6s %7s %15s %9s | %7s %7s %8s\n", "k", "regime", "step", "(min-max)", "/ k=1", "claim", "writes",
           "copy+rec");
    for (int paced = 0; paced < 2; paced++)
        for (int ki = 0; ki < NK; ki++) {
            double mn, mx, m = over_rounds(ki, paced, P_STEP, &mn, &mx), m1 = over_rounds(0, paced, P_STEP, 0, 0);
            printf("k=%-3d %-6s %7.0f %7.0f-%-7.0f %8.2fx | %7.0f %7.0f %8.0f\n", KS[ki], paced ? "paced" : "loop", m,
                   mn, mx, m / m1, over_rounds(ki, paced, P_CLAIM, 0, 0), over_rounds(ki, paced, P_WRITE, 0, 0),
                   over_rounds(ki, paced, P_COPY, 0, 0));
        }
    for (int paced = 0; paced < 2; paced++) {
        double m32 = over_rounds(NK - 1, paced, P_STEP, 0, 0), m1 = over_rounds(0, paced, P_STEP, 0, 0);
        printf("%s: k=32 / k=1 = %.2fx (%.0f ns per further field)\n", paced ? "paced" : "loop", m32 / m1,
               (m32 - m1) / (KMAX - 1));
    }
    printf("loop, mean ns per step (median over rounds):");
    for (int ki = 0; ki < NK; ki++) printf(" k=%d %.0f", KS[ki], over_rounds(ki, 0, NP, 0, 0));
    printf("; k=32 / k=1 = %.2fx\n", over_rounds(NK - 1, 0, NP, 0, 0) / over_rounds(0, 0, NP, 0, 0));
    for (int ki = 0; ki < NK; ki++) {
        for (int s = 0; s < R; s++) CHECK(cuEventDestroy(ev[ki][s]));
        CHECK(cuMemFreeHost(base[ki]));
    }
    CHECK(cuMemFreeHost(back));
    CHECK(cuMemFree(arenas));
    CHECK(cuStreamDestroy(stream));
    CHECK(cuDevicePrimaryCtxRelease(d));
    clock_gettime(CLOCK_MONOTONIC, &w1);
    printf("every step checked: %ld step images compared, all right; %.1f s\n", checked,
           (w1.tv_sec - w0.tv_sec) + (w1.tv_nsec - w0.tv_nsec) / 1e9);
    return 0;
}
