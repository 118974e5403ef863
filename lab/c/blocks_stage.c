/* blocks_stage.c -- can small KV blocks cross the link at the contiguous copy's rate if the
 * scatter is split: the copy engines gather (or scatter) the device blocks inside device memory,
 * ONE contiguous copy crosses PCIe, and CPU threads scatter (or gather) the host blocks?
 *
 * Build and run on the GPU machine:
 *   nvcc -O2 -o blocks_stage blocks_stage.c -lcuda -lpthread && ./blocks_stage [KiB...]
 *
 * Workload (bench_blocks.py's, smaller): L = 64 tensors of NB blocks of B bytes, each side ONE
 * allocation (tensor t at base + t * NB * B), NB = min(8192, 4 GiB / (L B)); a call moves M =
 * NB / 4 random blocks of every tensor (device ids and host ids: prefixes of two permutations,
 * redrawn per call): 1 GiB a call (512 MiB at 4 KiB, where NB = 8192). Staging (device and pinned host) holds a call's blocks
 * block-major: block k of the call at k * L * B, its tensors' slices one after the other.
 * Rows (env ONLY=name,...; T threads: env T, default 12, the calling thread among them):
 *   d2d-2d[-xS]  the device gather alone: one cuMemcpy2DAsync D2D per block (width B, height L,
 *               source pitch NB * B, destination pitch B) into device staging, over S streams
 *               (1, 2, 4): the copy engines' rate for scattered rows inside device memory
 *   d2d-batch    the same copies as one cuMemcpyBatchAsync of L * M entries (lists built before
 *               the clock)
 *   d2d-contig   one D2D copy of the same bytes (the control)
 *   off-2d       offload as pinstage's "strided": one 2D copy per block, device blocks straight to
 *               the host blocks (the figure to beat)
 *   off-stage[-xS] offload through staging: the device gather (S streams) of each chunk of C
 *               blocks (16 MiB), an event, ONE D2H copy of the chunk on its own stream, then T
 *               threads scatter the chunk's blocks from pinned staging into the host blocks
 *               (non-temporal stores) as each chunk lands; timed until the last block is stored
 *   scatter      the control: the host scatter of the whole staging alone (T threads)
 *   load-2d      load as pinstage's "strided": one 2D copy per block, host blocks to device
 *   load-stage[-xS] load through staging: T threads gather the host blocks into pinned staging
 *               (non-temporal stores) in order; whoever completes a chunk issues its H2D copy
 *               and, on one of S other streams after an event, its 2D device scatter
 *   gather       the control: the host gather of every block alone (T threads)
 *   d2h / h2d    one contiguous copy of the same bytes between device and pinned staging (the link)
 * Host rows: the threads start before the clock, which stops when every thread stored its last
 * block and every stream drained.
 * Every call checked: the destination poisoned (0xEE bytes) before it; after it every byte of
 * every moved block compared with the source, and (host destinations) the moved blocks
 * poisoned again, the whole destination scanned for anything but poison at the end of the row
 * (device destinations: the unmoved blocks' first and last 16 bytes after every call). Median
 * of REPS timed calls after one warm-up, GB/s = the bytes moved / wall. Exit status 1 on a wrong byte.
 */
#include "probe.h"
#include <pthread.h>
#include <stdatomic.h>

#define L 64
static size_t CAP = (size_t)4 << 30; /* per side; env CAP_MIB (a local check on a fake) */
#define REPS 5
#define CHUNK_BYTES ((size_t)16 << 20)

static size_t B, NB, M, C; /* block bytes, blocks per tensor, blocks per call, per chunk */
static size_t nchunks;
static CUcontext ctx;
static CUdeviceptr dsrc, ddst, dstg;   /* device blocks (offload source), load destination, staging */
static unsigned char *hsrc;            /* the pattern every source holds (pageable) */
static unsigned char *hblk, *hstg, *hchk; /* pinned: host blocks, staging, device read-back */
static size_t *did, *hid;
static CUstream xs, gs[4];
static CUevent *evx, *evg;
static batch_fn_t batch_fn;
static int wrong, T = 12;

