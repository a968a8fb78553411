/*
 * tcpstore_probe.c — talk to a torch.distributed TCPStore with rolloutd's client (sync/tcpstore.h):
 * to see what a trainer's rendezvous store holds, or to check that rolloutd can reach it.
 *
 *   build/tcpstore-probe [--timeout SECONDS] HOST PORT COMMAND...
 *
 * Commands run in order on one connection; each prints one JSON line ({"cmd", "ok", "seconds",
 * and "value" as hex, "int", "all_set", or "error", "http", "message"}). A failed command does not
 * stop the ones after it; the exit status is 1 if any failed. Each command has its own deadline,
 * --timeout seconds (default 10) from its start.
 *   join                     as the first command: connect as a rank > 0 (ADD "init/" 1)
 *   set KEY VALUE            VALUE is text, or hex:<bytes>
 *   get KEY | add KEY DELTA | check KEY[,KEY...] | wait KEY[,KEY...]
 *   cas KEY EXPECTED DESIRED
 *   mset N KEY VALUE ...     N pairs
 *   mget KEY[,KEY...]
 *   nccl-id GROUP [INDEX]    the ncclUniqueId ProcessGroupNCCL publishes for group GROUP
 *   nccl-id-any GROUP        the first id of group GROUP under either backend's key, as rolloutd
 *                            waits for it (polled); adds "flavor" (ProcessGroupNCCL or nccl2)
 *   sleep SECONDS
 * Without a command the probe only connects (VALIDATE, PING).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "../core/rs.h"
#include "../sync/tcpstore.h"

#define VALUE_CAP (1 << 20)

static uint8_t g_buf[RS_TCPSTORE_MULTI_MAX][4096];

static void usage(void) {
    fprintf(stderr, "usage: tcpstore-probe [--timeout SECONDS] HOST PORT "
                    "[join] [set K V | get K | add K N | check K,.. | wait K,.. | cas K E D | mset N K V .. | "
                    "mget K,.. | nccl-id GROUP [INDEX] | nccl-id-any GROUP | sleep S]...\n");
    exit(2);
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* VALUE as bytes into out (malloc'd). */
static size_t parse_value(const char *v, uint8_t **out) {
    size_t n = strlen(v);
    if (strncmp(v, "hex:", 4) != 0) {
        *out = (uint8_t *)rs_xmalloc(n + 1);
        memcpy(*out, v, n);
        return n;
    }
    v += 4;
    n = strlen(v) / 2;
    *out = (uint8_t *)rs_xmalloc(n + 1);
    for (size_t i = 0; i < n; i++) {
        int hi = hexval(v[2 * i]), lo = hexval(v[2 * i + 1]);
        if (hi < 0 || lo < 0) usage();
        (*out)[i] = (uint8_t)(hi << 4 | lo);
    }
    return n;
}

static json_t *hex(const uint8_t *p, size_t n) {
    char *s = rs_xmalloc(2 * n + 1);
    for (size_t i = 0; i < n; i++) snprintf(s + 2 * i, 3, "%02x", p[i]);
    json_t *j = json_string(s);
    free(s);
    return j;
}

/* Splits "a,b,c" in place into keys; returns the count. */
static int split_keys(char *list, const char **keys) {
    int n = 0;
    for (char *save = NULL, *k = strtok_r(list, ",", &save); k && n < RS_TCPSTORE_MULTI_MAX;
         k = strtok_r(NULL, ",", &save))
        keys[n++] = k;
    return n;
}

static void report(json_t *o, int rc, const rs_error *err, double t0, int *failed) {
    json_object_set_new(o, "ok", json_boolean(rc == RS_OK));
    json_object_set_new(o, "seconds", json_real(rs_now_s() - t0));
    if (rc != RS_OK) {
        json_object_set_new(o, "error", json_string(rs_err_name(rc)));
        json_object_set_new(o, "http", json_integer(rs_err_http_status(rc)));
        json_object_set_new(o, "message", json_string(err->message));
        *failed = 1;
    }
    char *s = json_dumps(o, JSON_COMPACT);
    printf("%s\n", s);
    fflush(stdout);
    free(s);
    json_decref(o);
}

