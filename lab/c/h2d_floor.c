// h2d_floor: the control for #28's pageable goal (copy_h2d from pageable, source cold, >= 0.88 of
// a copy from pinned memory at 64 MiB, >= 0.92 at 1 GiB, >= 0.5 at 1 MiB). What can ANY program
// on this host reach, C against the driver, with the best pipeline we know, and where does it
// stop: the fill (pageable -> pinned by the CPUs), the workers' wake-up, or the DMA beside the
// fill?
//
// Rows, per size (1, 16, 64, 1024 MiB; the source cold: 16 threads read a 1 GiB buffer before
// every call (bench_h2d.py's sweep also writes it), and the call's source is one of K rotating
// buffers):
//   pinned     one cuMemcpyHtoDAsync of the bytes from page-locked memory + cuStreamSynchronize
//              (torch's copy_ from pinned: the reference of the goal)
//   fill T x   T threads (the caller one of them) copy the source into a pinned ring of 12 slots
//   nt|mc      of 4 MiB, 256 KiB units claimed in address order (nt: SSE2 non-temporal stores; mc:
//              memcpy), NO copy to the device: the fill's own rate
//   pipe T x   the same fill, and the thread that completes a piece issues its cuMemcpyHtoDAsync
//   nt|mc      + cuEventRecord (a slot is refilled once its event completed; pieces ramp 128 KiB,
//   armed|park 256, ..., 4 MiB): pinstage's pipeline. Between calls every worker sleeps on its
//              own condition variable. armed: before the clock starts the call's workers are
//              woken and spin until it starts (no wake-up inside the call: the floor of
//              "workers already spinning when a copy is likely"); park: the call wakes them
//              (pinstage's workers park). Fill rows wake their workers as armed rows do. A
//              call wakes at most one worker per unit beyond the caller's (a 1 MiB copy: 4).
//   whole|halves|quarters T x nt: other cuts (armed, non-temporal): the copy as 1, 2 or 4 pieces,
//              no ramp, each piece cut into T units so all the call's threads fill it together
//              before the next; run only where a piece fits a 4 MiB slot (copies of <= 4, 8, 16 MiB)
// Run 2026-12-06-h200-a had the workers spin between calls instead: all 16 CPUs busy while the
// driver and the sweep needed them, medians scattered 10-fold; only its park rows held.
// Every call's result is checked (pipe and pinned rows): the destination poisoned (0xEE, untimed)
// before the call, read back after it and compared with the source, whose bytes never hold 0xEE
// and carry a per-call stamp in the first 8 bytes of every 64 KiB and the last 8 (so a copy
// that did nothing, or copied a slot's earlier bytes, fails). Fill rows check the slots' last piece against the
// source. Median of R calls (default 7) with min and max; rows interleaved per round.
//
// Build: nvcc -O2 -o h2d_floor h2d_floor.c -lcuda -lpthread     Run: ./h2d_floor [R [MiB...]]
#define _GNU_SOURCE
#include "probe.h"
#include <pthread.h>
#include <stdatomic.h>

#define SLOTS 12
#define PIECE (4u << 20)
#define UNIT (256u << 10)
#define MINP (128u << 10)
#define MAXT 16
#define SWEEP (1ull << 30)
#define MAXU 8192
#define MAXP 512

typedef struct { size_t piece, off, n; } unit_t;

static CUcontext ctx;
static CUstream stream;
static unsigned char *slot[SLOTS];
static CUevent ev[SLOTS];
// The call in flight.
static unit_t units[MAXU];
static size_t piece_off[MAXP], piece_len[MAXP], piece_units[MAXP];
static atomic_size_t piece_done[MAXP];
static atomic_int issued[MAXP];
// Piece i's slot is free once piece i - SLOTS's event completed: one thread polls the event (the
// first to ask), the others wait for its word (many threads polling one event could slow the
// thread issuing copies inside the driver).
static atomic_int slot_free[MAXP], poller[MAXP];
static atomic_size_t next_unit;
static size_t nunits, npieces;
static const unsigned char *src_now;
static CUdeviceptr dst_now;
static int nt_now, dma_now;
static atomic_int failed;
// Workers 0..T-2 of a call (the caller is the T-th): each sleeps on its own condition variable
// until `go` moves; then, armed, it spins until `start` moves, or runs at once.
static struct {
    pthread_mutex_t m;
    pthread_cond_t c;
    unsigned go;
    int armed;
} W[MAXT];
static atomic_uint start, finished, spinning;

static void fill(unsigned char *d, const unsigned char *s, size_t n, int nt) {
    if (nt) probe_nt_copy(d, s, n);
    else memcpy(d, s, n);
}

