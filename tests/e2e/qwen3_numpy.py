"""A float64 numpy forward pass of the tiny Qwen3 fixture (tests/fixtures/models/qwen3), written from
the architecture (Hugging Face's Qwen3ForCausalLM: RMSNorm, q/k RMSNorm per head, rotate-half RoPE,
GQA causal attention, SwiGLU MLP, tied embeddings), sharing no code with rolloutd. It gives the logits
the penalty tests reference against; check_against_golden() ties it to transformers' own numbers
(golden.json) before it is trusted.
"""
import json
import pathlib
import struct

import numpy as np

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3"


def load_safetensors(path):
    raw = pathlib.Path(path).read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hlen])
    data = raw[8 + hlen:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        assert t["dtype"] == "BF16", (name, t["dtype"])
        bits = np.frombuffer(data[a:b], dtype="<u2").astype(np.uint32) << 16
        out[name] = bits.view(np.float32).astype(np.float64).reshape(t["shape"])
    return out


class Qwen3:
    def __init__(self, directory=FIXTURE):
        self.cfg = json.loads((pathlib.Path(directory) / "config.json").read_text())
        self.w = load_safetensors(pathlib.Path(directory) / "model.safetensors")
        c = self.cfg
        self.hd = c["head_dim"]
        self.nh, self.nkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.eps = c["rms_norm_eps"]
        self.vocab = c["vocab_size"]

    def rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):  # x [T, heads, hd]
        half = self.hd // 2
        inv = 1.0 / (self.cfg["rope_theta"] ** (np.arange(0, self.hd, 2, dtype=np.float64) / self.hd))
        ang = np.outer(pos, inv)  # [T, half]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def logits(self, ids):
        """[len(ids), vocab]: the logits after every position of ids."""
        w, T = self.w, len(ids)
        x = w["model.embed_tokens.weight"][np.asarray(ids)]
        pos = np.arange(T, dtype=np.float64)
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = self.rms(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, self.nh, self.hd)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, self.nkv, self.hd)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, self.nkv, self.hd)
            q = self.rope(self.rms(q, w[p + "self_attn.q_norm.weight"]), pos)
            k = self.rope(self.rms(k, w[p + "self_attn.k_norm.weight"]), pos)
            group = self.nh // self.nkv
            att = np.empty((T, self.nh, self.hd))
            for hh in range(self.nh):
                s = q[:, hh] @ k[:, hh // group].T / np.sqrt(self.hd) + mask
                s = np.exp(s - s.max(axis=1, keepdims=True))
                att[:, hh] = (s / s.sum(axis=1, keepdims=True)) @ v[:, hh // group]
            x = x + att.reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = self.rms(x, w[p + "post_attention_layernorm.weight"])
            g = h @ w[p + "mlp.gate_proj.weight"].T
            u = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
        x = self.rms(x, w["model.norm.weight"])
        return x @ w["model.embed_tokens.weight"].T


def log_softmax(z):
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def check_against_golden(model, tol=1e-4):
    """Largest |logprob - transformers'| over the fixture's golden prompt logprobs (asserted < tol)."""
    golden = json.loads((FIXTURE / "golden.json").read_text())
    worst = 0.0
    for p in golden["prompts"]:
        ids = p["input_ids"]
        lg = model.logits(ids)
        for t in range(1, len(ids)):
            worst = max(worst, abs(log_softmax(lg[t - 1])[ids[t]] - p["prompt_logprobs"][t]))
    assert worst < tol, f"the numpy reference is {worst} away from transformers' golden logprobs"
    return worst
