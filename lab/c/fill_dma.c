// fill_dma: the control h2d_floor.c lacks. Its pipeline (CPU threads fill pinned slots from a
// cold pageable source, the filled slots go to the device) runs below the slower of its two
// halves: on an H100 (run 2026-12-06-h100-d) the fill alone reached 1.3x one pinned copy and the
// DMA alone 1.0x, together 0.76x at 64 MiB. Is that the two halves sharing something (memory
// bandwidth, the memory controller or the IOMMU beside the DMA's reads), or the pipeline's own
// hand-offs? Here the two halves share NOTHING of the pipeline: no slot, no event, no hand-off.
//   fill    T threads copy their part of a 1 GiB pageable source (touched, never in cache: each
//           pass reads 1 GiB) into their own pinned 64 MiB target with non-temporal stores,
//           pass after pass
//   dma     one stream copies a separate pinned 256 MiB buffer to the device, copy after copy
//           (cuMemcpyHtoDAsync, kept 4 deep)
//   both    the two at once, each timed over the same window
// Each row runs for about 1 s, 3 rounds, rows interleaved; printed: GB/s of each half alone and
// together (median [min max] of the rounds), and the host memory traffic they make: the fill
// reads and writes each byte (2 bytes of traffic a byte; non-temporal stores skip the read for
// ownership), the DMA reads each byte once. If the traffic together stays near the larger
// alone, the halves share memory bandwidth and the pipeline's 0.76x is a floor of this host;
// if both halves keep their rates together, the loss is the pipeline's and can be won back.
// Checks: each thread poisons (0xEE) one byte per 4 KiB of its target before every piece and
// compares them with the source after it (the source never holds 0xEE; its marks differ from
// piece to piece and row to row); after every row with a DMA the device buffer, poisoned before
// the row, is read back and compared at one byte per 4 KiB. The main thread waits with blocking
// event syncs (no core spun); after `stop` each thread ends its 4 MiB step, and the fill's window
// closes when all stopped. "dma alone" is measured first (3 rows), the T rows interleave fill
// alone and both.
// FILL=demote (environment): each thread fills a RING_KIB (default 1024) ring of its target with
// ordinary stores (memcpy), then `cldemote`s every line written (the lines leave the core's L2 for
// the shared L3), the way the `demote` knob of pinstage's fill does: what one thread's cached,
// demoted stores into a ring that stays in the L3 cost against its non-temporal stores, and what
// they leave to the DMA beside them. The traffic column then counts 1 byte a byte for the fill
// (the source's read) where the ring stays in the L3.
// DMA_SRC (environment) says what the DMA reads: `big` (default) the separate 256 MiB buffer in
// 256 MiB copies; `pieces` the same buffer in RING_KIB copies (what a ring's copy count costs,
// 16 deep); `ring` the fill threads' own rings, RING_KIB a copy, round robin over the threads
// filling (over all 16 rings in the "dma alone" row, nothing writing them): the pipeline's DMA
// without its hand-offs. With `ring` each thread rewrites a RING_KIB ring, with non-temporal
// stores or (FILL=demote) cached ones: RING_KIB=4096 DMA_SRC=ring is pinstage's 64 MiB case (12
// threads, 4 MiB slots) less the hand-offs; DMA_SRC=pieces RING_KIB=4096 its copy count alone.
// With FILL=demote it says whether the engine reads lines the fill just demoted to the L3 at the
// link's rate (then a pipeline's hand-offs are its loss) or not (then a cached ring is bound by
// the host). A `ring` row's device bytes race the fill by design and are
// not checked; the fill's checks still run. Each "both" line counts the issues that found the
// copy before already done (the engine had run dry: the issuing thread came late, e.g. with 16
// fill threads on 16 CPUs), which would lower the DMA's rate for a reason other than memory.
// Build: nvcc -O2 -o fill_dma fill_dma.c -lcuda -lpthread     Run: ./fill_dma [T...] (default 4 8 12 16)
#define _GNU_SOURCE
#include "probe.h"
#include <pthread.h>
#include <stdatomic.h>

