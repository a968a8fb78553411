/*
 * test_sync.c — the weight-sync service end to end in process: real POSIX shared-memory segments,
 * a running engine thread, the CPU backend; checkpoint directories for the disk route; and the
 * request parsers of every weight route.
 *
 * The reference for a successful update is a fresh rs_model_load of the checkpoint the trainer
 * "sent": the served model's logits must equal its logits bit for bit. The reference for a failed
 * one is the model before it: logits unchanged, no transaction left open, and the service still
 * able to take the next update.
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../../core/latch.h"
#include "../../kvcache/kvcache.h"
#include "../../model/model.h"
#include "../../model/quant.h"
#include "../../model/safetensors.h"
#include "../../protocol/weights.h"
#include "../../scheduler/engine.h"
#include "../../sync/disk.h"
#include "../../sync/shm.h"
#include "../../sync/sync.h"
#include "test.h"
#include "test_util.h"

/* ---------------------------------------------------------------- models and logits */


static void write_model(const char *dir, uint64_t seed) {
    rs_model_config c = rs_test_tiny_qwen3();
    rs_test_write_model(dir, &c, seed);
}

typedef rs_test_sync_env env;

static void expect_serving(env *v, const float *want) {
    if (!rs_test_sync_serves(v, want)) RS_TEST_FAIL("the served logits are not the expected model's");
}

static rs_sync_stats stats(env *v) {
    rs_sync_stats st;
    rs_sync_get_stats(v->s, &st);
    return st;
}

/* ---------------------------------------------------------------- shared memory */

typedef struct seg {
    char name[64];
    int fd;
    uint8_t *p;
    size_t size;
} seg;

static seg seg_create(size_t size, mode_t mode) {
    static int counter;
    seg s = {.size = size};
    snprintf(s.name, sizeof s.name, "/rs-test-%d-%d", (int)getpid(), counter++);
    s.fd = shm_open(s.name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (s.fd < 0) RS_TEST_FAIL("shm_open %s: %s", s.name, strerror(errno));
    if (mode != 0600) ASSERT_EQ(fchmod(s.fd, mode), 0);
    ASSERT_EQ(ftruncate(s.fd, (off_t)size), 0);
    s.p = size ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd, 0) : NULL;
    ASSERT_TRUE(s.p != MAP_FAILED);
    return s;
}

static void seg_destroy(seg *s) {
    if (s->p) munmap(s->p, s->size);
    close(s->fd);
    shm_unlink(s->name);
}

/* A bucket: B's tensors [from, to) written into a new segment (offsets 8-aligned, plus `extra`
 * bytes of room at the end), and the manifest. */
typedef struct bucket {
    seg sg;
    rs_weight_desc *d;
    int n;
} bucket;

static bucket bucket_make(env *v, size_t from, size_t to, size_t extra) {
    bucket k = {0};
    size_t total = 0;
    for (size_t i = from; i < to; i++) total += (rs_st_dir_tensor_at(v->bt, i, NULL)->nbytes + 7) & ~(size_t)7;
    k.sg = seg_create(total + extra, 0600);
    k.d = calloc(to - from + 1, sizeof *k.d);
    size_t off = 0;
    for (size_t i = from; i < to; i++) {
        const rs_st_tensor *t = rs_st_dir_tensor_at(v->bt, i, NULL);
        rs_weight_desc *d = &k.d[k.n++];
        snprintf(d->name, sizeof d->name, "%s", t->name);
        d->dtype = t->dtype;
        d->ndim = t->ndim;
        memcpy(d->shape, t->shape, sizeof d->shape);
        d->offset = off;
        d->nbytes = t->nbytes;
        memcpy(k.sg.p + off, t->data, t->nbytes);
        off += (t->nbytes + 7) & ~(size_t)7;
    }
    return k;
}

static void bucket_free(bucket *k) {
    seg_destroy(&k->sg);
    free(k->d);
}

static int send_bucket(env *v, const bucket *k, rs_weight_last last, const char *version, rs_sync_job *job) {
    memset(job, 0, sizeof *job);
    job->kind = RS_SYNC_SHM;
    rs_shm_update_req *r = &job->req.shm;
    snprintf(r->shm_name, sizeof r->shm_name, "%s", k->sg.name);
    r->tensors = k->d;
    r->n_tensors = k->n;
    r->is_last = last;
    if (version) {
        r->has_version = true;
        snprintf(r->weight_version, sizeof r->weight_version, "%s", version);
    }
    return rs_sync_run(v->s, job);
}

/* The whole of B in two buckets. */
static void update_to_b(env *v, rs_weight_last last1, rs_weight_last last2, const char *version) {
    size_t n = rs_st_dir_count(v->bt);
    bucket k1 = bucket_make(v, 0, n / 2, 0), k2 = bucket_make(v, n / 2, n, 0);
    rs_sync_job job;
    if (send_bucket(v, &k1, last1, version, &job) != RS_OK) RS_TEST_FAIL("bucket 1: %s", job.err.message);
    ASSERT_TRUE(!job.res.committed);
    ASSERT_TRUE(job.res.n_staged > 0 && job.res.n_staged < job.res.n_required);
    if (send_bucket(v, &k2, last2, version, &job) != RS_OK) RS_TEST_FAIL("bucket 2: %s", job.err.message);
    ASSERT_TRUE(job.res.committed);
    ASSERT_EQ(job.res.n_staged, job.res.n_required);
    if (version) ASSERT_STREQ(job.res.weight_version, version);
    bucket_free(&k1);
    bucket_free(&k2);
}

static void shm_end_to_end(const char *mode) {
    env v = rs_test_sync_open(mode, NULL);
    size_t n = rs_st_dir_count(v.bt);
    bucket k1 = bucket_make(&v, 0, n / 2, 0), k2 = bucket_make(&v, n / 2, n, 0);
    rs_sync_job job;
    ASSERT_EQ(send_bucket(&v, &k1, RS_WEIGHT_LAST_NO, "7", &job), RS_OK);
    ASSERT_TRUE(!job.res.committed);
    ASSERT_STREQ(job.res.weight_version, "0"); /* still serving the old weights */
    ASSERT_STREQ(rs_engine_weight_version(v.e), "0");
    expect_serving(&v, v.logits_a);
    ASSERT_TRUE(stats(&v).txn_open);
    uint64_t bytes = job.res.bytes;
    ASSERT_EQ(send_bucket(&v, &k2, RS_WEIGHT_LAST_YES, "7", &job), RS_OK);
    ASSERT_TRUE(job.res.committed);
    bytes += job.res.bytes;
    ASSERT_EQ(bytes, rs_st_dir_nbytes(v.bt));
    ASSERT_STREQ(job.res.weight_version, "7");
    ASSERT_STREQ(rs_engine_weight_version(v.e), "7");
    expect_serving(&v, v.logits_b);
    rs_sync_stats st = stats(&v);
    ASSERT_EQ(st.updates, 1);
    ASSERT_EQ(st.updates_failed, 0);
    ASSERT_EQ(st.bytes, bytes);
    ASSERT_EQ(st.update_seconds.n, 1);
    ASSERT_TRUE(!st.txn_open);
    bucket_free(&k1);
    bucket_free(&k2);
    rs_test_sync_close(&v);
}

