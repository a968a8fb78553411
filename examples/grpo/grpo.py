"""One GRPO run against rolloutd: the step, its loss with rollout correction, and its checks.

Each step s = 1, 2, ...:
  1. rollout: P prompts, each its own /generate request with n samples (a GRPO group), its own
     sampling seed (seed, s, prompt) and per-token rollout logprobs, all P sent at once so the
     daemon batches them; the served version must be s - 1;
  2. reward every sample (task.reward);
  3. group-normalized advantages A = (r - mean_group) / (std_group + 1e-6);
  4. the trainer recomputes the logprob of every sampled token in fp32 (policy.token_logprobs);
  5. policy-gradient loss, token-mean over the batch:
         loss = -sum_t w_t * A * logpi_theta(a_t) / #tokens
     with w_t a constant (no gradient) set by the correction:
         none  w_t = 1
         tis   w_t = min(rho_t, C),                      rho_t = exp(lp_train - lp_rollout)
         mis   w_t = rho_t * 1[1/C <= rho_t <= C]        (token-level MIS, IcePop)
     One optimizer step per rollout batch, so pi_old = pi_theta and the PPO ratio is 1: the
     surrogate reduces to this policy gradient, and rho_t is all that separates the sampler from
     the policy being optimized;
  6. an AdamW step on the fp32 master weights (policy.py);
  7. push_weights of the new BF16 weights over shm as version s; the answer must report s.

Checks, every step (a failure raises CheckFailed and ends the run, except the FP8 prediction,
which is recorded):
  - version: /get_weight_version is s - 1 before the rollout (the previous push was committed),
    every sample reports weight_version s - 1 over all its tokens, the push answers s;
  - BF16 rollouts: |lp_train - lp_rollout| <= 1e-4 on every token (rolloutd's BF16 numerics are
    fp32 math on BF16 weights, which the trainer repeats; a push that did not land, landed late or
    partly, or was rounded differently shows up here);
  - FP8 rollouts, every `check_every` steps: the measured mean |lp_train - lp_rollout| against
    what build/fp8-mismatch predicts for the same (served) weights; recorded with its ratio and
    whether it lies within a factor `fp8_band` (the tool samples random-token prompts and scores
    with an fp32 KV cache, so it predicts the W8A8 part of the mismatch on other contexts, not the
    FP8 KV part: an order-of-magnitude check, not an equality).
"""
import concurrent.futures as cf
import dataclasses
import json
import math
import os
import pathlib
import sys
import threading
import time

import numpy as np
import torch

import daemon as dmn
import policy as pol
import task

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python"))
from rolloutd_client import Client, tis  # noqa: E402

# run -> (rollout precision, correction)
RUNS = {"a": ("bf16", "none"), "b": ("fp8", "none"), "c": ("fp8", "tis"), "d": ("fp8", "mis")}
LABELS = {"a": "(a) BF16 rollouts", "b": "(b) FP8, no correction", "c": "(c) FP8 + TIS", "d": "(d) FP8 + MIS"}


class CheckFailed(AssertionError):
    pass


@dataclasses.dataclass
class Config:
    prompts: int = 16             # GRPO groups per step
    n: int = 8                    # samples per group
    max_new: int = task.MAX_NEW
    ignore_eos: bool = False      # True: every sample runs max_new tokens (the timing benchmark)
    temperature: float = 1.0
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    cap: float = 2.0              # C of TIS and of the MIS band [1/C, C]
    micro_batch: int = 128        # sequences per trainer forward/backward
    heldout: int = 512            # held-out prompts, greedy, scored every check_every steps
    check_every: int = 10         # 0: no held-out scoring and no fp8-mismatch check (benchmark)
    bf16_tol: float = 1e-4
    fp8_band: float = 3.0
    fp8_check_prompts: int = 16


