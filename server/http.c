/*
 * http.c — libmicrohttpd glue: routing, auth, body limits, and the suspend/resume round trip
 * through the engine (see http.h for the threads and the lifetime rules).
 *
 * MHD calls the access handler several times per request: once with the headers (routing, auth
 * and the Content-Length check happen there), once per piece of body, and once with no data when
 * the body is complete (the request is answered or submitted there). A suspended /generate is
 * resumed by the main thread when its job is done, and MHD calls the handler once more to queue
 * the answer. Errors found early are remembered and answered when the body is complete, so a
 * client that is still sending is not cut off mid-body (which would turn its 4xx into a reset),
 * except when it sent "Expect: 100-continue" and is waiting for permission to send: that one is
 * answered at once and never sends its body.
 */
#include "http.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "../protocol/errors.h"
#include "../protocol/generate.h"

typedef enum rs_http_state {
    RS_HTTP_STATE_STARTING = 0,
    RS_HTTP_STATE_READY,
    RS_HTTP_STATE_DRAINING,
} rs_http_state;

typedef enum rs_route {
    RS_ROUTE_NONE = 0,
    RS_ROUTE_HEALTH,
    RS_ROUTE_GENERATE,
} rs_route;

typedef struct rs_http_req rs_http_req;

struct rs_http {
    struct MHD_Daemon *daemon;
    uv_async_t async;               /* wakes the main loop: finished jobs to resume */
    rs_http_opts opts;
    char api_key[256];
    int port;
    atomic_ullong next_rid;

    pthread_mutex_t mu;             /* guards everything below and every req's pending/conn_alive */
    rs_http_state state;
    rs_engine *engine;              /* borrowed; NULL until READY */
    int in_flight;                  /* admitted generate requests not yet freed */
    rs_http_req *done_head, *done_tail; /* finished jobs waiting for the main thread to resume them */
};

struct rs_http_req {
    rs_http *h;
    struct MHD_Connection *conn;
    rs_route route;
    double t_arrival;

    /* an answer decided before the body was complete (or an engine refusal) */
    bool failed;
    rs_error error;
    const char *extra_header, *extra_value; /* static strings: Allow, Retry-After, WWW-Authenticate */

    char *body;                     /* [n] (cap allocated) */
    size_t n, cap;

    rs_generate_req gen;            /* the parsed request; gen.job is lent to the engine while pending */
    bool counted;                   /* holds one of in_flight's slots */
    bool done;                      /* the engine has finished the job (or refused it) */
    /* under h->mu */
    bool pending;                   /* the job is in the engine or on the completion list */
    bool conn_alive;                /* MHD has not yet reported the request completed */
    rs_http_req *next_done;
};

/* ---------------------------------------------------------------- requests */

static rs_http_req *req_new(rs_http *h, struct MHD_Connection *conn) {
    rs_http_req *r = rs_xcalloc(1, sizeof *r);
    r->h = h;
    r->conn = conn;
    r->conn_alive = true;
    r->t_arrival = rs_now_s();
    return r;
}

static void req_free(rs_http_req *r) {
    rs_http *h = r->h;
    if (r->counted) {
        pthread_mutex_lock(&h->mu);
        h->in_flight--;
        pthread_mutex_unlock(&h->mu);
    }
    rs_generate_req_free(&r->gen);
    free(r->body);
    free(r);
}

static void req_fail(rs_http_req *r, int code, const char *message) {
    r->failed = true;
    rs_error_set(&r->error, code, NULL, "%s", message);
}

/* ---------------------------------------------------------------- answers */

