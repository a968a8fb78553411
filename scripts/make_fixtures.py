#!/usr/bin/env python3
"""Generate the golden fixtures that rolloutd's forward pass is tested against.

    /opt/fxvenv/bin/python scripts/make_fixtures.py        # (PyTorch + transformers + safetensors)

For each architecture this builds a tiny random-weight model, rounds every weight to BF16, saves it
with save_pretrained (BF16 safetensors) into tests/fixtures/models/<name>/, rewrites config.json into
the layout that real Hugging Face Hub checkpoints use, checks the tensor names and shapes rolloutd's
loader expects, reloads the directory with transformers in fp32 and writes golden.json: prompt
logprobs, a 32-token greedy continuation with its logprobs and top-1/top-2 logit gaps, and the top 5
next-token logprobs after each prompt. Everything is computed in fp32 from the BF16 weights (BF16
upcasts to fp32 exactly). Re-running gives byte-identical files; CI never needs PyTorch.

FP8. Beside golden.json every model gets golden_fp8.json (same structure, same prompts): the same
transformers fp32 forward with rolloutd's W8A8 FP8 numerics emulated (docs/design.md "Numerics"):
attention q/k/v/o, MLP gate/up/down and MoE expert weights quantized to E4M3 in 128x128 blocks, and
the input of every such GEMM quantized dynamically per token in 1x128 groups; embeddings, lm_head,
norms, biases and the MoE router stay unquantized. The emulation is checked to reproduce golden.json
bit-for-bit when its quantizers are replaced by the identity. tests/fixtures/models/qwen3_fp8/ is
the qwen3 model as a pre-quantized FP8 checkpoint (F8_E4M3 weights + F32 `weight_scale_inv`,
`quantization_config` in config.json, the Qwen3-FP8 / DeepSeek-V3 format); its expected outputs
are qwen3/golden_fp8.json (same weights, same math; checked here). golden_fp8.json also records,
per prompt, how many leading prompt logprobs / greedy steps survive rounding-level perturbations
(FP8_STABLE_*: beyond them a correct implementation may legitimately differ by a flipped E4M3 code).

Perturbed weights. tests/fixtures/models/qwen3/perturbed/ is a loadable model directory holding
qwen3's weights after a pretend training step: every tensor w becomes bf16(w + PERTURB_REL * std(w) *
randn) (seeded), saved with the same Hub names, plus config.json / generation_config.json copied from
qwen3/ and its own golden.json and golden_fp8.json (same prompts as qwen3's, same computations).
tests/e2e/test_weight_sync.py pushes these weights into a daemon serving qwen3/ and checks that it then
reproduces them. It is rebuilt after qwen3/ (whose rebuild removes it), or alone:

    /opt/fxvenv/bin/python scripts/make_fixtures.py qwen3/perturbed
"""
import json
import math
import os
import pathlib
import shutil
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "models"

PROMPT_LENS = [1, 7, 33, 100]
GREEDY_STEPS = 32
WEIGHT_STD = 0.1   # linear layers and router: large enough that logits have real spread
EMBED_STD = 0.25   # embeddings / lm_head: logits ~ N(0, hidden * std^2) before the final norm
BIAS_STD = 0.1     # Qwen2 q/k/v biases (transformers initializes them to zero)
NORM_STD = 0.1     # RMSNorm weights are 1 + NORM_STD * randn so a missing norm is caught

COMMON = dict(vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6, hidden_act="silu",
              initializer_range=WEIGHT_STD, bos_token_id=None)

# name -> (config class, model class, config kwargs, "rope_scaling" as written in the Hub config)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
SPECS = {
    # head_dim 32 with hidden 96 and 4 heads: q_proj is [128][96], o_proj [96][128] (head_dim is
    # explicit, not hidden / heads). Tied embeddings.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM,
              dict(hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, eos_token_id=511,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
              None),
    # q/k/v biases (randomized), untied, head_dim = hidden / heads = 32.
    "qwen2": (Qwen2Config, Qwen2ForCausalLM,
              dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=False, eos_token_id=510,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
              None),
    # Llama 3 rope scaling; with head_dim 32 and theta 5e5 the wavelengths are 6.3, 14.3 (kept,
    # < 64/4), 32.4 (smoothed, between 16 and 64) and >= 73 (divided by 8): all three regimes.
    # GQA 4:1. Untied.
    "llama3": (LlamaConfig, LlamaForCausalLM,
               dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
                    attention_bias=False, mlp_bias=False, eos_token_id=509,
                    rope_parameters=dict(LLAMA3_SCALING, rope_theta=500000.0)),
               LLAMA3_SCALING),
    # 8 experts, top-2, normalized top-k; layer 1 is a dense MLP (mlp_only_layers) using
    # intermediate_size; layers 0 and 2 are sparse with moe_intermediate_size.
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, eos_token_id=508,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
                  None),
}
SEEDS = {"qwen3": 1001, "qwen2": 1002, "llama3": 1003, "qwen3_moe": 1004}


