/*
 * test_shm_guard.c — a shared-memory segment that shrinks while rolloutd reads it.
 *
 * The guard (sync/shm_guard.h) at the level of one mapping: reads past the new end return zeros on
 * any thread instead of killing the process, and the shrink is reported; a SIGBUS the guard does
 * not own still ends the process (or reaches the handler installed before the guard). Then the
 * whole /update_weights_from_shm job through the sync service, with the segment truncated after it
 * was mapped and before its first tensor is read (rs_shm_test_hook_mapped, so the timing is
 * deterministic): the request fails with 400, the transaction is dropped, the old weights keep
 * serving (the reference: their logits, bit for bit), and the next good update commits.
 *
 * Also the mappings kept between requests (weight-shm-keep): reused only for the same file at the
 * same size, never for a new segment under an old name, let go when unlinked, resized or refused
 * (mode), least recently used dropped first; and through the service, segments rewritten by the
 * trainer between two updates deliver the new bytes.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../../core/rs.h"
#include "../../model/model.h"
#include "../../model/quant.h"
#include "../../model/safetensors.h"
#include "../../scheduler/engine.h"
#include "../../sync/disk.h"
#include "../../sync/shm.h"
#include "../../sync/shm_guard.h"
#include "../../sync/sync.h"
#include "test.h"
#include "test_util.h"

/* ---------------------------------------------------------------- segments */

typedef struct seg {
    char name[64];
    int fd;                             /* read-write: the trainer's side */
    size_t size;
} seg;

/* A 0600 segment of `size` bytes, byte i = pattern(i). */
static uint8_t pattern(size_t i) { return (uint8_t)(0xA5 ^ (i * 131 + i / 4096)); }

static seg seg_create(size_t size) {
    static int counter;
    seg s = {.size = size};
    snprintf(s.name, sizeof s.name, "/rs-guard-%d-%d", (int)getpid(), counter++);
    s.fd = shm_open(s.name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (s.fd < 0) RS_TEST_FAIL("shm_open %s: %s", s.name, strerror(errno));
    ASSERT_EQ(ftruncate(s.fd, (off_t)size), 0);
    uint8_t *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd, 0);
    ASSERT_TRUE(p != MAP_FAILED);
    for (size_t i = 0; i < size; i++) p[i] = pattern(i);
    munmap(p, size);
    return s;
}

static void seg_destroy(seg *s) {
    close(s->fd);
    shm_unlink(s->name);
}

/* One load the compiler cannot drop or hoist: the fault, if any, happens here. */
static uint8_t load(const uint8_t *p) { return *(const volatile uint8_t *)p; }

typedef struct reader {
    const uint8_t *p;
    uint8_t got;
} reader;

static void *read_on_thread(void *arg) {
    reader *r = arg;
    r->got = load(r->p);
    return NULL;
}

/* ---------------------------------------------------------------- the guard */

RS_TEST(shm_guard_serves_zeros_past_a_shrink) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), size = 4 * page, cut = page + page / 2;
    seg s = seg_create(size);
    rs_shm_segment m;
    rs_error err = {0};
    ASSERT_EQ(rs_shm_open_segment(s.name, &m, &err), RS_OK);
    ASSERT_EQ(m.size, size);
    ASSERT_TRUE(m.guard >= 0);
    ASSERT_TRUE(!rs_shm_guard_truncated(m.guard));
    ASSERT_EQ(load(m.base + 3 * page + 5), pattern(3 * page + 5)); /* the page is populated before the cut */
    ASSERT_EQ(rs_shm_check_intact(&m, s.name, &err), RS_OK);

    ASSERT_EQ(ftruncate(s.fd, (off_t)cut), 0); /* the trainer shrinks it under the mapping */

    /* a page past the new end, read on another thread (a quantization worker): zeros, no crash */
    reader r = {.p = m.base + 3 * page + 5, .got = 0xFF};
    pthread_t th;
    ASSERT_EQ(pthread_create(&th, NULL, read_on_thread, &r), 0);
    ASSERT_EQ(pthread_join(th, NULL), 0);
    ASSERT_EQ(r.got, 0);
    ASSERT_TRUE(rs_shm_guard_truncated(m.guard));
    /* on this thread too, a page the first repair did not reach (it starts at the faulting page) */
    ASSERT_EQ(load(m.base + 2 * page), 0);
    ASSERT_EQ(load(m.base + size - 1), 0);
    /* before the cut the bytes are the trainer's; past it, in the cut's own page, the kernel's zeros */
    for (size_t i = 0; i < cut; i += 97) ASSERT_EQ(load(m.base + i), pattern(i));
    ASSERT_EQ(load(m.base + cut - 1), pattern(cut - 1));
    ASSERT_EQ(load(m.base + cut), 0);

    ASSERT_EQ(rs_shm_check_intact(&m, s.name, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "shm_name");
    char want[64];
    snprintf(want, sizeof want, "shrank to %zu bytes while rolloutd was reading it", cut);
    if (!strstr(err.message, want)) RS_TEST_FAIL("message '%s' lacks '%s'", err.message, want);
    rs_shm_close_segment(&m);
    ASSERT_EQ(m.guard, -1);
    seg_destroy(&s);

    /* The slot is free again, and a fresh mapping starts clean. */
    seg t = seg_create(2 * page);
    ASSERT_EQ(rs_shm_open_segment(t.name, &m, &err), RS_OK);
    ASSERT_TRUE(!rs_shm_guard_truncated(m.guard));
    rs_shm_close_segment(&m);
    seg_destroy(&t);
}