class Rollout:
    """Concurrent /generate requests, one Client per worker thread (requests.Session is not
    shared between threads)."""

    def __init__(self, url, workers):
        self.url = url
        self.local = threading.local()
        self.pool = cf.ThreadPoolExecutor(max_workers=workers)

    def client(self):
        if not hasattr(self.local, "c"):
            self.local.c = Client(self.url, timeout=600)
        return self.local.c

    def one(self, prompt, cfg, seed):
        # ignore_eos: EOS is the model's eos_token_id (config.json), so leaving out stop_token_ids
        # and ignoring EOS makes every sample run max_new tokens
        return self.client().generate(prompt, n=cfg.n, max_new_tokens=cfg.max_new, temperature=cfg.temperature,
                                      sampling_seed=seed, ignore_eos=cfg.ignore_eos,
                                      stop_token_ids=None if cfg.ignore_eos else [task.EOS])

    def groups(self, prompts, cfg, seeds):
        futs = [self.pool.submit(self.one, p, cfg, s) for p, s in zip(prompts, seeds)]
        return [f.result() for f in futs]

    def close(self):
        self.pool.shutdown()


def sampling_seed(seed, step, i):
    return int(np.random.default_rng([seed, step, i, 0x5eed]).integers(1, 2**62))


def advantages(rewards):
    """[P][n] rewards -> group-normalized advantages [P][n]."""
    r = np.asarray(rewards, dtype=np.float64)
    return (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + 1e-6)


def correction_weights(kind, lp_train, lp_rollout, mask, cap):
    """The constant per-token weights w_t of the loss ([B][T] numpy, 0 at padding)."""
    if kind == "none":
        return mask.astype(np.float64)
    if kind == "tis":
        return tis.tis_weights(lp_train, lp_rollout, cap=cap, mask=mask)
    if kind == "mis":
        return tis.mis_weights(lp_train, lp_rollout, 1.0 / cap, cap, mask=mask)
    raise ValueError(f"correction must be none, tis or mis, got {kind!r}")


def pad(rows, value, width):
    return [r + [value] * (width - len(r)) for r in rows]


def train_step(policy, samples, adv, correction, cfg):
    """Forward/backward over all samples in micro-batches, then the optimizer step.
    samples: list of (prompt ids, GenerateResult); adv: one advantage per sample. Returns the
    per-sample trainer logprobs (numpy, detached), the loss and the gradient norm."""
    n_tok = sum(len(o.output_ids) for _, o in samples)
    lp_train, loss_sum = [], 0.0
    for i in range(0, len(samples), cfg.micro_batch):
        mb = samples[i:i + cfg.micro_batch]
        width = max(len(o.output_ids) for _, o in mb)
        ids = torch.tensor(pad([p + o.output_ids.tolist() for p, o in mb], task.PAD, task.PROMPT_LEN + width))
        roll = np.array(pad([o.output_logprobs.tolist() for _, o in mb], 0.0, width))
        mask = np.array(pad([[True] * len(o.output_ids) for _, o in mb], False, width))
        lp = pol.token_logprobs(policy.model, ids, task.PROMPT_LEN, cfg.temperature)
        lp_np = lp.detach().double().numpy()
        w = correction_weights(correction, lp_np, roll, mask, cfg.cap)
        a = torch.tensor(adv[i:i + len(mb)], dtype=torch.float32)[:, None]
        loss = -(torch.tensor(w, dtype=torch.float32) * a * lp).sum() / n_tok
        loss.backward()
        loss_sum += float(loss.detach())
        lp_train += [lp_np[j, :len(o.output_ids)] for j, (_, o) in enumerate(mb)]
    norm = policy.step(cfg.max_grad_norm)
    return lp_train, loss_sum, norm


def check_versions(outs, expected, served_before):
    """Every sample generated under `expected`, which the daemon served before the request."""
    if served_before != expected:
        raise CheckFailed(f"daemon served version {served_before!r} before the rollout, expected {expected!r}")
    seen = {}
    for o in outs:
        vs = {o.weight_version} | {v for v, _, _ in o.weight_versions}
        for v in vs:
            seen[v] = seen.get(v, 0) + 1
        if vs != {expected}:
            raise CheckFailed(f"sample {o.rid} reports versions {sorted(vs)}, expected only {expected!r}")
    return seen


def check_bf16(lp_train, lp_rollout, tol):
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(lp_train, lp_rollout) if len(a))
    if not worst <= tol:
        raise CheckFailed(f"BF16 rollout logprobs differ from the trainer's by {worst:.3g} > {tol:g}")
    return worst


