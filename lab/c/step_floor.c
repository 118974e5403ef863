// step_floor: the cheapest TOTAL host time of one engine step (claim a pinned slot + write the
// six fields' values + one cuMemcpyHtoDAsync of the used span + cuEventRecord, prefetches
// included), and which slot-selection / prefetch policy gets it. C against the driver only.
//
// The engine step's fields (benches/c/slot_stores.c): off = {0, 32768, 98304, 163840, 164096,
// 164608}, len = {1024, 2048, 2048, 256, 260, 32768}: 38404 bytes used in a 198912-byte slot,
// copied as one span of 197376 bytes (first field's start to last field's end). The values come
// from S = 64 value sets (2.4 MiB: from L2/L3, as the engine's would), set = step % 64, and the
// first 8 bytes of every field hold a number unique to the step, so every step's bytes differ.
//
// Every step's bytes are checked (untimed): each step's device destination is poisoned (0xEE,
// cuMemsetD8Async on the step's stream, enqueued before the step begins) and read back after it.
//   paced: after each step: cuStreamSynchronize, cuMemcpyDtoH of the span, compare the six
//          fields; poison the next step's destination; busy-wait 30 us (a graph replaying while
//          the engine plans the next step); next step.
//   loop:  steps back to back; step i copies to device arena i % K (K = 250); after every K steps
//          (clock stopped) synchronize, read all K arenas back in one cuMemcpyDtoH, compare every
//          step's fields, poison them again, synchronize, go on.
//   Writes-only rows have no device work: their slots are checked on the host instead (paced:
//   after each step; loop: every slot at each block's end). Floor rows (nothing written) check
//   that the device got the slot's fixed bytes.
// Timed per step (rdtsc): claim (cuEventQuery of the chosen slot's event, spinning until it
// completes) | prefetch of the current slot | the value writes | cuMemcpyHtoDAsync + cuEventRecord
// | prefetch of the next slot. Each row runs WARM + N steps (the WARM first ones not counted),
// 5 rounds, round-robin over all rows so drift hits all alike. See README.md beside this file.
//
// Build: nvcc -O2 -o step_floor step_floor.c -lcuda (probe.h beside it)     Run: ./step_floor [N [rounds]]
#include "probe.h"
#include <sched.h>
#include <sys/mman.h>

static void cuda_fail(CUresult r, const char *what, int line) {
    const char *s = "?";
    cuGetErrorName(r, &s);
    fprintf(stderr, "step_floor.c:%d %s: %s (%d)\n", line, what, s, (int)r);
    exit(1);
}

#define NF 6
#define SLOT 198912      // the engine's slot (bytes)
#define ASPAN 197376     // aligned layout's span: 164608 + 32768
#define USED 38404       // the six fields' bytes
#define PSTRIDE 38656    // packed slot stride: 38404 rounded up to 256; also a value set's stride
#define NSETS 64         // value sets
#define KAR 250          // device arenas (loop: step i -> arena i % KAR)
#define WARM 100         // steps run (and checked) before the counted ones
#define MAXR 64
#define MAXREPS 9
#define PACE_NS 30000.0

static const size_t AOFF[NF] = {0, 32768, 98304, 163840, 164096, 164608};  // the engine's
static const size_t LEN[NF] = {1024, 2048, 2048, 256, 260, 32768};
static const size_t POFF[NF] = {0, 1024, 3072, 5120, 5376, 5636};  // packed contiguously
static const size_t VOFF[NF] = {0, 1024, 3072, 5120, 5376, 5888};  // value sets (256-aligned)

enum { FIFO, LIFO, MRU };
enum { PF_NONE, PF_NEXT, PF_CUR, PF_NEXT_IDLE };
enum { MEM_HOSTALLOC, MEM_REGISTER };
enum { K_STEP, K_WRITES, K_FLOOR };
enum { P_TOTAL, P_CLAIM, P_WRITE, P_COPY, P_PF, P_IDLE, NP };
static const char *PNAME[NP] = {"step", "claim", "writes", "copy+rec", "prefetch", "idle pf"};

typedef struct { double med[NP], p10, p90; } Stat;