/* A shrink that stays inside the last page raises no SIGBUS (the kernel serves zeros there): the
 * size check after reading is what catches it. */
RS_TEST(shm_guard_shrink_inside_last_page_is_caught_by_size) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), size = 2 * page + 100;
    seg s = seg_create(size);
    rs_shm_segment m;
    rs_error err = {0};
    ASSERT_EQ(rs_shm_open_segment(s.name, &m, &err), RS_OK);
    ASSERT_EQ(ftruncate(s.fd, (off_t)(size - 60)), 0);
    ASSERT_EQ(load(m.base + size - 1), 0);
    ASSERT_EQ(load(m.base + size - 61), pattern(size - 61));
    ASSERT_TRUE(!rs_shm_guard_truncated(m.guard));
    ASSERT_EQ(rs_shm_check_intact(&m, s.name, &err), RS_EINVAL);
    if (!strstr(err.message, "shrank to") || !strstr(err.message, "the update is dropped"))
        RS_TEST_FAIL("message '%s'", err.message);
    rs_shm_close_segment(&m);
    seg_destroy(&s);
}

RS_TEST(shm_guard_slots_run_out_cleanly) {
    seg s = seg_create(4096);
    rs_shm_segment m[RS_SHM_GUARD_SLOTS + 1];
    rs_error err = {0};
    for (int i = 0; i < RS_SHM_GUARD_SLOTS; i++) ASSERT_EQ(rs_shm_open_segment(s.name, &m[i], &err), RS_OK);
    ASSERT_EQ(rs_shm_open_segment(s.name, &m[RS_SHM_GUARD_SLOTS], &err), RS_EBUSY);
    ASSERT_STREQ(err.param, "shm_name");
    ASSERT_TRUE(m[RS_SHM_GUARD_SLOTS].base == NULL && m[RS_SHM_GUARD_SLOTS].fd == -1);
    rs_shm_close_segment(&m[3]);
    ASSERT_EQ(rs_shm_open_segment(s.name, &m[3], &err), RS_OK);
    for (int i = 0; i < RS_SHM_GUARD_SLOTS; i++) rs_shm_close_segment(&m[i]);
    seg_destroy(&s);
}

/* In a child: installs the guard (by opening a guarded segment), then faults on a file mapping the
 * guard does not own. Never returns. */
static void fault_outside_the_guard(void) {
    alarm(10); /* a guard that swallowed the fault would re-run the access forever */
    struct rlimit no_core = {0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    char log[300];
    snprintf(log, sizeof log, "%s/child-stderr", rs_test_tmpdir());
    int lfd = open(log, O_CREAT | O_WRONLY | O_TRUNC, 0600);
    if (lfd < 0 || dup2(lfd, 2) < 0) _exit(2);
    seg s = seg_create(4096);
    rs_shm_segment m;
    rs_error err = {0};
    if (rs_shm_open_segment(s.name, &m, &err) != RS_OK) _exit(3);
    shm_unlink(s.name); /* the child dies below: its segment's name must not outlive it (pid reuse) */
    char path[300];
    snprintf(path, sizeof path, "%s/truncated", rs_test_tmpdir());
    int fd = open(path, O_CREAT | O_RDWR | O_TRUNC, 0600);
    if (fd < 0 || ftruncate(fd, 8192) != 0) _exit(4);
    const uint8_t *p = mmap(NULL, 8192, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED || ftruncate(fd, 0) != 0) _exit(5);
    load(p + 4096);
    _exit(0); /* survived: the guard swallowed a SIGBUS that was not its own */
}

static int run_child(void (*fn)(void)) {
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    ASSERT_TRUE(pid >= 0);
    if (pid == 0) fn();
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    return status;
}

/* A genuine bug (a fault outside every guarded mapping) still kills the process with SIGBUS. */
RS_TEST(shm_guard_foreign_sigbus_is_still_fatal) {
    int status = run_child(fault_outside_the_guard);
#ifdef RS_ASAN
    /* ASan's handler came first: the guard hands the fault to it, and it reports and exits 1 */
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 1)
        RS_TEST_FAIL("child status %#x: want ASan's report and exit 1", status);
    char path[300], text[4096] = {0};
    snprintf(path, sizeof path, "%s/child-stderr", rs_test_tmpdir());
    FILE *f = fopen(path, "r");
    ASSERT_TRUE(f != NULL);
    size_t got = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    if (got == 0 || !strstr(text, "AddressSanitizer: BUS")) RS_TEST_FAIL("child stderr: '%s'", text);
#else
    if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGBUS)
        RS_TEST_FAIL("child status %#x (exit %d), want death by SIGBUS", status,
                     WIFEXITED(status) ? WEXITSTATUS(status) : -1);
