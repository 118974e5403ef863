/* blocks2d.c -- can 2D copies (one per block, across tensors at a regular address stride) or
 * split batch entries beat one cuMemcpyBatchAsync of every (tensor, block) pair?
 *
 * Build and run on the GPU machine:  nvcc -O2 -o blocks2d blocks2d.c -lcuda && ./blocks2d [KiB...]
 *
 * Workload as lab/c/blocks.c: L = 64 tensors of NB blocks of B bytes (NB = min(8192, 8 GiB /
 * (L B))), M = NB/4 random blocks per call (device ids and host ids: prefixes of two fixed-seed
 * permutations, redrawn per call). Here the L tensors of each side are slices of ONE allocation,
 * tensor t at base + t * NB * B (how a pool-allocated KV cache sits), so block b of every tensor
 * is one 2D copy of height L and pitch NB * B.
 *   batch      one cuMemcpyBatchAsync (order STREAM) of the L * M (tensor, block) copies
 *   split4k    the same with each copy cut into 4 KiB pieces (B > 4 KiB)
 *   2d         one cuMemcpy2DAsync per block: width B, height L, both pitches NB * B
 *   2d-x2      the 2D copies alternating over two streams (two engines?)
 *   contig     one copy of the same L * M * B bytes (the link's rate)
 *   contig-b   the control for block-sized copies: the same contiguous bytes as one batch of
 *              L * M copies of B bytes at consecutive addresses (nothing scattered: if this
 *              stops where the scattered strategies stop, the copy size sets the rate)
 *   batch-t2/t4  the batch's copies split in 2 / 4 shares, each issued by its own thread on its
 *              own stream (is the batch bound by the issuing thread?)
 *   2d-t2/t4   the 2D copies split the same way
 *   batch-held the batch issued onto a stream a host function holds for 1.5 s: the issue time is
 *              the driver's own cost per copy while nothing runs (the control: if it is far below
 *              the batch's wall time, the copy engines, not the issuing thread, set the rate)
 *   2d-seq     the 2d strategy over blocks 0..M-1 on both sides (the control for scatter: each
 *              2D copy the same shape, the blocks in address order)
 *   2d-wide    those M blocks as ONE 2D copy of width M * B per side (the control for the count
 *              of 2D copies: if 2d-seq stops below it, the per-copy cost sets the rate, not the
 *              2D shape)
 *   2d-dseq    the 2d strategy with the device blocks 0..M-1 in order, the host blocks random
 *   2d-hseq    the host blocks 0..M-1 in order, the device blocks random (which side's scatter
 *              costs?)
 *   2d-sorted  the random pairs issued in device address order (can the caller's order help?)
 *   2d-hsorted the random pairs issued in host address order (run 2026-12-03 y: H2D 64 KiB lost
 *              its 9% to the host side's scatter, 2d-hseq 51.3 against 2d-dseq 46.8 GB/s; does
 *              ascending host order with gaps recover it, or only adjacent host blocks?)
 *   2d-hgather (H2D only) a host-side gather: GATHER_T threads (default 8, the caller among them)
 *              copy the moved host blocks of GATHER_C blocks at a time (default: 16 MiB per chunk)
 *              into a ring of 8 chunks of pinned staging, tensor-major ([L][C] blocks), and each
 *              gathered chunk goes as one 2D copy per block from staging (pitch C * B) to the
 *              scattered device blocks while the next chunk is gathered (2d-hseq showed H2D 64
 *              KiB at 51.5 GB/s with the host side in order against 46.8 scattered: does a gather
 *              by the CPU buy that back, or does it cost the memory bandwidth the DMA needs?)
 *   gather     the control for 2d-hgather: the same gather into the staging ring, no copy (the
 *              CPU's gather rate alone; checked on the staging's last chunk)
 *   2d-hgpipe  (H2D only) 2d-hgather as a pipeline without rounds (pinstage's pageable path's
 *              shape): PIPE_T threads (default 12, the caller among them; the others woken per
 *              call) claim blocks in order; each gathers its block's L slices into the staging
 *              ring block-major (L * B contiguous bytes, non-temporal stores), and the thread
 *              that completes a chunk issues the chunk's 2D copies (source pitch B: the host side
 *              in order) and records the ring slot's event; a slot is refilled once its event
 *              completed. (Run 2026-12-05-h200-b: 2d-hgather ran at the serial rate of gather
 *              and DMA; does a pipeline without barriers, with more threads and non-temporal
 *              stores, overlap them?)
 *   gpipe      the control for 2d-hgpipe: its gather alone, the same threads, stores and layout,
 *              no copy (checked on the staging's last chunk)
 * ONLY=name,name...: run only these strategies. HOST_MEM=alloc|reg4k|reghuge: how the host
 * blocks are allocated (below, where they are).
 * Every timed call is checked: the destination poisoned (0xEE) before it; after it, the first
 * and last 8 bytes of every moved (tensor, block) and one unmoved block per tensor compared with
 * the source pattern (which changes per call). Median of 5 timed calls (1 warm-up), GB/s from
 * host wall time of issue + cuStreamSynchronize, and the host time of the issue alone.
 * Exit status 1 on any wrong byte or CUDA error.
 */
