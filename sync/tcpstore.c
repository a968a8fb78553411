/*
 * tcpstore.c — torch.distributed TCPStore client over a non-blocking socket (contract and wire
 * format in tcpstore.h).
 *
 * Each request is built whole in a small buffer and written with one deadline; each reply is read
 * field by field with the same deadline. Lengths that come from the peer are compared with the
 * caller's buffer before anything is read into it. A failure marks the connection broken (the
 * reply stream may be mid-message), except a wait that ends at its deadline, which cancels itself
 * the way torch's client does and leaves the stream in step.
 */
#include "tcpstore.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum {
    Q_VALIDATE = 0,
    Q_SET = 1,
    Q_COMPARE_SET = 2,
    Q_GET = 3,
    Q_ADD = 4,
    Q_CHECK = 5,
    Q_WAIT = 6,
    Q_MULTI_GET = 10,
    Q_MULTI_SET = 11,
    Q_CANCEL_WAIT = 12,
    Q_PING = 13,
};
enum { CHECK_READY = 0, CHECK_NOT_READY = 1 };
enum { WAIT_STOP_WAITING = 0, WAIT_CANCELED = 1 };

struct rs_tcpstore {
    int fd;
    bool broken;                        /* the stream is out of step: every call fails */
    char peer[320];                     /* "host:port" */
};

const char *rs_tcpstore_peer(const rs_tcpstore *s) { return s->peer; }

/* ---------------------------------------------------------------- errors */

static int fail(rs_tcpstore *s, rs_error *err, int code, const char *what, const char *detail) {
    s->broken = true;
    return rs_error_set(err, code, NULL, "TCPStore at %s: %s: %s", s->peer, what, detail);
}

static int timed_out(rs_tcpstore *s, rs_error *err, const char *what) {
    return fail(s, err, RS_EBUSY, what, "no answer before the deadline");
}

/* ---------------------------------------------------------------- socket I/O */

/* Milliseconds to the deadline for poll(), at least 1 while any time is left; -1 when none is. */
static int ms_left(double deadline) {
    double left = deadline - rs_now_s();
    if (left <= 0) return -1;
    double ms = left * 1000.0 + 1.0;
    return ms > 1e9 ? 1000000000 : (int)ms;
}

/* Waits for `events` on fd: 1 ready, 0 deadline passed, -1 poll failed (errno). */
static int wait_fd(int fd, short events, double deadline) {
    for (;;) {
        int ms = ms_left(deadline);
        if (ms < 0) return 0;
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, ms);
        if (r > 0) return 1;
        if (r < 0 && errno != EINTR) return -1;
    }
}

static int send_all(rs_tcpstore *s, const uint8_t *p, size_t n, double deadline, const char *what, rs_error *err) {
    while (n > 0) {
        ssize_t w = send(s->fd, p, n, MSG_NOSIGNAL);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int r = wait_fd(s->fd, POLLOUT, deadline);
            if (r == 0) return timed_out(s, err, what);
            if (r < 0) return fail(s, err, RS_EIO, what, strerror(errno));
            continue;
        }
        if (w < 0 && (errno == EPIPE || errno == ECONNRESET))
            return fail(s, err, RS_EIO, what, "the peer closed the connection");
        return fail(s, err, RS_EIO, what, w < 0 ? strerror(errno) : "send wrote nothing");
    }
    return RS_OK;
}

static int recv_all(rs_tcpstore *s, void *buf, size_t n, double deadline, const char *what, rs_error *err) {
    uint8_t *p = buf;
    size_t got = 0;
    while (got < n) {
        ssize_t r = recv(s->fd, p + got, n - got, 0);
        if (r > 0) {
            got += (size_t)r;
            continue;
        }
        if (r == 0) {
            char detail[96];
            snprintf(detail, sizeof detail, "the peer closed the connection %s",
                     got ? "in the middle of a reply" : "instead of replying");
            return fail(s, err, RS_EIO, what, detail);
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int w = wait_fd(s->fd, POLLIN, deadline);
            if (w == 0) return timed_out(s, err, what);
            if (w < 0) return fail(s, err, RS_EIO, what, strerror(errno));
            continue;
        }
        if (errno == ECONNRESET) return fail(s, err, RS_EIO, what, "the peer reset the connection");
        return fail(s, err, RS_EIO, what, strerror(errno));
    }
    return RS_OK;
}

