/*
 * runner.c — runs every registered unit test in its own process with a timeout (libuv's runner).
 *
 *   build/unit-tests                 all tests
 *   build/unit-tests kv_ fp8         tests whose name contains any of the arguments
 *   RS_TEST_TIMEOUT=120 build/...    per-test timeout in seconds (default 60)
 *   RS_TEST_VERBOSE=1 build/...      keep info-level logs (default: warnings and errors only)
 *
 * Ends with the summary line "N passed, N failed, N skipped" and exits non-zero if anything
 * failed. A test skips itself by exiting 77 (RS_TEST_SKIP), e.g. a CUDA test without a GPU.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../../core/rs.h"
#include "test.h"

typedef struct test_entry {
    const char *name;
    rs_test_fn fn;
    const char *file;
} test_entry;

static test_entry tests[1024];
static int n_tests;
static char tmpdir[256];

void rs_test_register(const char *name, rs_test_fn fn, const char *file) {
    if (n_tests < (int)(sizeof tests / sizeof tests[0])) tests[n_tests++] = (test_entry){name, fn, file};
}

const char *rs_test_fixtures_dir(void) {
    const char *d = getenv("RS_FIXTURES");
    return d && *d ? d : "tests/fixtures";
}

const char *rs_test_tmpdir(void) { return tmpdir; }

static int cmp_entry(const void *a, const void *b) {
    const test_entry *x = a, *y = b;
    int c = strcmp(x->file, y->file);
    return c ? c : strcmp(x->name, y->name);
}

static int selected(const char *name, int argc, char **argv) {
    if (argc <= 1) return 1;
    for (int i = 1; i < argc; i++)
        if (strstr(name, argv[i])) return 1;
    return 0;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    qsort(tests, (size_t)n_tests, sizeof tests[0], cmp_entry);
    const char *t = getenv("RS_TEST_TIMEOUT");
    int timeout = t ? atoi(t) : 60;
    if (timeout <= 0) timeout = 60;
    int passed = 0, failed = 0, skipped = 0;
    if (!getenv("RS_TEST_VERBOSE")) rs_log_min_level = RS_LOG_LEVEL_WARN;
    for (int i = 0; i < n_tests; i++) {
        if (!selected(tests[i].name, argc, argv)) continue;
        snprintf(tmpdir, sizeof tmpdir, "/tmp/rs-test-%d-%d", (int)getpid(), i);
        mkdir(tmpdir, 0700);
        fflush(stdout);
        double t0 = now_s();
        pid_t pid = fork();
        if (pid == 0) {
            alarm((unsigned)timeout);
            tests[i].fn();
            fflush(stdout);
            _exit(0);
        }
        int status = 0;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
        double dt = now_s() - t0;
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
        if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", tmpdir);
        if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
            skipped++;
            printf("skip   %-48s %7.2fs\n", tests[i].name, dt);
        } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
            passed++;
            printf("ok     %-48s %7.2fs\n", tests[i].name, dt);
        } else {
            failed++;
            if (WIFSIGNALED(status))
                printf("FAIL   %-48s %7.2fs (%s)\n", tests[i].name, dt,
                       WTERMSIG(status) == SIGALRM ? "timeout" : strsignal(WTERMSIG(status)));
            else
                printf("FAIL   %-48s %7.2fs (exit %d)\n", tests[i].name, dt, WEXITSTATUS(status));
        }
    }
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed ? 1 : 0;
}
