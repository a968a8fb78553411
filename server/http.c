/*
 * http.c — libmicrohttpd glue: routing through the route table (routes.c), auth, body limits,
 * answers, the suspend/resume protocol, the disconnect scan and the server's lifecycle (see http.h
 * for the threads and the lifetime rules; the table's handlers, in http_gen.c, http_ops.c and
 * weights_routes.c, hold the routes' own logic).
 *
 * MHD calls the access handler several times per request: once with the headers (routing, auth
 * and the Content-Length check happen there), once per piece of body, and once with no data when
 * the body is complete (the request is answered or handed on there). A suspended request is
 * resumed when its work is done, and MHD calls the handler once more to queue the answer. Errors
 * found early are remembered and answered when the body is complete, so a client that is still
 * sending is not cut off mid-body (which would turn its 4xx into a reset), except when it sent
 * "Expect: 100-continue" and is waiting for permission to send: that one is answered at once and
 * never sends its body.
 *
 * What a client must get right before anything else, checked with the headers in this order, each
 * answered at once (the body is never read) and the connection closed:
 *   - a connection over max-connections or max-connections-per-ip (http_limits.c) gets 503 unless
 *     the request is GET /health or GET /metrics;
 *   - the body's length must be unambiguous (RFC 9112 §6), or a proxy in front and rolloutd could
 *     split the byte stream into different requests: two Content-Length headers that differ,
 *     Transfer-Encoding with Content-Length, Transfer-Encoding in HTTP/1.0, and any transfer coding
 *     but a lone "chunked" get 400. libmicrohttpd 0.9.75 itself reads the first Content-Length,
 *     ignores Content-Length under Transfer-Encoding, and reads a body whose coding is not
 *     "chunked" until the client closes (so "gzip, chunked" would hang): hence these checks.
 * Then, with --api-key, every request but GET /health and GET /metrics needs the key before its
 * path or method is looked at: without it, an unknown path and a wrong method get the same 401 as
 * a real route, so routes cannot be enumerated. 401 lines (and 503 lines of connections over the
 * caps) are logged at most once a second, with the count of those not logged.
 *
 * Memory. A body is read into a buffer that grows as bytes come (never sized by what
 * Content-Length claims beyond 1 MiB), charged to body-memory-budget; a body that would exceed it
 * is dropped at once and answered 503 when it ends. libmicrohttpd's idle timeout (http-idle-timeout)
 * closes a connection that stops sending its headers or body, or stops reading its answer, and
 * one idle between requests; suspended requests (waiting for the engine) are exempt.
 *
 * Suspending. A request is suspended by the MHD thread running it (rs_http_suspend) and resumed
 * by whichever thread makes it ready. The two meet under h->mu: the producer records the new state
 * (done, data, gone) and then resumes the request if it is marked suspended; the MHD thread
 * suspends, then marks it suspended only if it is not already ready (else resumes it itself). So
 * a wake-up is never lost and never doubled, and no MHD function is called under h->mu.
 */
#include "http.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../protocol/errors.h"
#include "http_internal.h"
#include "weights_routes.h"

/* ---------------------------------------------------------------- routes */

/* The path a request is logged under: the one it came in on (six weight routes share
 * RS_ROUTE_WEIGHTS, and a log line must say which one it was). */
static const char *req_path(const rs_http_req *r) { return r->def ? r->def->path : "(none)"; }

/* HEAD is allowed wherever GET is (RFC 9110 9.1; Starlette does the same for SGLang and vLLM):
 * the route answers as for GET and libmicrohttpd sends the headers only. */
static bool method_allowed(const char *allow, const char *method) {
    if (strcmp(method, MHD_HTTP_METHOD_HEAD) == 0) method = MHD_HTTP_METHOD_GET;
    size_t n = strlen(method);
    for (const char *p = allow; *p;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (len == n && strncmp(p, method, n) == 0) return true;
        if (!comma) break;
        p = comma + 1;
        while (*p == ' ') p++;
    }
    return false;
}

/* ---------------------------------------------------------------- locking and suspension */

void rs_http_lock(rs_http *h) { pthread_mutex_lock(&h->mu); }
void rs_http_unlock(rs_http *h) { pthread_mutex_unlock(&h->mu); }

bool rs_http_claim_resume_locked(rs_http_req *r) {
    if (!r->suspended) return false;
    r->suspended = false;
    return true;
}

/* Under h->mu: r has something for MHD to do (an answer, stream bytes, or an end). */
static bool ready_locked(const rs_http_req *r) {
    if (r->done || r->answer_now || r->client_gone) return true;
    return r->phase == RS_PHASE_STREAMING && (r->sse.len > r->sse_off || r->stream_end || r->stream_error);
}

void rs_http_suspend(rs_http_req *r) {
    rs_http *h = r->h;
    MHD_suspend_connection(r->conn);
    pthread_mutex_lock(&h->mu);
    bool go_on = ready_locked(r);
    if (!go_on) r->suspended = true;
    pthread_mutex_unlock(&h->mu);
    if (go_on) MHD_resume_connection(r->conn);
}

/* ---------------------------------------------------------------- requests */