static int recv_u8(rs_tcpstore *s, uint8_t *v, double deadline, const char *what, rs_error *err) {
    return recv_all(s, v, 1, deadline, what, err);
}

static int recv_u64(rs_tcpstore *s, uint64_t *v, double deadline, const char *what, rs_error *err) {
    uint8_t b[8];
    int rc = recv_all(s, b, 8, deadline, what, err);
    if (rc != RS_OK) return rc;
    uint64_t x = 0;
    for (int i = 7; i >= 0; i--) x = x << 8 | b[i];
    *v = x;
    return RS_OK;
}

/* A byte vector of at most cap bytes into buf: the length is checked before the bytes are read. */
static int recv_value(rs_tcpstore *s, void *buf, size_t cap, size_t *n, double deadline, const char *what,
                      rs_error *err) {
    uint64_t len;
    int rc = recv_u64(s, &len, deadline, what, err);
    if (rc != RS_OK) return rc;
    if (len > cap) {
        char detail[128];
        snprintf(detail, sizeof detail, "malformed reply: a value of %llu bytes, more than the %zu expected",
                 (unsigned long long)len, cap);
        return fail(s, err, RS_EIO, what, detail);
    }
    *n = (size_t)len;
    return len ? recv_all(s, buf, (size_t)len, deadline, what, err) : RS_OK;
}

/* ---------------------------------------------------------------- requests */

typedef struct req {
    uint8_t *p;
    size_t n, cap;
} req;

static void put(req *q, const void *src, size_t n) {
    if (q->n + n > q->cap) {
        size_t cap = q->cap ? q->cap : 256;
        while (cap < q->n + n) cap *= 2;
        uint8_t *p = realloc(q->p, cap);
        RS_ASSERT(p);
        q->p = p;
        q->cap = cap;
    }
    memcpy(q->p + q->n, src, n);
    q->n += n;
}

static void put_u8(req *q, uint8_t v) { put(q, &v, 1); }

static void put_le(req *q, uint64_t v, int bytes) {
    uint8_t b[8];
    for (int i = 0; i < bytes; i++) b[i] = (uint8_t)(v >> (8 * i));
    put(q, b, (size_t)bytes);
}

static void put_bytes(req *q, const void *v, size_t n) {
    put_le(q, n, 8);
    if (n) put(q, v, n);
}

/* A public key: "/" + key (torch's TCPStore keyPrefix_). */
static void put_key(req *q, const char *key) {
    size_t n = strlen(key);
    put_le(q, n + 1, 8);
    put(q, "/", 1);
    put(q, key, n);
}

static int check_keys(rs_tcpstore *s, const char *const *keys, int n_keys, const char *what, rs_error *err) {
    if (s->broken)
        return rs_error_set(err, RS_EIO, NULL, "TCPStore at %s: %s: the connection failed earlier", s->peer, what);
    if (n_keys < 1 || n_keys > RS_TCPSTORE_MULTI_MAX)
        return rs_error_set(err, RS_EINVAL, NULL, "TCPStore %s: %d keys (1..%d)", what, n_keys, RS_TCPSTORE_MULTI_MAX);
    for (int i = 0; i < n_keys; i++)
        if (strlen(keys[i]) + 1 > RS_TCPSTORE_KEY_MAX)
            return rs_error_set(err, RS_EINVAL, NULL, "TCPStore %s: a key of %zu bytes (at most %d)", what,
                                strlen(keys[i]), RS_TCPSTORE_KEY_MAX - 1);
    return RS_OK;
}