#include "probe.h"  /* the driver API, CHECK, now_ms, probe_nt_copy */
#include <pthread.h>
#include <sys/mman.h>

#define L 64
#define CAP ((size_t)8 << 30)
#define REPS 5

static batch_fn_t batch_fn;  /* probe.h's type */
static int wrong;

static uint64_t rng_state = 0x5EED2D;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return rng_state;
}
static void perm(size_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = i;
    for (size_t i = n - 1; i > 0; i--) { size_t j = rnd() % (i + 1); size_t t = p[i]; p[i] = p[j]; p[j] = t; }
}
static uint64_t pat(uint64_t salt, size_t t, size_t b, size_t w) {
    uint64_t x = (salt << 48) ^ ((uint64_t)t << 40) ^ ((uint64_t)b << 16) ^ w;
    x *= 0x9E3779B97F4A7C15ULL;
    x ^= x >> 29;
    return (x & 0xFF) == 0xEE ? x ^ 1 : x;
}

enum { S_BATCH, S_SPLIT, S_2D, S_2DX2, S_CONTIG, S_BT2, S_BT4, S_2DT2, S_2DT4, S_HELD, S_CHUNKS,
       S_2DSEQ, S_2DWIDE, S_2DDSEQ, S_2DHSEQ, S_2DSORT, S_2DHSORT, S_HGATHER, S_GATHER, S_HGPIPE, S_GPIPE, NS };
static const char *SNAME[NS] = {"batch", "split4k", "2d", "2d-x2", "contig",
                                "batch-t2", "batch-t4", "2d-t2", "2d-t4", "batch-held", "contig-b",
                                "2d-seq", "2d-wide", "2d-dseq", "2d-hseq", "2d-sorted", "2d-hsorted",
                                "2d-hgather", "gather", "2d-hgpipe", "gpipe"};
static CUcontext g_ctx;
static CUstream g_st[4];

static void CUDA_CB holder(void *arg) {
    (void)arg;
    double t0 = now_ms();
    while (now_ms() - t0 < 1500) usleep(200);
}

static CUdeviceptr *cd, *cs;
static size_t *cz;

/* One cuMemcpyBatchAsync (source order STREAM) of entries [base, base + n) of the lists. */
static void batch_list(size_t base, size_t n, CUstream st) {
    CUmemcpyAttributes a;
    memset(&a, 0, sizeof a);
    a.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    size_t idx = 0, fail = 0;
    CHECK(batch_fn(cd + base, cs + base, cz + base, n, &a, &idx, 1, &fail, st));
}

/* One block of every tensor as one 2D copy: width B, height L, both pitches `pitch`. */
static void copy_2d(int dir, CUdeviceptr d, char *h, size_t pitch, size_t B, CUstream st) {
    CUDA_MEMCPY2D c;
    memset(&c, 0, sizeof c);
    if (dir == 0) {
        c.srcMemoryType = CU_MEMORYTYPE_HOST; c.srcHost = h; c.srcPitch = pitch;
        c.dstMemoryType = CU_MEMORYTYPE_DEVICE; c.dstDevice = d; c.dstPitch = pitch;
    } else {
        c.srcMemoryType = CU_MEMORYTYPE_DEVICE; c.srcDevice = d; c.srcPitch = pitch;
        c.dstMemoryType = CU_MEMORYTYPE_HOST; c.dstHost = h; c.dstPitch = pitch;
    }
    c.WidthInBytes = B;
    c.Height = L;
    CHECK(cuMemcpy2DAsync(&c, st));
}

