/* host_pair.c -- does the host's memory hold a staged offload and a staged load at once?
 * engines_pair.c asks the copy engines (the crossings with and without the device's 2D copies,
 * no host threads); this asks the host side: the same crossings with the staged moves' HOST
 * halves (threads scatter a landed chunk from a pinned staging ring into the host blocks by
 * non-temporal stores; threads gather the host blocks into a staging ring by plain stores, then
 * the chunk crosses), and no device copies at all. A staged byte crosses host memory two or
 * three times (the DMA, the thread's read, its write); if the host halves alone carry both
 * directions but with the crossings the pair falls to about one direction's rate, the host's
 * memory bandwidth is the floor of a staged pair.
 *
 *   nvcc -O2 -o host_pair host_pair.c -lcuda -lpthread && ./host_pair [KiB ...]   (default 16 64)
 *   env T: copy threads of a direction alone (default 12, pinstage's); TP: threads started for
 *   each direction of a pair (default 6: pinstage's twelve for two moves), which take the other
 *   direction's open tasks when their own has none (pinstage's threads are one pool)
 *
 * Workload (engines_pair's): L = 64 tensors of NB blocks of B bytes in one pinned host allocation
 * per direction (tensor t at t NB B, 2 GiB), NCH = 32 chunks of 16 MiB each way (512 MiB), a
 * chunk holds C = 16 MiB / (L B) blocks, random distinct block ids per run; staging: a pinned ring
 * of 4 chunk slots per direction, block k of a chunk at k L B, its tensors' rows one after the
 * other; device side: 512 MiB per direction, chunk j at j CH (no device ring, no device copies).
 * The pipeline is pinstage's: offload: chunk j's D2H into slot j % 4 once chunk j - 4's rows are
 * scattered, chunk j's rows open to the threads once its D2H completed; load: chunk j opens once
 * the H2D of chunk j - 4 (the slot's last reader) completed, its H2D is issued once its rows are
 * gathered. One issuing thread (for both directions) polls the events and, as pinstage's, takes a
 * task between polls when one is open; the copy threads spin between chunks (the best case: no
 * wake-ups).
 * Rows (GB/s of the bytes moved, both ways for a pair / wall from the go to every row stored and
 * every stream drained; median of REPS runs after a warm-up, min-max; x = against the faster
 * direction alone of the same kind):
 *   d2h, h2d, pair           the crossings alone, no threads (contiguous, 512 MiB pinned areas)
 *   scatter, gather, h-pair  the host halves alone, no crossings (chunk j opens once chunk j - 4
 *                            finished); the scatter reads the ring, the gather writes each chunk
 *                            in a place of its own (512 MiB: every row checked; its stores reach
 *                            memory, where the staged load's ring may stay in the cache)
 *   off, load, pair-stage    the staged pipelines: crossings and host halves
 * Checked every run, destinations poisoned (0xEE) before it: every row of every moved block (the
 * offload's host blocks against the device pattern; the load's device area read back whole and
 * compared with the host blocks; the crossings, every byte; the host halves alone, every row).
 * Exit status 1 on a wrong byte.
 */
#include "probe.h"
#include <pthread.h>
#include <stdatomic.h>

#define L 64
#define NCH 32
#define SLOTS 4
#define REPS 5
#define CH ((size_t)16 << 20)
#define TASK ((size_t)128 << 10)
#define MAXT 32

static size_t B, C, NB, POOL, RPT, TPC; /* rows a task, tasks a chunk */

static unsigned char mix(size_t x) { return (unsigned char)((x * 0x9E3779B97F4A7C15ull) >> 56); }
static unsigned char dev_pat(size_t off) { return mix(off + 1); }
static unsigned char host_pat(size_t off) { return mix(off + ((size_t)2 << 40)); }

/* One direction: its host blocks, staging ring, device area, stream, events and tasks. */
struct dir {
    int off, dma, host;             /* offload or load; with the crossings; with the host halves */
    unsigned char *blocks, *ring;   /* pinned: the host blocks (POOL), staging (SLOTS CH) */
    unsigned char *area;            /* pinned: the crossings alone's host side (NCH CH) */
    CUdeviceptr dev;                /* NCH CH */
    CUstream s;
    CUevent ev[NCH];
    size_t ids[NCH * 64];
    _Alignas(64) atomic_size_t next; /* every claim writes it: a line of its own */
    _Alignas(64) atomic_size_t open;
    _Alignas(64) atomic_size_t left[NCH];
    _Alignas(64) atomic_int go, quit;
    struct dir *peer;               /* in a pair: the other direction, whose tasks idle threads take */
    int threads;
    pthread_t th[MAXT];
};