// The call's cut: shape 0 (pinstage's): pieces ramp from MINP up to PIECE, units of UNIT
// within each piece, in address order; shape s > 0: pieces of len / s (at most PIECE; s = 1:
// the whole copy one piece), no ramp, each piece cut into `T` units so that all the call's
// threads fill the first piece together, then the next (fill T x then one copy, halves,
// quarters).
static int shape_now, threads_now;
static void cut(size_t len) {
    size_t first = MINP, unit = UNIT;
    if (shape_now > 0) {
        first = (len / (size_t)shape_now + 4095) & ~(size_t)4095;
        if (first > PIECE) first = PIECE;
        unit = (first / (size_t)threads_now + 4095) & ~(size_t)4095;
    }
    size_t off = 0, size = first;
    npieces = nunits = 0;
    while (off < len) {
        size_t n = size < len - off ? size : len - off;
        piece_off[npieces] = off; piece_len[npieces] = n; piece_units[npieces] = 0;
        for (size_t a = 0; a < n; a += unit) {
            units[nunits++] = (unit_t){npieces, a, (n - a) < unit ? n - a : unit};
            piece_units[npieces]++;
        }
        atomic_store(&piece_done[npieces], 0);
        atomic_store(&issued[npieces], 0);
        atomic_store(&slot_free[npieces], 0);
        atomic_store(&poller[npieces], 0);
        npieces++;
        off += n;
        if (shape_now == 0) size = size * 2 > PIECE ? PIECE : size * 2;
    }
    atomic_store(&next_unit, 0);
}

// Take units until none is left (every thread of a call, the caller included).
static void work(void) {
    for (;;) {
        size_t u = atomic_fetch_add(&next_unit, 1);
        if (u >= nunits) return;
        unit_t w = units[u];
        int s = (int)(w.piece % SLOTS);
        if (w.piece >= SLOTS) {  // the slot's previous piece must be filled (and copied)
            while (!atomic_load_explicit(&issued[w.piece - SLOTS], memory_order_acquire)) _mm_pause();
        }
        if (w.piece >= SLOTS && dma_now && !atomic_load_explicit(&slot_free[w.piece], memory_order_acquire)) {
            if (!atomic_exchange(&poller[w.piece], 1)) {
                CUresult r;
                while ((r = cuEventQuery(ev[s])) == CUDA_ERROR_NOT_READY) _mm_pause();
                if (r != CUDA_SUCCESS) atomic_store(&failed, 1);
                atomic_store_explicit(&slot_free[w.piece], 1, memory_order_release);
            } else {
                while (!atomic_load_explicit(&slot_free[w.piece], memory_order_acquire)) _mm_pause();
            }
        }
        fill(slot[s] + w.off, src_now + piece_off[w.piece] + w.off, w.n, nt_now);
        size_t done = atomic_fetch_add_explicit(&piece_done[w.piece], 1, memory_order_acq_rel) + 1;
        if (done == piece_units[w.piece]) {
            if (dma_now) {
                if (cuMemcpyHtoDAsync(dst_now + piece_off[w.piece], slot[s], piece_len[w.piece], stream) != CUDA_SUCCESS ||
                    cuEventRecord(ev[s], stream) != CUDA_SUCCESS)
                    atomic_store(&failed, 1);
            }
            atomic_store_explicit(&issued[w.piece], 1, memory_order_release);
        }
    }
}

static void *worker(void *arg) {
    int me = (int)(intptr_t)arg;
    CHECK(cuCtxSetCurrent(ctx));
    unsigned seen = 0;
    for (;;) {
        pthread_mutex_lock(&W[me].m);
        while (W[me].go == seen) pthread_cond_wait(&W[me].c, &W[me].m);
        seen = W[me].go;
        int armed = W[me].armed;
        unsigned s0 = atomic_load(&start);
        pthread_mutex_unlock(&W[me].m);
        if (armed) {
            atomic_fetch_add(&spinning, 1);
            while (atomic_load_explicit(&start, memory_order_acquire) == s0) _mm_pause();
        }
        work();
        atomic_fetch_add(&finished, 1);
    }
    return NULL;
}

static void wake(int k, int armed) {
    pthread_mutex_lock(&W[k].m);
    W[k].go++;
    W[k].armed = armed;
    pthread_cond_signal(&W[k].c);
    pthread_mutex_unlock(&W[k].m);
}

// Before the clock (armed calls): the call's `nw` workers woken, spinning.
static void arm(int nw) {
    atomic_store(&spinning, 0);
    for (int k = 0; k < nw; k++) wake(k, 1);
    while (atomic_load(&spinning) < (unsigned)nw) _mm_pause();
}

