/*
 * test_tcpstore.c — the TCPStore client (sync/tcpstore.h) against scripted peers on loopback.
 *
 * The reference for the wire format is what torch's own client sends and its server answers,
 * recorded through a proxy with torch 2.9.1 (the same bytes with 2.7.1, 2.8.0 and 2.15.0; the
 * recordings are the hex strings below, nonce bytes aside): every request this client builds must
 * be byte-identical, and it must take torch's answers. The rest are peers a trainer's store must
 * never be, and the client must survive: nothing listening, silence, a close in the middle of a
 * reply, a wrong nonce, a value length of 2^63 (refused before a byte is read or allocated), a
 * unique id of the wrong size, and a wait that is cancelled at its deadline (the connection stays
 * usable) or whose cancel is never answered. Each failure must come within its deadline (plus the
 * cancel grace). The same client against torch's real TCPStore: tests/e2e/test_tcpstore.py.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../../sync/tcpstore.h"
#include "test.h"

/* ---------------------------------------------------------------- a scripted peer */

typedef enum { P_READ, P_WRITE, P_ECHO_NONCE, P_SLEEP, P_CLOSE } peer_op;

typedef struct peer_step {
    peer_op op;
    const char *hex;                    /* P_READ: the bytes expected; P_WRITE: the bytes sent */
    double seconds;                     /* P_SLEEP */
} peer_step;

typedef struct peer {
    int listen_fd, port;
    double listen_after;                /* seconds before the listener is opened (0: at once) */
    const peer_step *steps;
    int n_steps;
    pthread_t thread;
    uint8_t nonce[4];
    char mismatch[512];                 /* first P_READ that differed, "" if none */
} peer;

static size_t unhex(const char *h, uint8_t *out, size_t cap) {
    size_t n = 0;
    for (; h[0] && h[1]; h += 2) {
        if (h[0] == ' ') {
            h--;
            continue;
        }
        unsigned v;
        if (sscanf(h, "%2x", &v) != 1 || n == cap) RS_TEST_FAIL("bad hex in the test: %s", h);
        out[n++] = (uint8_t)v;
    }
    return n;
}

static bool read_n(int fd, uint8_t *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = recv(fd, buf + got, n - got, 0);
        if (r <= 0) return false;
        got += (size_t)r;
    }
    return true;
}

static int open_listener(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 4) != 0) RS_TEST_FAIL("listen: %s", strerror(errno));
    return fd;
}

static int bound_port(int fd) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &len);
    return ntohs(a.sin_port);
}

