// free_lock: does a thread that frees memory while the device is busy hold up OTHER threads'
// driver calls? (Decides whether freeing page-locked or device memory on a background thread
// keeps the caller's copies fast.)
//
// Stream S1 is held for 300 ms by a host function. While it is held, thread A frees one kind of
// memory (timed: how long the free itself blocks), and the main thread B, 50 ms after A started,
// issues on stream S2 a cuMemcpyHtoDAsync of 64 KiB from pinned memory and records an event
// (timed: how long B's two calls take). Control rows: B alone (no free), and A's free with S1
// idle; A's cuCtxSynchronize alone, and a synchronize before the free. Every row runs 3 times; B's copy is checked (its bytes read back after the run).
//
// Build: nvcc -O2 -o free_lock free_lock.c -lcuda -lpthread
#define _GNU_SOURCE
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define CHECK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_; \
    cuGetErrorName(r_, &s_); fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); \
    exit(1); } } while (0)

#define NB (64 << 10)
#define BIG (64 << 20)

static CUcontext ctx;
static volatile int hold_ms;

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void CUDA_CB holder(void *arg) {
    (void)arg;
    double t0 = now_ms();
    while (now_ms() - t0 < hold_ms) usleep(100);
}

enum kind { FREE_HOST, HOST_UNREGISTER, MEM_FREE, CTX_SYNC, SYNC_THEN_FREE, NONE };
static const char *names[] = {"cuMemFreeHost", "cuMemHostUnregister", "cuMemFree", "cuCtxSynchronize", "sync, then FreeHost", "(no free)"};

struct job { enum kind k; void *host; CUdeviceptr dev; double took; };

static void *freer(void *p) {
    struct job *j = p;
    CHECK(cuCtxSetCurrent(ctx));
    double t0 = now_ms();
    switch (j->k) {
    case FREE_HOST: CHECK(cuMemFreeHost(j->host)); break;
    case HOST_UNREGISTER: CHECK(cuMemHostUnregister(j->host)); munmap(j->host, BIG); break;
    case MEM_FREE: CHECK(cuMemFree(j->dev)); break;
    case CTX_SYNC: CHECK(cuCtxSynchronize()); break;
    case SYNC_THEN_FREE: CHECK(cuCtxSynchronize()); CHECK(cuMemFreeHost(j->host)); break;
    case NONE: break;
    }
    j->took = now_ms() - t0;
    return NULL;
}

int main(void) {
    CUdevice dev;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CUstream s1, s2;
    CHECK(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    unsigned char *src;
    CHECK(cuMemHostAlloc((void **)&src, NB, CU_MEMHOSTALLOC_PORTABLE));
    CUdeviceptr dst;
    CHECK(cuMemAlloc(&dst, NB));
    CUevent ev;
    CHECK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
    unsigned char *back = malloc(NB);
    int bad = 0;
    printf("%-22s %-10s %12s %14s\n", "free on thread A", "S1", "A's free ms", "B's copy+rec ms");
    for (int busy = 1; busy >= 0; busy--) {
        for (int k = FREE_HOST; k <= NONE; k++) {
            for (int rep = 0; rep < 3; rep++) {
                struct job j = {.k = k};
                if (k == FREE_HOST || k == SYNC_THEN_FREE) CHECK(cuMemHostAlloc(&j.host, BIG, CU_MEMHOSTALLOC_PORTABLE));
                if (k == HOST_UNREGISTER) {
                    j.host = mmap(NULL, BIG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
                    CHECK(cuMemHostRegister(j.host, BIG, CU_MEMHOSTREGISTER_PORTABLE));
                }
                if (k == MEM_FREE) CHECK(cuMemAlloc(&j.dev, BIG));
                for (int i = 0; i < NB; i++) src[i] = (unsigned char)(i * 7 + rep * 13 + k + 1);
                CHECK(cuMemsetD8(dst, 0xEE, NB));
                CHECK(cuCtxSynchronize());
                hold_ms = busy ? 300 : 0;
                if (busy) CHECK(cuLaunchHostFunc(s1, holder, NULL));
                usleep(2000);
                pthread_t th;
                pthread_create(&th, NULL, freer, &j);
                usleep(50000);
                double t0 = now_ms();
                CHECK(cuMemcpyHtoDAsync(dst, src, NB, s2));
                CHECK(cuEventRecord(ev, s2));
                double b = now_ms() - t0;
                pthread_join(th, NULL);
                CHECK(cuCtxSynchronize());
                CHECK(cuMemcpyDtoH(back, dst, NB));
                if (memcmp(back, src, NB) != 0) bad++;
                printf("%-22s %-10s %12.2f %14.3f\n", names[k], busy ? "held 300ms" : "idle", j.took, b);
                fflush(stdout);
            }
        }
    }
    printf("B's copies checked: %d wrong\n", bad);
    return bad ? 2 : 0;
}
