/*
 * http.h — the HTTP front end: libmicrohttpd threads that parse, route, hand jobs to the engine
 * and answer when the engine is done.
 *
 * Threads. MHD runs its own small thread pool; its callbacks never block. A /generate request is
 * parsed and validated on an MHD thread, submitted to the engine, and its connection suspended.
 * The engine calls the job's on_done on the engine thread, which only pushes the request onto a
 * completion list under a mutex and wakes the libuv loop (uv_async_send); the loop's callback,
 * on the main thread, resumes the connections, and MHD then calls the handler again to queue the
 * serialized answer. server/ never builds JSON: protocol/ writes every body.
 *
 * Lifetime of a request. It is freed exactly once, by whichever of two owners lets go last: the
 * connection (MHD's completion notice) and the engine (a submitted job, until it has finished and
 * been handed back through the completion list). Both flags live under the same mutex.
 */
#ifndef RS_HTTP_H
#define RS_HTTP_H

#include <stddef.h>
#include <uv.h>

#include "../core/rs.h"
#include "../scheduler/engine.h"

typedef struct rs_http_opts {
    const char *host;           /* borrowed: numeric address or name to bind */
    int port;                   /* 0 = any free port (see rs_http_port) */
    size_t max_body_bytes;
    int max_waiting_requests;   /* generate requests in flight before 503 */
    const char *api_key;        /* borrowed; NULL or "" = no auth */
} rs_http_opts;

typedef struct rs_http rs_http;

/* Binds and starts serving in the STARTING state: /health and /generate answer 503 until
 * rs_http_set_engine. Registers a uv_async_t on `loop`, which must be run by the calling thread. */
int rs_http_start(rs_http **out, const rs_http_opts *opts, uv_loop_t *loop, rs_error *err);

int rs_http_port(const rs_http *h);

/* Attaches the running engine (borrowed; it must outlive the server's use of it, i.e. stay until
 * rs_http_close) and starts answering: the READY state. */
void rs_http_set_engine(rs_http *h, rs_engine *e);

/* The DRAINING state: /health and new /generate requests answer 503; admitted ones finish. */
void rs_http_drain(rs_http *h);

/* Generate requests admitted and not yet finished (their answer sent or their client gone). */
int rs_http_in_flight(rs_http *h);

/* Resumes the connections of every finished job. The loop's async callback does this; call it
 * directly after rs_engine_stop, so that jobs the engine aborted are answered. Main thread only. */
void rs_http_flush_completions(rs_http *h);

/* Stops MHD (closing every connection) and closes the async handle; `h` is freed by the loop once
 * the handle is closed, so the loop must run after this. The engine must already be stopped. */
void rs_http_close(rs_http *h);

#endif /* RS_HTTP_H */