static rs_http_req *req_new(rs_http *h, struct MHD_Connection *conn) {
    rs_http_req *r = rs_xcalloc(1, sizeof *r);
    r->h = h;
    r->conn = conn;
    r->fd = -1;
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci) r->fd = ci->connect_fd;
    r->in_mhd = true;
    r->t_arrival = rs_now_s();
    return r;
}

void rs_http_req_free(rs_http_req *r) {
    rs_http *h = r->h;
    pthread_mutex_lock(&h->mu);
    if (r->counted) h->in_flight--;
    if (r->live_prev) r->live_prev->live_next = r->live_next;
    else if (h->live == r) h->live = r->live_next;
    if (r->live_next) r->live_next->live_prev = r->live_prev;
    pthread_mutex_unlock(&h->mu);
    if (r->def && r->def->cleanup) r->def->cleanup(r);
    if (r->sse.len > r->sse_off) rs_http_budget_give(&h->lim.stream_bytes, r->sse.len - r->sse_off);
    rs_buf_free(&r->sse);
    rs_http_body_drop(r);
    free(r);
}

void rs_http_body_drop(rs_http_req *r) {
    free(r->body);
    if (r->cap) rs_http_budget_give(&r->h->lim.body_bytes, r->cap);
    r->body = NULL;
    r->n = r->cap = 0;
}

static void req_fail(rs_http_req *r, int code, const char *message) {
    r->failed = true;
    rs_error_set(&r->error, code, NULL, "%s", message);
}

/* ---------------------------------------------------------------- answers */

void rs_http_count(rs_http *h, rs_route route, unsigned status) {
    static const unsigned codes[] = {
#define RS_HTTP_CODE_VALUE(c) c,
        RS_HTTP_CODES(RS_HTTP_CODE_VALUE)
#undef RS_HTTP_CODE_VALUE
    };
    for (int i = 0; i < RS_HTTP_CODE_COUNT; i++) {
        if (codes[i] == status) {
            atomic_fetch_add_explicit(&h->responses[route][i], 1, memory_order_relaxed);
            return;
        }
    }
}

enum MHD_Result rs_http_send(rs_http_req *r, unsigned status, char *body, size_t len, const char *content_type) {
    struct MHD_Response *resp;
    if (body) {
        resp = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
        if (!resp) free(body);
    } else { /* protocol/ ran out of memory writing the body */
        status = 500;
        resp = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    }
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    if (r->extra_header) MHD_add_response_header(resp, r->extra_header, r->extra_value);
    if (r->close) MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result ret = MHD_queue_response(r->conn, status, resp);
    MHD_destroy_response(resp);
    rs_http_count(r->h, r->route, status);
    return ret;
}

enum MHD_Result rs_http_send_error(rs_http_req *r, const rs_error *err) {
    int status = rs_err_http_status(err->code);
    /* /health is polled, and 503 while starting or draining is its normal answer */
    rs_log_level lvl = r->route == RS_ROUTE_HEALTH || r->route == RS_ROUTE_METRICS ? RS_LOG_LEVEL_DEBUG
                       : status >= 500 && err->code != RS_EBUSY                      ? RS_LOG_LEVEL_WARN
                                                                                     : RS_LOG_LEVEL_INFO;
    /* a client may repeat these as fast as it likes: one line a second, with the count of the rest */
    int kind = err->code == RS_EAUTH ? RS_HTTP_LOG_AUTH : r->over_refused ? RS_HTTP_LOG_OVER : -1;
    unsigned long skipped = 0;
    if (kind < 0 || rs_http_log_allowed(&r->h->lim, (rs_http_log_kind)kind, &skipped)) {
        char more[64] = "";
        if (skipped) snprintf(more, sizeof more, " | %lu more like it not logged", skipped);
        rs_log(lvl, "http | %s | %d %s%s%s | %s%s", req_path(r), status, rs_err_type(err->code),
               err->param[0] ? " " : "", err->param, err->message, more);
    }
    size_t len = 0;
    char *body = rs_error_body(err, &len);
    return rs_http_send(r, (unsigned)status, body, len, "application/json");
}

rs_engine *rs_http_engine(rs_http *h, bool need_ready, rs_error *err) {
    pthread_mutex_lock(&h->mu);
    rs_http_state state = h->state;
    rs_engine *e = h->engine;
    pthread_mutex_unlock(&h->mu);
    if (e && (state == RS_HTTP_STATE_READY || !need_ready)) return e;
    rs_error_set(err, RS_EBUSY, NULL, state == RS_HTTP_STATE_STARTING ? "server is starting" : "server is shutting down");
    return NULL;
}

/* ---------------------------------------------------------------- the handler */

/* Compares the bearer token with the key in time that depends only on the key's length (every
 * byte of the key is compared whatever the token holds, and the accumulator is volatile so the
 * compiler cannot stop at the first difference). */