#endif
}

static void on_bus_exit_42(int sig, siginfo_t *si, void *uctx) {
    (void)sig, (void)uctx;
    _exit(si->si_code == BUS_ADRERR ? 42 : 43);
}

static void previous_handler_then_fault(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_bus_exit_42;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, NULL) != 0) _exit(6);
    fault_outside_the_guard();
}

/* The handler installed before the guard (a sanitizer's, a crash reporter's) gets the SIGBUS the
 * guard does not own, with its siginfo. */
RS_TEST(shm_guard_chains_to_the_previous_handler) {
    int status = run_child(previous_handler_then_fault);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 42)
        RS_TEST_FAIL("child status %#x (exit %d), want exit 42 from the previous handler", status,
                     WIFEXITED(status) ? WEXITSTATUS(status) : -1);
}

/* ---------------------------------------------------------------- the whole request */



/* Checkpoint B's tensors [from, to) packed into a new segment (8-aligned), with their manifest. */
typedef struct bucket {
    seg sg;
    rs_weight_desc *d;
    int n;
} bucket;

static bucket bucket_make(rs_st_dir *bt, size_t from, size_t to) {
    bucket k = {0};
    size_t total = 0;
    for (size_t i = from; i < to; i++) total += (rs_st_dir_tensor_at(bt, i, NULL)->nbytes + 7) & ~(size_t)7;
    k.sg = seg_create(total);
    uint8_t *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, k.sg.fd, 0);
    ASSERT_TRUE(p != MAP_FAILED);
    k.d = calloc(to - from, sizeof *k.d);
    size_t off = 0;
    for (size_t i = from; i < to; i++) {
        const rs_st_tensor *t = rs_st_dir_tensor_at(bt, i, NULL);
        rs_weight_desc *d = &k.d[k.n++];
        snprintf(d->name, sizeof d->name, "%s", t->name);
        d->dtype = t->dtype;
        d->ndim = t->ndim;
        memcpy(d->shape, t->shape, sizeof d->shape);
        d->offset = off;
        d->nbytes = t->nbytes;
        memcpy(p + off, t->data, t->nbytes);
        off += (t->nbytes + 7) & ~(size_t)7;
    }
    munmap(p, total);
    return k;
}

static void bucket_free(bucket *k) {
    seg_destroy(&k->sg);
    free(k->d);
}

static int send_bucket(rs_sync *s, const bucket *k, rs_weight_last last, rs_sync_job *job) {
    memset(job, 0, sizeof *job);
    job->kind = RS_SYNC_SHM;
    rs_shm_update_req *r = &job->req.shm;
    snprintf(r->shm_name, sizeof r->shm_name, "%s", k->sg.name);
    r->tensors = k->d;
    r->n_tensors = k->n;
    r->is_last = last;
    r->has_version = true;
    snprintf(r->weight_version, sizeof r->weight_version, "5");
    return rs_sync_run(s, job);
}

/* The trainer's misbehaviour, run by the service thread between mapping and reading. */
static int hook_fd = -1;
static off_t hook_size;
static void truncate_now(const char *shm_name) {
    (void)shm_name;
    if (ftruncate(hook_fd, hook_size) != 0) RS_TEST_FAIL("ftruncate: %s", strerror(errno));
}

/* The daemon's sync configuration: quantizing threads and kept mappings. */
static rs_test_sync_env open_fp8(void) {
    rs_sync_opts so = {.threads = 2, .keep_shm_maps = true};
    return rs_test_sync_open("fp8", &so);
}

/* The FP8-served model quantizes BF16 matrices on the sync pool's workers, so the reads that fault
 * run on worker threads as well as on the service thread. */