/* Queues `body` (malloc'd; ownership passes to MHD, which frees it) with `status`. */
static enum MHD_Result send_json(rs_http_req *r, unsigned status, char *body, size_t len) {
    struct MHD_Response *resp;
    if (body) {
        resp = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
        if (!resp) free(body);
    } else { /* protocol/ ran out of memory writing the body */
        status = 500;
        resp = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
    }
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    if (r->extra_header) MHD_add_response_header(resp, r->extra_header, r->extra_value);
    enum MHD_Result ret = MHD_queue_response(r->conn, status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result send_error(rs_http_req *r, const rs_error *err) {
    int status = rs_err_http_status(err->code);
    /* /health is polled, and 503 while starting or draining is its normal answer */
    rs_log_level lvl = r->route == RS_ROUTE_HEALTH ? RS_LOG_LEVEL_DEBUG
                       : status >= 500 && err->code != RS_EBUSY ? RS_LOG_LEVEL_WARN : RS_LOG_LEVEL_INFO;
    rs_log(lvl, "http | %s | %d %s%s%s | %s", r->route == RS_ROUTE_GENERATE ? "generate" : "-", status,
           rs_err_type(err->code), err->param[0] ? " " : "", err->param, err->message);
    size_t len = 0;
    char *body = rs_error_body(err, &len);
    return send_json(r, (unsigned)status, body, len);
}

static enum MHD_Result send_generate(rs_http_req *r) {
    const rs_gen_job *job = r->gen.job;
    size_t len = 0;
    char *body = rs_generate_response(&r->gen, &len);
    if (!body) RS_ERROR("rid %s | out of memory writing the response", job->rid);
    RS_DEBUG("rid %s | 200 | %d prompt%s x n=%d | %zu bytes | %.3fs", job->rid, job->n_prompts,
             job->n_prompts == 1 ? "" : "s", job->sp.n, len, rs_now_s() - r->t_arrival);
    return send_json(r, 200, body, len);
}

/* ---------------------------------------------------------------- engine round trip */

/* Engine thread: must not block. */
static void on_job_done(rs_gen_job *job, void *user) {
    (void)job;
    rs_http_req *r = user;
    rs_http *h = r->h;
    pthread_mutex_lock(&h->mu);
    r->done = true;
    bool orphan = !r->conn_alive;
    if (orphan) {
        r->pending = false;
    } else {
        r->next_done = NULL;
        if (h->done_tail) h->done_tail->next_done = r;
        else h->done_head = r;
        h->done_tail = r;
    }
    pthread_mutex_unlock(&h->mu);
    if (orphan) req_free(r); /* the client left while its job ran */
    else uv_async_send(&h->async);
}

void rs_http_flush_completions(rs_http *h) {
    pthread_mutex_lock(&h->mu);
    rs_http_req *r = h->done_head;
    h->done_head = h->done_tail = NULL;
    for (rs_http_req *q = r; q; q = q->next_done) q->pending = false;
    pthread_mutex_unlock(&h->mu);
    /* A suspended connection cannot complete (MHD neither polls nor times it out), so each r is
     * alive until resumed; after MHD_resume_connection it belongs to MHD's threads. */
    while (r) {
        rs_http_req *next = r->next_done;
        MHD_resume_connection(r->conn);
        r = next;
    }
}

static void on_async(uv_async_t *a) { rs_http_flush_completions(a->data); }

static enum MHD_Result submit_generate(rs_http_req *r) {
    rs_http *h = r->h;
    rs_error err = {0};
    pthread_mutex_lock(&h->mu);
    rs_http_state state = h->state;
    rs_engine *e = h->engine;
    pthread_mutex_unlock(&h->mu);
    if (state != RS_HTTP_STATE_READY) {
        rs_error_set(&err, RS_EBUSY, NULL, state == RS_HTTP_STATE_STARTING ? "server is starting" : "server is shutting down");
        return send_error(r, &err);
    }

    int rc = rs_generate_parse(r->body, r->n, &r->gen, &err);
    if (rc != RS_OK) return send_error(r, &err);
    rs_gen_job *job = r->gen.job;
    if (!job->rid[0])
        snprintf(job->rid, sizeof job->rid, "req-%llu", (unsigned long long)atomic_fetch_add(&h->next_rid, 1));
    rc = rs_gen_job_validate(job, rs_engine_model_config(e), rs_engine_get_limits(e), &err);
    if (rc != RS_OK) return send_error(r, &err);
    free(r->body); /* the job holds everything now */
    r->body = NULL;
    r->n = r->cap = 0;

    pthread_mutex_lock(&h->mu);
    if (h->state != RS_HTTP_STATE_READY) {
        rc = rs_error_set(&err, RS_EBUSY, NULL, "server is shutting down");
    } else if (h->in_flight >= h->opts.max_waiting_requests) {
        rc = rs_error_set(&err, RS_EBUSY, NULL, "too many requests in flight (max-waiting-requests = %d); retry",
                          h->opts.max_waiting_requests);
        r->extra_header = MHD_HTTP_HEADER_RETRY_AFTER;
        r->extra_value = "1";
    } else {
        h->in_flight++;
        r->counted = true;
        r->pending = true;
    }
    pthread_mutex_unlock(&h->mu);
    if (rc != RS_OK) return send_error(r, &err);

    job->on_done = on_job_done;
    job->on_done_user = r;
    job->t_arrival = r->t_arrival;
    RS_DEBUG("rid %s | submit | %d prompt%s x n=%d", job->rid, job->n_prompts, job->n_prompts == 1 ? "" : "s",
             job->sp.n);
    /* Suspend before submitting: the job may finish, and be resumed, before submit returns. */
    MHD_suspend_connection(r->conn);
    rc = rs_engine_submit(e, job, &err);
    if (rc != RS_OK) { /* still ours: answer the refusal through the same resume path */
        r->failed = true;
        r->error = err;
        on_job_done(job, r);
    }
    return MHD_YES;
}

/* ---------------------------------------------------------------- the handler */

/* Compares the bearer token with the key in time that depends only on the key's length. */
static bool auth_ok(const char *header, const char *key) {
    if (!header || strncasecmp(header, "Bearer ", 7) != 0) return false;
    const char *tok = header + 7;
    while (*tok == ' ') tok++;
    size_t kl = strlen(key), tl = strlen(tok);
    unsigned char diff = kl != tl;
    for (size_t i = 0; i < kl; i++) diff |= (unsigned char)key[i] ^ (unsigned char)(i < tl ? tok[i] : 0);
    return diff == 0;
}

/* First call, headers only: route, method, auth, declared size. */
static void begin(rs_http_req *r, const char *url, const char *method) {
    rs_http *h = r->h;
    const char *allow;
    bool method_ok;
    if (strcmp(url, "/health") == 0) {
        r->route = RS_ROUTE_HEALTH;
        allow = "GET";
        method_ok = strcmp(method, "GET") == 0;
    } else if (strcmp(url, "/generate") == 0) {
        r->route = RS_ROUTE_GENERATE;
        allow = "POST, PUT";
        method_ok = strcmp(method, "POST") == 0 || strcmp(method, "PUT") == 0; /* SGLang takes both */
    } else {
        char msg[300];
        snprintf(msg, sizeof msg, "no route for %.16s %.256s", method, url);
        req_fail(r, RS_ENOTFOUND, msg);
        return;
    }
    if (!method_ok) {
        char msg[300];
        snprintf(msg, sizeof msg, "method %.16s is not allowed on %s (allowed: %s)", method, url, allow);
        req_fail(r, RS_EMETHOD, msg);
        r->extra_header = MHD_HTTP_HEADER_ALLOW;
        r->extra_value = allow;
        return;
    }
    if (r->route != RS_ROUTE_HEALTH && h->api_key[0] &&
        !auth_ok(MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION), h->api_key)) {
        req_fail(r, RS_EAUTH, "missing or wrong API key (send 'Authorization: Bearer <key>')");
        r->extra_header = MHD_HTTP_HEADER_WWW_AUTHENTICATE;
        r->extra_value = "Bearer";
        return;
    }
    const char *cl = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        char *end;
        unsigned long long n = strtoull(cl, &end, 10);
        if (end == cl || *end != '\0' || n > h->opts.max_body_bytes) {
            char msg[96];
            snprintf(msg, sizeof msg, "request body is larger than max-body-bytes (%zu)", h->opts.max_body_bytes);
            req_fail(r, RS_ETOOBIG, msg);
            return;
        }
        if (n > 0) { /* sized up front, but a claim is not bytes yet: past 1 MiB it grows as data comes */
            r->cap = RS_MIN((size_t)n, (size_t)1 << 20);
            r->body = rs_xmalloc(r->cap);
        }
    }
}

