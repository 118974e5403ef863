// idle_class_latency: how late does a job handed to a thread in the SCHED_IDLE class run when the
// CPUs are oversubscribed by busy threads of the normal class, against SCHED_BATCH and the normal
// class? (pinstage's reaper, which frees pinned memory, must not take the core of the caller that
// woke it with a free: SCHED_IDLE and SCHED_BATCH threads never preempt on wake-up; an idle-class
// thread also runs only where no normal thread wants the core, and a lock it holds then waits
// with it.)
//
// A worker thread (SCHED_IDLE, SCHED_BATCH, or SCHED_OTHER as the control) waits on a pipe; the main thread
// writes a timestamp 20 times, 5 ms apart, and the worker spins 200 us (a job) and reports when
// it finished. SPINNERS threads of the normal class spin meanwhile. Prints the median and max
// of the 20 delays (send -> job finished). No GPU.
//
// Build: cc -O2 -o idle_class_latency idle_class_latency.c -lpthread
// Run:   for n in 0 2 4 8 16; do for c in normal batch idle; do ./idle_class_latency $c $n; done; done
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int to_worker[2], to_main[2], policy = SCHED_OTHER;
static atomic_int stop;

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void *worker(void *arg) {
  (void)arg;
  if (policy != SCHED_OTHER) {
    struct sched_param p = {0};
    if (sched_setscheduler(0, policy, &p)) perror("sched_setscheduler");
  }
  double sent;
  while (read(to_worker[0], &sent, sizeof sent) == sizeof sent) {
    double t0 = now_us();
    while (now_us() - t0 < 200) {}
    double delay = now_us() - sent;
    if (write(to_main[1], &delay, sizeof delay) != sizeof delay) abort();
  }
  return NULL;
}

static void *spinner(void *arg) {
  (void)arg;
  while (!atomic_load_explicit(&stop, memory_order_relaxed)) {}
  return NULL;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  const char *name = argc > 1 ? argv[1] : "normal";
  if (!strcmp(name, "idle")) policy = SCHED_IDLE;
  else if (!strcmp(name, "batch")) policy = SCHED_BATCH;
  else name = "normal";
  int spinners = argc > 2 ? atoi(argv[2]) : 0;
  if (pipe(to_worker) || pipe(to_main)) return 1;
  pthread_t w, s[256];
  pthread_create(&w, NULL, worker, NULL);
  for (int i = 0; i < spinners && i < 256; i++) pthread_create(&s[i], NULL, spinner, NULL);
  usleep(100000);
  double d[20];
  for (int i = 0; i < 20; i++) {
    double t = now_us();
    if (write(to_worker[1], &t, sizeof t) != sizeof t) return 1;
    if (read(to_main[0], &d[i], sizeof d[i]) != sizeof d[i]) return 1;
    usleep(5000);
  }
  qsort(d, 20, sizeof d[0], cmp);
  printf("%-10s %2d spinners on %ld CPUs: job done after median %.0f us, max %.0f us\n",
         policy == SCHED_IDLE ? "SCHED_IDLE" : policy == SCHED_BATCH ? "SCHED_BATCH" : "normal", spinners, sysconf(_SC_NPROCESSORS_ONLN), d[10], d[19]);
  atomic_store(&stop, 1);
  for (int i = 0; i < spinners && i < 256; i++) pthread_join(s[i], NULL);
  return 0;
}
