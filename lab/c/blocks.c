/* blocks.c -- paged KV-block mover measurements on one GPU (copy engines only).
 *
 * Build (on the GPU machine):  nvcc -O2 -o blocks blocks.c -lcuda -lpthread
 * Run:                         ./blocks            (see README.md; < 4 minutes)
 *
 * Workload: L device tensors (one cuMemAlloc each) of NB blocks of B bytes and
 * L host tensors (views into one pinned cuMemHostAlloc pool).  Each call moves
 * M = NB/4 blocks per tensor; device ids and host ids are prefixes of two
 * different fixed-seed permutations (the same ids for every tensor, as with
 * vLLM's KV blocks), or host ids 0..M-1 ("hc" rows).  Every call is checked:
 * sources carry a pattern derived from (side, tensor, block, word, call),
 * destinations are poisoned (0xEE) before the call, and after it a random
 * 1/CHECK_DIV window of EVERY moved block is compared, plus every non-moved
 * device block (H2D) or a few full non-moved host blocks (D2H, snapshot).
 *
 * Robustness: the measuring runs in a forked child (CUDA is never touched in
 * the parent).  If the child crashes (e.g. a driver segfault on a huge batch),
 * hangs, or hits a CUDA error, the parent marks that measurement and starts a
 * new child at the next one, and always prints the tables.
 *
 * Exit status: 0 all measured and correct; 1 any CUDA error or wrong byte;
 * 3 a crash or hang (and no error/wrong byte); 2 something skipped for time.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <cuda.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if !defined(CUDA_VERSION) || CUDA_VERSION < 12080
#error "blocks.c needs cuda.h from CUDA 12.8 or newer (CUmemcpyAttributes)"
#endif

/* ------------------------------------------------------------------ knobs */
#define L_TENSORS 64          /* 32 layers x K/V                               */
#define NB_SMALL 8192         /* blocks per tensor when it fits the cap        */
#define MOVE_DIV 4            /* M = NB / MOVE_DIV blocks moved per tensor     */
#define CHECK_DIV 8           /* check a window of B/CHECK_DIV bytes per block */
#define CHUNK_BYTES ((size_t)8 << 20) /* host gather/scatter pipeline chunk   */
#define NSLOT 3               /* pinned ring slots per CPU worker              */
#define MAX_T 8               /* most CPU gather/scatter threads               */
#define WARMUP 1
#define TIMED_MAX 5
#define TIMED_MIN 2
#define MAX_CFG_S 5.0         /* reduce repetitions above ~5 s per config      */
#define SNAP_PER_T 4          /* non-moved host blocks snapshotted per tensor  */
#define RNG_SEED 0x5EEDB10C5ULL
#define MAX_SIZES 8
#define MAX_RESTARTS 4
#define INIT_TIMEOUT_S 150.0  /* child start (pinned allocation) allowance    */
#define IDLE_TIMEOUT_S 60.0   /* no message from the child for this long: hang */
#define WAIT_TIMEOUT_S 30.0   /* one call not complete after this long: hang   */
/* defaults, overridable by environment (README.md) */
static double g_cap_gib = 16.0;    /* per side: L*NB*B <= cap (device and host) */
static double g_budget_s = 200.0;  /* plan repetitions to end near this        */
static double g_hard_s = 222.0;    /* start no measurement after this          */
static double g_kill_s = 236.0;    /* parent kills a still-running child        */
static int g_sizes_kib[MAX_SIZES] = {4, 16, 32, 64, 256};
static int g_nsizes = 5;
static size_t g_batch_max = 0;     /* 0: one cuMemcpyBatchAsync per list       */

/* ------------------------------------------------------------- strategies */
enum { DIR_H2D = 0, DIR_D2H = 1, DIR_BOTH = 2 };
enum {
    K_SEP, K_BATCH, K_MULTI, K_GATHER, K_SCATTER_ONLY, K_CONTIG, K_D2D_REF,
    K_HC_STAGE, K_CPU_SCATTER, K_GATHER_ONLY, K_BOTH
};
/* order values are CUmemcpySrcAccessOrder values */
enum { O_NONE = 0, O_STREAM = 1, O_DURING = 2, O_ANY = 3 };

typedef struct {
    const char *name;
    int dir, kind, order;
    unsigned flags;
    int nstreams, T, hc, pc, wall;
} strat_t;

static const strat_t STRATS[] = {
    /* name                         dir      kind            order     fl ns T hc pc wall */
    {"a  separate copies",          DIR_H2D, K_SEP,          O_NONE,   0, 1, 0, 0, 0, 0},
    {"b  batch STREAM",             DIR_H2D, K_BATCH,        O_STREAM, 0, 1, 0, 0, 0, 0},
    {"c  batch ANY",                DIR_H2D, K_BATCH,        O_ANY,    0, 1, 0, 0, 0, 0},
    {"c  batch DURING_API_CALL",    DIR_H2D, K_BATCH,        O_DURING, 0, 1, 0, 0, 0, 0},
    {"c  batch STREAM+OVERLAP",     DIR_H2D, K_BATCH,        O_STREAM, 1, 1, 0, 0, 0, 0},
    {"d  batch over 2 streams",     DIR_H2D, K_MULTI,        O_STREAM, 0, 2, 0, 0, 0, 0},
    {"d  batch over 4 streams",     DIR_H2D, K_MULTI,        O_STREAM, 0, 4, 0, 0, 0, 0},
    {"e  T=1 gather+1 D2D scat",    DIR_H2D, K_GATHER,       O_STREAM, 0, 1, 1, 0, 0, 0},
    {"e  T=4 gather+1 D2D scat",    DIR_H2D, K_GATHER,       O_STREAM, 0, 1, 4, 0, 0, 0},
    {"e  T=8 gather+1 D2D scat",    DIR_H2D, K_GATHER,       O_STREAM, 0, 1, 8, 0, 0, 0},
    {"e  T=8 gather+chunk scat",    DIR_H2D, K_GATHER,       O_STREAM, 0, 1, 8, 0, 1, 0},
    {"e  D2D batch scatter only",   DIR_H2D, K_SCATTER_ONLY, O_STREAM, 0, 1, 0, 0, 0, 0},
    {"e  D2D scatter only +OVL/CE", DIR_H2D, K_SCATTER_ONLY, O_STREAM, 1, 1, 0, 0, 0, 0},
    {"f  1 contiguous H2D",         DIR_H2D, K_CONTIG,       O_NONE,   0, 1, 0, 0, 0, 0},
    {"f  1 contiguous D2D (ref)",   DIR_H2D, K_D2D_REF,      O_NONE,   0, 1, 0, 0, 0, 0},
    {"f  1 D2D as batch+OVL/CE",    DIR_H2D, K_D2D_REF,      O_STREAM, 1, 1, 0, 0, 0, 0},
    {"hc a separate copies",        DIR_H2D, K_SEP,          O_NONE,   0, 1, 0, 1, 0, 0},
    {"hc b batch STREAM",           DIR_H2D, K_BATCH,        O_STREAM, 0, 1, 0, 1, 0, 0},
    {"hc g 64 H2D+1 D2D scat",      DIR_H2D, K_HC_STAGE,     O_STREAM, 0, 1, 0, 1, 0, 0},

    {"a  separate copies",          DIR_D2H, K_SEP,          O_NONE,   0, 1, 0, 0, 0, 0},
    {"b  batch STREAM",             DIR_D2H, K_BATCH,        O_STREAM, 0, 1, 0, 0, 0, 0},
    {"b  batch ANY",                DIR_D2H, K_BATCH,        O_ANY,    0, 1, 0, 0, 0, 0},
    {"d  batch over 2 streams",     DIR_D2H, K_MULTI,        O_STREAM, 0, 2, 0, 0, 0, 0},
    {"d  batch over 4 streams",     DIR_D2H, K_MULTI,        O_STREAM, 0, 4, 0, 0, 0, 0},
    {"e  D2D gath+T=1 scatter *",   DIR_D2H, K_CPU_SCATTER,  O_STREAM, 0, 1, 1, 0, 0, 1},
    {"e  D2D gath+T=4 scatter *",   DIR_D2H, K_CPU_SCATTER,  O_STREAM, 0, 1, 4, 0, 0, 1},
    {"e  D2D gath+T=8 scatter *",   DIR_D2H, K_CPU_SCATTER,  O_STREAM, 0, 1, 8, 0, 0, 1},
    {"e  D2D batch gather only",    DIR_D2H, K_GATHER_ONLY,  O_STREAM, 0, 1, 0, 0, 0, 0},
    {"e  D2D gather only +OVL/CE",  DIR_D2H, K_GATHER_ONLY,  O_STREAM, 1, 1, 0, 0, 0, 0},
    {"f  1 contiguous D2H",         DIR_D2H, K_CONTIG,       O_NONE,   0, 1, 0, 0, 0, 0},
    {"hc a separate copies",        DIR_D2H, K_SEP,          O_NONE,   0, 1, 0, 1, 0, 0},
    {"hc b batch STREAM",           DIR_D2H, K_BATCH,        O_STREAM, 0, 1, 0, 1, 0, 0},
    {"hc g D2D gath+64 D2H",        DIR_D2H, K_HC_STAGE,     O_STREAM, 0, 1, 0, 1, 0, 0},

    {"both: best 1-stream batch",   DIR_BOTH, K_BOTH,        O_NONE,   0, 2, 0, 0, 0, 0},
};
#define NSTRAT ((int)(sizeof STRATS / sizeof STRATS[0]))

static int uses_d2d(const strat_t *s) {
    return s->kind == K_GATHER || s->kind == K_SCATTER_ONLY || s->kind == K_HC_STAGE ||
           s->kind == K_CPU_SCATTER || s->kind == K_GATHER_ONLY ||
           (s->kind == K_D2D_REF && s->order != O_NONE);
}
static int uses_batch(const strat_t *s) {
    return s->kind == K_BATCH || s->kind == K_MULTI || uses_d2d(s);
}

/* ---------------------------------------------------------------- results */
enum { ST_NONE = 0, ST_OK, ST_NA, ST_SKIP, ST_FAIL, ST_ERR, ST_CRASH, ST_HANG };
static const char *ST_TXT[] = {"-", "ok", "n/a", "skip", "FAIL", "ERR", "CRASH", "HANG"};

