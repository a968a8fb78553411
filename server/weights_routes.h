/*
 * weights_routes.h — the weight-update routes of the HTTP server:
 *
 *   POST /update_weights_from_shm          POST /update_weights_from_disk
 *   POST /update_weight_version            POST /init_weights_update_group
 *   POST /update_weights_from_distributed  POST /destroy_weights_update_group
 *
 * The route table (routes.c) sends these paths here once the body is complete, each with its
 * rs_sync_kind as the row's arg. The body is parsed
 * on the MHD thread (protocol/weights.h; a bad body is answered at once), then handed to the
 * weight-sync service (sync/sync.h) as a job and the connection suspended: nothing here blocks.
 * The service thread finishes the job and resumes the connection; MHD calls the handler again and
 * rs_weights_routes_answer sends {"success": true, "message", "weight_version", "bytes", "seconds",
 * "committed"} or the error (400 bad manifest or tensor, 409 an update to another version in
 * progress, 503 starting or shutting down).
 *
 * The service is attached once by main.c; there is one per process, like the server itself.
 */
#ifndef RS_WEIGHTS_ROUTES_H
#define RS_WEIGHTS_ROUTES_H

#include <microhttpd.h>
#include <stdbool.h>

#include "../sync/sync.h"

typedef struct rs_http_req rs_http_req; /* http_internal.h (main.c does not see it) */

/* main.c: after rs_sync_start, and before rs_sync_stop (from then on the routes answer 503). */
void rs_weights_routes_attach(rs_sync *s);
void rs_weights_routes_detach(void);

/* The attached service's counters (rs_sync_get_stats), for /metrics: false (and *out zeroed) when
 * none is attached. Thread-safe. */
bool rs_weights_routes_stats(rs_sync_stats *out);

/* The route table's handlers: the body of r is complete; r was resumed with its job done; r is
 * freed (its job with it). */
enum MHD_Result rs_weights_routes_handle(rs_http_req *r);
enum MHD_Result rs_weights_routes_answer(rs_http_req *r);
void rs_weights_routes_cleanup(rs_http_req *r);

#endif /* RS_WEIGHTS_ROUTES_H */