static uint64_t rng_state = 0x5EED5;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return rng_state;
}
static void draw(void) {
    size_t *p = malloc(NB * sizeof *p);
    for (int side = 0; side < 2; side++) {
        for (size_t i = 0; i < NB; i++) p[i] = i;
        for (size_t i = NB - 1; i > 0; i--) { size_t j = rnd() % (i + 1), t = p[i]; p[i] = p[j]; p[j] = t; }
        memcpy(side ? hid : did, p, M * sizeof *p);
    }
    free(p);
}
static size_t pitch(void) { return NB * B; }
static unsigned char *src_block(size_t t, size_t b) { return hsrc + t * pitch() + b * B; }

static void copy2d(CUmemorytype st, const void *sp, CUdeviceptr sd, size_t spitch,
                   CUmemorytype dt, void *dp, CUdeviceptr dd, size_t dpitch, CUstream s) {
    CUDA_MEMCPY2D c;
    memset(&c, 0, sizeof c);
    c.srcMemoryType = st; c.srcHost = sp; c.srcDevice = sd; c.srcPitch = spitch;
    c.dstMemoryType = dt; c.dstHost = dp; c.dstDevice = dd; c.dstPitch = dpitch;
    c.WidthInBytes = B;
    c.Height = L;
    CHECK(cuMemcpy2DAsync(&c, s));
}
/* Device gather of blocks [a, e) into staging (block-major), spread over `ns` streams. */
static void gather_dev(size_t a, size_t e, int ns) {
    for (size_t k = a; k < e; k++)
        copy2d(CU_MEMORYTYPE_DEVICE, NULL, dsrc + did[k] * B, pitch(),
               CU_MEMORYTYPE_DEVICE, NULL, dstg + k * L * B, B, gs[k % ns]);
}
/* Device scatter of staged blocks [a, e) into ddst. */
static void scatter_dev(size_t a, size_t e, int ns) {
    for (size_t k = a; k < e; k++)
        copy2d(CU_MEMORYTYPE_DEVICE, NULL, dstg + k * L * B, B,
               CU_MEMORYTYPE_DEVICE, NULL, ddst + did[k] * B, pitch(), gs[k % ns]);
}
static void sync_all(void) {
    CHECK(cuStreamSynchronize(xs));
    for (int i = 0; i < 4; i++) CHECK(cuStreamSynchronize(gs[i]));
}

/* ---------------------------------------------------------------- host threads */
typedef struct {
    int load, ns, only; /* only: the host part alone (no copies) */
    atomic_size_t next, ready, issued; /* issued: chunks whose D2H and event are queued */
    atomic_int go, finished, polling; /* started, threads done, one thread polls the events */
    atomic_size_t *left; /* per chunk: blocks not yet gathered (load) */
    pthread_mutex_t issue;
} job_t;
static job_t job;

static void host_block(size_t k) {
    for (size_t t = 0; t < L; t++) {
        unsigned char *h = hblk + t * pitch() + hid[k] * B, *s = hstg + (k * L + t) * B;
        if (job.load) probe_nt_copy(s, h, B);
        else probe_nt_copy(h, s, B);
    }
}
static void *worker(void *arg) {
    CHECK(cuCtxSetCurrent(ctx));
    if (arg) /* a started thread: waits for the clock (thread start-up is not timed) */
        while (!atomic_load(&job.go)) __builtin_ia32_pause();
    for (;;) {
        size_t k = atomic_fetch_add(&job.next, 1);
        if (k >= M) break;
        size_t j = k / C;
        if (!job.load && !job.only) { /* wait until chunk j landed in pinned staging */
            while (atomic_load(&job.ready) <= j) {
                size_t r = atomic_load(&job.ready);
                /* One thread polls the driver (the others would slow the issuing caller); an
                   event not yet recorded for this call would read as complete. */
                int no = 0;
                if (atomic_load(&job.issued) > r && atomic_compare_exchange_strong(&job.polling, &no, 1)) {
                    CUresult q = cuEventQuery(evx[r]);
                    if (q == CUDA_SUCCESS) {
                        size_t want = r;
                        atomic_compare_exchange_strong(&job.ready, &want, r + 1);
                    } else if (q != CUDA_ERROR_NOT_READY) {
                        CHECK(q);
                    }
                    atomic_store(&job.polling, 0);
                }
                for (int i = 0; i < 16; i++) __builtin_ia32_pause();
            }
        }
        host_block(k);
        if (job.load && !job.only && atomic_fetch_sub(&job.left[j], 1) == 1) {
            size_t a = j * C, e = a + C < M ? a + C : M;
            pthread_mutex_lock(&job.issue);
            CHECK(cuMemcpyHtoDAsync(dstg + a * L * B, hstg + a * L * B, (e - a) * L * B, xs));
            CHECK(cuEventRecord(evx[j], xs));
            for (int s = 0; s < job.ns; s++) CHECK(cuStreamWaitEvent(gs[s], evx[j], 0));
            scatter_dev(a, e, job.ns);
            pthread_mutex_unlock(&job.issue);
        }
    }
    atomic_fetch_add(&job.finished, 1);
    return NULL;
}
/* The host rows; returns the ms from the start (threads already started) until the last block
   was stored and every stream drained. */