static bool auth_ok(const char *header, const char *key) {
    if (!header || strncasecmp(header, "Bearer ", 7) != 0) return false;
    const char *tok = header + 7;
    while (*tok == ' ' || *tok == '\t') tok++;
    size_t kl = strlen(key), tl = strlen(tok);
    while (tl > 0 && (tok[tl - 1] == ' ' || tok[tl - 1] == '\t')) tl--; /* RFC 9110 5.5: not part of the value */
    volatile unsigned char diff = kl != tl;
    for (size_t i = 0; i < kl; i++) diff |= (unsigned char)key[i] ^ (unsigned char)(i < tl ? tok[i] : 0);
    return diff == 0;
}

/* The URI's and its arguments' %HH escapes, decoded as libmicrohttpd does, except in a string that
 * holds "%00": decoded, the NUL would end the path for every strcmp after it ("/health%00/x" served
 * as /health), so such a string stays as it came, and matches no route. */
static size_t unescape(void *cls, struct MHD_Connection *c, char *s) {
    (void)cls, (void)c;
    return strstr(s, "%00") ? strlen(s) : MHD_http_unescape(s);
}

/* ---------------------------------------------------------------- framing */

/* The header fields that begin() checks, gathered in one walk over the headers. */
typedef struct head_fields {
    int n_cl, n_te;
    const char *cl;             /* the first Content-Length value (MHD's) */
    bool cl_differ;             /* a later one differs from it */
    char te[256];               /* every Transfer-Encoding value, joined with ", " */
    bool te_long;
    int n_host;
    const char *host;           /* the first Host value */
} head_fields;

static enum MHD_Result scan_header(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    (void)kind;
    head_fields *f = cls;
    if (!value) value = "";
    if (strcasecmp(key, MHD_HTTP_HEADER_HOST) == 0) {
        if (f->n_host++ == 0) f->host = value;
    } else if (strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH) == 0) {
        if (f->n_cl++ == 0) f->cl = value;
        else if (strcmp(f->cl, value) != 0) f->cl_differ = true;
    } else if (strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING) == 0) {
        size_t len = strlen(f->te);
        int k = snprintf(f->te + len, sizeof f->te - len, "%s%s", f->n_te++ ? ", " : "", value);
        if (k < 0 || (size_t)k >= sizeof f->te - len) f->te_long = true;
    }
    return MHD_YES;
}

/* RS_OK when the body's length is unambiguous and rolloutd reads its framing: at most one
 * Content-Length value, or one Transfer-Encoding header whose value is exactly "chunked" (HTTP/1.1).
 * Otherwise err says why. */
static int check_framing(const head_fields *f, const char *version, rs_error *err) {
    if (f->cl_differ)
        return rs_error_set(err, RS_EINVAL, NULL, "two Content-Length headers with different values");
    if (f->n_te == 0) return RS_OK;
    if (f->n_cl)
        return rs_error_set(err, RS_EINVAL, NULL,
                            "Transfer-Encoding together with Content-Length: send one of them");
    if (version && strcmp(version, MHD_HTTP_VERSION_1_0) == 0)
        return rs_error_set(err, RS_EINVAL, NULL, "Transfer-Encoding in an HTTP/1.0 request");
    if (f->te_long) return rs_error_set(err, RS_EINVAL, NULL, "Transfer-Encoding is too long");
    /* the codings, in the order applied; the body length is known only when chunked is last */
    const char *tok[8];
    size_t len[8];
    int n = 0;
    for (const char *p = f->te; *p;) {
        while (*p == ' ' || *p == '\t' || *p == ',') p++;
        const char *q = p;
        while (*q && *q != ',') q++;
        size_t m = (size_t)(q - p);
        while (m > 0 && (p[m - 1] == ' ' || p[m - 1] == '\t')) m--;
        if (m > 0) {
            if (n == (int)RS_ARRAY_LEN(tok))
                return rs_error_set(err, RS_EINVAL, NULL, "Transfer-Encoding lists too many codings");
            tok[n] = p;
            len[n++] = m;
        }
        p = q;
    }
    bool last_chunked = n > 0 && len[n - 1] == 7 && strncasecmp(tok[n - 1], "chunked", 7) == 0;
    if (!last_chunked)
        return rs_error_set(err, RS_EINVAL, NULL,
                            "Transfer-Encoding '%.64s' does not end with chunked: the body length cannot be "
                            "determined", f->te);
    for (int i = 0; i < n - 1; i++)
        if (len[i] == 7 && strncasecmp(tok[i], "chunked", 7) == 0)
            return rs_error_set(err, RS_EINVAL, NULL, "Transfer-Encoding applies chunked more than once");
    if (n > 1)
        return rs_error_set(err, RS_EUNSUPPORTED, NULL,
                            "transfer coding '%.*s' is not supported: send the body with Content-Length, or with "
                            "Transfer-Encoding: chunked alone", (int)RS_MIN(len[0], (size_t)32), tok[0]);
    /* libmicrohttpd reads a chunked body only when the one header's whole value is "chunked" (any
     * case): "chunked," or "chunked " or a second header would leave it reading to the close */
    if (f->n_te != 1 || strcasecmp(f->te, "chunked") != 0)
        return rs_error_set(err, RS_EINVAL, NULL,
                            "Transfer-Encoding must be exactly 'chunked' (one header, nothing around it), got "
                            "'%.64s'", f->te);
    return RS_OK;
}