/* dir 0: H2D (host -> device), 1: D2H. */
static void issue(int s, int dir, CUdeviceptr dev, char *host, size_t NB, size_t B, size_t M,
                  size_t *did, size_t *hid, CUstream st, CUstream st2, CUdeviceptr gdev,
                  char *stage) {
    size_t pitch = NB * B;
    if (s == S_CONTIG) {
        if (dir == 0) CHECK(cuMemcpyHtoDAsync(gdev, stage, L * M * B, st));
        else CHECK(cuMemcpyDtoHAsync(stage, gdev, L * M * B, st));
        return;
    }
    if (s == S_CHUNKS) {
        size_t n = L * M;
        for (size_t i = 0; i < n; i++) {
            CUdeviceptr d = gdev + i * B, h = (CUdeviceptr)(stage + i * B);
            cd[i] = dir == 0 ? d : h;
            cs[i] = dir == 0 ? h : d;
            cz[i] = B;
        }
        batch_list(0, n, st);
        return;
    }
    if (s == S_BATCH || s == S_SPLIT) {
        size_t piece = (s == S_SPLIT && B > 4096) ? 4096 : B, n = 0;
        for (size_t t = 0; t < L; t++)
            for (size_t i = 0; i < M; i++)
                for (size_t o = 0; o < B; o += piece) {
                    CUdeviceptr d = dev + t * pitch + did[i] * B + o;
                    CUdeviceptr h = (CUdeviceptr)(host + t * pitch + hid[i] * B + o);
                    cd[n] = dir == 0 ? d : h;
                    cs[n] = dir == 0 ? h : d;
                    cz[n] = piece;
                    n++;
                }
        batch_list(0, n, st);
        return;
    }
    if (s == S_2DWIDE) {  /* ids 0..M-1 on both sides (main): one run of M blocks per tensor */
        copy_2d(dir, dev, host, pitch, M * B, st);
        return;
    }
    for (size_t i = 0; i < M; i++) {
        copy_2d(dir, dev + did[i] * B, host + hid[i] * B, pitch, B,
                (s == S_2DX2 && (i & 1)) ? st2 : st);
    }
}

typedef struct {
    int s, dir, share, shares;
    CUdeviceptr dev; char *host; size_t NB, B, M; size_t *did, *hid;
} job_t;

/* One thread's share: blocks [M*share/shares, M*(share+1)/shares) of every tensor, on its own
 * stream, its own range of the address lists. */
static void *issue_share(void *arg) {
    job_t *j = arg;
    CHECK(cuCtxSetCurrent(g_ctx));
    size_t a = j->M * j->share / j->shares, e = j->M * (j->share + 1) / j->shares;
    size_t pitch = j->NB * j->B, B = j->B;
    CUstream st = g_st[j->share];
    if (j->s == S_BT2 || j->s == S_BT4) {
        size_t base = L * a, n = 0;
        for (size_t t = 0; t < L; t++)
            for (size_t i = a; i < e; i++) {
                CUdeviceptr d = j->dev + t * pitch + j->did[i] * B;
                CUdeviceptr h = (CUdeviceptr)(j->host + t * pitch + j->hid[i] * B);
                cd[base + n] = j->dir == 0 ? d : h;
                cs[base + n] = j->dir == 0 ? h : d;
                cz[base + n] = B;
                n++;
            }
        batch_list(base, n, st);
        return NULL;
    }
    for (size_t i = a; i < e; i++) {
        copy_2d(j->dir, j->dev + j->did[i] * B, j->host + j->hid[i] * B, pitch, B, st);
    }
    return NULL;
}

static void issue_threads(int s, int dir, CUdeviceptr dev, char *host, size_t NB, size_t B,
                          size_t M, size_t *did, size_t *hid) {
    int T = (s == S_BT2 || s == S_2DT2) ? 2 : 4;
    pthread_t th[4];
    job_t jobs[4];
    for (int k = 0; k < T; k++) {
        jobs[k] = (job_t){s, dir, k, T, dev, host, NB, B, M, did, hid};
        if (pthread_create(&th[k], NULL, issue_share, &jobs[k])) { fprintf(stderr, "pthread\n"); exit(1); }
    }
    for (int k = 0; k < T; k++) pthread_join(th[k], NULL);
}

/* The host-side gather (2d-hgather, gather): a pool of GATHER_T - 1 threads and the caller,
 * each round copying its share of one chunk's (tensor, block) pieces into the staging ring. */
#define RING 8
static pthread_barrier_t g_bar;
static struct {
    char *host, *dst; size_t pitch, B, C, first, n, *hid; int T, quit;
} g_gather;

static void gather_share(int k) {
    size_t pieces = L * g_gather.n, a = pieces * k / g_gather.T, e = pieces * (k + 1) / g_gather.T;
    size_t B = g_gather.B;
    for (size_t p = a; p < e; p++) {
        size_t t = p / g_gather.n, j = p % g_gather.n;
        memcpy(g_gather.dst + (t * g_gather.C + j) * B,
               g_gather.host + t * g_gather.pitch + g_gather.hid[g_gather.first + j] * B, B);
    }
}

