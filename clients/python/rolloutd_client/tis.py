"""Rollout correction for the FP8-rollout / BF16-trainer mismatch: TIS and MIS weights (numpy).

rolloutd returns every sampled token with its rollout logprob (`output_token_logprobs`, by default
log_softmax(logits / T) before truncation). The trainer recomputes the same token's logprob under its
own policy (lp_train: pi_old in verl's decoupled mode, pi_theta in bypass mode) and reweights the
loss by the ratio rho_t = pi_train(a_t|s_t) / pi_rollout(a_t|s_t) = exp(lp_train - lp_rollout).
Definitions follow verl `docs/algo/rollout_corr_math.md` §3.3 and NeMo-RL `loss_functions.py`, as
FP8-RL (arXiv 2601.18150) trains with token-level TIS, C = 2:

  Token-TIS  w_t = min(rho_t, C)                                  tis_weights
  Token-MIS  w_t = rho_t * 1[lo <= rho_t <= hi] (IcePop)          mis_weights / mis_mask
  Seq-TIS    w   = min(prod_t rho_t, C)                           seq_tis_weights
  Seq-MIS    drop the sequence when prod_t rho_t > C              seq_mis_mask
  Geo-RS     drop the sequence when (prod_t rho_t)^(1/T) is outside [lo, hi]   geo_rs_mask

Log-ratios (and their per-sequence sums) are clamped to +-20 before exp, and padding positions get
weight 0 / are masked out, as verl does. The weights are constants in the loss (stop-gradient):
these helpers return numpy arrays, never tensors that carry gradients.

Inputs: lp_train and lp_rollout of the same shape, as 1-D arrays (one sequence), 2-D [batch][T]
arrays (padded; pass `mask`, True = a real token), or lists of 1-D arrays (ragged sequences; a
`mask` there is a list of rows as long as their sequences). A mask of another shape is a ValueError.
numpy arrays, lists or torch tensors (any device) are accepted; results are float64 numpy, in the
same layout (1-D / 2-D / list of 1-D) for token-level functions, and one value per sequence for
sequence-level ones (a scalar for a 1-D input).
"""
import numpy as np

LOG_RATIO_CLAMP = 20.0


