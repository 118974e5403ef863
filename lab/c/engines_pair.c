/* engines_pair.c -- is "both directions staged at once move what one moves" the copy engines?
 * A staged offload keeps two streams of copies busy (2D gathers inside device memory, then one
 * contiguous D2H per chunk), a staged load two more (one contiguous H2D per chunk, then 2D
 * scatters). Here the same device-side copies and crossings run with NO host threads: if the pair
 * with the 2D copies falls to about one direction's rate while the pair without them carries
 * ~1.7x, the engines run in turn what the driver maps onto them; if not, look at the host side.
 *
 *   nvcc -O2 -o engines_pair engines_pair.c -lcuda && ./engines_pair [KiB ...]   (default 16 64)
 *
 * Workload: L = 64 tensors of NB blocks of B bytes in one device allocation (tensor stride
 * NB * B), twice (the offload's source pool, the load's destination pool); a run moves NCH = 32
 * chunks of 16 MiB each way (512 MiB); a chunk holds C = 16 MiB / (L B) blocks, block k's L rows
 * of B bytes at k L B; NB = 4 NCH C (each pool 2 GiB); block ids random per run. Device staging:
 * a ring of 4 chunk slots per direction; host side: 512 MiB pinned per direction, no ring.
 * Rows (GB/s of the bytes both ways / wall from the first issue to every stream drained; median
 * of REPS runs after a warm-up, min-max; x = against the faster direction alone of the same kind):
 *   d2h, h2d, pair            the crossings alone (chunk j from / into slot j % 4)
 *   d2h+2d, h2d+2d, pair+2d   with the 2D copies: the gather of chunk j (one cuMemcpy2DAsync per
 *                             block: width B, height L, pitch NB B -> B) on stream g1 after the
 *                             D2H of chunk j - 4 left its slot, an event, its D2H on x1; the H2D
 *                             of chunk j on x2 after the scatter of chunk j - 4, an event, its
 *                             scatter on g2
 * Checked every run, destinations poisoned (0xEE) before it: with the 2D copies, every row of
 * every moved block (the offload's host side against the source pattern; the load's rows read
 * back by 2D copies and compared with the host source); the crossings alone, every byte of every
 * chunk (d2h: the slot it came from; h2d: the last four chunks read back from their slots).
 * Exit status 1 on a wrong byte.
 */
#include "probe.h"

#define L 64
#define NCH 32
#define SLOTS 4
#define REPS 5
#define CH ((size_t)16 << 20)

static size_t B, C, NB, POOL;
static CUdeviceptr dsrc, ddst, ring_o, ring_l; /* pools, the two directions' device rings */
static unsigned char *hdst, *hsrc, *hchk;       /* pinned: offload's host side, load's, read-back */
static unsigned char *hpoison;                  /* pinned: one chunk of 0xEE */
static size_t ido[NCH * 64], idl[NCH * 64];     /* block ids per run (C <= 64) */
static CUstream x1, x2, g1, g2;
static CUevent evg[NCH], evx[NCH], evh[NCH], evs[NCH];
static int wrong;

/* Byte patterns with no period a swapped chunk, slot, block or row could hide in. */
static unsigned char mix(size_t x) { return (unsigned char)((x * 0x9E3779B97F4A7C15ull) >> 56); }
static unsigned char pat(size_t off) { return mix(off + 1); }
static unsigned char slot_pat(size_t off) { return mix(off + ((size_t)1 << 40)); }
static unsigned char src_pat(size_t off) { return mix(off + ((size_t)2 << 40)); }

/* Device memory poisoned, or written from host memory (async copies of pinned memory on g2, then
 * a wait: what the simulated driver a local check runs on offers too). */
static void poison_dev(CUdeviceptr d, size_t n) {
    for (size_t o = 0; o < n; o += CH) CHECK(cuMemcpyHtoDAsync(d + o, hpoison, n - o < CH ? n - o : CH, g2));
    CHECK(cuStreamSynchronize(g2));
}

static void to_dev(CUdeviceptr d, const unsigned char *h, size_t n) {
    CHECK(cuMemcpyHtoDAsync(d, h, n, g2));
    CHECK(cuStreamSynchronize(g2));
}