def mismatch_metrics(lp_train, lp_rollout, cap):
    rep = tis.mismatch_report(lp_train, lp_rollout, cap=cap, low=1.0 / cap, high=cap)
    w = np.concatenate(tis.tis_weights(lp_train, lp_rollout, cap=cap))
    return {"mean_abs": rep["mean_abs_diff"], "max_abs": rep["max_abs_diff"], "mean": rep["mean_diff"],
            "kl_k1": rep["kl_k1"], "kl_k3": rep["kl_k3"], "ratio_mean": rep["ratio_mean"],
            "ratio_max": rep["ratio_max"], "share_outside": rep["mis_masked_share"],
            "share_above": rep["tis_clipped_share"],
            "tis_w": {"mean": float(w.mean()), "std": float(w.std()), "min": float(w.min()),
                      "max": float(w.max())}}


def fp8_prediction(ckpt, measured, step, cfg):
    """build/fp8-mismatch on the checkpoint of the weights the rollout was served with, against
    the measured mean |lp_train - lp_rollout|."""
    pred = dmn.fp8_mismatch(ckpt, cfg.fp8_check_prompts, task.PROMPT_LEN, cfg.max_new, seed=step)
    ratio = measured / pred["mean_abs"] if pred["mean_abs"] > 0 else math.inf
    pred.update(ratio=ratio, band=cfg.fp8_band, ok=bool(1.0 / cfg.fp8_band <= ratio <= cfg.fp8_band))
    return pred


def cpu_seconds(pid=None):
    """User + system CPU seconds of a process (all its threads): this one, or pid's from /proc."""
    if pid is None:
        return time.process_time()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Phases:
    """Wall and CPU seconds (trainer process, daemon process) of the named phases of a step."""

    def __init__(self, daemon_pid):
        self.pid, self.rec = daemon_pid, {}

    def now(self):
        return time.perf_counter(), cpu_seconds(), cpu_seconds(self.pid)

    def add(self, name, since):
        w, t, d = self.now()
        self.rec[f"t_{name}"] = w - since[0]
        self.rec[f"cpu_trainer_{name}"] = t - since[1]
        self.rec[f"cpu_daemon_{name}"] = d - since[2]
        return w, t, d