#define SRC (1ull << 30)
#define TGT (64u << 20)
#define DMA (256u << 20)
#define DEPTH 16  // the events; `big` copies keep 4 in flight, pieces all 16
#define MAXT 16

static unsigned char *src;
static unsigned char *tgt[MAXT];
static unsigned char *pinned;
static CUdeviceptr dev;
static CUcontext ctx;
static atomic_int go, stop;
static int nthreads;
static unsigned char stamp;
static atomic_long filled, bad;
static int demote;          // FILL=demote: cached stores + cldemote into a small ring
static size_t piece = TGT;  // the bytes a thread writes before it starts its target again
static size_t ring_bytes = 1u << 20;  // RING_KIB: the demoted ring and a `pieces` / `ring` copy
static int dma_src;         // DMA_SRC: 0 big, 1 pieces, 2 ring

// Ordinary stores, then every written line demoted to the shared L3 (a no-op hint on a CPU
// without CLDEMOTE: the instruction sits in the hint-NOP space).
static void demoted_copy(unsigned char *dst, const unsigned char *s, size_t n) {
    memcpy(dst, s, n);
    for (size_t i = 0; i < n; i += 64) __asm__ volatile("cldemote (%0)" ::"r"(dst + i) : "memory");
    __asm__ volatile("sfence" ::: "memory");
}

static unsigned char mark(size_t i, unsigned char salt) {
    return (unsigned char)((((i >> 12) * 0x9E3779B1u) >> 24) ^ salt) | 1;
}

#define STEP (4u << 20)

static void *filler(void *arg) {
    long t = (long)arg;
    // A whole number of 4 KiB pages: the checked bytes (one per 4 KiB) are the marked ones.
    size_t part = (SRC / nthreads) & ~(size_t)4095, off = (size_t)t * part;
    while (!atomic_load(&go)) ;
    long mine = 0;
    while (!atomic_load(&stop)) {
        for (size_t done = 0; done < part && !atomic_load(&stop); done += piece) {
            size_t n = part - done < piece ? part - done : piece;
            // The checked bytes poisoned first: a pass that copied nothing fails even where the
            // piece is the one before (T = 16: every pass copies the same piece).
            for (size_t i = 0; i < n; i += 4096) tgt[t][i] = 0xEE;
            // In 4 MiB steps, so that the thread stops soon after `stop` (the window's end).
            size_t copied = 0;
            for (; copied < n && !atomic_load(&stop); copied += STEP) {
                size_t m = n - copied < STEP ? n - copied : STEP;
                if (demote) demoted_copy(tgt[t] + copied, src + off + done + copied, m);
                else probe_nt_copy(tgt[t] + copied, src + off + done + copied, m);
            }
            if (copied > n) copied = n;
            for (size_t i = 0; i < copied; i += 4096)
                if (tgt[t][i] != src[off + done + i]) atomic_fetch_add(&bad, 1);
            mine += copied;
        }
    }
    atomic_fetch_add(&filled, mine);
    return NULL;
}

