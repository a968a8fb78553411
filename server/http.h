/*
 * http.h — the HTTP front end: libmicrohttpd threads that route, authenticate, parse (through
 * protocol/), hand work to the engine and answer when it is done. Routes are listed in http.c.
 *
 * Threads, and who may block. MHD runs a pool of worker threads whose callbacks never block:
 *   - generation (/generate, /v1/completions, /health_generate): parsed and validated on the MHD
 *     thread, submitted to the engine; a plain answer suspends the connection, and the engine's
 *     on_done (engine thread) resumes it; MHD then calls the handler again to send the body. A
 *     streamed answer is an MHD callback response: the engine's on_progress and on_done build the
 *     SSE events on the engine thread (the outputs are stable there) and append them to the
 *     request's buffer; the content reader hands the bytes to MHD, and suspends the connection
 *     when the buffer is empty until the next append resumes it.
 *   - pause, continue and flush wait for an engine step boundary, so a control thread of this
 *     module runs them; the connection is suspended meanwhile.
 *   - everything else (abort, info, metrics) answers at once.
 * Whoever makes a suspended request ready (engine, control thread, main loop) claims the resume
 * under the mutex and calls MHD_resume_connection itself: a resume is never lost or doubled.
 *
 * Disconnects. MHD does not watch a suspended connection, so a timer on the libuv loop peeks at
 * the socket of every suspended generation request (recv MSG_PEEK: 0 = the peer closed) every
 * RS_HTTP_SCAN_MS; a client that left gets its job aborted (its KV pages are freed at the next
 * step) and its connection ended. A streamed answer also notices a gone client when a write
 * fails. (A client that half-closes its socket after sending, shutdown(SHUT_WR), reads as gone:
 * HTTP clients do not do that.) Client ids (rids) may repeat: each job gets a unique engine rid "<rid>#<seq>", and
 * /abort_request finds jobs by their client-visible ids. The same timer answers /health_generate
 * with 503 when its probe outlives health-generate-timeout.
 *
 * What a slow or hostile client gets (http.c, http_limits.c, http_gen.c):
 *   - http-idle-timeout (30 s): a connection that sends nothing while its headers or body are read,
 *     takes nothing of its answer, or sits idle between requests is closed; a request waiting for
 *     the engine (suspended) is not timed;
 *   - max-connections (2048) and max-connections-per-ip (1536): a connection beyond either gets 503
 *     (Retry-After: 1, Connection: close) as soon as its headers are in, whatever the route, except
 *     GET /health and GET /metrics, served from a reserve of RS_HTTP_CONN_RESERVE connections; a
 *     connection in the reserve has an idle timeout of at most RS_HTTP_OVER_TIMEOUT_S;
 *   - body-memory-budget (1 GiB, all bodies) beside max-body-bytes (16 MiB, each): a body that would
 *     exceed it is freed at once and answered 503 when it ends;
 *   - max-stream-buffer (64 MiB, each stream) and stream-memory-budget (1 GiB, all streams) bound the
 *     streamed bytes the client has not taken: the stream that would exceed either is cut and its
 *     request aborted (finish "abort", KV pages freed at the next engine step);
 *   - an ambiguous body length (two Content-Length values, Transfer-Encoding with Content-Length,
 *     a transfer coding other than chunked alone, Transfer-Encoding in HTTP/1.0) gets 400 at once,
 *     the connection closed;
 *   - with --api-key, 401 before any 404 or 405 (only GET /health and /metrics are open); 401 log
 *     lines at most once a second.
 * Each connection also holds up to 256 KiB of libmicrohttpd's own buffers.
 *
 * Lifetime of a request. Freed exactly once, by whichever of two owners lets go last: the
 * connection (MHD's completion notice) and the engine or control thread (a submitted job or
 * control operation, until it has finished). Both flags live under the same mutex.
 */
#ifndef RS_HTTP_H
#define RS_HTTP_H

#include <stddef.h>
#include <uv.h>

#include "../config/config.h"
#include "../core/rs.h"
#include "../model/model.h"
#include "../scheduler/engine.h"
#include "../tokenizer/tokenizer.h"

#define RS_HTTP_SCAN_MS 100                          /* disconnect and probe-timeout scan period */

typedef struct rs_http_opts {
    const char *host;           /* borrowed: numeric address or name to bind */
    int port;                   /* 0 = any free port (see rs_http_port) */
    int threads;                /* MHD worker threads; 0 = one per core */
    size_t max_body_bytes;
    int max_waiting_requests;   /* generation requests in flight before 503 */
    const char *api_key;        /* borrowed; NULL or "" = no auth */
    int idle_timeout;           /* seconds a silent connection stays open (> 0) */
    int max_connections;        /* served connections, all clients (http_limits.c) */
    int max_connections_per_ip; /* served connections from one client address */
    size_t body_memory_budget;  /* request bodies in memory, all requests (>= max_body_bytes) */
    size_t stream_memory_budget; /* unsent streamed bytes, all streams */
    size_t max_stream_buffer;   /* unsent bytes of one stream (<= stream_memory_budget) */
} rs_http_opts;

/* What the info routes report; everything is borrowed and must outlive the server. */
typedef struct rs_http_info {
    const rs_config *cfg;       /* the effective settings */
    const rs_model *model;
    const char *model_path;     /* the directory loaded */
    const char *served_model_name;
    const char *backend;        /* backend name, "cpu" */
    const rs_tok *tok;          /* the model's tokenizer.json; NULL: token ids only */
} rs_http_info;

typedef struct rs_http rs_http;

/* Binds and starts serving in the STARTING state: /health and every engine route answer 503
 * until rs_http_set_engine. Registers a timer on `loop`, which must be run by the calling thread. */
int rs_http_start(rs_http **out, const rs_http_opts *opts, uv_loop_t *loop, rs_error *err);

int rs_http_port(const rs_http *h);

/* Attaches the running engine (borrowed; it must stay valid until rs_http_close) and starts
 * answering: the READY state. */
void rs_http_set_engine(rs_http *h, rs_engine *e, const rs_http_info *info);

/* The DRAINING state: /health, /health_generate and new generation requests answer 503;
 * admitted ones finish; operations routes keep working. */
void rs_http_drain(rs_http *h);

/* Call before rs_engine_stop: engine routes answer 503 from now on, and this waits (at most one
 * engine step) for a control operation in progress. */
void rs_http_detach_engine(rs_http *h);

/* Generation requests admitted and not yet finished (their answer sent or their client gone). */
int rs_http_in_flight(rs_http *h);

/* Stops the control thread, ends every connection still suspended, stops MHD and closes the
 * timer; `h` is freed by the loop once the timer is closed, so the loop must run after this.
 * The engine must already be stopped. Main thread only. */
void rs_http_close(rs_http *h);

#endif /* RS_HTTP_H */