class Run:
    """One run: a daemon serving model_dir at the run's precision, the policy that holds the same
    weights, and the loop. Use as a context manager; step() does one GRPO step."""

    def __init__(self, run_id, policy, model_dir, workdir, seed, cfg, heldout=None, exclude=frozenset()):
        self.run_id, self.policy, self.seed, self.cfg = run_id, policy, seed, cfg
        self.precision, self.correction = RUNS[run_id]
        self.heldout, self.exclude = heldout, exclude
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        policy.optimizer(cfg.lr)
        c = policy.cfg  # KV pages for every sample at once, at f32 (the largest page format)
        kv_bytes = cfg.prompts * cfg.n * (task.PROMPT_LEN + cfg.max_new + 16) * c.num_hidden_layers * 2 * \
            c.num_key_value_heads * c.head_dim * 4
        self.daemon = dmn.Rolloutd(model_dir, self.precision, self.workdir / f"rolloutd-{run_id}.log",
                                   max_running=max(64, cfg.prompts * cfg.n),
                                   kv_cache_mb=max(64, math.ceil(1.25 * kv_bytes / 2**20)))
        self.control = Client(self.daemon.url, timeout=600)
        self.rollout = Rollout(self.daemon.url, workers=min(cfg.prompts, 64))
        self.steps_done = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.rollout.close()
        self.control.close()
        self.daemon.stop()

    def evaluate(self):
        """The step-0 record: held-out greedy reward and accuracy of the starting policy."""
        r, acc = pol.evaluate(self.policy.model, self.heldout)
        return {"run": self.run_id, "step": 0, "heldout_reward": r, "heldout_acc": acc}

    def step(self):
        cfg, policy = self.cfg, self.policy
        step = self.steps_done + 1
        expected = str(step - 1)
        rec = {"run": self.run_id, "step": step, "precision": self.precision, "correction": self.correction}
        ph = Phases(self.daemon.proc.pid)
        t0 = mark = ph.now()

        # 1. rollout, after checking that the previous push is what the daemon serves
        served_before = self.control.get_weight_version()
        digits = task.train_prompts(self.seed, step, cfg.prompts, self.exclude)
        prompts = [task.prompt_ids(dg) for dg in digits]
        groups = self.rollout.groups(prompts, cfg, [sampling_seed(self.seed, step, i) for i in range(len(prompts))])
        mark = ph.add("rollout", mark)
        outs = [o for g in groups for o in g]
        versions = check_versions(outs, expected, served_before)

        # 2-3. rewards and group-normalized advantages
        scores = [[task.reward(o.output_ids, dg) for o in g] for g, dg in zip(groups, digits)]
        rewards = [[s[0] for s in g] for g in scores]
        adv = advantages(rewards).ravel()
        samples = [(p, o) for p, g in zip(prompts, groups) for o in g]
        lp_roll = [o.output_logprobs for o in outs]
        fp8_check = self.precision == "fp8" and cfg.check_every > 0 and (step == 1 or step % cfg.check_every == 0)
        if fp8_check:  # a checkpoint of the served weights (version step - 1), for fp8-mismatch
            policy.save(self.workdir / "served")
        mark = ph.now()

        # 4-6. trainer logprobs, loss with correction, optimizer step
        lp_train, loss, norm = train_step(policy, samples, adv, self.correction, cfg)
        mark = ph.add("train", mark)
        mm = mismatch_metrics(lp_train, lp_roll, cfg.cap)
        if self.precision == "bf16":
            rec["bf16_max_abs"] = check_bf16(lp_train, lp_roll, cfg.bf16_tol)
        elif fp8_check:
            rec["fp8_predicted"] = fp8_prediction(self.workdir / "served", mm["mean_abs"], step, cfg)
        mark = ph.now()

        # 7. push the new weights as version `step`
        res = self.control.push_weights(policy.state_dict_bf16(), version=str(step))
        ph.add("push", mark)
        if res.weight_version != str(step):
            raise CheckFailed(f"push of version {step} answered {res.weight_version!r}")
        self.steps_done = step

        flat = [s for g in scores for s in g]
        rec.update(
            served_before=served_before, pushed_version=res.weight_version, sample_versions=versions,
            reward=float(np.mean([s[0] for s in flat])), acc=float(np.mean([s[1] for s in flat])),
            resp_len=float(np.mean([len(o.output_ids) for o in outs])),
            stopped=float(np.mean([o.finish_reason == "stop" for o in outs])),
            flat_groups=float(np.mean([np.std(r) == 0 for r in rewards])),
            loss=loss, grad_norm=norm, tokens=int(sum(len(o.output_ids) for o in outs)), mismatch=mm,
            push_bytes=res.bytes, push_server_s=res.server_seconds, **ph.rec)
        if not (math.isfinite(loss) and math.isfinite(rec["reward"])):
            raise CheckFailed(f"step {step}: loss {loss}, reward {rec['reward']}")
        if self.heldout is not None and cfg.check_every > 0 and step % cfg.check_every == 0:
            rec["heldout_reward"], rec["heldout_acc"] = pol.evaluate(policy.model, self.heldout)
        rec["t_step"] = time.perf_counter() - t0[0]
        return rec


def run(run_id, policy, model_dir, workdir, steps, seed, cfg, log, heldout=None, exclude=frozenset()):
    """Trains `policy` (already holding the weights in model_dir) for `steps` GRPO steps with the
    rollout precision and correction of RUNS[run_id], passing one record per step to log."""
    with Run(run_id, policy, model_dir, workdir, seed, cfg, heldout, exclude) as r:
        if heldout is not None:
            log(r.evaluate())
        for _ in range(steps):
            log(r.step())


class JsonlLog:
    """Appends one JSON object per line to path (flushed each record) and passes it to echo."""

    def __init__(self, path, echo=None):
        self.f, self.echo = open(path, "w"), echo

    def __call__(self, rec):
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        if self.echo:
            self.echo(rec)

    def close(self):
        self.f.close()