typedef struct {
    int status, n;
    double med, mn, mx;     /* GB/s shown in the table (events; wall for '*' rows) */
    double ev_med, wall_med;/* GB/s from events / from host wall clock             */
    double host_us;         /* median host time spent issuing the call(s)          */
    long copies;            /* copy descriptors (or API copies) per call           */
    long split;             /* >0: batches were split into calls of <= split copies */
    double load_med, off_med; /* both-at-once: per-direction GB/s while overlapped */
    int pick_h, pick_d;       /* both-at-once: strategy index used per direction   */
} result_t;

typedef struct { int NB, M; size_t B, bytes; } sinfo_t;
static sinfo_t g_si[MAX_SIZES];
static result_t g_res[MAX_SIZES][NSTRAT];
static double g_t0;

/* -------------------------------------------------------------- utilities */
static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static double elapsed_s(void) { return now_s() - g_t0; }

static inline uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static void shuffle(int *a, int n, uint64_t seed) {
    uint64_t s = seed;
    for (int i = 0; i < n; i++) a[i] = i;
    for (int i = n - 1; i > 0; i--) {
        s = mix64(s);
        int j = (int)(s % (uint64_t)(i + 1));
        int t = a[i]; a[i] = a[j]; a[j] = t;
    }
}

static int cmp_dbl(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static double median(const double *v, int n) {
    double t[TIMED_MAX];
    if (n <= 0) return 0;
    memcpy(t, v, (size_t)n * sizeof *t);
    qsort(t, (size_t)n, sizeof *t, cmp_dbl);
    return (n & 1) ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "out of host memory (%zu bytes)\n", n); _exit(1); }
    return p;
}

/* ------------------------------------------------------------ child -> parent */
enum { MSG_HELLO = 1, MSG_SETUP, MSG_BINFO, MSG_START, MSG_RESULT, MSG_FATAL, MSG_DONE };
typedef struct { int type, si, st, code; result_t r; } msg_t;
static int g_pipe_wr = -1;
static int g_cur_si = -1, g_cur_st = -1;

static void send_msg(int type, int si, int st, int code, const result_t *r) {
    msg_t m;
    memset(&m, 0, sizeof m);
    m.type = type; m.si = si; m.st = st; m.code = code;
    if (r) m.r = *r;
    if (g_pipe_wr >= 0) {
        const char *p = (const char *)&m;
        size_t left = sizeof m;
        while (left > 0) {
            ssize_t w = write(g_pipe_wr, p, left);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) break;
            p += w; left -= (size_t)w;
        }
    }
}

static pthread_mutex_t g_print_mu = PTHREAD_MUTEX_INITIALIZER;
static void child_fatal(int code, const char *fmt, ...) {
    va_list ap;
    pthread_mutex_lock(&g_print_mu);
    fprintf(stdout, "FATAL (%s): ", ST_TXT[code]);
    va_start(ap, fmt);
    vfprintf(stdout, fmt, ap);
    va_end(ap);
    fprintf(stdout, "\n");
    fflush(stdout);
    send_msg(MSG_FATAL, g_cur_si, g_cur_st, code, NULL);
    _exit(1);
}