static void *gather_worker(void *arg) {
    int k = (int)(intptr_t)arg;
    for (;;) {
        pthread_barrier_wait(&g_bar);
        if (g_gather.quit) return NULL;
        gather_share(k);
        pthread_barrier_wait(&g_bar);
    }
}

static void gather_round(void) {
    pthread_barrier_wait(&g_bar);
    gather_share(0);
    pthread_barrier_wait(&g_bar);
}

static void hgather(int copy, CUdeviceptr dev, char *host, size_t NB, size_t B, size_t M,
                    size_t *did, size_t *hid, CUstream st, char *stage, size_t C, CUevent *ev) {
    size_t pitch = NB * B, chunk = (size_t)L * C * B;
    int used[RING] = {0};
    for (size_t first = 0, k = 0; first < M; first += C, k++) {
        size_t n = M - first < C ? M - first : C;
        int r = (int)(k % RING);
        if (used[r]) CHECK(cuEventSynchronize(ev[r]));
        char *dst = stage + r * chunk;
        g_gather.host = host; g_gather.dst = dst; g_gather.pitch = pitch; g_gather.B = B;
        g_gather.C = C; g_gather.first = first; g_gather.n = n; g_gather.hid = hid;
        gather_round();
        if (!copy) continue;
        for (size_t j = 0; j < n; j++) {
            CUDA_MEMCPY2D c;
            memset(&c, 0, sizeof c);
            c.srcMemoryType = CU_MEMORYTYPE_HOST; c.srcHost = dst + j * B; c.srcPitch = C * B;
            c.dstMemoryType = CU_MEMORYTYPE_DEVICE; c.dstDevice = dev + did[first + j] * B;
            c.dstPitch = pitch; c.WidthInBytes = B; c.Height = L;
            CHECK(cuMemcpy2DAsync(&c, st));
        }
        CHECK(cuEventRecord(ev[r], st));
        used[r] = 1;
    }
}

/* 2d-hgpipe: the pool, woken per call by a condition variable. */
#include <stdatomic.h>
#define PMAX 64
static struct {
    char *host, *stage; CUdeviceptr dev; size_t pitch, B, C, M, chunks, *did, *hid;
    CUstream st; CUevent *ev; int T, copy;
    atomic_size_t next;
    atomic_size_t done[8192];
    atomic_int issued[8192];
    /* chunk k's ring slot free (chunk k - RING copied): one thread polls the event */
    atomic_int slot_free[8192], poller[8192];
    atomic_int failed;
    atomic_uint gen, finished;
} hp;
static pthread_mutex_t hp_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hp_cv = PTHREAD_COND_INITIALIZER;

static void hp_work(void) {
    size_t B = hp.B, C = hp.C, chunk = (size_t)L * C * B;
    for (;;) {
        size_t j = atomic_fetch_add(&hp.next, 1);
        if (j >= hp.M) return;
        size_t k = j / C, r = k % RING;
        if (k >= RING) {  /* the slot's previous chunk issued, then copied */
            while (!atomic_load_explicit(&hp.issued[k - RING], memory_order_acquire)) _mm_pause();
            if (hp.copy && !atomic_load_explicit(&hp.slot_free[k], memory_order_acquire)) {
                if (!atomic_exchange(&hp.poller[k], 1)) {
                    CUresult q;
                    while ((q = cuEventQuery(hp.ev[r])) == CUDA_ERROR_NOT_READY) _mm_pause();
                    if (q != CUDA_SUCCESS) atomic_store(&hp.failed, 1);
                    atomic_store_explicit(&hp.slot_free[k], 1, memory_order_release);
                } else {
                    while (!atomic_load_explicit(&hp.slot_free[k], memory_order_acquire)) _mm_pause();
                }
            }
        }
        char *g = hp.stage + r * chunk + (j - k * C) * L * B;
        for (size_t t = 0; t < L; t++) probe_nt_copy((unsigned char *)g + t * B, (const unsigned char *)hp.host + t * hp.pitch + hp.hid[j] * B, B);
        size_t n = hp.M - k * C < C ? hp.M - k * C : C;
        if (atomic_fetch_add_explicit(&hp.done[k], 1, memory_order_acq_rel) + 1 == n) {
            for (size_t i = 0; i < n && hp.copy; i++) {
                CUDA_MEMCPY2D c;
                memset(&c, 0, sizeof c);
                c.srcMemoryType = CU_MEMORYTYPE_HOST; c.srcHost = hp.stage + r * chunk + i * L * B; c.srcPitch = B;
                c.dstMemoryType = CU_MEMORYTYPE_DEVICE; c.dstDevice = hp.dev + hp.did[k * C + i] * B;
                c.dstPitch = hp.pitch; c.WidthInBytes = B; c.Height = L;
                if (cuMemcpy2DAsync(&c, hp.st) != CUDA_SUCCESS) atomic_store(&hp.failed, 1);
            }
            if (hp.copy && cuEventRecord(hp.ev[r], hp.st) != CUDA_SUCCESS) atomic_store(&hp.failed, 1);
            atomic_store_explicit(&hp.issued[k], 1, memory_order_release);
        }
    }
}

