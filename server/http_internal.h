/*
 * http_internal.h — the state shared by the HTTP modules: routes.c (the route table), http.c (MHD
 * glue, auth, answers, lifecycle, the disconnect scan), http_gen.c (generation and streaming),
 * http_ops.c (the operations routes and the control thread), weights_routes.c (weight updates) and
 * http_limits.c (connection caps, memory budgets, rate-limited log lines). Private to server/.
 */
#ifndef RS_HTTP_INTERNAL_H
#define RS_HTTP_INTERNAL_H

#include <microhttpd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "../protocol/generate.h"
#include "../protocol/openai.h"
#include "../protocol/openapi.h"
#include "../protocol/sse.h"
#include "http.h"

typedef enum rs_http_state {
    RS_HTTP_STATE_STARTING = 0,
    RS_HTTP_STATE_READY,
    RS_HTTP_STATE_DRAINING,
} rs_http_state;

/* Which route a request took, for the /metrics counters (a path and its SGLang alias share one). */
typedef enum rs_route {
    RS_ROUTE_NONE = 0,
    RS_ROUTE_HEALTH,
    RS_ROUTE_HEALTH_GENERATE,
    RS_ROUTE_GENERATE,
    RS_ROUTE_COMPLETIONS,
    RS_ROUTE_MODELS,
    RS_ROUTE_MODEL_INFO,
    RS_ROUTE_SERVER_INFO,
    RS_ROUTE_LOAD,
    RS_ROUTE_WEIGHT_VERSION,
    RS_ROUTE_METRICS,
    RS_ROUTE_ABORT,
    RS_ROUTE_PAUSE,
    RS_ROUTE_CONTINUE,
    RS_ROUTE_FLUSH,
    RS_ROUTE_TOKENIZE,
    RS_ROUTE_DETOKENIZE,
    RS_ROUTE_WEIGHTS,           /* every weight-update route: weights_routes.c */
    RS_ROUTE_OPENAPI,
    RS_ROUTE_COUNT
} rs_route;

/* Status codes counted for /metrics, by route. */
#define RS_HTTP_CODES(X) X(200) X(400) X(401) X(403) X(404) X(405) X(409) X(413) X(415) X(500) X(503)
enum {
#define RS_HTTP_CODE_ENUM(c) RS_HTTP_CODE_##c,
    RS_HTTP_CODES(RS_HTTP_CODE_ENUM)
#undef RS_HTTP_CODE_ENUM
    RS_HTTP_CODE_COUNT
};

typedef enum rs_phase {
    RS_PHASE_BODY = 0,          /* reading the request */
    RS_PHASE_WAITING,           /* submitted (engine or control thread): answered when resumed */
    RS_PHASE_STREAMING,         /* an SSE callback response is queued */
} rs_phase;

typedef struct rs_http_req rs_http_req;

/* The bodies of the load routes: SGLang's /get_load list, or its newer /v1/loads object. */
typedef enum rs_load_shape { RS_LOAD_LIST = 0, RS_LOAD_V1 = 1 } rs_load_shape;

/* One row of the route table (routes.c), in the nginx style: what a path accepts and the handlers
 * that serve it. Every stage but `handle` is optional.
 *   handle    the body is complete (or there is none): answer at once, or hand the work to the
 *             engine, the control thread or the sync service and suspend the connection;
 *   answer    the request was resumed with that work done: send the answer;
 *   cleanup   frees the route's state of the request (r->ctx and what it holds) when the request
 *             is freed. */
typedef struct rs_route_def {
    const char *path;
    rs_route id;
    const char *allow;          /* methods, as the Allow header lists them */
    bool open;                  /* answered without the API key (GET /health, /metrics) */
    int arg;                    /* a constant for the handlers: a weight route's rs_sync_kind, a
                                 * load route's rs_load_shape */
    enum MHD_Result (*handle)(rs_http_req *r);
    enum MHD_Result (*answer)(rs_http_req *r);
    void (*cleanup)(rs_http_req *r);
    /* for GET /openapi.json (protocol/openapi.h) */
    const char *summary;
    const struct rs_jobject *body; /* the table its body is read with, or NULL: no body */
    const char *answer_schema;  /* what a 200 holds: one of protocol/openapi.c's answers */
} rs_route_def;

/* The route for `path`, or NULL; the path /metrics reports for a route id. */
const rs_route_def *rs_route_find(const char *path);
const char *rs_route_name(rs_route id);
/* The OpenAPI document of every route (protocol/openapi.h), stating lim where given, or NULL when
 * memory is exhausted. */
char *rs_routes_openapi(bool api_key, const struct rs_jlimits *lim, size_t *len);

/* http_limits.c: connections beyond the soft caps live in a reserve this much larger (MHD's own
 * limits), with an idle timeout of at most RS_HTTP_OVER_TIMEOUT_S seconds. */