typedef struct {
    const char *id, *what;
    int R, packed, policy, pf, mem, kind;
    unsigned char *base;  // R slots, `stride` apart
    size_t stride, bytes, map_bytes, span;
    const size_t *off;
    CUevent ev[MAXR];
    int order[MAXR];      // LIFO/MRU: slots by release, oldest first
    int next;             // FIFO: the next slot
    uint64_t held_g[MAXR];
    int held_set[MAXR];
    Stat st[2][MAXREPS];  // [paced][round]
} Var;

#define ROW(i_, w_, r_, pk_, po_, pf_, mem_, kind_) \
    {.id = i_, .what = w_, .R = r_, .packed = pk_, .policy = po_, .pf = pf_, .mem = mem_, .kind = kind_}
static Var V[] = {
    ROW("1", "FIFO R=4 (engine layout, span copy)", 4, 0, FIFO, PF_NONE, MEM_HOSTALLOC, K_STEP),
    ROW("2", "FIFO R=4 + prefetchw next slot at step end", 4, 0, FIFO, PF_NEXT, MEM_HOSTALLOC, K_STEP),
    ROW("2i", "FIFO R=4 + prefetchw next slot between steps", 4, 0, FIFO, PF_NEXT_IDLE, MEM_HOSTALLOC, K_STEP),
    ROW("3", "FIFO R=4 + prefetchw current slot first", 4, 0, FIFO, PF_CUR, MEM_HOSTALLOC, K_STEP),
    ROW("4", "LIFO R=4 (last released if done, else FIFO)", 4, 0, LIFO, PF_NONE, MEM_HOSTALLOC, K_STEP),
    ROW("4m", "MRU R=4 (newest done slot, else oldest)", 4, 0, MRU, PF_NONE, MEM_HOSTALLOC, K_STEP),
    ROW("5a", "FIFO R=2", 2, 0, FIFO, PF_NONE, MEM_HOSTALLOC, K_STEP),
    ROW("5b", "FIFO R=16", 16, 0, FIFO, PF_NONE, MEM_HOSTALLOC, K_STEP),
    ROW("6", "packed FIFO R=4 (38404-byte copy)", 4, 1, FIFO, PF_NONE, MEM_HOSTALLOC, K_STEP),
    ROW("7", "packed LIFO R=4", 4, 1, LIFO, PF_NONE, MEM_HOSTALLOC, K_STEP),
    ROW("8a", "control: writes only, FIFO R=4", 4, 0, FIFO, PF_NONE, MEM_HOSTALLOC, K_WRITES),
    ROW("8b", "control: writes only, FIFO R=64", 64, 0, FIFO, PF_NONE, MEM_HOSTALLOC, K_WRITES),
    ROW("9a", "floor: claim+copy+record, span, nothing written", 4, 0, FIFO, PF_NONE, MEM_HOSTALLOC, K_FLOOR),
    ROW("9b", "floor: claim+copy+record, packed, nothing written", 4, 1, FIFO, PF_NONE, MEM_HOSTALLOC, K_FLOOR),
    ROW("1r", "FIFO R=4, mmap+cuMemHostRegister slots", 4, 0, FIFO, PF_NONE, MEM_REGISTER, K_STEP),
    ROW("4r", "LIFO R=4, mmap+cuMemHostRegister slots", 4, 0, LIFO, PF_NONE, MEM_REGISTER, K_STEP),
};
#define NV ((int)(sizeof V / sizeof V[0]))

static CUstream stream;
static CUdeviceptr arenas;  // KAR arenas, astride(v) apart
static unsigned char *back; // pinned: the arenas read back
static unsigned char *vals; // NSETS value sets, PSTRIDE apart, fields at VOFF
static uint64_t gstep = 1;  // a number unique to each step of the whole program
static int N = 2000, REPS = 5;
static uint64_t *T[NP];     // per counted step, ticks
static uint64_t a_g[KAR];   // per arena: the step it got
static int a_set[KAR], a_slot[KAR];
static long checked;