RS_TEST(sync_shm_end_to_end_bf16) { shm_end_to_end("bf16"); }
RS_TEST(sync_shm_end_to_end_fp8) { shm_end_to_end("fp8"); }

/* is_last absent: the bucket that completes the set commits (SGLang-style trainers). */
RS_TEST(sync_shm_auto_commit) {
    env v = rs_test_sync_open("fp8", NULL);
    update_to_b(&v, RS_WEIGHT_LAST_AUTO, RS_WEIGHT_LAST_AUTO, "3");
    expect_serving(&v, v.logits_b);
    rs_test_sync_close(&v);
}

/* The request as JSON through the parser: what a trainer posts. */
RS_TEST(sync_shm_from_json_body) {
    env v = rs_test_sync_open("bf16", NULL);
    size_t n = rs_st_dir_count(v.bt);
    bucket k = bucket_make(&v, 0, n, 0);
    json_t *tensors = json_array();
    for (int i = 0; i < k.n; i++) {
        json_t *shape = json_array();
        for (int d = 0; d < k.d[i].ndim; d++) json_array_append_new(shape, json_integer(k.d[i].shape[d]));
        json_array_append_new(tensors, json_pack("{s:s, s:s, s:o, s:I}", "name", k.d[i].name, "dtype",
                                                 i % 2 ? "bfloat16" : "torch.bfloat16", "shape", shape, "offset",
                                                 (json_int_t)k.d[i].offset));
    }
    json_t *body = json_pack("{s:s, s:o, s:b, s:s}", "shm_name", k.sg.name, "tensors", tensors, "is_last", 1,
                             "weight_version", "18");
    char *text = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    rs_sync_job job = {.kind = RS_SYNC_SHM};
    rs_error err = {0};
    ASSERT_EQ(rs_weights_parse_shm(text, strlen(text), &job.req.shm, &err), RS_OK);
    free(text);
    ASSERT_EQ(rs_sync_run(v.s, &job), RS_OK);
    ASSERT_TRUE(job.res.committed);
    size_t len = 0;
    char *answer = rs_weights_response(job.res.message, job.res.weight_version, job.res.bytes, job.res.seconds,
                                       job.res.committed, job.res.txn_id, &len);
    json_error_t je;
    json_t *a = json_loads(answer, 0, &je);
    ASSERT_TRUE(a != NULL);
    ASSERT_TRUE(json_is_true(json_object_get(a, "success")));
    ASSERT_STREQ(json_string_value(json_object_get(a, "weight_version")), "18");
    ASSERT_EQ(json_integer_value(json_object_get(a, "bytes")), (long long)rs_st_dir_nbytes(v.bt));
    ASSERT_TRUE(json_is_real(json_object_get(a, "seconds")));
    ASSERT_TRUE(json_is_true(json_object_get(a, "committed")));
    ASSERT_EQ(strlen(json_string_value(json_object_get(a, "transaction_id"))), 16);
    json_decref(a);
    free(answer);
    rs_shm_update_req_free(&job.req.shm);
    bucket_free(&k);
    expect_serving(&v, v.logits_b);
    rs_test_sync_close(&v);
}

/* Each corrupt update fails whole with a clear error; the old weights keep serving, the
 * transaction is gone, and the next good update goes through. */
RS_TEST(sync_shm_corrupt_updates_fail_whole) {
    env v = rs_test_sync_open("fp8", NULL);
    const size_t n = rs_st_dir_count(v.bt), half = n / 2;
    enum { UNKNOWN, SHAPE, DTYPE, OFFSET, MISSING, SMALL, NOSEG, MODE, DUP, OTHER_UID, N_CASES };
    static const char *const what[N_CASES] = {"unknown name", "wrong shape", "wrong dtype", "offset beyond the segment",
                                              "missing tensor at is_last", "segment too small",
                                              "segment does not exist", "segment mode 0644", "duplicate tensor",
                                              "segment of another uid"};
    uint64_t failed = 0;
    for (int c = 0; c < N_CASES; c++) {
        if (c == OTHER_UID && geteuid() != 0) continue; /* needs root to chown the segment */
        bucket k1 = bucket_make(&v, 0, half, 0);
        rs_sync_job job;
        ASSERT_EQ(send_bucket(&v, &k1, RS_WEIGHT_LAST_NO, "9", &job), RS_OK);
        ASSERT_TRUE(stats(&v).txn_open);
        bucket k2 = bucket_make(&v, half, n, 64);
        const char *param = NULL, *needle = NULL;
        int code = RS_EINVAL;
        rs_weight_desc *d0 = &k2.d[0];
        switch (c) {
        case UNKNOWN:
            snprintf(d0->name, sizeof d0->name, "model.layers.0.mlp.experts.0.up_proj.weight");
            param = d0->name, needle = "unknown tensor";
            break;
        case SHAPE:
            d0->shape[0] += 1;
            param = d0->name, needle = "shape";
            break;
        case DTYPE: /* FP8 codes for a vector */
            for (int i = 0; i < k2.n; i++)
                if (k2.d[i].ndim == 1) d0 = &k2.d[i];
            d0->dtype = RS_DTYPE_E4M3;
            code = RS_EUNSUPPORTED;
            param = d0->name, needle = "cannot take FP8";
            break;
        case OFFSET:
            d0->offset = k2.sg.size;
            param = "tensors[0].offset", needle = "segment";
            break;
        case MISSING:
            k2.n--;
            param = k2.d[k2.n].name, needle = "missing tensor";
            break;
        case SMALL:
            ASSERT_EQ(ftruncate(k2.sg.fd, (off_t)(k2.d[k2.n - 1].offset + 1)), 0);
            param = "tensors[", needle = "has only";
            break;
        case NOSEG:
            shm_unlink(k2.sg.name);
            param = "shm_name", needle = "does not exist";
            break;
        case MODE:
            ASSERT_EQ(fchmod(k2.sg.fd, 0644), 0);
            param = "shm_name", needle = "mode 0644";
            break;
        case DUP: /* bucket 1 sent again */
            break;
        case OTHER_UID:
            ASSERT_EQ(fchown(k2.sg.fd, 65534, 65534), 0);
            param = "shm_name", needle = "belongs to uid 65534";
            break;
        }
        int rc;
        if (c == DUP) {
            rc = send_bucket(&v, &k1, RS_WEIGHT_LAST_NO, "9", &job);
            param = k1.d[0].name, needle = "duplicate";
        } else {
            rc = send_bucket(&v, &k2, RS_WEIGHT_LAST_YES, "9", &job);
        }
        if (rc != code || strncmp(job.err.param, param, strlen(param)) != 0 || !strstr(job.err.message, needle))
            RS_TEST_FAIL("%s: rc %d (want %d), param '%s' (want '%s'), message '%s'", what[c], rc, code,
                         job.err.param, param, job.err.message);
        rs_sync_stats st = stats(&v);
        ASSERT_TRUE(!st.txn_open);
        ASSERT_EQ(st.staged_bytes, 0);
        ASSERT_EQ(st.updates, 0);
        ASSERT_EQ(st.updates_failed, ++failed);
        ASSERT_STREQ(rs_engine_weight_version(v.e), "0");
        expect_serving(&v, v.logits_a);
        bucket_free(&k1);
        bucket_free(&k2);
    }
    /* still healthy: a good update commits */
    update_to_b(&v, RS_WEIGHT_LAST_NO, RS_WEIGHT_LAST_YES, "10");
    expect_serving(&v, v.logits_b);
    rs_test_sync_close(&v);
}

