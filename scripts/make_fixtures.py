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
"""
import json
import math
import os
import pathlib
import shutil
import sys

import torch
import transformers
from safetensors import safe_open
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
    for k in ("arch", "transformers_version", "torch_version"):
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


def main():
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    names = sys.argv[1:] or list(SPECS)
    print(f"transformers {transformers.__version__}, torch {torch.__version__} -> {OUT.relative_to(ROOT)}")
    for name in names:
        build(name)
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"total {total / 1024:.1f} KiB under {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