def is_norm(name):
    return name.endswith("norm.weight")


def randomize(model, seed):
    """Deterministic weights independent of transformers' init: every parameter in name order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if is_norm(name):
                v = 1.0 + NORM_STD * r
            elif name.endswith(".bias"):
                v = BIAS_STD * r
            elif "embed_tokens" in name or name.startswith("lm_head"):
                v = EMBED_STD * r
            else:
                v = WEIGHT_STD * r
            p.copy_(v.to(torch.bfloat16).to(torch.float32))


def hub_config(path, rope_scaling):
    """transformers 5 writes rope_parameters / num_local_experts; real Hub checkpoints (what the
    loader must read) have top-level rope_theta, rope_scaling and num_experts. Rewrite to that."""
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = rope_scaling
    if "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg["torch_dtype"] = cfg.pop("dtype", "bfloat16")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg


def expected_tensors(cfg):
    """Name -> shape of every tensor rolloutd's loader reads (Hub layout, per-expert MoE)."""
    H, V, hd = cfg["hidden_size"], cfg["vocab_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    nh, nkv, I = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    arch = cfg["architectures"][0]
    t = {"model.embed_tokens.weight": [V, H], "model.norm.weight": [H]}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = [V, H]
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        t[p + "input_layernorm.weight"] = [H]
        t[p + "post_attention_layernorm.weight"] = [H]
        t[p + "self_attn.q_proj.weight"] = [nh * hd, H]
        t[p + "self_attn.k_proj.weight"] = [nkv * hd, H]
        t[p + "self_attn.v_proj.weight"] = [nkv * hd, H]
        t[p + "self_attn.o_proj.weight"] = [H, nh * hd]
        if arch == "Qwen2ForCausalLM":
            t[p + "self_attn.q_proj.bias"] = [nh * hd]
            t[p + "self_attn.k_proj.bias"] = [nkv * hd]
            t[p + "self_attn.v_proj.bias"] = [nkv * hd]
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            t[p + "self_attn.q_norm.weight"] = [hd]
            t[p + "self_attn.k_norm.weight"] = [hd]
        moe = (arch == "Qwen3MoeForCausalLM" and L not in cfg["mlp_only_layers"]
               and cfg["num_experts"] > 0 and (L + 1) % cfg["decoder_sparse_step"] == 0)
        if moe:
            E, Im = cfg["num_experts"], cfg["moe_intermediate_size"]
            t[p + "mlp.gate.weight"] = [E, H]
            for e in range(E):
                t[p + f"mlp.experts.{e}.gate_proj.weight"] = [Im, H]
                t[p + f"mlp.experts.{e}.up_proj.weight"] = [Im, H]
                t[p + f"mlp.experts.{e}.down_proj.weight"] = [H, Im]
        else:
            t[p + "mlp.gate_proj.weight"] = [I, H]
            t[p + "mlp.up_proj.weight"] = [I, H]
            t[p + "mlp.down_proj.weight"] = [H, I]
    return t


def check_tensors(d, cfg):
    want = expected_tensors(cfg)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        got = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        meta = f.metadata()
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert not missing and not extra, f"{d.name}: missing {missing[:5]} extra {extra[:5]}"
    bad = [k for k in want if want[k] != got[k]]
    assert not bad, f"{d.name}: shape mismatch {[(k, want[k], got[k]) for k in bad[:5]]}"
    assert dtypes == {"BF16"}, dtypes
    return len(got), meta


def load_fp32(d, moe):
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    if moe:
        kw["experts_implementation"] = "eager"
    m = AutoModelForCausalLM.from_pretrained(str(d), **kw)
    m.eval()
    return m


@torch.no_grad()
def logits_of(model, ids):
    x = torch.tensor([ids], dtype=torch.long)
    return model(input_ids=x, use_cache=False).logits[0].to(torch.float32)


@torch.no_grad()
def router_margin(model, ids):
    """Smallest gap between the k-th and (k+1)-th router probability over all tokens and sparse
    layers: a tiny margin would make expert selection implementation-sensitive."""
    out = model(input_ids=torch.tensor([ids]), use_cache=False, output_router_logits=True)
    k = model.config.num_experts_per_tok
    best = math.inf
    for rl in out.router_logits or ():
        p = torch.softmax(rl.float(), dim=-1).sort(dim=-1, descending=True).values
        best = min(best, float((p[:, k - 1] - p[:, k]).min()))
    return best


def golden_prompt(model, ids):
    lg = logits_of(model, ids)
    lp = torch.log_softmax(lg, dim=-1)
    prompt_lps = [None] + [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
    top = torch.topk(lp[-1], 5)
    last_top5 = {"ids": [int(i) for i in top.indices], "logprobs": [float(v) for v in top.values]}
    # Greedy: re-run the full sequence each step (no KV cache), fp32, argmax; EOS never stops it.
    seq = list(ids)
    g_ids, g_lps, gaps = [], [], []
    for _ in range(GREEDY_STEPS):
        step = logits_of(model, seq)[-1]
        t2 = torch.topk(step, 2)
        tok = int(t2.indices[0])
        g_ids.append(tok)
        g_lps.append(float(torch.log_softmax(step, dim=-1)[tok]))
        gaps.append(float(t2.values[0] - t2.values[1]))
        seq.append(tok)
    spread = float(lg.std(dim=-1).mean())
    return {"input_ids": list(ids), "prompt_logprobs": prompt_lps, "greedy_ids": g_ids,
            "greedy_logprobs": g_lps, "top2_gaps": gaps, "last_top5": last_top5}, spread, seq


def llama3_inv_freq_report(cfg_kw, model):
    hd = cfg_kw["head_dim"]
    theta = cfg_kw["rope_parameters"]["rope_theta"]
    base = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    scaled = model.model.rotary_emb.inv_freq.float()
    ratio = (base / scaled).tolist()
    kept = sum(1 for r in ratio if abs(r - 1) < 1e-6)
    full = sum(1 for r in ratio if abs(r - 8) < 1e-4)
    print(f"    llama3 inv_freq base/scaled ratio: {' '.join(f'{r:.3f}' for r in ratio)}")
    print(f"    -> {kept} kept, {len(ratio) - kept - full} smoothed, {full} divided by 8")
    assert kept and full and len(ratio) - kept - full, "llama3 scaling does not exercise all regimes"


def dump_golden(g):
    """JSON with one line per field of each prompt (floats via repr: full precision)."""
    lines = ["{"]
    for k in g:  # top-level fields in insertion order, "prompts" last
        if k != "prompts":
            lines.append(f" {json.dumps(k)}: {json.dumps(g[k])},")
    lines.append(' "prompts": [')
    for i, p in enumerate(g["prompts"]):
        fields = [f"  {json.dumps(k)}: {json.dumps(v, separators=(', ', ': '))}" for k, v in p.items()]
        lines.append("  {\n" + ",\n".join(" " + f for f in fields) + "\n  }" + ("," if i + 1 < len(g["prompts"]) else ""))
    lines.append(" ]")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == g
    return text


def build(name):
    cfg_cls, model_cls, kw, rope_scaling = SPECS[name]
    seed = SEEDS[name]
    d = OUT / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    moe = model_cls is Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = cfg_cls(**COMMON, **kw)
    cfg._attn_implementation = "eager"
    if moe:
        cfg._experts_implementation = "eager"
    model = model_cls(cfg).to(torch.float32).eval()
    randomize(model, seed)
    probe = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
    ref = logits_of(model, probe)

    model.to(torch.bfloat16).save_pretrained(str(d), safe_serialization=True)
    for f in d.iterdir():
        os.chmod(f, 0o644)  # save_pretrained leaves model.safetensors 0600
    hub = hub_config(d / "config.json", rope_scaling)
    n_tensors, meta = check_tensors(d, hub)

    m = load_fp32(d, moe)
    diff = float((logits_of(m, probe) - ref).abs().max())
    assert diff <= 1e-6, f"{name}: reloaded Hub-layout model differs from the in-memory one by {diff}"
    if name == "llama3":
        llama3_inv_freq_report(kw, m)

    g = torch.Generator().manual_seed(seed + 7)
    prompts, spreads, gaps, margins = [], [], [], []
    for n in PROMPT_LENS:
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
        p, spread, full_seq = golden_prompt(m, ids)
        prompts.append(p)
        spreads.append(spread)
        gaps += p["top2_gaps"]
        if moe:
            margins.append(router_margin(m, full_seq))
    golden = {"arch": hub["architectures"][0], "transformers_version": transformers.__version__,
              "torch_version": torch.__version__, "prompts": prompts}
    (d / "golden.json").write_text(dump_golden(golden))

    size = sum(f.stat().st_size for f in d.iterdir())
    all_lps = [x for p in prompts for x in p["prompt_logprobs"][1:]]
    print(f"  {name:10s} {hub['architectures'][0]:20s} {n_tensors:3d} tensors {size / 1024:7.1f} KiB "
          f"metadata={meta} reload diff={diff:.1e}")
    print(f"    logit std (mean over positions) {min(spreads):.3f}..{max(spreads):.3f}; prompt logprob "
          f"range {min(all_lps):.2f}..{max(all_lps):.2f}; greedy gaps min {min(gaps):.2e} "
          f"median {sorted(gaps)[len(gaps) // 2]:.3f}; gaps < 1e-3: {sum(x < 1e-3 for x in gaps)}")
    print(f"    greedy distinct tokens per prompt {[len(set(p['greedy_ids'])) for p in prompts]}")
    if moe:
        print(f"    min router top-{hub['num_experts_per_tok']} margin (prob) {min(margins):.2e}")


# ------------------------------------------------------------------------------------------------
# FP8 (W8A8, E4M3) emulation: rolloutd's numerics (docs/design.md "Numerics") on top of the transformers
# fp32 forward. Every step below is a correctly rounded fp32 operation (torch's fp32 division, also by
# a Python scalar, is IEEE division; its float32 -> float8_e4m3fn cast is round-to-nearest-even and
# matches ml_dtypes bit-for-bit once the input is clamped to +-448, which is what rolloutd's
# saturating encoder does).

FP8_MAX = 448.0
FP8_BLOCK = 128
FP8_AMAX_FLOOR = 1e-10
FP8_QUANT_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
FP8_DESCRIPTION = ("W8A8 FP8 E4M3 (rolloutd --quantization fp8): q/k/v/o, gate/up/down and MoE expert "
                   "weights in 128x128 blocks, GEMM inputs dynamic per token in 1x128 groups; embeddings, "
                   "lm_head, norms, biases, router unquantized")
# Stability of the FP8 reference. The W8A8 network is discontinuous: an activation whose x / s lies
# within an fp32 rounding of an E4M3 rounding midpoint can round either way in two correct
# implementations, and one flipped code changes that token's next GEMM outputs by ~1e-3 relative, which
# flips more codes downstream and in every later position (through the KV cache) -- logprobs then
# differ by up to ~0.5, as much as FP8 vs BF16. To tell rolloutd where a 1e-3 comparison is meaningful,
# the emulation is re-run FP8_STABLE_RUNS times with every GEMM output multiplied by
# (1 + u * N(0,1)), u alternating over FP8_STABLE_NOISE (one or two fp32 roundings: what a different
# summation order does); a prompt logprob or greedy step is "stable" if it and everything before it
# stay within FP8_STABLE_DEV of the reference in all runs. Against rolloutd's CPU path (first FP8 build) every
# divergence > 1e-3 it showed fell outside these prefixes; fewer runs or only 2^-24 missed some.
FP8_STABLE_RUNS = 96
FP8_STABLE_NOISE = (2.0 ** -24, 2.0 ** -23)
FP8_STABLE_DEV = 1e-4
# BF16 fixture -> directory of the same model as a pre-quantized FP8 checkpoint.
FP8_CHECKPOINTS = {"qwen3": "qwen3_fp8"}
FP8_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def fp8_is_quantized(name):
    """Checkpoint (Hub layout) tensor names that rolloutd stores as FP8."""
    if not name.endswith(".weight"):
        return False
    mod = name[:-len(".weight")]
    if ".mlp.experts." in mod:
        return mod.rsplit(".", 1)[1] in ("gate_proj", "up_proj", "down_proj")
    return mod.endswith(FP8_LINEARS)


def sat_e4m3(x):
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_scale(amax):
    return torch.clamp_min(amax, FP8_AMAX_FLOOR) / FP8_MAX


def expand_blocks(s, rows, cols):
    return s.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]


def quantize_weight(w):
    """w: fp32 [out][in] -> (q float8_e4m3fn [out][in], scale_inv fp32 [ceil(out/128)][ceil(in/128)]);
    one scale per 128x128 block, partial blocks at the ragged edges."""
    assert w.dim() == 2 and w.dtype == torch.float32
    rows, cols = w.shape
    nbo, nbi = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    s = torch.empty(nbo, nbi, dtype=torch.float32)
    for bo in range(nbo):
        for bi in range(nbi):
            blk = w[bo * FP8_BLOCK:(bo + 1) * FP8_BLOCK, bi * FP8_BLOCK:(bi + 1) * FP8_BLOCK]
            s[bo, bi] = fp8_scale(blk.abs().max())
    q = sat_e4m3(w / expand_blocks(s, rows, cols))
    return q, s


def dequantize_weight(q, s):
    return q.to(torch.float32) * expand_blocks(s, *q.shape)


def fp8_weight(w):
    return dequantize_weight(*quantize_weight(w.detach().to(torch.float32)))


def fp8_act(x):
    """Dynamic activation quantization: per token (every index but the last), 1x128 groups along the
    last dimension (the GEMM's K; last group ragged); returns the dequantized fp32 values."""
    parts = []
    for k0 in range(0, x.shape[-1], FP8_BLOCK):
        g = x[..., k0:k0 + FP8_BLOCK]
        s = fp8_scale(g.abs().amax(dim=-1, keepdim=True))
        parts.append(sat_e4m3(g / s).to(torch.float32) * s)
    return torch.cat(parts, dim=-1)


def identity(x):
    return x


PERTURB = {"gen": None, "u": 0.0}  # set by fp8_stability while perturbed runs are computed


def gemm(x, w, b=None):
    y = F.linear(x, w, b)
    if PERTURB["gen"] is not None:
        y = y * (1 + PERTURB["u"] * torch.randn(y.shape, generator=PERTURB["gen"]))
    return y


class EmulatedLinear(torch.nn.Module):
    """y = act(x) @ W^T (+ bias), W already dequantized (or the original weight)."""

    def __init__(self, lin, weight, act):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.bias = lin.bias
        self.act = act

    def forward(self, x):
        return gemm(self.act(x), self.weight, self.bias)


def emulated_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' eager Qwen3MoeExperts.forward, with the expert weights replaced by their FP8
    round trip and each expert GEMM's input (the token's hidden state; the SwiGLU output) quantized."""
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = self.emu_act(hidden_states[token_idx])
        gate, up = gemm(current_state, self.emu_gate_up[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = gemm(self.emu_act(current_hidden_states), self.emu_down[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states


@torch.no_grad()
def emulate(model, quantize=True, stored=None):
    """Swap the quantized projections of a loaded fp32 model for their emulation, in place.
    quantize=False: identity quantizers (must reproduce the unquantized model exactly).
    stored: {checkpoint name: dequantized fp32 weight} from an FP8 checkpoint, used instead of
    quantizing the in-memory weights (dense models only)."""
    wq = fp8_weight if quantize else (lambda w: w.detach().clone())
    act = fp8_act if quantize else identity
    n = 0
    for L, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{L}."
        for path in FP8_LINEARS:
            parent_path, attr = path.split(".")
            parent = getattr(layer, parent_path)
            lin = getattr(parent, attr, None)
            if not isinstance(lin, torch.nn.Linear):
                continue
            w = stored[prefix + path + ".weight"] if stored is not None else wq(lin.weight)
            setattr(parent, attr, EmulatedLinear(lin, w, act))
            n += 1
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            assert stored is None, "FP8 checkpoints of MoE models are not emulated here"
            gu, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
            I = experts.intermediate_dim
            # In the checkpoint (and in rolloutd) gate and up are separate [I][H] matrices with their
            # own 128x128 blocks: quantize them separately, then fuse for transformers' layout.
            experts.emu_gate_up = torch.stack([torch.cat([wq(gu[e, :I]), wq(gu[e, I:])]) for e in range(gu.shape[0])])
            experts.emu_down = torch.stack([wq(down[e]) for e in range(down.shape[0])])
            experts.emu_act = act
            experts.forward = emulated_experts_forward.__get__(experts)
            n += 3 * gu.shape[0]
    return n


@torch.no_grad()
def routing_of(model, ids):
    """Top-k expert sets per sparse layer and token."""
    out = model(input_ids=torch.tensor([ids]), use_cache=False, output_router_logits=True)
    k = model.config.num_experts_per_tok
    return [torch.topk(rl.float(), k, dim=-1).indices.sort(dim=-1).values for rl in out.router_logits or ()]


def fp8_stability(model, prompts):
    """Adds "stable_prompt_logprobs" (how many leading entries of prompt_logprobs[1:]) and
    "stable_greedy_steps" to each prompt: the prefix that FP8_STABLE_RUNS perturbed runs reproduce."""
    for p in prompts:
        p["stable_prompt_logprobs"] = len(p["input_ids"]) - 1
        p["stable_greedy_steps"] = GREEDY_STEPS
    for run in range(FP8_STABLE_RUNS):
        PERTURB["gen"] = torch.Generator().manual_seed(run)
        PERTURB["u"] = FP8_STABLE_NOISE[run % len(FP8_STABLE_NOISE)]
        for p in prompts:
            q, _, _ = golden_prompt(model, p["input_ids"])
            bad = [i for i, (a, b) in enumerate(zip(q["prompt_logprobs"][1:], p["prompt_logprobs"][1:]))
                   if abs(a - b) > FP8_STABLE_DEV]
            p["stable_prompt_logprobs"] = min([p["stable_prompt_logprobs"]] + bad[:1])
            bad = [i for i in range(GREEDY_STEPS) if q["greedy_ids"][i] != p["greedy_ids"][i]
                   or abs(q["greedy_logprobs"][i] - p["greedy_logprobs"][i]) > FP8_STABLE_DEV]
            p["stable_greedy_steps"] = min([p["stable_greedy_steps"]] + bad[:1])
    PERTURB["gen"] = None
    for p in prompts:
        # Greedy step 0 reads the last prompt position: once a prompt position is unstable, a flip
        # there reaches every greedy step through the KV cache, whatever the perturbed runs showed.
        if p["stable_prompt_logprobs"] < len(p["input_ids"]) - 1:
            p["stable_greedy_steps"] = 0


def build_fp8_golden(name, d=None):
    """golden_fp8.json of the model directory d (default OUT / name; name picks the architecture)."""
    label = name if d is None else str(d.relative_to(OUT))
    d = OUT / name if d is None else d
    moe = SPECS[name][1] is Qwen3MoeForCausalLM
    golden = json.loads((d / "golden.json").read_text())

    # 1. Identity quantizers: the emulation harness itself must not change a single bit.
    m = load_fp32(d, moe)
    emulate(m, quantize=False)
    for p in golden["prompts"]:
        q, _, _ = golden_prompt(m, p["input_ids"])
        assert q == p, f"{label}: emulation with identity quantizers does not reproduce golden.json"

    # 2. W8A8.
    m = load_fp32(d, moe)
    n_q = emulate(m)
    prompts, gaps, margins, route_diff, route_total = [], [], [], 0, 0
    ref = load_fp32(d, moe) if moe else None
    for p in golden["prompts"]:
        q, _, full_seq = golden_prompt(m, p["input_ids"])
        prompts.append(q)
        gaps += q["top2_gaps"]
        if moe:
            margins.append(router_margin(m, full_seq))
            for a, b in zip(routing_of(m, p["input_ids"]), routing_of(ref, p["input_ids"])):
                route_diff += int((a != b).any(dim=-1).sum())
                route_total += a.shape[0]
    fp8_stability(m, prompts)
    g8 = {"arch": golden["arch"], "quantization": FP8_DESCRIPTION,
          "stability": {"runs": FP8_STABLE_RUNS, "gemm_output_rel_noise": list(FP8_STABLE_NOISE),
                        "max_dev": FP8_STABLE_DEV},
          "transformers_version": transformers.__version__, "torch_version": torch.__version__,
          "prompts": prompts}
    (d / "golden_fp8.json").write_text(dump_golden(g8))

    dl = [abs(a - b) for p, q in zip(golden["prompts"], prompts)
          for a, b in zip(p["prompt_logprobs"][1:], q["prompt_logprobs"][1:])]
    d5 = [abs(a - b) for p, q in zip(golden["prompts"], prompts)
          for a, b in zip(p["last_top5"]["logprobs"], q["last_top5"]["logprobs"])]
    div = []
    for p, q in zip(golden["prompts"], prompts):
        same = [a == b for a, b in zip(p["greedy_ids"], q["greedy_ids"])]
        div.append(same.index(False) if False in same else GREEDY_STEPS)
    print(f"  {label:10s} FP8 W8A8 emulation: {n_q} quantized matrices; |prompt logprob FP8 - BF16| "
          f"mean {sum(dl) / len(dl):.2e} max {max(dl):.2e} (over {len(dl)}); last top-5 logprobs max "
          f"{max(d5):.2e}; greedy agrees with BF16 for {div} of {GREEDY_STEPS} steps")
    print(f"    FP8 greedy gaps min {min(gaps):.2e} median {sorted(gaps)[len(gaps) // 2]:.3f}; "
          f"gaps < 1e-3: {sum(x < 1e-3 for x in gaps)}")
    print(f"    FP8 stable under {FP8_STABLE_RUNS} perturbed runs: prompt logprobs "
          f"{[p['stable_prompt_logprobs'] for p in prompts]} of {[len(p['input_ids']) - 1 for p in prompts]}, "
          f"greedy steps {[p['stable_greedy_steps'] for p in prompts]} of {GREEDY_STEPS}")
    if moe:
        print(f"    FP8 min router top-{m.config.num_experts_per_tok} margin (prob) {min(margins):.2e}; "
              f"prompt tokens routed differently from BF16: {route_diff} of {route_total} (token, layer)")


def build_fp8_checkpoint(src_name, name):
    """src_name's weights as a pre-quantized FP8 checkpoint: quantized matrices F8_E4M3 with
    `<name>_scale_inv` F32 [ceil(out/128)][ceil(in/128)], everything else BF16 as before."""
    src, d = OUT / src_name, OUT / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    tensors, stored, n_q = {}, {}, 0
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for k in sorted(f.keys()):
            t = f.get_tensor(k)
            assert t.dtype == torch.bfloat16
            if fp8_is_quantized(k):
                q, s = quantize_weight(t.to(torch.float32))
                tensors[k], tensors[k + "_scale_inv"] = q, s
                stored[k] = dequantize_weight(q, s)
                n_q += 1
            else:
                tensors[k] = t
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = FP8_QUANT_CONFIG
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(src / "generation_config.json", d / "generation_config.json")
    for f in d.iterdir():
        os.chmod(f, 0o644)

    # Read it back: dtypes, scale shapes, and that running the emulation on the stored codes and
    # scales gives exactly src_name's golden_fp8.json.
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        got = {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}
        back = {k[:-len("_scale_inv")]: dequantize_weight(f.get_tensor(k[:-len("_scale_inv")]), f.get_tensor(k))
                for k in f.keys() if k.endswith("_scale_inv")}
    for k, (dt, shape) in got.items():
        if k.endswith("_scale_inv"):
            w = got[k[:-len("_scale_inv")]]
            assert dt == "F32" and w[0] == "F8_E4M3"
            assert shape == [-(-w[1][0] // FP8_BLOCK), -(-w[1][1] // FP8_BLOCK)], (k, shape, w)
        else:
            assert dt == ("F8_E4M3" if fp8_is_quantized(k) else "BF16"), (k, dt)
    assert back.keys() == stored.keys() and all(torch.equal(back[k], stored[k]) for k in back)
    moe = SPECS[src_name][1] is Qwen3MoeForCausalLM
    assert not moe
    m = load_fp32(src, moe)
    emulate(m, stored=back)
    want = json.loads((src / "golden_fp8.json").read_text())["prompts"]
    for p in want:
        q, _, _ = golden_prompt(m, p["input_ids"])
        assert q == {k: p[k] for k in q}, \
            f"{name}: emulation from the stored FP8 weights differs from {src_name}/golden_fp8.json"
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"  {name:10s} FP8 checkpoint of {src_name}: {n_q} F8_E4M3 matrices + scale_inv, "
          f"{len(got)} tensors {size / 1024:.1f} KiB; emulation from the stored codes == {src_name}/golden_fp8.json")
    check_transformers_fp8_load(src_name, d, back)


def check_transformers_fp8_load(src_name, d, deq):
    """transformers' own FP8 loader (FineGrainedFP8): without a GPU it dequantizes on load. Checks that
    it reads our tensors the same way (weights), and how its weight-only model compares to the
    weight-only emulation. Needs `accelerate`; skipped if absent."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        print("    transformers FP8 load check skipped: `accelerate` is not installed")
        return
    try:
        m = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager")
    except Exception as e:  # noqa: BLE001 -- report, the fixture itself is already verified
        print(f"    transformers FP8 load check: from_pretrained failed: {type(e).__name__}: {e}")
        return
    sd = m.state_dict()
    wdiff = max(float((sd[k].float() - v).abs().max() / v.abs().max()) for k, v in deq.items())
    ref = load_fp32(OUT / src_name, False)
    emulate(ref, stored=deq)
    for mod in ref.modules():
        if isinstance(mod, EmulatedLinear):
            mod.act = identity
    ids = json.loads((OUT / src_name / "golden.json").read_text())["prompts"][-1]["input_ids"]
    ldiff = float((logits_of(m, ids) - logits_of(ref, ids)).abs().max())
    print(f"    transformers {type(m).__name__} loads it (dequantized on CPU, weights dtype "
          f"{sd[next(iter(deq))].dtype}): max rel weight diff vs our dequantization {wdiff:.1e}; "
          f"logits vs weight-only emulation max |diff| {ldiff:.1e}")