/* A FIFO in /dev/shm (world-writable: anyone can make one) named as the segment gets a 400 at
 * once; opening it without O_NONBLOCK would wait for a writer forever, holding the sync service and
 * every weight job behind it (and shutdown, which joins the service). The next update goes
 * through. */
RS_TEST(sync_shm_fifo_refused_at_once) {
    alarm(30); /* a blocked open would otherwise wait for the runner's own timeout */
    env v = rs_test_sync_open("bf16", NULL);
    char name[64], path[128];
    snprintf(name, sizeof name, "/rs-test-fifo-%d", (int)getpid());
    snprintf(path, sizeof path, "/dev/shm%s", name);
    unlink(path);
    ASSERT_EQ(mkfifo(path, 0600), 0);
    rs_sync_job job;
    memset(&job, 0, sizeof job);
    job.kind = RS_SYNC_SHM;
    snprintf(job.req.shm.shm_name, sizeof job.req.shm.shm_name, "%s", name);
    job.req.shm.is_last = RS_WEIGHT_LAST_NO;
    int rc = rs_sync_run(v.s, &job);
    unlink(path);
    ASSERT_EQ(rc, RS_EINVAL);
    ASSERT_EQ(rs_err_http_status(rc), 400);
    ASSERT_STREQ(job.err.param, "shm_name");
    if (!strstr(job.err.message, "is not a shared-memory segment")) RS_TEST_FAIL("message '%s'", job.err.message);
    ASSERT_TRUE(!stats(&v).txn_open);
    expect_serving(&v, v.logits_a);
    update_to_b(&v, RS_WEIGHT_LAST_NO, RS_WEIGHT_LAST_YES, "2");
    expect_serving(&v, v.logits_b);
    rs_test_sync_close(&v);
}

/* A bucket for another version while a transaction is open: 409, and the open one is untouched. */
RS_TEST(sync_version_conflict_409) {
    env v = rs_test_sync_open("bf16", NULL);
    size_t n = rs_st_dir_count(v.bt);
    bucket k1 = bucket_make(&v, 0, n / 2, 0), k2 = bucket_make(&v, n / 2, n, 0);
    rs_sync_job job;
    ASSERT_EQ(send_bucket(&v, &k1, RS_WEIGHT_LAST_NO, "8", &job), RS_OK);
    int staged = job.res.n_staged;
    ASSERT_EQ(send_bucket(&v, &k2, RS_WEIGHT_LAST_YES, "9", &job), RS_ESTATE);
    ASSERT_EQ(rs_err_http_status(job.rc), 409);
    ASSERT_STREQ(job.err.param, "weight_version");
    ASSERT_TRUE(strstr(job.err.message, "'8'"));
    ASSERT_TRUE(stats(&v).txn_open);
    ASSERT_EQ(stats(&v).updates_failed, 0);
    ASSERT_EQ(send_bucket(&v, &k2, RS_WEIGHT_LAST_YES, "8", &job), RS_OK);
    ASSERT_TRUE(job.res.committed);
    ASSERT_TRUE(job.res.n_staged > staged);
    ASSERT_STREQ(rs_engine_weight_version(v.e), "8");
    expect_serving(&v, v.logits_b);
    bucket_free(&k1);
    bucket_free(&k2);
    rs_test_sync_close(&v);
}

static int send_bucket_txn(env *v, const bucket *k, rs_weight_last last, const char *version, const char *txn,
                           rs_sync_job *job) {
    memset(job, 0, sizeof *job);
    job->kind = RS_SYNC_SHM;
    rs_shm_update_req *r = &job->req.shm;
    snprintf(r->shm_name, sizeof r->shm_name, "%s", k->sg.name);
    r->tensors = k->d;
    r->n_tensors = k->n;
    r->is_last = last;
    if (version) {
        r->has_version = true;
        snprintf(r->weight_version, sizeof r->weight_version, "%s", version);
    }
    if (txn) {
        r->has_txn_id = true;
        snprintf(r->txn_id, sizeof r->txn_id, "%s", txn);
    }
    return rs_sync_run(v->s, job);
}

/* A bucket joins the open transaction only when it names it (sync.h): bucket 1 of version B and a
 * bucket 2 without a version (is_last absent, so it would complete the set) is a 409 that stages
 * nothing; so is a version for an update opened without one, and a transaction_id that is not the
 * open one. The open update is untouched by each refusal and commits when its own bucket comes. */
RS_TEST(sync_bucket_must_name_the_open_transaction) {
    env v = rs_test_sync_open("bf16", NULL);
    size_t n = rs_st_dir_count(v.bt);
    bucket k1 = bucket_make(&v, 0, n / 2, 0), k2 = bucket_make(&v, n / 2, n, 0);
    rs_sync_job job;
    ASSERT_EQ(send_bucket_txn(&v, &k1, RS_WEIGHT_LAST_AUTO, "B", NULL, &job), RS_OK);
    const int staged = job.res.n_staged;
    char txn[sizeof job.res.txn_id];
    snprintf(txn, sizeof txn, "%s", job.res.txn_id);
    ASSERT_EQ(strlen(txn), 16);
    ASSERT_EQ(send_bucket_txn(&v, &k2, RS_WEIGHT_LAST_AUTO, NULL, NULL, &job), RS_ESTATE); /* the mix */
    ASSERT_EQ(rs_err_http_status(job.rc), 409);
    ASSERT_STREQ(job.err.param, "weight_version");
    ASSERT_TRUE(strstr(job.err.message, "without a weight_version") && strstr(job.err.message, "'B'"));
    ASSERT_EQ(send_bucket_txn(&v, &k2, RS_WEIGHT_LAST_AUTO, "B", "0123456789abcdef", &job), RS_ESTATE);
    ASSERT_STREQ(job.err.param, "transaction_id");
    ASSERT_TRUE(stats(&v).txn_open);
    ASSERT_EQ(stats(&v).updates_failed, 0);
    ASSERT_STREQ(rs_engine_weight_version(v.e), "0");
    expect_serving(&v, v.logits_a);
    ASSERT_EQ(send_bucket_txn(&v, &k2, RS_WEIGHT_LAST_AUTO, "B", txn, &job), RS_OK);
    ASSERT_TRUE(job.res.committed && job.res.n_staged > staged);
    ASSERT_STREQ(job.res.txn_id, txn);
    ASSERT_STREQ(rs_engine_weight_version(v.e), "B");
    expect_serving(&v, v.logits_b);
    /* the id of a committed transaction matches nothing, and opens nothing */
    ASSERT_EQ(send_bucket_txn(&v, &k1, RS_WEIGHT_LAST_NO, "C", txn, &job), RS_ESTATE);
    ASSERT_TRUE(strstr(job.err.message, "is not open"));
    ASSERT_TRUE(!stats(&v).txn_open);
    /* opened without a version: a versioned bucket does not relabel it; the version-less one joins */
    ASSERT_EQ(send_bucket_txn(&v, &k1, RS_WEIGHT_LAST_NO, NULL, NULL, &job), RS_OK);
    ASSERT_TRUE(strcmp(job.res.txn_id, txn) != 0);
    ASSERT_EQ(send_bucket_txn(&v, &k2, RS_WEIGHT_LAST_YES, "C", NULL, &job), RS_ESTATE);
    ASSERT_EQ(send_bucket_txn(&v, &k2, RS_WEIGHT_LAST_YES, NULL, NULL, &job), RS_OK);
    ASSERT_TRUE(job.res.committed);
    ASSERT_STREQ(rs_engine_weight_version(v.e), "B"); /* kept: the update named no version */
    bucket_free(&k1);
    bucket_free(&k2);
    rs_test_sync_close(&v);
}