def _np(x):
    if type(x).__module__.split(".")[0] == "torch":
        import torch
        return x.detach().to(device="cpu", dtype=torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _is_ragged(x):
    return isinstance(x, (list, tuple)) and len(x) > 0 and not np.isscalar(x[0]) and \
        not (hasattr(x[0], "ndim") and x[0].ndim == 0)


class _Batch:
    """delta = lp_train - lp_rollout as 2-D [B][T] float64 with a bool mask; `layout` remembers the
    input form so results go back the same way."""

    def __init__(self, lp_train, lp_rollout, mask=None):
        if _is_ragged(lp_train) or _is_ragged(lp_rollout):
            a, b = [_np(x).ravel() for x in lp_train], [_np(x).ravel() for x in lp_rollout]
            if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
                raise ValueError("lp_train and lp_rollout hold sequences of different lengths")
            self.lengths = [len(x) for x in a]
            T = max(self.lengths, default=0)
            self.delta = np.zeros((len(a), T))
            self.mask = np.zeros((len(a), T), dtype=bool)
            for i, (x, y) in enumerate(zip(a, b)):
                self.delta[i, :len(x)] = x - y
                self.mask[i, :len(x)] = True
            if mask is not None:  # one row per sequence, each as long as its sequence
                ms = [_np(m).ravel() for m in mask]
                if len(ms) != len(a) or any(len(m) != n for m, n in zip(ms, self.lengths)):
                    raise ValueError(f"mask rows {[len(m) for m in ms]} do not match the sequences' lengths "
                                     f"{self.lengths}")
                for i, m in enumerate(ms):
                    self.mask[i, :self.lengths[i]] &= m.astype(bool)
            self.layout = "list"
            return
        a, b = _np(lp_train), _np(lp_rollout)
        if a.shape != b.shape:
            raise ValueError(f"lp_train {a.shape} and lp_rollout {b.shape} differ in shape")
        if a.ndim not in (1, 2):
            raise ValueError(f"expected 1-D or 2-D logprobs, got shape {a.shape}")
        self.layout = "1d" if a.ndim == 1 else "2d"
        self.delta = (a - b)[None, :] if a.ndim == 1 else a - b
        m = np.ones(a.shape, dtype=bool) if mask is None else _np(mask).astype(bool)
        if m.shape != a.shape:
            raise ValueError(f"mask {m.shape} and logprobs {a.shape} differ in shape")
        self.mask = m.reshape(self.delta.shape)

    def log_ratio(self):
        return np.clip(self.delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    def tokens(self, x):
        """A [B][T] token-level result in the input's layout (padding zeroed/False)."""
        x = np.where(self.mask, x, np.zeros((), dtype=x.dtype))
        if self.layout == "1d":
            return x[0]
        if self.layout == "2d":
            return x
        return [x[i, :n] for i, n in enumerate(self.lengths)]

    def seqs(self, x):
        return x[0] if self.layout == "1d" else x

    def seq_log_ratio_sum(self):
        return np.where(self.mask, self.delta, 0.0).sum(axis=1)


def ratio(lp_train, lp_rollout, mask=None):
    """rho_t = exp(clamp(lp_train - lp_rollout, +-20)); 0 at padding."""
    b = _Batch(lp_train, lp_rollout, mask)
    return b.tokens(np.exp(b.log_ratio()))


def tis_weights(lp_train, lp_rollout, cap=2.0, mask=None):
    """Token-level truncated importance sampling: w_t = min(rho_t, cap) (FP8-RL / verl
    `rollout_is=token`, `rollout_is_threshold` = cap, default C = 2); 0 at padding."""
    b = _Batch(lp_train, lp_rollout, mask)
    return b.tokens(np.minimum(np.exp(b.log_ratio()), cap))


def mis_mask(lp_train, lp_rollout, low, high, mask=None):
    """Token-level masked importance sampling (IcePop; NeMo-RL `truncated_importance_sampling_type:
    icepop`, reference bounds 0.5-5): True where low <= rho_t <= high; tokens outside (and padding)
    are masked out of the loss."""
    b = _Batch(lp_train, lp_rollout, mask)
    r = np.exp(b.log_ratio())
    return b.tokens((r >= low) & (r <= high))


def mis_weights(lp_train, lp_rollout, low, high, mask=None):
    """Token-MIS weights: w_t = rho_t * 1[low <= rho_t <= high] (verl §3.3, IcePop)."""
    b = _Batch(lp_train, lp_rollout, mask)
    r = np.exp(b.log_ratio())
    return b.tokens(np.where((r >= low) & (r <= high), r, 0.0))


def seq_tis_weights(lp_train, lp_rollout, cap=2.0, mask=None):
    """Sequence-level TIS: w = min(prod_t rho_t, cap) per sequence (verl `rollout_is=sequence`); the
    log of the product (sum of log-ratios over real tokens) is clamped to +-20 before exp."""
    b = _Batch(lp_train, lp_rollout, mask)
    s = np.clip(b.seq_log_ratio_sum(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return b.seqs(np.minimum(np.exp(s), cap))


def seq_mis_mask(lp_train, lp_rollout, cap=2.0, low=None, mask=None):
    """Sequence-level MIS: keep a sequence (True) unless prod_t rho_t > cap (verl Seq-MIS,
    `decoupled_seq_is_rs()`); with `low`, also drop it when the product is below low."""
    b = _Batch(lp_train, lp_rollout, mask)
    s = b.seq_log_ratio_sum()
    keep = s <= np.log(cap)
    if low is not None:
        keep &= s >= np.log(low)
    return b.seqs(keep)


def geo_rs_mask(lp_train, lp_rollout, low, high, mask=None):
    """Geometric-mean rejection (verl Geo-RS; NeMo-RL seq-mask-tis, bounds ~0.999-1.002): keep a
    sequence when exp(mean_t log rho_t) over its real tokens lies in [low, high] (the mean log-ratio
    is clamped to +-20 before exp)."""
    b = _Batch(lp_train, lp_rollout, mask)
    n = b.mask.sum(axis=1)
    g = np.exp(np.clip(b.seq_log_ratio_sum() / np.maximum(n, 1), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return b.seqs((g >= low) & (g <= high) & (n > 0))


def mismatch_report(lp_train, lp_rollout, mask=None, cap=2.0, low=None, high=None):
    """Summary of the training-vs-rollout logprob mismatch over real tokens:
      n_tokens, mean_abs_diff / max_abs_diff / mean_diff of delta = lp_train - lp_rollout,
      kl_k1 = mean(lp_rollout - lp_train) and kl_k3 = mean(rho - 1 - log rho): estimates of
        KL(pi_rollout || pi_train) from tokens sampled by the rollout (k3 is never negative),
      ratio_mean, ratio_max of rho,
      tis_clipped_share: share of tokens with rho > cap (their TIS weight is clipped),
      mis_masked_share (when low and high are given): share outside [low, high].
    The delta statistics and kl_k1 are of delta as it is; rho (and so kl_k3 and the ratio and share
    figures) is exp(clamp(delta, +-20)), the ratio the weights above use."""
    b = _Batch(lp_train, lp_rollout, mask)
    d = b.delta[b.mask]
    n = int(d.size)
    rep = {"n_tokens": n}
    if n == 0:
        return rep
    c = np.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    r = np.exp(c)
    rep.update(mean_abs_diff=float(np.abs(d).mean()), max_abs_diff=float(np.abs(d).max()),
               mean_diff=float(d.mean()), kl_k1=float((-d).mean()), kl_k3=float((r - 1 - c).mean()),
               ratio_mean=float(r.mean()), ratio_max=float(r.max()),
               tis_clipped_share=float((r > cap).mean()))
    if low is not None and high is not None:
        rep["mis_masked_share"] = float(((r < low) | (r > high)).mean())
    return rep
