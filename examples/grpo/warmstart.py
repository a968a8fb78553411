"""The supervised warm start: a few hundred steps of teacher forcing on (prompt, sorted answer)
pairs, stopped early on purpose so that the base policy solves some prompts and not others (GRPO
learns nothing from a group whose samples all score the same).

The loss is the mean negative logprob of the answer tokens (the sorted digits and EOS), computed
on the BF16-valued weights like every trainer forward (policy.py). Training prompts are drawn
from their own seed stream and never include a held-out string.
"""
import time

import numpy as np
import torch

import policy as pol
import task


def batch(digit_strings):
    """LongTensor [B][PROMPT_LEN + MAX_LEN + 1] of prompt + answer (right-padded with PAD) and the
    mask [B][MAX_LEN + 1] of real answer tokens."""
    width = task.MAX_LEN + 1
    rows, mask = [], []
    for d in digit_strings:
        a = task.answer_ids(d)
        rows.append(task.prompt_ids(d) + a + [task.PAD] * (width - len(a)))
        mask.append([1.0] * len(a) + [0.0] * (width - len(a)))
    return torch.tensor(rows, dtype=torch.long), torch.tensor(mask)


def train(policy, steps, seed, exclude, batch_size=64, lr=1e-3, warmup=20, log=None, eval_set=None,
          eval_every=0):
    """Runs `steps` supervised steps; returns the list of per-step records (also passed to log)."""
    policy.optimizer(lr)
    rng = np.random.default_rng([seed, 0x5f7])
    records = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        ids, mask = batch(task.draw(rng, batch_size, exclude))
        lp = pol.token_logprobs(policy.model, ids, task.PROMPT_LEN)
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()
        norm = policy.step(max_grad_norm=1.0, lr=lr * min(1.0, step / warmup))
        rec = {"step": step, "loss": loss.item(), "grad_norm": norm, "seconds": time.perf_counter() - t0}
        if eval_set is not None and eval_every and (step % eval_every == 0 or step == steps):
            rec["heldout_reward"], rec["heldout_acc"] = pol.evaluate(policy.model, eval_set)
        records.append(rec)
        if log is not None:
            log(rec)
    return records