/* A transaction whose trainer went away expires and stops blocking other versions. */
RS_TEST(sync_idle_transaction_expires) {
    rs_sync_opts so = {.txn_idle_timeout = 0.2};
    env v = rs_test_sync_open("bf16", &so);
    size_t n = rs_st_dir_count(v.bt);
    bucket k1 = bucket_make(&v, 0, n / 2, 0);
    rs_sync_job job;
    ASSERT_EQ(send_bucket(&v, &k1, RS_WEIGHT_LAST_NO, "5", &job), RS_OK);
    ASSERT_TRUE(stats(&v).txn_open);
    /* dropped by the service thread itself, without a request: 0.2 s idle, then its next wake-up
     * (waited for up to 5 s, so that a loaded or sanitized run does not fail on timing) */
    struct timespec ts = {0, 50 * 1000 * 1000};
    for (int i = 0; i < 100 && stats(&v).txn_open; i++) nanosleep(&ts, NULL);
    ASSERT_TRUE(!stats(&v).txn_open);
    ASSERT_EQ(stats(&v).updates_failed, 1);
    update_to_b(&v, RS_WEIGHT_LAST_NO, RS_WEIGHT_LAST_YES, "6");
    expect_serving(&v, v.logits_b);
    bucket_free(&k1);
    rs_test_sync_close(&v);
}

/* weight-staging-mb: a bucket over the limit is a 400, not an out-of-memory crash. */
RS_TEST(sync_staging_limit) {
    rs_sync_opts so = {.staging_limit = 100 << 10};
    env v = rs_test_sync_open("bf16", &so);
    size_t n = rs_st_dir_count(v.bt);
    bucket k = bucket_make(&v, 0, n, 0);
    rs_sync_job job;
    ASSERT_EQ(send_bucket(&v, &k, RS_WEIGHT_LAST_YES, "1", &job), RS_EINVAL);
    ASSERT_TRUE(strstr(job.err.message, "staging limit"));
    ASSERT_TRUE(!stats(&v).txn_open);
    expect_serving(&v, v.logits_a);
    bucket_free(&k);
    rs_test_sync_close(&v);
}

/* /update_weight_version relabels; with abort_all_requests it aborts what is running. */
static void on_gen_done(rs_gen_job *job, void *user) {
    (void)job;
    rs_latch_arrive(user);
}

RS_TEST(sync_update_weight_version) {
    env v = rs_test_sync_open("bf16", NULL);
    rs_sync_job job = {.kind = RS_SYNC_VERSION};
    snprintf(job.req.version.new_version, sizeof job.req.version.new_version, "v42");
    ASSERT_EQ(rs_sync_run(v.s, &job), RS_OK);
    ASSERT_STREQ(job.res.weight_version, "v42");
    ASSERT_STREQ(rs_engine_weight_version(v.e), "v42");

    /* a generation held by a pause (so it cannot finish first), then a version bump with
     * abort_all_requests */
    rs_engine_pause(v.e, RS_PAUSE_IN_PLACE);
    rs_latch f = RS_LATCH_INIT;
    rs_gen_job *g = rs_gen_job_new();
    g->n_prompts = 1;
    g->prompts = calloc(1, sizeof(int32_t *));
    g->prompt_lens = calloc(1, sizeof(int));
    g->prompts[0] = calloc(4, sizeof(int32_t));
    g->prompt_lens[0] = 4;
    g->sp.max_new_tokens = 120;
    g->sp.ignore_eos = true;
    g->on_done = on_gen_done;
    g->on_done_user = &f;
    rs_error err = {0};
    ASSERT_EQ(rs_engine_submit(v.e, g, &err), RS_OK);
    memset(&job, 0, sizeof job);
    job.kind = RS_SYNC_VERSION;
    snprintf(job.req.version.new_version, sizeof job.req.version.new_version, "v43");
    job.req.version.abort_all_requests = true;
    ASSERT_EQ(rs_sync_run(v.s, &job), RS_OK);
    rs_latch_wait(&f, 1);
    ASSERT_EQ(g->outputs[0].finish.type, RS_FINISH_ABORT);
    rs_gen_job_free(g);
    rs_engine_continue(v.e);
    ASSERT_STREQ(rs_engine_weight_version(v.e), "v43");
    rs_test_sync_close(&v);
}

/* ---------------------------------------------------------------- disk */

static void mkdir_ok(const char *p) {
    if (mkdir(p, 0700) != 0 && errno != EEXIST) RS_TEST_FAIL("mkdir %s: %s", p, strerror(errno));
}

static int disk_update(env *v, const char *path, rs_sync_job *job) {
    memset(job, 0, sizeof *job);
    job->kind = RS_SYNC_DISK;
    snprintf(job->req.disk.model_path, sizeof job->req.disk.model_path, "%s", path);
    job->req.disk.has_version = true;
    snprintf(job->req.disk.weight_version, sizeof job->req.disk.weight_version, "disk");
    return rs_sync_run(v->s, job);
}

RS_TEST(sync_disk_update_and_path_restriction) {
    char allowed[600], outside[600], p[1400], q[1400];
    snprintf(allowed, sizeof allowed, "%s/allowed", rs_test_tmpdir());
    snprintf(outside, sizeof outside, "%s/outside", rs_test_tmpdir());
    mkdir_ok(allowed);
    mkdir_ok(outside);
    rs_sync_opts so = {.allowed_weight_dir = allowed};
    env v = rs_test_sync_open("fp8", &so);
    rs_sync_job job;

    /* escapes: "..", a symlinked directory, a symlinked shard, a missing path */
    snprintf(p, sizeof p, "%s/ckpt", outside);
    write_model(p, 2);
    snprintf(p, sizeof p, "%s/../outside/ckpt", allowed);
    ASSERT_EQ(disk_update(&v, p, &job), RS_EINVAL);
    ASSERT_STREQ(job.err.param, "model_path");
    ASSERT_TRUE(strstr(job.err.message, "'..' component"));
    snprintf(p, sizeof p, "%s/ckpt", outside);
    snprintf(q, sizeof q, "%s/link", allowed);
    ASSERT_EQ(symlink(p, q), 0);
    ASSERT_EQ(disk_update(&v, q, &job), RS_EINVAL);
    ASSERT_TRUE(strstr(job.err.message, "does not resolve to a directory inside allowed-weight-dir"));
    snprintf(q, sizeof q, "%s/evil", allowed);
    mkdir_ok(q);
    snprintf(p, sizeof p, "%s/ckpt/config.json", outside);
    snprintf(q, sizeof q, "%s/evil/config.json", allowed);
    ASSERT_EQ(symlink(p, q), 0);
    snprintf(p, sizeof p, "%s/ckpt/model.safetensors", outside);
    snprintf(q, sizeof q, "%s/evil/model.safetensors", allowed);
    ASSERT_EQ(symlink(p, q), 0);
    snprintf(q, sizeof q, "%s/evil", allowed);
    ASSERT_EQ(disk_update(&v, q, &job), RS_EINVAL);
    ASSERT_TRUE(strstr(job.err.message, "does not resolve to a file inside allowed-weight-dir"));
    snprintf(q, sizeof q, "%s/nothing-here", allowed);
    ASSERT_EQ(disk_update(&v, q, &job), RS_EINVAL);
    ASSERT_TRUE(strstr(job.err.message, "does not resolve to a directory inside allowed-weight-dir"));
    ASSERT_EQ(stats(&v).updates, 0);
    expect_serving(&v, v.logits_a);

    /* '..' is refused even where it would resolve inside the allowed directory */
    snprintf(p, sizeof p, "%s/step1", allowed);
    write_model(p, 2);
    snprintf(q, sizeof q, "%s/evil/../step1", allowed);
    ASSERT_EQ(disk_update(&v, q, &job), RS_EINVAL);
    ASSERT_TRUE(strstr(job.err.message, "'..' component"));
    /* a checkpoint below the allowed directory */
    if (disk_update(&v, p, &job) != RS_OK) RS_TEST_FAIL("%s", job.err.message);
    ASSERT_TRUE(job.res.committed);
    ASSERT_STREQ(job.res.weight_version, "disk");
    expect_serving(&v, v.logits_b);
    rs_test_sync_close(&v);
}