static struct dir O, D; /* the offload, the load */
static unsigned char *hchk, *hpoison, *devp; /* read-back, poison, the device pattern */
static int wrong;

static void draw(size_t *ids, unsigned seed) {
    static size_t perm[1 << 16];
    for (size_t i = 0; i < NB; i++) perm[i] = i;
    srand(seed);
    for (size_t i = 0; i < NCH * C; i++) {
        size_t k = i + (size_t)rand() % (NB - i), t = perm[i];
        perm[i] = perm[k], perm[k] = t, ids[i] = perm[i];
    }
}

/* Row r of chunk j: its host block row and its staged row (slot j % SLOTS). */
static unsigned char *host_row(struct dir *d, size_t j, size_t r) {
    return d->blocks + (r % L) * NB * B + d->ids[j * C + r / L] * B;
}
static unsigned char *staged_row(struct dir *d, size_t j, size_t r) {
    /* The gather alone writes every chunk in a place of its own, so that every row is checked. */
    if (!d->off && !d->dma) return d->area + j * CH + r * B;
    return d->ring + (j % SLOTS) * CH + r * B;
}

static void task(struct dir *d, size_t t) {
    size_t j = t / TPC, r0 = (t % TPC) * RPT, r1 = r0 + RPT;
    if (r1 > C * L) r1 = C * L;
    for (size_t r = r0; r < r1; r++) {
        if (d->off) probe_nt_copy(host_row(d, j, r), staged_row(d, j, r), B);
        else memcpy(staged_row(d, j, r), host_row(d, j, r), B);
    }
    atomic_fetch_sub_explicit(&d->left[j], 1, memory_order_release);
}

/* Takes and does one open task of `d`; 0 if none is open. */
static int try_task(struct dir *d) {
    size_t t = atomic_load(&d->next);
    while (t < NCH * TPC && t / TPC < atomic_load_explicit(&d->open, memory_order_acquire))
        if (atomic_compare_exchange_weak(&d->next, &t, t + 1)) {
            task(d, t);
            return 1;
        }
    return 0;
}

static int over(struct dir *d) { return !d || atomic_load(&d->next) >= NCH * TPC; }

/* A copy thread of `d`: its direction's open tasks first, then (in a pair) the other's, as
 * pinstage's copy threads, one pool for both moves, take whatever chunk is open. */
static void *worker(void *arg) {
    struct dir *d = arg;
    for (;;) {
        while (!atomic_load(&d->go)) {
            if (atomic_load(&d->quit)) return NULL;
            __builtin_ia32_pause();
        }
        if (try_task(d) || (d->peer && try_task(d->peer))) continue;
        if (over(d) && over(d->peer))
            while (atomic_load(&d->go)) __builtin_ia32_pause(); /* the run's end */
        else
            __builtin_ia32_pause();
    }
}

static int ev_done(CUevent e) {
    CUresult r = cuEventQuery(e);
    if (r == CUDA_ERROR_NOT_READY) return 0;
    CHECK(r);
    return 1;
}

/* One step of a direction's issuing loop; returns 1 once its move is complete (rows stored,
 * stream drained). `st` holds opened, finished, issued. */
static int step(struct dir *d, size_t *st) {
    size_t *opened = &st[0], *finished = &st[1], *issued = &st[2];
    if (!d->host) { /* the crossings alone: everything at once */
        if (*issued == 0) {
            for (size_t j = 0; j < NCH; j++) {
                if (d->off) CHECK(cuMemcpyDtoHAsync(d->area + j * CH, d->dev + j * CH, CH, d->s));
                else CHECK(cuMemcpyHtoDAsync(d->dev + j * CH, d->area + j * CH, CH, d->s));
            }
            CHECK(cuEventRecord(d->ev[NCH - 1], d->s));
            *issued = NCH;
        }
        return ev_done(d->ev[NCH - 1]);
    }
    if (!d->dma) { /* the host halves alone: chunk j opens once chunk j - 4 left its slot */
        if (*opened < NCH && (*opened < SLOTS || *finished > *opened - SLOTS)) atomic_store(&d->open, ++*opened);
        while (*finished < NCH && atomic_load_explicit(&d->left[*finished], memory_order_acquire) == 0)
            ++*finished;
        return *finished == NCH;
    }
    if (d->off) {
        while (*issued < NCH && *issued < *finished + SLOTS) {
            size_t j = (*issued)++;
            CHECK(cuMemcpyDtoHAsync(d->ring + (j % SLOTS) * CH, d->dev + j * CH, CH, d->s));
            CHECK(cuEventRecord(d->ev[j], d->s));
        }
        if (*opened < *issued && ev_done(d->ev[*opened])) atomic_store(&d->open, ++*opened);
        while (*finished < *opened && atomic_load_explicit(&d->left[*finished], memory_order_acquire) == 0)
            ++*finished;
        return *finished == NCH;
    }
    while (*issued < *finished) {
        size_t j = (*issued)++;
        CHECK(cuMemcpyHtoDAsync(d->dev + j * CH, d->ring + (j % SLOTS) * CH, CH, d->s));
        CHECK(cuEventRecord(d->ev[j], d->s));
    }
    if (*opened < NCH && (*opened < SLOTS || (*issued > *opened - SLOTS && ev_done(d->ev[*opened - SLOTS]))))
        atomic_store(&d->open, ++*opened);
    while (*finished < *opened && atomic_load_explicit(&d->left[*finished], memory_order_acquire) == 0)
        ++*finished;
    return *issued == NCH && ev_done(d->ev[NCH - 1]);
}

