/*
 * gen_text.h — the text of a generation job's outputs, built while the tokens arrive: per output an
 * incremental detokenizer (tokenizer.h's stream), the text so far, and the stop strings matched on
 * it. It is the job's on_token hook (engine.h), so the engine stops an output as soon as a stop
 * string appears, and the scheduler never sees the tokenizer.
 *
 * The text of an output is its ids decoded after the prompt's last few (rs_tok_stream_prime), as
 * SGLang's and vLLM's detokenizers decode it: a SentencePiece tokenizer's first output token keeps
 * its leading space.
 *
 * Stop strings, as SGLang does them (python/sglang/srt/managers/schedule_batch.py check_finished
 * and detokenizer_manager.py trim_matched_stop, sgl-project/sglang mid 2026):
 *   - after every token they are searched in the output decoded so far, exactly what a re-decode
 *     of its ids reads (a held ByteFallback run or incomplete character included,
 *     rs_tok_stream_peek_finish), so a match that spans tokens is found on the token that
 *     completes it; the first stop string in the request's order that the new text holds wins;
 *     min_new_tokens does not hold them back. The held part is decoded again at every token, so
 *     it is searched only while it is at most RS_GEN_TEXT_PEEK_MAX bytes: a longer run of byte
 *     tokens (170 CJK characters written as bytes) is searched once it ends;
 *   - the searched text keeps special tokens when stops_see_special (/generate: SGLang re-decodes
 *     with tokenizer.decode's default, skip_special_tokens=False, so "<|im_end|>" stops an output
 *     whatever skip_special_tokens says) and is the answer's text otherwise (/v1/completions, as
 *     vLLM's check_stop_strings);
 *   - the output finishes "stop" with that string as `matched`; output_ids and the logprobs keep
 *     every token, the one that completed the match included;
 *   - the text ends where the match starts; with no_stop_trim it ends where the match ends (text
 *     the completing token carried past the stop string is dropped either way). When the searched
 *     text is not the answer's, the cut is at the stop string's first occurrence in the answer's
 *     text (SGLang's output.find(matched)), and nothing is cut when it does not occur there (a
 *     special token's own text);
 *   - an output ended by a stop token or EOS (matched = the id) has the text of the tokens before
 *     it; with no_stop_trim the stop token's text too (empty for a special token with
 *     skip_special_tokens).
 * Which finish wins when the last allowed token completes a stop is the engine's
 * (rs_sampling_params.sglang_finish); a finish other than this stop cuts nothing.
 *
 * Stop regexes (SGLang's stop_regex) are checked on the same text after the stop strings, in the
 * request's order, each from the earliest position where a match may still start
 * (rs_tok_stop_re_find); a match stops the output and cuts the text like a stop string (in the
 * answer's text, when it is not the searched one, where the regex first matches there).
 *
 * Cost per token: the stream's delta (O(1) amortized, tokenizer.h) plus a search of the new bytes,
 * the held bytes (at most RS_GEN_TEXT_PEEK_MAX) and the (longest stop - 1) bytes before them, i.e.
 * O(delta + held + total stop length). While an output runs, what may be shown of it
 * (rs_gen_text_stable) excludes a trailing part that could still become a stop string, so
 * streamed text never has to be taken back.
 *
 * Threads: the hook and the stable-text reads run on the engine thread (on_token, on_progress);
 * rs_gen_text_get settles a finished output on whichever thread writes the answer, after the
 * engine is done with the output. Nothing is locked: the engine's callbacks never overlap.
 */
#ifndef RS_PROTOCOL_GEN_TEXT_H
#define RS_PROTOCOL_GEN_TEXT_H

#include <stdbool.h>
#include <stddef.h>

#include "../core/rs.h"
#include "../scheduler/engine.h"
#include "../tokenizer/tokenizer.h"
#include "sse.h"

#define RS_GEN_TEXT_MAX_STOPS 64       /* stop strings per request */
#define RS_GEN_TEXT_MAX_STOP_LEN 1024  /* bytes per stop string or stop regex */
#define RS_GEN_TEXT_MAX_REGEXES 16     /* stop regexes per request */
#define RS_GEN_TEXT_REGEX_STOP(r) (RS_GEN_TEXT_MAX_STOPS + (r)) /* the hook's index of stop regex r */
#define RS_GEN_TEXT_PEEK_MAX 512       /* held bytes searched before they are final (see above) */