static void cu_fail(CUresult r, const char *what, const char *file, int line) {
    const char *nm = NULL, *s = NULL;
    cuGetErrorName(r, &nm);
    cuGetErrorString(r, &s);
    child_fatal(ST_ERR, "CUDA error %d %s (%s) in %s at %s:%d", (int)r, nm ? nm : "?",
                s ? s : "?", what, file, line);
}
#define CK(call)                                                              \
    do {                                                                      \
        CUresult ck_r_ = (call);                                              \
        if (ck_r_ != CUDA_SUCCESS) cu_fail(ck_r_, #call, __FILE__, __LINE__); \
    } while (0)

/* ------------------------------------------------------------ thread pool */
typedef void (*pjob_fn)(void *arg, int idx, int n);
typedef struct pool pool_t;
typedef struct { pool_t *p; int idx; } pw_arg_t;
struct pool {
    int nth, set_ctx;
    pthread_t th[32];
    pw_arg_t pa[32];
    pthread_mutex_t mu;
    pthread_cond_t cv, cvd;
    unsigned gen;
    int active, pending;
    pjob_fn fn;
    void *arg;
};
static CUcontext g_ctx;

static void *pool_worker(void *a) {
    pw_arg_t *pa = (pw_arg_t *)a;
    pool_t *p = pa->p;
    unsigned seen = 0;
    if (p->set_ctx) CK(cuCtxSetCurrent(g_ctx));
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->gen == seen) pthread_cond_wait(&p->cv, &p->mu);
        seen = p->gen;
        if (pa->idx < p->active) {
            pjob_fn fn = p->fn;
            void *arg = p->arg;
            int n = p->active;
            pthread_mutex_unlock(&p->mu);
            fn(arg, pa->idx, n);
            pthread_mutex_lock(&p->mu);
            if (--p->pending == 0) pthread_cond_signal(&p->cvd);
        }
    }
    return NULL;
}
static void pool_init(pool_t *p, int nth, int set_ctx) {
    memset(p, 0, sizeof *p);
    if (nth > 32) nth = 32;
    if (nth < 1) nth = 1;
    p->nth = nth;
    p->set_ctx = set_ctx;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    pthread_cond_init(&p->cvd, NULL);
    for (int i = 0; i < nth; i++) {
        p->pa[i].p = p;
        p->pa[i].idx = i;
        if (pthread_create(&p->th[i], NULL, pool_worker, &p->pa[i]) != 0) {
            fprintf(stderr, "pthread_create failed\n");
            _exit(1);
        }
    }
}
/* runs fn(arg, i, active) on workers 0..active-1 and waits for all of them */
static void pool_run(pool_t *p, int active, pjob_fn fn, void *arg) {
    if (active > p->nth) active = p->nth;
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->active = active;
    p->pending = active;
    p->gen++;
    pthread_cond_broadcast(&p->cv);
    while (p->pending > 0) pthread_cond_wait(&p->cvd, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

static pool_t g_chk; /* checking / pattern threads (no CUDA)  */
static pool_t g_gat; /* CPU gather / scatter workers (CUDA)    */

typedef void (*range_fn)(void *arg, size_t i0, size_t i1);
typedef struct { range_fn fn; void *arg; size_t n; } pfor_t;
static void pfor_job(void *a, int idx, int n) {
    pfor_t *pf = (pfor_t *)a;
    size_t i0 = pf->n * (size_t)idx / (size_t)n, i1 = pf->n * (size_t)(idx + 1) / (size_t)n;
    if (i1 > i0) pf->fn(pf->arg, i0, i1);
}
static void pfor(size_t n, range_fn fn, void *arg) {
    pfor_t pf = {fn, arg, n};
    pool_run(&g_chk, n < 256 ? 1 : g_chk.nth, pfor_job, &pf);
}

/* ------------------------------------------------------------ child state */
typedef CUresult (*batch_fn_t)(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                               size_t count, CUmemcpyAttributes *attrs, size_t *attrsIdxs,
                               size_t numAttrs, size_t *failIdx, CUstream hStream);
static batch_fn_t g_batch;          /* CUDA 12.8 ABI (with failIdx) */
static int g_ok_order[2][4];        /* [dir][order]: batch works    */
static int g_ok_overlap, g_ok_d2d, g_ok_d2d_overlap;
static CUdevice g_dev;
static CUstream g_s[4];
static CUevent ev_start, ev_end, ev_part[4], ev_aux;
static CUstream wk_s[MAX_T];
static CUevent wk_ev[MAX_T][NSLOT], wk_done[MAX_T];
static uint8_t *wk_buf[MAX_T][NSLOT];
static uint8_t *g_pool, *g_img, *g_scr, *g_snap;
static size_t g_pool_bytes, g_img_bytes;
static unsigned g_call;
static long g_bad;

typedef struct { CUdeviceptr *dst, *src; size_t *size; size_t n; } clist_t;
typedef struct {
    int si, NB, M;
    size_t B, W, NI;
    CUdeviceptr dev[L_TENSORS];
    CUdeviceptr stg;
    size_t stg_bytes;
    uint8_t *host[L_TENSORS];
    uint8_t *hreg[L_TENSORS];      /* contiguous host region view (f rows)      */
    CUdeviceptr vstg[L_TENSORS];   /* staging viewed as L tensors of M rows     */
    CUdeviceptr vstg_hi[L_TENSORS];/* upper half of staging (D2D reference dst) */
    int *dperm, *hperm, *iden;
    int *map_sc, *map_hc;          /* device row -> host source block, or -1    */
    clist_t h2d_sc, h2d_hc, d2h_sc, d2h_hc, d2h_both, scat, gath, ref1;
    int snap_sc[SNAP_PER_T], snap_hc[SNAP_PER_T];
    size_t ipc;                    /* items (blocks) per pipeline chunk          */
    int nchunks;
    size_t off[L_TENSORS];         /* this call's check window offset per tensor */
} bctx_t;
static bctx_t g_b;

enum { SIDE_HOST = 1, SIDE_DEV = 2, SIDE_CONTIG = 3 };
#define WORD_K 0xD1B54A32D192ED03ULL
#define POISON64 0xEEEEEEEEEEEEEEEEULL

static inline uint64_t row_base(int side, int t, int blk) {
    return mix64(((uint64_t)g_call << 40) ^ ((uint64_t)side << 36) ^ ((uint64_t)t << 28) ^
                 (uint64_t)(unsigned)blk ^ RNG_SEED);
}
static void fill_win(uint64_t *p, const bctx_t *b, int side, int t, int blk, size_t off) {
    uint64_t base = row_base(side, t, blk);
    size_t w0 = off / 8, nw = b->W / 8;
    for (size_t j = 0; j < nw; j++) p[j] = base + (w0 + j) * WORD_K;
}
static long check_win(const uint64_t *p, const bctx_t *b, int side, int t, int blk, size_t off,
                      uint64_t *exp_out) {
    uint64_t base = row_base(side, t, blk);
    size_t w0 = off / 8, nw = b->W / 8;
    for (size_t j = 0; j < nw; j++) {
        uint64_t e = base + (w0 + j) * WORD_K;
        if (p[j] != e) { *exp_out = e; return (long)j; }
    }
    return -1;
}
static void report_bad(const char *what, int t, long row, size_t byte_off, uint64_t exp,
                       uint64_t got) {
    long n = __atomic_add_fetch(&g_bad, 1, __ATOMIC_RELAXED);
    if (n <= 6) {
        pthread_mutex_lock(&g_print_mu);
        printf("    MISMATCH [%s] call %u tensor %d row/block %ld byte %zu: expected %016llx "
               "got %016llx\n", what, g_call, t, row, byte_off, (unsigned long long)exp,
               (unsigned long long)got);
        fflush(stdout);
        pthread_mutex_unlock(&g_print_mu);
    }
}

/* ---- host windows: fill (pattern), poison, check.  row k of tensor t is
 * hb[t] + ids[k]*B; its identity (pattern block id) is idl[k]. */
enum { HM_FILL, HM_POISON, HM_CHECK };
typedef struct {
    uint8_t **hb;
    const int *ids, *idl;
    int m, side, mode, nt;
    const char *what;
} hjob_t;
static void hjob_range(void *a_, size_t i0, size_t i1) {
    hjob_t *a = (hjob_t *)a_;
    const bctx_t *b = &g_b;
    for (size_t i = i0; i < i1; i++) {
        int t = (int)(i / (size_t)a->m), k = (int)(i % (size_t)a->m);
        size_t off = b->off[t];
        uint64_t *p = (uint64_t *)(a->hb[t] + (size_t)a->ids[k] * b->B + off);
        if (a->mode == HM_FILL) {
            fill_win(p, b, a->side, t, a->idl[k], off);
        } else if (a->mode == HM_POISON) {
            memset(p, 0xEE, b->W);
        } else {
            uint64_t e = 0;
            long j = check_win(p, b, a->side, t, a->idl[k], off, &e);
            if (j >= 0) report_bad(a->what, t, a->ids[k], off + 8 * (size_t)j, e, p[j]);
        }
    }
}
static void host_op(uint8_t **hb, const int *ids, const int *idl, int m, int side, int mode,
                    const char *what) {
    hjob_t a = {hb, ids, idl, m, side, mode, L_TENSORS, what};
    pfor((size_t)L_TENSORS * (size_t)m, hjob_range, &a);
}

/* ---- image (host, compact rows of W bytes): row (t,r) at g_img + (t*nrows+r)*W.
 * img_fill writes the pattern of identity idl[k] into row (t, rows[k]). */
typedef struct { int nrows, m, side; const int *rows, *idl; } ijob_t;
static void ijob_range(void *a_, size_t i0, size_t i1) {
    ijob_t *a = (ijob_t *)a_;
    const bctx_t *b = &g_b;
    for (size_t i = i0; i < i1; i++) {
        int t = (int)(i / (size_t)a->m), k = (int)(i % (size_t)a->m);
        uint64_t *p = (uint64_t *)(g_img + ((size_t)t * (size_t)a->nrows + (size_t)a->rows[k]) * b->W);
        fill_win(p, b, a->side, t, a->idl[k], b->off[t]);
    }
}
static void img_fill(int nrows, int nt, const int *rows, const int *idl, int m, int side) {
    ijob_t a = {nrows, m, side, rows, idl};
    pfor((size_t)nt * (size_t)m, ijob_range, &a);
}
/* upload image rows to the windows of device view v (nt tensors x nrows rows) */
static void img_upload(const CUdeviceptr *v, int nrows, int nt) {
    const bctx_t *b = &g_b;
    for (int t = 0; t < nt; t++) {
        CUDA_MEMCPY2D c;
        memset(&c, 0, sizeof c);
        c.srcMemoryType = CU_MEMORYTYPE_HOST;
        c.srcHost = g_img + (size_t)t * (size_t)nrows * b->W;
        c.srcPitch = b->W;
        c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
        c.dstDevice = v[t];
        c.dstXInBytes = b->off[t];
        c.dstPitch = b->B;
        c.WidthInBytes = b->W;
        c.Height = (size_t)nrows;
        CK(cuMemcpy2DAsync(&c, g_s[0]));
    }
}
/* fetch the windows of device view v into g_scr (same layout as the image) */
static void dev_fetch(const CUdeviceptr *v, int nrows, int nt) {
    const bctx_t *b = &g_b;
    for (int t = 0; t < nt; t++) {
        CUDA_MEMCPY2D c;
        memset(&c, 0, sizeof c);
        c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
        c.srcDevice = v[t];
        c.srcXInBytes = b->off[t];
        c.srcPitch = b->B;
        c.dstMemoryType = CU_MEMORYTYPE_HOST;
        c.dstHost = g_scr + (size_t)t * (size_t)nrows * b->W;
        c.dstPitch = b->W;
        c.WidthInBytes = b->W;
        c.Height = (size_t)nrows;
        CK(cuMemcpy2DAsync(&c, g_s[0]));
    }
    CK(cuStreamSynchronize(g_s[0]));
}
/* check fetched windows: map[r] >= 0: pattern (side, t, map[r]); else other */
enum { OTH_NONE, OTH_POISON, OTH_IMAGE };
typedef struct { int nrows, side, other; const int *map; const char *what; } djob_t;
static void djob_range(void *a_, size_t i0, size_t i1) {
    djob_t *a = (djob_t *)a_;
    const bctx_t *b = &g_b;
    size_t nw = b->W / 8;
    for (size_t i = i0; i < i1; i++) {
        int t = (int)(i / (size_t)a->nrows), r = (int)(i % (size_t)a->nrows);
        const uint64_t *p = (const uint64_t *)(g_scr + i * b->W);
        size_t off = b->off[t];
        if (a->map[r] >= 0) {
            uint64_t e = 0;
            long j = check_win(p, b, a->side, t, a->map[r], off, &e);
            if (j >= 0) report_bad(a->what, t, r, off + 8 * (size_t)j, e, p[j]);
        } else if (a->other == OTH_POISON) {
            for (size_t j = 0; j < nw; j++)
                if (p[j] != POISON64) {
                    report_bad("non-moved device block overwritten", t, r, off + 8 * j, POISON64, p[j]);
                    break;
                }
        } else if (a->other == OTH_IMAGE) {
            const uint64_t *q = (const uint64_t *)(g_img + i * b->W);
            for (size_t j = 0; j < nw; j++)
                if (p[j] != q[j]) {
                    report_bad("non-moved device block changed", t, r, off + 8 * j, q[j], p[j]);
                    break;
                }
        }
    }
}
static void dev_check(int nrows, int nt, const int *map, int side, int other, const char *what) {
    djob_t a = {nrows, side, other, map, what};
    pfor((size_t)nt * (size_t)nrows, djob_range, &a);
}

/* ---- snapshots of a few non-moved host blocks (full blocks) */
typedef struct { const int *ids; int t0, check; } sjob_t;
static void sjob_range(void *a_, size_t i0, size_t i1) {
    sjob_t *a = (sjob_t *)a_;
    const bctx_t *b = &g_b;
    for (size_t i = i0; i < i1; i++) {
        int t = a->t0 + (int)(i / SNAP_PER_T), j = (int)(i % SNAP_PER_T);
        uint8_t *h = b->host[t] + (size_t)a->ids[j] * b->B;
        uint8_t *s = g_snap + ((size_t)t * SNAP_PER_T + (size_t)j) * b->B;
        if (!a->check) {
            memcpy(s, h, b->B);
        } else if (memcmp(s, h, b->B) != 0) {
            size_t o = 0;
            while (o + 8 <= b->B && memcmp(s + o, h + o, 8) == 0) o += 8;
            uint64_t e = 0, g = 0;
            memcpy(&e, s + o, 8);
            memcpy(&g, h + o, 8);
            report_bad("non-moved host block changed", t, a->ids[j], o, e, g);
        }
    }
}
static void snap(const int *ids, int t0, int check) {
    sjob_t a = {ids, t0, check};
    pfor((size_t)(L_TENSORS - t0) * SNAP_PER_T, sjob_range, &a);
}

/* ------------------------------------------------------------ copy issue */
static void issue_batch(const clist_t *c, size_t i0, size_t i1, int order, unsigned flags,
                        CUstream s) {
    CUmemcpyAttributes a;
    memset(&a, 0, sizeof a);
    a.srcAccessOrder = (CUmemcpySrcAccessOrder)order;
    a.flags = flags;
    size_t step = g_batch_max ? g_batch_max : (i1 - i0);
    for (size_t i = i0; i < i1; i += step) {
        size_t n = (i1 - i < step) ? i1 - i : step;
        size_t aidx = 0, fail = (size_t)-1;
        CUresult r = g_batch(c->dst + i, c->src + i, c->size + i, n, &a, &aidx, 1, &fail, s);
        if (r != CUDA_SUCCESS) {
            const char *nm = NULL;
            cuGetErrorName(r, &nm);
            child_fatal(ST_ERR, "cuMemcpyBatchAsync(count=%zu, order=%d, flags=%u) -> %d %s, "
                        "failIdx=%zu", n, order, flags, (int)r, nm ? nm : "?", fail);
        }
    }
}
static void issue_sep(const clist_t *c, int dir, CUstream s) {
    for (size_t i = 0; i < c->n; i++) {
        if (dir == DIR_H2D)
            CK(cuMemcpyHtoDAsync(c->dst[i], (const void *)(uintptr_t)c->src[i], c->size[i], s));
        else
            CK(cuMemcpyDtoHAsync((void *)(uintptr_t)c->dst[i], c->src[i], c->size[i], s));
    }
}
static void wait_event(CUevent e) {
    double t0 = now_s();
    unsigned spins = 0;
    for (;;) {
        CUresult r = cuEventQuery(e);
        if (r == CUDA_SUCCESS) return;
        if (r != CUDA_ERROR_NOT_READY) CK(r);
        if ((++spins & 1023u) == 0) {
            if (now_s() - t0 > WAIT_TIMEOUT_S)
                child_fatal(ST_HANG, "call not complete after %.0f s", WAIT_TIMEOUT_S);
            sched_yield();
        }
    }
}

/* ---- CPU gather (H2D e) and CPU scatter (D2H e) workers, one stream each */
typedef struct { int pc; const int *hs; } gjob_t;
static void job_gather_h2d(void *a_, int w, int T) {
    gjob_t *a = (gjob_t *)a_;
    const bctx_t *b = &g_b;
    CK(cuStreamWaitEvent(wk_s[w], ev_start, 0));
    int j = 0;
    for (int c = w; c < b->nchunks; c += T, j++) {
        int slot = j % NSLOT;
        if (j >= NSLOT) CK(cuEventSynchronize(wk_ev[w][slot]));
        size_t i0 = (size_t)c * b->ipc, i1 = i0 + b->ipc;
        if (i1 > b->NI) i1 = b->NI;
        uint8_t *buf = wk_buf[w][slot];
        for (size_t i = i0; i < i1; i++) {
            int t = (int)(i / (size_t)b->M), k = (int)(i % (size_t)b->M);
            memcpy(buf + (i - i0) * b->B, b->host[t] + (size_t)a->hs[k] * b->B, b->B);
        }
        CK(cuMemcpyHtoDAsync(b->stg + i0 * b->B, buf, (i1 - i0) * b->B, wk_s[w]));
        CK(cuEventRecord(wk_ev[w][slot], wk_s[w]));
        if (a->pc) issue_batch(&b->scat, i0, i1, O_STREAM, 0, wk_s[w]);
    }
    CK(cuEventRecord(wk_done[w], wk_s[w]));
}
static void d2h_chunk_issue(const bctx_t *b, int w, int T, int j) {
    int c = w + j * T;
    size_t i0 = (size_t)c * b->ipc, i1 = i0 + b->ipc;
    if (i1 > b->NI) i1 = b->NI;
    CK(cuMemcpyDtoHAsync(wk_buf[w][j % NSLOT], b->stg + i0 * b->B, (i1 - i0) * b->B, wk_s[w]));
    CK(cuEventRecord(wk_ev[w][j % NSLOT], wk_s[w]));
}
static void job_scatter_d2h(void *a_, int w, int T) {
    gjob_t *a = (gjob_t *)a_;
    const bctx_t *b = &g_b;
    int nw = b->nchunks > w ? (b->nchunks - w + T - 1) / T : 0;
    CK(cuStreamWaitEvent(wk_s[w], ev_aux, 0));
    for (int j = 0; j < nw && j < NSLOT; j++) d2h_chunk_issue(b, w, T, j);
    for (int j = 0; j < nw; j++) {
        int slot = j % NSLOT, c = w + j * T;
        CK(cuEventSynchronize(wk_ev[w][slot]));
        size_t i0 = (size_t)c * b->ipc, i1 = i0 + b->ipc;
        if (i1 > b->NI) i1 = b->NI;
        const uint8_t *buf = wk_buf[w][slot];
        for (size_t i = i0; i < i1; i++) {
            int t = (int)(i / (size_t)b->M), k = (int)(i % (size_t)b->M);
            memcpy(b->host[t] + (size_t)a->hs[k] * b->B, buf + (i - i0) * b->B, b->B);
        }
        if (j + NSLOT < nw) d2h_chunk_issue(b, w, T, j + NSLOT);
    }
    CK(cuEventRecord(wk_done[w], wk_s[w]));
}

/* ------------------------------------------------------------ per-B setup */
static void cl_init(clist_t *c, size_t cap) {
    c->dst = (CUdeviceptr *)xmalloc(cap * sizeof *c->dst);
    c->src = (CUdeviceptr *)xmalloc(cap * sizeof *c->src);
    c->size = (size_t *)xmalloc(cap * sizeof *c->size);
    c->n = 0;
}
static void cl_free(clist_t *c) {
    free(c->dst); free(c->src); free(c->size);
    memset(c, 0, sizeof *c);
}
static void cl_push(clist_t *c, CUdeviceptr d, CUdeviceptr s, size_t n) {
    c->dst[c->n] = d; c->src[c->n] = s; c->size[c->n] = n; c->n++;
}
/* host<->device list, merging runs of adjacent ids on both sides */
static void build_hd(clist_t *c, int h2d, const int *dev_ids, const int *host_ids, int m) {
    bctx_t *b = &g_b;
    cl_init(c, (size_t)L_TENSORS * (size_t)m);
    for (int t = 0; t < L_TENSORS; t++) {
        int k = 0;
        while (k < m) {
            int len = 1;
            while (k + len < m && dev_ids[k + len] == dev_ids[k] + len &&
                   host_ids[k + len] == host_ids[k] + len)
                len++;
            CUdeviceptr dp = b->dev[t] + (size_t)dev_ids[k] * b->B;
            CUdeviceptr hp = (CUdeviceptr)(uintptr_t)(b->host[t] + (size_t)host_ids[k] * b->B);
            if (h2d) cl_push(c, dp, hp, (size_t)len * b->B);
            else cl_push(c, hp, dp, (size_t)len * b->B);
            k += len;
        }
    }
}
/* staging item (t,k) <-> device block dperm[k] of tensor t (one per block) */
static void build_dd(clist_t *c, int scatter) {
    bctx_t *b = &g_b;
    cl_init(c, b->NI);
    for (int t = 0; t < L_TENSORS; t++)
        for (int k = 0; k < b->M; k++) {
            CUdeviceptr sp = b->stg + ((size_t)t * (size_t)b->M + (size_t)k) * b->B;
            CUdeviceptr dp = b->dev[t] + (size_t)b->dperm[k] * b->B;
            if (scatter) cl_push(c, dp, sp, b->B);
            else cl_push(c, sp, dp, b->B);
        }
}

static void setup_b(int si) {
    bctx_t *b = &g_b;
    memset(b, 0, sizeof *b);
    b->si = si;
    b->B = g_si[si].B;
    b->NB = g_si[si].NB;
    b->M = g_si[si].M;
    b->W = b->B / CHECK_DIV;
    b->NI = (size_t)L_TENSORS * (size_t)b->M;
    size_t tbytes = (size_t)b->NB * b->B;
    b->stg_bytes = b->NI * b->B;
    size_t fr = 0, tot = 0;
    CK(cuMemGetInfo(&fr, &tot));
    if (fr < tbytes * L_TENSORS + b->stg_bytes + ((size_t)1 << 30))
        child_fatal(ST_ERR, "not enough device memory: free %.1f GiB, need %.1f GiB",
                    fr / 1073741824.0, (tbytes * L_TENSORS + b->stg_bytes) / 1073741824.0);
    for (int t = 0; t < L_TENSORS; t++) {
        CK(cuMemAlloc(&b->dev[t], tbytes));
        b->host[t] = g_pool + (size_t)t * tbytes;
        b->hreg[t] = g_pool + (size_t)t * (size_t)b->M * b->B;
        b->vstg[t] = 0;
    }
    CK(cuMemAlloc(&b->stg, b->stg_bytes));
    for (int t = 0; t < L_TENSORS; t++) {
        b->vstg[t] = b->stg + (size_t)t * (size_t)b->M * b->B;
        b->vstg_hi[t] = (t < L_TENSORS / 2)
            ? b->stg + (size_t)(L_TENSORS / 2 + t) * (size_t)b->M * b->B : 0;
    }
    b->dperm = (int *)xmalloc((size_t)b->NB * sizeof(int));
    b->hperm = (int *)xmalloc((size_t)b->NB * sizeof(int));
    b->iden = (int *)xmalloc((size_t)b->NB * sizeof(int));
    b->map_sc = (int *)xmalloc((size_t)b->NB * sizeof(int));
    b->map_hc = (int *)xmalloc((size_t)b->NB * sizeof(int));
    shuffle(b->dperm, b->NB, RNG_SEED ^ 0x1111ULL ^ ((uint64_t)b->B << 20));
    shuffle(b->hperm, b->NB, RNG_SEED ^ 0x2222ULL ^ ((uint64_t)b->B << 24));
    for (int i = 0; i < b->NB; i++) { b->iden[i] = i; b->map_sc[i] = -1; b->map_hc[i] = -1; }
    for (int k = 0; k < b->M; k++) { b->map_sc[b->dperm[k]] = b->hperm[k]; b->map_hc[b->dperm[k]] = k; }
    build_hd(&b->h2d_sc, 1, b->dperm, b->hperm, b->M);
    build_hd(&b->h2d_hc, 1, b->dperm, b->iden, b->M);
    build_hd(&b->d2h_sc, 0, b->dperm, b->hperm, b->M);
    build_hd(&b->d2h_hc, 0, b->dperm, b->iden, b->M);
    build_hd(&b->d2h_both, 0, b->dperm + b->M, b->hperm + b->M, b->M);
    build_dd(&b->scat, 1);
    build_dd(&b->gath, 0);
    cl_init(&b->ref1, 1);
    cl_push(&b->ref1, b->vstg_hi[0], b->stg, b->stg_bytes / 2);
    for (int j = 0; j < SNAP_PER_T; j++) b->snap_sc[j] = b->hperm[2 * b->M + j];
    b->snap_hc[0] = b->M;
    b->snap_hc[1] = b->M + 1;
    b->snap_hc[2] = (b->M + b->NB) / 2;
    b->snap_hc[3] = b->NB - 1;
    b->ipc = CHUNK_BYTES / b->B;
    if (b->ipc < 1) b->ipc = 1;
    b->nchunks = (int)((b->NI + b->ipc - 1) / b->ipc);
    for (int t = 0; t < L_TENSORS; t++) CK(cuMemsetD8Async(b->dev[t], 0xEE, tbytes, g_s[0]));
    CK(cuMemsetD8Async(b->stg, 0xEE, b->stg_bytes, g_s[0]));
    CK(cuStreamSynchronize(g_s[0]));
    printf("== B=%zu KiB: NB=%d M=%d (tensors %.1f GiB per side), %.1f MiB per call; copies per "
           "call: h2d %zu, d2h %zu, hc %zu, both-offload %zu, d2d %zu; %d chunks of %zu blocks\n",
           b->B >> 10, b->NB, b->M, (double)tbytes * L_TENSORS / 1073741824.0,
           (double)b->NI * b->B / 1048576.0, b->h2d_sc.n, b->d2h_sc.n, b->h2d_hc.n,
           b->d2h_both.n, b->scat.n, b->nchunks, b->ipc);
    fflush(stdout);
}
static void teardown_b(void) {
    bctx_t *b = &g_b;
    CK(cuStreamSynchronize(g_s[0]));
    for (int t = 0; t < L_TENSORS; t++) CK(cuMemFree(b->dev[t]));
    CK(cuMemFree(b->stg));
    cl_free(&b->h2d_sc); cl_free(&b->h2d_hc); cl_free(&b->d2h_sc); cl_free(&b->d2h_hc);
    cl_free(&b->d2h_both); cl_free(&b->scat); cl_free(&b->gath); cl_free(&b->ref1);
    free(b->dperm); free(b->hperm); free(b->iden); free(b->map_sc); free(b->map_hc);
    memset(b, 0, sizeof *b);
}

/* ------------------------------------------------------------ one call */
static int g_pick_h = -1, g_pick_d = -1; /* both-at-once choices (strategy idx) */

static void dev_poison_tensors(void) {
    const bctx_t *b = &g_b;
    for (int t = 0; t < L_TENSORS; t++)
        CK(cuMemsetD8Async(b->dev[t], 0xEE, (size_t)b->NB * b->B, g_s[0]));
}
static void stage_poison(void) { CK(cuMemsetD8Async(g_b.stg, 0xEE, g_b.stg_bytes, g_s[0])); }
static int region_t0(void) { return (int)(((size_t)L_TENSORS * g_b.M + g_b.NB - 1) / g_b.NB); }

static void prep_call(const strat_t *s) {
    bctx_t *b = &g_b;
    int M = b->M;
    for (int t = 0; t < L_TENSORS; t++) {
        uint64_t h = mix64(((uint64_t)g_call << 16) ^ (uint64_t)t ^ (0x77ULL << 56));
        size_t slots = (b->B - b->W) / 8 + 1;
        b->off[t] = (size_t)(h % slots) * 8;
    }
    if (s->dir == DIR_H2D) {
        switch (s->kind) {
        case K_SCATTER_ONLY: /* staging holds what a gather would have produced */
            img_fill(M, L_TENSORS, b->iden, b->hperm, M, SIDE_HOST);
            img_upload(b->vstg, M, L_TENSORS);
            dev_poison_tensors();
            break;
        case K_CONTIG:
            host_op(b->hreg, b->iden, b->iden, M, SIDE_CONTIG, HM_FILL, "");
            stage_poison();
            break;
        case K_D2D_REF:
            stage_poison();
            img_fill(M, L_TENSORS / 2, b->iden, b->iden, M, SIDE_CONTIG);
            img_upload(b->vstg, M, L_TENSORS / 2);
            break;
        default: {
            const int *hs = s->hc ? b->iden : b->hperm;
            host_op(b->host, hs, hs, M, SIDE_HOST, HM_FILL, "");
            dev_poison_tensors();
        }
        }
    } else if (s->dir == DIR_D2H) {
        if (s->kind == K_CONTIG) {
            img_fill(M, L_TENSORS, b->iden, b->iden, M, SIDE_CONTIG);
            img_upload(b->vstg, M, L_TENSORS);
            host_op(b->hreg, b->iden, b->iden, M, 0, HM_POISON, "");
            snap(b->snap_sc, region_t0(), 0);
        } else {
            img_fill(b->NB, L_TENSORS, b->dperm, b->dperm, M, SIDE_DEV);
            img_upload(b->dev, b->NB, L_TENSORS);
            if (s->kind == K_GATHER_ONLY) {
                stage_poison();
            } else {
                const int *hs = s->hc ? b->iden : b->hperm;
                host_op(b->host, hs, hs, M, 0, HM_POISON, "");
                snap(s->hc ? b->snap_hc : b->snap_sc, 0, 0);
            }
        }
    } else { /* both: load hperm[0..M) -> dperm[0..M), offload dperm[M..2M) -> hperm[M..2M) */
        dev_poison_tensors();
        img_fill(b->NB, L_TENSORS, b->dperm + M, b->dperm + M, M, SIDE_DEV);
        img_upload(b->dev, b->NB, L_TENSORS);
        host_op(b->host, b->hperm, b->hperm, M, SIDE_HOST, HM_FILL, "");
        host_op(b->host, b->hperm + M, b->hperm + M, M, 0, HM_POISON, "");
        snap(b->snap_sc, 0, 0);
    }
    CK(cuStreamSynchronize(g_s[0]));
}

static void check_call(const strat_t *s) {
    bctx_t *b = &g_b;
    int M = b->M;
    if (s->dir == DIR_H2D) {
        if (s->kind == K_CONTIG) {
            dev_fetch(b->vstg, M, L_TENSORS);
            dev_check(M, L_TENSORS, b->iden, SIDE_CONTIG, OTH_NONE, "contiguous H2D dst");
        } else if (s->kind == K_D2D_REF) {
            dev_fetch(b->vstg_hi, M, L_TENSORS / 2);
            dev_check(M, L_TENSORS / 2, b->iden, SIDE_CONTIG, OTH_NONE, "contiguous D2D dst");
        } else {
            dev_fetch(b->dev, b->NB, L_TENSORS);
            dev_check(b->NB, L_TENSORS, s->hc ? b->map_hc : b->map_sc, SIDE_HOST, OTH_POISON,
                      "moved device block");
        }
    } else if (s->dir == DIR_D2H) {
        if (s->kind == K_CONTIG) {
            host_op(b->hreg, b->iden, b->iden, M, SIDE_CONTIG, HM_CHECK, "contiguous D2H dst");
            snap(b->snap_sc, region_t0(), 1);
        } else if (s->kind == K_GATHER_ONLY) {
            dev_fetch(b->vstg, M, L_TENSORS);
            dev_check(M, L_TENSORS, b->dperm, SIDE_DEV, OTH_NONE, "gathered staging block");
        } else {
            const int *hs = s->hc ? b->iden : b->hperm;
            host_op(b->host, hs, b->dperm, M, SIDE_DEV, HM_CHECK, "moved host block");
            snap(s->hc ? b->snap_hc : b->snap_sc, 0, 1);
        }
    } else {
        dev_fetch(b->dev, b->NB, L_TENSORS);
        dev_check(b->NB, L_TENSORS, b->map_sc, SIDE_HOST, OTH_IMAGE, "both: loaded device block");
        host_op(b->host, b->hperm + M, b->dperm + M, M, SIDE_DEV, HM_CHECK,
                "both: offloaded host block");
        snap(b->snap_sc, 0, 1);
    }
}

typedef struct { double ev_ms, host_us, wall_us, load_ms, off_ms; } tm_t;

static void issue_dir(int st, const clist_t *c, int dir, CUstream s) {
    if (st >= 0 && STRATS[st].kind == K_BATCH)
        issue_batch(c, 0, c->n, STRATS[st].order, STRATS[st].flags, s);
    else
        issue_sep(c, dir, s);
}

static void timed_call(const strat_t *s, tm_t *tm) {
    bctx_t *b = &g_b;
    CUstream s0 = g_s[0];
    const clist_t *cl = NULL;
    if (s->dir == DIR_H2D) cl = s->hc ? &b->h2d_hc : &b->h2d_sc;
    else if (s->dir == DIR_D2H) cl = s->hc ? &b->d2h_hc : &b->d2h_sc;
    gjob_t gj = {s->pc, b->hperm};
    CK(cuEventRecord(ev_start, s0));
    double t0 = now_s();
    switch (s->kind) {
    case K_SEP:
        issue_sep(cl, s->dir, s0);
        break;
    case K_BATCH:
        issue_batch(cl, 0, cl->n, s->order, s->flags, s0);
        break;
    case K_MULTI: {
        int ns = s->nstreams;
        for (int i = 1; i < ns; i++) CK(cuStreamWaitEvent(g_s[i], ev_start, 0));
        for (int i = 0; i < ns; i++) {
            size_t a = cl->n * (size_t)i / (size_t)ns, e = cl->n * (size_t)(i + 1) / (size_t)ns;
            if (e > a) issue_batch(cl, a, e, s->order, s->flags, g_s[i]);
        }
        for (int i = 1; i < ns; i++) {
            CK(cuEventRecord(ev_part[i], g_s[i]));
            CK(cuStreamWaitEvent(s0, ev_part[i], 0));
        }
        break;
    }
    case K_GATHER:
        pool_run(&g_gat, s->T, job_gather_h2d, &gj);
        for (int w = 0; w < s->T; w++) CK(cuStreamWaitEvent(s0, wk_done[w], 0));
        if (!s->pc) issue_batch(&b->scat, 0, b->scat.n, O_STREAM, 0, s0);
        break;
    case K_SCATTER_ONLY:
        issue_batch(&b->scat, 0, b->scat.n, O_STREAM, s->flags, s0);
        break;
    case K_CONTIG:
        if (s->dir == DIR_H2D) CK(cuMemcpyHtoDAsync(b->stg, g_pool, b->stg_bytes, s0));
        else CK(cuMemcpyDtoHAsync(g_pool, b->stg, b->stg_bytes, s0));
        break;
    case K_D2D_REF:
        if (s->order != O_NONE) issue_batch(&b->ref1, 0, 1, s->order, s->flags, s0);
        else CK(cuMemcpyDtoDAsync(b->vstg_hi[0], b->stg, b->stg_bytes / 2, s0));
        break;
    case K_HC_STAGE:
        if (s->dir == DIR_H2D) {
            for (int t = 0; t < L_TENSORS; t++)
                CK(cuMemcpyHtoDAsync(b->vstg[t], b->host[t], (size_t)b->M * b->B, s0));
            issue_batch(&b->scat, 0, b->scat.n, O_STREAM, 0, s0);
        } else {
            issue_batch(&b->gath, 0, b->gath.n, O_STREAM, 0, s0);
            for (int t = 0; t < L_TENSORS; t++)
                CK(cuMemcpyDtoHAsync(b->host[t], b->vstg[t], (size_t)b->M * b->B, s0));
        }
        break;
    case K_CPU_SCATTER:
        issue_batch(&b->gath, 0, b->gath.n, O_STREAM, 0, s0);
        CK(cuEventRecord(ev_aux, s0));
        pool_run(&g_gat, s->T, job_scatter_d2h, &gj);
        for (int w = 0; w < s->T; w++) CK(cuStreamWaitEvent(s0, wk_done[w], 0));
        break;
    case K_GATHER_ONLY:
        issue_batch(&b->gath, 0, b->gath.n, O_STREAM, s->flags, s0);
        break;
    case K_BOTH:
        CK(cuStreamWaitEvent(g_s[1], ev_start, 0));
        issue_dir(g_pick_h, &b->h2d_sc, DIR_H2D, s0);
        issue_dir(g_pick_d, &b->d2h_both, DIR_D2H, g_s[1]);
        CK(cuEventRecord(ev_part[0], s0));
        CK(cuEventRecord(ev_part[1], g_s[1]));
        CK(cuStreamWaitEvent(s0, ev_part[1], 0));
        break;
    }
    double t1 = now_s();
    CK(cuEventRecord(ev_end, s0));
    wait_event(ev_end);
    double t2 = now_s();
    float ms = 0;
    CK(cuEventElapsedTime(&ms, ev_start, ev_end));
    tm->ev_ms = ms;
    tm->host_us = (t1 - t0) * 1e6;
    tm->wall_us = (t2 - t0) * 1e6;
    tm->load_ms = tm->off_ms = 0;
    if (s->kind == K_BOTH) {
        CK(cuEventElapsedTime(&ms, ev_start, ev_part[0]));
        tm->load_ms = ms;
        CK(cuEventElapsedTime(&ms, ev_start, ev_part[1]));
        tm->off_ms = ms;
    }
}

/* returns number of wrong blocks found in this call */
static long one_call(const strat_t *s, tm_t *tm) {
    long bad0 = __atomic_load_n(&g_bad, __ATOMIC_RELAXED);
    g_call++;
    prep_call(s);
    timed_call(s, tm);
    check_call(s);
    return __atomic_load_n(&g_bad, __ATOMIC_RELAXED) - bad0;
}

static double size_weight(int si) { return (double)g_si[si].bytes / 1073741824.0 + 1.0; }
static int plan_reps(int si, int st, double tw) {
    double el = elapsed_s(), wsum = 0;
    for (int s2 = si; s2 < g_nsizes; s2++)
        wsum += size_weight(s2) * (s2 == si ? NSTRAT - st : NSTRAT);
    double remaining = g_budget_s - el - 2.0 * (g_nsizes - 1 - si);
    double share = remaining * size_weight(si) / (wsum > 0 ? wsum : 1);
    int reps = tw > 0 ? (int)(share / tw) : TIMED_MAX;
    if (reps > TIMED_MAX) reps = TIMED_MAX;
    if (reps < TIMED_MIN) reps = TIMED_MIN;
    if (tw * reps > MAX_CFG_S) reps = (int)(MAX_CFG_S / tw) < TIMED_MIN ? TIMED_MIN : (int)(MAX_CFG_S / tw);
    if (el + tw * reps > g_hard_s) reps = (g_hard_s - el) / tw >= 1 ? (int)((g_hard_s - el) / tw) : 1;
    return reps;
}

static void pick_both(int si) {
    double bh = -1, bd = -1;
    g_pick_h = g_pick_d = -1;
    for (int st = 0; st < NSTRAT; st++) {
        const strat_t *s = &STRATS[st];
        const result_t *r = &g_res[si][st];
        if (s->kind != K_BATCH || s->hc || s->order == O_DURING || r->status != ST_OK) continue;
        if (s->dir == DIR_H2D && r->med > bh) { bh = r->med; g_pick_h = st; }
        if (s->dir == DIR_D2H && r->med > bd) { bd = r->med; g_pick_d = st; }
    }
}

static result_t measure(int si, int st) {
    const strat_t *s = &STRATS[st];
    const bctx_t *b = &g_b;
    result_t r;
    memset(&r, 0, sizeof r);
    r.pick_h = r.pick_d = -1;
    int dir = s->dir == DIR_D2H ? 1 : 0;
    if (uses_batch(s) && !g_batch) { r.status = ST_NA; return r; }
    if ((s->kind == K_BATCH || s->kind == K_MULTI) &&
        (!g_ok_order[dir][s->order] || (s->flags && !g_ok_overlap))) { r.status = ST_NA; return r; }
    if (uses_d2d(s) && (!g_ok_d2d || (s->flags && !g_ok_d2d_overlap))) { r.status = ST_NA; return r; }
    if (s->kind == K_BOTH) {
        pick_both(si);
        r.pick_h = g_pick_h;
        r.pick_d = g_pick_d;
    }
    if (elapsed_s() > g_hard_s) { r.status = ST_SKIP; return r; }

    size_t bytes = b->NI * b->B;
    if (s->kind == K_D2D_REF) bytes /= 2;
    if (s->kind == K_BOTH) bytes *= 2;
    switch (s->kind) {
    case K_SEP: case K_BATCH: case K_MULTI:
        r.copies = (long)(s->hc ? b->h2d_hc.n : b->h2d_sc.n); break;
    case K_GATHER: r.copies = (long)(b->nchunks + b->scat.n); break;
    case K_SCATTER_ONLY: case K_GATHER_ONLY: r.copies = (long)b->scat.n; break;
    case K_HC_STAGE: r.copies = (long)(L_TENSORS + b->scat.n); break;
    case K_CPU_SCATTER: r.copies = (long)(b->gath.n + b->nchunks); break;
    case K_BOTH: r.copies = (long)(b->h2d_sc.n + b->d2h_both.n); break;
    default: r.copies = 1;
    }

    tm_t tm;
    double ev[TIMED_MAX], wl[TIMED_MAX], hu[TIMED_MAX], lo[TIMED_MAX], of[TIMED_MAX];
    double tw0 = now_s();
    for (int w = 0; w < WARMUP; w++)
        if (one_call(s, &tm) > 0) { r.status = ST_FAIL; return r; }
    double tw = (now_s() - tw0) / WARMUP;
    int reps = plan_reps(si, st, tw);
    for (int i = 0; i < reps; i++) {
        if (one_call(s, &tm) > 0) { r.status = ST_FAIL; r.n = i + 1; return r; }
        ev[i] = (double)bytes / (tm.ev_ms * 1e-3) / 1e9;
        wl[i] = (double)bytes / (tm.wall_us * 1e-6) / 1e9;
        hu[i] = tm.host_us;
        lo[i] = tm.load_ms > 0 ? (double)(bytes / 2) / (tm.load_ms * 1e-3) / 1e9 : 0;
        of[i] = tm.off_ms > 0 ? (double)(bytes / 2) / (tm.off_ms * 1e-3) / 1e9 : 0;
    }
    r.status = ST_OK;
    r.n = reps;
    r.split = uses_batch(s) || (s->kind == K_BOTH && (g_pick_h >= 0 || g_pick_d >= 0))
                  ? (long)g_batch_max : 0;
    r.ev_med = median(ev, reps);
    r.wall_med = median(wl, reps);
    r.host_us = median(hu, reps);
    r.load_med = median(lo, reps);
    r.off_med = median(of, reps);
    const double *v = s->wall ? wl : ev;
    r.med = median(v, reps);
    r.mn = r.mx = v[0];
    for (int i = 1; i < reps; i++) {
        if (v[i] < r.mn) r.mn = v[i];
        if (v[i] > r.mx) r.mx = v[i];
    }
    return r;
}

/* ------------------------------------------------------------ child init */
static void probe_batch(void) {
    void *p = NULL;
    CUdriverProcAddressQueryResult q = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult rc = cuGetProcAddress("cuMemcpyBatchAsync", &p, 12080, CU_GET_PROC_ADDRESS_DEFAULT, &q);
    if (rc != CUDA_SUCCESS || p == NULL || q != CU_GET_PROC_ADDRESS_SUCCESS) {
        printf("batch unavailable (cuGetProcAddress(\"cuMemcpyBatchAsync\", 12080) rc=%d "
               "status=%d): batch rows will read n/a\n", (int)rc, (int)q);
        return;
    }
    g_batch = (batch_fn_t)p;
    /* tiny functional probes: 2 non-adjacent 4 KiB copies per direction/order */
    const size_t SZ = 64 << 10, C = 4 << 10;
    uint8_t *h = NULL;
    CUdeviceptr d = 0;
    CK(cuMemHostAlloc((void **)&h, 2 * SZ, 0));
    CK(cuMemAlloc(&d, 2 * SZ));
    uint8_t *hs = h, *hd = h + SZ;
    CUdeviceptr ds = d, dd = d + SZ;
    int n_ok = 0, n_try = 0;
    /* dir 0 H2D, 1 D2H, 2 D2D */
    static const int TESTS[][3] = {{0, O_STREAM, 0}, {0, O_DURING, 0}, {0, O_ANY, 0},
                                   {0, O_STREAM, 1}, {1, O_STREAM, 0}, {1, O_DURING, 0},
                                   {1, O_ANY, 0},    {2, O_STREAM, 0}, {2, O_STREAM, 1}};
    for (int test = 0; test < (int)(sizeof TESTS / sizeof TESTS[0]); test++) {
        int dir = TESTS[test][0], order = TESTS[test][1];
        unsigned flags = (unsigned)TESTS[test][2];
        uint8_t val = (uint8_t)(0x30 + test);
        CUdeviceptr dst[2], src[2];
        size_t sz[2] = {C, C};
        memset(h, 0x11, 2 * SZ);
        CK(cuMemsetD8Async(d, 0x22, 2 * SZ, g_s[0]));
        if (dir == 0) {
            memset(hs + 4096, val, C); memset(hs + 24576, val, C);
            src[0] = (CUdeviceptr)(uintptr_t)(hs + 4096); dst[0] = dd + 8192;
            src[1] = (CUdeviceptr)(uintptr_t)(hs + 24576); dst[1] = dd + 40960;
        } else if (dir == 1) {
            CK(cuMemsetD8Async(ds, val, SZ, g_s[0]));
            src[0] = ds + 4096; dst[0] = (CUdeviceptr)(uintptr_t)(hd + 8192);
            src[1] = ds + 24576; dst[1] = (CUdeviceptr)(uintptr_t)(hd + 40960);
        } else {
            CK(cuMemsetD8Async(ds, val, SZ, g_s[0]));
            src[0] = ds + 4096; dst[0] = dd + 8192;
            src[1] = ds + 24576; dst[1] = dd + 40960;
        }
        CK(cuStreamSynchronize(g_s[0]));
        CUmemcpyAttributes a;
        memset(&a, 0, sizeof a);
        a.srcAccessOrder = (CUmemcpySrcAccessOrder)order;
        a.flags = flags;
        size_t aidx = 0, fail = (size_t)-1;
        n_try++;
        CUresult r = g_batch(dst, src, sz, 2, &a, &aidx, 1, &fail, g_s[0]);
        CUresult r2 = cuStreamSynchronize(g_s[0]);
        /* ok = accepted and completed; wrong data does not make a row n/a (the
         * real measurement then runs and reports FAIL) */
        int ok = (r == CUDA_SUCCESS && r2 == CUDA_SUCCESS), right = 0;
        if (ok) {
            if (dir != 1) CK(cuMemcpyDtoHAsync(hd, dd, SZ, g_s[0]));
            CK(cuStreamSynchronize(g_s[0]));
            right = 1;
            for (size_t i = 0; i < SZ; i++) {
                int moved = (i >= 8192 && i < 8192 + C) || (i >= 40960 && i < 40960 + C);
                uint8_t want = moved ? val : (dir == 1 ? 0x11 : 0x22);
                if (hd[i] != want) { right = 0; break; }
            }
        }
        const char *nm = NULL;
        if (r != CUDA_SUCCESS) cuGetErrorName(r, &nm);
        printf("  batch probe %-3s order=%d flags=%u: %s%s%s\n",
               dir == 0 ? "H2D" : (dir == 1 ? "D2H" : "D2D"), order, flags,
               !ok ? "not supported" : right ? "ok" : "accepted but WRONG BYTES",
               r != CUDA_SUCCESS ? " rc=" : "", nm ? nm : "");
        if (r2 != CUDA_SUCCESS) CK(r2);
        n_ok += ok && right;
        if (dir < 2 && !flags) g_ok_order[dir][order] = ok;
        if (dir == 0 && flags) g_ok_overlap = ok;
        if (dir == 2 && !flags) g_ok_d2d = ok;
        if (dir == 2 && flags) g_ok_d2d_overlap = ok;
    }
    CK(cuMemFree(d));
    CK(cuMemFreeHost(h));
    printf("  batch probes: %d of %d ok\n", n_ok, n_try);
}

static void child_main(int si0, int st0) {
    int drv = 0, v = 0;
    char name[256];
    CK(cuInit(0));
    CK(cuDeviceGet(&g_dev, 0));
    CK(cuDevicePrimaryCtxRetain(&g_ctx, g_dev));
    CK(cuCtxSetCurrent(g_ctx));
    CK(cuDriverGetVersion(&drv));
    CK(cuDeviceGetName(name, (int)sizeof name, g_dev));
    if (si0 == 0 && st0 == 0) {
        size_t tot = 0;
        int eng = 0, sms = 0, bus = 0;
        CK(cuDeviceTotalMem(&tot, g_dev));
        CK(cuDeviceGetAttribute(&eng, CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, g_dev));
        CK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, g_dev));
        CK(cuDeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, g_dev));
        CK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, g_dev));
        printf("device: %s, %.1f GiB, %d SMs, PCI bus %d, UVA %d\n", name, tot / 1073741824.0,
               sms, bus, v);
        printf("driver version (cuDriverGetVersion): %d; built with CUDA_VERSION %d\n", drv,
               CUDA_VERSION);
        printf("asyncEngineCount (CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT): %d\n", eng);
        printf("host CPUs online: %ld\n", sysconf(_SC_NPROCESSORS_ONLN));
    } else {
        printf("(child restarted at size %d strategy %d on %s)\n", si0, st0, name);
    }
    for (int i = 0; i < 4; i++) CK(cuStreamCreate(&g_s[i], CU_STREAM_NON_BLOCKING));
    CK(cuEventCreate(&ev_start, CU_EVENT_DEFAULT));
    CK(cuEventCreate(&ev_end, CU_EVENT_DEFAULT));
    CK(cuEventCreate(&ev_aux, CU_EVENT_DISABLE_TIMING));
    for (int i = 0; i < 4; i++) CK(cuEventCreate(&ev_part[i], CU_EVENT_DEFAULT));
    probe_batch();

    /* pinned host memory for the remaining sizes (allocated once) */
    size_t maxB = 0;
    g_pool_bytes = g_img_bytes = 0;
    for (int si = si0; si < g_nsizes; si++) {
        size_t tb = (size_t)L_TENSORS * (size_t)g_si[si].NB * g_si[si].B;
        if (tb > g_pool_bytes) g_pool_bytes = tb;
        if (tb / CHECK_DIV > g_img_bytes) g_img_bytes = tb / CHECK_DIV;
        if (g_si[si].B > maxB) maxB = g_si[si].B;
    }
    double ta = now_s();
    CK(cuMemHostAlloc((void **)&g_pool, g_pool_bytes, 0));
    double tb = now_s();
    CK(cuMemHostAlloc((void **)&g_img, g_img_bytes, 0));
    CK(cuMemHostAlloc((void **)&g_scr, g_img_bytes, 0));
    for (int w = 0; w < MAX_T; w++) {
        CK(cuStreamCreate(&wk_s[w], CU_STREAM_NON_BLOCKING));
        CK(cuEventCreate(&wk_done[w], CU_EVENT_DISABLE_TIMING));
        for (int j = 0; j < NSLOT; j++) {
            size_t sb = CHUNK_BYTES > maxB ? CHUNK_BYTES : maxB;
            CK(cuMemHostAlloc((void **)&wk_buf[w][j], sb, 0));
            CK(cuEventCreate(&wk_ev[w][j], CU_EVENT_DISABLE_TIMING));
        }
    }
    g_snap = (uint8_t *)xmalloc((size_t)L_TENSORS * SNAP_PER_T * maxB);
    printf("pinned host: tensors %.1f GiB (cuMemHostAlloc %.1f s), image+scratch 2 x %.2f GiB, "
           "rings %d x %d x %zu MiB (%.1f s total)\n", g_pool_bytes / 1073741824.0, tb - ta,
           g_img_bytes / 1073741824.0, MAX_T, NSLOT, CHUNK_BYTES >> 20, now_s() - ta);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    pool_init(&g_chk, ncpu > 16 ? 16 : (int)ncpu, 0);
    pool_init(&g_gat, MAX_T, 1);
    fflush(stdout);
    send_msg(MSG_HELLO, si0, -1, 0, NULL);

    for (int si = si0; si < g_nsizes; si++) {
        g_cur_si = si;
        g_cur_st = -1;
        send_msg(MSG_SETUP, si, -1, 0, NULL);
        setup_b(si);
        send_msg(MSG_BINFO, si, -1, 0, NULL);
        for (int st = (si == si0 ? st0 : 0); st < NSTRAT; st++) {
            const strat_t *s = &STRATS[st];
            g_cur_st = st;
            send_msg(MSG_START, si, st, 0, NULL);
            result_t r = measure(si, st);
            g_res[si][st] = r;
            send_msg(MSG_RESULT, si, st, 0, &r);
            const char *dn = s->dir == DIR_H2D ? "H2D" : (s->dir == DIR_D2H ? "D2H" : "BOTH");
            if (r.status == ST_OK) {
                printf("B=%3zuK %-4s %-27s n=%d  GB/s %7.2f [%6.2f..%6.2f]  host %9.0f us  "
                       "wall %7.2f GB/s  copies %ld", g_si[si].B >> 10, dn, s->name, r.n, r.med,
                       r.mn, r.mx, r.host_us, r.wall_med, r.copies);
                if (s->kind == K_BOTH)
                    printf("  load %.2f off %.2f GB/s (%s / %s)", r.load_med, r.off_med,
                           r.pick_h >= 0 ? STRATS[r.pick_h].name : "separate",
                           r.pick_d >= 0 ? STRATS[r.pick_d].name : "separate");
                printf("  ok  [t=%.0fs]\n", elapsed_s());
            } else {
                printf("B=%3zuK %-4s %-27s %s  [t=%.0fs]\n", g_si[si].B >> 10, dn, s->name,
                       ST_TXT[r.status], elapsed_s());
            }
            fflush(stdout);
        }
        g_cur_st = -1;
        teardown_b();
    }
    send_msg(MSG_DONE, -1, -1, 0, NULL);
    fflush(stdout);
    _exit(0);
}