#define RS_HTTP_CONN_RESERVE 32
#define RS_HTTP_OVER_TIMEOUT_S 5
#define RS_HTTP_IP_BUCKETS 1024 /* a power of two */

/* Open connections from one client address. */
typedef struct rs_http_addr_count {
    struct rs_http_addr_count *next;
    uint8_t addr[16];           /* [len] */
    uint8_t len;                /* 4 (IPv4, also mapped) or 16 */
    int n;
} rs_http_addr_count;

/* MHD's socket context of one connection (made and freed by rs_http_on_connection). */
typedef struct rs_http_conn {
    uint8_t addr[16];           /* [addr_len] the client's address; addr_len 0 = not an IP socket */
    uint8_t addr_len;
    bool over;                  /* accepted beyond a soft cap: answered 503, except GET /health, /metrics */
} rs_http_conn;

typedef enum rs_http_log_kind {
    RS_HTTP_LOG_AUTH = 0,       /* 401s */
    RS_HTTP_LOG_OVER,           /* 503s of connections beyond the caps */
    RS_HTTP_LOG_KINDS
} rs_http_log_kind;

typedef struct rs_http_limits {
    pthread_mutex_t mu;         /* guards the connection counts and the log-line state */
    int n_conn;                 /* open connections */
    rs_http_addr_count *buckets[RS_HTTP_IP_BUCKETS];
    atomic_size_t body_bytes;   /* request-body buffers, all requests (capacity) */
    atomic_size_t stream_bytes; /* streamed bytes not yet taken by MHD, all streams */
    double log_last[RS_HTTP_LOG_KINDS];        /* rs_now_s of the last line of each kind */
    unsigned long log_skipped[RS_HTTP_LOG_KINDS]; /* lines not written since */
} rs_http_limits;

struct rs_http {
    struct MHD_Daemon *daemon;
    uv_timer_t scan_timer;      /* disconnects of suspended requests; probe timeouts */
    rs_http_opts opts;
    char api_key[256];
    int port;
    bool loopback;              /* listening on a loopback address: the Host guard is on */
    rs_http_info info;
    char model_path[4096];
    char served_model_name[256];
    char backend[32];
    double start_time_unix;
    atomic_ullong next_rid;     /* generated client rids: req-N */
    atomic_ullong next_job;     /* engine rids: <rid>#N */
    atomic_ullong seed_state;   /* seeds for /v1/completions requests that give none */
    atomic_ullong responses[RS_ROUTE_COUNT][RS_HTTP_CODE_COUNT];
    rs_http_limits lim;

    pthread_mutex_t mu;         /* guards everything below and the "under h->mu" fields of requests */
    rs_http_state state;
    rs_engine *engine;          /* borrowed; NULL until READY and after rs_http_detach_engine */
    int in_flight;              /* admitted generation requests not yet freed */
    rs_http_req *live;          /* admitted generation requests (doubly linked) */

    /* the control thread: pause, continue and flush wait for a step boundary */
    pthread_t ctl_thread;
    bool ctl_started, ctl_stop, ctl_busy;
    pthread_cond_t ctl_cv;      /* work queued or stop */
    pthread_cond_t ctl_idle_cv; /* ctl_busy went false */
    rs_http_req *ctl_head, *ctl_tail;
};

struct rs_http_req {
    rs_http *h;
    struct MHD_Connection *conn;
    int fd;                     /* the connection's socket, for the disconnect scan */
    const rs_route_def *def;    /* the route it took, or NULL (no such path) */
    rs_route route;             /* def->id, RS_ROUTE_NONE without one */
    void *ctx;                  /* the route's per-request context, freed by def->cleanup */
    rs_phase phase;
    double t_arrival;

    /* an answer decided early (while reading, or a refusal) */
    bool failed;
    rs_error error;
    const char *extra_header, *extra_value; /* static strings: Allow, Retry-After, WWW-Authenticate */
    bool answer_early;          /* answer `error` with the headers, without reading the body (framing, caps) */
    bool close;                 /* the answer ends the connection (Connection: close) */
    bool over_refused;          /* a 503 for a connection over the caps (its log line is rate-limited) */

    char *body;                 /* [n] (cap allocated, and charged to body-memory-budget) */
    size_t n, cap;

    /* the generation routes' state (http_gen.c; freed by their cleanup): one of gen
     * (generate, health_generate) or oai (completions) holds the job */
    rs_generate_req gen;
    rs_openai_req oai;
    /* an engine job in flight, what every stage that aborts or times out requests looks at */
    rs_gen_job *job;            /* borrowed from the route's context; lent to the engine while held */
    bool stream;
    bool counted;               /* holds one of in_flight's slots */
    double deadline;            /* /health_generate: answer 503 after this (rs_now_s) */
    char engine_rid[128];       /* job->rid, copied for aborts from other threads */

