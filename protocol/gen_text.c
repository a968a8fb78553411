/*
 * gen_text.c — outputs' text as tokens arrive, and stop strings on it (see gen_text.h).
 */
#include "gen_text.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

rs_gen_text *rs_gen_text_new(const rs_tok *tok) {
    rs_gen_text *t = rs_xcalloc(1, sizeof *t);
    t->tok = tok;
    t->skip_special_tokens = true;
    return t;
}

void rs_gen_text_free(rs_gen_text *t) {
    if (!t) return;
    for (int i = 0; i < t->n_stops; i++) free(t->stops[i]);
    free(t->stops);
    free(t->stop_lens);
    for (int i = 0; i < t->n_regexes; i++) rs_tok_stop_re_free(t->regexes[i]);
    free(t->regexes);
    for (int i = 0; t->outs && i < t->n_out; i++) {
        rs_tok_stream_free(t->outs[i].stream);
        rs_buf_free(&t->outs[i].text);
        free(t->outs[i].re_from);
    }
    free(t->outs);
    free(t);
}

int rs_gen_text_add_stop(rs_gen_text *t, const char *s, size_t len, const char *param, rs_error *err) {
    if (len == 0) return RS_OK;
    if (len > RS_GEN_TEXT_MAX_STOP_LEN)
        return rs_error_set(err, RS_EINVAL, param, "%s is %zu bytes; a stop string may have at most %d", param, len,
                            RS_GEN_TEXT_MAX_STOP_LEN);
    if (t->n_stops == RS_GEN_TEXT_MAX_STOPS)
        return rs_error_set(err, RS_EINVAL, param, "at most %d stop strings per request", RS_GEN_TEXT_MAX_STOPS);
    t->stops = rs_xrealloc(t->stops, sizeof(char *) * (size_t)(t->n_stops + 1));
    t->stop_lens = rs_xrealloc(t->stop_lens, sizeof(size_t) * (size_t)(t->n_stops + 1));
    char *c = rs_xmalloc(len + 1);
    memcpy(c, s, len);
    c[len] = '\0';
    t->stops[t->n_stops] = c;
    t->stop_lens[t->n_stops++] = len;
    return RS_OK;
}

int rs_gen_text_add_stop_regex(rs_gen_text *t, const char *s, size_t len, const char *param, rs_error *err) {
    if (len == 0) return RS_OK;
    if (len > RS_GEN_TEXT_MAX_STOP_LEN)
        return rs_error_set(err, RS_EINVAL, param, "%s is %zu bytes; a stop regex may have at most %d", param, len,
                            RS_GEN_TEXT_MAX_STOP_LEN);
    if (t->n_regexes == RS_GEN_TEXT_MAX_REGEXES)
        return rs_error_set(err, RS_EINVAL, param, "at most %d stop regexes per request", RS_GEN_TEXT_MAX_REGEXES);
    rs_tok_stop_re *re;
    int rc = rs_tok_stop_re_compile(s, len, param, &re, err);
    if (rc != RS_OK) return rc;
    t->regexes = rs_xrealloc(t->regexes, sizeof(rs_tok_stop_re *) * (size_t)(t->n_regexes + 1));
    t->regexes[t->n_regexes++] = re;
    return RS_OK;
}

bool rs_gen_text_has_stops(const rs_gen_text *t) { return t->n_stops > 0 || t->n_regexes > 0; }

void rs_gen_text_attach(rs_gen_text *t, rs_gen_job *job) {
    job->on_token = rs_gen_text_on_token;
    job->on_token_user = t;
    t->hooked = true;
}

static rs_gen_text_out *out_of(rs_gen_text *t, const rs_gen_job *job, int i) {
    if (!t->outs) {
        t->n_out = job->n_prompts * job->sp.n;
        t->outs = rs_xcalloc((size_t)t->n_out, sizeof *t->outs);
        for (int k = 0; k < t->n_out; k++) {
            t->outs[k].stop = -1;
            if (t->n_regexes > 0) t->outs[k].re_from = rs_xcalloc((size_t)t->n_regexes, sizeof(size_t));
        }
    }
    RS_ASSERT(i >= 0 && i < t->n_out);
    return &t->outs[i];
}

static void push(rs_gen_text *t, rs_gen_text_out *o, int32_t token) {
    if (!o->stream) o->stream = rs_tok_stream_new(t->tok, t->skip_special_tokens);
    const char *d;
    size_t n = rs_tok_stream_push(o->stream, token, &d);
    if (n > 0 && rs_buf_append(&o->text, d, n) != RS_OK) RS_ASSERT(!"out of memory appending output text");
}