// One call: the caller and `nw` workers fill (and with dma, copy) the units `cut` made; armed:
// the workers were armed (spinning) before, else the call wakes them.
static void call(int nw, int nt, int dma, int armed) {
    nt_now = nt; dma_now = dma;
    atomic_store(&finished, 0);
    if (armed) {
        atomic_fetch_add_explicit(&start, 1, memory_order_release);
    } else {
        for (int k = 0; k < nw; k++) wake(k, 0);
    }
    work();
    while (atomic_load(&finished) < (unsigned)nw) _mm_pause();
    if (dma) CHECK(cuStreamSynchronize(stream));
}

static unsigned char *sweep_buf;
static _Atomic uint64_t sweep_sink;
static void *sweeper(void *arg) {
    size_t part = SWEEP / MAXT, i = (size_t)(intptr_t)arg;
    uint64_t sum = 0;
    for (size_t a = i * part; a < (i + 1) * part; a += 64) sum += sweep_buf[a];
    sweep_sink += sum;
    return NULL;
}
// Evicts every cache: 16 threads read 1 GiB (reads only: no dirty lines left for the timed
// call's stores to write back; bench_h2d.py's sweep writes too).
static void sweep(void) {
    pthread_t t[MAXT];
    for (int i = 0; i < MAXT; i++) pthread_create(&t[i], NULL, sweeper, (void *)(intptr_t)i);
    for (int i = 0; i < MAXT; i++) pthread_join(t[i], NULL);
}