static size_t round256(size_t n) { return (n + 255) & ~(size_t)255; }
static inline size_t astride(const Var *v) { return round256(v->span); }
static unsigned char pat(size_t set, size_t f, size_t j) {
    unsigned char b = (unsigned char)(set * 131u + f * 17u + j * 7u + 1u);
    return b == 0xEE ? 0x11 : b;
}
static inline uint64_t word(uint64_t g, int f) { return (g * 8 + (uint64_t)f) ^ 0x5A3C000000000000ull; }

static inline void prefetchw_fields(const Var *v, const unsigned char *slot) {
    for (int f = 0; f < NF; f++) {
        uintptr_t p = (uintptr_t)(slot + v->off[f]) & ~(uintptr_t)63, e = (uintptr_t)(slot + v->off[f] + LEN[f]);
        for (; p < e; p += 64) __asm__ volatile("prefetchw (%0)" ::"r"(p));
    }
}
static inline void write_fields(const Var *v, unsigned char *slot, uint64_t g, int set) {
    const unsigned char *src = vals + (size_t)set * PSTRIDE;
    for (int f = 0; f < NF; f++) {
        uint64_t w = word(g, f);
        memcpy(slot + v->off[f], src + VOFF[f], LEN[f]);
        memcpy(slot + v->off[f], &w, 8);  // the step's own number: its line is in L1 by now
    }
}
static inline int done(CUevent e) {
    CUresult r = cuEventQuery(e);
    if (r == CUDA_SUCCESS) return 1;
    if (r != CUDA_ERROR_NOT_READY) cuda_fail(r, "cuEventQuery", __LINE__);
    return 0;
}

static void wrong(const Var *v, int paced, const char *where, uint64_t g, int f, size_t j, int got, int want) {
    fprintf(stderr, "WRONG BYTE: row %s (%s) %s, %s, step %llu field %d byte %zu: 0x%02x, want 0x%02x\n",
            v->id, v->what, paced ? "paced" : "loop", where, (unsigned long long)g, f, j, got, want);
    exit(2);
}
// img holds the six fields at v->off; want: step g's values (set), or the floor slot's bytes.
static void check(const Var *v, int paced, const char *where, const unsigned char *img, uint64_t g, int set,
                  const unsigned char *floor_slot) {
    for (int f = 0; f < NF; f++) {
        const unsigned char *got = img + v->off[f];
        unsigned char wantw[8];
        const unsigned char *want;
        if (floor_slot) want = floor_slot + v->off[f];
        else {
            uint64_t w = word(g, f);
            memcpy(wantw, &w, 8);
            if (memcmp(got, wantw, 8))
                for (int j = 0; j < 8; j++)
                    if (got[j] != wantw[j]) wrong(v, paced, where, g, f, j, got[j], wantw[j]);
            want = vals + (size_t)set * PSTRIDE + VOFF[f];
        }
        size_t j0 = floor_slot ? 0 : 8;
        if (memcmp(got + j0, want + j0, LEN[f] - j0))
            for (size_t j = j0; j < LEN[f]; j++)
                if (got[j] != want[j]) wrong(v, paced, where, g, f, j, got[j], want[j]);
    }
    checked++;
}