static double run_host(int load, int ns, int only) {
    job.load = load; job.ns = ns; job.only = only;
    atomic_store(&job.next, 0);
    atomic_store(&job.ready, 0);
    atomic_store(&job.issued, 0);
    for (size_t j = 0; j < nchunks; j++) {
        size_t a = j * C, e = a + C < M ? a + C : M;
        atomic_store(&job.left[j], e - a);
    }
    atomic_store(&job.go, 0);
    atomic_store(&job.finished, 0);
    atomic_store(&job.polling, 0);
    pthread_t th[64];
    for (int i = 1; i < T; i++) pthread_create(&th[i], NULL, worker, &job);
    double t0 = now_ms();
    atomic_store(&job.go, 1);
    if (!load && !only) { /* the caller issues the device side, then scatters with the others */
        for (size_t j = 0; j < nchunks; j++) {
            size_t a = j * C, e = a + C < M ? a + C : M;
            gather_dev(a, e, ns);
            for (int s = 0; s < ns; s++) { CHECK(cuEventRecord(evg[j * 4 + s], gs[s]));
                                           CHECK(cuStreamWaitEvent(xs, evg[j * 4 + s], 0)); }
            CHECK(cuMemcpyDtoHAsync(hstg + a * L * B, dstg + a * L * B, (e - a) * L * B, xs));
            CHECK(cuEventRecord(evx[j], xs));
            atomic_store(&job.issued, j + 1);
        }
    }
    worker(NULL);
    while (atomic_load(&job.finished) < T) __builtin_ia32_pause();
    sync_all();
    double t1 = now_ms();
    for (int i = 1; i < T; i++) pthread_join(th[i], NULL);
    return t1 - t0;
}

/* ---------------------------------------------------------------- rows */
enum { R_D2D, R_D2D2, R_D2D4, R_D2DB, R_D2DC, R_OFF2D, R_OFFS, R_OFFS2, R_OFFS4, R_SCAT, R_LOAD2D,
       R_LOADS, R_LOADS2, R_LOADS4, R_GATH, R_D2H, R_H2D, NR };
static const char *RN[NR] = {"d2d-2d", "d2d-2d-x2", "d2d-2d-x4", "d2d-batch", "d2d-contig",
    "off-2d", "off-stage", "off-stage-x2", "off-stage-x4", "scatter", "load-2d", "load-stage",
    "load-stage-x2", "load-stage-x4", "gather", "d2h", "h2d"};
/* Destination of each row: 0 device staging, 1 host blocks, 2 device blocks, 3 host staging,
   4 nothing checked but the host part (controls: the source of the other side). */
