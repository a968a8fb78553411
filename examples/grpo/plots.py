"""The three figures, from the JSONL logs in a results directory (matplotlib, Agg backend):

  reward.png      training reward (5-step running mean) and held-out greedy accuracy vs step,
                  the four runs on each panel (one line per run and seed);
  mismatch.png    rollout/trainer mismatch vs step: mean |lp_train - lp_rollout| (with what
                  build/fp8-mismatch predicted for the same weights, as markers), the KL estimate
                  k3, the share of tokens whose ratio is outside [1/C, C], and the TIS weights
                  (mean, with min and max as a band);
  time_split.png  the step time split into rollout, push and train (median over steps; wall and
                  CPU seconds), per run at the demo shape, and per precision at the benchmark
                  shapes when bench-*.jsonl files are present.

The run logs are read as <run>-s<seed>.jsonl or, once pack_logs has compressed them (what the
demo commits to results/), <run>-s<seed>.jsonl.gz. The figures are written at 80 dpi with a
128-colour palette, which keeps each PNG under about 100 KB.
"""
import gzip
import io
import json
import pathlib
import re
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"a": "tab:blue", "b": "tab:red", "c": "tab:green", "d": "tab:orange"}
LABELS = {"a": "(a) BF16", "b": "(b) FP8, no correction", "c": "(c) FP8 + TIS", "d": "(d) FP8 + MIS"}


RUN_LOG = re.compile(r"([abcd])-s(\d+)\.jsonl(\.gz)?")


def read_jsonl(path):
    """The records of a JSONL file, plain or gzip-compressed (by its .gz suffix)."""
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
        return [json.loads(line) for line in f]


def run_logs(out):
    """{(run, seed): path} of every <run>-s<seed>.jsonl[.gz] in out (the plain file if both)."""
    logs = {}
    for path in sorted(pathlib.Path(out).iterdir(), key=lambda p: p.name.endswith(".gz")):
        m = RUN_LOG.fullmatch(path.name)
        if m and (m[1], int(m[2])) not in logs:
            logs[(m[1], int(m[2]))] = path
    return dict(sorted(logs.items()))


def pack_logs(out):
    """Compresses every plain run log in out to <name>.gz (gzip -9, no timestamp, so the same log
    gives the same bytes) and removes the plain file."""
    for path in run_logs(out).values():
        if path.suffix == ".jsonl":
            with open(path, "rb") as src, open(str(path) + ".gz", "wb") as raw, \
                    gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as dst:
                dst.write(src.read())
            path.unlink()


def load_runs(out):
    """{(run, seed): [records]} of every run log in out."""
    return {key: read_jsonl(path) for key, path in run_logs(out).items()}


def save(fig, path):
    """fig as a PNG at 80 dpi, quantized to 128 colours (Pillow, which matplotlib depends on)."""
    from PIL import Image
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    buf.seek(0)
    img = Image.open(buf).convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT)
    img.save(path, optimize=True)