static int send_req(rs_tcpstore *s, req *q, double deadline, const char *what, rs_error *err) {
    int rc = send_all(s, q->p, q->n, deadline, what, err);
    free(q->p);
    *q = (req){0};
    return rc;
}

/* "WAIT for 'k'" and the like, for messages (keys shortened). */
static void describe(char *out, size_t cap, const char *verb, const char *const *keys, int n_keys) {
    int o = snprintf(out, cap, "%s '%.120s'", verb, keys[0]);
    if (n_keys > 1 && o > 0 && (size_t)o < cap) snprintf(out + o, cap - (size_t)o, " and %d more keys", n_keys - 1);
}

/* ---------------------------------------------------------------- connect */

static int connect_once(const struct addrinfo *ai, double deadline, int *fd_out, int *err_out) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) return *err_out = errno, -1;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        if (errno != EINPROGRESS) {
            *err_out = errno;
            close(fd);
            return -1;
        }
        int r = wait_fd(fd, POLLOUT, deadline);
        int soerr = 0;
        socklen_t len = sizeof soerr;
        if (r <= 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) != 0 || soerr != 0) {
            *err_out = r == 0 ? ETIMEDOUT : r < 0 ? errno : soerr ? soerr : errno;
            close(fd);
            return -1;
        }
    }
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    *fd_out = fd;
    return 0;
}