/* ------------------------------------------------------------ parent */
static void read_env(void) {
    const char *e;
    if ((e = getenv("BLOCKS_CAP_GIB")) && atof(e) > 0) g_cap_gib = atof(e);
    if ((e = getenv("BLOCKS_BUDGET_S")) && atof(e) > 0) {
        g_budget_s = atof(e);
        g_hard_s = g_budget_s + 22;
        g_kill_s = g_budget_s + 36;
    }
    if ((e = getenv("BLOCKS_BATCH_MAX")) && atol(e) > 0) g_batch_max = (size_t)atol(e);
    if ((e = getenv("BLOCKS_SIZES_KIB")) && *e) {
        int n = 0;
        char buf[256];
        snprintf(buf, sizeof buf, "%s", e);
        for (char *tok = strtok(buf, ", "); tok && n < MAX_SIZES; tok = strtok(NULL, ", ")) {
            int k = atoi(tok);
            if (k >= 1 && (k & (k - 1)) == 0) g_sizes_kib[n++] = k;
        }
        if (n > 0) g_nsizes = n;
    }
}

static void fmt_us(char *b, size_t n, double us) {
    if (us < 10000) snprintf(b, n, "%.0fus", us);
    else if (us < 1e7) snprintf(b, n, "%.1fms", us / 1000);
    else snprintf(b, n, "%.0fs", us / 1e6);
}

