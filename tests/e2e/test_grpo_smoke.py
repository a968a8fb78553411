"""The GRPO example (examples/grpo) against the real daemon: three RL steps of (a) BF16 rollouts and
(c) FP8 rollouts with TIS, at the "smoke" shape (a 0.3M-parameter Qwen3, 4 prompts x 4 samples).

The reference for the rollout logprobs is transformers' Qwen3ForCausalLM in fp32 on the same BF16
weights (the trainer's own forward). Asserted per step: the daemon served the version pushed by
the step before when the rollout was asked (/get_weight_version, and every sample's
weight_version and version spans), the push answered the new version, the BF16 logprobs equal
the trainer's within 1e-4 on every token, loss and rewards are finite. And the BF16 check can
fail: a "push" that only relabels the version (update_weight_version, the weights unchanged) is
caught on the next step by the logprob check alone, the version checks passing.

Needs torch, transformers, safetensors and crc32c (skips saying so without them), like the example
itself.
"""
import math
import pathlib
import sys
import types

import pytest

from conftest import BIN, ROOT

torch = pytest.importorskip("torch", reason="the GRPO example needs PyTorch (not importable here)")
pytest.importorskip("transformers", reason="the GRPO example needs transformers (not importable here)")
pytest.importorskip("safetensors", reason="the GRPO example needs safetensors (not importable here)")
pytest.importorskip("crc32c", reason="the GRPO example's shm pushes carry CRC-32C checksums: needs crc32c")

sys.path.insert(0, str(ROOT / "examples" / "grpo"))
import daemon as dmn  # noqa: E402
import grpo  # noqa: E402
import policy as pol  # noqa: E402
import task  # noqa: E402

STEPS = 3
CFG = grpo.Config(prompts=4, n=4, check_every=STEPS, heldout=32)


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A smoke-shape policy after 20 supervised steps (so that rewards vary within groups), saved
    as the model directory every run starts from."""
    if not pathlib.Path(BIN).exists() or not pathlib.Path(dmn.FP8_MISMATCH).exists():
        pytest.skip(f"needs {BIN} and {dmn.FP8_MISMATCH} (make)")
    torch.set_num_threads(1)
    import warmstart
    p = pol.Policy(pol.config("smoke"), seed=0)
    held = task.heldout(CFG.heldout)
    warmstart.train(p, 20, seed=0, exclude=frozenset(held))
    d = p.save(tmp_path_factory.mktemp("grpo") / "start")
    return d, {n: t.detach().clone() for n, t in zip(p.names, p.params)}, held


def three_steps(run_id, start, tmp_path):
    model_dir, state, held = start
    policy = pol.Policy(pol.config("smoke"), seed=0, state=state)
    recs = []
    with grpo.Run(run_id, policy, model_dir, tmp_path / run_id, seed=1, cfg=CFG, heldout=held,
                  exclude=frozenset(held)) as r:
        recs.append(r.evaluate())
        for _ in range(STEPS):
            recs.append(r.step())
        after = r.control.get_weight_version()
        (o,) = r.control.generate(task.prompt_ids([3, 1, 2]), max_new_tokens=4, temperature=1.0, sampling_seed=1)
    return recs, after, o


def check_common(recs, after, o):
    assert recs[0]["step"] == 0 and 0.0 <= recs[0]["heldout_acc"] <= 1.0
    for step, rec in enumerate(recs[1:], start=1):
        assert rec["step"] == step
        assert rec["served_before"] == str(step - 1), rec          # the previous push was committed
        assert rec["sample_versions"] == {str(step - 1): CFG.prompts * CFG.n}, rec
        assert rec["pushed_version"] == str(step), rec
        assert math.isfinite(rec["loss"]) and math.isfinite(rec["grad_norm"])
        assert 0.0 <= rec["reward"] <= 1.0 and 0.0 <= rec["acc"] <= 1.0
        assert rec["tokens"] > 0 and all(math.isfinite(v) for v in
                                         (rec["mismatch"]["mean_abs"], rec["mismatch"]["kl_k3"]))
        assert rec["t_rollout"] > 0 and rec["t_train"] > 0 and rec["t_push"] > 0
    assert after == str(STEPS) and o.weight_version == str(STEPS)
    assert "heldout_acc" in recs[-1]


def test_grpo_bf16_rollouts(start, tmp_path):
    recs, after, o = three_steps("a", start, tmp_path)
    check_common(recs, after, o)
    for rec in recs[1:]:
        assert rec["bf16_max_abs"] <= 1e-4, rec["bf16_max_abs"]
        assert rec["mismatch"]["share_outside"] == 0.0
    # the policy moved: a stale push would be visible to the 1e-4 check
    assert recs[-1]["grad_norm"] > 0


def test_grpo_fp8_tis(start, tmp_path):
    recs, after, o = three_steps("c", start, tmp_path)
    check_common(recs, after, o)
    for rec in recs[1:]:
        assert rec["precision"] == "fp8" and rec["correction"] == "tis"
        assert "bf16_max_abs" not in rec
        assert rec["mismatch"]["mean_abs"] > 1e-4          # FP8 rollouts do differ from the trainer
        w = rec["mismatch"]["tis_w"]
        assert 0.0 < w["min"] <= w["mean"] <= w["max"] <= CFG.cap
    for step in (1, STEPS):                                # fp8-mismatch ran on the served weights
        pred = recs[step]["fp8_predicted"]
        assert pred["tokens"] == CFG.fp8_check_prompts * CFG.max_new and pred["mean_abs"] > 0
        assert math.isfinite(pred["ratio"]) and pred["ratio"] > 0


def test_grpo_bf16_check_catches_unpushed_weights(start, tmp_path):
    model_dir, state, held = start
    policy = pol.Policy(pol.config("smoke"), seed=0, state=state)
    with grpo.Run("a", policy, model_dir, tmp_path / "relabel", seed=1, cfg=CFG) as r:
        r.step()

        def relabel(state_dict, version):
            r.control.update_weight_version(version)
            return types.SimpleNamespace(weight_version=version, bytes=0, server_seconds=0.0)
        r.control.push_weights = relabel
        r.step()   # served version 1 (pushed for real), then only relabeled "2"
        with pytest.raises(grpo.CheckFailed, match="BF16 rollout logprobs differ"):
            r.step()