RS_TEST(sync_shm_segment_truncated_mid_request) {
    rs_test_sync_env f = open_fp8();
    rs_sync *s = f.s;
    rs_engine *e = f.e;
    rs_st_dir *bt = f.bt;
    const size_t n = rs_st_dir_count(bt), half = n / 2, page = (size_t)sysconf(_SC_PAGESIZE);

    enum { PAST_PAGES, INSIDE_LAST_PAGE, N_CASES };
    for (int cs = 0; cs < N_CASES; cs++) {
        bucket k1 = bucket_make(bt, 0, half), k2 = bucket_make(bt, half, n);
        rs_sync_job job;
        ASSERT_EQ(send_bucket(s, &k1, RS_WEIGHT_LAST_NO, &job), RS_OK);
        ASSERT_TRUE(job.res.n_staged > 0);
        /* PAST_PAGES: most of the bucket's pages vanish, so reads fault (SIGBUS) and get zeros;
         * INSIDE_LAST_PAGE: the segment loses its last 2 bytes, which read as zeros without a fault */
        ASSERT_TRUE(k2.sg.size > 4 * page);
        hook_size = cs == PAST_PAGES ? (off_t)page : (off_t)(k2.sg.size - 2);
        hook_fd = k2.sg.fd;
        rs_shm_test_hook_mapped = truncate_now;
        int rc = send_bucket(s, &k2, RS_WEIGHT_LAST_YES, &job);
        rs_shm_test_hook_mapped = NULL;
        ASSERT_EQ(rc, RS_EINVAL);
        ASSERT_EQ(rs_err_http_status(rc), 400);
        ASSERT_STREQ(job.err.param, "shm_name");
        char want[160];
        snprintf(want, sizeof want, "'%s' shrank to %lld bytes while rolloutd was reading it", k2.sg.name,
                 (long long)hook_size);
        if (!strstr(job.err.message, want) || !strstr(job.err.message, "the update is dropped"))
            RS_TEST_FAIL("case %d: message '%s' lacks '%s'", cs, job.err.message, want);
        ASSERT_TRUE(!job.res.committed);
        rs_sync_stats st;
        rs_sync_get_stats(s, &st);
        ASSERT_TRUE(!st.txn_open); /* bucket 1 went with it */
        ASSERT_EQ(st.staged_bytes, 0);
        ASSERT_EQ(st.updates, 0);
        ASSERT_EQ(st.updates_failed, (uint64_t)cs + 1);
        ASSERT_EQ(st.shm_mapped_bytes, k1.sg.size); /* the shrunk segment's mapping was let go */
        ASSERT_STREQ(rs_engine_weight_version(e), "0");
        if (!rs_test_sync_serves(&f, f.logits_a)) RS_TEST_FAIL("case %d: the served weights changed", cs);
        bucket_free(&k1);
        bucket_free(&k2);
    }

    /* the service is healthy: the same update, untouched, commits */
    bucket k1 = bucket_make(bt, 0, half), k2 = bucket_make(bt, half, n);
    rs_sync_job job;
    ASSERT_EQ(send_bucket(s, &k1, RS_WEIGHT_LAST_NO, &job), RS_OK);
    if (send_bucket(s, &k2, RS_WEIGHT_LAST_YES, &job) != RS_OK) RS_TEST_FAIL("%s", job.err.message);
    ASSERT_TRUE(job.res.committed);
    ASSERT_STREQ(rs_engine_weight_version(e), "5");
    if (!rs_test_sync_serves(&f, f.logits_b)) RS_TEST_FAIL("the committed weights are not B's");
    bucket_free(&k1);
    bucket_free(&k2);
    rs_test_sync_close(&f);
}

/* ---------------------------------------------------------------- a checkpoint rewritten in place */

/* The trainer rewriting the checkpoint in place (safetensors' save_file and torch.save open it
 * with O_TRUNC), run by the service thread once the shards are open and before the first tensor
 * is read. */
static char disk_hook_path[700];
static off_t disk_hook_size;
static void truncate_checkpoint(const char *model_dir) {
    (void)model_dir;
    if (truncate(disk_hook_path, disk_hook_size) != 0) RS_TEST_FAIL("truncate: %s", strerror(errno));
}

static int disk_update(rs_sync *s, const char *dir, rs_sync_job *job) {
    memset(job, 0, sizeof *job);
    job->kind = RS_SYNC_DISK;
    snprintf(job->req.disk.model_path, sizeof job->req.disk.model_path, "%s", dir);
    job->req.disk.has_version = true;
    snprintf(job->req.disk.weight_version, sizeof job->req.disk.weight_version, "7");
    return rs_sync_run(s, job);
}

/* /update_weights_from_disk reading a checkpoint that the trainer truncates under it: a 400 that
 * drops the whole update, never SIGBUS. Shrunk by most of its pages (the reads fault, on the sync
 * thread and on the FP8 quantizer's workers, and the guard serves zeros) or by 2 bytes inside the
 * last page (no fault; the size check sees it). The old weights keep serving (their logits, bit
 * for bit), and the same checkpoint written whole again commits. */