static void print_tables(void) {
    char c[64], u[32];
    printf("\n================ SUMMARY (L=%d tensors; per call M=NB/%d blocks per tensor; "
           "median of n timed calls) ================\n", L_TENSORS, MOVE_DIV);
    printf("%-28s", "block size");
    for (int si = 0; si < g_nsizes; si++) printf(" %16zuK", g_si[si].B >> 10);
    printf("\n%-28s", "NB (blocks/tensor)");
    for (int si = 0; si < g_nsizes; si++) printf(" %17d", g_si[si].NB);
    printf("\n%-28s", "M (moved/tensor/call)");
    for (int si = 0; si < g_nsizes; si++) printf(" %17d", g_si[si].M);
    printf("\n%-28s", "MiB moved per call");
    for (int si = 0; si < g_nsizes; si++) printf(" %17.0f", g_si[si].bytes / 1048576.0);
    printf("\n");
    for (int dir = 0; dir < 2; dir++) {
        printf("\n---- %s: cell = median GB/s / median host time issuing one call ----\n",
               dir == 0 ? "H2D (load: pinned host blocks -> device blocks)"
                        : "D2H (offload: device blocks -> pinned host blocks)");
        for (int st = 0; st < NSTRAT; st++) {
            if (STRATS[st].dir != dir) continue;
            printf("%-28s", STRATS[st].name);
            for (int si = 0; si < g_nsizes; si++) {
                const result_t *r = &g_res[si][st];
                if (r->status == ST_OK) {
                    fmt_us(u, sizeof u, r->host_us);
                    snprintf(c, sizeof c, "%s%.1f/%s", r->split ? "~" : "", r->med, u);
                } else {
                    snprintf(c, sizeof c, "%s", ST_TXT[r->status]);
                }
                printf(" %17s", c);
            }
            printf("\n");
        }
        printf("%s wall GB/s (issue start -> completion seen by the host):\n",
               dir == 0 ? "H2D" : "D2H");
        for (int st = 0; st < NSTRAT; st++) {
            if (STRATS[st].dir != dir) continue;
            printf("%-28s", STRATS[st].name);
            for (int si = 0; si < g_nsizes; si++) {
                const result_t *r = &g_res[si][st];
                if (r->status == ST_OK) snprintf(c, sizeof c, "%.1f", r->wall_med);
                else snprintf(c, sizeof c, "%s", ST_TXT[r->status]);
                printf(" %17s", c);
            }
            printf("\n");
        }
    }
    int sb = NSTRAT - 1;
    printf("\n---- BOTH: offload on one stream while load on another (best single-stream batch "
           "each; GB/s from events) ----\n");
    const char *rows[] = {"aggregate GB/s (both dirs)", "load GB/s while overlapped",
                          "offload GB/s while overlapped", "aggregate / load alone",
                          "aggregate / offload alone", "load: overlapped / alone",
                          "offload: overlapped / alone", "host time issuing both"};
    for (int k = 0; k < 8; k++) {
        printf("%-28s", rows[k]);
        for (int si = 0; si < g_nsizes; si++) {
            const result_t *r = &g_res[si][sb];
            if (r->status != ST_OK) { printf(" %17s", ST_TXT[r->status]); continue; }
            double la = r->pick_h >= 0 ? g_res[si][r->pick_h].med : 0;
            double oa = r->pick_d >= 0 ? g_res[si][r->pick_d].med : 0;
            double x = 0;
            switch (k) {
            case 0: x = r->med; break;
            case 1: x = r->load_med; break;
            case 2: x = r->off_med; break;
            case 3: x = la > 0 ? r->med / la : 0; break;
            case 4: x = oa > 0 ? r->med / oa : 0; break;
            case 5: x = la > 0 ? r->load_med / la : 0; break;
            case 6: x = oa > 0 ? r->off_med / oa : 0; break;
            case 7: break;
            }
            if (k == 7) { fmt_us(u, sizeof u, r->host_us); printf(" %17s", u); }
            else if (k < 3) printf(" %17.1f", x);
            else printf(" %17.2f", x);
        }
        printf("\n");
    }
    printf("%-28s", "strategies used (load/off)");
    for (int si = 0; si < g_nsizes; si++) {
        const result_t *r = &g_res[si][sb];
        snprintf(c, sizeof c, "%s/%s", r->pick_h >= 0 ? STRATS[r->pick_h].name + 3 : "sep",
                 r->pick_d >= 0 ? STRATS[r->pick_d].name + 3 : "sep");
        printf(" %17.17s", c);
    }
    printf("\n\n'*' rows: GB/s from host wall time (CPU scatter ends the operation). ");
    if (g_batch_max)
        printf("'~': every batch was split into calls of <= %zu copies (after a failure, or "
               "BLOCKS_BATCH_MAX). ", g_batch_max);
    printf("Statuses: n/a = API/flag not supported here, skip = time budget, FAIL = wrong bytes, "
           "ERR = CUDA error, CRASH/HANG = child process died/stalled in that measurement.\n");
}