/* The first stop regex (in the request's order) with a match in o's text, or -1. */
static int find_regex(rs_gen_text *t, const rs_gen_job *job, int output, rs_gen_text_out *o) {
    for (int r = 0; r < t->n_regexes; r++) {
        if (o->re_from[r] == SIZE_MAX) continue;
        size_t ms, me;
        int rc = rs_tok_stop_re_find(t->regexes[r], o->text.data, o->text.len, &o->re_from[r], &ms, &me);
        if (rc == 1) {
            o->stop_pos = ms, o->stop_end = me;
            return RS_GEN_TEXT_REGEX_STOP(r);
        }
        if (rc < 0) {
            if (rc == RS_ETOOBIG)
                RS_WARN("rid %s | output %d: stop_regex[%d] exceeded %u search steps at %zu bytes of text; it no "
                        "longer stops this output",
                        job->rid, output, r, RS_TOK_STOP_RE_MATCH_LIMIT, o->text.len);
            else
                RS_ERROR("rid %s | output %d: stop_regex[%d] could not search the output text (%s); it no longer "
                         "stops this output",
                         job->rid, output, r, rs_err_name(rc));
            o->re_from[r] = SIZE_MAX;
        }
    }
    return -1;
}

int rs_gen_text_on_token(rs_gen_job *job, int output, int32_t token, void *user) {
    rs_gen_text *t = user;
    rs_gen_text_out *o = out_of(t, job, output);
    push(t, o, token);
    int k = -1;
    if (t->n_stops > 0) {
        size_t pos;
        k = rs_tok_stop_find((const char *const *)t->stops, t->stop_lens, t->n_stops, o->text.data, o->text.len,
                             o->scanned, &pos);
        o->scanned = o->text.len;
        if (k >= 0) o->stop_pos = pos, o->stop_end = pos + t->stop_lens[k];
    }
    if (k < 0 && t->n_regexes > 0) k = find_regex(t, job, output, o);
    if (k >= 0) o->stop = k;
    return k;
}

/* A finished output: the stop token's text when no_stop_trim asks for it, then what the stream
 * still holds. */
static void settle(rs_gen_text *t, const rs_gen_job *job, int i, rs_gen_text_out *o) {
    const rs_gen_output *g = &job->outputs[i];
    if (o->settled || g->finish.type == RS_FINISH_NONE) return;
    o->settled = true;
    if (o->stop >= 0) return; /* the text ends at the match, which is all emitted */
    const bool stop_token = g->finish.type == RS_FINISH_STOP && g->finish.matched_text == 0 && g->n_output > 0;
    for (int k = 0; !t->hooked && k < g->n_output - (stop_token ? 1 : 0); k++) push(t, o, g->output_ids[k]);
    if (stop_token && t->no_stop_trim) push(t, o, g->output_ids[g->n_output - 1]);
    if (!o->stream) return;
    const char *d;
    size_t n = rs_tok_stream_finish(o->stream, &d);
    if (n > 0 && rs_buf_append(&o->text, d, n) != RS_OK) RS_ASSERT(!"out of memory appending output text");
}

static size_t visible_len(const rs_gen_text *t, const rs_gen_text_out *o) {
    if (o->stop < 0) return o->text.len;
    return t->no_stop_trim ? o->stop_end : o->stop_pos;
}

const char *rs_gen_text_get(rs_gen_text *t, const rs_gen_job *job, int i, size_t *len) {
    rs_gen_text_out *o = out_of(t, job, i);
    settle(t, job, i, o);
    *len = visible_len(t, o);
    return o->text.data ? o->text.data : "";
}

size_t rs_gen_text_stable(rs_gen_text *t, const rs_gen_job *job, int i, const char **text) {
    rs_gen_text_out *o = out_of(t, job, i);
    settle(t, job, i, o);
    *text = o->text.data ? o->text.data : "";
    if (o->settled || o->stop >= 0) return visible_len(t, o);
    size_t n = o->text.len - rs_tok_stop_holdback((const char *const *)t->stops, t->stop_lens, t->n_stops, *text,
                                                  o->text.len);
    for (int r = 0; r < t->n_regexes; r++) /* a regex may still match from re_from[r] on */
        if (o->re_from && o->re_from[r] != SIZE_MAX && o->re_from[r] < n) n = o->re_from[r];
    return n;
}

const char *rs_gen_text_stop_string(const rs_gen_text *t, const rs_finish *f) {
    if (f->type != RS_FINISH_STOP || f->matched_text <= 0) return NULL;
    int k = f->matched_text - 1;
    if (k < t->n_stops) return t->stops[k];
    int r = k - RS_GEN_TEXT_REGEX_STOP(0);
    return r >= 0 && r < t->n_regexes ? rs_tok_stop_re_pattern(t->regexes[r]) : NULL;
}

size_t rs_utf8_chars(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++) c += ((unsigned char)s[i] & 0xc0) != 0x80;
    return c;
}