RS_TEST(sync_disk_checkpoint_truncated_mid_request) {
    rs_sync_opts so = {.threads = 2, .keep_shm_maps = true, .allowed_weight_dir = rs_test_tmpdir()};
    rs_test_sync_env f = rs_test_sync_open("fp8", &so);
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const rs_model_config cfg = rs_test_tiny_qwen3();
    char dir[600];
    snprintf(dir, sizeof dir, "%s/step", rs_test_tmpdir());
    snprintf(disk_hook_path, sizeof disk_hook_path, "%s/model.safetensors", dir);
    rs_error err = {0};
    enum { PAST_PAGES, INSIDE_LAST_PAGE, N_CASES };
    for (int cs = 0; cs < N_CASES; cs++) {
        ASSERT_EQ(rs_testmodel_write(dir, &cfg, 2, &err), RS_OK); /* checkpoint B, whole */
        struct stat st;
        ASSERT_EQ(stat(disk_hook_path, &st), 0);
        ASSERT_TRUE((size_t)st.st_size > 8 * page);
        disk_hook_size = cs == PAST_PAGES ? (off_t)page : st.st_size - 2;
        rs_disk_test_hook_opened = truncate_checkpoint;
        rs_sync_job job;
        int rc = disk_update(f.s, dir, &job);
        rs_disk_test_hook_opened = NULL;
        ASSERT_EQ(rc, RS_EINVAL);
        ASSERT_EQ(rs_err_http_status(rc), 400);
        ASSERT_STREQ(job.err.param, "model_path");
        if (!strstr(job.err.message, "model.safetensors' shrank while rolloutd was reading it") ||
            !strstr(job.err.message, "the update is dropped"))
            RS_TEST_FAIL("case %d: message '%s'", cs, job.err.message);
        ASSERT_TRUE(!job.res.committed);
        rs_sync_stats sst;
        rs_sync_get_stats(f.s, &sst);
        ASSERT_TRUE(!sst.txn_open);
        ASSERT_EQ(sst.staged_bytes, 0);
        ASSERT_EQ(sst.updates, 0);
        ASSERT_EQ(sst.updates_failed, (uint64_t)cs + 1);
        ASSERT_STREQ(rs_engine_weight_version(f.e), "0");
        if (!rs_test_sync_serves(&f, f.logits_a)) RS_TEST_FAIL("case %d: the served weights changed", cs);
    }
    ASSERT_EQ(rs_testmodel_write(dir, &cfg, 2, &err), RS_OK);
    rs_sync_job job;
    if (disk_update(f.s, dir, &job) != RS_OK) RS_TEST_FAIL("%s", job.err.message);
    ASSERT_TRUE(job.res.committed);
    ASSERT_STREQ(rs_engine_weight_version(f.e), "7");
    if (!rs_test_sync_serves(&f, f.logits_b)) RS_TEST_FAIL("the committed weights are not B's");
    rs_test_sync_close(&f);
}

/* ---------------------------------------------------------------- what gets populated */

/* Resident bytes of this process's mappings of `path` (/proc/self/smaps Rss: pages in its page
 * tables, populated or faulted in). */
static size_t mapped_rss(const char *path) {
    FILE *fp = fopen("/proc/self/smaps", "r");
    ASSERT_TRUE(fp != NULL);
    char line[1024];
    bool in = false;
    size_t kb = 0, total = 0;
    while (fgets(line, sizeof line, fp)) {
        unsigned long a, b;
        if (sscanf(line, "%lx-%lx ", &a, &b) == 2) {
            size_t n = strlen(line);
            while (n && line[n - 1] == '\n') line[--n] = '\0';
            in = n >= strlen(path) && strcmp(line + n - strlen(path), path) == 0;
        } else if (in && sscanf(line, "Rss: %zu kB", &kb) == 1) {
            total += kb << 10;
        }
    }
    fclose(fp);
    return total;
}

static char rss_path[128];
static size_t rss_at_hook;
static void measure_rss(const char *shm_name) {
    (void)shm_name;
    rss_at_hook = mapped_rss(rss_path);
}

/* Tmpfs bytes allocated to a segment. */
static size_t seg_allocated(const seg *sg) {
    struct stat st;
    ASSERT_EQ(fstat(sg->fd, &st), 0);
    return (size_t)st.st_blocks * 512;
}

/* Whether this kernel has MADV_POPULATE_READ (Linux 5.14); without it the daemon's pages fault in
 * as they are read instead of in one pass, and nothing is populated ahead of the reads. */
