/*
 * rs.h — the few things every rolloutd module shares: the error table, logging and assertions.
 *
 * Errors. A function that can fail returns int: RS_OK (0) or a negative RS_E* code. One X-macro
 * table gives each code its name, the HTTP status it maps to and the "type" string used in JSON
 * error bodies, so the server never has to guess how to report a failure (libuv's uv-errno idea).
 *
 * Assertions. RS_ASSERT is for bugs, never for bad input: it stays on in release builds, logs the
 * expression with file and line, then aborts (redis' serverAssert). Bad input is a 4xx answer.
 */
#ifndef RS_H
#define RS_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#define RS_NORETURN [[noreturn]]
#else
#define RS_NORETURN _Noreturn
#endif

/*     name          code  http  json type */
#define RS_ERRNO_MAP(X)                                   \
    X(OK,            0,    200, "ok")                     \
    X(EINVAL,       -1,    400, "invalid_request")        \
    X(EAUTH,        -2,    401, "unauthorized")           \
    X(ENOTFOUND,    -3,    404, "not_found")              \
    X(EMETHOD,      -4,    405, "method_not_allowed")     \
    X(ESTATE,       -5,    409, "conflict")               \
    X(ETOOBIG,      -6,    413, "request_too_large")      \
    X(EBUSY,        -7,    503, "unavailable")            \
    X(ENOMEM,       -8,    500, "out_of_memory")          \
    X(EIO,          -9,    500, "io_error")               \
    X(EFORMAT,     -10,    400, "bad_format")             \
    X(EUNSUPPORTED,-11,    400, "unsupported")            \
    X(EINTERNAL,   -12,    500, "internal_error")        \
    X(EFORBIDDEN,  -13,    403, "forbidden")              \
    X(EMEDIA,      -14,    415, "unsupported_media_type")

enum rs_errno {
#define RS_ERR_ENUM(name, code, http, type) RS_##name = code,
    RS_ERRNO_MAP(RS_ERR_ENUM)
#undef RS_ERR_ENUM
};

const char *rs_err_name(int err);      /* "RS_EINVAL" */
const char *rs_err_type(int err);      /* "invalid_request" */
int rs_err_http_status(int err);       /* 400 */

/* An error with a human message, filled by the failing function for the caller to report.
 * `param` names the offending field or tensor when there is one ("sampling_params.top_p"). */
typedef struct rs_error {
    int code;
    char message[512];
    char param[128];
} rs_error;

/* Sets err (if non-NULL) and returns code, so callers can `return rs_error_set(err, RS_EINVAL, ...)`. */
int rs_error_set(rs_error *err, int code, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* ---- logging: one line per event to stderr, with a level and a monotonic timestamp ---- */
typedef enum rs_log_level {
    RS_LOG_LEVEL_DEBUG = 0,
    RS_LOG_LEVEL_INFO,
    RS_LOG_LEVEL_WARN,
    RS_LOG_LEVEL_ERROR,
} rs_log_level;

extern rs_log_level rs_log_min_level;
void rs_log(rs_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define RS_DEBUG(...) rs_log(RS_LOG_LEVEL_DEBUG, __VA_ARGS__)
#define RS_INFO(...)  rs_log(RS_LOG_LEVEL_INFO, __VA_ARGS__)
#define RS_WARN(...)  rs_log(RS_LOG_LEVEL_WARN, __VA_ARGS__)
#define RS_ERROR(...) rs_log(RS_LOG_LEVEL_ERROR, __VA_ARGS__)

RS_NORETURN void rs_assert_fail(const char *expr, const char *file, int line);
#define RS_ASSERT(e) ((e) ? (void)0 : rs_assert_fail(#e, __FILE__, __LINE__))

/* Allocation that cannot fail quietly: aborts with a log line on OOM. Use it for sizes the
 * server itself chose; sizes that come from a request are checked against limits first. */
void *rs_xmalloc(size_t n);
void *rs_xcalloc(size_t n, size_t size);
void *rs_xrealloc(void *p, size_t n);
char *rs_xstrdup(const char *s);

double rs_now_s(void); /* CLOCK_MONOTONIC seconds */

#define RS_MIN(a, b) ((a) < (b) ? (a) : (b))
#define RS_MAX(a, b) ((a) > (b) ? (a) : (b))
#define RS_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* RS_ASAN is defined where this file is compiled with AddressSanitizer (GCC's or clang's flag). */
#if defined(__SANITIZE_ADDRESS__)
#define RS_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define RS_ASAN 1
#endif
#endif

#ifdef __cplusplus
}
#endif

#endif /* RS_H */