static int dest_of(int r) {
    switch (r) {
    case R_D2D: case R_D2D2: case R_D2D4: case R_D2DB: case R_D2DC: case R_H2D: return 0;
    case R_OFF2D: case R_OFFS: case R_OFFS2: case R_OFFS4: case R_SCAT: return 1;
    case R_LOAD2D: case R_LOADS: case R_LOADS2: case R_LOADS4: return 2;
    default: return 3; /* gather, d2h */
    }
}
static void prepare(int r) {
    int d = dest_of(r);
    if (d == 0) CHECK(cuMemsetD8(dstg, 0xEE, M * L * B));
    if (d == 2) CHECK(cuMemsetD8(ddst, 0xEE, L * NB * B));
    if (d == 3) memset(hstg, 0xEE, M * L * B);
    if (r == R_SCAT) /* the staging holds the call's blocks, as the D2H would leave it */
        for (size_t k = 0; k < M; k++)
            for (size_t t = 0; t < L; t++) memcpy(hstg + (k * L + t) * B, src_block(t, did[k]), B);
    if (r == R_D2H || r == R_H2D) { /* a staged call: device staging or host staging full */
        for (size_t k = 0; k < M; k++)
            for (size_t t = 0; t < L; t++)
                memcpy(hchk + (k * L + t) * B, src_block(t, did[k]), B);
        if (r == R_D2H) CHECK(cuMemcpyHtoD(dstg, hchk, M * L * B));
        else memcpy(hstg, hchk, M * L * B);
    }
    CHECK(cuCtxSynchronize());
}
/* The batch row's address lists, built before the clock (as a caller reusing its lists). */
static CUdeviceptr *bsrc, *bdst;
static size_t *bsz;
static void batch_lists(void) {
    size_t n = L * M;
    bsrc = realloc(bsrc, n * sizeof *bsrc);
    bdst = realloc(bdst, n * sizeof *bdst);
    bsz = realloc(bsz, n * sizeof *bsz);
    for (size_t k = 0, i = 0; k < M; k++)
        for (size_t t = 0; t < L; t++, i++) {
            bsrc[i] = dsrc + t * pitch() + did[k] * B;
            bdst[i] = dstg + (k * L + t) * B;
            bsz[i] = B;
        }
}
/* One timed call of row r: ms from issue to the last byte (host rows: the last block stored). */
static double one(int r) {
    if (r == R_OFFS || r == R_OFFS2 || r == R_OFFS4)
        return run_host(0, r == R_OFFS ? 1 : r == R_OFFS2 ? 2 : 4, 0);
    if (r == R_SCAT) return run_host(0, 1, 1);
    if (r == R_LOADS || r == R_LOADS2 || r == R_LOADS4)
        return run_host(1, r == R_LOADS ? 1 : r == R_LOADS2 ? 2 : 4, 0);
    if (r == R_GATH) return run_host(1, 1, 1);
    double t0 = now_ms();
    switch (r) {
    case R_D2D: case R_D2D2: case R_D2D4:
        gather_dev(0, M, r == R_D2D ? 1 : r == R_D2D2 ? 2 : 4); break;
    case R_D2DB: {
        size_t n = L * M;
        CUmemcpyAttributes a;
        memset(&a, 0, sizeof a);
        a.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        size_t idx = 0, fail = 0;
        for (size_t o = 0; o < n; o += 65536) /* pinstage's MAX_BATCH */
            CHECK(batch_fn(bdst + o, bsrc + o, bsz + o, n - o < 65536 ? n - o : 65536, &a, &idx, 1,
                           &fail, gs[0]));
        break;
    }
    case R_D2DC: CHECK(cuMemcpyDtoDAsync(dstg, dsrc, M * L * B, gs[0])); break;
    case R_OFF2D:
        for (size_t k = 0; k < M; k++)
            copy2d(CU_MEMORYTYPE_DEVICE, NULL, dsrc + did[k] * B, pitch(),
                   CU_MEMORYTYPE_HOST, hblk + hid[k] * B, 0, pitch(), xs);
        break;
    case R_LOAD2D:
        for (size_t k = 0; k < M; k++)
            copy2d(CU_MEMORYTYPE_HOST, hblk + hid[k] * B, 0, pitch(),
                   CU_MEMORYTYPE_DEVICE, NULL, ddst + did[k] * B, pitch(), xs);
        break;
    case R_D2H: CHECK(cuMemcpyDtoHAsync(hstg, dstg, M * L * B, xs)); break;
    case R_H2D: CHECK(cuMemcpyHtoDAsync(dstg, hstg, M * L * B, xs)); break;
    }
    sync_all();
    return now_ms() - t0;
}
static int all_poison(const unsigned char *p, size_t n) { /* n a multiple of 8, p aligned */
    const uint64_t *w = (const uint64_t *)p, *e = w + n / 8;
    uint64_t acc = 0;
    for (; w < e; w++) acc |= *w ^ 0xEEEEEEEEEEEEEEEEULL;
    return acc == 0;
}
static void bad(int r, const char *what, size_t k, size_t t) {
    if (wrong++ < 10) printf("  WRONG %s: %s, block %zu tensor %zu\n", RN[r], what, k, t);
}
static void check(int r) {
    int d = dest_of(r);
    if (d == 0 || d == 3) { /* staging: block-major, the call's device blocks (d2d, h2d, d2h)
                              or its host blocks (gather); the load source is hsrc too */
        if (d == 0) CHECK(cuMemcpyDtoH(hchk, dstg, M * L * B));
        const unsigned char *g = d == 0 ? hchk : hstg;
        if (r == R_D2DC) { /* the contiguous control copies the source's first bytes */
            if (memcmp(g, hsrc, M * L * B)) bad(r, "contiguous copy differs", 0, 0);
            return;
        }
        for (size_t k = 0; k < M; k++)
            for (size_t t = 0; t < L; t++)
                if (memcmp(g + (k * L + t) * B, src_block(t, r == R_GATH ? hid[k] : did[k]), B))
                    bad(r, "staged block differs", k, t);
    } else if (d == 1) {
        for (size_t k = 0; k < M; k++)
            for (size_t t = 0; t < L; t++) {
                unsigned char *h = hblk + t * pitch() + hid[k] * B;
                if (memcmp(h, src_block(t, did[k]), B)) bad(r, "host block differs", k, t);
                memset(h, 0xEE, B);
            }
    } else {
        CHECK(cuMemcpyDtoH(hchk, ddst, L * NB * B));
        char *moved = calloc(NB, 1);
        for (size_t k = 0; k < M; k++) moved[did[k]] = 1;
        for (size_t k = 0; k < M; k++)
            for (size_t t = 0; t < L; t++)
                if (memcmp(hchk + t * pitch() + did[k] * B, src_block(t, hid[k]), B))
                    bad(r, "device block differs", k, t);
        for (size_t b = 0; b < NB; b++)
            if (!moved[b])
                for (size_t t = 0; t < L; t++) {
                    const unsigned char *p = hchk + t * pitch() + b * B;
                    if (!all_poison(p, 16) || !all_poison(p + B - 16, 16)) bad(r, "unmoved block written", b, t);
                }
        free(moved);
    }
}
static int cmp(const void *a, const void *b) { return probe_cmp_double(a, b); }

