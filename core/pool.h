/*
 * pool.h — a fixed pool of worker threads for data-parallel loops (the CPU backend's matmuls).
 *
 * rs_pool_run splits [0, n) into one contiguous range per thread and blocks until all are done
 * (rs_pool_run_dynamic hands out one grain at a time instead).
 * The caller's thread takes part as thread 0, so a pool of 1 thread runs inline with no handoff.
 * Not reentrant: one rs_pool_run at a time per pool (the engine thread is the only caller).
 */
#ifndef RS_POOL_H
#define RS_POOL_H

#include <stdint.h>

typedef struct rs_pool rs_pool;

/* fn handles items [begin, end); tid in [0, n_threads). */
typedef void (*rs_pool_fn)(void *ctx, int64_t begin, int64_t end, int tid);

rs_pool *rs_pool_init(int n_threads); /* n_threads <= 0: number of online CPUs */
void rs_pool_free(rs_pool *p);
int rs_pool_threads(const rs_pool *p);

/* Runs fn over [0, n) split into ranges aligned to `grain` items (grain >= 1). */
void rs_pool_run(rs_pool *p, int64_t n, int64_t grain, rs_pool_fn fn, void *ctx);

/* The same, but each thread takes one grain at a time until none is left, so fn is called once
 * per grain, on whichever thread gets there first (tid as above). For jobs of many similar items
 * on a machine the pool shares with other busy processes: a descheduled thread delays only the
 * grain it holds, where rs_pool_run's fixed split waits for its whole share. */
void rs_pool_run_dynamic(rs_pool *p, int64_t n, int64_t grain, rs_pool_fn fn, void *ctx);

#endif /* RS_POOL_H */
