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
        rs_tok_stream_free(t->outs[i].sstream);
        rs_buf_free(&t->outs[i].stext);
        free(t->outs[i].re_from);
        free(t->outs[i].t_re_from);
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
            t->outs[k].t_hit = SIZE_MAX;
            if (t->n_regexes > 0) {
                t->outs[k].re_from = rs_xcalloc((size_t)t->n_regexes, sizeof(size_t));
                t->outs[k].t_re_from = rs_xcalloc((size_t)t->n_regexes, sizeof(size_t));
            }
        }
    }
    RS_ASSERT(i >= 0 && i < t->n_out);
    return &t->outs[i];
}

/* The searched text has a stream of its own: special tokens kept for the search, skipped in the
 * answer. */
static bool separate_search(const rs_gen_text *t) {
    return t->stops_see_special && t->skip_special_tokens && rs_gen_text_has_stops(t);
}

#define PRIME_IDS 8 /* the prompt's last ids an output's text is decoded after */

static rs_tok_stream *new_stream(rs_gen_text *t, const rs_gen_job *job, int i, bool skip_special) {
    rs_tok_stream *s = rs_tok_stream_new(t->tok, skip_special);
    int p = i / job->sp.n, len = job->prompts ? job->prompt_lens[p] : 0;
    if (len > 0) {
        int n = RS_MIN(len, PRIME_IDS);
        rs_tok_stream_prime(s, job->prompts[p] + len - n, (size_t)n);
    }
    return s;
}

static void append(rs_buf *b, const char *d, size_t n) {
    if (n > 0 && rs_buf_append(b, d, n) != RS_OK) RS_ASSERT(!"out of memory appending output text");
}

static void push(rs_gen_text *t, const rs_gen_job *job, int i, rs_gen_text_out *o, int32_t token) {
    if (!o->stream) o->stream = new_stream(t, job, i, t->skip_special_tokens);
    const char *d;
    size_t n = rs_tok_stream_push(o->stream, token, &d);
    append(&o->text, d, n);
    if (!separate_search(t)) return;
    if (!o->sstream) o->sstream = new_stream(t, job, i, false);
    n = rs_tok_stream_push(o->sstream, token, &d);
    append(&o->stext, d, n);
}

/* Ends a stream whose held text `held` bytes were already appended to b (0: append it now). */
static void finish_into(rs_tok_stream *s, rs_buf *b, size_t held) {
    const char *d;
    size_t n = rs_tok_stream_finish(s, &d);
    RS_ASSERT(held == 0 || held == n);
    if (held == 0) append(b, d, n);
}

/* The first stop regex (in the request's order) with a match in text[0, len), or -1. With
 * `advance` the search positions move on (text is final); else they stay (its tail is a peek). */
static int find_regex(rs_gen_text *t, const rs_gen_job *job, int output, rs_gen_text_out *o, const char *text,
                      size_t len, bool advance) {
    for (int r = 0; r < t->n_regexes; r++) {
        if (o->re_from[r] == SIZE_MAX) continue;
        size_t from = o->re_from[r], ms, me;
        int rc = rs_tok_stop_re_find(t->regexes[r], text, len, &from, &ms, &me);
        if (rc == 1) {
            o->stop_pos = ms, o->stop_end = me;
            return RS_GEN_TEXT_REGEX_STOP(r);
        }
        if (rc < 0) {
            if (rc == RS_ETOOBIG)
                RS_WARN("rid %s | output %d: stop_regex[%d] exceeded %u search steps at %zu bytes of text; it no "
                        "longer stops this output",
                        job->rid, output, r, RS_TOK_STOP_RE_MATCH_LIMIT, len);
            else
                RS_ERROR("rid %s | output %d: stop_regex[%d] could not search the output text (%s); it no longer "
                         "stops this output",
                         job->rid, output, r, rs_err_name(rc));
            o->re_from[r] = SIZE_MAX;
        } else if (advance) {
            o->re_from[r] = from;
        }
    }
    return -1;
}

/* Where the answer's text is cut for stop k when it was matched in the separate searched text:
 * the stop's first occurrence in text (SGLang's output.find(matched)), or nowhere. */
static void cut_in_text(rs_gen_text *t, rs_gen_text_out *o, int k) {
    const char *x = o->text.data ? o->text.data : "";
    size_t len = o->text.len, ms = len, me = len;
    if (k < t->n_stops) {
        const char *hit = len >= t->stop_lens[k] ? memmem(x, len, t->stops[k], t->stop_lens[k]) : NULL;
        if (hit) ms = (size_t)(hit - x), me = ms + t->stop_lens[k];
    } else {
        size_t from = 0, a, b;
        if (rs_tok_stop_re_find(t->regexes[k - RS_GEN_TEXT_REGEX_STOP(0)], x, len, &from, &a, &b) == 1) ms = a, me = b;
    }
    o->stop_pos = ms, o->stop_end = me;
}