static void *hp_worker(void *arg) {
    int me = (int)(intptr_t)arg;
    CHECK(cuCtxSetCurrent(g_ctx));
    unsigned seen = 0;
    for (;;) {
        pthread_mutex_lock(&hp_mu);
        unsigned g;
        while ((g = atomic_load(&hp.gen)) == seen) pthread_cond_wait(&hp_cv, &hp_mu);
        pthread_mutex_unlock(&hp_mu);
        seen = g;
        if (me < hp.T) hp_work();
        atomic_fetch_add(&hp.finished, 1);
    }
    return NULL;
}

static int hp_pool;
static void hgpipe(int copy, CUdeviceptr dev, char *host, size_t NB, size_t B, size_t M, size_t *did, size_t *hid,
                   CUstream st, char *stage, size_t C, CUevent *ev) {
    hp.host = host; hp.stage = stage; hp.dev = dev; hp.pitch = NB * B; hp.B = B; hp.C = C; hp.M = M;
    hp.did = did; hp.hid = hid; hp.st = st; hp.ev = ev; hp.copy = copy;
    hp.chunks = (M + C - 1) / C;
    for (size_t k = 0; k < hp.chunks; k++) {
        atomic_store(&hp.done[k], 0); atomic_store(&hp.issued[k], 0);
        atomic_store(&hp.slot_free[k], 0); atomic_store(&hp.poller[k], 0);
    }
    atomic_store(&hp.next, 0);
    atomic_store(&hp.finished, 0);
    pthread_mutex_lock(&hp_mu);
    atomic_fetch_add(&hp.gen, 1);
    pthread_cond_broadcast(&hp_cv);
    pthread_mutex_unlock(&hp_mu);
    hp_work();
    while (atomic_load(&hp.finished) < (unsigned)hp_pool) _mm_pause();
    if (atomic_load(&hp.failed)) { fprintf(stderr, "2d-hgpipe: a driver call failed\n"); exit(1); }
}