# ------------------------------------------------------------------------------------------------
# Perturbed weights: a pretend training step, the weights a trainer would push next.

PERTURBED = {"qwen3": "perturbed"}  # fixture -> subdirectory holding its perturbed copy
PERTURB_REL = 0.02  # noise std relative to each tensor's own std
PERTURB_SEED = 2001


def build_perturbed(src_name):
    """OUT/src_name/<PERTURBED>/: every tensor bf16(w + PERTURB_REL * std(w) * randn), tensors in
    name order from one seeded generator; config copied; golden.json and golden_fp8.json on src's
    prompts."""
    src = OUT / src_name
    d = src / PERTURBED[src_name]
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    moe = SPECS[src_name][1] is Qwen3MoeForCausalLM
    g = torch.Generator().manual_seed(PERTURB_SEED)
    tensors, changed, total = {}, 0, 0
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        meta = f.metadata()
        for k in sorted(f.keys()):
            t = f.get_tensor(k)
            assert t.dtype == torch.bfloat16
            w = t.to(torch.float32)
            noise = torch.randn(w.shape, generator=g, dtype=torch.float32)
            tensors[k] = (w + PERTURB_REL * w.std() * noise).to(torch.bfloat16)
            changed += int((tensors[k] != t).sum())
            total += t.numel()
    save_file(tensors, str(d / "model.safetensors"), metadata=meta)
    for name in ("config.json", "generation_config.json"):
        shutil.copyfile(src / name, d / name)
    for f in d.iterdir():
        os.chmod(f, 0o644)
    hub = json.loads((d / "config.json").read_text())
    n_tensors, _ = check_tensors(d, hub)

    m = load_fp32(d, moe)
    base = json.loads((src / "golden.json").read_text())
    prompts = [golden_prompt(m, p["input_ids"])[0] for p in base["prompts"]]
    golden = {"arch": hub["architectures"][0],
              "perturbation": {"source": src_name, "rule": f"bf16(w + {PERTURB_REL} * std(w) * randn)",
                               "seed": PERTURB_SEED},
              "transformers_version": transformers.__version__, "torch_version": torch.__version__,
              "prompts": prompts}
    (d / "golden.json").write_text(dump_golden(golden))
    label = f"{src_name}/{PERTURBED[src_name]}"
    dl = [abs(a - b) for p, q in zip(base["prompts"], prompts)
          for a, b in zip(p["prompt_logprobs"][1:], q["prompt_logprobs"][1:])]
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"  {label}: {n_tensors} tensors, {changed}/{total} elements changed, {size / 1024:.1f} KiB; "
          f"|prompt logprob perturbed - {src_name}| mean {sum(dl) / len(dl):.3e} max {max(dl):.3e}")

    build_fp8_golden(src_name, d)
    b8 = json.loads((src / "golden_fp8.json").read_text())["prompts"]
    p8 = json.loads((d / "golden_fp8.json").read_text())["prompts"]
    dl = [abs(a - b) for p, q in zip(b8, p8) for a, b in zip(p["prompt_logprobs"][1:], q["prompt_logprobs"][1:])]
    print(f"    FP8: |prompt logprob perturbed - {src_name}| mean {sum(dl) / len(dl):.3e} max {max(dl):.3e}")


def main():
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    names = sys.argv[1:] or list(SPECS)
    print(f"transformers {transformers.__version__}, torch {torch.__version__} -> {OUT.relative_to(ROOT)}")
    for name in names:
        if "/" in name:  # "<fixture>/perturbed": only the perturbed copy of an existing fixture
            src, sub = name.split("/", 1)
            assert PERTURBED.get(src) == sub, f"unknown fixture {name!r} (perturbed copies: {PERTURBED})"
            build_perturbed(src)
            continue
        build(name)
        build_fp8_golden(name)
        if name in FP8_CHECKPOINTS:
            build_fp8_checkpoint(name, FP8_CHECKPOINTS[name])
        if name in PERTURBED:
            build_perturbed(name)
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"total {total / 1024:.1f} KiB under {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