/* A path outside allowed-weight-dir and one that does not resolve get the same answer, which
 * names neither where the path leads nor why it does not resolve: the route must not be an oracle
 * for the file system outside the directory (whether a path exists, where a symlink points). */
RS_TEST(sync_disk_refusal_reveals_nothing_outside) {
    char allowed[600], outside[600], p[1400], q[1400];
    snprintf(allowed, sizeof allowed, "%s/allowed", rs_test_tmpdir());
    snprintf(outside, sizeof outside, "%s/outside", rs_test_tmpdir());
    mkdir_ok(allowed);
    mkdir_ok(outside);
    snprintf(p, sizeof p, "%s/ckpt", outside);
    write_model(p, 2);
    snprintf(q, sizeof q, "%s/link", allowed);
    ASSERT_EQ(symlink(p, q), 0);
    rs_sync_opts so = {.allowed_weight_dir = allowed};
    env v = rs_test_sync_open("bf16", &so);
    char cwd[1024], exe[1024];
    ASSERT_TRUE(getcwd(cwd, sizeof cwd) != NULL);
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    ASSERT_TRUE(n > 0);
    exe[n] = '\0';

    char out_ckpt[700], out_none[700], in_link[700], in_none[700];
    snprintf(out_ckpt, sizeof out_ckpt, "%s/ckpt", outside);        /* a checkpoint outside */
    snprintf(out_none, sizeof out_none, "%s/no-such-dir", outside); /* nothing there */
    snprintf(in_link, sizeof in_link, "%s/link", allowed);          /* inside, leading outside */
    snprintf(in_none, sizeof in_none, "%s/nothing-here", allowed);
    /* /proc/self/cwd and exe: symlinks to the daemon's working directory and binary */
    const char *paths[] = {"/proc/self/cwd", "/proc/self/exe", out_ckpt, out_none, in_link, in_none};
    const char *leaks[] = {cwd, exe, outside, strerror(ENOENT), strerror(ENOTDIR), "resolves to"};
    char first[sizeof ((rs_error *)0)->message] = "";
    for (size_t i = 0; i < RS_ARRAY_LEN(paths); i++) {
        rs_sync_job job;
        ASSERT_EQ(disk_update(&v, paths[i], &job), RS_EINVAL);
        ASSERT_STREQ(job.err.param, "model_path");
        /* the message starts with the request's own path; what follows must be the same for all */
        const char *tail = strstr(job.err.message, "' does not resolve to a directory inside allowed-weight-dir");
        if (!tail) RS_TEST_FAIL("%s: message '%s'", paths[i], job.err.message);
        for (size_t k = 0; k < RS_ARRAY_LEN(leaks); k++)
            if (strstr(tail, leaks[k])) RS_TEST_FAIL("%s: message '%s' tells '%s'", paths[i], job.err.message, leaks[k]);
        if (!first[0]) snprintf(first, sizeof first, "%s", tail);
        else ASSERT_STREQ(tail, first);
    }
    ASSERT_EQ(stats(&v).updates, 0);
    expect_serving(&v, v.logits_a);
    rs_test_sync_close(&v);
}

/* Writes dir/model.safetensors.index.json mapping every tensor of B to `shard`. */
static void write_index(env *v, const char *dir, const char *shard) {
    json_t *wm = json_object();
    for (size_t i = 0; i < rs_st_dir_count(v->bt); i++)
        json_object_set_new(wm, rs_st_dir_tensor_at(v->bt, i, NULL)->name, json_string(shard));
    json_t *root = json_pack("{s:o}", "weight_map", wm);
    char path[1400];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    ASSERT_EQ(json_dump_file(root, path, 0), 0);
    json_decref(root);
}

/* The shards an index names are opened without following symlinks: one symlinked outside is
 * refused with the same message whatever it points at (a file whose header the parser would
 * quote, one too short to parse, one that does not exist, a FIFO that an open would wait on), so
 * nothing of the file outside reaches the client. A shard symlinked to a file inside is refused
 * the same way (no symlink is followed); the same file as a plain name (a hard link) is read. */
RS_TEST(sync_disk_shards_checked_before_open) {
    alarm(30); /* the FIFO case, were the shard opened, would block the service for good */
    char allowed[600], outside[600], ckpt[700], shard[800], p[1400];
    snprintf(allowed, sizeof allowed, "%s/allowed", rs_test_tmpdir());
    snprintf(outside, sizeof outside, "%s/outside", rs_test_tmpdir());
    mkdir_ok(allowed);
    mkdir_ok(outside);
    rs_sync_opts so = {.allowed_weight_dir = allowed};
    env v = rs_test_sync_open("bf16", &so);
    snprintf(ckpt, sizeof ckpt, "%s/sharded", allowed);
    mkdir_ok(ckpt);
    write_index(&v, ckpt, "s.safetensors");
    snprintf(shard, sizeof shard, "%s/s.safetensors", ckpt);

    snprintf(p, sizeof p, "%s/secret", outside);
    FILE *fp = fopen(p, "wb");
    ASSERT_TRUE(fp != NULL);
    fputs("top secret data, not a checkpoint", fp);
    fclose(fp);
    snprintf(p, sizeof p, "%s/short", outside);
    fp = fopen(p, "wb");
    ASSERT_TRUE(fp != NULL);
    fputs("abc", fp);
    fclose(fp);
    snprintf(p, sizeof p, "%s/fifo", outside);
    ASSERT_EQ(mkfifo(p, 0600), 0);
    static const char *const targets[] = {"secret", "short", "missing", "fifo"};
    char first[sizeof ((rs_error *)0)->message] = "";
    for (size_t i = 0; i < RS_ARRAY_LEN(targets); i++) {
        snprintf(p, sizeof p, "%s/%s", outside, targets[i]);
        unlink(shard);
        ASSERT_EQ(symlink(p, shard), 0);
        rs_sync_job job;
        ASSERT_EQ(disk_update(&v, ckpt, &job), RS_EINVAL);
        ASSERT_STREQ(job.err.param, "model_path");
        if (!strstr(job.err.message, "s.safetensors' does not resolve to a file inside allowed-weight-dir") ||
            strstr(job.err.message, outside) || strstr(job.err.message, "top secr") ||
            strstr(job.err.message, "header") || strstr(job.err.message, strerror(ENOENT)))
            RS_TEST_FAIL("shard -> %s: message '%s'", targets[i], job.err.message);
        if (!first[0]) snprintf(first, sizeof first, "%s", job.err.message);
        else ASSERT_STREQ(job.err.message, first);
    }
    ASSERT_EQ(stats(&v).updates, 0);
    expect_serving(&v, v.logits_a);

    /* a shard symlinked to a file inside the directory: refused alike; the file itself: read */
    snprintf(p, sizeof p, "%s/step", allowed);
    write_model(p, 2);
    snprintf(p, sizeof p, "%s/step/model.safetensors", allowed);
    unlink(shard);
    ASSERT_EQ(symlink(p, shard), 0);
    rs_sync_job job;
    ASSERT_EQ(disk_update(&v, ckpt, &job), RS_EINVAL);
    ASSERT_STREQ(job.err.message, first);
    unlink(shard);
    ASSERT_EQ(link(p, shard), 0);
    if (disk_update(&v, ckpt, &job) != RS_OK) RS_TEST_FAIL("%s", job.err.message);
    ASSERT_TRUE(job.res.committed);
    expect_serving(&v, v.logits_b);
    rs_test_sync_close(&v);
}