static bool kernel_populates(void) {
#ifdef MADV_POPULATE_READ
    void *p = mmap(NULL, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_TRUE(p != MAP_FAILED);
    bool ok = madvise(p, 4096, MADV_POPULATE_READ) == 0;
    munmap(p, 4096);
    return ok;
#else
    return false;
#endif
}

/* A request names a large sparse segment (tmpfs allocates a page on a read fault in a hole):
 *   - a manifest that overruns it is refused before anything is mapped, and allocates nothing;
 *   - one small tensor at its start: only that tensor's pages are populated (before the first
 *     read, in one pass) and allocated, not the other 64 MiB;
 *   - the same segment again (a kept mapping) with a second tensor far into it: nothing is
 *     populated again at open (the kept pages stay mapped; the new tensor's pages fault in as they
 *     are read), and both tensors arrive;
 *   - the rest of B packed in a new segment: all its pages are populated before the first read
 *     (the tensors' ranges merged into runs), and the update commits B, bit for bit. */
RS_TEST(sync_shm_populates_only_what_tensors_cover) {
    rs_test_sync_env f = open_fp8();
    rs_sync *s = f.s;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), big = 64u << 20, far = 32u << 20;
    const rs_st_tensor *t0 = rs_st_dir_tensor_at(f.bt, 0, NULL), *t1 = rs_st_dir_tensor_at(f.bt, 1, NULL);
    const size_t t0_pages = (t0->nbytes + page - 1) / page * page;
    const bool populates = kernel_populates();

    seg sg = {.size = big};
    snprintf(sg.name, sizeof sg.name, "/rs-guard-%d-sparse", (int)getpid());
    snprintf(rss_path, sizeof rss_path, "/dev/shm%s", sg.name);
    sg.fd = shm_open(sg.name, O_CREAT | O_EXCL | O_RDWR, 0600);
    ASSERT_TRUE(sg.fd >= 0);
    ASSERT_EQ(ftruncate(sg.fd, (off_t)big), 0);
    ASSERT_EQ(seg_allocated(&sg), 0);

    rs_weight_desc d[1];
    memset(d, 0, sizeof d);
    snprintf(d[0].name, sizeof d[0].name, "%s", t0->name);
    d[0].dtype = t0->dtype;
    d[0].ndim = t0->ndim;
    memcpy(d[0].shape, t0->shape, sizeof d[0].shape);
    d[0].nbytes = t0->nbytes;
    d[0].offset = big; /* past the end */
    bucket k = {.sg = sg, .d = d, .n = 1};
    rs_sync_job job;
    ASSERT_EQ(send_bucket(s, &k, RS_WEIGHT_LAST_NO, &job), RS_EINVAL);
    ASSERT_STREQ(job.err.param, "tensors[0].offset");
    ASSERT_EQ(seg_allocated(&sg), 0);
    rs_sync_stats st;
    rs_sync_get_stats(s, &st);
    ASSERT_EQ(st.shm_mapped_bytes, 0);

    /* t0 at offset 0, the rest a hole (written with pwrite: a mapping of the test's own would
     * count in the Rss measured) */
    ASSERT_EQ(pwrite(sg.fd, t0->data, t0->nbytes, 0), (ssize_t)t0->nbytes);
    d[0].offset = 0;
    rs_shm_test_hook_mapped = measure_rss;
    int rc = send_bucket(s, &k, RS_WEIGHT_LAST_NO, &job);
    rs_shm_test_hook_mapped = NULL;
    if (rc != RS_OK) RS_TEST_FAIL("%s", job.err.message);
    ASSERT_EQ(job.res.n_staged, 1);
    if (seg_allocated(&sg) > t0_pages) RS_TEST_FAIL("%zu bytes allocated for %zu covered", seg_allocated(&sg), t0_pages);
    if (rss_at_hook > t0_pages || (populates && rss_at_hook < t0_pages))
        RS_TEST_FAIL("%zu bytes mapped before the first read; the tensor covers %zu", rss_at_hook, t0_pages);
    rs_sync_get_stats(s, &st);
    ASSERT_EQ(st.shm_mapped_bytes, big); /* kept */
    const size_t rss_kept = mapped_rss(rss_path);

    /* the kept mapping again, now also carrying t1 32 MiB in */
    ASSERT_EQ(pwrite(sg.fd, t1->data, t1->nbytes, (off_t)far), (ssize_t)t1->nbytes);
    rs_weight_desc d1[1] = {d[0]};
    snprintf(d1[0].name, sizeof d1[0].name, "%s", t1->name);
    d1[0].dtype = t1->dtype;
    d1[0].ndim = t1->ndim;
    memcpy(d1[0].shape, t1->shape, sizeof d1[0].shape);
    d1[0].nbytes = t1->nbytes;
    d1[0].offset = far;
    bucket k1 = {.sg = sg, .d = d1, .n = 1};
    rs_shm_test_hook_mapped = measure_rss;
    rc = send_bucket(s, &k1, RS_WEIGHT_LAST_NO, &job);
    rs_shm_test_hook_mapped = NULL;
    if (rc != RS_OK) RS_TEST_FAIL("%s", job.err.message);
    ASSERT_EQ(job.res.n_staged, 2);
    ASSERT_EQ(rss_at_hook, rss_kept); /* not populated again */
    if (seg_allocated(&sg) > t0_pages + (t1->nbytes + page - 1) / page * page + page)
        RS_TEST_FAIL("%zu bytes allocated", seg_allocated(&sg));

    /* the rest of B packed in a new segment */
    bucket rest = bucket_make(f.bt, 2, rs_st_dir_count(f.bt));
    snprintf(rss_path, sizeof rss_path, "/dev/shm%s", rest.sg.name);
    rs_shm_test_hook_mapped = measure_rss;
    rc = send_bucket(s, &rest, RS_WEIGHT_LAST_YES, &job);
    rs_shm_test_hook_mapped = NULL;
    if (rc != RS_OK) RS_TEST_FAIL("%s", job.err.message);
    if (populates && rss_at_hook != (rest.sg.size + page - 1) / page * page)
        RS_TEST_FAIL("%zu of the packed bucket's %zu bytes mapped before the first read", rss_at_hook, rest.sg.size);
    ASSERT_TRUE(job.res.committed);
    if (!rs_test_sync_serves(&f, f.logits_b)) RS_TEST_FAIL("the committed weights are not B's");

    bucket_free(&rest);
    seg_destroy(&sg);
    rs_test_sync_close(&f);
}

