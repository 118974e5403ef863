// What registering pageable memory in place costs, and whether it can feed the link: the
// driver's floor for host-to-device copies straight from a caller's pageable buffer, pinned
// piece by piece with cuMemHostRegister (no CPU copy), and for getting a small pinned block.
//   1. register / unregister a whole touched buffer, flags 0 and READ_ONLY, one thread;
//   2. the same split over T threads at once (does the driver serialise registrations?);
//   3. pipelined: T threads claim pieces of P bytes; each registers its piece, issues its copy
//      on its own stream, and unregisters its previous piece once that copy completed;
//   4. a 4 MiB pinned block: cuMemHostAlloc against mmap + populate variants + register.
// Every copy of 2 and 3 is checked: the device buffer is poisoned before, read back after.
// Build: nvcc -O2 -o h2d_register benches/c/h2d_register.c -lcuda -lpthread
#define _GNU_SOURCE
#include <cuda.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define CHECK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_; \
    cuGetErrorName(r_, &s_); fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); \
    exit(1); } } while (0)

static CUcontext ctx;
static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static unsigned char *host, *back;
static CUdeviceptr dev;
static size_t total, piece;
static atomic_size_t next_piece;
static unsigned flags;

static void poison(size_t n) { CHECK(cuMemsetD8(dev, 0xEE, n)); CHECK(cuCtxSynchronize()); }
static void verify(size_t n, const char *what) {
    CHECK(cuMemcpyDtoH(back, dev, n));
    if (memcmp(back, host, n) != 0) { fprintf(stderr, "WRONG RESULT: %s\n", what); exit(1); }
}

struct reg_arg { unsigned char *p; size_t n; double t; int unreg; };
static void *reg_thread(void *a_) {
    struct reg_arg *a = a_;
    CHECK(cuCtxSetCurrent(ctx));
    double t0 = now_ms();
    if (a->unreg) CHECK(cuMemHostUnregister(a->p));
    else CHECK(cuMemHostRegister(a->p, a->n, flags));
    a->t = now_ms() - t0;
    return NULL;
}

static void *pipe_thread(void *unused) {
    (void)unused;
    CHECK(cuCtxSetCurrent(ctx));
    CUstream s;
    CUevent ev[2];
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CHECK(cuEventCreate(&ev[0], CU_EVENT_DISABLE_TIMING));
    CHECK(cuEventCreate(&ev[1], CU_EVENT_DISABLE_TIMING));
    unsigned char *prev = NULL;
    int k = 0;
    for (;;) {
        size_t i = atomic_fetch_add(&next_piece, 1);
        if (i * piece >= total) break;
        size_t off = i * piece, n = total - off < piece ? total - off : piece;
        CHECK(cuMemHostRegister(host + off, n, flags));
        CHECK(cuMemcpyHtoDAsync(dev + off, host + off, n, s));
        CHECK(cuEventRecord(ev[k], s));
        if (prev) { CHECK(cuEventSynchronize(ev[k ^ 1])); CHECK(cuMemHostUnregister(prev)); }
        prev = host + off;
        k ^= 1;
    }
    if (prev) { CHECK(cuEventSynchronize(ev[k ^ 1])); CHECK(cuMemHostUnregister(prev)); }
    CHECK(cuStreamDestroy(s));
    CHECK(cuEventDestroy(ev[0]));
    CHECK(cuEventDestroy(ev[1]));
    return NULL;
}

static double run_parallel_reg(size_t n, int threads, int unreg) {
    pthread_t th[16];
    struct reg_arg a[16];
    size_t per = n / threads;
    double t0 = now_ms();
    for (int t = 0; t < threads; t++) {
        a[t] = (struct reg_arg){host + t * per, per, 0, unreg};
        pthread_create(&th[t], NULL, reg_thread, &a[t]);
    }
    for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
    return now_ms() - t0;
}

static double run_pipe(size_t n, size_t p, int threads) {
    pthread_t th[16];
    total = n; piece = p;
    atomic_store(&next_piece, 0);
    double t0 = now_ms();
    for (int t = 0; t < threads; t++) pthread_create(&th[t], NULL, pipe_thread, NULL);
    for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
    return now_ms() - t0;
}