/* ---------------------------------------------------------------- who a request is for, and from */

/* RFC 3986 authority characters, as a Host value may hold them (host, port, IPv6 brackets). */
static bool host_chars_ok(const char *v) {
    for (const unsigned char *p = (const unsigned char *)v; *p; p++)
        if (!(isalnum(*p) || strchr("-._~%!$&'()*+,;=:[]", *p))) return false;
    return true;
}

/* The host part of a Host value or an origin's authority, without the port and brackets, into out;
 * false when it does not parse. */
static bool host_name(const char *v, size_t n, char *out, size_t cap) {
    const char *end = v + n;
    if (n > 0 && v[0] == '[') {
        const char *rb = memchr(v, ']', n);
        if (!rb || (rb + 1 < end && rb[1] != ':')) return false;
        v++, end = rb;
    } else {
        const char *colon = memchr(v, ':', n);
        if (colon) end = colon;
    }
    size_t m = (size_t)(end - v);
    if (m == 0 || m >= cap) return false;
    memcpy(out, v, m);
    out[m] = '\0';
    return true;
}

/* A name that reaches only this machine: localhost, *.localhost, or an IP address literal (which
 * no DNS answer can rebind). */
static bool local_name(char *name) {
    size_t n = strlen(name);
    if (n > 1 && name[n - 1] == '.') name[--n] = '\0'; /* "localhost." is the absolute form (RFC 6761) */
    if (strcasecmp(name, "localhost") == 0 || (n > 10 && strcasecmp(name + n - 10, ".localhost") == 0)) return true;
    unsigned char a[16];
    return inet_pton(AF_INET, name, a) == 1 || inet_pton(AF_INET6, name, a) == 1;
}

/* RS_OK for a request addressed as HTTP wants (RFC 9112 3.2: HTTP/1.1 carries exactly one valid
 * Host) and, when rolloutd listens on a loopback address, addressed to a loopback name: a page
 * whose DNS name is rebound to 127.0.0.1 sends its own name as Host, so this keeps a browser
 * from reaching a daemon it could not otherwise (Ollama's CVE-2024-28224). A browser's
 * cross-origin request (an Origin header naming another host than Host) is refused too: rolloutd
 * serves no page, answers no CORS preflight, and a cross-site form post must not pause, flush or
 * use it (CSRF). Otherwise err says why. */
static int check_addressing(const rs_http *h, const head_fields *f, struct MHD_Connection *conn,
                            const char *version, rs_error *err) {
    if (f->n_host > 1) return rs_error_set(err, RS_EINVAL, NULL, "more than one Host header");
    bool http11 = version && strcmp(version, MHD_HTTP_VERSION_1_0) != 0;
    if (f->n_host == 0 && http11) return rs_error_set(err, RS_EINVAL, NULL, "an HTTP/1.1 request needs a Host header");
    if (f->n_host == 1 && !host_chars_ok(f->host))
        return rs_error_set(err, RS_EINVAL, NULL, "the Host header is not a host[:port]");
    char name[256];
    if (h->loopback && f->n_host == 1 && f->host[0] &&
        (!host_name(f->host, strlen(f->host), name, sizeof name) || !local_name(name)))
        return rs_error_set(err, RS_EFORBIDDEN, NULL,
                            "Host '%.64s' is not a loopback name: rolloutd listens on a loopback address and answers "
                            "requests addressed to localhost or an IP address only (a guard against DNS "
                            "rebinding); use http://127.0.0.1:%d, or --host to listen on another address",
                            f->host, h->port);
    const char *origin = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Origin");
    if (origin) {
        const char *auth = strstr(origin, "://");
        auth = auth ? auth + 3 : NULL;
        size_t an = auth ? strcspn(auth, "/") : 0;
        bool same = auth && f->n_host == 1 && an == strlen(f->host) && strncasecmp(auth, f->host, an) == 0;
        if (!same)
            return rs_error_set(err, RS_EFORBIDDEN, NULL,
                                "cross-origin request from '%.64s' refused: rolloutd serves no browser page of another "
                                "origin (a guard against cross-site requests)", origin);
    }
    return RS_OK;
}

/* The media type of a body: JSON (application/json, or a +json type) or none given, as FastAPI
 * reads a body as JSON (SGLang, vLLM); the body in identity coding. Otherwise err says why: a
 * browser sends a cross-site form as text/plain or a form type without asking first, and a coded
 * body is not the JSON it would be read as. */
static int check_media(struct MHD_Connection *conn, rs_error *err) {
    const char *ce = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_ENCODING);
    if (ce && strcasecmp(ce, "identity") != 0)
        return rs_error_set(err, RS_EMEDIA, NULL, "Content-Encoding '%.32s' is not supported: send the body unencoded",
                            ce);
    const char *ct = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
    if (!ct) return RS_OK;
    size_t n = strcspn(ct, ";");
    while (n > 0 && (ct[n - 1] == ' ' || ct[n - 1] == '\t')) n--;
    const size_t tl = sizeof "application/" - 1; /* type and slash */
    const char *sub = ct + tl;                     /* the subtype: json, or x+json */
    const size_t sl = n > tl ? n - tl : 0;
    bool json = n > tl && strncasecmp(ct, "application/", tl) == 0 &&
                ((sl == 4 && strncasecmp(sub, "json", 4) == 0) || (sl > 5 && strncasecmp(sub + sl - 5, "+json", 5) == 0));
    if (!json)
        return rs_error_set(err, RS_EMEDIA, NULL,
                            "Content-Type '%.64s' is not JSON: send Content-Type: application/json (curl: --json, "
                            "or -H 'Content-Type: application/json')", ct);
    return RS_OK;
}

