/*
 * json_util.h — helpers shared by the protocol/ parsers and writers. Private to protocol/: nothing
 * outside it includes jansson.
 *
 * Parsing helpers name the offending field in the error (`param`) and quote the value in the
 * message; writers dump compact JSON with 9 significant digits, which round-trips an fp32 logprob.
 */
#ifndef RS_PROTOCOL_JSON_UTIL_H
#define RS_PROTOCOL_JSON_UTIL_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../core/rs.h"
#include "../scheduler/engine.h"
#include "sse.h"

#define RS_JSON_DUMP_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(9))

/* Parses a whole body as one JSON object (duplicate keys rejected). An empty body is an error
 * unless allow_empty, in which case *out is a new empty object. */
int rs_json_load_object(const char *body, size_t len, bool allow_empty, json_t **out, rs_error *err);

/* A JSON value as a message shows it: numbers and literals by value, containers by kind. */
void rs_json_describe(const json_t *v, char *buf, size_t n);
int rs_json_bad_type(rs_error *err, const char *param, const char *want, const json_t *v);
int rs_json_get_int(const json_t *v, const char *param, long long min, long long max, long long *out,
                    rs_error *err);
/* Any finite number that fits a float. */
int rs_json_get_float(const json_t *v, const char *param, double *out, rs_error *err);
int rs_json_get_bool(const json_t *v, const char *param, bool *out, rs_error *err);
/* A list of non-negative int32 token ids into a new array (NULL when empty). `path` is how
 * messages name the list. */
int rs_json_get_ids(const json_t *arr, const char *param, const char *path, int32_t **out, int *n_out,
                    rs_error *err);
/* A non-empty printable string of at most max_len bytes, without control characters. */
int rs_json_check_name(const json_t *v, const char *param, size_t max_len, rs_error *err);

/* "default" | "raw" | "processed" (param "logprobs_mode"). */
int rs_json_get_logprobs_mode(const json_t *v, rs_logprobs_mode *mode, rs_error *err);

/* A JSON string of s; text that is not valid UTF-8 keeps its ASCII and has every other byte
 * replaced by '?' (messages quote request bytes, paths are bytes). */
json_t *rs_json_string_lossy(const char *s);

/* A logprob as JSON: null when it is not finite (no context, or -inf). */
json_t *rs_json_logprob(float lp);

/* Steals v: dumps it as compact text (new malloc'd string, *len set), or NULL on OOM. */
char *rs_json_dump(json_t *v, size_t *len);
/* Steals v: appends `data: <json>\n\n` to b. RS_OK or RS_ENOMEM. */
int rs_json_sse_event(rs_buf *b, json_t *v);
/* Appends v's compact text to b (v is borrowed). */
int rs_json_append(rs_buf *b, const json_t *v);

#endif /* RS_PROTOCOL_JSON_UTIL_H */