static void nap(double s) {
    struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static void *peer_main(void *arg) {
    peer *p = arg;
    if (p->listen_after > 0) {
        nap(p->listen_after);
        p->listen_fd = open_listener(p->port);
    }
    int c = accept(p->listen_fd, NULL, NULL);
    if (c < 0) return NULL;
    uint8_t want[4096], got[4096];
    for (int i = 0; i < p->n_steps; i++) {
        const peer_step *st = &p->steps[i];
        if (st->op == P_READ) {
            size_t n = unhex(st->hex, want, sizeof want);
            if (!read_n(c, got, n)) {
                snprintf(p->mismatch, sizeof p->mismatch, "step %d: the client sent less than %zu bytes", i, n);
                break;
            }
            if (i == 0 && n >= 10) memcpy(p->nonce, got + 6, 4); /* VALIDATE, then PING's nonce */
            for (size_t k = 0; k < n && !p->mismatch[0]; k++)
                if (got[k] != want[k] && !(i == 0 && k >= 6 && k < 10))
                    snprintf(p->mismatch, sizeof p->mismatch, "step %d byte %zu: sent %02x, torch sends %02x", i, k,
                             got[k], want[k]);
        } else if (st->op == P_WRITE) {
            size_t n = unhex(st->hex, want, sizeof want);
            if (send(c, want, n, MSG_NOSIGNAL) != (ssize_t)n) break;
        } else if (st->op == P_ECHO_NONCE) {
            if (send(c, p->nonce, 4, MSG_NOSIGNAL) != 4) break;
        } else if (st->op == P_SLEEP) {
            nap(st->seconds);
        } else {
            break;
        }
    }
    close(c);
    return NULL;
}

/* Starts a peer on an ephemeral loopback port running `steps` for one connection. */
static void peer_start(peer *p, const peer_step *steps, int n_steps, double listen_after) {
    memset(p, 0, sizeof *p);
    p->steps = steps;
    p->n_steps = n_steps;
    p->listen_after = listen_after;
    p->listen_fd = open_listener(0);
    p->port = bound_port(p->listen_fd);
    if (listen_after > 0) close(p->listen_fd); /* refused until the thread listens again */
    pthread_create(&p->thread, NULL, peer_main, p);
}

static void peer_join(peer *p) {
    pthread_join(p->thread, NULL);
    close(p->listen_fd);
    if (p->mismatch[0]) RS_TEST_FAIL("the client's bytes differ from torch's: %s", p->mismatch);
}

/* Frames recorded from torch 2.9.1 (the Python client's bytes and the libuv server's answers). */
#define HELLO "00cef7853c 0d00000000"                    /* VALIDATE magic, PING nonce (any) */
#define SET_K_V1 "01 0200000000000000 2f6b 0200000000000000 7631"
#define WAIT_K "06 0100000000000000 0200000000000000 2f6b"
#define GET_K "03 0200000000000000 2f6b"
#define ADD_N_5 "04 0200000000000000 2f6e 0500000000000000"
#define CHECK_K_ZZ "05 0200000000000000 0200000000000000 2f6b 0300000000000000 2f7a7a"
#define CAS_K "02 0200000000000000 2f6b 0200000000000000 7631 0200000000000000 7632"
#define MSET_AB "0b 0200000000000000 0200000000000000 2f61 0100000000000000 31 0200000000000000 2f62 0200000000000000 3232"
#define WAIT_AB "06 0200000000000000 0200000000000000 2f61 0200000000000000 2f62"
#define MGET_AB "0a 0200000000000000 0200000000000000 2f61 0200000000000000 2f62"
#define WAIT_NEVER "06 0100000000000000 0600000000000000 2f6e65766572"
#define ADD_INIT "04 0500000000000000 696e69742f 0100000000000000" /* raw "init/", no "/" */

static const peer_step HANDSHAKE[] = {{P_READ, HELLO, 0}, {P_ECHO_NONCE, NULL, 0}};

RS_TEST(tcpstore_requests_match_torch) {
    static const peer_step steps[] = {
        {P_READ, HELLO, 0}, {P_ECHO_NONCE, NULL, 0},
        {P_READ, SET_K_V1, 0},
        {P_READ, WAIT_K, 0}, {P_WRITE, "00", 0}, {P_READ, GET_K, 0}, {P_WRITE, "0200000000000000 7631", 0},
        {P_READ, ADD_N_5, 0}, {P_WRITE, "0500000000000000", 0},
        {P_READ, CHECK_K_ZZ, 0}, {P_WRITE, "01", 0},
        {P_READ, CAS_K, 0}, {P_WRITE, "0200000000000000 7632", 0},
        {P_READ, MSET_AB, 0},
        {P_READ, WAIT_AB, 0}, {P_WRITE, "00", 0}, {P_READ, MGET_AB, 0},
        {P_WRITE, "0100000000000000 31 0200000000000000 3232", 0},
        {P_READ, WAIT_NEVER, 0}, {P_READ, "0c", 0}, {P_WRITE, "01", 0}, /* cancelled at the deadline */
        {P_READ, CHECK_K_ZZ, 0}, {P_WRITE, "00", 0},                   /* ... and still in step */
    };
    peer p;
    peer_start(&p, steps, RS_ARRAY_LEN(steps), 0);
    rs_error err = {0};
    rs_tcpstore *s = NULL;
    double dl = rs_now_s() + 10;
    ASSERT_EQ(rs_tcpstore_connect(&s, "127.0.0.1", p.port, dl, &err), RS_OK);
    ASSERT_EQ(rs_tcpstore_set(s, "k", "v1", 2, dl, &err), RS_OK);
    char buf[16];
    size_t n = 0;
    ASSERT_EQ(rs_tcpstore_get(s, "k", buf, sizeof buf, &n, dl, &err), RS_OK);
    ASSERT_EQ(n, 2);
    ASSERT_TRUE(memcmp(buf, "v1", 2) == 0);
    int64_t v = 0;
    ASSERT_EQ(rs_tcpstore_add(s, "n", 5, &v, dl, &err), RS_OK);
    ASSERT_EQ(v, 5);
    const char *kz[] = {"k", "zz"};
    bool all = true;
    ASSERT_EQ(rs_tcpstore_check(s, kz, 2, &all, dl, &err), RS_OK);
    ASSERT_TRUE(!all);
    ASSERT_EQ(rs_tcpstore_compare_set(s, "k", "v1", 2, "v2", 2, buf, sizeof buf, &n, dl, &err), RS_OK);
    ASSERT_TRUE(n == 2 && memcmp(buf, "v2", 2) == 0);
    const char *ab[] = {"a", "b"};
    const void *vals[] = {"1", "22"};
    const size_t lens[] = {1, 2};
    ASSERT_EQ(rs_tcpstore_multi_set(s, ab, vals, lens, 2, dl, &err), RS_OK);
    char b0[4], b1[4];
    void *bufs[] = {b0, b1};
    const size_t caps[] = {4, 4};
    size_t got[2];
    ASSERT_EQ(rs_tcpstore_multi_get(s, ab, 2, bufs, caps, got, dl, &err), RS_OK);
    ASSERT_TRUE(got[0] == 1 && got[1] == 2 && b0[0] == '1' && memcmp(b1, "22", 2) == 0);
    const char *never = "never";
    double t0 = rs_now_s();
    ASSERT_EQ(rs_tcpstore_wait(s, &never, 1, t0 + 0.3, &err), RS_EBUSY);
    ASSERT_TRUE(rs_now_s() - t0 >= 0.29 && rs_now_s() - t0 < 0.3 + RS_TCPSTORE_CANCEL_GRACE_S);
    ASSERT_TRUE(strstr(err.message, "'never'") && strstr(err.message, "not set before the deadline"));
    ASSERT_EQ(rs_tcpstore_check(s, kz, 2, &all, dl, &err), RS_OK);
    ASSERT_TRUE(all);
    rs_tcpstore_close(s);
    peer_join(&p);
}

RS_TEST(tcpstore_c10d_join_and_keys) {
    /* The key of torch's recorded gloo group ("/grpX/grpX//cpu//0/1" on the wire) and the
     * ProcessGroupNCCL id key built the same way. */
    char key[256];
    ASSERT_EQ(rs_c10d_backend_key(key, sizeof key, "grpX", "cpu", "0/1"), RS_OK);
    ASSERT_STREQ(key, "grpX/grpX//cpu//0/1");
    ASSERT_EQ(rs_c10d_backend_key(key, sizeof key, "weight_update_group", "cuda", "0"), RS_OK);
    ASSERT_STREQ(key, "weight_update_group/weight_update_group//cuda//0");
    ASSERT_EQ(rs_c10d_backend_key(key, 10, "weight_update_group", "cuda", "0"), RS_EINVAL);

    char id_reply[2 * 8 + 2 * 128 + 2];
    snprintf(id_reply, sizeof id_reply, "8000000000000000");
    for (int i = 0; i < 128; i++) snprintf(id_reply + 16 + 2 * i, 3, "%02x", (i * 7 + 3) & 0xff);
    /* WAIT and GET of "/g0/g0//cuda//0" */
    static const char wait_id[] = "06 0100000000000000 0f00000000000000 2f67302f6730 2f2f63756461 2f2f30";
    static const char get_id[] = "03 0f00000000000000 2f67302f6730 2f2f63756461 2f2f30";
    const peer_step steps[] = {
        {P_READ, HELLO, 0}, {P_ECHO_NONCE, NULL, 0},
        {P_READ, ADD_INIT, 0}, {P_WRITE, "0200000000000000", 0},
        {P_READ, wait_id, 0}, {P_WRITE, "00", 0}, {P_READ, get_id, 0}, {P_WRITE, id_reply, 0},
    };
    peer p;
    peer_start(&p, steps, RS_ARRAY_LEN(steps), 0);
    rs_error err = {0};
    rs_tcpstore *s = NULL;
    int64_t joined = 0;
    double dl = rs_now_s() + 10;
    ASSERT_EQ(rs_c10d_join(&s, "127.0.0.1", p.port, &joined, dl, &err), RS_OK);
    ASSERT_EQ(joined, 2);
    uint8_t id[128];
    ASSERT_EQ(rs_c10d_nccl_unique_id(s, "g0", 0, id, dl, &err), RS_OK);
    for (int i = 0; i < 128; i++) ASSERT_EQ(id[i], (i * 7 + 3) & 0xff);
    rs_tcpstore_close(s);
    peer_join(&p);
}

RS_TEST(tcpstore_connect_waits_for_a_late_listener) {
    /* slime and AReaL post /init_weights_update_group before they create their store */
    peer p;
    peer_start(&p, HANDSHAKE, RS_ARRAY_LEN(HANDSHAKE), 0.4);
    rs_error err = {0};
    rs_tcpstore *s = NULL;
    double t0 = rs_now_s();
    ASSERT_EQ(rs_tcpstore_connect(&s, "127.0.0.1", p.port, t0 + 10, &err), RS_OK);
    ASSERT_TRUE(rs_now_s() - t0 >= 0.35);
    rs_tcpstore_close(s);
    peer_join(&p);
}

RS_TEST(tcpstore_connect_refused_until_the_deadline) {
    int fd = open_listener(0);
    int port = bound_port(fd);
    close(fd);
    rs_error err = {0};
    rs_tcpstore *s = NULL;
    double t0 = rs_now_s();
    ASSERT_EQ(rs_tcpstore_connect(&s, "127.0.0.1", port, t0 + 0.5, &err), RS_EBUSY);
    double dt = rs_now_s() - t0;
    ASSERT_TRUE(dt >= 0.45 && dt < 1.5);
    ASSERT_TRUE(s == NULL);
    ASSERT_TRUE(strstr(err.message, "Connection refused") && strstr(err.message, "not listening"));
    ASSERT_EQ(rs_err_http_status(err.code), 503);

    memset(&err, 0, sizeof err);
    ASSERT_EQ(rs_tcpstore_connect(&s, "no-such-host.invalid", 29500, rs_now_s() + 2, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "master_address");
    memset(&err, 0, sizeof err);
    ASSERT_EQ(rs_tcpstore_connect(&s, "127.0.0.1", 0, rs_now_s() + 2, &err), RS_EINVAL);
    ASSERT_STREQ(err.param, "master_port");
}

static double resolve_delay_s;
static void slow_resolver(const char *name) {
    (void)name;
    struct timespec ts = {0, (long)(resolve_delay_s * 1e9)};
    nanosleep(&ts, NULL);
}

RS_TEST(tcpstore_a_slow_name_server_costs_at_most_the_deadline) {
    rs_tcpstore_test_hook_resolving = slow_resolver;
    resolve_delay_s = 0.6;
    rs_error err = {0};
    rs_tcpstore *s = NULL;
    double t0 = rs_now_s();
    ASSERT_EQ(rs_tcpstore_connect(&s, "localhost", 29500, t0 + 0.2, &err), RS_EBUSY);
    double dt = rs_now_s() - t0;
    ASSERT_TRUE(dt >= 0.15 && dt < 0.5);
    ASSERT_TRUE(s == NULL);
    ASSERT_STREQ(err.param, "master_address");
    ASSERT_TRUE(strstr(err.message, "did not resolve before the deadline") != NULL);

    /* a name that resolves within the deadline connects as before (the peer listens on 127.0.0.1;
     * localhost may also name ::1, which refuses and is passed over) */
    resolve_delay_s = 0.1;
    peer p;
    peer_start(&p, HANDSHAKE, RS_ARRAY_LEN(HANDSHAKE), 0);
    memset(&err, 0, sizeof err);
    ASSERT_EQ(rs_tcpstore_connect(&s, "localhost", p.port, rs_now_s() + 10, &err), RS_OK);
    rs_tcpstore_close(s);
    peer_join(&p);
    rs_tcpstore_test_hook_resolving = NULL;
    struct timespec ts = {0, 700 * 1000 * 1000}; /* the abandoned lookup ends and frees its job */
    nanosleep(&ts, NULL);
}

/* Runs one connect against a peer with `steps`; returns the code and how long it took. */
static int connect_to(const peer_step *steps, int n_steps, double timeout, double *dt, rs_error *err) {
    peer p;
    peer_start(&p, steps, n_steps, 0);
    rs_tcpstore *s = NULL;
    double t0 = rs_now_s();
    int rc = rs_tcpstore_connect(&s, "127.0.0.1", p.port, t0 + timeout, err);
    *dt = rs_now_s() - t0;
    rs_tcpstore_close(s);
    peer_join(&p);
    return rc;
}

RS_TEST(tcpstore_bad_peers_fail_within_the_deadline) {
    double dt;
    rs_error err = {0};
    static const peer_step silent[] = {{P_READ, HELLO, 0}, {P_SLEEP, NULL, 1.0}};
    ASSERT_EQ(connect_to(silent, RS_ARRAY_LEN(silent), 0.3, &dt, &err), RS_EBUSY);
    ASSERT_TRUE(dt >= 0.29 && dt < 0.8);
    ASSERT_TRUE(strstr(err.message, "PING") && strstr(err.message, "no answer before the deadline"));

    static const peer_step half[] = {{P_READ, HELLO, 0}, {P_WRITE, "0102", 0}, {P_CLOSE, NULL, 0}};
    memset(&err, 0, sizeof err);
    ASSERT_EQ(connect_to(half, RS_ARRAY_LEN(half), 5, &dt, &err), RS_EIO);
    ASSERT_TRUE(strstr(err.message, "closed the connection in the middle of a reply") != NULL);
    ASSERT_TRUE(dt < 2);

    static const peer_step shut[] = {{P_READ, HELLO, 0}, {P_CLOSE, NULL, 0}};
    memset(&err, 0, sizeof err);
    ASSERT_EQ(connect_to(shut, RS_ARRAY_LEN(shut), 5, &dt, &err), RS_EIO);
    ASSERT_TRUE(strstr(err.message, "closed the connection instead of replying") != NULL);

    static const peer_step wrong[] = {{P_READ, HELLO, 0}, {P_WRITE, "deadbeef", 0}};
    memset(&err, 0, sizeof err);
    ASSERT_EQ(connect_to(wrong, RS_ARRAY_LEN(wrong), 5, &dt, &err), RS_EIO);
    ASSERT_TRUE(strstr(err.message, "malformed reply") && strstr(err.message, "nonce"));
}

RS_TEST(tcpstore_garbage_lengths_are_refused_unread) {
    /* a value length of 2^63, then of 129 bytes for the 128-byte unique id, then 127 bytes */
    static const char wait_id[] = "06 0100000000000000 0f00000000000000 2f67302f6730 2f2f63756461 2f2f30";
    static const char get_id[] = "03 0f00000000000000 2f67302f6730 2f2f63756461 2f2f30";
    const char *replies[] = {"0000000000000080", "8100000000000000", "7f00000000000000"};
    const char *want[] = {"a value of 9223372036854775808 bytes, more than the 128 expected",
                          "a value of 129 bytes, more than the 128 expected", "is 127 bytes, not 128"};
    for (int i = 0; i < 3; i++) {
        char reply[600];
        snprintf(reply, sizeof reply, "%s", replies[i]);
        if (i == 2)
            for (int k = 0; k < 127; k++) strcat(reply, "ab");
        const peer_step steps[] = {{P_READ, HELLO, 0}, {P_ECHO_NONCE, NULL, 0}, {P_READ, wait_id, 0},
                                   {P_WRITE, "00", 0}, {P_READ, get_id, 0}, {P_WRITE, reply, 0},
                                   {P_SLEEP, NULL, 0.2}};
        peer p;
        peer_start(&p, steps, RS_ARRAY_LEN(steps), 0);
        rs_error err = {0};
        rs_tcpstore *s = NULL;
        double dl = rs_now_s() + 5;
        ASSERT_EQ(rs_tcpstore_connect(&s, "127.0.0.1", p.port, dl, &err), RS_OK);
        uint8_t id[128];
        ASSERT_EQ(rs_c10d_nccl_unique_id(s, "g0", 0, id, dl, &err), RS_EIO);
        if (!strstr(err.message, want[i])) RS_TEST_FAIL("case %d: %s", i, err.message);
        ASSERT_TRUE(strstr(err.message, "malformed reply") != NULL);
        /* the stream is out of step now: every later call fails at once */
        int64_t v;
        memset(&err, 0, sizeof err);
        ASSERT_EQ(rs_tcpstore_add(s, "n", 1, &v, dl, &err), RS_EIO);
        ASSERT_TRUE(strstr(err.message, "failed earlier") != NULL);
        rs_tcpstore_close(s);
        peer_join(&p);
    }
}

RS_TEST(tcpstore_unanswered_cancel_ends_within_the_grace) {
    const peer_step steps[] = {{P_READ, HELLO, 0}, {P_ECHO_NONCE, NULL, 0}, {P_READ, WAIT_NEVER, 0},
                               {P_READ, "0c", 0}, {P_SLEEP, NULL, 1.5}};
    peer p;
    peer_start(&p, steps, RS_ARRAY_LEN(steps), 0);
    rs_error err = {0};
    rs_tcpstore *s = NULL;
    ASSERT_EQ(rs_tcpstore_connect(&s, "127.0.0.1", p.port, rs_now_s() + 5, &err), RS_OK);
    const char *never = "never";
    double t0 = rs_now_s();
    ASSERT_EQ(rs_tcpstore_wait(s, &never, 1, t0 + 0.2, &err), RS_EBUSY);
    double dt = rs_now_s() - t0;
    ASSERT_TRUE(dt >= 0.2 + RS_TCPSTORE_CANCEL_GRACE_S - 0.05 && dt < 0.2 + RS_TCPSTORE_CANCEL_GRACE_S + 0.5);
    ASSERT_TRUE(strstr(err.message, "no answer before the deadline") != NULL);
    rs_tcpstore_close(s);
    peer_join(&p);
}

/* "05 <n = 1> <len> <bytes>": torch's CHECK of one key, the key as hex (the "/" prefix included). */
static void check_frame(char *out, size_t cap, const char *wire_key) {
    size_t n = strlen(wire_key), off = 0;
    off += (size_t)snprintf(out + off, cap - off, "05 0100000000000000 %02zx00000000000000 ", n);
    for (size_t i = 0; i < n && off + 3 < cap; i++) off += (size_t)snprintf(out + off, cap - off, "%02x", wire_key[i]);
}

RS_TEST(tcpstore_unique_id_of_either_backend) {
    /* The keys: ProcessGroupNCCL's "0" of the backend store, nccl2's PrefixStore(G)
     * "nccl_storekey_0" (tcpstore.h); then the poll: a CHECK of each, in that order, until one is set. */
    char key[256];
    ASSERT_EQ(rs_c10d_nccl_id_key(key, sizeof key, "g0", RS_C10D_ID_LEGACY), RS_OK);
    ASSERT_STREQ(key, "g0/g0//cuda//0");
    ASSERT_EQ(rs_c10d_nccl_id_key(key, sizeof key, "g0", RS_C10D_ID_NCCL2), RS_OK);
    ASSERT_STREQ(key, "g0/g0//cuda//g0/nccl_storekey_0");
    ASSERT_EQ(rs_c10d_nccl_id_key(key, 20, "g0", RS_C10D_ID_NCCL2), RS_EINVAL);

    char chk_legacy[256], chk_nccl2[256];
    check_frame(chk_legacy, sizeof chk_legacy, "/g0/g0//cuda//0");
    check_frame(chk_nccl2, sizeof chk_nccl2, "/g0/g0//cuda//g0/nccl_storekey_0");
    static const char wait_n2[] = "06 0100000000000000 2000000000000000 2f67302f6730 2f2f63756461 2f2f "
                                  "67302f6e63636c5f73746f72656b65795f30";
    static const char get_n2[] = "03 2000000000000000 2f67302f6730 2f2f63756461 2f2f "
                                 "67302f6e63636c5f73746f72656b65795f30";
    static const char wait_legacy[] = "06 0100000000000000 0f00000000000000 2f67302f6730 2f2f63756461 2f2f30";
    static const char get_legacy[] = "03 0f00000000000000 2f67302f6730 2f2f63756461 2f2f30";
    char id_reply[2 * 8 + 2 * 128 + 2];
    snprintf(id_reply, sizeof id_reply, "8000000000000000");
    for (int i = 0; i < 128; i++) snprintf(id_reply + 16 + 2 * i, 3, "%02x", (i * 5 + 1) & 0xff);

    for (int flavor = 0; flavor < 2; flavor++) {
        /* two polls find nothing; the third finds the key of `flavor` */
        const peer_step nccl2_steps[] = {
            {P_READ, HELLO, 0}, {P_ECHO_NONCE, NULL, 0},
            {P_READ, chk_legacy, 0}, {P_WRITE, "01", 0}, {P_READ, chk_nccl2, 0}, {P_WRITE, "01", 0},
            {P_READ, chk_legacy, 0}, {P_WRITE, "01", 0}, {P_READ, chk_nccl2, 0}, {P_WRITE, "01", 0},
            {P_READ, chk_legacy, 0}, {P_WRITE, "01", 0}, {P_READ, chk_nccl2, 0}, {P_WRITE, "00", 0},
            {P_READ, wait_n2, 0}, {P_WRITE, "00", 0}, {P_READ, get_n2, 0}, {P_WRITE, id_reply, 0},
        };
        const peer_step legacy_steps[] = {
            {P_READ, HELLO, 0}, {P_ECHO_NONCE, NULL, 0},
            {P_READ, chk_legacy, 0}, {P_WRITE, "01", 0}, {P_READ, chk_nccl2, 0}, {P_WRITE, "01", 0},
            {P_READ, chk_legacy, 0}, {P_WRITE, "01", 0}, {P_READ, chk_nccl2, 0}, {P_WRITE, "01", 0},
            {P_READ, chk_legacy, 0}, {P_WRITE, "00", 0},
            {P_READ, wait_legacy, 0}, {P_WRITE, "00", 0}, {P_READ, get_legacy, 0}, {P_WRITE, id_reply, 0},
        };
        peer p;
        if (flavor == RS_C10D_ID_NCCL2) peer_start(&p, nccl2_steps, RS_ARRAY_LEN(nccl2_steps), 0);
        else peer_start(&p, legacy_steps, RS_ARRAY_LEN(legacy_steps), 0);
        rs_error err = {0};
        rs_tcpstore *s = NULL;
        ASSERT_EQ(rs_tcpstore_connect(&s, "127.0.0.1", p.port, rs_now_s() + 5, &err), RS_OK);
        uint8_t id[128];
        rs_c10d_id_flavor got = (rs_c10d_id_flavor)-1;
        double t0 = rs_now_s();
        int rc = rs_c10d_nccl_unique_id_either(s, "g0", id, &got, t0 + 10, 5, NULL, &err);
        if (rc != RS_OK) RS_TEST_FAIL("flavor %d: %s", flavor, err.message);
        double dt = rs_now_s() - t0;
        ASSERT_EQ((int)got, flavor);
        ASSERT_TRUE(dt >= 2 * RS_C10D_POLL_FAST_S - 0.002 && dt < 3); /* two poll intervals */
        for (int i = 0; i < 128; i++) ASSERT_EQ(id[i], (i * 5 + 1) & 0xff);
        rs_tcpstore_close(s);
        peer_join(&p);
    }

    /* cancelled: one poll, then RS_EBUSY; and the deadline names both keys */
    const peer_step once[] = {
        {P_READ, HELLO, 0}, {P_ECHO_NONCE, NULL, 0},
        {P_READ, chk_legacy, 0}, {P_WRITE, "01", 0}, {P_READ, chk_nccl2, 0}, {P_WRITE, "01", 0},
        {P_READ, chk_legacy, 0}, {P_WRITE, "01", 0}, {P_READ, chk_nccl2, 0}, {P_WRITE, "01", 0},
    };
    peer p;
    peer_start(&p, once, RS_ARRAY_LEN(once), 0);
    rs_error err = {0};
    rs_tcpstore *s = NULL;
    ASSERT_EQ(rs_tcpstore_connect(&s, "127.0.0.1", p.port, rs_now_s() + 5, &err), RS_OK);
    uint8_t id[128];
    rs_c10d_id_flavor got;
    volatile int cancel = 1;
    ASSERT_EQ(rs_c10d_nccl_unique_id_either(s, "g0", id, &got, rs_now_s() + 10, 5, &cancel, &err), RS_EBUSY);
    ASSERT_TRUE(strstr(err.message, "cancelled") != NULL);
    memset(&err, 0, sizeof err);
    double t0 = rs_now_s();
    ASSERT_EQ(rs_c10d_nccl_unique_id_either(s, "g0", id, &got, t0 + 0.01, 5, NULL, &err), RS_EBUSY);
    ASSERT_TRUE(rs_now_s() - t0 < 1);
    ASSERT_TRUE(strstr(err.message, "'/g0/g0//cuda//0'") && strstr(err.message, "'/g0/g0//cuda//g0/nccl_storekey_0'"));
    rs_tcpstore_close(s);
    peer_join(&p);
}

typedef struct interrupt_arg {
    rs_tcpstore *s;
    int rc;
    double seconds;
    rs_error err;
} interrupt_arg;

static void *check_forever(void *arg) {
    interrupt_arg *a = arg;
    const char *k = "k";
    bool all = false;
    double t0 = rs_now_s();
    a->rc = rs_tcpstore_check(a->s, &k, 1, &all, t0 + 30, &a->err);
    a->seconds = rs_now_s() - t0;
    return NULL;
}

RS_TEST(tcpstore_interrupt_ends_a_waiting_call) {
    /* a store that never answers the CHECK; another thread shuts the connection down */
    const peer_step steps[] = {{P_READ, HELLO, 0}, {P_ECHO_NONCE, NULL, 0}, {P_SLEEP, NULL, 1.0}};
    peer p;
    peer_start(&p, steps, RS_ARRAY_LEN(steps), 0);
    interrupt_arg a = {0};
    ASSERT_EQ(rs_tcpstore_connect(&a.s, "127.0.0.1", p.port, rs_now_s() + 5, &a.err), RS_OK);
    pthread_t t;
    pthread_create(&t, NULL, check_forever, &a);
    nap(0.2);
    rs_tcpstore_interrupt(a.s);
    pthread_join(t, NULL);
    ASSERT_EQ(a.rc, RS_EIO);
    ASSERT_TRUE(a.seconds >= 0.15 && a.seconds < 1.5);
    ASSERT_TRUE(strstr(a.err.message, "closed the connection") != NULL);
    int64_t v;
    ASSERT_EQ(rs_tcpstore_add(a.s, "n", 1, &v, rs_now_s() + 1, &a.err), RS_EIO); /* and every later call */
    rs_tcpstore_close(a.s);
    peer_join(&p);
}