/* ---------------------------------------------------------------- reading a request */

static void refuse_body_memory(rs_http_req *r) {
    rs_http *h = r->h;
    rs_error_set(&r->error, RS_EBUSY, NULL,
                 "request bodies held in memory have reached body-memory-budget (%zu bytes); retry",
                 h->opts.body_memory_budget);
    r->failed = true;
    r->extra_header = MHD_HTTP_HEADER_RETRY_AFTER;
    r->extra_value = "1";
}

/* First call, headers only: connection caps, framing, auth, route, method, declared size. */
static void begin(rs_http_req *r, const char *url, const char *method, const char *version) {
    rs_http *h = r->h;
    const rs_route_def *def = rs_route_find(url);
    if (def) {
        r->def = def;
        r->route = def->id;
    }
    /* GET /health and GET /metrics: open without the key, and served from the connection reserve */
    const bool open = def && def->open && method_allowed(def->allow, method);
    if (rs_http_conn_over(r->conn)) {
        r->close = true;
        if (!open) {
            rs_error_set(&r->error, RS_EBUSY, NULL,
                         "too many connections (max-connections %d, max-connections-per-ip %d); retry",
                         h->opts.max_connections, h->opts.max_connections_per_ip);
            r->failed = r->answer_early = r->over_refused = true;
            r->extra_header = MHD_HTTP_HEADER_RETRY_AFTER;
            r->extra_value = "1";
            return;
        }
    }
    head_fields hf = {0};
    MHD_get_connection_values(r->conn, MHD_HEADER_KIND, scan_header, &hf);
    if (check_framing(&hf, version, &r->error) != RS_OK) {
        r->failed = r->answer_early = r->close = true;
        return;
    }
    if (check_addressing(h, &hf, r->conn, version, &r->error) != RS_OK) {
        r->failed = r->answer_early = true;
        return;
    }
    if (!open && h->api_key[0] &&
        !auth_ok(MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION), h->api_key)) {
        req_fail(r, RS_EAUTH, "missing or wrong API key (send 'Authorization: Bearer <key>')");
        r->extra_header = MHD_HTTP_HEADER_WWW_AUTHENTICATE;
        r->extra_value = "Bearer";
        return;
    }
    if (!def) {
        char msg[300];
        snprintf(msg, sizeof msg, "no route for %.16s %.256s", method, url);
        req_fail(r, RS_ENOTFOUND, msg);
        return;
    }
    if (!method_allowed(def->allow, method)) {
        char msg[300];
        snprintf(msg, sizeof msg, "method %.16s is not allowed on %s (allowed: %s)", method, url, def->allow);
        req_fail(r, RS_EMETHOD, msg);
        r->extra_header = MHD_HTTP_HEADER_ALLOW;
        r->extra_value = strcmp(def->allow, "GET") == 0         ? "GET, HEAD"
                         : strcmp(def->allow, "GET, POST") == 0 ? "GET, HEAD, POST"
                                                                : def->allow;
        return;
    }
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0 &&
        check_media(r->conn, &r->error) != RS_OK) {
        r->failed = r->answer_early = true;
        return;
    }
    const char *cl = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        char *end;
        errno = 0;
        unsigned long long n = strtoull(cl, &end, 10);
        if (end == cl || *end != '\0' || errno == ERANGE || n > h->opts.max_body_bytes) {
            char msg[96];
            snprintf(msg, sizeof msg, "request body is larger than max-body-bytes (%zu)", h->opts.max_body_bytes);
            req_fail(r, RS_ETOOBIG, msg);
            return;
        }
        if (n > 0) { /* sized up front, but a claim is not bytes yet: past 1 MiB it grows as data comes */
            size_t cap = RS_MIN((size_t)n, (size_t)1 << 20);
            if (!rs_http_budget_take(&h->lim.body_bytes, h->opts.body_memory_budget, cap)) {
                refuse_body_memory(r);
                return;
            }
            r->cap = cap;
            r->body = rs_xmalloc(r->cap);
        }
    }
}