/* ---------------------------------------------------------------- kept mappings */

static void seg_fill(seg *s, uint8_t v) {
    uint8_t *p = mmap(NULL, s->size, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    ASSERT_TRUE(p != MAP_FAILED);
    memset(p, v, s->size);
    munmap(p, s->size);
}

/* Opens `name` through `maps`, checks every byte is v, closes; returns the base it was read at. */
static const uint8_t *read_kept(rs_shm_maps *maps, const char *name, size_t size, uint8_t v) {
    rs_shm_segment g;
    rs_error err = {0};
    if (rs_shm_open_kept(maps, name, &g, &err) != RS_OK) RS_TEST_FAIL("open %s: %s", name, err.message);
    ASSERT_EQ(g.size, size);
    ASSERT_TRUE(g.kept);
    for (size_t i = 0; i < size; i++)
        if (g.base[i] != v) RS_TEST_FAIL("%s byte %zu is %u, want %u", name, i, g.base[i], v);
    const uint8_t *base = g.base;
    rs_shm_close_segment(&g);
    return base;
}

RS_TEST(shm_kept_mappings) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    rs_shm_maps *maps = rs_shm_maps_new();
    rs_error err = {0};

    /* reused while the trainer keeps the segment, and it sees what the trainer writes */
    seg a = seg_create(3 * page);
    seg_fill(&a, 1);
    const uint8_t *base = read_kept(maps, a.name, a.size, 1);
    ASSERT_EQ(rs_shm_maps_bytes(maps), a.size);
    seg_fill(&a, 2);
    ASSERT_TRUE(read_kept(maps, a.name, a.size, 2) == base);
    rs_shm_maps_sweep(maps);
    ASSERT_EQ(rs_shm_maps_bytes(maps), a.size);

    /* resized: mapped anew at the new size, the old mapping dropped */
    ASSERT_EQ(ftruncate(a.fd, (off_t)(5 * page)), 0);
    a.size = 5 * page;
    seg_fill(&a, 3);
    read_kept(maps, a.name, a.size, 3);
    ASSERT_EQ(rs_shm_maps_bytes(maps), 5 * page);

    /* a new segment under the old name is a new file: its own bytes, never the old mapping's */
    ASSERT_EQ(shm_unlink(a.name), 0);
    close(a.fd);
    a.fd = shm_open(a.name, O_CREAT | O_EXCL | O_RDWR, 0600);
    ASSERT_TRUE(a.fd >= 0);
    ASSERT_EQ(ftruncate(a.fd, (off_t)a.size), 0);
    seg_fill(&a, 4);
    read_kept(maps, a.name, a.size, 4);
    rs_shm_maps_sweep(maps); /* the unlinked file's mapping goes */
    ASSERT_EQ(rs_shm_maps_bytes(maps), a.size);

    /* every check runs again on a kept segment: one made group-readable is refused */
    ASSERT_EQ(fchmod(a.fd, 0640), 0);
    rs_shm_segment g;
    ASSERT_EQ(rs_shm_open_kept(maps, a.name, &g, &err), RS_EINVAL);
    ASSERT_TRUE(strstr(err.message, "mode 0640") != NULL);
    ASSERT_EQ(fchmod(a.fd, 0600), 0);

    /* unlinked: let go at the next sweep */
    seg_destroy(&a);
    rs_shm_maps_sweep(maps);
    ASSERT_EQ(rs_shm_maps_bytes(maps), 0);

    /* at most RS_SHM_KEEP, the least recently used dropped first */
    seg many[RS_SHM_KEEP + 1];
    for (int i = 0; i <= RS_SHM_KEEP; i++) {
        many[i] = seg_create((size_t)(i + 1) * page);
        seg_fill(&many[i], (uint8_t)(10 + i));
    }
    for (int i = 0; i < RS_SHM_KEEP; i++) read_kept(maps, many[i].name, many[i].size, (uint8_t)(10 + i));
    const uint8_t *first = read_kept(maps, many[0].name, many[0].size, 10); /* 1 is now the oldest */
    read_kept(maps, many[RS_SHM_KEEP].name, many[RS_SHM_KEEP].size, (uint8_t)(10 + RS_SHM_KEEP));
    size_t want = 0;
    for (int i = 0; i <= RS_SHM_KEEP; i++) want += i == 1 ? 0 : many[i].size;
    ASSERT_EQ(rs_shm_maps_bytes(maps), want);
    ASSERT_TRUE(read_kept(maps, many[0].name, many[0].size, 10) == first);

    /* a request's own mapping (maps NULL) is not kept */
    ASSERT_EQ(rs_shm_open_kept(NULL, many[1].name, &g, &err), RS_OK);
    ASSERT_TRUE(!g.kept);
    rs_shm_close_segment(&g);
    for (int i = 0; i <= RS_SHM_KEEP; i++) seg_destroy(&many[i]);
    rs_shm_maps_free(maps);
}