static void draw(size_t *ids, unsigned seed) {
    /* NCH C distinct ids of NB: a partial Fisher-Yates over 0..NB-1. */
    static size_t perm[NCH * 64 * 4];
    for (size_t i = 0; i < NB; i++) perm[i] = i;
    srand(seed);
    for (size_t i = 0; i < NCH * C; i++) {
        size_t k = i + (size_t)rand() % (NB - i), t = perm[i];
        perm[i] = perm[k], perm[k] = t, ids[i] = perm[i];
    }
}

/* The 2D copy of block k of chunk j between a pool (rows at id B + t NB B) and a device slot. */
static void rows_2d(int gather, size_t j, size_t k, CUstream s) {
    size_t id = gather ? ido[j * C + k] : idl[j * C + k];
    CUdeviceptr pool = (gather ? dsrc : ddst) + id * B;
    CUdeviceptr slot = (gather ? ring_o : ring_l) + (j % SLOTS) * CH + k * L * B;
    CUDA_MEMCPY2D m;
    memset(&m, 0, sizeof m);
    m.srcMemoryType = m.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    m.srcDevice = gather ? pool : slot, m.srcPitch = gather ? NB * B : B;
    m.dstDevice = gather ? slot : pool, m.dstPitch = gather ? B : NB * B;
    m.WidthInBytes = B, m.Height = L;
    CHECK(cuMemcpy2DAsync(&m, s));
}

/* One run of `off` / `load` (with the 2D copies when `two_d`); returns ms of wall. */
static double run(int off, int load, int two_d, unsigned seed) {
    draw(ido, seed), draw(idl, seed + 7919);
    if (off) memset(hdst, 0xEE, NCH * CH);
    if (load) poison_dev(ddst, POOL);
    if (load && !two_d) poison_dev(ring_l, SLOTS * CH);
    CHECK(cuCtxSynchronize());
    double t0 = now_ms();
    for (size_t j = 0; j < NCH; j++) {
        if (off) {
            if (two_d) {
                if (j >= SLOTS) CHECK(cuStreamWaitEvent(g1, evx[j - SLOTS], 0));
                for (size_t k = 0; k < C; k++) rows_2d(1, j, k, g1);
                CHECK(cuEventRecord(evg[j], g1));
                CHECK(cuStreamWaitEvent(x1, evg[j], 0));
            }
            CHECK(cuMemcpyDtoHAsync(hdst + j * CH, ring_o + (j % SLOTS) * CH, CH, x1));
            CHECK(cuEventRecord(evx[j], x1));
        }
        if (load) {
            if (two_d && j >= SLOTS) CHECK(cuStreamWaitEvent(x2, evs[j - SLOTS], 0));
            CHECK(cuMemcpyHtoDAsync(ring_l + (j % SLOTS) * CH, hsrc + j * CH, CH, x2));
            CHECK(cuEventRecord(evh[j], x2));
            if (two_d) {
                CHECK(cuStreamWaitEvent(g2, evh[j], 0));
                for (size_t k = 0; k < C; k++) rows_2d(0, j, k, g2);
                CHECK(cuEventRecord(evs[j], g2));
            }
        }
    }
    CHECK(cuCtxSynchronize());
    double ms = now_ms() - t0;
    /* The checks. */
    if (off) {
        for (size_t j = 0; j < NCH; j++)
            for (size_t k = 0; k < C; k++)
                for (size_t t = 0; t < L; t++) {
                    const unsigned char *got = hdst + j * CH + (k * L + t) * B;
                    for (size_t i = 0; i < B; i++) {
                        unsigned char want = two_d ? pat(t * NB * B + ido[j * C + k] * B + i)
                                                   : slot_pat((j % SLOTS) * CH + (k * L + t) * B + i);
                        if (got[i] != want) { wrong++; goto off_done; }
                    }
                }
    off_done:;
    }
    if (load) {
        if (two_d) {
            for (size_t j = 0; j < NCH; j++)
                for (size_t k = 0; k < C; k++) {
                    CUDA_MEMCPY2D m;
                    memset(&m, 0, sizeof m);
                    m.srcMemoryType = CU_MEMORYTYPE_DEVICE, m.dstMemoryType = CU_MEMORYTYPE_HOST;
                    m.srcDevice = ddst + idl[j * C + k] * B, m.srcPitch = NB * B;
                    m.dstHost = hchk + j * CH + k * L * B, m.dstPitch = B;
                    m.WidthInBytes = B, m.Height = L;
                    CHECK(cuMemcpy2DAsync(&m, x2));
                }
            CHECK(cuStreamSynchronize(x2));
            if (memcmp(hchk, hsrc, NCH * CH) != 0) wrong++;
        } else {
            CHECK(cuMemcpyDtoH(hchk, ring_l, SLOTS * CH));
            for (size_t s = 0; s < SLOTS; s++) {
                size_t j = NCH - SLOTS + s; /* the chunk slot j % SLOTS holds last */
                if (memcmp(hchk + (j % SLOTS) * CH, hsrc + j * CH, CH) != 0) wrong++;
            }
        }
    }
    return ms;
}