/* A piece of body: kept while under the limits, dropped once the request has failed. */
static void take_body(rs_http_req *r, const char *data, size_t size) {
    rs_http *h = r->h;
    if (r->failed) return;
    if (size > h->opts.max_body_bytes - r->n) {
        char msg[96];
        snprintf(msg, sizeof msg, "request body is larger than max-body-bytes (%zu)", h->opts.max_body_bytes);
        req_fail(r, RS_ETOOBIG, msg);
        rs_http_body_drop(r);
        return;
    }
    if (r->n + size > r->cap) {
        size_t cap = RS_MIN(RS_MAX(r->cap * 2, r->n + size), h->opts.max_body_bytes);
        if (!rs_http_budget_take(&h->lim.body_bytes, h->opts.body_memory_budget, cap - r->cap)) {
            rs_http_body_drop(r); /* its memory goes back at once; the answer waits for the body's end */
            refuse_body_memory(r);
            return;
        }
        r->cap = cap;
        r->body = rs_xrealloc(r->body, r->cap);
    }
    memcpy(r->body + r->n, data, size);
    r->n += size;
}

static bool expects_continue(struct MHD_Connection *conn) {
    const char *v = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
    return v && strcasecmp(v, "100-continue") == 0;
}

/* The handler is called again after a resume: the answer is ready, or the client is gone. */
static enum MHD_Result resumed(rs_http_req *r) {
    rs_http *h = r->h;
    pthread_mutex_lock(&h->mu);
    bool done = r->done, now = r->answer_now, gone = r->client_gone;
    pthread_mutex_unlock(&h->mu);
    if (now) return rs_http_send_error(r, &r->error); /* a probe past its deadline, done or not */
    if (done) {
        if (r->failed) return rs_http_send_error(r, &r->error);
        RS_ASSERT(r->def && r->def->answer); /* only routes with an answer stage suspend */
        return r->def->answer(r);
    }
    RS_ASSERT(gone); /* nothing else resumes a waiting request */
    return MHD_NO;   /* closes the connection */
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                 const char *version, const char *upload_data, size_t *upload_data_size,
                                 void **con_cls) {
    rs_http *h = cls;
    rs_http_req *r = *con_cls;
    if (!r) {
        r = req_new(h, conn);
        *con_cls = r;
        begin(r, url, method, version);
        if (r->failed && (r->answer_early || expects_continue(conn))) return rs_http_send_error(r, &r->error);
        return MHD_YES;
    }
    if (*upload_data_size > 0) {
        take_body(r, upload_data, *upload_data_size);
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (r->phase == RS_PHASE_WAITING) return resumed(r);
    if (r->failed) return rs_http_send_error(r, &r->error);
    return r->def->handle(r); /* a request without a route has failed in begin() */
}

/* A request ended (answered, or its connection closed). A job still running for it is aborted:
 * its client cannot receive the answer. Once in_mhd is false, the thread that ends the job frees
 * r (on_job_done and the like), possibly before the abort below is sent: what the abort and its
 * log line need is copied while the lock is held. */
static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls, enum MHD_RequestTerminationCode toe) {
    (void)conn;
    rs_http *h = cls;
    rs_http_req *r = *con_cls;
    if (!r) return;
    *con_cls = NULL;
    char rid[sizeof r->engine_rid];
    pthread_mutex_lock(&h->mu);
    r->in_mhd = false;
    bool abort = r->held && r->job && !r->done && !r->client_gone; /* the scan already aborted a gone one */
    rs_engine *e = h->engine;
    bool free_now = !r->held;
    const char *path = req_path(r); /* a route table's string, not r's */
    memcpy(rid, r->engine_rid, sizeof rid);
    pthread_mutex_unlock(&h->mu);
    if (abort) {
        if (toe == MHD_REQUEST_TERMINATED_TIMEOUT_REACHED)
            RS_INFO("http | %s | rid %s | the client took nothing for http-idle-timeout (%d s); aborting", path, rid,
                    h->opts.idle_timeout);
        else
            RS_INFO("http | %s | rid %s | the client left before the answer (code %d); aborting", path, rid,
                    (int)toe);
        if (e) rs_engine_abort(e, rid);
    }
    if (free_now) rs_http_req_free(r);
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = '\0';
    /* how MHD reports a client that left (its job is aborted) and the connections this module
     * ends on purpose (a client found gone, a stream cut): expected, so not warnings */
    static const char *const expected[] = {"Application reported internal error", "application error generating",
                                           "closed by remote peer", "Connection reset",
                                           "socket is no longer available for sending"};
    rs_log_level lvl = RS_LOG_LEVEL_WARN;
    for (size_t i = 0; i < RS_ARRAY_LEN(expected); i++)
        if (strstr(line, expected[i])) lvl = RS_LOG_LEVEL_DEBUG;
    rs_log(lvl, "microhttpd | %s", line);
}

/* ---------------------------------------------------------------- the disconnect scan */

/* True when the peer of a suspended connection has closed it (or reset it). Data waiting to be
 * read (a pipelined request) means it is still there. */
static bool peer_gone(int fd) {
    if (fd < 0) return false;
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) return false;
    if (n == 0) return true;
    return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

typedef struct scan_list {
    rs_http_req **resume;
    char (*abort)[128];
    int n_resume, n_abort, cap;
} scan_list;

static void scan_add(scan_list *l, rs_http_req *resume, const char *abort_rid) {
    if (l->n_resume == l->cap || l->n_abort == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 16;
        l->resume = rs_xrealloc(l->resume, sizeof *l->resume * (size_t)l->cap);
        l->abort = rs_xrealloc(l->abort, sizeof *l->abort * (size_t)l->cap);
    }
    if (resume) l->resume[l->n_resume++] = resume;
    if (abort_rid) snprintf(l->abort[l->n_abort++], sizeof l->abort[0], "%s", abort_rid);
}