/* A FIFO where the checkpoint's model.safetensors, its index or one of its shards should be gets a
 * 400 at once: an open that waited for a writer would hold the sync service (and shutdown) for
 * good. The service then takes the next update. */
RS_TEST(sync_disk_fifo_refused_at_once) {
    alarm(30); /* a blocked open would otherwise wait for the runner's own timeout */
    char allowed[600], dir[700], p[1400];
    snprintf(allowed, sizeof allowed, "%s/allowed", rs_test_tmpdir());
    mkdir_ok(allowed);
    rs_sync_opts so = {.allowed_weight_dir = allowed};
    env v = rs_test_sync_open("bf16", &so);
    enum { SINGLE, INDEX, SHARD, N_CASES };
    static const char *const what[N_CASES] = {"model.safetensors", "model.safetensors.index.json", "a shard"};
    for (int c = 0; c < N_CASES; c++) {
        snprintf(dir, sizeof dir, "%s/fifo%d", allowed, c);
        mkdir_ok(dir);
        if (c == SHARD) write_index(&v, dir, "s.safetensors");
        snprintf(p, sizeof p, "%s/%s", dir, c == SINGLE ? "model.safetensors"
                                             : c == INDEX ? "model.safetensors.index.json" : "s.safetensors");
        ASSERT_EQ(mkfifo(p, 0600), 0);
        rs_sync_job job;
        int rc = disk_update(&v, dir, &job);
        if (rc != RS_EINVAL || !strstr(job.err.message, "not a regular file"))
            RS_TEST_FAIL("%s a FIFO: rc %d, message '%s'", what[c], rc, job.err.message);
        ASSERT_EQ(rs_err_http_status(rc), 400);
        ASSERT_TRUE(!stats(&v).txn_open);
    }
    expect_serving(&v, v.logits_a);
    snprintf(p, sizeof p, "%s/step", allowed);
    write_model(p, 2);
    rs_sync_job job;
    if (disk_update(&v, p, &job) != RS_OK) RS_TEST_FAIL("%s", job.err.message);
    expect_serving(&v, v.logits_b);
    rs_test_sync_close(&v);
}

RS_TEST(sync_disk_disabled_by_default) {
    env v = rs_test_sync_open("bf16", NULL);
    rs_sync_job job;
    ASSERT_EQ(disk_update(&v, v.dir_b, &job), RS_EINVAL);
    ASSERT_STREQ(job.err.param, "model_path");
    ASSERT_TRUE(strstr(job.err.message, "disabled"));
    expect_serving(&v, v.logits_a);
    rs_test_sync_close(&v);
}

/* Stopping the service answers every queued job exactly once. */
typedef struct counter {
    pthread_mutex_t mu;
    int n;
} counter;

static void on_count(rs_sync_job *job, void *user) {
    (void)job;
    counter *c = user;
    pthread_mutex_lock(&c->mu);
    c->n++;
    pthread_mutex_unlock(&c->mu);
}

RS_TEST(sync_stop_answers_queued_jobs) {
    env v = rs_test_sync_open("bf16", NULL);
    enum { N = 8 };
    rs_sync_job jobs[N];
    counter c = {PTHREAD_MUTEX_INITIALIZER, 0};
    rs_error err = {0};
    for (int i = 0; i < N; i++) {
        memset(&jobs[i], 0, sizeof jobs[i]);
        jobs[i].kind = RS_SYNC_VERSION;
        snprintf(jobs[i].req.version.new_version, sizeof jobs[i].req.version.new_version, "q%d", i);
        jobs[i].on_done = on_count;
        jobs[i].user = &c;
        ASSERT_EQ(rs_sync_submit(v.s, &jobs[i], &err), RS_OK);
    }
    rs_sync_stop(v.s);
    ASSERT_EQ(c.n, N);
    for (int i = 0; i < N; i++) ASSERT_TRUE(jobs[i].rc == RS_OK || jobs[i].rc == RS_EBUSY);
    v.s = NULL;
    rs_test_sync_close(&v);
}

/* ---------------------------------------------------------------- the parsers */

static void parse_fails(int (*parse)(const char *, size_t, void *, rs_error *), void *out, const char *body, int code,
                        const char *param, const char *needle) {
    rs_error err = {0};
    int rc = parse(body, strlen(body), out, &err);
    if (rc != code || strcmp(err.param, param) != 0 || (needle && !strstr(err.message, needle)))
        RS_TEST_FAIL("%s: rc %d (want %d), param '%s' (want '%s'), message '%s'", body, rc, code, err.param, param,
                     err.message);
}

static int shm_parse(const char *b, size_t n, void *out, rs_error *e) { return rs_weights_parse_shm(b, n, out, e); }
static int nccl_parse(const char *b, size_t n, void *out, rs_error *e) { return rs_weights_parse_nccl_update(b, n, out, e); }
static int group_parse(const char *b, size_t n, void *out, rs_error *e) { return rs_weights_parse_nccl_group(b, n, out, e); }
static int disk_parse(const char *b, size_t n, void *out, rs_error *e) { return rs_weights_parse_disk(b, n, out, e); }
static int version_parse(const char *b, size_t n, void *out, rs_error *e) {
    return rs_weights_parse_version(b, n, out, e);
}