/* Runs the command at argv[*i] (advancing *i past its arguments). */
static int run_one(rs_tcpstore *s, int argc, char **argv, int *i, double timeout, json_t *o, rs_error *err) {
    const char *cmd = argv[(*i)++];
    const double deadline = rs_now_s() + timeout;
#define ARG() (*i < argc ? argv[(*i)++] : (usage(), (char *)NULL))
    const char *keys[RS_TCPSTORE_MULTI_MAX];
    size_t n = 0;
    int rc;
    if (!strcmp(cmd, "set")) {
        const char *k = ARG();
        uint8_t *v;
        size_t vn = parse_value(ARG(), &v);
        rc = rs_tcpstore_set(s, k, v, vn, deadline, err);
        free(v);
    } else if (!strcmp(cmd, "get")) {
        if ((rc = rs_tcpstore_get(s, ARG(), g_buf[0], sizeof g_buf[0], &n, deadline, err)) == RS_OK)
            json_object_set_new(o, "value", hex(g_buf[0], n));
    } else if (!strcmp(cmd, "add")) {
        const char *k = ARG();
        int64_t v = 0;
        if ((rc = rs_tcpstore_add(s, k, strtoll(ARG(), NULL, 10), &v, deadline, err)) == RS_OK)
            json_object_set_new(o, "int", json_integer(v));
    } else if (!strcmp(cmd, "check") || !strcmp(cmd, "wait") || !strcmp(cmd, "mget")) {
        int nk = split_keys(ARG(), keys);
        if (!strcmp(cmd, "check")) {
            bool all = false;
            if ((rc = rs_tcpstore_check(s, keys, nk, &all, deadline, err)) == RS_OK)
                json_object_set_new(o, "all_set", json_boolean(all));
        } else if (!strcmp(cmd, "wait")) {
            rc = rs_tcpstore_wait(s, keys, nk, deadline, err);
        } else {
            void *bufs[RS_TCPSTORE_MULTI_MAX];
            size_t caps[RS_TCPSTORE_MULTI_MAX], lens[RS_TCPSTORE_MULTI_MAX];
            for (int k = 0; k < nk; k++) bufs[k] = g_buf[k], caps[k] = sizeof g_buf[k];
            if ((rc = rs_tcpstore_multi_get(s, keys, nk, bufs, caps, lens, deadline, err)) == RS_OK) {
                json_t *a = json_array();
                for (int k = 0; k < nk; k++) json_array_append_new(a, hex(g_buf[k], lens[k]));
                json_object_set_new(o, "value", a);
            }
        }
    } else if (!strcmp(cmd, "cas")) {
        const char *k = ARG();
        uint8_t *e, *d;
        size_t en = parse_value(ARG(), &e), dn = parse_value(ARG(), &d);
        if ((rc = rs_tcpstore_compare_set(s, k, e, en, d, dn, g_buf[0], sizeof g_buf[0], &n, deadline, err)) == RS_OK)
            json_object_set_new(o, "value", hex(g_buf[0], n));
        free(e);
        free(d);
    } else if (!strcmp(cmd, "mset")) {
        int np = atoi(ARG());
        if (np < 1 || np > RS_TCPSTORE_MULTI_MAX) usage();
        uint8_t *vals[RS_TCPSTORE_MULTI_MAX];
        size_t lens[RS_TCPSTORE_MULTI_MAX];
        for (int k = 0; k < np; k++) {
            keys[k] = ARG();
            lens[k] = parse_value(ARG(), &vals[k]);
        }
        rc = rs_tcpstore_multi_set(s, keys, (const void *const *)vals, lens, np, deadline, err);
        for (int k = 0; k < np; k++) free(vals[k]);
    } else if (!strcmp(cmd, "nccl-id")) {
        const char *g = ARG();
        uint64_t index = *i < argc && argv[*i][0] >= '0' && argv[*i][0] <= '9' ? strtoull(argv[(*i)++], NULL, 10) : 0;
        uint8_t id[RS_C10D_UNIQUE_ID_BYTES];
        if ((rc = rs_c10d_nccl_unique_id(s, g, index, id, deadline, err)) == RS_OK)
            json_object_set_new(o, "value", hex(id, sizeof id));
    } else if (!strcmp(cmd, "nccl-id-any")) {
        const char *g = ARG();
        uint8_t id[RS_C10D_UNIQUE_ID_BYTES];
        rs_c10d_id_flavor flavor;
        if ((rc = rs_c10d_nccl_unique_id_either(s, g, id, &flavor, deadline, timeout, NULL, err)) == RS_OK) {
            json_object_set_new(o, "value", hex(id, sizeof id));
            json_object_set_new(o, "flavor", json_string(rs_c10d_id_flavor_name(flavor)));
        }
    } else if (!strcmp(cmd, "sleep")) {
        double t = atof(ARG());
        struct timespec ts = {.tv_sec = (time_t)t, .tv_nsec = (long)((t - (double)(time_t)t) * 1e9)};
        nanosleep(&ts, NULL);
        rc = RS_OK;
    } else {
        usage();
        rc = RS_EINVAL;
    }
#undef ARG
    return rc;
}

int main(int argc, char **argv) {
    double timeout = 10.0;
    int i = 1;
    if (i + 1 < argc && !strcmp(argv[i], "--timeout")) {
        timeout = atof(argv[i + 1]);
        i += 2;
    }
    if (argc - i < 2) usage();
    const char *host = argv[i++];
    int port = atoi(argv[i++]);
    int failed = 0;
    rs_error err = {0};
    rs_tcpstore *s = NULL;

    const bool join = i < argc && !strcmp(argv[i], "join");
    json_t *o = json_pack("{s:s}", "cmd", join ? "join" : "connect");
    double t0 = rs_now_s();
    int64_t joined = 0;
    int rc = join ? rs_c10d_join(&s, host, port, &joined, t0 + timeout, &err)
                  : rs_tcpstore_connect(&s, host, port, t0 + timeout, &err);
    if (join) {
        i++;
        if (rc == RS_OK) json_object_set_new(o, "int", json_integer(joined));
    }
    report(o, rc, &err, t0, &failed);
    if (rc != RS_OK) return 1;
    while (i < argc) {
        o = json_pack("{s:s}", "cmd", argv[i]);
        memset(&err, 0, sizeof err);
        t0 = rs_now_s();
        rc = run_one(s, argc, argv, &i, timeout, o, &err);
        report(o, rc, &err, t0, &failed);
    }
    rs_tcpstore_close(s);
    return failed;
}