static void on_scan(uv_timer_t *t) {
    rs_http *h = t->data;
    scan_list l = {0};
    double now = rs_now_s();
    pthread_mutex_lock(&h->mu);
    rs_engine *e = h->engine;
    for (rs_http_req *r = h->live; r; r = r->live_next) {
        bool running = r->held && !r->done;
        if (r->suspended && !r->client_gone && peer_gone(r->fd)) {
            r->client_gone = true;
            RS_INFO("http | %s | rid %s | the client closed its connection; aborting", req_path(r),
                    r->engine_rid);
            scan_add(&l, rs_http_claim_resume_locked(r) ? r : NULL, running ? r->engine_rid : NULL);
        } else if (r->route == RS_ROUTE_HEALTH_GENERATE && running && !r->answer_now && now > r->deadline) {
            r->answer_now = true;
            rs_engine_stats st = {0};
            if (e) rs_engine_get_stats(e, &st); /* its lock is a leaf: fine under h->mu */
            rs_error_set(&r->error, RS_EBUSY, NULL, "the health probe did not finish within %gs%s",
                         h->info.cfg ? h->info.cfg->health_generate_timeout : 0.0,
                         st.paused ? " (generation is paused)" : "");
            scan_add(&l, rs_http_claim_resume_locked(r) ? r : NULL, r->engine_rid);
        }
    }
    pthread_mutex_unlock(&h->mu);
    for (int i = 0; e && i < l.n_abort; i++) rs_engine_abort(e, l.abort[i]);
    /* each of these is still suspended (its resume is ours), so it is still alive */
    for (int i = 0; i < l.n_resume; i++) MHD_resume_connection(l.resume[i]->conn);
    free(l.resume);
    free(l.abort);
}

/* ---------------------------------------------------------------- lifecycle */

static int resolve(const char *host, int port, struct sockaddr_storage *ss, socklen_t *len, rs_error *err) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV}, *res = NULL;
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", port);
    int g = getaddrinfo(host, port_s, &hints, &res);
    if (g != 0 || !res)
        return rs_error_set(err, RS_EINVAL, "host", "cannot resolve host '%s': %s", host, gai_strerror(g));
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *len = res->ai_addrlen;
    freeaddrinfo(res);
    return RS_OK;
}

/* The settings that bound one another. */
static int check_opts(const rs_http_opts *o, rs_error *err) {
    if (o->body_memory_budget < o->max_body_bytes)
        return rs_error_set(err, RS_EINVAL, "body-memory-budget",
                            "body-memory-budget (%zu) must be at least max-body-bytes (%zu): the largest body "
                            "allowed must fit", o->body_memory_budget, o->max_body_bytes);
    if (o->max_stream_buffer > o->stream_memory_budget)
        return rs_error_set(err, RS_EINVAL, "max-stream-buffer",
                            "max-stream-buffer (%zu) must be at most stream-memory-budget (%zu)",
                            o->max_stream_buffer, o->stream_memory_budget);
    if (o->max_connections_per_ip < o->max_waiting_requests)
        RS_WARN("max-connections-per-ip %d is below max-waiting-requests %d: a trainer on one host cannot hold "
                "that many requests in flight", o->max_connections_per_ip, o->max_waiting_requests);
    return RS_OK;
}

