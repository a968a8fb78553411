/*
 * setup.h — the engine options the settings ask for. main.c and the in-process benchmark
 * (tools/bench_inproc.c) both build their engine from here, so that a comparison between them
 * compares the same engine.
 */
#ifndef RS_SETUP_H
#define RS_SETUP_H

#include "../config/config.h"
#include "../scheduler/engine.h"

/* Fills *eo from the settings for a model whose max_position_embeddings is `max_position`
 * (max-context 0, or above it, means max_position; the latter with a warning). eo->weight_version
 * borrows c. */
void rs_setup_engine_opts(const rs_config *c, int max_position, rs_engine_opts *eo);

#endif /* RS_SETUP_H */