static double row(const char *name, int off, int load, int two_d, double alone) {
    double t[REPS];
    int w0 = wrong;
    run(off, load, two_d, 1);
    for (int r = 0; r < REPS; r++) t[r] = (double)(off + load) * NCH * CH / (run(off, load, two_d, 100 + r) * 1e6);
    return probe_row(name, t, REPS, alone, wrong > w0);
}

int main(int argc, char **argv) {
    probe_init();
    CHECK(cuStreamCreate(&x1, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&x2, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&g1, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&g2, CU_STREAM_NON_BLOCKING));
    for (int j = 0; j < NCH; j++) {
        CHECK(cuEventCreate(&evg[j], CU_EVENT_DISABLE_TIMING));
        CHECK(cuEventCreate(&evx[j], CU_EVENT_DISABLE_TIMING));
        CHECK(cuEventCreate(&evh[j], CU_EVENT_DISABLE_TIMING));
        CHECK(cuEventCreate(&evs[j], CU_EVENT_DISABLE_TIMING));
    }
    POOL = 4 * NCH * CH;
    CHECK(cuMemAlloc(&dsrc, POOL));
    CHECK(cuMemAlloc(&ddst, POOL));
    CHECK(cuMemAlloc(&ring_o, SLOTS * CH));
    CHECK(cuMemAlloc(&ring_l, SLOTS * CH));
    CHECK(cuMemHostAlloc((void **)&hdst, NCH * CH, 0));
    CHECK(cuMemHostAlloc((void **)&hsrc, NCH * CH, 0));
    CHECK(cuMemHostAlloc((void **)&hchk, NCH * CH, 0));
    CHECK(cuMemHostAlloc((void **)&hpoison, CH, 0));
    memset(hpoison, 0xEE, CH);
    /* The source pool's pattern and the offload ring's, written once through hchk. */
    for (size_t o = 0; o < POOL; o += NCH * CH) {
        for (size_t i = 0; i < NCH * CH; i++) hchk[i] = pat(o + i);
        to_dev(dsrc + o, hchk, NCH * CH);
    }
    for (size_t i = 0; i < NCH * CH; i++) hsrc[i] = src_pat(i);
    int n = argc > 1 ? argc - 1 : 2;
    for (int a = 0; a < n; a++) {
        B = (size_t)(argc > 1 ? atoi(argv[a + 1]) : (a ? 64 : 16)) << 10;
        if (B < 1024 || B > (256 << 10)) { fprintf(stderr, "block KiB: 1-256\n"); return 2; }
        C = CH / (L * B), NB = POOL / (L * B);
        if (C < 1 || C > 64) { fprintf(stderr, "block KiB: 4-256\n"); return 2; }
        /* The offload ring's own pattern (the 2D rows overwrite it). */
        for (size_t i = 0; i < SLOTS * CH; i++) hchk[i] = slot_pat(i);
        to_dev(ring_o, hchk, SLOTS * CH);
        printf("== %zu KiB blocks: %d tensors x %zu blocks, %zu blocks a chunk, %d chunks each way (%zu MiB)\n",
               B >> 10, L, NB, C, NCH, NCH * CH >> 20);
        double d = row("d2h", 1, 0, 0, 0), h = row("h2d", 0, 1, 0, 0);
        row("pair", 1, 1, 0, d > h ? d : h);
        double d2 = row("d2h+2d", 1, 0, 1, 0), h2 = row("h2d+2d", 0, 1, 1, 0);
        row("pair+2d", 1, 1, 1, d2 > h2 ? d2 : h2);
    }
    printf("checks: %s\n", wrong ? "WRONG BYTES" : "all passed");
    return wrong ? 1 : 0;
}