int main(void) {
    CUdevice d;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&d, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, d));
    CHECK(cuCtxSetCurrent(ctx));
    int ro = 0;
    CHECK(cuDeviceGetAttribute(&ro, CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, d));
    printf("READ_ONLY_HOST_REGISTER_SUPPORTED %d\n", ro);
    const size_t GiB = 1ul << 30, MiB = 1ul << 20;
    // A malloc'd buffer as numpy gets it (glibc mmaps large blocks: page aligned + 16 bytes);
    // pieces are registered page-aligned from its first whole page.
    unsigned char *raw = malloc(GiB + 8192);
    host = (unsigned char *)(((size_t)raw + 4095) & ~(size_t)4095);
    back = malloc(GiB);
    for (size_t i = 0; i < GiB; i++) host[i] = (unsigned char)(i * 2654435761u >> 13);
    memset(back, 0, GiB);
    CHECK(cuMemAlloc(&dev, GiB));
    CUstream s;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));

    size_t sizes[] = {64 * MiB, 256 * MiB, GiB};
    // 1. one thread, the whole buffer, flags 0 / READ_ONLY.
    for (int f = 0; f < 2; f++) {
        flags = f ? CU_MEMHOSTREGISTER_READ_ONLY : 0;
        if (f && !ro) continue;
        for (int k = 0; k < 3; k++) {
            size_t n = sizes[k];
            double best_total = 1e9, r = 0, c = 0, u = 0;
            for (int rep = 0; rep < 3; rep++) {
                poison(n);
                double t0 = now_ms();
                CHECK(cuMemHostRegister(host, n, flags));
                double t1 = now_ms();
                CHECK(cuMemcpyHtoDAsync(dev, host, n, s));
                CHECK(cuStreamSynchronize(s));
                double t2 = now_ms();
                CHECK(cuMemHostUnregister(host));
                double t3 = now_ms();
                verify(n, "serial");
                if (t3 - t0 < best_total) { best_total = t3 - t0; r = t1 - t0; c = t2 - t1; u = t3 - t2; }
            }
            printf("serial flags=%s %4zu MiB: register %.2f ms, copy %.2f ms, unregister %.2f ms: %.2f GB/s\n",
                   f ? "RO" : "0", n / MiB, r, c, u, n / best_total / 1e6);
        }
    }
    flags = ro ? CU_MEMHOSTREGISTER_READ_ONLY : 0;
    // 2. registration split over T threads at once.
    int tcount[] = {1, 2, 4, 8};
    for (int k = 0; k < 3; k += 2) {
        size_t n = sizes[k];
        for (int ti = 0; ti < 4; ti++) {
            double rbest = 1e9, ubest = 1e9;
            for (int rep = 0; rep < 3; rep++) {
                double r = run_parallel_reg(n, tcount[ti], 0);
                double u = run_parallel_reg(n, tcount[ti], 1);
                if (r < rbest) rbest = r;
                if (u < ubest) ubest = u;
            }
            printf("parallel %4zu MiB, %d threads: register %.2f ms (%.1f GB/s), unregister %.2f ms (%.1f GB/s)\n",
                   n / MiB, tcount[ti], rbest, n / rbest / 1e6, ubest, n / ubest / 1e6);
        }
    }
    // 3. pipelined pieces.
    size_t pieces[] = {2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB};
    int pthreads[] = {2, 4, 8};
    for (int k = 0; k < 3; k++) {
        size_t n = sizes[k];
        for (int pi = 0; pi < 4; pi++) {
            for (int ti = 0; ti < 3; ti++) {
                double ts[5];
                for (int rep = 0; rep < 5; rep++) {
                    poison(n);
                    ts[rep] = run_pipe(n, pieces[pi], pthreads[ti]);
                    verify(n, "pipelined");
                }
                qsort(ts, 5, sizeof(double), cmp);
                printf("pipelined %4zu MiB, pieces %2zu MiB, %d threads: %.2f ms median, %.2f GB/s (best %.2f)\n",
                       n / MiB, pieces[pi] / MiB, pthreads[ti], ts[2], n / ts[2] / 1e6, n / ts[0] / 1e6);
            }
        }
    }
    // 4. a cold 4 MiB pinned block.
    const char *names[] = {"cuMemHostAlloc", "mmap+MAP_POPULATE+register", "mmap+THP+memset+register",
                           "mmap+THP+MADV_POPULATE_WRITE+register", "mmap+register (driver faults in)",
                           "mmap+THP+MADV_POPULATE_WRITE (no register)", "cuMemHostRegister of a populated block"};
    for (int m = 0; m < 7; m++) {
        double ts[21];
        for (int rep = 0; rep < 21; rep++) {
            size_t n = 4 * MiB;
            void *p = NULL;
            double t0 = now_ms(), t1 = 0;
            if (m == 0) {
                CHECK(cuMemHostAlloc(&p, n, CU_MEMHOSTALLOC_PORTABLE));
                t1 = now_ms();
                CHECK(cuMemFreeHost(p));
            } else {
                int populate = m == 1 ? MAP_POPULATE : 0;
                double tm = now_ms();
                p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | populate, -1, 0);
                if (p == MAP_FAILED) { perror("mmap"); return 1; }
                if (m == 2 || m == 3 || m == 5 || m == 6) madvise(p, n, MADV_HUGEPAGE);
                if (m == 2) memset(p, 0, n);
                if (m == 3 || m == 5 || m == 6) {
                    if (madvise(p, n, MADV_POPULATE_WRITE) != 0) { perror("MADV_POPULATE_WRITE"); memset(p, 0, n); }
                }
                if (m == 6) t0 = now_ms();
                (void)tm;
                if (m != 5) CHECK(cuMemHostRegister(p, n, CU_MEMHOSTREGISTER_PORTABLE));
                t1 = now_ms();
                if (m != 5) CHECK(cuMemHostUnregister(p));
                munmap(p, n);
            }
            ts[rep] = t1 - t0;
        }
        qsort(ts, 21, sizeof(double), cmp);
        printf("4 MiB pinned block, %s: %.3f ms median (min %.3f)\n", names[m], ts[10], ts[0]);
    }
    return 0;
}
