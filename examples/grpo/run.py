"""GRPO on rolloutd: FP8 against BF16 rollouts, with and without TIS/MIS correction.

    python examples/grpo/run.py demo  [--steps 80] [--runs abcd] [--seeds 1,2] [--out DIR]
    python examples/grpo/run.py bench [--shape large] [--prompts 64] [--n 8] [--max-new 128] [--steps 3]
    python examples/grpo/run.py plot  [--out DIR]       (summary, tables and figures again, from the logs)

demo: one supervised warm start (warmstart.py), then the four runs from the same weights with the
same seeds: (a) BF16 rollouts, (b) FP8 W8A8 + FP8 KV rollouts without correction, (c) FP8 with
token-level TIS, (d) FP8 with token-level MIS (grpo.py). Writes DIR/warmstart.jsonl, one
DIR/<run>-s<seed>.jsonl per run and seed (compressed to .jsonl.gz when all runs are done),
DIR/summary.json, and the figures (plots.py).
bench: the step time split (rollout / push / train) of BF16 and FP8 rollouts at a shape, from
random weights (no warm start), every sample running --max-new tokens; the two daemons run side
by side and the steps alternate between them, so that a change in the machine's load shows in
both; DIR/bench-<shape>.jsonl.
rolloutd must be built (`make`); examples/grpo/run.sh does that and installs the Python side.
"""
import argparse
import contextlib
import json
import os
import pathlib
import platform
import resource
import signal
import statistics
import subprocess
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import grpo  # noqa: E402
import plots  # noqa: E402
import policy as pol  # noqa: E402
import task  # noqa: E402
import warmstart  # noqa: E402

ROOT = HERE.parents[1]


def machine():
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu": cpu, "cores": len(os.sched_getaffinity(0)),
            "loadavg": os.getloadavg(),
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip()}


def echo(every):
    """A log callback printing one line for every `every`-th step and each held-out evaluation."""
    def show(rec):
        if "step" not in rec or not ("heldout_acc" in rec or rec["step"] % every == 0):
            return
        parts = [f"{rec.get('run', 'sft')} step {rec['step']:4d}"]
        for k in ("reward", "acc", "loss", "heldout_acc"):
            if rec.get(k) is not None:
                parts.append(f"{k} {rec[k]:.3f}")
        if "mismatch" in rec:
            parts.append(f"|dlp| {rec['mismatch']['mean_abs']:.2e}")
        for k in ("t_rollout", "t_push", "t_train", "t_step"):
            if k in rec:
                parts.append(f"{k[2:]} {rec[k]:.2f} s")
        print("  ".join(parts), flush=True)
    return show


def median_min(recs, key):
    xs = [r[key] for r in recs if key in r]
    return (statistics.median(xs), min(xs)) if xs else (float("nan"), float("nan"))