def running_mean(xs, k=5):
    return [statistics.mean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def _lines(ax, runs, key_fn, k=1, only_fp8=False):
    for (run, seed), recs in runs.items():
        if only_fp8 and run == "a":
            continue
        pts = [(r["step"], key_fn(r)) for r in recs if r["step"] > 0 and key_fn(r) is not None]
        if not pts:
            continue
        xs, ys = zip(*pts)
        ys = running_mean(list(ys), k) if k > 1 else ys
        ax.plot(xs, ys, color=COLORS[run], lw=1.3, alpha=0.9 if seed == min(s for _, s in runs) else 0.5,
                label=LABELS[run] if seed == min(s for r_, s in runs if r_ == run) else None)


def reward_figure(runs, path):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    _lines(ax1, runs, lambda r: r.get("reward"), k=5)
    ax1.set(xlabel="RL step", ylabel="mean reward (5-step running mean)", title="training reward (rollout samples)")
    for (run, seed), recs in runs.items():
        pts = [(r["step"], r["heldout_acc"]) for r in recs if "heldout_acc" in r]
        xs, ys = zip(*pts)
        ax2.plot(xs, ys, "o-", ms=3, color=COLORS[run], alpha=0.9 if seed == min(s for _, s in runs) else 0.5,
                 label=LABELS[run] if seed == min(s for r_, s in runs if r_ == run) else None)
    ax2.set(xlabel="RL step", ylabel="exact-match accuracy", title="held-out accuracy (greedy, trainer's policy)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)


def mismatch_figure(runs, path):
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    _lines(ax, runs, lambda r: r.get("mismatch", {}).get("mean_abs"))
    for (run, seed), recs in runs.items():
        pts = [(r["step"], r["fp8_predicted"]["mean_abs"]) for r in recs if "fp8_predicted" in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, "x", color=COLORS[run], ms=6, alpha=0.8)
    ax.plot([], [], "kx", label="build/fp8-mismatch prediction (same weights)")
    ax.set(yscale="log", ylabel="mean |lp_train - lp_rollout|", title="logprob mismatch per token")
    ax = axes[0][1]
    _lines(ax, runs, lambda r: max(r["mismatch"]["kl_k3"], 1e-16) if "mismatch" in r else None)
    ax.set(yscale="log", ylabel="k3 = mean(rho - 1 - log rho)", title="KL(rollout || trainer) estimate k3 (floor 1e-16)")
    ax = axes[1][0]
    _lines(ax, runs, lambda r: 100 * r["mismatch"]["share_outside"] if "mismatch" in r else None, only_fp8=True)
    ax.set(ylabel="% of tokens", title="tokens with rho outside [1/C, C], C = 2")
    ax = axes[1][1]
    for (run, seed), recs in runs.items():
        if run == "a":
            continue
        rs = [r for r in recs if "mismatch" in r]
        xs = [r["step"] for r in rs]
        ax.plot(xs, [r["mismatch"]["tis_w"]["mean"] for r in rs], color=COLORS[run], lw=1.3,
                label=LABELS[run] if seed == min(s for r_, s in runs if r_ == run) else None)
        ax.fill_between(xs, [r["mismatch"]["tis_w"]["min"] for r in rs], [r["mismatch"]["tis_w"]["max"] for r in rs],
                        color=COLORS[run], alpha=0.08)
    ax.set(ylabel="min(rho, C)", title="TIS weights: mean (line), min-max (band)")
    for ax in axes.ravel():
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, path)


def _phase(r, name, cpu):
    return r[f"cpu_trainer_{name}"] + r[f"cpu_daemon_{name}"] if cpu else r[f"t_{name}"]


def time_figure(runs, benches, path):
    """Per run (demo) or precision (benchmarks): the median wall seconds of each phase, and below
    it (hatched) the CPU seconds the trainer and the daemon spent in it (both processes)."""
    groups = [("demo shape", [(f"{LABELS[run]} s{seed}", [r for r in recs if "t_step" in r])
                              for (run, seed), recs in sorted(runs.items())])]
    for name, recs in benches:
        groups.append((name, [("BF16" if run == "a" else f"FP8 {LABELS[run]}", [r for r in recs if r["run"] == run])
                              for run in sorted({r["run"] for r in recs})]))
    groups = [g for g in groups if g[1]]
    rows = max(len(g[1]) for g in groups)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 0.8 * rows + 1.6), squeeze=False)
    for ax, (title, bars) in zip(axes[0], groups):
        ticks = []
        for i, (label, rs) in enumerate(bars):
            for j, cpu in enumerate((False, True)):
                y, left = 2 * i + 0.8 * j, 0.0
                for name, color in (("rollout", "tab:blue"), ("push", "tab:orange"), ("train", "tab:green")):
                    v = statistics.median(_phase(r, name, cpu) for r in rs)
                    ax.barh(y, v, left=left, height=0.7, color=color, hatch="//" if cpu else None,
                            alpha=0.55 if cpu else 1.0, label=name if i == 0 and not cpu else None)
                    left += v
                ticks.append((y, f"{label}, {'CPU' if cpu else 'wall'}"))
        ax.set_yticks([t[0] for t in ticks], [t[1] for t in ticks], fontsize=7)
        ax.invert_yaxis()
        ax.set(xlabel="seconds per RL step (median over steps)", title=title)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)


def all_figures(out):
    out = pathlib.Path(out)
    runs = load_runs(out)
    benches = []
    for path in sorted(out.glob("bench-*.jsonl")):
        recs = read_jsonl(path)
        benches.append((f"{recs[0]['shape']} ({recs[0]['params'] / 1e6:.0f}M)", [r for r in recs[1:] if "t_step" in r]))
    if runs:
        reward_figure(runs, out / "reward.png")
        mismatch_figure(runs, out / "mismatch.png")
    if runs or benches:
        time_figure(runs, benches, out / "time_split.png")
