/*
 * rs.c — error table lookups, logging, assertions and checked allocation (see rs.h).
 */
#define _POSIX_C_SOURCE 200809L
#include "rs.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

rs_log_level rs_log_min_level = RS_LOG_LEVEL_INFO;

const char *rs_err_name(int err) {
    switch (err) {
#define RS_ERR_NAME(name, code, http, type) case code: return "RS_" #name;
        RS_ERRNO_MAP(RS_ERR_NAME)
#undef RS_ERR_NAME
    }
    return "RS_E?";
}

const char *rs_err_type(int err) {
    switch (err) {
#define RS_ERR_TYPE(name, code, http, type) case code: return type;
        RS_ERRNO_MAP(RS_ERR_TYPE)
#undef RS_ERR_TYPE
    }
    return "internal_error";
}

int rs_err_http_status(int err) {
    switch (err) {
#define RS_ERR_HTTP(name, code, http, type) case code: return http;
        RS_ERRNO_MAP(RS_ERR_HTTP)
#undef RS_ERR_HTTP
    }
    return 500;
}

int rs_error_set(rs_error *err, int code, const char *param, const char *fmt, ...) {
    if (err) {
        err->code = code;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
        snprintf(err->param, sizeof err->param, "%s", param ? param : "");
    }
    return code;
}

double rs_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void rs_log(rs_log_level level, const char *fmt, ...) {
    static const char *names[] = {"debug", "info ", "warn ", "error"};
    static double t0;
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    if (level < rs_log_min_level) return;
    char line[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    /* one event, one line: a control character that came from a request (a path, a field name,
     * a model name) cannot start a forged line of its own (CWE-117) */
    for (char *p = line; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f) *p = '?';
    pthread_mutex_lock(&mu);
    if (t0 == 0) t0 = rs_now_s();
    fprintf(stderr, "[%9.3f] %s | %s\n", rs_now_s() - t0, names[level], line);
    pthread_mutex_unlock(&mu);
}

void rs_assert_fail(const char *expr, const char *file, int line) {
    rs_log(RS_LOG_LEVEL_ERROR, "assertion failed: %s (%s:%d)", expr, file, line);
    abort();
}

static void *oom(size_t n) {
    rs_log(RS_LOG_LEVEL_ERROR, "out of memory allocating %zu bytes", n);
    abort();
}

void *rs_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    return p ? p : oom(n);
}

void *rs_xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    return p ? p : oom(n * size);
}

void *rs_xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    return q ? q : oom(n);
}

char *rs_xstrdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = rs_xmalloc(n);
    memcpy(d, s, n);
    return d;
}