static void run(Var *v, int paced, int rep) {
    const int R = v->R, total = WARM + N;
    const size_t as = astride(v);
    CHECK(cuStreamSynchronize(stream));  // every slot's event complete
    for (int s = 0; s < R; s++) v->order[s] = s;
    v->next = 0;
    for (int i = 0; i < total; i++) {
        const int a = i % KAR, set = i % NSETS;
        const uint64_t g = gstep++;
        const CUdeviceptr dst = arenas + (CUdeviceptr)a * as;
        // -------- untimed: poison this step's destination (and pace) --------
        if (v->kind != K_WRITES) {
            if (paced) CHECK(cuMemsetD8Async(dst, 0xEE, v->span, stream));
            else if (a == 0) {
                CHECK(cuMemsetD8Async(arenas, 0xEE, KAR * as, stream));
                CHECK(cuStreamSynchronize(stream));
            }
        }
        if (paced) busy_ns(PACE_NS);
        // -------- the step (timed) --------
        const uint64_t t0 = tsc();
        int s;
        if (v->policy == FIFO) {
            s = v->next;
            v->next = v->next + 1 == R ? 0 : v->next + 1;
            if (v->kind != K_WRITES) while (!done(v->ev[s])) {}
        } else {
            int j = 0;
            if (v->policy == LIFO) { if (R > 1 && done(v->ev[v->order[R - 1]])) j = R - 1; }
            else for (int k = R - 1; k > 0; k--) if (done(v->ev[v->order[k]])) { j = k; break; }
            s = v->order[j];
            if (j == 0) while (!done(v->ev[s])) {}
            if (j != R - 1) {
                memmove(&v->order[j], &v->order[j + 1], (size_t)(R - 1 - j) * sizeof(int));
                v->order[R - 1] = s;
            }
        }
        unsigned char *slot = v->base + (size_t)s * v->stride;
        const uint64_t t1 = tsc();
        if (v->pf == PF_CUR) prefetchw_fields(v, slot);
        const uint64_t t2 = tsc();
        if (v->kind != K_FLOOR) write_fields(v, slot, g, set);
        const uint64_t t3 = tsc();
        if (v->kind != K_WRITES) {
            CHECK(cuMemcpyHtoDAsync(dst, slot, v->span, stream));
            CHECK(cuEventRecord(v->ev[s], stream));
        }
        const uint64_t t4 = tsc();
        if (v->pf == PF_NEXT) prefetchw_fields(v, v->base + (size_t)v->next * v->stride);
        const uint64_t t5 = tsc();
        // -------- untimed: bookkeeping and checks --------
        a_g[a] = g; a_set[a] = set; a_slot[a] = s;
        if (v->kind == K_WRITES) { v->held_g[s] = g; v->held_set[s] = set; }
        const unsigned char *fl = v->kind == K_FLOOR ? slot : NULL;
        if (paced) {
            CHECK(cuStreamSynchronize(stream));
            if (v->kind == K_WRITES) check(v, paced, "slot", slot, g, set, NULL);
            else {
                CHECK(cuMemcpyDtoH(back, dst, v->span));
                check(v, paced, "device", back, g, set, fl);
            }
        } else if (a == KAR - 1 || i == total - 1) {
            CHECK(cuStreamSynchronize(stream));
            if (v->kind == K_WRITES) {
                for (int k = 0; k < R; k++)
                    if (v->held_g[k]) check(v, paced, "slot", v->base + (size_t)k * v->stride, v->held_g[k], v->held_set[k], NULL);
            } else {
                CHECK(cuMemcpyDtoH(back, arenas, (size_t)(a + 1) * as));
                for (int k = 0; k <= a; k++)
                    check(v, paced, "device", back + (size_t)k * as, a_g[k], a_set[k],
                          fl ? v->base + (size_t)a_slot[k] * v->stride : NULL);
            }
        }
        uint64_t t6 = 0, t7 = 0;
        if (v->pf == PF_NEXT_IDLE) {  // between steps: the thread's time, but outside the step call
            t6 = tsc();
            prefetchw_fields(v, v->base + (size_t)v->next * v->stride);
            t7 = tsc();
        }
        if (i >= WARM) {
            const int k = i - WARM;
            T[P_TOTAL][k] = t5 - t0; T[P_CLAIM][k] = t1 - t0; T[P_WRITE][k] = t3 - t2;
            T[P_COPY][k] = t4 - t3;
            T[P_PF][k] = v->pf == PF_CUR || v->pf == PF_NEXT ? (t2 - t1) + (t5 - t4) : 0; T[P_IDLE][k] = t7 - t6;
        }
    }
    Stat *st = &v->st[paced][rep];
    for (int p = 0; p < NP; p++) {
        qsort(T[p], (size_t)N, sizeof(uint64_t), probe_cmp_u64);
        st->med[p] = T[p][N / 2] / tsc_per_ns;
        if (p == P_TOTAL) { st->p10 = T[p][N / 10] / tsc_per_ns; st->p90 = T[p][N * 9 / 10] / tsc_per_ns; }
    }
    printf("  round %d %-3s %-6s step %6.0f ns (p10 %6.0f p90 %6.0f)  claim %5.0f  writes %5.0f  copy+rec %5.0f"
           "  pf %4.0f  idle-pf %4.0f\n", rep + 1, v->id, paced ? "paced" : "loop", st->med[P_TOTAL], st->p10,
           st->p90, st->med[P_CLAIM], st->med[P_WRITE], st->med[P_COPY], st->med[P_PF], st->med[P_IDLE]);
    fflush(stdout);
}