static void row(int r) {
    double ms[REPS];
    /* Host blocks: the offload's destination (all poison) or the load's source (the pattern). */
    int off = dest_of(r) == 1, loadsrc = r == R_LOAD2D || r == R_LOADS || r == R_LOADS2 ||
                                         r == R_LOADS4 || r == R_GATH;
    if (off) memset(hblk, 0xEE, L * NB * B);
    if (loadsrc) memcpy(hblk, hsrc, L * NB * B);
    for (int i = -1; i < REPS; i++) {
        draw();
        prepare(r);
        if (r == R_D2DB) batch_lists();
        double t = one(r);
        check(r);
        if (i >= 0) ms[i] = t;
    }
    if (off && !all_poison(hblk, L * NB * B)) bad(r, "host blocks written beyond the moved ones", 0, 0);
    qsort(ms, REPS, sizeof *ms, cmp);
    double gb = (double)(M * L * B) / 1e9;
    printf("  %-14s %7.2f GB/s  (%.2f-%.2f)\n", RN[r], gb / ms[REPS / 2] * 1e3, gb / ms[REPS - 1] * 1e3,
           gb / ms[0] * 1e3);
    fflush(stdout);
}

int main(int argc, char **argv) {
    ctx = probe_init();
    batch_fn = probe_batch_fn();
    if (getenv("T")) T = atoi(getenv("T"));
    if (getenv("CAP_MIB")) CAP = (size_t)atoi(getenv("CAP_MIB")) << 20;
    if (T < 1 || T > 64) T = 12;
    const char *only = getenv("ONLY");
    int kib[8] = {4, 16, 64}, nk = 3;
    if (argc > 1) { nk = 0; for (int i = 1; i < argc && nk < 8; i++) kib[nk++] = atoi(argv[i]); }
    CHECK(cuStreamCreate(&xs, CU_STREAM_NON_BLOCKING));
    for (int i = 0; i < 4; i++) CHECK(cuStreamCreate(&gs[i], CU_STREAM_NON_BLOCKING));
    CHECK(cuMemAlloc(&dsrc, CAP));
    CHECK(cuMemAlloc(&ddst, CAP));
    CHECK(cuMemAlloc(&dstg, CAP / 4));
    hsrc = malloc(CAP);
    CHECK(cuMemHostAlloc((void **)&hblk, CAP, 0));
    CHECK(cuMemHostAlloc((void **)&hstg, CAP / 4, 0));
    CHECK(cuMemHostAlloc((void **)&hchk, CAP, 0));
    did = malloc(8192 * sizeof *did);
    hid = malloc(8192 * sizeof *hid);
    pthread_mutex_init(&job.issue, NULL);
    printf("blocks_stage: L = %d tensors, %zu MiB a side, T = %d host threads\n", L, CAP >> 20, T);
    for (int ki = 0; ki < nk; ki++) {
        B = (size_t)kib[ki] << 10;
        if (B < 4096 || B % 4096) { printf("skip %d KiB (multiples of 4 KiB)\n", kib[ki]); continue; }
        NB = CAP / (L * B) < 8192 ? CAP / (L * B) : 8192;
        M = NB / 4;
        C = CHUNK_BYTES / (L * B) ? CHUNK_BYTES / (L * B) : 1;
        nchunks = (M + C - 1) / C;
        evx = realloc(evx, nchunks * sizeof *evx);
        evg = realloc(evg, nchunks * 4 * sizeof *evg);
        for (size_t j = 0; j < nchunks; j++) {
            CHECK(cuEventCreate(&evx[j], CU_EVENT_DISABLE_TIMING));
            for (int s = 0; s < 4; s++) CHECK(cuEventCreate(&evg[j * 4 + s], CU_EVENT_DISABLE_TIMING));
        }
        job.left = realloc(job.left, nchunks * sizeof *job.left);
        /* The pattern: every 8-byte word unique to (size, tensor, block, word), never 0xEE.. */
        for (size_t i = 0; i < L * NB * B / 8; i++) {
            uint64_t x = (i + 1 + ((uint64_t)B << 40)) * 0x9E3779B97F4A7C15ULL;
            x ^= x >> 29;
            ((uint64_t *)hsrc)[i] = (x & 0xFF) == 0xEE ? x ^ 1 : x;
        }
        CHECK(cuMemcpyHtoD(dsrc, hsrc, L * NB * B));
        printf("== %zu KiB blocks: %zu per tensor, %zu moved, chunks of %zu blocks (%zu MiB)\n",
               B >> 10, NB, M, C, (C * L * B) >> 20);
        for (int r = 0; r < NR; r++) {
            if (only) {
                char key[32];
                snprintf(key, sizeof key, ",%s,", RN[r]);
                char list[512];
                snprintf(list, sizeof list, ",%s,", only);
                if (!strstr(list, key)) continue;
            }
            row(r);
        }
        for (size_t j = 0; j < nchunks; j++) {
            CHECK(cuEventDestroy(evx[j]));
            for (int s = 0; s < 4; s++) CHECK(cuEventDestroy(evg[j * 4 + s]));
        }
    }
    printf("checks: %s\n", wrong ? "WRONG BYTES" : "every byte of every moved block right");
    return wrong ? 1 : 0;
}
