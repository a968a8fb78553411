/*
 * errors.h — JSON bodies for errors and other fixed answers, so that server/ never writes JSON.
 *
 * Every error body has the one shape docs/api.md gives:
 *   {"error": {"message": "...", "type": "invalid_request", "param": "sampling_params.top_p", "code": 400}}
 * where type comes from the rs_errno table (core/rs.h), param is null when nothing in the request
 * is at fault, and code is the HTTP status, from the same table (rs_err_http_status), as vLLM's
 * ErrorInfo.code is.
 */
#ifndef RS_PROTOCOL_ERRORS_H
#define RS_PROTOCOL_ERRORS_H

#include <stddef.h>

#include "../core/rs.h"

/* Returns a new malloc'd, NUL-terminated body (the caller frees it) and its length in *len, or
 * NULL only when memory is exhausted. */
char *rs_error_body(const rs_error *err, size_t *len);

/* {"status":"ok"}: the body of GET /health when the server is ready. Same ownership. */
char *rs_health_body(size_t *len);

#endif /* RS_PROTOCOL_ERRORS_H */