    rs_http_req *ctl_next;      /* the control thread's queue (http_ops.c) */

    /* under h->mu */
    bool in_mhd;                /* MHD has not yet reported the request completed */
    bool held;                  /* the engine or the control thread holds it */
    bool done;                  /* its job or control operation has finished */
    bool suspended;             /* its connection is suspended and nobody has claimed the resume */
    bool client_gone;           /* the peer closed: end the connection */
    bool answer_now;            /* answer `error` without waiting for the job (probe timeout) */
    bool stream_end;            /* the final events are in sse */
    bool stream_error;          /* end the stream with an error (client too slow, out of memory) */
    rs_buf sse;                 /* streamed bytes; [sse_off, sse.len) not yet handed to MHD, and charged
                                 * to stream-memory-budget */
    size_t sse_off;
    rs_http_req *live_prev, *live_next;
};

/* http.c */
void rs_http_lock(rs_http *h);
void rs_http_unlock(rs_http *h);
/* Under h->mu: true when the caller claimed the resume of a suspended r (it must then call
 * MHD_resume_connection after unlocking). */
bool rs_http_claim_resume_locked(rs_http_req *r);
/* From an MHD callback: suspends r's connection unless it is already ready to go on. */
void rs_http_suspend(rs_http_req *r);
void rs_http_req_free(rs_http_req *r);
/* Frees r's body buffer and gives its memory back to body-memory-budget. */
void rs_http_body_drop(rs_http_req *r);
/* Queue an answer; `body` (malloc'd, NULL = out of memory) passes to MHD. */
enum MHD_Result rs_http_send(rs_http_req *r, unsigned status, char *body, size_t len, const char *content_type);
enum MHD_Result rs_http_send_error(rs_http_req *r, const rs_error *err);
void rs_http_count(rs_http *h, rs_route route, unsigned status);
/* The engine when READY (or DRAINING with engine routes still up); NULL with err set (503) otherwise. */
rs_engine *rs_http_engine(rs_http *h, bool need_ready, rs_error *err);

/* http_gen.c: /generate, /v1/completions, /health_generate */
enum MHD_Result rs_http_gen_start(rs_http_req *r);
enum MHD_Result rs_http_gen_answer(rs_http_req *r);     /* resumed: the job is done */
void rs_http_gen_cleanup(rs_http_req *r);               /* frees gen / oai */
/* Aborts, in the engine, the admitted requests `rid` names (all with NULL); returns how many. */
int rs_http_gen_abort(rs_http *h, rs_engine *e, const char *rid);

/* http_limits.c */
void rs_http_limits_init(rs_http_limits *L);
void rs_http_limits_free(rs_http_limits *L); /* after MHD has stopped */
/* MHD_OPTION_NOTIFY_CONNECTION (cls: the rs_http): counts connections and marks those over a cap. */
void rs_http_on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                           enum MHD_ConnectionNotificationCode toe);
bool rs_http_conn_over(struct MHD_Connection *c);
/* Takes n bytes of a budget when they fit (true), else takes nothing (false); gives them back. */
bool rs_http_budget_take(atomic_size_t *used, size_t budget, size_t n);
void rs_http_budget_give(atomic_size_t *used, size_t n);
/* A line of `kind` may be logged: at most one a second; *skipped gets how many were not since. */
bool rs_http_log_allowed(rs_http_limits *L, rs_http_log_kind kind, unsigned long *skipped);

/* http_ops.c: the operations routes, one handler each, and the control routes (pause, continue,
 * flush), which run on the control thread and answer when resumed */
enum MHD_Result rs_http_health(rs_http_req *r);
enum MHD_Result rs_http_metrics(rs_http_req *r);
enum MHD_Result rs_http_server_info(rs_http_req *r);
enum MHD_Result rs_http_model_info(rs_http_req *r);
enum MHD_Result rs_http_load(rs_http_req *r);
enum MHD_Result rs_http_weight_version(rs_http_req *r);
enum MHD_Result rs_http_models(rs_http_req *r);
enum MHD_Result rs_http_openapi(rs_http_req *r);
enum MHD_Result rs_http_abort(rs_http_req *r);
enum MHD_Result rs_http_tokenize(rs_http_req *r);     /* /tokenize and /detokenize */
enum MHD_Result rs_http_control(rs_http_req *r);
enum MHD_Result rs_http_control_answer(rs_http_req *r);
void rs_http_control_cleanup(rs_http_req *r);
void rs_http_ctl_start(rs_http *h);
void rs_http_ctl_stop(rs_http *h);

#endif /* RS_HTTP_INTERNAL_H */