/* A piece of body: kept while under the limit, dropped once the request has failed. */
static void take_body(rs_http_req *r, const char *data, size_t size) {
    rs_http *h = r->h;
    if (r->failed) return;
    if (size > h->opts.max_body_bytes - r->n) {
        char msg[96];
        snprintf(msg, sizeof msg, "request body is larger than max-body-bytes (%zu)", h->opts.max_body_bytes);
        req_fail(r, RS_ETOOBIG, msg);
        free(r->body);
        r->body = NULL;
        r->n = r->cap = 0;
        return;
    }
    if (r->n + size > r->cap) {
        r->cap = RS_MIN(RS_MAX(r->cap * 2, r->n + size), h->opts.max_body_bytes);
        r->body = rs_xrealloc(r->body, r->cap);
    }
    memcpy(r->body + r->n, data, size);
    r->n += size;
}

static bool expects_continue(struct MHD_Connection *conn) {
    const char *v = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
    return v && strcasecmp(v, "100-continue") == 0;
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                 const char *version, const char *upload_data, size_t *upload_data_size,
                                 void **con_cls) {
    (void)version;
    rs_http *h = cls;
    rs_http_req *r = *con_cls;
    if (!r) {
        r = req_new(h, conn);
        *con_cls = r;
        begin(r, url, method);
        if (r->failed && expects_continue(conn)) return send_error(r, &r->error);
        return MHD_YES;
    }
    if (*upload_data_size > 0) {
        take_body(r, upload_data, *upload_data_size);
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (r->done) return r->failed ? send_error(r, &r->error) : send_generate(r); /* resumed */
    if (r->failed) return send_error(r, &r->error);
    if (r->route == RS_ROUTE_GENERATE) return submit_generate(r);

    pthread_mutex_lock(&h->mu);
    rs_http_state state = h->state;
    pthread_mutex_unlock(&h->mu);
    if (state != RS_HTTP_STATE_READY) {
        rs_error err;
        rs_error_set(&err, RS_EBUSY, NULL, state == RS_HTTP_STATE_STARTING ? "server is starting" : "server is shutting down");
        return send_error(r, &err);
    }
    size_t len = 0;
    char *body = rs_health_body(&len);
    return send_json(r, 200, body, len);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)conn;
    rs_http *h = cls;
    rs_http_req *r = *con_cls;
    if (!r) return;
    *con_cls = NULL;
    pthread_mutex_lock(&h->mu);
    r->conn_alive = false;
    bool free_now = !r->pending;
    pthread_mutex_unlock(&h->mu);
    if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK && r->route == RS_ROUTE_GENERATE)
        RS_INFO("http | generate | %s%s | connection ended before the answer was sent (code %d)",
                r->gen.job ? "rid " : "", r->gen.job ? r->gen.job->rid : "", (int)toe);
    if (free_now) req_free(r);
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = '\0';
    RS_WARN("microhttpd | %s", line);
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

