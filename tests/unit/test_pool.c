/*
 * test_pool.c — core/pool.c: every item of every job runs exactly once, on the thread id it was
 * given, whether the workers are spinning (back-to-back jobs) or asleep (jobs after idle gaps),
 * and the pool shuts down from either state.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "../../core/pool.h"
#include "test.h"

enum { MAX_N = 5000 };

typedef struct job {
    atomic_int hits[MAX_N];
    atomic_int calls;
    int n_threads;
    atomic_int bad_tid;
} job;

static void count(void *ctx, int64_t begin, int64_t end, int tid) {
    job *j = ctx;
    if (tid < 0 || tid >= j->n_threads) atomic_store(&j->bad_tid, 1);
    atomic_fetch_add(&j->calls, 1);
    for (int64_t i = begin; i < end; i++) atomic_fetch_add(&j->hits[i], 1);
}

static void sleep_us(long us) {
    struct timespec ts = {.tv_sec = us / 1000000, .tv_nsec = (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

/* One job over [0, n) with `grain` (rs_pool_run, or rs_pool_run_dynamic: one call per grain);
 * asserts each item ran once. */
static void run_and_check_how(rs_pool *p, job *j, int64_t n, int64_t grain, int dynamic) {
    for (int64_t i = 0; i < n; i++) atomic_store(&j->hits[i], 0);
    atomic_store(&j->calls, 0);
    (dynamic ? rs_pool_run_dynamic : rs_pool_run)(p, n, grain, count, j);
    for (int64_t i = 0; i < n; i++)
        if (atomic_load(&j->hits[i]) != 1)
            RS_TEST_FAIL("n %lld grain %lld%s: item %lld ran %d times", (long long)n, (long long)grain,
                         dynamic ? " dynamic" : "", (long long)i, atomic_load(&j->hits[i]));
    const int64_t grains = (n + grain - 1) / grain;
    if (dynamic) ASSERT_EQ(atomic_load(&j->calls), j->n_threads == 1 || n <= grain ? 1 : grains);
    else ASSERT_TRUE(atomic_load(&j->calls) <= j->n_threads);
    ASSERT_EQ(atomic_load(&j->bad_tid), 0);
}

static void run_and_check(rs_pool *p, job *j, int64_t n, int64_t grain) {
    run_and_check_how(p, j, n, grain, 0);
    run_and_check_how(p, j, n, grain, 1);
}

RS_TEST(pool_every_item_once_spinning_and_sleeping) {
    static job j;
    for (int threads = 1; threads <= 4; threads++) {
        rs_pool *p = rs_pool_init(threads);
        j.n_threads = threads;
        ASSERT_EQ(rs_pool_threads(p), threads);
        uint64_t x = 12345;
        for (int it = 0; it < 5000; it++) { /* back to back: workers hand off while spinning */
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            int64_t n = 1 + (int64_t)((x >> 33) % 64), grain = 1 + (int64_t)((x >> 20) % 8);
            run_and_check(p, &j, n, grain);
        }
        for (int it = 0; it < 12; it++) { /* after idle gaps: workers are asleep and must be woken */
            sleep_us(it % 3 == 0 ? 20000 : 300);
            run_and_check(p, &j, MAX_N, 1 + it);
        }
        rs_pool_free(p); /* workers asleep or spinning: both must exit */
    }
}

/* A job whose ranges take very different times: the caller waits (spins, then sleeps) for the
 * slowest worker, and the next job does not start before it has finished. */
static void uneven(void *ctx, int64_t begin, int64_t end, int tid) {
    job *j = ctx;
    if (tid == j->n_threads - 1) sleep_us(5000);
    count(ctx, begin, end, tid);
}

RS_TEST(pool_waits_for_the_slowest_worker) {
    static job j;
    rs_pool *p = rs_pool_init(3);
    j.n_threads = 3;
    for (int it = 0; it < 20; it++) {
        for (int64_t i = 0; i < 300; i++) atomic_store(&j.hits[i], 0);
        rs_pool_run(p, 300, 1, uneven, &j);
        for (int64_t i = 0; i < 300; i++) ASSERT_EQ(atomic_load(&j.hits[i]), 1);
    }
    rs_pool_free(p);
    rs_pool_free(NULL);
}

/* rs_pool_run_dynamic around a thread that is slow on every grain (as if descheduled): the others
 * take the grains it would have had under a fixed split, and every item still runs once. */
typedef struct slow_job {
    job j;
    atomic_int by_tid[3];
} slow_job;

static void slow_last(void *ctx, int64_t begin, int64_t end, int tid) {
    slow_job *s = ctx;
    if (tid == 2) sleep_us(20000);
    atomic_fetch_add(&s->by_tid[tid], 1);
    count(&s->j, begin, end, tid);
}

RS_TEST(pool_dynamic_others_take_a_slow_threads_share) {
    static slow_job s;
    rs_pool *p = rs_pool_init(3);
    s.j.n_threads = 3;
    rs_pool_run_dynamic(p, 300, 1, slow_last, &s);
    for (int64_t i = 0; i < 300; i++) ASSERT_EQ(atomic_load(&s.j.hits[i]), 1);
    /* a fixed split gives thread 2 a hundred grains (2 s); here it holds one or two */
    ASSERT_TRUE(atomic_load(&s.by_tid[2]) <= 5);
    ASSERT_EQ(atomic_load(&s.by_tid[0]) + atomic_load(&s.by_tid[1]) + atomic_load(&s.by_tid[2]), 300);
    rs_pool_free(p);
}