static void mark_from(int si, int st, int status) {
    for (; si < g_nsizes; si++, st = 0)
        for (; st < NSTRAT; st++)
            if (g_res[si][st].status == ST_NONE) g_res[si][st].status = status;
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    g_t0 = now_s();
    read_env();
    for (int si = 0; si < g_nsizes; si++) {
        size_t B = (size_t)g_sizes_kib[si] << 10;
        size_t cap = (size_t)(g_cap_gib * 1073741824.0);
        size_t nb = NB_SMALL;
        if ((size_t)L_TENSORS * nb * B > cap) nb = cap / ((size_t)L_TENSORS * B);
        nb -= nb % MOVE_DIV;
        if (nb < 4 * MOVE_DIV) nb = 4 * MOVE_DIV;
        g_si[si].B = B;
        g_si[si].NB = (int)nb;
        g_si[si].M = (int)(nb / MOVE_DIV);
        g_si[si].bytes = (size_t)L_TENSORS * (size_t)g_si[si].M * B;
    }
    printf("blocks: L=%d, sizes", L_TENSORS);
    for (int si = 0; si < g_nsizes; si++) printf(" %zuK(NB=%d)", g_si[si].B >> 10, g_si[si].NB);
    printf(", cap %g GiB/side, check 1/%d of every block, budget %.0f s (hard %.0f, kill %.0f)"
           ", batch split %zu\n", g_cap_gib, CHECK_DIV, g_budget_s, g_hard_s, g_kill_s,
           g_batch_max);
    signal(SIGPIPE, SIG_IGN);

    int si = 0, st = 0, restarts = 0, stop = 0, incidents = 0, err_incidents = 0;
    while (!stop && si < g_nsizes) {
        int fd[2];
        if (pipe(fd) != 0) { perror("pipe"); return 1; }
        fflush(stdout);
        fflush(stderr);
        pid_t pid = fork();
        if (pid < 0) { perror("fork"); return 1; }
        if (pid == 0) {
            close(fd[0]);
            g_pipe_wr = fd[1];
            child_main(si, st);
            _exit(0);
        }
        close(fd[1]);
        int hello = 0, done = 0, fatal_code = 0, active = 0, timed_out = 0;
        int cur_si = si, cur_st = -1;
        double last = now_s(), fatal_at = 0;
        for (;;) {
            double lim = (hello ? IDLE_TIMEOUT_S : INIT_TIMEOUT_S) - (now_s() - last);
            if (fatal_code) lim = 5.0 - (now_s() - fatal_at); /* grace to exit after FATAL */
            double kl = g_kill_s - elapsed_s();
            if (kl < lim) lim = kl;
            int ms = lim > 0 ? (int)(lim * 1000) : 0;
            struct pollfd pf = {fd[0], POLLIN, 0};
            int pr = poll(&pf, 1, ms);
            if (pr < 0 && errno == EINTR) continue;
            if (pr == 0) { timed_out = !fatal_code; break; }
            msg_t m;
            size_t got = 0;
            while (got < sizeof m) {
                ssize_t n = read(fd[0], (char *)&m + got, sizeof m - got);
                if (n < 0 && errno == EINTR) continue;
                if (n <= 0) break;
                got += (size_t)n;
            }
            if (got < sizeof m) break; /* EOF: the child is gone */
            last = now_s();
            switch (m.type) {
            case MSG_HELLO: hello = 1; break;
            case MSG_SETUP: cur_si = m.si; cur_st = -1; active = 1; break;
            case MSG_BINFO: cur_si = m.si; cur_st = -1; active = 0; break;
            case MSG_START: cur_si = m.si; cur_st = m.st; active = 1; break;
            case MSG_RESULT: g_res[m.si][m.st] = m.r; cur_si = m.si; cur_st = m.st; active = 0; break;
            case MSG_FATAL: if (!fatal_code) { fatal_code = m.code; fatal_at = now_s(); } break;
            case MSG_DONE: done = 1; break;
            }
        }
        close(fd[0]);
        /* reap without blocking forever (a process stuck in the driver may not die) */
        int wst = 0, reaped = 0;
        for (int i = 0; i < 500 && !reaped; i++) {
            pid_t w = waitpid(pid, &wst, WNOHANG);
            if (w == pid) { reaped = 1; break; }
            if (i == 0 || i == 100) kill(pid, SIGKILL);
            usleep(10000);
        }
        if (done) break;
        int code = fatal_code ? fatal_code
                 : timed_out ? ST_HANG
                 : (reaped && WIFSIGNALED(wst)) ? ST_CRASH : ST_ERR;
        if (timed_out && elapsed_s() >= g_kill_s - 1) {
            printf("# time limit: child stopped at %.0f s\n", elapsed_s());
            if (active && cur_st >= 0) g_res[cur_si][cur_st].status = ST_SKIP;
            break;
        }
        printf("# child ended: %s (%s, status 0x%x)%s at t=%.0f s\n", ST_TXT[code],
               reaped ? "reaped" : "NOT reaped", wst, !hello ? " before it was ready" : "",
               elapsed_s());
        if (!hello) { mark_from(si, st, code); break; }
        if (code == ST_CRASH || code == ST_HANG) incidents++;
        if (code == ST_ERR || code == ST_FAIL) err_incidents++;
        if (active && cur_st >= 0) {
            const strat_t *cs = &STRATS[cur_st];
            int batchy = uses_batch(cs) || cs->kind == K_BOTH;
            size_t ni = (size_t)L_TENSORS * (size_t)g_si[cur_si].M;
            if ((code == ST_CRASH || code == ST_HANG || code == ST_ERR) && batchy &&
                g_batch_max == 0 && ni > 8192) {
                g_batch_max = 8192;
                printf("# retrying '%s' with every batch split into calls of <= %zu copies\n",
                       cs->name, g_batch_max);
                si = cur_si; st = cur_st;
            } else {
                g_res[cur_si][cur_st].status = code;
                si = cur_si; st = cur_st + 1;
            }
        } else if (active) {
            for (int k = 0; k < NSTRAT; k++)
                if (g_res[cur_si][k].status == ST_NONE) g_res[cur_si][k].status = code;
            si = cur_si + 1; st = 0;
        } else {
            si = cur_si; st = cur_st + 1;
        }
        if (st >= NSTRAT) { si++; st = 0; }
        if (++restarts > MAX_RESTARTS || elapsed_s() > g_hard_s) {
            printf("# not restarting (restarts %d, t=%.0f s)\n", restarts, elapsed_s());
            stop = 1;
        }
    }
    mark_from(0, 0, ST_SKIP);
    print_tables();
    int any_err = 0, any_crash = 0, any_skip = 0;
    for (int a = 0; a < g_nsizes; a++)
        for (int b = 0; b < NSTRAT; b++) {
            int s = g_res[a][b].status;
            any_err |= (s == ST_FAIL || s == ST_ERR);
            any_crash |= (s == ST_CRASH || s == ST_HANG);
            any_skip |= (s == ST_SKIP);
        }
    any_crash |= incidents > 0;
    any_err |= err_incidents > 0;
    int rc = any_err ? 1 : any_crash ? 3 : any_skip ? 2 : 0;
    printf("total %.0f s; exit status %d (%s)\n", elapsed_s(), rc,
           rc == 0 ? "all measured, every checked byte right"
           : rc == 1 ? "CUDA error or WRONG BYTES" : rc == 3 ? "crash/hang" : "some skipped for time");
    return rc;
}
