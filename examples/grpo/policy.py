"""The policy: a tiny Qwen3 (transformers' Qwen3ForCausalLM) trained in fp32 on BF16 weights.

rolloutd serves BF16 weights and computes in fp32 (docs/design.md "Numerics"); the trainer must
compute exactly that for its logprobs to equal the daemon's. So the trainer keeps two copies:

  - `master`: fp32 parameters, the ones the optimizer updates (small steps accumulate here);
  - `model`: the module the forward pass runs, whose fp32 parameters always hold bf16(master),
    i.e. the weights that were pushed, upcast exactly.

Gradients are taken with respect to the BF16-valued weights and applied to the master copy (the
usual mixed-precision arrangement), and after every optimizer step the model is refreshed from
the master and the same BF16 tensors are pushed to rolloutd. The logprobs the trainer computes are
therefore those of the policy rolloutd serves under BF16, bit for bit in the weights; what remains
between the two is fp32 summation order (about 1e-6 here).

Shapes (SHAPES): "smoke" for the tests, "demo" (3.2M parameters) for the RL runs, "large"
(31.5M) for the step-time benchmark. Every matrix dimension is a multiple of 128, so rolloutd's
128x128 FP8 weight blocks tile them exactly. Embeddings are tied (as in the small Qwen3 models);
the vocabulary is task.VOCAB.
"""
import json
import math
import pathlib

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

import task

SHAPES = {
    "smoke": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64),
    "demo": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64),
    "large": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=10, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64),
}


def config(shape, max_positions=64):
    return Qwen3Config(vocab_size=task.VOCAB, max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=task.BOS, eos_token_id=task.EOS,
                       pad_token_id=task.PAD, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       **SHAPES[shape])


def bf16_round(t):
    return t.detach().to(torch.bfloat16).to(torch.float32)


class Policy:
    """model (forward, BF16-valued fp32 weights) + master (fp32) + an AdamW over master."""

    def __init__(self, cfg, seed, state=None):
        torch.manual_seed(seed)
        self.cfg = cfg
        self.model = Qwen3ForCausalLM(cfg)
        self.model.train()
        if state is not None:  # {name: tensor} without the tied lm_head
            res = self.model.load_state_dict(state, strict=False)
            assert set(res.missing_keys) <= {"lm_head.weight"} and not res.unexpected_keys, res
        self.names = [n for n, _ in self.model.named_parameters()]  # tied lm_head is not listed
        self.params = [p for _, p in self.model.named_parameters()]
        self.master = [p.detach().clone().float() for p in self.params]
        self.opt = None
        self.refresh()

    def optimizer(self, lr, betas=(0.9, 0.99), weight_decay=0.0):
        for m in self.master:
            m.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.master, lr=lr, betas=betas, weight_decay=weight_decay)
        return self.opt

    def refresh(self):
        """model weights := bf16(master)."""
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(bf16_round(m))

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self, max_grad_norm=1.0, lr=None):
        """Moves the model's gradients to the master copy, clips, steps, refreshes the model.
        Returns the gradient norm before clipping."""
        for p, m in zip(self.params, self.master):
            m.grad = torch.zeros_like(m) if p.grad is None else p.grad.detach().float()
        norm = float(torch.nn.utils.clip_grad_norm_(self.master, max_grad_norm))
        if lr is not None:
            for g in self.opt.param_groups:
                g["lr"] = lr
        if math.isfinite(norm):
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.zero_grad()
        self.refresh()
        return norm

    def state_dict_bf16(self):
        """{HF name: bf16 tensor}: what is pushed to rolloutd and saved (no tied lm_head)."""
        return {n: p.detach().to(torch.bfloat16).contiguous() for n, p in zip(self.names, self.params)}

    def n_params(self):
        return sum(p.numel() for p in self.params)

    def save(self, directory):
        """config.json + model.safetensors (BF16): a model directory rolloutd and transformers load."""
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.cfg.save_pretrained(str(d))
        save_file(self.state_dict_bf16(), str(d / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((d / "config.json").read_text())
        cfg["dtype"] = "bfloat16"
        cfg["architectures"] = ["Qwen3ForCausalLM"]
        (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return d


def token_logprobs(model, seqs, prompt_len, temperature=1.0):
    """fp32 log_softmax(logits / T) of every generated token.

    seqs: LongTensor [B][T] of prompt (prompt_len tokens) + completion, right-padded (padding does
    not affect earlier positions: attention is causal). Returns [B][T - prompt_len]: entry t is the
    logprob of seqs[:, prompt_len + t] given everything before it (what rolloutd reports for that
    output token). Differentiable through the model's weights."""
    logits = model(input_ids=seqs, use_cache=False).logits.float()
    logits = logits[:, prompt_len - 1:-1]
    if temperature != 1.0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(-1, seqs[:, prompt_len:, None]).squeeze(-1)


@torch.no_grad()
def greedy(model, prompts, max_new, batch=256):
    """Greedy completions (lists of ids, each ending at its first EOS or at max_new tokens) of
    equal-length prompts, with transformers' KV-cached generate."""
    was_training = model.training
    model.eval()
    out = []
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i:i + batch], dtype=torch.long)
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=task.EOS, pad_token_id=task.PAD)
        for row in gen[:, ids.shape[1]:].tolist():
            out.append(row[:row.index(task.EOS) + 1] if task.EOS in row else row)
    model.train(was_training)
    return out


def evaluate(model, digit_strings):
    """(mean reward, exact accuracy) of greedy decoding on the given prompts."""
    outs = greedy(model, [task.prompt_ids(d) for d in digit_strings], task.MAX_NEW)
    scores = [task.reward(o, d) for o, d in zip(outs, digit_strings)]
    return sum(s[0] for s in scores) / len(scores), sum(s[1] for s in scores) / len(scores)
