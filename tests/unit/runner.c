/*
 * runner.c — runs every registered unit test in its own process with a timeout (libuv's runner).
 *
 *   build/unit-tests                 all tests
 *   build/unit-tests kv_ fp8         tests whose name contains any of the arguments
 *   RS_TEST_TIMEOUT=120 build/...    per-test timeout in seconds (default 60)
 *   RS_TEST_VERBOSE=1 build/...      keep info-level logs (default: warnings and errors only)
 *   RS_TEST_JOBS=2 build/...         run up to 2 tests at once (default 1), for single-threaded
 *                                    suites such as the CUDA emulation's; each test's output is
 *                                    held in a log and printed with its result line
 *   RS_TEST_FIRST=a,b build/...      start tests a and b (exact names) before the others, in that
 *                                    order: with jobs, the longest first keeps the last one from
 *                                    running alone at the end
 *
 * Ends with the summary line "N passed, N failed, N skipped" and exits non-zero if anything
 * failed. A test skips itself by exiting 77 (RS_TEST_SKIP), e.g. a CUDA test without a GPU.
 */
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
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

#define MAX_JOBS 64

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

/* Moves the tests named in the comma-separated list to the front, in the list's order. */
static void put_first(const char *list) {
    int front = 0;
    for (const char *p = list; *p;) {
        const size_t len = strcspn(p, ",");
        for (int i = front; i < n_tests; i++)
            if (strlen(tests[i].name) == len && strncmp(tests[i].name, p, len) == 0) {
                const test_entry t = tests[i];
                memmove(&tests[front + 1], &tests[front], (size_t)(i - front) * sizeof tests[0]);
                tests[front++] = t;
                break;
            }
        p += len + (p[len] == ',');
    }
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

typedef struct running {
    pid_t pid;
    int i; /* index into tests */
    double t0;
    char dir[256]; /* the test's tmpdir */
} running;

/* Prints a finished test's captured output (when run in parallel), then its status line, and counts it. */
static void finish(const running *r, int status, bool captured, int *passed, int *failed, int *skipped) {
    const double dt = now_s() - r->t0;
    char log[300], cmd[600];
    snprintf(log, sizeof log, "%s.log", r->dir);
    if (captured) {
        FILE *f = fopen(log, "r");
        if (f) {
            char buf[4096];
            size_t got;
            while ((got = fread(buf, 1, sizeof buf, f)) > 0) fwrite(buf, 1, got, stdout);
            fclose(f);
        }
    }
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s'", r->dir, log);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", r->dir);
    const char *name = tests[r->i].name;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
        (*skipped)++;
        printf("skip   %-48s %7.2fs\n", name, dt);
    } else if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        (*passed)++;
        printf("ok     %-48s %7.2fs\n", name, dt);
    } else {
        (*failed)++;
        if (WIFSIGNALED(status))
            printf("FAIL   %-48s %7.2fs (%s)\n", name, dt,
                   WTERMSIG(status) == SIGALRM ? "timeout" : strsignal(WTERMSIG(status)));
        else
            printf("FAIL   %-48s %7.2fs (exit %d)\n", name, dt, WEXITSTATUS(status));
    }
    fflush(stdout);
}

int main(int argc, char **argv) {
    qsort(tests, (size_t)n_tests, sizeof tests[0], cmp_entry);
    if (getenv("RS_TEST_FIRST")) put_first(getenv("RS_TEST_FIRST"));
    const char *t = getenv("RS_TEST_TIMEOUT");
    int timeout = t ? atoi(t) : 60;
    if (timeout <= 0) timeout = 60;
    const char *jv = getenv("RS_TEST_JOBS");
    int jobs = jv ? atoi(jv) : 1;
    if (jobs < 1) jobs = 1;
    if (jobs > MAX_JOBS) jobs = MAX_JOBS;
    const bool captured = jobs > 1; /* parallel tests write to a log each, printed when they end */
    int passed = 0, failed = 0, skipped = 0;
    if (!getenv("RS_TEST_VERBOSE")) rs_log_min_level = RS_LOG_LEVEL_WARN;
    running run[MAX_JOBS];
    int n_run = 0;
    for (int i = 0; i <= n_tests; i++) {
        /* wait while every slot is busy, or at the end until none is */
        while (n_run > 0 && (n_run == jobs || i == n_tests)) {
            int status = 0;
            pid_t pid;
            while ((pid = waitpid(-1, &status, 0)) < 0 && errno == EINTR) {}
            if (pid < 0) break;
            for (int s = 0; s < n_run; s++)
                if (run[s].pid == pid) {
                    finish(&run[s], status, captured, &passed, &failed, &skipped);
                    run[s] = run[--n_run];
                    break;
                }
        }
        if (i == n_tests) break;
        if (!selected(tests[i].name, argc, argv)) continue;
        running *r = &run[n_run];
        snprintf(tmpdir, sizeof tmpdir, "/tmp/rs-test-%d-%d", (int)getpid(), i);
        mkdir(tmpdir, 0700);
        memcpy(r->dir, tmpdir, sizeof r->dir);
        r->i = i;
        fflush(stdout);
        fflush(stderr);
        r->t0 = now_s();
        r->pid = fork();
        if (r->pid == 0) {
            if (captured) {
                char log[300];
                snprintf(log, sizeof log, "%s.log", tmpdir);
                if (!freopen(log, "w", stdout) || dup2(fileno(stdout), STDERR_FILENO) < 0) _exit(2);
                setvbuf(stdout, NULL, _IOLBF, 0);
            }
            alarm((unsigned)timeout);
            tests[i].fn();
            fflush(stdout);
            _exit(0);
        }
        if (r->pid < 0) {
            perror("fork");
            return 2;
        }
        n_run++;
    }
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed ? 1 : 0;
}
