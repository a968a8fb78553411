"""The task: sort a string of digits. Prompts, answers and a verifiable reward.

A prompt is a string of 3-8 random digits, left-padded to a fixed width so that every prompt has
the same length (PROMPT_LEN tokens) and a batch needs no attention mask:

    BOS PAD PAD PAD 7 3 9 1 3 SEP   ->   1 3 3 7 9 EOS

The vocabulary is the ten digits plus four control tokens (ids 0-9 are the digits themselves);
VOCAB rounds it up to 16. The reward of a completion (the tokens the policy generated, up to and
excluding its first EOS) against the sorted digits is the share of positions that are right,
over the longer of the two strings:

    reward = #{i : out[i] == target[i]} / max(len(out), len(target))

so an exact answer (all digits right, then EOS) scores 1, a completion that never stops scores at
most len(target) / MAX_NEW, and every correct position earns partial credit. `exact` is the
accuracy figure: 1 for an exact answer, else 0.

Prompts come from numpy Generators seeded by (seed, step), so every run of the same seed sees the
same prompts in the same order; the held-out set is drawn from its own seed and its digit strings
never appear among training prompts.
"""
import numpy as np

PAD, SEP, EOS, BOS = 10, 11, 12, 13
VOCAB = 16                      # 14 used ids, rounded up
MIN_LEN, MAX_LEN = 3, 8
PROMPT_LEN = MAX_LEN + 2        # BOS + MAX_LEN (left-padded digits) + SEP
MAX_NEW = MAX_LEN + 2           # room for the answer, its EOS and one token of overrun
HELDOUT_SEED = 987654321
_NAMES = {PAD: "_", SEP: ">", EOS: "$", BOS: "^"}


def prompt_ids(digits):
    """The PROMPT_LEN token ids asking to sort `digits` (a sequence of ints 0-9)."""
    assert MIN_LEN <= len(digits) <= MAX_LEN
    return [BOS] + [PAD] * (MAX_LEN - len(digits)) + [int(d) for d in digits] + [SEP]


def target(digits):
    """The answer's digits (without EOS)."""
    return sorted(int(d) for d in digits)


def answer_ids(digits):
    """The tokens a perfect policy generates: the sorted digits, then EOS."""
    return target(digits) + [EOS]


def draw(rng, n, exclude=frozenset()):
    """n digit strings (tuples), lengths uniform in [MIN_LEN, MAX_LEN], none of them in exclude."""
    out = []
    while len(out) < n:
        length = int(rng.integers(MIN_LEN, MAX_LEN + 1))
        d = tuple(int(x) for x in rng.integers(0, 10, size=length))
        if d not in exclude:
            out.append(d)
    return out


def heldout(n):
    """The fixed held-out set: n digit strings drawn from HELDOUT_SEED."""
    return draw(np.random.default_rng(HELDOUT_SEED), n)


def train_prompts(seed, step, n, exclude):
    """The n digit strings of RL step `step` of a run seeded `seed` (the same for every run)."""
    return draw(np.random.default_rng([seed, step]), n, exclude)


def completion(output_ids):
    """The generated digits: output tokens up to (excluding) the first EOS, and whether it stopped."""
    out = [int(t) for t in output_ids]
    if EOS in out:
        return out[:out.index(EOS)], True
    return out, False


def reward(output_ids, digits):
    """(reward in [0, 1], exact 0/1) of one completion for the prompt `digits`."""
    tgt = target(digits)
    out, stopped = completion(output_ids)
    right = sum(1 for a, b in zip(out, tgt) if a == b)
    r = right / max(len(out), len(tgt))
    exact = int(stopped and out == tgt)
    return r, exact


def render(ids):
    """Token ids as text: digits as themselves, ^ BOS, _ PAD, > SEP, $ EOS."""
    return "".join(_NAMES.get(int(t), str(int(t)) if int(t) < 10 else "?") for t in ids)