// One row: fill with `t` threads (0: none), the DMA or not; for about `ms`. Writes GB/s.
static void row(int t, int dma, double ms, double *fill_gbs, double *dma_gbs, long *idle_out) {
    CUstream s;
    CUevent a, b, ev[DEPTH];
    *idle_out = 0;
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CHECK(cuEventCreate(&a, 0));
    CHECK(cuEventCreate(&b, 0));
    // Blocking waits: a spinning main thread would take a core from the fill (T = 16).
    for (int i = 0; i < DEPTH; i++) CHECK(cuEventCreate(&ev[i], CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC));
    stamp = (unsigned char)(stamp + 2);
    // Values that differ from one 64 MiB piece to the next (a pass that copied nothing would
    // leave the piece before in the target) and from row to row; never the poison 0xEE.
    for (size_t i = 0; i < SRC; i += 4096) src[i] = mark(i, stamp);
    for (size_t i = 0; i < DMA; i += 4096) pinned[i] = mark(i, (unsigned char)(stamp + 1));
    CHECK(cuMemsetD8(dev, 0xEE, DMA));
    CHECK(cuCtxSynchronize());
    nthreads = t;
    atomic_store(&go, 0);
    atomic_store(&stop, 0);
    atomic_store(&filled, 0);
    pthread_t th[MAXT];
    for (long i = 0; i < t; i++)
        if (pthread_create(&th[i], NULL, filler, (void *)i) != 0) exit(1);
    long copies = 0;
    double t0 = now_ms();
    atomic_store(&go, 1);
    if (dma) {
        CHECK(cuEventRecord(a, s));
        int depth = dma_src ? DEPTH : 4, rings = t ? t : MAXT;
        long idle = 0;  // issues that found the copy before done: the engine had run dry
        while (now_ms() - t0 < ms) {
            CUevent e = ev[copies % depth];
            if (copies >= depth) CHECK(cuEventSynchronize(e));
            if (copies > 0 && cuEventQuery(ev[(copies - 1) % depth]) == CUDA_SUCCESS) idle++;
            size_t off = (size_t)(copies % (long)(DMA / ring_bytes)) * ring_bytes;  // whole copies inside
            if (dma_src == 0) CHECK(cuMemcpyHtoDAsync(dev, pinned, DMA, s));
            else if (dma_src == 1) CHECK(cuMemcpyHtoDAsync(dev + off, pinned + off, ring_bytes, s));
            else CHECK(cuMemcpyHtoDAsync(dev + off, tgt[copies % rings], ring_bytes, s));
            CHECK(cuEventRecord(e, s));
            copies++;
        }
        *idle_out = idle;
        CHECK(cuEventRecord(b, s));
        CHECK(cuEventRecord(ev[0], s));
        CHECK(cuEventSynchronize(ev[0]));  // blocking: the drain spins no core either
    } else {
        while (now_ms() - t0 < ms) usleep(1000);
    }
    atomic_store(&stop, 1);
    // Each thread ends its target-sized piece first: the fill's window closes when all stopped.
    for (int i = 0; i < t; i++) pthread_join(th[i], NULL);
    double fill_end = now_ms();
    *fill_gbs = t ? atomic_load(&filled) / ((fill_end - t0) * 1e6) : 0;
    *dma_gbs = 0;
    if (dma) {
        CHECK(cuEventSynchronize(b));
        float gpu_ms;
        CHECK(cuEventElapsedTime(&gpu_ms, a, b));
        *dma_gbs = (double)copies * (dma_src ? ring_bytes : DMA) / (gpu_ms * 1e6);
        unsigned char *back = malloc(DMA);
        if (!back) exit(1);
        CHECK(cuMemcpyDtoH(back, dev, DMA));
        // `ring` rows race the fill (not checked); `pieces` rows: the bytes their copies covered
        // (whole RING_KIB copies from the buffer's start, round after round).
        long per_round = (long)(DMA / ring_bytes);
        size_t covered = dma_src == 0 ? DMA : (size_t)(copies < per_round ? copies : per_round) * ring_bytes;
        if (dma_src != 2)
            for (size_t i = 0; i < covered; i += 4096)
                if (back[i] != pinned[i]) atomic_fetch_add(&bad, 1);
        free(back);
    }
    for (int i = 0; i < DEPTH; i++) CHECK(cuEventDestroy(ev[i]));
    CHECK(cuEventDestroy(a));
    CHECK(cuEventDestroy(b));
    CHECK(cuStreamDestroy(s));
}

static int cmp(const void *x, const void *y) { return probe_cmp_double(x, y); }