/* The same two segments carry two updates (the client's keep_segments): the second must deliver
 * the bytes the trainer wrote for it, through the kept mappings, bit for bit. */
RS_TEST(sync_shm_kept_segments_carry_the_next_update) {
    rs_test_sync_env f = open_fp8();
    rs_sync *s = f.s;
    rs_error err = {0};
    rs_st_dir *ta = NULL, *tb = f.bt;
    ASSERT_EQ(rs_st_dir_open(&ta, f.dir_a, &err), RS_OK);
    const size_t n = rs_st_dir_count(tb), half = n / 2;
    ASSERT_EQ(rs_st_dir_count(ta), n);

    bucket k1 = bucket_make(tb, 0, half), k2 = bucket_make(tb, half, n);
    rs_sync_job job;
    ASSERT_EQ(send_bucket(s, &k1, RS_WEIGHT_LAST_NO, &job), RS_OK);
    if (send_bucket(s, &k2, RS_WEIGHT_LAST_YES, &job) != RS_OK) RS_TEST_FAIL("%s", job.err.message);
    if (!rs_test_sync_serves(&f, f.logits_b)) RS_TEST_FAIL("the first update is not B's weights");
    rs_sync_stats st;
    rs_sync_get_stats(s, &st);
    ASSERT_EQ(st.shm_mapped_bytes, k1.sg.size + k2.sg.size);

    /* the trainer rewrites the same segments with A (same layout: same names, shapes, dtypes) */
    bucket a1 = bucket_make(ta, 0, half), a2 = bucket_make(ta, half, n);
    ASSERT_EQ(a1.sg.size, k1.sg.size);
    ASSERT_EQ(a2.sg.size, k2.sg.size);
    const bucket *src[2] = {&a1, &a2};
    const bucket *dst[2] = {&k1, &k2};
    for (int i = 0; i < 2; i++) {
        uint8_t *from = mmap(NULL, src[i]->sg.size, PROT_READ, MAP_SHARED, src[i]->sg.fd, 0);
        uint8_t *to = mmap(NULL, dst[i]->sg.size, PROT_READ | PROT_WRITE, MAP_SHARED, dst[i]->sg.fd, 0);
        ASSERT_TRUE(from != MAP_FAILED && to != MAP_FAILED);
        memcpy(to, from, dst[i]->sg.size);
        munmap(from, src[i]->sg.size);
        munmap(to, dst[i]->sg.size);
    }
    ASSERT_EQ(send_bucket(s, &k1, RS_WEIGHT_LAST_NO, &job), RS_OK);
    if (send_bucket(s, &k2, RS_WEIGHT_LAST_YES, &job) != RS_OK) RS_TEST_FAIL("%s", job.err.message);
    ASSERT_TRUE(job.res.committed);
    if (!rs_test_sync_serves(&f, f.logits_a)) RS_TEST_FAIL("the second update is not A's weights");

    /* the trainer unlinks its segments: the service lets them go within about a second */
    bucket_free(&a1);
    bucket_free(&a2);
    bucket_free(&k1);
    bucket_free(&k2);
    for (int i = 0; i < 40; i++) {
        rs_sync_get_stats(s, &st);
        if (st.shm_mapped_bytes == 0) break;
        usleep(50 * 1000);
    }
    ASSERT_EQ(st.shm_mapped_bytes, 0);

    rs_st_dir_close(ta);
    rs_test_sync_close(&f);
}