static void prepare(struct dir *d, int on, int dma, int host, int threads, unsigned seed) {
    d->dma = dma, d->host = host;
    if (!on) return;
    draw(d->ids, seed);
    atomic_store(&d->next, 0), atomic_store(&d->open, 0);
    for (size_t j = 0; j < NCH; j++) atomic_store(&d->left[j], TPC);
    /* Destinations poisoned. */
    if (d->off) {
        if (!host) memset(d->area, 0xEE, NCH * CH);
        else for (size_t j = 0; j < NCH; j++)
            for (size_t r = 0; r < C * L; r++) memset(host_row(d, j, r), 0xEE, B);
        if (host && !dma) /* the scatter alone: the staging ring holds what a crossing would land */
            memcpy(d->ring, devp, SLOTS * CH);
    } else {
        if (dma) for (size_t o = 0; o < NCH * CH; o += CH) CHECK(cuMemcpyHtoDAsync(d->dev + o, hpoison, CH, d->s));
        if (!dma) memset(d->area, 0xEE, NCH * CH);
        CHECK(cuStreamSynchronize(d->s));
    }
    d->threads = host ? threads : 0;
    for (int i = 0; i < d->threads; i++) CHECK(pthread_create(&d->th[i], NULL, worker, d) ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS);
}

static void finish(struct dir *d, int on) {
    if (!on) return;
    atomic_store(&d->quit, 1), atomic_store(&d->go, 0);
    for (int i = 0; i < d->threads; i++) pthread_join(d->th[i], NULL);
    atomic_store(&d->quit, 0);
    /* The checks: every row (or byte) of what moved. */
    int w = 0;
    if (d->off) {
        for (size_t j = 0; j < NCH && !w; j++)
            for (size_t r = 0; r < C * L && !w; r++) {
                const unsigned char *got = d->host ? host_row(d, j, r) : d->area + j * CH + r * B;
                /* With the crossings, chunk j came from device chunk j; the scatter alone from slot j % 4. */
                size_t base = (d->dma || !d->host ? j * CH : (j % SLOTS) * CH) + r * B;
                if (memcmp(got, devp + base, B) != 0) w = 1;
            }
    } else if (d->dma) {
        CHECK(cuMemcpyDtoH(hchk, d->dev, NCH * CH));
        for (size_t j = 0; j < NCH && !w; j++)
            for (size_t r = 0; r < C * L && !w; r++) {
                const unsigned char *want = d->host ? host_row(d, j, r) : d->area + j * CH + r * B;
                if (memcmp(hchk + j * CH + r * B, want, B) != 0) w = 1;
            }
    } else { /* the gather alone */
        for (size_t j = 0; j < NCH && !w; j++)
            for (size_t r = 0; r < C * L && !w; r++)
                if (memcmp(staged_row(d, j, r), host_row(d, j, r), B) != 0) w = 1;
    }
    wrong += w;
}

