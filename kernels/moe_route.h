/*
 * moe_route.h — the host half of the Qwen3-MoE sparse block, shared by the CPU and CUDA backends:
 * turning one row's router logits into its top-k experts and weights, and grouping the chosen
 * (row, weight) pairs by expert. Both backends compute the router logits on their own device and
 * the expert MLPs with their own matmuls; routing is the same host code, so the same logits give
 * the same experts on both.
 */
#ifndef RS_MOE_ROUTE_H
#define RS_MOE_ROUTE_H

#include <stdbool.h>
#include <stdint.h>

/* Softmax of logits [n] in place (fp32, max-subtracted, e / sum), then the k largest probabilities
 * into sel_e / sel_w [k] in descending order, ties to the lower expert index (what torch.topk does
 * in practice); with norm, the k weights are divided by their sum. */
void rs_moe_route_row(float *logits, int n, int k, bool norm, int32_t *sel_e, float *sel_w);

/* Counting sort of the n_rows x k selections by expert, rows in ascending order within an expert:
 * expert e's pairs are rows[offsets[e] .. offsets[e+1]) with weights wts[...].
 * offsets [n_experts + 1], fill [n_experts] (scratch), rows / wts [n_rows * k]. */
void rs_moe_group(const int32_t *sel_e, const float *sel_w, int n_rows, int k, int n_experts, int32_t *offsets,
                  int32_t *fill, int32_t *rows, float *wts);

#endif /* RS_MOE_ROUTE_H */
