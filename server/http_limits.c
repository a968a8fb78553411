/*
 * http_limits.c — what one client can hold of the server: connections (all together and per
 * client address, with a reserve that keeps /health and /metrics answering on a full server), the
 * memory of request bodies and of unsent stream bytes, and the log lines it can provoke at will.
 *
 * Connections. libmicrohttpd (MHD) has limits of its own, but at its global limit it stops
 * accepting, so further clients wait unanswered in the kernel's listen backlog, and above its
 * per-address limit it closes a new connection without a word. So this module counts connections
 * itself (MHD's connection notices) under soft limits below MHD's hard ones. A connection accepted
 * while max-connections are open, or while max-connections-per-ip are open from its address, is
 * "over": its first request is answered as soon as its headers are in, with a 503 (Retry-After: 1,
 * Connection: close) whatever the route, except GET /health and GET /metrics, which are served
 * (and the connection closed after). MHD's own limits sit RS_HTTP_CONN_RESERVE above the soft
 * ones: that reserve is where the over connections live, and each gets an idle timeout of at most
 * RS_HTTP_OVER_TIMEOUT_S, so connections that never finish a request cannot hold it for long.
 * Counting is at accept: a connection is over or not for its whole life.
 *
 * Memory. Request bodies are charged as their buffers grow (what is allocated, never what a
 * Content-Length claims) against body-memory-budget; a body whose next piece would not fit is
 * dropped at once and its request answered 503 when the body ends (http.c). Streamed bytes are
 * charged from the moment the engine thread produces them until MHD takes them, against
 * stream-memory-budget (http_gen.c cuts the stream that would exceed it, and aborts its job).
 * The budgets are atomic counters: a charge either fits whole or is refused, so the sum never
 * exceeds the budget, whatever the threads.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "http_internal.h"

/* ---------------------------------------------------------------- memory budgets */

bool rs_http_budget_take(atomic_size_t *used, size_t budget, size_t n) {
    size_t cur = atomic_load_explicit(used, memory_order_relaxed);
    do {
        if (cur > budget || n > budget - cur) return false;
    } while (!atomic_compare_exchange_weak_explicit(used, &cur, cur + n, memory_order_relaxed, memory_order_relaxed));
    return true;
}

void rs_http_budget_give(atomic_size_t *used, size_t n) {
    size_t before = atomic_fetch_sub_explicit(used, n, memory_order_relaxed);
    RS_ASSERT(before >= n); /* never more given back than taken */
}

/* ---------------------------------------------------------------- connections */

/* The client's address as 4 (IPv4, also when mapped into IPv6) or 16 bytes; 0 when it has none
 * (not an IP socket): such a connection counts only towards max-connections. */
static uint8_t client_addr(struct MHD_Connection *c, uint8_t out[16]) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (!ci || !ci->client_addr) return 0;
    const struct sockaddr *sa = ci->client_addr;
    if (sa->sa_family == AF_INET) {
        struct sockaddr_in in;
        memcpy(&in, sa, sizeof in);
        memcpy(out, &in.sin_addr, 4);
        return 4;
    }
    if (sa->sa_family == AF_INET6) {
        struct sockaddr_in6 in6;
        memcpy(&in6, sa, sizeof in6);
        if (IN6_IS_ADDR_V4MAPPED(&in6.sin6_addr)) {
            memcpy(out, in6.sin6_addr.s6_addr + 12, 4);
            return 4;
        }
        memcpy(out, in6.sin6_addr.s6_addr, 16);
        return 16;
    }
    return 0;
}

static size_t addr_bucket(const uint8_t *addr, uint8_t len) {
    uint32_t x = 2166136261u; /* FNV-1a */
    for (uint8_t i = 0; i < len; i++) x = (x ^ addr[i]) * 16777619u;
    return x & (RS_HTTP_IP_BUCKETS - 1);
}

/* Under L->mu: adds `delta` to the count of `addr` (an entry is made at the first connection and
 * dropped at the last) and returns the new count. */
static int addr_count_add(rs_http_limits *L, const uint8_t *addr, uint8_t len, int delta) {
    rs_http_addr_count **link = &L->buckets[addr_bucket(addr, len)];
    while (*link && !((*link)->len == len && memcmp((*link)->addr, addr, len) == 0)) link = &(*link)->next;
    rs_http_addr_count *a = *link;
    if (!a) {
        RS_ASSERT(delta > 0);
        a = rs_xcalloc(1, sizeof *a);
        memcpy(a->addr, addr, len);
        a->len = len;
        *link = a;
    }
    a->n += delta;
    RS_ASSERT(a->n >= 0);
    int n = a->n;
    if (n == 0) {
        *link = a->next;
        free(a);
    }
    return n;
}

void rs_http_on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                           enum MHD_ConnectionNotificationCode toe) {
    rs_http *h = cls;
    rs_http_limits *L = &h->lim;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        rs_http_conn *hc = rs_xcalloc(1, sizeof *hc);
        hc->addr_len = client_addr(c, hc->addr);
        pthread_mutex_lock(&L->mu);
        int from_addr = hc->addr_len ? addr_count_add(L, hc->addr, hc->addr_len, +1) : 0;
        L->n_conn++;
        hc->over = L->n_conn > h->opts.max_connections || from_addr > h->opts.max_connections_per_ip;
        pthread_mutex_unlock(&L->mu);
        *socket_context = hc;
        if (hc->over)
            MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT,
                                      (unsigned)RS_MIN(RS_HTTP_OVER_TIMEOUT_S, h->opts.idle_timeout));
        return;
    }
    rs_http_conn *hc = *socket_context;
    if (!hc) return;
    pthread_mutex_lock(&L->mu);
    L->n_conn--;
    if (hc->addr_len) addr_count_add(L, hc->addr, hc->addr_len, -1);
    pthread_mutex_unlock(&L->mu);
    free(hc);
    *socket_context = NULL;
}

bool rs_http_conn_over(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    const rs_http_conn *hc = ci ? ci->socket_context : NULL;
    return hc && hc->over;
}

void rs_http_limits_init(rs_http_limits *L) {
    memset(L, 0, sizeof *L);
    pthread_mutex_init(&L->mu, NULL);
    atomic_init(&L->body_bytes, 0);
    atomic_init(&L->stream_bytes, 0);
}

void rs_http_limits_free(rs_http_limits *L) {
    /* MHD reported every connection closed before this: nothing is counted any more */
    RS_ASSERT(L->n_conn == 0);
    for (size_t i = 0; i < RS_HTTP_IP_BUCKETS; i++) RS_ASSERT(!L->buckets[i]);
    RS_ASSERT(atomic_load(&L->body_bytes) == 0 && atomic_load(&L->stream_bytes) == 0);
    pthread_mutex_destroy(&L->mu);
}

/* ---------------------------------------------------------------- log lines */

bool rs_http_log_allowed(rs_http_limits *L, rs_http_log_kind kind, unsigned long *skipped) {
    double now = rs_now_s();
    pthread_mutex_lock(&L->mu);
    bool ok = now - L->log_last[kind] >= 1.0;
    if (ok) {
        *skipped = L->log_skipped[kind];
        L->log_skipped[kind] = 0;
        L->log_last[kind] = now;
    } else {
        L->log_skipped[kind]++;
    }
    pthread_mutex_unlock(&L->mu);
    return ok;
}
