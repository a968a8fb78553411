/*
 * test.h — the unit-test harness. A test is
 *
 *     RS_TEST(kv_pool_reserve_release) { ... ASSERT_EQ(a, b); ... }
 *
 * anywhere under tests/unit/; it registers itself at start-up. The runner (runner.c) forks each
 * test into its own process with a timeout, so a crash or hang fails one test, not the run.
 * ASSERT_* print both sides on failure and end the test process with status 1.
 */
#ifndef RS_TEST_H
#define RS_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void (*rs_test_fn)(void);
void rs_test_register(const char *name, rs_test_fn fn, const char *file);
/* Directory of committed fixtures (tests/fixtures, or $RS_FIXTURES). */
const char *rs_test_fixtures_dir(void);
/* A fresh scratch directory for this test process (removed by the runner). */
const char *rs_test_tmpdir(void);

#define RS_TEST(name)                                                                 \
    static void test_##name(void);                                                    \
    __attribute__((constructor)) static void rs_register_##name(void) {               \
        rs_test_register(#name, test_##name, __FILE__);                               \
    }                                                                                 \
    static void test_##name(void)

#define RS_TEST_FAIL(...)                                                             \
    do {                                                                              \
        fprintf(stderr, "  %s:%d: ", __FILE__, __LINE__);                             \
        fprintf(stderr, __VA_ARGS__);                                                 \
        fprintf(stderr, "\n");                                                        \
        exit(1);                                                                      \
    } while (0)

/* Ends the test as skipped (exit status 77), e.g. a CUDA test on a machine without a GPU. */
#define RS_TEST_SKIP(...)                                                             \
    do {                                                                              \
        fprintf(stderr, "  skipped: ");                                               \
        fprintf(stderr, __VA_ARGS__);                                                 \
        fprintf(stderr, "\n");                                                        \
        exit(77);                                                                     \
    } while (0)

/* Prints "  skipped: NAME (this CPU cannot run it)" once per name and test process: for a code path
 * (an instruction set) that a test cannot run here while it runs the others. */
static inline void rs_test_note_skip(const char *name) {
    static const char *seen[16];
    for (int i = 0; i < 16 && seen[i]; i++)
        if (strcmp(seen[i], name) == 0) return;
    for (int i = 0; i < 16; i++)
        if (!seen[i]) {
            seen[i] = name;
            break;
        }
    fprintf(stderr, "  skipped: %s (this CPU cannot run it)\n", name);
}

#define ASSERT_TRUE(c)                                                                \
    do { if (!(c)) RS_TEST_FAIL("ASSERT_TRUE(%s) failed", #c); } while (0)

#define ASSERT_EQ(a, b)                                                               \
    do {                                                                              \
        long long a_ = (long long)(a), b_ = (long long)(b);                           \
        if (a_ != b_) RS_TEST_FAIL("ASSERT_EQ(%s, %s): %lld != %lld", #a, #b, a_, b_); \
    } while (0)

#define ASSERT_NE(a, b)                                                               \
    do {                                                                              \
        long long a_ = (long long)(a), b_ = (long long)(b);                           \
        if (a_ == b_) RS_TEST_FAIL("ASSERT_NE(%s, %s): both %lld", #a, #b, a_);       \
    } while (0)

#define ASSERT_NEAR(a, b, tol)                                                        \
    do {                                                                              \
        double a_ = (double)(a), b_ = (double)(b), t_ = (double)(tol);                \
        if (!(fabs(a_ - b_) <= t_))                                                   \
            RS_TEST_FAIL("ASSERT_NEAR(%s, %s, %g): %.9g vs %.9g (diff %.3g)", #a, #b, \
                         t_, a_, b_, fabs(a_ - b_));                                  \
    } while (0)

#define ASSERT_STREQ(a, b)                                                            \
    do {                                                                              \
        const char *a_ = (a), *b_ = (b);                                              \
        if (!a_ || !b_ || strcmp(a_, b_) != 0)                                        \
            RS_TEST_FAIL("ASSERT_STREQ(%s, %s): \"%s\" != \"%s\"", #a, #b,            \
                         a_ ? a_ : "(null)", b_ ? b_ : "(null)");                     \
    } while (0)

#endif /* RS_TEST_H */