typedef struct rs_gen_text_out {
    rs_tok_stream *stream;      /* NULL until the output's first token */
    rs_buf text;                /* every delta of the stream so far */
    rs_tok_stream *sstream;     /* the searched text's own stream when it keeps special tokens and
                                 * text does not (rs_gen_text.stops_see_special); else NULL */
    rs_buf stext;               /* its deltas */
    /* With a separate searched text, what the answer's text may show while the output runs: the
     * cut (cut_in_text) is at a stop's first occurrence in text, which the searched text does not
     * locate, so text is watched too: */
    size_t t_scanned;           /* text [0, t_scanned) was searched for stop strings */
    size_t t_hit;               /* the earliest full stop match seen in text (SIZE_MAX: none) */
    size_t *t_re_from;          /* [n_regexes] as re_from, over text */
    size_t scanned;             /* the searched text [0, scanned) was searched for stop strings */
    size_t *re_from;            /* [n_regexes] no match of regex r starts before re_from[r]; SIZE_MAX: given up */
    int stop;                   /* the stop matched: a stop string's index, RS_GEN_TEXT_REGEX_STOP(r), or -1 */
    size_t stop_pos, stop_end;  /* where the text is cut: the match's start and end in text */
    bool settled;               /* finished: the stop token handled, the stream flushed */
} rs_gen_text_out;

typedef struct rs_gen_text {
    const rs_tok *tok;          /* borrowed: the server's tokenizer, which outlives every request */
    char **stops;               /* [n_stops] owned, NUL-terminated, non-empty */
    size_t *stop_lens;
    int n_stops;
    rs_tok_stop_re **regexes;   /* [n_regexes] owned */
    int n_regexes;
    bool no_stop_trim;
    bool skip_special_tokens;   /* default true, as SGLang and vLLM */
    bool stops_see_special;     /* stops are searched in the text with special tokens kept (/generate) */
    bool hooked;                /* the job's on_token feeds it; else outputs are decoded when they finish */
    int n_out;
    rs_gen_text_out *outs;      /* [n_out], allocated at the job's first token (after validation) */
} rs_gen_text;

/* A new, empty text state (skip_special_tokens on). */
rs_gen_text *rs_gen_text_new(const rs_tok *tok);
void rs_gen_text_free(rs_gen_text *t);

/* Adds a stop string; the empty string is ignored (SGLang's and the neutral value). RS_EINVAL with
 * err naming `param` when there are too many or one is too long. */
int rs_gen_text_add_stop(rs_gen_text *t, const char *s, size_t len, const char *param, rs_error *err);

/* Adds a stop regex (sampling_params.stop_regex, SGLang's): the output stops once the regex finds
 * a match in its text, checked after every token as stop strings are (and after them: a stop
 * string completed by the same token wins); the text is cut where the match starts (with
 * no_stop_trim, where it ends) and `matched` is the pattern. The empty pattern is ignored.
 * RS_EINVAL naming `param` for a pattern that does not compile, is too long, or one too many. A
 * search that exceeds its step limit (rs_tok_stop_re_find) is logged, and that regex stops
 * nothing more in that output. */
int rs_gen_text_add_stop_regex(rs_gen_text *t, const char *s, size_t len, const char *param, rs_error *err);

/* True when t has stop strings or stop regexes. */
bool rs_gen_text_has_stops(const rs_gen_text *t);

/* Makes t the job's on_token hook: needed for stop strings and streamed text. Without it (a plain
 * answer without stop strings) each output is decoded once it has finished, on the thread that
 * writes the answer, and the engine thread does no text work for it. */
void rs_gen_text_attach(rs_gen_text *t, rs_gen_job *job);

/* The hook itself (engine.h's rs_job_token_fn; user = the rs_gen_text). */
int rs_gen_text_on_token(rs_gen_job *job, int output, int32_t token, void *user);

/* Output i's text as the answer gives it (trimmed as above); settles the output first when it
 * has finished. Borrowed until t changes; "" for an output without tokens. */
const char *rs_gen_text_get(rs_gen_text *t, const rs_gen_job *job, int i, size_t *len);

/* How many bytes of output i's text are final: all of rs_gen_text_get's once it has finished or
 * matched a stop string, else all but a trailing part that may still become a stop string. *text
 * gets the text (borrowed). */
size_t rs_gen_text_stable(rs_gen_text *t, const rs_gen_job *job, int i, const char **text);

/* The stop string (or stop regex pattern) of a finish with matched_text = k + 1 (borrowed), or
 * NULL. */
const char *rs_gen_text_stop_string(const rs_gen_text *t, const rs_finish *f);

/* Number of code points in s[0, n) (UTF-8; vLLM's text offsets count characters). */
size_t rs_utf8_chars(const char *s, size_t n);

#endif /* RS_PROTOCOL_GEN_TEXT_H */