static void sleep_until(double t) {
    double left = t - rs_now_s();
    if (left <= 0) return;
    struct timespec ts = {.tv_sec = (time_t)left, .tv_nsec = (long)((left - (double)(time_t)left) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ---------------------------------------------------------------- resolve */

/* getaddrinfo has no timeout: a name server that does not answer holds it for as long as
 * resolv.conf's timeout x attempts allows (30 s and more with several servers), past the init
 * request's deadline. So a name is resolved on a detached thread that the caller waits for until
 * the deadline; one left behind frees its own job when getaddrinfo returns. Numeric addresses skip
 * the thread (AI_NUMERICHOST never blocks). */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;                           /* the caller and the thread */
    bool done;
    int rc;                             /* getaddrinfo's */
    struct addrinfo *res;
    char name[300], service[16];
} resolve_job;

void (*rs_tcpstore_test_hook_resolving)(const char *name);

static void job_unref(resolve_job *j) {
    pthread_mutex_lock(&j->mu);
    bool last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (!last) return;
    if (j->res) freeaddrinfo(j->res);
    pthread_cond_destroy(&j->cv);
    pthread_mutex_destroy(&j->mu);
    free(j);
}

static void *resolve_main(void *arg) {
    resolve_job *j = arg;
    if (rs_tcpstore_test_hook_resolving) rs_tcpstore_test_hook_resolving(j->name);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int rc = getaddrinfo(j->name, j->service, &hints, &res);
    pthread_mutex_lock(&j->mu);
    j->rc = rc;
    j->res = rc == 0 ? res : NULL;
    j->done = true;
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    job_unref(j);
    return NULL;
}

/* 0 and *res on success, a getaddrinfo error code, or EAI_AGAIN with *timed_out at the deadline. */
static int resolve_by(const char *name, const char *service, double deadline, struct addrinfo **res,
                      bool *timed_out) {
    *res = NULL;
    *timed_out = false;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICHOST};
    if (getaddrinfo(name, service, &hints, res) == 0) return 0;
    resolve_job *j = rs_xcalloc(1, sizeof *j);
    pthread_mutex_init(&j->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&j->cv, &ca);
    pthread_condattr_destroy(&ca);
    j->refs = 2;
    snprintf(j->name, sizeof j->name, "%s", name);
    snprintf(j->service, sizeof j->service, "%s", service);
    pthread_attr_t ta;
    pthread_attr_init(&ta);
    pthread_attr_setdetachstate(&ta, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    int e = pthread_create(&t, &ta, resolve_main, j);
    pthread_attr_destroy(&ta);
    if (e != 0) {
        j->refs = 1;
        job_unref(j);
        return EAI_SYSTEM;
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double left = RS_MIN(RS_MAX(deadline - rs_now_s(), 0.0), 1e6);
    long long ns = (long long)ts.tv_nsec + (long long)(left * 1e9);
    ts.tv_sec += (time_t)(ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    pthread_mutex_lock(&j->mu);
    while (!j->done && pthread_cond_timedwait(&j->cv, &j->mu, &ts) != ETIMEDOUT) {
    }
    int rc = j->done ? j->rc : EAI_AGAIN;
    if (j->done && rc == 0) *res = j->res, j->res = NULL;
    *timed_out = !j->done;
    pthread_mutex_unlock(&j->mu);
    job_unref(j);
    return rc;
}

/* ---------------------------------------------------------------- dial */

static int dial(rs_tcpstore *s, const char *host, int port, double deadline, rs_error *err) {
    char name[300], service[16];
    size_t hl = strlen(host);
    if (hl >= 2 && host[0] == '[' && host[hl - 1] == ']') snprintf(name, sizeof name, "%.*s", (int)(hl - 2), host + 1);
    else snprintf(name, sizeof name, "%s", host);
    snprintf(service, sizeof service, "%d", port);
    struct addrinfo *res = NULL;
    bool timed_out;
    int g = resolve_by(name, service, deadline, &res, &timed_out);
    if (timed_out)
        return rs_error_set(err, RS_EBUSY, "master_address",
                            "master_address '%.200s' did not resolve before the deadline (the name server does not "
                            "answer)", host);
    if (g != 0)
        return rs_error_set(err, RS_EINVAL, "master_address", "master_address '%.200s' does not resolve: %s", host,
                            gai_strerror(g));
    int last = 0;
    double backoff = 0.05;
    for (;;) {
        for (const struct addrinfo *ai = res; ai; ai = ai->ai_next) {
            int e = 0;
            if (connect_once(ai, deadline, &s->fd, &e) == 0) {
                freeaddrinfo(res);
                return RS_OK;
            }
            if (e != ETIMEDOUT || last == 0) last = e; /* the deadline cutting an attempt short is not news */
        }
        double now = rs_now_s();
        if (now >= deadline) break;
        sleep_until(RS_MIN(now + backoff, deadline));
        backoff = RS_MIN(backoff * 2, 1.0);
    }
    freeaddrinfo(res);
    return rs_error_set(err, RS_EBUSY, NULL,
                        "TCPStore at %s: could not connect before the deadline (%s): the trainer's store (rank 0 of "
                        "init_method tcp://%s) is not listening", s->peer, strerror(last), s->peer);
}

int rs_tcpstore_connect(rs_tcpstore **out, const char *host, int port, double deadline, rs_error *err) {
    *out = NULL;
    if (port < 1 || port > 65535)
        return rs_error_set(err, RS_EINVAL, "master_port", "master_port %d is not a TCP port", port);
    rs_tcpstore *s = rs_xcalloc(1, sizeof *s);
    s->fd = -1;
    bool v6 = strchr(host, ':') && host[0] != '[';
    snprintf(s->peer, sizeof s->peer, v6 ? "[%.250s]:%d" : "%.250s:%d", host, port);
    int rc = dial(s, host, port, deadline, err);
    if (rc != RS_OK) goto fail;

    req q = {0};
    put_u8(&q, Q_VALIDATE);
    put_le(&q, RS_TCPSTORE_MAGIC, 4);
    const uint32_t nonce = (uint32_t)getpid();
    put_u8(&q, Q_PING);
    put_le(&q, nonce, 4);
    if ((rc = send_req(s, &q, deadline, "VALIDATE and PING", err)) != RS_OK) goto fail;
    uint8_t b[4];
    if ((rc = recv_all(s, b, 4, deadline, "PING", err)) != RS_OK) goto fail;
    uint32_t echo = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    if (echo != nonce) {
        char detail[96];
        snprintf(detail, sizeof detail, "malformed reply: nonce %u, sent %u (not a c10d TCPStore?)", echo, nonce);
        rc = fail(s, err, RS_EIO, "PING", detail);
        goto fail;
    }
    *out = s;
    return RS_OK;
fail:
    rs_tcpstore_close(s);
    return rc;
}

void rs_tcpstore_interrupt(rs_tcpstore *s) {
    if (s && s->fd >= 0) shutdown(s->fd, SHUT_RDWR); /* a poll() on it returns; recv() then reads 0 */
}

void rs_tcpstore_close(rs_tcpstore *s) {
    if (!s) return;
    if (s->fd >= 0) close(s->fd);
    free(s);
}

/* ---------------------------------------------------------------- calls */

int rs_tcpstore_set(rs_tcpstore *s, const char *key, const void *value, size_t n, double deadline, rs_error *err) {
    int rc = check_keys(s, &key, 1, "SET", err);
    if (rc != RS_OK) return rc;
    if (n > RS_TCPSTORE_VALUE_MAX)
        return rs_error_set(err, RS_EINVAL, NULL, "TCPStore SET: a value of %zu bytes (at most %d)", n,
                            RS_TCPSTORE_VALUE_MAX);
    req q = {0};
    put_u8(&q, Q_SET);
    put_key(&q, key);
    put_bytes(&q, value, n);
    return send_req(s, &q, deadline, "SET", err);
}

/* WAIT for public keys (checked by the caller); cancels itself at the deadline. */
static int do_wait(rs_tcpstore *s, const char *const *keys, int n_keys, double deadline, rs_error *err) {
    char what[200];
    describe(what, sizeof what, "WAIT for", keys, n_keys);
    req q = {0};
    put_u8(&q, Q_WAIT);
    put_le(&q, (uint64_t)n_keys, 8);
    for (int i = 0; i < n_keys; i++) put_key(&q, keys[i]);
    int rc = send_req(s, &q, deadline, what, err);
    if (rc != RS_OK) return rc;

    uint8_t r = 0;
    int w = wait_fd(s->fd, POLLIN, deadline);
    if (w < 0) return fail(s, err, RS_EIO, what, strerror(errno));
    if (w == 1) {
        if ((rc = recv_u8(s, &r, deadline, what, err)) != RS_OK) return rc;
        if (r != WAIT_STOP_WAITING) return fail(s, err, RS_EIO, what, "malformed reply (not STOP_WAITING)");
        return RS_OK;
    }
    /* The deadline passed: cancel the wait as torch's client does (the answer may be a
     * STOP_WAITING that crossed the cancel, then WAIT_CANCELED). */
    const double grace = rs_now_s() + RS_TCPSTORE_CANCEL_GRACE_S;
    put_u8(&q, Q_CANCEL_WAIT);
    if ((rc = send_req(s, &q, grace, what, err)) != RS_OK) return rc;
    if ((rc = recv_u8(s, &r, grace, what, err)) != RS_OK) return rc;
    if (r == WAIT_STOP_WAITING && (rc = recv_u8(s, &r, grace, what, err)) != RS_OK) return rc;
    if (r != WAIT_CANCELED) return fail(s, err, RS_EIO, what, "malformed reply to CANCEL_WAIT");
    return rs_error_set(err, RS_EBUSY, NULL, "TCPStore at %s: %s: not set before the deadline", s->peer, what);
}

int rs_tcpstore_wait(rs_tcpstore *s, const char *const *keys, int n_keys, double deadline, rs_error *err) {
    int rc = check_keys(s, keys, n_keys, "WAIT", err);
    return rc != RS_OK ? rc : do_wait(s, keys, n_keys, deadline, err);
}

int rs_tcpstore_get(rs_tcpstore *s, const char *key, void *buf, size_t cap, size_t *n, double deadline,
                    rs_error *err) {
    int rc = check_keys(s, &key, 1, "GET", err);
    if (rc != RS_OK || (rc = do_wait(s, &key, 1, deadline, err)) != RS_OK) return rc;
    char what[160];
    snprintf(what, sizeof what, "GET '%.120s'", key);
    req q = {0};
    put_u8(&q, Q_GET);
    put_key(&q, key);
    if ((rc = send_req(s, &q, deadline, what, err)) != RS_OK) return rc;
    return recv_value(s, buf, cap, n, deadline, what, err);
}

/* ADD on a key as it is sent (raw: no "/" prefix), for "init/". */
static int add_wire(rs_tcpstore *s, const char *wire_key, int64_t delta, int64_t *value, double deadline,
                    rs_error *err) {
    char what[160];
    snprintf(what, sizeof what, "ADD '%.120s'", wire_key);
    req q = {0};
    put_u8(&q, Q_ADD);
    put_bytes(&q, wire_key, strlen(wire_key));
    put_le(&q, (uint64_t)delta, 8);
    int rc = send_req(s, &q, deadline, what, err);
    uint64_t v = 0;
    if (rc != RS_OK || (rc = recv_u64(s, &v, deadline, what, err)) != RS_OK) return rc;
    if (value) *value = (int64_t)v;
    return RS_OK;
}

int rs_tcpstore_add(rs_tcpstore *s, const char *key, int64_t delta, int64_t *value, double deadline, rs_error *err) {
    int rc = check_keys(s, &key, 1, "ADD", err);
    if (rc != RS_OK) return rc;
    char wire[RS_TCPSTORE_KEY_MAX];
    snprintf(wire, sizeof wire, "/%s", key);
    return add_wire(s, wire, delta, value, deadline, err);
}

int rs_tcpstore_check(rs_tcpstore *s, const char *const *keys, int n_keys, bool *all_set, double deadline,
                      rs_error *err) {
    int rc = check_keys(s, keys, n_keys, "CHECK", err);
    if (rc != RS_OK) return rc;
    char what[200];
    describe(what, sizeof what, "CHECK", keys, n_keys);
    req q = {0};
    put_u8(&q, Q_CHECK);
    put_le(&q, (uint64_t)n_keys, 8);
    for (int i = 0; i < n_keys; i++) put_key(&q, keys[i]);
    uint8_t r = 0;
    if ((rc = send_req(s, &q, deadline, what, err)) != RS_OK || (rc = recv_u8(s, &r, deadline, what, err)) != RS_OK)
        return rc;
    if (r != CHECK_READY && r != CHECK_NOT_READY) return fail(s, err, RS_EIO, what, "malformed reply (not READY/NOT_READY)");
    *all_set = r == CHECK_READY;
    return RS_OK;
}

int rs_tcpstore_compare_set(rs_tcpstore *s, const char *key, const void *expected, size_t expected_n,
                            const void *desired, size_t desired_n, void *buf, size_t cap, size_t *n, double deadline,
                            rs_error *err) {
    int rc = check_keys(s, &key, 1, "COMPARE_SET", err);
    if (rc != RS_OK) return rc;
    if (expected_n > RS_TCPSTORE_VALUE_MAX || desired_n > RS_TCPSTORE_VALUE_MAX)
        return rs_error_set(err, RS_EINVAL, NULL, "TCPStore COMPARE_SET: a value over %d bytes", RS_TCPSTORE_VALUE_MAX);
    char what[160];
    snprintf(what, sizeof what, "COMPARE_SET '%.120s'", key);
    req q = {0};
    put_u8(&q, Q_COMPARE_SET);
    put_key(&q, key);
    put_bytes(&q, expected, expected_n);
    put_bytes(&q, desired, desired_n);
    if ((rc = send_req(s, &q, deadline, what, err)) != RS_OK) return rc;
    return recv_value(s, buf, cap, n, deadline, what, err);
}

int rs_tcpstore_multi_set(rs_tcpstore *s, const char *const *keys, const void *const *values, const size_t *lens,
                          int n_keys, double deadline, rs_error *err) {
    int rc = check_keys(s, keys, n_keys, "MULTI_SET", err);
    if (rc != RS_OK) return rc;
    for (int i = 0; i < n_keys; i++)
        if (lens[i] > RS_TCPSTORE_VALUE_MAX)
            return rs_error_set(err, RS_EINVAL, NULL, "TCPStore MULTI_SET: a value of %zu bytes (at most %d)", lens[i],
                                RS_TCPSTORE_VALUE_MAX);
    req q = {0};
    put_u8(&q, Q_MULTI_SET);
    put_le(&q, (uint64_t)n_keys, 8);
    for (int i = 0; i < n_keys; i++) {
        put_key(&q, keys[i]);
        put_bytes(&q, values[i], lens[i]);
    }
    return send_req(s, &q, deadline, "MULTI_SET", err);
}

int rs_tcpstore_multi_get(rs_tcpstore *s, const char *const *keys, int n_keys, void *const *bufs,
                          const size_t *caps, size_t *lens, double deadline, rs_error *err) {
    int rc = check_keys(s, keys, n_keys, "MULTI_GET", err);
    if (rc != RS_OK || (rc = do_wait(s, keys, n_keys, deadline, err)) != RS_OK) return rc;
    char what[200];
    describe(what, sizeof what, "MULTI_GET", keys, n_keys);
    req q = {0};
    put_u8(&q, Q_MULTI_GET);
    put_le(&q, (uint64_t)n_keys, 8);
    for (int i = 0; i < n_keys; i++) put_key(&q, keys[i]);
    if ((rc = send_req(s, &q, deadline, what, err)) != RS_OK) return rc;
    for (int i = 0; i < n_keys; i++)
        if ((rc = recv_value(s, bufs[i], caps[i], &lens[i], deadline, what, err)) != RS_OK) return rc;
    return RS_OK;
}

/* ---------------------------------------------------------------- the c10d group sequence */

int rs_c10d_backend_key(char *out, size_t cap, const char *group_name, const char *device, const char *key) {
    int n = snprintf(out, cap, "%s/%s//%s//%s", group_name, group_name, device, key);
    return n < 0 || (size_t)n >= cap || (size_t)n + 1 >= RS_TCPSTORE_KEY_MAX ? RS_EINVAL : RS_OK;
}

int rs_c10d_join(rs_tcpstore **out, const char *host, int port, int64_t *joined, double deadline, rs_error *err) {
    rs_tcpstore *s = NULL;
    int rc = rs_tcpstore_connect(&s, host, port, deadline, err);
    if (rc != RS_OK) return rc;
    int64_t n = 0;
    if ((rc = add_wire(s, "init/", 1, &n, deadline, err)) != RS_OK) {
        rs_tcpstore_close(s);
        return rc;
    }
    if (joined) *joined = n;
    *out = s;
    return RS_OK;
}

int rs_c10d_nccl_id_key(char *out, size_t cap, const char *group_name, rs_c10d_id_flavor flavor) {
    if (flavor == RS_C10D_ID_LEGACY) return rs_c10d_backend_key(out, cap, group_name, "cuda", "0");
    char key[RS_TCPSTORE_KEY_MAX];
    int n = snprintf(key, sizeof key, "%s/nccl_storekey_0", group_name);
    if (n < 0 || (size_t)n >= sizeof key) return RS_EINVAL;
    return rs_c10d_backend_key(out, cap, group_name, "cuda", key);
}

const char *rs_c10d_id_flavor_name(rs_c10d_id_flavor flavor) {
    return flavor == RS_C10D_ID_NCCL2 ? "nccl2" : "ProcessGroupNCCL";
}

/* GETs the 128-byte id under key (set: the caller saw it), into id. */
static int read_id(rs_tcpstore *s, const char *key, uint8_t id[RS_C10D_UNIQUE_ID_BYTES], double deadline,
                   rs_error *err) {
    uint8_t buf[RS_C10D_UNIQUE_ID_BYTES];
    size_t n = 0;
    int rc = rs_tcpstore_get(s, key, buf, sizeof buf, &n, deadline, err);
    if (rc != RS_OK) return rc;
    if (n != RS_C10D_UNIQUE_ID_BYTES) {
        s->broken = true;
        return rs_error_set(err, RS_EIO, NULL,
                            "TCPStore at %s: malformed reply: the ncclUniqueId under key '/%s' is %zu bytes, not %d",
                            s->peer, key, n, RS_C10D_UNIQUE_ID_BYTES);
    }
    memcpy(id, buf, sizeof buf);
    return RS_OK;
}

int rs_c10d_nccl_unique_id(rs_tcpstore *s, const char *group_name, uint64_t comm_index,
                           uint8_t id[RS_C10D_UNIQUE_ID_BYTES], double deadline, rs_error *err) {
    char index[24], key[RS_TCPSTORE_KEY_MAX];
    snprintf(index, sizeof index, "%llu", (unsigned long long)comm_index);
    if (rs_c10d_backend_key(key, sizeof key, group_name, "cuda", index) != RS_OK)
        return rs_error_set(err, RS_EINVAL, "group_name", "group_name is too long for a store key");
    int rc = read_id(s, key, id, deadline, err);
    if (rc == RS_EBUSY && !s->broken) /* the wait was cancelled at the deadline */
        return rs_error_set(err, RS_EBUSY, NULL,
                            "timed out waiting for the trainer's ncclUniqueId under key '/%s' of the TCPStore at %s: "
                            "rank 0 sets it when its first collective on the group (dist.broadcast) creates the "
                            "communicator", key, s->peer);
    return rc;
}

static void nap_s(double s) {
    struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

int rs_c10d_nccl_unique_id_either(rs_tcpstore *s, const char *group_name, uint8_t id[RS_C10D_UNIQUE_ID_BYTES],
                                  rs_c10d_id_flavor *flavor, double deadline, double op_timeout_s,
                                  const volatile int *cancel, rs_error *err) {
    const double t0 = rs_now_s();
    char keys[2][RS_TCPSTORE_KEY_MAX];
    for (int f = 0; f < 2; f++)
        if (rs_c10d_nccl_id_key(keys[f], sizeof keys[f], group_name, (rs_c10d_id_flavor)f) != RS_OK)
            return rs_error_set(err, RS_EINVAL, "group_name", "group_name is too long for a store key");
    for (;;) {
        for (int f = 0; f < 2; f++) {
            const char *key = keys[f];
            bool set = false;
            int rc = rs_tcpstore_check(s, &key, 1, &set, RS_MIN(deadline, rs_now_s() + op_timeout_s), err);
            if (rc != RS_OK) return rc;
            if (!set) continue;
            if ((rc = read_id(s, key, id, RS_MIN(deadline, rs_now_s() + op_timeout_s), err)) != RS_OK) return rc;
            *flavor = (rs_c10d_id_flavor)f;
            return RS_OK;
        }
        if (cancel && __atomic_load_n(cancel, __ATOMIC_ACQUIRE))
            return rs_error_set(err, RS_EBUSY, NULL, "the wait for the trainer's ncclUniqueId was cancelled");
        const double now = rs_now_s();
        const double poll_s = now - t0 < RS_C10D_POLL_FAST_FOR_S ? RS_C10D_POLL_FAST_S : RS_C10D_POLL_SLOW_S;
        if (now + poll_s > deadline)
            return rs_error_set(err, RS_EBUSY, NULL,
                                "timed out waiting for the trainer's ncclUniqueId under key '/%s' (torch's "
                                "ProcessGroupNCCL: set at the trainer's first collective on the group) or '/%s' "
                                "(torch's nccl2 backend, the default \"nccl\" from torch 2.15: set as the group is "
                                "created) of the TCPStore at %s", keys[0], keys[1], s->peer);
        nap_s(poll_s);
    }
}