int main(int argc, char **argv) {
    int R = argc > 1 ? atoi(argv[1]) : 7;
    if (R < 1 || R > 16) { fprintf(stderr, "R: 1..16\n"); return 2; }
    ctx = probe_init();
    CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    for (int s = 0; s < SLOTS; s++) {
        CHECK(cuMemHostAlloc((void **)&slot[s], PIECE, 0));
        CHECK(cuEventCreate(&ev[s], CU_EVENT_DISABLE_TIMING));
    }
    size_t sizes[8] = {1u << 20, 16u << 20, 64u << 20, 1u << 30};
    int nsizes = 4;
    if (argc > 2) {  // sizes in MiB (at most 1024)
        nsizes = argc - 2 > 8 ? 8 : argc - 2;
        for (int i = 0; i < nsizes; i++) {
            sizes[i] = (size_t)atoi(argv[i + 2]) << 20;
            if (sizes[i] == 0 || sizes[i] > (1u << 30)) { fprintf(stderr, "sizes: 1..1024 MiB\n"); return 2; }
        }
    }
    size_t maxlen = 1u << 30;
    unsigned char *pinned, *back;
    CUdeviceptr dst;
    CHECK(cuMemHostAlloc((void **)&pinned, maxlen, 0));
    CHECK(cuMemAlloc(&dst, maxlen));
    back = malloc(maxlen);
    sweep_buf = malloc(SWEEP);
    memset(sweep_buf, 1, SWEEP);
    for (int i = 0; i < MAXT - 1; i++) {
        pthread_mutex_init(&W[i].m, NULL);
        pthread_cond_init(&W[i].c, NULL);
        pthread_t t;
        pthread_create(&t, NULL, worker, (void *)(intptr_t)i);
    }
    // Rows: pinned; fill T x nt|mc; pipe T x nt|mc x spin|park.
    enum { PINNED, FILL, PIPE };
    struct { int kind, T, nt, park; const char *name; int shape; } rows[40];
    int nr = 0;
    rows[nr++] = (typeof(rows[0])){PINNED, 0, 0, 0, "pinned one copy"};
    const int Ts[] = {1, 4, 8, 12, 16};
    for (int i = 0; i < 5; i++)
        for (int nt = 1; nt >= 0; nt--) rows[nr++] = (typeof(rows[0])){FILL, Ts[i], nt, 0, "fill"};
    for (int i = 1; i < 5; i++)
        for (int nt = 1; nt >= 0; nt--) rows[nr++] = (typeof(rows[0])){PIPE, Ts[i], nt, 0, "pipe armed"};
    rows[nr++] = (typeof(rows[0])){PIPE, 12, 1, 1, "pipe park"};
    rows[nr++] = (typeof(rows[0])){PIPE, 12, 0, 1, "pipe park"};
    // Other cuts of the copy (the control of the 1 MiB goal: is pinstage's ramp the best cut?).
    // Only where len / shape fits a slot (4 MiB): beyond, every shape is 4 MiB pieces (skipped).
    const int shp[] = {1, 2, 4};
    const char *sname[] = {"whole, 1 copy", "halves", "quarters"};
    for (int j = 0; j < 3; j++)
        for (int T = 4; T <= 8; T += 4) rows[nr++] = (typeof(rows[0])){PIPE, T, 1, 0, sname[j], shp[j]};
    printf("h2d_floor: %d calls per row, source cold (1 GiB sweep before each call)\n", R);
    for (int zi = 0; zi < nsizes; zi++) {
        size_t len = sizes[zi];
        // Rotating sources: never the same one twice within 1 GiB of calls (at least 2).
        int k = len >= (512u << 20) ? 2 : (int)((1u << 30) / len) > 64 ? 64 : (int)((1u << 30) / len);
        unsigned char **src = malloc(k * sizeof *src);
        for (int b = 0; b < k; b++) {
            src[b] = aligned_alloc(4096, len);
            for (size_t a = 0; a < len; a++) src[b][a] = (unsigned char)(1 + (a * 131 + b * 7 + a / 4093) % 163);
        }
        double t[40][16];
        long call_no = 0;
        int nw = 0;
        for (int r = 0; r < R; r++) {
            for (int q = 0; q < nr; q++) {
                int i = (q + r) % nr;  // rotated order per round
                if (rows[i].shape && len / (size_t)rows[i].shape > PIECE) continue;
                int b = (int)(call_no % k);
                call_no++;
                // Stamp: the first 8 bytes of every 64 KiB and the last 8 unique to this call
                // (never 0xEE bytes), so a slot copied before it was refilled fails the check.
                uint64_t stamp = 0x0101010101010101ull * (uint64_t)(1 + call_no % 200);
                for (size_t a = 0; a < len; a += 64u << 10) memcpy(src[b] + a, &stamp, 8);
                memcpy(src[b] + len - 8, &stamp, 8);
                if (rows[i].kind == PINNED) memcpy(pinned, src[b], len);  // pinned source hot or not: DMA reads DRAM
                CHECK(cuMemsetD8(dst, 0xEE, len));
                CHECK(cuCtxSynchronize());
                sweep();
                if (rows[i].kind != PINNED) {
                    shape_now = rows[i].shape;
                    threads_now = rows[i].T;
                    cut(len);  // the call's pieces and units, before the clock
                    src_now = src[b]; dst_now = dst;
                    // Workers for this copy: at most one per unit beyond the caller's.
                    nw = rows[i].T - 1 < (int)nunits - 1 ? rows[i].T - 1 : (int)nunits - 1;
                    if (nw < 0) nw = 0;
                    if (!rows[i].park) arm(nw);
                }
                double t0 = probe_now_ns();
                if (rows[i].kind == PINNED) {
                    CHECK(cuMemcpyHtoDAsync(dst, pinned, len, stream));
                    CHECK(cuStreamSynchronize(stream));
                } else {
                    call(nw, rows[i].nt, rows[i].kind == PIPE, !rows[i].park);
                }
                t[i][r] = probe_now_ns() - t0;
                if (atomic_load(&failed)) { fprintf(stderr, "a driver call failed\n"); return 1; }
                if (rows[i].kind == FILL) {  // the last piece's bytes in its slot
                    size_t p = npieces - 1;
                    if (memcmp(slot[p % SLOTS], src[b] + piece_off[p], piece_len[p])) {
                        fprintf(stderr, "CHECK FAILED: fill %zu MiB T=%d\n", len >> 20, rows[i].T);
                        return 1;
                    }
                } else {
                    CHECK(cuMemcpyDtoH(back, dst, len));
                    if (memcmp(back, src[b], len)) {
                        fprintf(stderr, "CHECK FAILED: %s %zu MiB T=%d nt=%d\n", rows[i].name, len >> 20, rows[i].T, rows[i].nt);
                        return 1;
                    }
                }
            }
        }
        printf("\n%zu MiB (GB/s: median [min max]; x pinned: ratio of medians)\n", len >> 20);
        double ref = 0;
        for (int i = 0; i < nr; i++) {
            if (rows[i].shape && len / (size_t)rows[i].shape > PIECE) continue;
            qsort(t[i], R, sizeof(double), probe_cmp_double);
            double med = t[i][R / 2], gbs = len / med, lo = len / t[i][R - 1], hi = len / t[i][0];
            if (i == 0) ref = gbs;
            printf("  %-16s T=%-2d %s  %7.2f [%6.2f %6.2f]  %.3fx  (%.0f us)\n", rows[i].name, rows[i].T,
                   rows[i].kind == PINNED ? "  " : rows[i].nt ? "nt" : "mc", gbs, lo, hi, gbs / ref, med / 1e3);
        }
        for (int b = 0; b < k; b++) free(src[b]);
        free(src);
        fflush(stdout);
    }
    printf("\nall checks passed\n");
    return 0;
}