def summarize(out, runs, seeds, totals, machine_info):
    """summary.json and a markdown table: final held-out accuracy and the checks, per run."""
    rows, logs = [], plots.load_runs(out)
    for run in runs:
        for seed in seeds:
            recs = logs[(run, seed)]
            steps = [r for r in recs if r["step"] > 0]
            evals = [r for r in recs if "heldout_acc" in r]
            last = steps[-10:]
            pred = [r["fp8_predicted"] for r in steps if "fp8_predicted" in r]
            row = {"run": run, "seed": seed, "label": grpo.LABELS[run], "steps": len(steps),
                   "heldout_acc_start": evals[0]["heldout_acc"], "heldout_acc_final": evals[-1]["heldout_acc"],
                   "heldout_acc_best": max(r["heldout_acc"] for r in evals),
                   "heldout_acc_last3": statistics.mean(r["heldout_acc"] for r in evals[-3:]),
                   "train_reward_last10": statistics.mean(r["reward"] for r in last),
                   "train_acc_last10": statistics.mean(r["acc"] for r in last),
                   "mismatch_mean_abs": statistics.mean(r["mismatch"]["mean_abs"] for r in steps),
                   "kl_k3": statistics.mean(r["mismatch"]["kl_k3"] for r in steps),
                   "share_outside": statistics.mean(r["mismatch"]["share_outside"] for r in steps),
                   "bf16_max_abs": max((r["bf16_max_abs"] for r in steps if "bf16_max_abs" in r), default=None),
                   "fp8_checks": len(pred), "fp8_checks_ok": sum(p["ok"] for p in pred),
                   "fp8_ratio_median": statistics.median(p["ratio"] for p in pred) if pred else None}
            for ph in ("rollout", "train", "push", "step"):
                row[f"t_{ph}_median"], row[f"t_{ph}_min"] = median_min(steps, f"t_{ph}")
            for who, ph in (("daemon", "rollout"), ("trainer", "train"), ("trainer", "push"), ("daemon", "push")):
                row[f"cpu_{who}_{ph}_median"] = median_min(steps, f"cpu_{who}_{ph}")[0]
            rows.append(row)
    (out / "summary.json").write_text(json.dumps({"machine": machine_info, "totals": totals, "runs": rows}, indent=1) + "\n")
    print(f"\n| run | held-out accuracy: start -> final, per seed ({', '.join(map(str, seeds))}) | mean final "
          "| mean of the last 3 evaluations | train reward, last 10 steps | mean abs dlogprob | KL k3 "
          "| tokens outside [1/C, C] | BF16 check max | fp8-mismatch checks in band (median ratio) | step s, median |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        rs = [r for r in rows if r["run"] == run]
        mean = lambda k: statistics.mean(r[k] for r in rs)  # noqa: E731
        bf = [r["bf16_max_abs"] for r in rs if r["bf16_max_abs"] is not None]
        n_chk, n_ok = sum(r["fp8_checks"] for r in rs), sum(r["fp8_checks_ok"] for r in rs)
        ratios = [r["fp8_ratio_median"] for r in rs if r["fp8_ratio_median"] is not None]
        print(f"| {grpo.LABELS[run]} | {rs[0]['heldout_acc_start']:.3f} -> "
              f"{' / '.join('%.3f' % r['heldout_acc_final'] for r in rs)} | {mean('heldout_acc_final'):.3f} "
              f"| {mean('heldout_acc_last3'):.3f} | {mean('train_reward_last10'):.3f} | {mean('mismatch_mean_abs'):.2e} | {mean('kl_k3'):.2e} "
              f"| {100 * mean('share_outside'):.3f}% | {'%.1e' % max(bf) if bf else '-'} "
              f"| {'%d/%d (x%.2f)' % (n_ok, n_chk, statistics.median(ratios)) if n_chk else '-'} "
              f"| {statistics.median(r['t_step_median'] for r in rs):.2f} |")
    print("\nStep time, seconds, min / median over steps (per seed), and median CPU seconds of each process:")
    print("| run | seed | rollout | push | train | whole step | daemon CPU in rollout | trainer CPU in train |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cell = {ph: "%.2f / %.2f" % (r[f"t_{ph}_min"], r[f"t_{ph}_median"]) for ph in ("rollout", "push", "train", "step")}
        print(f"| {r['label']} | {r['seed']} | {cell['rollout']} | {cell['push']} | {cell['train']} | {cell['step']} "
              f"| {r['cpu_daemon_rollout_median']:.2f} | {r['cpu_trainer_train_median']:.2f} |")
    return rows


def cmd_demo(a):
    out, work = pathlib.Path(a.out), pathlib.Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    cfg = grpo.Config(prompts=a.prompts, n=a.n, lr=a.lr, heldout=a.heldout, check_every=a.check_every)
    held = task.heldout(cfg.heldout)
    exclude = frozenset(held)
    seeds = [int(s) for s in a.seeds.split(",")]
    t0 = time.perf_counter()

    base = pol.Policy(pol.config(a.shape), seed=a.init_seed)
    print(f"policy: Qwen3 {a.shape}, {base.n_params() / 1e6:.2f}M parameters; warm start {a.warm_steps} steps", flush=True)
    log = grpo.JsonlLog(out / "warmstart.jsonl", echo(10))
    warmstart.train(base, a.warm_steps, seed=a.init_seed, exclude=exclude, eval_set=held, eval_every=50, log=log)
    log.close()
    model_dir = base.save(work / "warmstart")
    state = {n: p.detach().clone() for n, p in zip(base.names, base.params)}
    print(f"warm start done in {time.perf_counter() - t0:.0f} s -> {model_dir}", flush=True)

    for seed in seeds:
        for run in a.runs:
            print(f"run {grpo.LABELS[run]}, seed {seed}: {a.steps} steps", flush=True)
            policy = pol.Policy(pol.config(a.shape), seed=a.init_seed, state=state)
            log = grpo.JsonlLog(out / f"{run}-s{seed}.jsonl", echo(10))
            grpo.run(run, policy, model_dir, work / f"{run}-s{seed}", a.steps, seed, cfg, log, held, exclude)
            log.close()
    wall = time.perf_counter() - t0
    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    summarize(out, a.runs, seeds, {"wall_s": wall, "cpu_s": cpu}, machine())
    plots.pack_logs(out)
    plots.all_figures(out)
    print(f"\ndemo done in {wall:.0f} s wall, {cpu:.0f} s CPU (trainer, daemons, fp8-mismatch); results in {out}")


def cmd_bench(a):
    out, work = pathlib.Path(a.out), pathlib.Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    cfg = grpo.Config(prompts=a.prompts, n=a.n, max_new=a.max_new, ignore_eos=True, lr=a.lr,
                      micro_batch=a.micro_batch, check_every=0)
    pcfg = pol.config(a.shape, max_positions=task.PROMPT_LEN + a.max_new + 16)
    base = pol.Policy(pcfg, seed=a.init_seed)
    state = {n: p.detach().clone() for n, p in zip(base.names, base.params)}
    model_dir = base.save(work / f"bench-{a.shape}")
    print(f"bench: Qwen3 {a.shape}, {base.n_params() / 1e6:.1f}M parameters, {a.prompts} prompts x {a.n} samples x "
          f"{a.max_new} tokens, {a.steps} steps per precision", flush=True)
    path = out / f"bench-{a.shape}.jsonl"
    log = grpo.JsonlLog(path, echo(1))
    log({"machine": machine(), "shape": a.shape, "params": base.n_params(), "prompts": a.prompts, "n": a.n,
         "max_new": a.max_new})
    with contextlib.ExitStack() as stack:  # one daemon per precision, steps alternating between them
        runs = [stack.enter_context(grpo.Run(run, pol.Policy(pcfg, seed=a.init_seed, state=state), model_dir,
                                             work / f"bench-{a.shape}-{run}", a.seed, cfg)) for run in a.runs]
        for _ in range(a.steps):
            for r in runs:
                log(r.step())
    log.close()
    print_bench(path)


def print_bench(path):
    recs = plots.read_jsonl(path)
    head, steps = recs[0], [r for r in recs[1:] if "t_step" in r]
    print(f"\n{head['shape']}: {head['params'] / 1e6:.1f}M parameters, {head['prompts']} x {head['n']} x "
          f"{head['max_new']} tokens; min / median over {len(steps) // max(1, len({r['run'] for r in steps}))} steps")
    print("| rollouts | rollout s | push s | train s | step s | rollout tok/s (median) | daemon CPU s in rollout "
          "| trainer CPU s in train |")
    print("|---|---|---|---|---|---|---|---|")
    for run in sorted({r["run"] for r in steps}):
        rs = [r for r in steps if r["run"] == run]
        cell = {k: "%.2f / %.2f" % (min(r[k] for r in rs), statistics.median(r[k] for r in rs))
                for k in ("t_rollout", "t_push", "t_train", "t_step")}
        tps = statistics.median(r["tokens"] / r["t_rollout"] for r in rs)
        print(f"| {grpo.LABELS[run]} | {cell['t_rollout']} | {cell['t_push']} | {cell['t_train']} | {cell['t_step']} "
              f"| {tps:.0f} | {statistics.median(r['cpu_daemon_rollout'] for r in rs):.2f} "
              f"| {statistics.median(r['cpu_trainer_train'] for r in rs):.2f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("demo", "bench", "plot"):
        s = sub.add_parser(name)
        s.add_argument("--out", default=str(HERE / "results"))
        s.add_argument("--work", default=str(ROOT / "build" / "rl-demo"), help="checkpoints and daemon logs")
        s.add_argument("--torch-threads", type=int, default=1,
                       help="intra-op threads of the trainer (1: see README, 'Threads')")
        if name == "plot":
            continue
        s.add_argument("--runs", default="abcd" if name == "demo" else "ac",
                       help="which of a (BF16), b (FP8), c (FP8+TIS), d (FP8+MIS)")
        s.add_argument("--steps", type=int, default=80 if name == "demo" else 3)
        s.add_argument("--prompts", type=int, default=16 if name == "demo" else 64)
        s.add_argument("--n", type=int, default=8)
        s.add_argument("--lr", type=float, default=1e-4)
        s.add_argument("--shape", default="demo" if name == "demo" else "large", choices=sorted(pol.SHAPES))
        s.add_argument("--init-seed", type=int, default=0, help="model initialization and warm start")
        if name == "demo":
            s.add_argument("--seeds", default="1,2", help="comma-separated RL seeds (prompts and sampling)")
            s.add_argument("--warm-steps", type=int, default=100)
            s.add_argument("--heldout", type=int, default=512)
            s.add_argument("--check-every", type=int, default=10)
        else:
            s.add_argument("--seed", type=int, default=1)
            s.add_argument("--max-new", type=int, default=128)
            s.add_argument("--micro-batch", type=int, default=32)
    a = p.parse_args(argv)
    torch.set_num_threads(a.torch_threads)
    # SIGTERM unwinds like Ctrl-C, so the daemons a run started are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.cmd == "demo":
        cmd_demo(a)
    elif a.cmd == "bench":
        cmd_bench(a)
    else:  # the summary (keeping the demo's totals) and the figures again, from the logs
        out = pathlib.Path(a.out)
        logs = plots.run_logs(out)
        runs, seeds = sorted({r for r, _ in logs}), sorted({s for _, s in logs})
        if runs:
            old = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
            summarize(out, runs, seeds, old.get("totals", {}), old.get("machine", machine()))
        plots.pack_logs(out)
        for path in sorted(out.glob("bench-*.jsonl")):
            print_bench(path)
        plots.all_figures(out)


if __name__ == "__main__":
    main()