static double med_of(const Var *v, int paced, int p, double *mn, double *mx) {
    double x[MAXREPS];
    for (int r = 0; r < REPS; r++) x[r] = p < 0 ? (p == -1 ? v->st[paced][r].p10 : v->st[paced][r].p90) : v->st[paced][r].med[p];
    qsort(x, (size_t)REPS, sizeof x[0], probe_cmp_double);
    if (mn) *mn = x[0];
    if (mx) *mx = x[REPS - 1];
    return x[REPS / 2];
}

static void print_host(void) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[8192];
    int got = 0, constant = 0, nonstop = 0, pfw = 0;
    char model[256] = "?", fam[32] = "?", mod[32] = "?";
    while (f && fgets(line, sizeof line, f)) {
        char *c = strchr(line, ':');
        if (!c) { if (got) break; continue; }
        char *val = c + 1; while (*val == ' ') val++;
        val[strcspn(val, "\n")] = 0;
        if (!strncmp(line, "model name", 10)) { snprintf(model, sizeof model, "%s", val); got = 1; }
        else if (!strncmp(line, "cpu family", 10)) snprintf(fam, sizeof fam, "%s", val);
        else if (!strncmp(line, "model\t", 6)) snprintf(mod, sizeof mod, "%s", val);
        else if (!strncmp(line, "flags", 5)) {
            constant = strstr(val, "constant_tsc") != NULL;
            nonstop = strstr(val, "nonstop_tsc") != NULL;
            pfw = strstr(val, "3dnowprefetch") != NULL;
        }
    }
    if (f) fclose(f);
    printf("cpu: %s (family %s, model %s), %ld cpus online; constant_tsc %d nonstop_tsc %d prefetchw(3dnowprefetch) %d\n",
           model, fam, mod, sysconf(_SC_NPROCESSORS_ONLN), constant, nonstop, pfw);
    f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (f && fgets(line, sizeof line, f)) printf("transparent hugepages: %s", line);
    if (f) fclose(f);
}

// Pin the thread to a CPU near the GPU (the last of the device's local_cpulist that we may use),
// else to the CPU we are on: a migration in mid-row would move the slots' lines to another core.
static void pin(CUdevice d) {
    char bus[64] = "", path[160], list[4096] = "";
    cpu_set_t allowed, one;
    int cpu = -1;
    sched_getaffinity(0, sizeof allowed, &allowed);
    if (cuDeviceGetPCIBusId(bus, sizeof bus, d) == CUDA_SUCCESS) {
        for (char *p = bus; *p; p++) if (*p >= 'A' && *p <= 'F') *p = (char)(*p - 'A' + 'a');
        snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/local_cpulist", bus);
        FILE *f = fopen(path, "r");
        if (!f && strlen(bus) > 12 && !strncmp(bus, "0000", 4)) {  // an 8-digit domain: sysfs has 4
            memmove(bus, bus + 4, strlen(bus + 4) + 1);
            snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/local_cpulist", bus);
            f = fopen(path, "r");
        }
        if (f && fgets(list, sizeof list, f)) {
            char *p = list;
            while (*p && *p != '\n') {
                long lo = strtol(p, &p, 10), hi = lo;
                if (*p == '-') hi = strtol(p + 1, &p, 10);
                for (long c = lo; c <= hi; c++) if (c < CPU_SETSIZE && CPU_ISSET(c, &allowed)) cpu = (int)c;
                if (*p == ',') p++; else break;
            }
        }
        if (f) fclose(f);
        snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/numa_node", bus);
        f = fopen(path, "r");
        int node = -9;
        if (f && fscanf(f, "%d", &node) == 1) printf("gpu %s numa node %d, local cpus %s", bus, node, list[0] ? list : "?\n");
        if (f) fclose(f);
    }
    if (cpu < 0) cpu = sched_getcpu();
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (sched_setaffinity(0, sizeof one, &one)) perror("sched_setaffinity");
    printf("thread pinned to cpu %d\n", cpu);
}