int rs_http_start(rs_http **out, const rs_http_opts *opts, uv_loop_t *loop, rs_error *err) {
    int rc = check_opts(opts, err);
    if (rc != RS_OK) return rc;
    struct sockaddr_storage ss;
    socklen_t ss_len;
    if ((rc = resolve(opts->host, opts->port, &ss, &ss_len, err)) != RS_OK) return rc;

    rs_http *h = rs_xcalloc(1, sizeof *h);
    h->opts = *opts;
    snprintf(h->api_key, sizeof h->api_key, "%s", opts->api_key ? opts->api_key : "");
    h->opts.api_key = h->api_key;
    h->opts.host = NULL; /* borrowed, not needed past here */
    if (ss.ss_family == AF_INET) {
        h->loopback = (ntohl(((struct sockaddr_in *)&ss)->sin_addr.s_addr) >> 24) == 127;
    } else if (ss.ss_family == AF_INET6) {
        const struct in6_addr *a = &((struct sockaddr_in6 *)&ss)->sin6_addr;
        h->loopback = IN6_IS_ADDR_LOOPBACK(a) || (IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127);
    }
    atomic_init(&h->next_rid, 0);
    atomic_init(&h->next_job, 0);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    h->start_time_unix = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
    atomic_init(&h->seed_state, (unsigned long long)ts.tv_nsec ^ ((unsigned long long)ts.tv_sec << 20) ^
                                    ((unsigned long long)getpid() << 40));
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->ctl_cv, NULL);
    pthread_cond_init(&h->ctl_idle_cv, NULL);
    rs_http_limits_init(&h->lim);
    h->state = RS_HTTP_STATE_STARTING;

    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    unsigned threads = opts->threads > 0 ? (unsigned)opts->threads : (unsigned)(cores > 0 ? cores : 2);
    unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG | MHD_USE_TURBO;
    if (ss.ss_family == AF_INET6) flags |= MHD_USE_IPv6;
    h->daemon = MHD_start_daemon(flags, (uint16_t)opts->port, NULL, NULL, on_access, h,
                                 MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h,
                                 MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                                 MHD_OPTION_THREAD_POOL_SIZE, threads,
                                 MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(256 * 1024),
                                 MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)opts->idle_timeout,
                                 /* the hard limits: the soft ones (http_limits.c) plus the reserve */
                                 MHD_OPTION_CONNECTION_LIMIT, (unsigned)(opts->max_connections + RS_HTTP_CONN_RESERVE),
                                 MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                                 (unsigned)(opts->max_connections_per_ip + RS_HTTP_CONN_RESERVE),
                                 MHD_OPTION_NOTIFY_CONNECTION, rs_http_on_connection, h,
                                 MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
                                 MHD_OPTION_UNESCAPE_CALLBACK, unescape, NULL,
                                 MHD_OPTION_END);
    if (!h->daemon) {
        rs_error_set(err, RS_EIO, "port", "cannot listen on %s port %d (in use, or not a local address?)",
                     opts->host, opts->port);
        rs_http_limits_free(&h->lim);
        pthread_cond_destroy(&h->ctl_idle_cv);
        pthread_cond_destroy(&h->ctl_cv);
        pthread_mutex_destroy(&h->mu);
        free(h);
        return RS_EIO;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->daemon, MHD_DAEMON_INFO_BIND_PORT);
    h->port = info ? info->port : opts->port;
    rs_http_ctl_start(h);
    uv_timer_init(loop, &h->scan_timer);
    h->scan_timer.data = h;
    uv_timer_start(&h->scan_timer, on_scan, RS_HTTP_SCAN_MS, RS_HTTP_SCAN_MS);
    RS_INFO("http: %u worker thread%s", threads, threads == 1 ? "" : "s");
    *out = h;
    return RS_OK;
}

int rs_http_port(const rs_http *h) { return h->port; }

void rs_http_set_engine(rs_http *h, rs_engine *e, const rs_http_info *info) {
    pthread_mutex_lock(&h->mu);
    h->info = *info;
    snprintf(h->model_path, sizeof h->model_path, "%s", info->model_path ? info->model_path : "");
    snprintf(h->served_model_name, sizeof h->served_model_name, "%s",
             info->served_model_name ? info->served_model_name : "");
    snprintf(h->backend, sizeof h->backend, "%s", info->backend ? info->backend : "");
    h->info.model_path = h->model_path;
    h->info.served_model_name = h->served_model_name;
    h->info.backend = h->backend;
    h->engine = e;
    h->state = RS_HTTP_STATE_READY;
    pthread_mutex_unlock(&h->mu);
}

void rs_http_drain(rs_http *h) {
    pthread_mutex_lock(&h->mu);
    h->state = RS_HTTP_STATE_DRAINING;
    pthread_mutex_unlock(&h->mu);
}

void rs_http_detach_engine(rs_http *h) {
    pthread_mutex_lock(&h->mu);
    if (h->state == RS_HTTP_STATE_READY) h->state = RS_HTTP_STATE_DRAINING;
    h->engine = NULL;
    while (h->ctl_busy) pthread_cond_wait(&h->ctl_idle_cv, &h->mu);
    pthread_mutex_unlock(&h->mu);
}

int rs_http_in_flight(rs_http *h) {
    pthread_mutex_lock(&h->mu);
    int n = h->in_flight;
    pthread_mutex_unlock(&h->mu);
    return n;
}

static void on_timer_closed(uv_handle_t *handle) {
    rs_http *h = handle->data;
    rs_http_limits_free(&h->lim);
    pthread_cond_destroy(&h->ctl_idle_cv);
    pthread_cond_destroy(&h->ctl_cv);
    pthread_mutex_destroy(&h->mu);
    free(h);
}

void rs_http_close(rs_http *h) {
    rs_http_ctl_stop(h); /* answers what it still holds */
    uv_timer_stop(&h->scan_timer);
    /* MHD must not be stopped with suspended connections: end every one still waiting (their jobs
     * ended when the engine stopped, so this is only a connection whose last event is pending) */
    scan_list l = {0};
    pthread_mutex_lock(&h->mu);
    h->engine = NULL;
    for (rs_http_req *r = h->live; r; r = r->live_next) {
        r->client_gone = true;
        if (rs_http_claim_resume_locked(r)) scan_add(&l, r, NULL);
    }
    pthread_mutex_unlock(&h->mu);
    for (int i = 0; i < l.n_resume; i++) MHD_resume_connection(l.resume[i]->conn);
    free(l.resume);
    free(l.abort);
    MHD_stop_daemon(h->daemon); /* completes (and so frees) every remaining request */
    h->daemon = NULL;
    uv_close((uv_handle_t *)&h->scan_timer, on_timer_closed);
}