RS_TEST(sync_parse_shm_request) {
    rs_shm_update_req r;
    rs_error err = {0};
    const char *ok = "{\"shm_name\":\"/rolloutd-w-1\",\"tensors\":[{\"name\":\"model.norm.weight\",\"dtype\":"
                     "\"bfloat16\",\"shape\":[4096],\"offset\":0},{\"name\":\"lm_head.weight\",\"dtype\":\"F32\","
                     "\"shape\":[2,3],\"offset\":8192}],\"is_last\":false,\"weight_version\":\"18\","
                     "\"abort_all_requests\":false,\"flush_cache\":true}";
    ASSERT_EQ(rs_weights_parse_shm(ok, strlen(ok), &r, &err), RS_OK);
    ASSERT_STREQ(r.shm_name, "/rolloutd-w-1");
    ASSERT_EQ(r.n_tensors, 2);
    ASSERT_EQ(r.tensors[0].dtype, RS_DTYPE_BF16);
    ASSERT_EQ(r.tensors[0].nbytes, 8192);
    ASSERT_EQ(r.tensors[1].dtype, RS_DTYPE_F32);
    ASSERT_EQ(r.tensors[1].nbytes, 24);
    ASSERT_EQ(r.tensors[1].offset, 8192);
    ASSERT_EQ(r.is_last, RS_WEIGHT_LAST_NO);
    ASSERT_TRUE(r.has_version);
    ASSERT_STREQ(r.weight_version, "18");
    rs_shm_update_req_free(&r);
    const char *auto_last = "{\"shm_name\":\"/x\",\"tensors\":[],\"weight_version\":null,\"is_last\":null}";
    ASSERT_EQ(rs_weights_parse_shm(auto_last, strlen(auto_last), &r, &err), RS_OK);
    ASSERT_EQ(r.is_last, RS_WEIGHT_LAST_AUTO);
    ASSERT_TRUE(!r.has_version);
    rs_shm_update_req_free(&r);

    static const struct { const char *body, *param, *needle; int code; } bad[] = {
        {"{\"shm_name\":\"/x\",\"tensors\":[],\"is_lats\":true}", "is_lats", "unknown field", RS_EINVAL},
        {"{\"tensors\":[]}", "shm_name", "shm_name is required", RS_EINVAL},
        {"{\"shm_name\":\"/x\"}", "tensors", "tensors is required", RS_EINVAL},
        {"{\"shm_name\":\"x\",\"tensors\":[]}", "shm_name", "POSIX", RS_EINVAL},
        {"{\"shm_name\":\"/a/b\",\"tensors\":[]}", "shm_name", "POSIX", RS_EINVAL},
        {"{\"shm_name\":\"/..\",\"tensors\":[]}", "shm_name", "POSIX", RS_EINVAL},
        {"{\"shm_name\":\"/\",\"tensors\":[]}", "shm_name", "POSIX", RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[{\"name\":\"a\",\"dtype\":\"bfloat16\",\"shape\":[1],\"offset\":0,"
         "\"stride\":1}]}", "tensors[0].stride", "unknown field", RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[{\"name\":\"a\",\"dtype\":\"bfloat16\",\"shape\":[1]}]}",
         "tensors[0].offset", "tensors[0].offset is required", RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[{\"name\":\"a\",\"dtype\":\"int64\",\"shape\":[1],\"offset\":0}]}",
         "tensors[0].dtype", "not supported", RS_EUNSUPPORTED},
        {"{\"shm_name\":\"/x\",\"tensors\":[{\"name\":\"a\",\"dtype\":\"bf16\",\"shape\":[1],\"offset\":0}]}",
         "tensors[0].dtype", "must be one of", RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[{\"name\":\"a\",\"dtype\":\"bfloat16\",\"shape\":[2,-1],\"offset\":0}]}",
         "tensors[0].shape[1]", ">= 0", RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[{\"name\":\"a\",\"dtype\":\"bfloat16\",\"shape\":[1,1,1,1,1],"
         "\"offset\":0}]}", "tensors[0].shape", "dimensions", RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[{\"name\":\"a\",\"dtype\":\"float32\",\"shape\":[4611686018427387904,"
         "4611686018427387904],\"offset\":0}]}", "tensors[0].shape", "2^62", RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[{\"name\":\"a\",\"dtype\":\"float32\",\"shape\":[1],\"offset\":"
         "4611686018427387903}]}", "tensors[0].offset", "2^62", RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[{\"name\":\"a\",\"dtype\":\"float32\",\"shape\":[1],\"offset\":1.5}]}",
         "tensors[0].offset", "integer", RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[{\"name\":\"\",\"dtype\":\"float32\",\"shape\":[1],\"offset\":0}]}",
         "tensors[0].name", "empty", RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[],\"is_last\":1}", "is_last", "true or false", RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[],\"weight_version\":18}", "weight_version", "string", RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[],\"weight_version\":"
         "\"0123456789012345678901234567890123456789012345678901234567890123\"}", "weight_version", "at most",
         RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[],\"weight_version\":\"a\\nb\"}", "weight_version", "control",
         RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"shm_name\":\"/y\",\"tensors\":[]}", "", "duplicate", RS_EINVAL},
        {"[1,2]", "", "must be a JSON object", RS_EINVAL},
        {"{\"shm_name\":\"/x\",", "", "invalid JSON", RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[],\"abort_all_requests\":true,\"abort_all_request\":true}",
         "abort_all_request", "give one of them", RS_EINVAL},
        {"{\"shm_name\":\"/x\",\"tensors\":[],\"http_worker_ipc\":\"ipc:///x\"}", "http_worker_ipc",
         "not implemented", RS_EUNSUPPORTED},
    };
    for (size_t i = 0; i < RS_ARRAY_LEN(bad); i++) parse_fails(shm_parse, &r, bad[i].body, bad[i].code, bad[i].param, bad[i].needle);
}

RS_TEST(sync_parse_nccl_requests) {
    rs_nccl_update_req u;
    rs_error err = {0};
    const char *ok = "{\"names\":[\"a\",\"b\"],\"dtypes\":[\"bfloat16\",\"float8_e4m3fn\"],\"shapes\":[[3,2],[5]],"
                     "\"group_name\":\"g0\",\"load_format\":\"flattened_bucket\",\"weight_version\":\"18\"}";
    ASSERT_EQ(rs_weights_parse_nccl_update(ok, strlen(ok), &u, &err), RS_OK);
    ASSERT_EQ(u.n_tensors, 2);
    ASSERT_EQ(u.tensors[0].offset, 0);
    ASSERT_EQ(u.tensors[1].offset, 12);
    ASSERT_EQ(u.tensors[1].nbytes, 5);
    ASSERT_EQ(u.total_bytes, 17);
    ASSERT_TRUE(u.flattened_bucket);
    ASSERT_EQ(u.is_last, RS_WEIGHT_LAST_AUTO);
    ASSERT_STREQ(u.group_name, "g0");
    rs_nccl_update_req_free(&u);
    const char *plain = "{\"names\":[\"a\"],\"dtypes\":[\"float32\"],\"shapes\":[[1]],\"load_format\":null}";
    ASSERT_EQ(rs_weights_parse_nccl_update(plain, strlen(plain), &u, &err), RS_OK);
    ASSERT_TRUE(!u.flattened_bucket);
    ASSERT_TRUE(!u.abort_all_requests);
    rs_nccl_update_req_free(&u);
    /* AReaL's /update_weights_from_distributed: abort_all_requests, and SGLang's no-effect fields */
    const char *areal = "{\"names\":[\"a\"],\"dtypes\":[\"float32\"],\"shapes\":[[1]],\"abort_all_requests\":true,"
                        "\"flush_cache\":true,\"torch_empty_cache\":false,\"rid\":\"u1\",\"http_worker_ipc\":null}";
    ASSERT_EQ(rs_weights_parse_nccl_update(areal, strlen(areal), &u, &err), RS_OK);
    ASSERT_TRUE(u.abort_all_requests);
    ASSERT_STREQ(u.group_name, "weight_update_group");
    rs_nccl_update_req_free(&u);
    parse_fails(nccl_parse, &u, "{\"names\":[\"a\",\"b\"],\"dtypes\":[\"float32\"],\"shapes\":[[1],[1]]}", RS_EINVAL,
                "dtypes", "entries");
    parse_fails(nccl_parse, &u, "{\"names\":[],\"dtypes\":[],\"shapes\":[]}", RS_EINVAL, "names", "empty");
    { /* a list past RS_WEIGHT_MAX_TENSORS is refused before a descriptor is allocated; one at it is read */
        for (int extra = 0; extra < 2; extra++) {
            const int n = RS_WEIGHT_MAX_TENSORS + extra;
            char *b = rs_xmalloc((size_t)n * 4 + 64), *p = b;
            p += sprintf(p, "{\"names\":[");
            for (int i = 0; i < n; i++) p += sprintf(p, "%s\"a\"", i ? "," : "");
            sprintf(p, "]}");
            if (extra) {
                char want[64];
                snprintf(want, sizeof want, "at most %d per request", RS_WEIGHT_MAX_TENSORS);
                parse_fails(nccl_parse, &u, b, RS_EINVAL, "names", want);
            } else {
                parse_fails(nccl_parse, &u, b, RS_EINVAL, "dtypes", "dtypes is required");
            }
            free(b);
        }
    }
    parse_fails(nccl_parse, &u, "{\"names\":[\"a\"],\"dtypes\":[\"float32\"],\"shapes\":[[1]],\"load_format\":\"x\"}",
                RS_EUNSUPPORTED, "load_format", NULL);
    parse_fails(nccl_parse, &u, "{\"names\":[\"a\"],\"dtypes\":[\"float32\"],\"shapes\":[[\"1\"]]}", RS_EINVAL,
                "shapes[0][0]", "integer");

    rs_nccl_group_req g;
    char body[600];
    char id[200] = ""; /* base64 of 128 bytes: 172 characters, ending "=" */
    for (int i = 0; i < 42; i++) strcat(id, "AAEC");
    strcat(id, "AAA=");
    snprintf(body, sizeof body, "{\"master_address\":\"127.0.0.1\",\"master_port\":29711,\"rank_offset\":1,"
             "\"world_size\":2,\"group_name\":\"g0\",\"backend\":\"nccl\",\"nccl_unique_id_b64\":\"%s\"}", id);
    ASSERT_EQ(rs_weights_parse_nccl_group(body, strlen(body), &g, &err), RS_OK);
    ASSERT_TRUE(g.has_unique_id);
    ASSERT_EQ(g.unique_id[1], 1);
    ASSERT_EQ(g.unique_id[2], 2);
    ASSERT_EQ(g.unique_id[127], 0);
    ASSERT_EQ(g.master_port, 29711);
    parse_fails(group_parse, &g, "{\"master_address\":\"h\",\"master_port\":1,\"rank_offset\":2,\"world_size\":2}",
                RS_EINVAL, "rank_offset", "<= 1");
    parse_fails(group_parse, &g, "{\"master_address\":\"h\",\"master_port\":70000,\"rank_offset\":1,\"world_size\":2}",
                RS_EINVAL, "master_port", NULL);
    parse_fails(group_parse, &g, "{\"master_address\":\"h\",\"master_port\":1,\"rank_offset\":1,\"world_size\":2,"
                "\"backend\":\"gloo\"}", RS_EUNSUPPORTED, "backend", NULL);
    parse_fails(group_parse, &g, "{\"master_address\":\"h\",\"master_port\":1,\"rank_offset\":1,\"world_size\":2,"
                "\"nccl_unique_id_b64\":\"AAEC\"}", RS_EINVAL, "nccl_unique_id_b64", "128");
    /* AReaL sends master_port as a string: a decimal port is taken, anything else is refused */
    const char *str_port = "{\"master_address\":\"h\",\"master_port\":\"29711\",\"rank_offset\":1,\"world_size\":2}";
    ASSERT_EQ(rs_weights_parse_nccl_group(str_port, strlen(str_port), &g, &err), RS_OK);
    ASSERT_EQ(g.master_port, 29711);
    static const char *const bad_ports[] = {"\"0\"", "\"70000\"", "\"29a\"", "\"\"", "\"-1\"", "\" 80\"",
                                            "\"123456\"", "1.5", "true", "[1]"};
    for (size_t i = 0; i < RS_ARRAY_LEN(bad_ports); i++) {
        snprintf(body, sizeof body, "{\"master_address\":\"h\",\"master_port\":%s,\"rank_offset\":1,"
                 "\"world_size\":2}", bad_ports[i]);
        parse_fails(group_parse, &g, body, RS_EINVAL, "master_port", NULL);
    }
    rs_nccl_destroy_req dr;
    ASSERT_EQ(rs_weights_parse_nccl_destroy("{}", 2, &dr, &err), RS_OK);
    ASSERT_STREQ(dr.group_name, "weight_update_group");
}

RS_TEST(sync_parse_disk_and_version) {
    rs_disk_update_req d;
    rs_error err = {0};
    const char *ok = "{\"model_path\":\"/ckpt/step18\",\"weight_version\":\"18\",\"load_format\":\"auto\"}";
    ASSERT_EQ(rs_weights_parse_disk(ok, strlen(ok), &d, &err), RS_OK);
    ASSERT_STREQ(d.model_path, "/ckpt/step18");
    ASSERT_TRUE(!d.abort_all_requests);
    /* AReaL's spelling, and SGLang's fields that have no effect or only a neutral value here */
    const char *areal = "{\"model_path\":\"/c\",\"abort_all_request\":true,\"flush_cache\":false,"
                        "\"torch_empty_cache\":true,\"is_async\":false,\"keep_pause\":null,\"token_step\":0}";
    ASSERT_EQ(rs_weights_parse_disk(areal, strlen(areal), &d, &err), RS_OK);
    ASSERT_TRUE(d.abort_all_requests);
    parse_fails(disk_parse, &d, "{\"model_path\":\"/c\",\"is_async\":true}", RS_EUNSUPPORTED, "is_async",
                "not implemented");
    parse_fails(disk_parse, &d, "{\"model_path\":\"ckpt\"}", RS_EINVAL, "model_path", "absolute");
    parse_fails(disk_parse, &d, "{\"model_path\":\"/c\",\"load_format\":\"pt\"}", RS_EUNSUPPORTED, "load_format",
                NULL);
    rs_version_update_req v;
    const char *vok = "{\"new_version\":\"18\",\"abort_all_requests\":true}";
    ASSERT_EQ(rs_weights_parse_version(vok, strlen(vok), &v, &err), RS_OK);
    ASSERT_STREQ(v.new_version, "18");
    ASSERT_TRUE(v.abort_all_requests);
    ASSERT_EQ(rs_weights_parse_version("{\"new_version\":\"1\"}", 19, &v, &err), RS_OK);
    ASSERT_TRUE(!v.abort_all_requests); /* never abort unasked (some SGLang versions default to true) */
    parse_fails(version_parse, &v, "{}", RS_EINVAL, "new_version", "required");
    parse_fails(version_parse, &v, "{\"new_version\":\"\"}", RS_EINVAL, "new_version", "empty");
}