/* One run of the offload and/or the load; returns ms of wall. */
static double run(int off, int load, int dma, int host, unsigned seed) {
    int t = off && load ? (getenv("TP") ? atoi(getenv("TP")) : 6) : (getenv("T") ? atoi(getenv("T")) : 12);
    if (t < 1 || t > MAXT) { fprintf(stderr, "T, TP: 1-%d\n", MAXT); exit(2); }
    O.peer = off && load ? &D : NULL, D.peer = off && load ? &O : NULL;
    prepare(&O, off, dma, host, t, seed);
    prepare(&D, load, dma, host, t, seed + 7919);
    CHECK(cuCtxSynchronize());
    size_t so[3] = {0, 0, 0}, sl[3] = {0, 0, 0};
    double t0 = now_ms();
    atomic_store(&O.go, off), atomic_store(&D.go, load);
    int od = !off, ld = !load;
    while (!od || !ld) {
        if (!od) od = step(&O, so);
        if (!ld) ld = step(&D, sl);
        /* As pinstage's issuing thread, a task when there is one (one at a time: the events
         * are polled between). */
        if (host && !(off && try_task(&O)) && load) try_task(&D);
    }
    CHECK(cuCtxSynchronize());
    double ms = now_ms() - t0;
    finish(&O, off), finish(&D, load);
    return ms;
}

static double row(const char *name, int off, int load, int dma, int host, double alone) {
    double t[REPS];
    int w0 = wrong;
    run(off, load, dma, host, 1);
    for (int r = 0; r < REPS; r++)
        t[r] = (double)(off + load) * NCH * CH / (run(off, load, dma, host, 100 + r) * 1e6);
    return probe_row(name, t, REPS, alone, wrong > w0);
}

static void setup(struct dir *d, int off) {
    d->off = off;
    CHECK(cuStreamCreate(&d->s, CU_STREAM_NON_BLOCKING));
    for (int j = 0; j < NCH; j++) CHECK(cuEventCreate(&d->ev[j], CU_EVENT_DISABLE_TIMING));
    CHECK(cuMemHostAlloc((void **)&d->blocks, POOL, 0));
    CHECK(cuMemHostAlloc((void **)&d->ring, SLOTS * CH, 0));
    CHECK(cuMemHostAlloc((void **)&d->area, NCH * CH, 0));
    CHECK(cuMemAlloc(&d->dev, NCH * CH));
}

int main(int argc, char **argv) {
    probe_init();
    POOL = (size_t)2 << 30;
    if (getenv("POOL_MIB")) POOL = (size_t)atoi(getenv("POOL_MIB")) << 20; /* a local check on a fake */
    setup(&O, 1), setup(&D, 0);
    CHECK(cuMemHostAlloc((void **)&hchk, NCH * CH, 0));
    CHECK(cuMemHostAlloc((void **)&hpoison, CH, 0));
    memset(hpoison, 0xEE, CH);
    /* The offload's device area and the crossings' areas: patterns written once. */
    if (!(devp = malloc(NCH * CH))) return 2;
    for (size_t i = 0; i < NCH * CH; i++) devp[i] = dev_pat(i);
    CHECK(cuMemcpyHtoDAsync(O.dev, devp, NCH * CH, O.s));
    CHECK(cuStreamSynchronize(O.s));
    for (size_t i = 0; i < NCH * CH; i++) D.area[i] = host_pat(i + ((size_t)1 << 36));
    for (size_t i = 0; i < POOL; i++) D.blocks[i] = host_pat(i);
    int n = argc > 1 ? argc - 1 : 2;
    for (int a = 0; a < n; a++) {
        B = (size_t)(argc > 1 ? atoi(argv[a + 1]) : (a ? 64 : 16)) << 10;
        C = CH / (L * B), NB = POOL / (L * B);
        if ((B & (B - 1)) || C < 1 || C > 64 || NB < NCH * C || NB > (1 << 16)) {
            fprintf(stderr, "block KiB: a power of two, 4-256\n");
            return 2;
        }
        RPT = TASK / B ? TASK / B : 1, TPC = (C * L + RPT - 1) / RPT;
        printf("== %zu KiB blocks: %d tensors x %zu blocks, %zu blocks a chunk, %d chunks each way (%zu MiB); "
               "threads alone %s, each in a pair %s\n", B >> 10, L, NB, C, NCH, NCH * CH >> 20,
               getenv("T") ? getenv("T") : "12", getenv("TP") ? getenv("TP") : "6");
        double d = row("d2h", 1, 0, 1, 0, 0), h = row("h2d", 0, 1, 1, 0, 0);
        row("pair", 1, 1, 1, 0, d > h ? d : h);
        double s = row("scatter", 1, 0, 0, 1, 0), g = row("gather", 0, 1, 0, 1, 0);
        row("h-pair", 1, 1, 0, 1, s > g ? s : g);
        double o = row("off", 1, 0, 1, 1, 0), l = row("load", 0, 1, 1, 1, 0);
        row("pair-stage", 1, 1, 1, 1, o > l ? o : l);
    }
    printf("checks: %s\n", wrong ? "WRONG BYTES" : "all passed");
    return wrong ? 1 : 0;
}