int rs_http_start(rs_http **out, const rs_http_opts *opts, uv_loop_t *loop, rs_error *err) {
    struct sockaddr_storage ss;
    socklen_t ss_len;
    int rc = resolve(opts->host, opts->port, &ss, &ss_len, err);
    if (rc != RS_OK) return rc;

    rs_http *h = rs_xcalloc(1, sizeof *h);
    h->opts = *opts;
    snprintf(h->api_key, sizeof h->api_key, "%s", opts->api_key ? opts->api_key : "");
    h->opts.api_key = h->api_key;
    h->opts.host = NULL; /* borrowed, not needed past here */
    atomic_init(&h->next_rid, 0);
    pthread_mutex_init(&h->mu, NULL);
    h->state = RS_HTTP_STATE_STARTING;

    unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    if (ss.ss_family == AF_INET6) flags |= MHD_USE_IPv6;
    h->daemon = MHD_start_daemon(flags, (uint16_t)opts->port, NULL, NULL, on_access, h,
                                 MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h,
                                 MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                                 MHD_OPTION_THREAD_POOL_SIZE, (unsigned)2,
                                 MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(256 * 1024),
                                 /* trainers open a connection per in-flight request */
                                 MHD_OPTION_CONNECTION_LIMIT, (unsigned)RS_MAX(1024, opts->max_waiting_requests + 256),
                                 MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
                                 MHD_OPTION_END);
    if (!h->daemon) {
        rs_error_set(err, RS_EIO, "port", "cannot listen on %s port %d (in use, or not a local address?)",
                     opts->host, opts->port);
        pthread_mutex_destroy(&h->mu);
        free(h);
        return RS_EIO;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->daemon, MHD_DAEMON_INFO_BIND_PORT);
    h->port = info ? info->port : opts->port;
    uv_async_init(loop, &h->async, on_async);
    h->async.data = h;
    *out = h;
    return RS_OK;
}

int rs_http_port(const rs_http *h) { return h->port; }

void rs_http_set_engine(rs_http *h, rs_engine *e) {
    pthread_mutex_lock(&h->mu);
    h->engine = e;
    h->state = RS_HTTP_STATE_READY;
    pthread_mutex_unlock(&h->mu);
}

void rs_http_drain(rs_http *h) {
    pthread_mutex_lock(&h->mu);
    h->state = RS_HTTP_STATE_DRAINING;
    pthread_mutex_unlock(&h->mu);
}

int rs_http_in_flight(rs_http *h) {
    pthread_mutex_lock(&h->mu);
    int n = h->in_flight;
    pthread_mutex_unlock(&h->mu);
    return n;
}

static void on_async_closed(uv_handle_t *handle) {
    rs_http *h = handle->data;
    pthread_mutex_destroy(&h->mu);
    free(h);
}

void rs_http_close(rs_http *h) {
    rs_http_flush_completions(h); /* MHD refuses to stop with suspended connections */
    MHD_stop_daemon(h->daemon);   /* completes (and so frees) every remaining request */
    h->daemon = NULL;
    uv_close((uv_handle_t *)&h->async, on_async_closed);
}