int main(int argc, char **argv) {
    ctx = probe_init();
    int ts[8] = {4, 8, 12, 16}, nt = 4;
    if (argc > 1) {
        nt = 0;
        for (int i = 1; i < argc && nt < 8; i++) {
            int v = atoi(argv[i]);
            if (v >= 1 && v <= MAXT) ts[nt++] = v;
        }
    }
    const char *fill = getenv("FILL");
    demote = fill && strcmp(fill, "demote") == 0;
    const char *rk = getenv("RING_KIB");
    long kib = rk ? atol(rk) : 1024;
    if (kib < 4 || (size_t)kib * 1024 > TGT) kib = 1024;
    ring_bytes = (size_t)kib * 1024 & ~(size_t)4095;
    const char *ds = getenv("DMA_SRC");
    dma_src = !ds ? 0 : strcmp(ds, "pieces") == 0 ? 1 : strcmp(ds, "ring") == 0 ? 2 : 0;
    if (demote || dma_src == 2) piece = ring_bytes;  // `ring`: each thread rewrites its ring

    src = malloc(SRC);
    if (!src) return 1;
    memset(src, 0x11, SRC);  // every page present: pageable, not in cache once 1 GiB was read
    for (int t = 0; t < MAXT; t++) {
        CHECK(cuMemHostAlloc((void **)&tgt[t], TGT, CU_MEMHOSTALLOC_PORTABLE));
        memset(tgt[t], 0xEE, TGT);
    }
    CHECK(cuMemHostAlloc((void **)&pinned, DMA, CU_MEMHOSTALLOC_PORTABLE));
    CHECK(cuMemAlloc(&dev, DMA));
    if (demote)
        printf("fill_dma (FILL=demote): each thread's target a %zu KiB ring, ordinary stores + cldemote\n", piece >> 10);
    if (dma_src)
        printf("fill_dma (DMA_SRC=%s): the DMA copies %zu KiB at a time from %s\n", dma_src == 1 ? "pieces" : "ring",
               ring_bytes >> 10, dma_src == 1 ? "the separate buffer, 16 deep" : "the fill threads' rings, round robin, 16 deep (not checked: they race the fill)");
    printf("fill_dma: fill = T threads, pageable 1 GiB source -> own pinned 64 MiB target (non-temporal);\n"
           "dma = a separate pinned 256 MiB buffer -> device, 4 deep; ~1 s a row, median of 3 [min max]\n");
    double dma_alone[3];
    long idle;
    for (int r = 0; r < 3; r++) {
        double f;
        row(0, 1, 1000, &f, &dma_alone[r], &idle);
    }
    qsort(dma_alone, 3, sizeof(double), cmp);
    printf("  dma alone                  %6.2f [%6.2f %6.2f] GB/s  (host memory traffic %6.2f GB/s)\n",
           dma_alone[1], dma_alone[0], dma_alone[2], dma_alone[1]);
    for (int k = 0; k < nt; k++) {
        double fa[3], fb[3], db[3], tot[3];
        long idle_both = 0;
        for (int r = 0; r < 3; r++) {
            double d;
            row(ts[k], 0, 1000, &fa[r], &d, &idle);
            row(ts[k], 1, 1000, &fb[r], &db[r], &idle);
            idle_both += idle;
            tot[r] = (demote ? 1 : 2) * fb[r] + db[r];
        }
        qsort(fa, 3, sizeof(double), cmp);
        qsort(fb, 3, sizeof(double), cmp);
        qsort(db, 3, sizeof(double), cmp);
        qsort(tot, 3, sizeof(double), cmp);
        printf("  T=%-2d fill alone           %6.2f [%6.2f %6.2f] GB/s  (traffic %6.2f)\n", ts[k], fa[1], fa[0], fa[2], (demote ? 1 : 2) * fa[1]);
        printf("  T=%-2d both: fill           %6.2f [%6.2f %6.2f], dma %6.2f [%6.2f %6.2f] GB/s  (traffic %6.2f [%6.2f %6.2f]); "
               "fill kept %.2f, dma kept %.2f of alone; engine found idle at %ld issues in the 3 rows\n",
               ts[k], fb[1], fb[0], fb[2], db[1], db[0], db[2], tot[1], tot[0], tot[2], fb[1] / fa[1], db[1] / dma_alone[1],
               idle_both);
    }
    long b = atomic_load(&bad);
    printf("%s\n", b ? "WRONG BYTES" : "every fill pass and every dma row checked: none wrong");
    return b ? 1 : 0;
}