static void calibrate(void) {
    probe_tsc_calibrate();
    uint64_t d[1001];
    for (int i = 0; i < 1001; i++) {  // the timer's own cost inside a step: 6 reads, back to back
        uint64_t x0 = tsc(), x1 = tsc(), x2 = tsc(), x3 = tsc(), x4 = tsc(), x5 = tsc();
        (void)x1; (void)x2; (void)x3; (void)x4;
        d[i] = x5 - x0;
    }
    qsort(d, 1001, sizeof d[0], probe_cmp_u64);
    printf("tsc %.3f GHz; the step's 6 timer reads cost ~%.0f ns (inside every step figure)\n", tsc_per_ns,
           d[500] / tsc_per_ns);
}

int main(int argc, char **argv) {
    if (argc > 1) N = atoi(argv[1]);
    if (argc > 2) REPS = atoi(argv[2]);
    if (N < 10 || REPS < 1 || REPS > MAXREPS) { fprintf(stderr, "usage: step_floor [N>=10 [rounds 1..%d]]\n", MAXREPS); return 64; }
    struct timespec w0, w1;
    clock_gettime(CLOCK_MONOTONIC, &w0);
    setvbuf(stdout, NULL, _IOLBF, 0);
    CUdevice d;
    CUcontext ctx;
    char name[256];
    int drv = 0;
    CHECK(cuInit(0));
    CHECK(cuDriverGetVersion(&drv));
    CHECK(cuDeviceGet(&d, 0));
    CHECK(cuDeviceGetName(name, sizeof name, d));
    printf("step_floor: %s, driver API %d\n", name, drv);
    print_host();
    pin(d);
    calibrate();
    CHECK(cuDevicePrimaryCtxRetain(&ctx, d));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    CHECK(cuMemAlloc(&arenas, (size_t)KAR * ASPAN));
    CHECK(cuMemHostAlloc((void **)&back, (size_t)KAR * ASPAN, 0));
    vals = aligned_alloc(4096, (size_t)NSETS * PSTRIDE);
    if (!vals) { perror("aligned_alloc"); return 1; }
    for (int s = 0; s < NSETS; s++)
        for (int f = 0; f < NF; f++)
            for (size_t j = 0; j < LEN[f]; j++) vals[(size_t)s * PSTRIDE + VOFF[f] + j] = pat((size_t)s, (size_t)f, j);
    for (int p = 0; p < NP; p++) T[p] = calloc((size_t)N, sizeof(uint64_t));
    for (int k = 0; k < NV; k++) {
        Var *v = &V[k];
        v->off = v->packed ? POFF : AOFF;
        v->span = v->off[NF - 1] + LEN[NF - 1];
        v->stride = v->packed ? PSTRIDE : SLOT;
        v->bytes = (size_t)v->R * v->stride;
        if (v->mem == MEM_HOSTALLOC) {
            CHECK(cuMemHostAlloc((void **)&v->base, v->bytes, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP));
        } else {
            v->map_bytes = (v->bytes + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
            v->base = mmap(NULL, v->map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
            if (v->base == MAP_FAILED) { perror("mmap"); return 1; }
            CHECK(cuMemHostRegister(v->base, v->map_bytes, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP));
        }
        memset(v->base, 0x5A, v->bytes);
        for (int s = 0; s < v->R; s++) {
            CHECK(cuEventCreate(&v->ev[s], CU_EVENT_DISABLE_TIMING));
            v->held_g[s] = 0;
            // floor rows copy these fixed bytes every step (a step number no other step has)
            if (v->kind == K_FLOOR) write_fields(v, v->base + (size_t)s * v->stride, gstep++, s % NSETS);
        }
    }
    printf("%d rows x {loop, paced} x %d rounds, %d counted steps each (+%d warm-up), values from %d sets "
           "(%.1f MiB), %d bytes written per step, pace %.0f us\n",
           NV, REPS, N, WARM, NSETS, NSETS * (double)PSTRIDE / (1 << 20), USED, PACE_NS / 1000);
    for (int k = 0; k < NV; k++)
        printf("  row %-3s %-52s R=%-2d span %6zu  %s\n", V[k].id, V[k].what, V[k].R,
               V[k].kind == K_WRITES ? (size_t)0 : V[k].span, V[k].mem == MEM_HOSTALLOC ? "cuMemHostAlloc" : "mmap+register");
    for (int rep = 0; rep < REPS; rep++) {
        printf("round %d\n", rep + 1);
        for (int k = 0; k < NV; k++)
            for (int paced = 0; paced < 2; paced++) run(&V[k], paced, rep);
    }

    printf("\nmedian over %d rounds of each round's median ns per step (min-max of the round medians); "
           "parts: medians of the parts alone (they need not sum to the step's)\n", REPS);
    printf("%-3s %-52s %-6s %7s %15s %7s %7s | %7s %7s %8s %8s %7s\n", "row", "what", "regime", "step", "(min-max)",
           "p10", "p90", PNAME[P_CLAIM], PNAME[P_WRITE], PNAME[P_COPY], PNAME[P_PF], PNAME[P_IDLE]);
    for (int paced = 0; paced < 2; paced++)
        for (int k = 0; k < NV; k++) {
            const Var *v = &V[k];
            double mn, mx, m = med_of(v, paced, P_TOTAL, &mn, &mx);
            printf("%-3s %-52s %-6s %7.0f %7.0f-%-7.0f %7.0f %7.0f | %7.0f %7.0f %8.0f %8.0f %7.0f\n", v->id, v->what,
                   paced ? "paced" : "loop", m, mn, mx, med_of(v, paced, -1, 0, 0), med_of(v, paced, -2, 0, 0),
                   med_of(v, paced, P_CLAIM, 0, 0), med_of(v, paced, P_WRITE, 0, 0), med_of(v, paced, P_COPY, 0, 0),
                   med_of(v, paced, P_PF, 0, 0), med_of(v, paced, P_IDLE, 0, 0));
        }
    // The answer: the cheapest full step (values written and copied) per regime; row 2i is
    // charged its between-steps prefetch too (the thread pays it, only outside the step call).
    printf("\ncheapest full step (rows 1-7, 1r, 4r; 2i charged step + idle prefetch):\n");
    for (int paced = 0; paced < 2; paced++) {
        int best = -1, second = -1;
        double bm = 1e30, sm = 1e30, bmin[NV], bmax[NV], tot[NV];
        for (int k = 0; k < NV; k++) {
            if (V[k].kind != K_STEP) continue;
            tot[k] = med_of(&V[k], paced, P_TOTAL, &bmin[k], &bmax[k]);
            if (V[k].pf == PF_NEXT_IDLE) {
                double idle = med_of(&V[k], paced, P_IDLE, 0, 0);
                tot[k] += idle; bmin[k] += idle; bmax[k] += idle;
            }
            if (tot[k] < bm) { second = best; sm = bm; best = k; bm = tot[k]; }
            else if (tot[k] < sm) { second = k; sm = tot[k]; }
        }
        double fl = 0;
        for (int k = 0; k < NV; k++) if (!strcmp(V[k].id, "9a")) fl = med_of(&V[k], paced, P_TOTAL, 0, 0);
        printf("  %-6s row %-3s %s: %.0f ns (%.0f-%.0f); next row %s: %.0f ns (%.0f-%.0f)%s; "
               "driver floor (row 9a, span) %.0f ns\n", paced ? "paced" : "loop", V[best].id, V[best].what, bm,
               bmin[best], bmax[best], V[second].id, sm, bmin[second], bmax[second],
               bmax[best] < bmin[second] ? ", ranges apart" : ", RANGES OVERLAP (not separated)", fl);
    }
    for (int k = 0; k < NV; k++) {
        for (int s = 0; s < V[k].R; s++) CHECK(cuEventDestroy(V[k].ev[s]));
        if (V[k].mem == MEM_HOSTALLOC) CHECK(cuMemFreeHost(V[k].base));
        else { CHECK(cuMemHostUnregister(V[k].base)); munmap(V[k].base, V[k].map_bytes); }
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