int rs_gen_text_on_token(rs_gen_job *job, int output, int32_t token, void *user) {
    rs_gen_text *t = user;
    rs_gen_text_out *o = out_of(t, job, output);
    if (o->stop >= 0) return o->stop; /* its streams ended with the match */
    push(t, job, output, o, token);
    if (!rs_gen_text_has_stops(t)) return -1;
    const bool sep = separate_search(t);
    rs_tok_stream *ss = sep ? o->sstream : o->stream;
    rs_buf *sb = sep ? &o->stext : &o->text;
    /* what a re-decode of the output reads now: the final text and, after it, what is held */
    const size_t final_len = sb->len;
    const char *held = "";
    size_t n_held = rs_tok_stream_held_bytes(ss) <= RS_GEN_TEXT_PEEK_MAX ? rs_tok_stream_peek_finish(ss, &held) : 0;
    append(sb, held, n_held);
    const char *x = sb->data ? sb->data : "";
    int k = -1;
    if (t->n_stops > 0) {
        size_t pos;
        k = rs_tok_stop_find((const char *const *)t->stops, t->stop_lens, t->n_stops, x, sb->len, o->scanned, &pos);
        if (k >= 0) o->stop_pos = pos, o->stop_end = pos + t->stop_lens[k];
    }
    if (k < 0 && t->n_regexes > 0) k = find_regex(t, job, output, o, x, sb->len, n_held == 0);
    if (k < 0) {
        sb->len = final_len; /* the held part is searched again once it is final */
        if (sb->data) sb->data[final_len] = '\0';
        o->scanned = final_len;
        return -1;
    }
    /* the output ends on this token: its text is what was searched, the held part included */
    o->stop = k;
    finish_into(ss, sb, n_held);
    if (sep) {
        finish_into(o->stream, &o->text, 0);
        cut_in_text(t, o, k);
    }
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
    for (int k = 0; !t->hooked && k < g->n_output - (stop_token ? 1 : 0); k++) push(t, job, i, o, g->output_ids[k]);
    if (stop_token && t->no_stop_trim) push(t, job, i, o, g->output_ids[g->n_output - 1]);
    if (o->stream) finish_into(o->stream, &o->text, 0);
}

/* The text is cut at a matched stop unless the output finished otherwise: SGLang's length check
 * comes first (sglang_finish), and a length finish cuts nothing. */
static size_t visible_len(const rs_gen_text *t, const rs_gen_job *job, int i, const rs_gen_text_out *o) {
    const rs_finish *f = &job->outputs[i].finish;
    if (o->stop < 0 || (f->type != RS_FINISH_NONE && (f->type != RS_FINISH_STOP || f->matched_text != o->stop + 1)))
        return o->text.len;
    return t->no_stop_trim ? o->stop_end : o->stop_pos;
}

const char *rs_gen_text_get(rs_gen_text *t, const rs_gen_job *job, int i, size_t *len) {
    rs_gen_text_out *o = out_of(t, job, i);
    settle(t, job, i, o);
    *len = visible_len(t, job, i, o);
    return o->text.data ? o->text.data : "";
}

/* With a separate searched text: how much of the answer's text no cut can reach. A later match
 * cuts text at a stop's first occurrence in it, so nothing from the earliest match already in
 * text (t_hit), nor from where a stop may still begin to match, is shown. */
static size_t separate_stable(rs_gen_text *t, const rs_gen_job *job, int i, rs_gen_text_out *o) {
    const char *x = o->text.data ? o->text.data : "";
    const size_t len = o->text.len;
    for (int k = 0; k < t->n_stops && o->t_hit == SIZE_MAX; k++) {
        size_t sl = t->stop_lens[k], from = o->t_scanned >= sl - 1 ? o->t_scanned - (sl - 1) : 0;
        const char *hit = sl <= len && from <= len - sl ? memmem(x + from, len - from, t->stops[k], sl) : NULL;
        if (hit) o->t_hit = RS_MIN(o->t_hit, (size_t)(hit - x));
    }
    o->t_scanned = len;
    size_t n = len - rs_tok_stop_holdback((const char *const *)t->stops, t->stop_lens, t->n_stops, x, len);
    for (int r = 0; r < t->n_regexes; r++) {
        if (o->t_re_from[r] == SIZE_MAX) continue;
        size_t ms, me;
        int rc = rs_tok_stop_re_find(t->regexes[r], x, len, &o->t_re_from[r], &ms, &me);
        if (rc == 1) {
            o->t_hit = RS_MIN(o->t_hit, ms);
            o->t_re_from[r] = SIZE_MAX; /* its first match in text is known */
        } else if (rc < 0) {
            RS_WARN("rid %s | output %d: stop_regex[%d] could not search the output text (%s); its stream shows "
                    "nothing more until the output ends", job->rid, i, r, rs_err_name(rc));
            o->t_hit = RS_MIN(o->t_hit, o->t_re_from[r]);
            o->t_re_from[r] = SIZE_MAX;
        } else {
            n = RS_MIN(n, o->t_re_from[r]); /* a match may still start there */
        }
    }
    return RS_MIN(n, o->t_hit);
}

size_t rs_gen_text_stable(rs_gen_text *t, const rs_gen_job *job, int i, const char **text) {
    rs_gen_text_out *o = out_of(t, job, i);
    settle(t, job, i, o);
    *text = o->text.data ? o->text.data : "";
    if (o->settled || o->stop >= 0) return visible_len(t, job, i, o);
    if (separate_search(t)) return separate_stable(t, job, i, o);
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