int main(int argc, char **argv) {
    CUdevice dev0;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev0, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev0));
    CHECK(cuCtxSetCurrent(ctx));
    g_ctx = ctx;
    int maxpitch = 0;
    CHECK(cuDeviceGetAttribute(&maxpitch, CU_DEVICE_ATTRIBUTE_MAX_PITCH, dev0));
    CUdriverProcAddressQueryResult q;
    CHECK(cuGetProcAddress("cuMemcpyBatchAsync", (void **)&batch_fn, 12080,
                           CU_GET_PROC_ADDRESS_DEFAULT, &q));
    CUdeviceptr dev, gdev;
    char *host, *stage, *mirror;
    CHECK(cuMemAlloc(&dev, CAP));
    CHECK(cuMemAlloc(&gdev, CAP / 4));
    /* HOST_MEM=alloc (default): the host blocks from cuMemHostAlloc; reg4k / reghuge: an
     * anonymous mapping registered with cuMemHostRegister, its pages kept 4 KiB
     * (MADV_NOHUGEPAGE) or made 2 MiB transparent huge pages (MADV_HUGEPAGE) before it is
     * touched. Is the host side's scatter loss the GPU's translation of 4 KiB host pages? */
    const char *hm = getenv("HOST_MEM") ? getenv("HOST_MEM") : "alloc";
    if (strcmp(hm, "alloc") == 0) {
        CHECK(cuMemHostAlloc((void **)&host, CAP, 0));
    } else {
        size_t A = 2u << 20;
        char *raw = mmap(NULL, CAP + A, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (raw == MAP_FAILED) { perror("mmap"); return 1; }
        host = (char *)(((uintptr_t)raw + A - 1) & ~(uintptr_t)(A - 1));
        int huge = strcmp(hm, "reghuge") == 0;
        if (madvise(host, CAP, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE)) perror("madvise");
        memset(host, 1, CAP);
        CHECK(cuMemHostRegister(host, CAP, 0));
        FILE *mi = fopen("/proc/meminfo", "r");
        char line[256];
        while (mi && fgets(line, sizeof line, mi))
            if (strncmp(line, "AnonHugePages", 13) == 0) printf("HOST_MEM=%s: %s", hm, line);
        if (mi) fclose(mi);
        FILE *th = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
        if (th && fgets(line, sizeof line, th)) printf("THP enabled: %s", line);
        if (th) fclose(th);
    }
    CHECK(cuMemHostAlloc((void **)&stage, CAP / 4, 0));
    mirror = malloc(CAP);
    size_t maxn = (CAP / 4) / 4096 + 16;
    cd = malloc(maxn * sizeof *cd); cs = malloc(maxn * sizeof *cs); cz = malloc(maxn * sizeof *cz);
    CUstream st, st2;
    CHECK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&st2, CU_STREAM_NON_BLOCKING));
    g_st[0] = st; g_st[1] = st2;
    CHECK(cuStreamCreate(&g_st[2], CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&g_st[3], CU_STREAM_NON_BLOCKING));
    int GT = getenv("GATHER_T") ? atoi(getenv("GATHER_T")) : 8;
    if (GT < 1) GT = 1;
    g_gather.T = GT;
    pthread_barrier_init(&g_bar, NULL, (unsigned)GT);
    pthread_t gth[64];
    for (int k = 1; k < GT && k < 64; k++)
        if (pthread_create(&gth[k], NULL, gather_worker, (void *)(intptr_t)k)) { fprintf(stderr, "pthread\n"); exit(1); }
    int PT = getenv("PIPE_T") ? atoi(getenv("PIPE_T")) : 12;
    if (PT < 1) PT = 1;
    if (PT > PMAX) PT = PMAX;
    hp.T = PT - 1;
    hp_pool = PT - 1;
    for (int k = 0; k < PT - 1; k++) {
        pthread_t t;
        if (pthread_create(&t, NULL, hp_worker, (void *)(intptr_t)k)) { fprintf(stderr, "pthread\n"); exit(1); }
    }
    CUevent gev[RING];
    for (int k = 0; k < RING; k++) CHECK(cuEventCreate(&gev[k], CU_EVENT_DISABLE_TIMING));
    printf("blocks2d: L=%d, cap %zu GiB per side, max pitch %d, gather threads %d\n", L, CAP >> 30,
           maxpitch, GT);
    size_t sizes[8] = {4096, 16384, 32768, 65536, 262144};
    int nsizes = 5;
    if (argc > 1) {  /* block sizes in KiB */
        nsizes = argc - 1 > 8 ? 8 : argc - 1;
        for (int i = 0; i < nsizes; i++) sizes[i] = (size_t)atoi(argv[i + 1]) << 10;
    }
    double res[8][2][NS], host_ms[8][2][NS];
    size_t *pd = malloc(8192 * sizeof *pd), *ph = malloc(8192 * sizeof *ph);
    uint64_t salt = 1;
    for (int zi = 0; zi < nsizes; zi++) {
        size_t B = sizes[zi], NB = CAP / (L * B);
        if (NB > 8192) NB = 8192;
        size_t M = NB / 4, pitch = NB * B, W = B / 8;
        for (int dir = 0; dir < 2; dir++)
            for (int s = 0; s < NS; s++) {
                double t[REPS], h[REPS];
                int ok = 1;
                if (s == S_2D || s == S_2DX2 || s == S_2DT2 || s == S_2DT4 || s == S_2DSEQ || s == S_2DWIDE
                    || s == S_2DDSEQ || s == S_2DHSEQ || s == S_2DSORT || s == S_2DHSORT || s == S_HGATHER || s == S_HGPIPE || s == S_GPIPE)
                    ok = pitch <= (size_t)maxpitch;
                if (getenv("SKIP_OLD") && (s == S_SPLIT || s == S_2DX2)) ok = 0;
                if ((s == S_HGATHER || s == S_GATHER || s == S_HGPIPE || s == S_GPIPE) && dir == 1) ok = 0;
                size_t C = getenv("GATHER_C") ? (size_t)atoi(getenv("GATHER_C")) : (16u << 20) / (L * B);
                if (C < 1) C = 1;
                if (C > M) C = M;
                if ((size_t)RING * L * C * B > CAP / 4) C = CAP / 4 / ((size_t)RING * L * B);
                if (C < 1) C = 1;
                if (getenv("ONLY")) {
                    char list[256];
                    snprintf(list, sizeof list, ",%s,", getenv("ONLY"));
                    char key[32];
                    snprintf(key, sizeof key, ",%s,", SNAME[s]);
                    if (!strstr(list, key)) ok = 0;
                }
                int reps = s == S_HELD ? 1 : REPS;
                if (!ok) { res[zi][dir][s] = -1; host_ms[zi][dir][s] = -1; continue; }
                for (int r = s == S_HELD ? 0 : -1; r < reps; r++) {
                    perm(pd, NB); perm(ph, NB);
                    if (s == S_2DSEQ || s == S_2DWIDE)  /* the controls: blocks in address order */
                        for (size_t i = 0; i < NB; i++) pd[i] = ph[i] = i;
                    if (s == S_2DDSEQ) for (size_t i = 0; i < NB; i++) pd[i] = i;
                    if (s == S_2DHSEQ) for (size_t i = 0; i < NB; i++) ph[i] = i;
                    if (s == S_2DSORT || s == S_2DHSORT)  /* the M moved pairs in device (host) address order */
                        for (size_t i = 1; i < M; i++)
                            for (size_t j = i; j > 0 && (s == S_2DSORT ? pd[j - 1] > pd[j] : ph[j - 1] > ph[j]); j--) {
                                size_t x = pd[j]; pd[j] = pd[j - 1]; pd[j - 1] = x;
                                x = ph[j]; ph[j] = ph[j - 1]; ph[j - 1] = x;
                            }
                    salt++;
                    /* source pattern, destination poison */
                    char *src_host = dir == 0 ? host : mirror;  /* H2D: host is the source */
                    if (s == S_CONTIG || s == S_CHUNKS) {
                        uint64_t *sp = (uint64_t *)stage;
                        size_t n = L * M * B / 8;
                        if (dir == 0) { for (size_t i = 0; i < n; i += 4099) sp[i] = pat(salt, 0, 0, i); CHECK(cuMemsetD8(gdev, 0xEE, L * M * B)); }
                        else { for (size_t i = 0; i < n; i += 4099) ((uint64_t *)mirror)[i] = pat(salt, 0, 0, i);
                               CHECK(cuMemcpyHtoD(gdev, mirror, L * M * B));
                               for (size_t i = 0; i < n; i += 4099) sp[i] = 0xEEEEEEEEEEEEEEEEULL; }
                    } else {
                        for (size_t tt = 0; tt < L; tt++)
                            for (size_t b = 0; b < NB; b++) {
                                uint64_t *p = (uint64_t *)(src_host + tt * pitch + b * B);
                                p[0] = pat(salt, tt, b, 0); p[W - 1] = pat(salt, tt, b, W - 1);
                            }
                        if (dir == 0) CHECK(cuMemsetD8(dev, 0xEE, L * pitch));
                        else {
                            CHECK(cuMemcpyHtoD(dev, mirror, L * pitch));
                            for (size_t tt = 0; tt < L; tt++)
                                for (size_t i = 0; i <= M; i++) {
                                    uint64_t *p = (uint64_t *)(host + tt * pitch + ph[i] * B);
                                    p[0] = p[W - 1] = 0xEEEEEEEEEEEEEEEEULL;
                                }
                        }
                    }
                    CHECK(cuCtxSynchronize());
                    if (s == S_HELD) CHECK(cuLaunchHostFunc(st, holder, NULL));
                    double t0 = now_ms();
                    if (s == S_HGPIPE || s == S_GPIPE)
                        hgpipe(s == S_HGPIPE, dev, host, NB, B, M, pd, ph, st, stage, C, gev);
                    else if (s == S_HGATHER || s == S_GATHER)
                        hgather(s == S_HGATHER, dev, host, NB, B, M, pd, ph, st, stage, C, gev);
                    else if (s >= S_BT2 && s <= S_2DT4) issue_threads(s, dir, dev, host, NB, B, M, pd, ph);
                    else issue(s == S_HELD ? S_BATCH : (s == S_2DSEQ || s >= S_2DDSEQ) ? S_2D : s, dir, dev, host, NB, B, M, pd, ph,
                               st, st2, gdev, stage);
                    double t1 = now_ms();
                    for (int k = 0; k < 4; k++) CHECK(cuStreamSynchronize(g_st[k]));
                    double t2 = now_ms();
                    if (r >= 0) { t[r] = L * M * B / ((t2 - t0) * 1e6); h[r] = t1 - t0; }
                    /* check */
                    if (s == S_CONTIG || s == S_CHUNKS) {
                        if (dir == 0) CHECK(cuMemcpyDtoH(mirror, gdev, L * M * B));
                        char *got = dir == 0 ? mirror : stage;
                        for (size_t i = 0; i < L * M * B / 8; i += 4099)
                            if (((uint64_t *)got)[i] != pat(salt, 0, 0, i)) { wrong++; break; }
                        continue;
                    }
                    if (s == S_GPIPE) {  /* the last chunk's blocks, block-major in the staging ring */
                        size_t k = (M - 1) / C, first = k * C, n = M - first;
                        char *g = stage + (k % RING) * (size_t)L * C * B;
                        for (size_t j = 0; j < n; j++)
                            for (size_t tt = 0; tt < L; tt++) {
                                uint64_t *p = (uint64_t *)(g + (j * L + tt) * B);
                                if (p[0] != pat(salt, tt, ph[first + j], 0) || p[W - 1] != pat(salt, tt, ph[first + j], W - 1))
                                    if (wrong++ < 5) printf("WRONG gpipe B %zu t %zu j %zu\n", B, tt, j);
                            }
                        continue;
                    }
                    if (s == S_GATHER) {  /* the last chunk's pieces, in the staging ring */
                        size_t k = (M - 1) / C, first = k * C, n = M - first;
                        char *g = stage + (k % RING) * (size_t)L * C * B;
                        for (size_t tt = 0; tt < L; tt++)
                            for (size_t j = 0; j < n; j++) {
                                uint64_t *p = (uint64_t *)(g + (tt * C + j) * B);
                                if (p[0] != pat(salt, tt, ph[first + j], 0) || p[W - 1] != pat(salt, tt, ph[first + j], W - 1))
                                    if (wrong++ < 5) printf("WRONG gather B %zu t %zu j %zu\n", B, tt, j);
                            }
                        continue;
                    }
                    char *dst = dir == 0 ? mirror : host;
                    if (dir == 0) CHECK(cuMemcpyDtoH(mirror, dev, L * pitch));
                    size_t *sid = dir == 0 ? ph : pd, *tid = dir == 0 ? pd : ph;
                    for (size_t tt = 0; tt < L; tt++) {
                        for (size_t i = 0; i < M; i++) {
                            uint64_t *p = (uint64_t *)(dst + tt * pitch + tid[i] * B);
                            if (p[0] != pat(salt, tt, sid[i], 0) || p[W - 1] != pat(salt, tt, sid[i], W - 1)) {
                                if (wrong++ < 5) printf("WRONG %s dir %d B %zu t %zu i %zu\n", SNAME[s], dir, B, tt, i);
                            }
                        }
                        uint64_t *u = (uint64_t *)(dst + tt * pitch + tid[M] * B);
                        if (u[0] != 0xEEEEEEEEEEEEEEEEULL) { if (wrong++ < 5) printf("WRITTEN %s unmoved\n", SNAME[s]); }
                    }
                }
                /* medians */
                for (int a = 0; a < reps; a++) for (int b2 = a + 1; b2 < reps; b2++) {
                    if (t[b2] < t[a]) { double x = t[a]; t[a] = t[b2]; t[b2] = x; }
                    if (h[b2] < h[a]) { double x = h[a]; h[a] = h[b2]; h[b2] = x; }
                }
                res[zi][dir][s] = t[reps / 2];
                host_ms[zi][dir][s] = h[reps / 2];
                printf("B %6zu %s %-10s %6.1f GB/s (%.1f-%.1f)  issue %8.2f ms (%.2f-%.2f)\n", B, dir ? "D2H" : "H2D",
                       SNAME[s], t[reps / 2], t[0], t[reps - 1], h[reps / 2], h[0], h[reps - 1]);
                fflush(stdout);
            }
    }
    printf("\nSUMMARY GB/s (issue ms)\n%-12s", "");
    for (int zi = 0; zi < nsizes; zi++) printf("%20zuK", sizes[zi] >> 10);
    printf("\n");
    for (int dir = 0; dir < 2; dir++)
        for (int s = 0; s < NS; s++) {
            printf("%s %-8s", dir ? "D2H" : "H2D", SNAME[s]);
            for (int zi = 0; zi < nsizes; zi++) printf("   %7.1f (%7.2f)", res[zi][dir][s], host_ms[zi][dir][s]);
            printf("\n");
        }
    printf("wrong: %d\n", wrong);
    return wrong ? 1 : 0;
}
