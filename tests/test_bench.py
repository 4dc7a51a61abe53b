"""bench.py: the aggregates against hand-made run folders (mean ± std, AUC, episodes to
reach GRPO's final success), reuse of finished runs (no process launched), bad arguments,
and one real end-to-end bench of two tiny runs."""
import itertools
import json
import os
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from bench import compare as bench  # noqa: E402  (the compare; its entries come from bench/entries.py)
from bench import entries  # noqa: E402
from bench import gap  # noqa: E402
from bench import report  # noqa: E402
from conftest import TINY_BASE  # noqa: E402
import train  # noqa: E402
import warmup  # noqa: E402
from plugins import baselines  # noqa: E402
from plumbing import registry  # noqa: E402

TINY = ["--episodes", "48", "--batch", "16", *TINY_BASE, "--init_episodes", "16", "--cold_start_steps", "2",
        "--eval_every", "2", "--eval_tasks", "16", "--teacher_eval", "8"]


def fake_run(d, method, seed, xs, ys, teacher=None, delta=None, summary=True, ckpt=False, code=None, tasks=None, base=None):
    """A run folder as train.py leaves it: config.json, metrics.jsonl, summary.json (tasks: the last
    evaluation's per-task rewards; base: its --warmup_seed, if any)."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"method": method, "seed": seed, "code": code or train.CODE, **({"warmup_seed": base} if base is not None else {})}, f)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for i, (x, y) in enumerate(zip(xs, ys)):
            m = {"reward": y, "success": y, "episodes": x, "step": i, "delta": delta, "loss": None}
            if method == "lopd":
                m["beta"] = 0.1 * i
            if teacher is not None:
                m.update(teacher_reward=teacher, student_reward_same_tasks=y)
            if tasks is not None and i == len(xs) - 1:
                m["task_reward"] = tasks
            f.write(json.dumps(m) + "\n")
    if summary:
        with open(os.path.join(d, "summary.json"), "w") as f:
            json.dump({"method": method, "seed": seed, "episodes": xs[-1], "base_success": ys[0], "final_success": ys[-1], "final_reward": ys[-1],
                       "best_success": max(ys), "teacher_reward": teacher, "wall_seconds": 10.0,
                       "setup_episodes": 256 if method == "lopd" else 0}, f)
    if ckpt:
        open(os.path.join(d, "ckpt.pt"), "w").close()


def test_auc_and_reach_by_hand():
    # the docstring's example: (0.5 * 512 + 0.75 * 512) / 1024
    assert report.auc([0, 512, 1024], [0.5, 0.5, 1.0], 1024) == pytest.approx(0.625)
    assert report.auc([0, 1024], [1.0, 1.0], 1024) == pytest.approx(1.0)
    assert report.episodes_to_reach([0, 512, 1024], [0.5, 0.6, 0.7], 0.6) == 512
    assert report.episodes_to_reach([0, 512, 1024], [0.5, 0.6, 0.7], 0.8) is None


def slow_bootstrap(values, n_boot=2000, seed=0, level=0.95):
    """The two-level bootstrap written as loops, with the same draws as report.bootstrap_ci."""
    v = np.asarray(values, float)
    S, T = v.shape
    rng = np.random.default_rng(seed)
    seeds, tasks = rng.integers(0, S, (n_boot, S)), rng.integers(0, T, (n_boot, S, T))
    means = []
    for b in range(n_boot):
        total = 0.0
        for j in range(S):
            total += sum(v[seeds[b, j], tasks[b, j, k]] for k in range(T)) / T
        means.append(total / S)
    means = sorted(means)
    return v.mean(), np.percentile(means, 100 * (1 - level) / 2), np.percentile(means, 100 * (1 + level) / 2)


def test_bootstrap_interval_against_a_slow_reference_and_by_hand():
    rng = np.random.default_rng(1)
    values = rng.random((3, 40)) < [[0.2], [0.5], [0.8]]                         # 3 seeds, 40 tasks, 0/1
    assert report.bootstrap_ci(values, n_boot=300) == pytest.approx(slow_bootstrap(values, n_boot=300))
    mean, lo, hi = report.bootstrap_ci(np.full((2, 10), 0.25))
    assert mean == lo == hi == 0.25                                            # nothing varies: no width
    mean, lo, hi = report.bootstrap_ci([[0.0, 1.0] * 250])                      # one seed, 500 tasks of p = 0.5
    assert mean == 0.5 and hi - lo == pytest.approx(2 * 1.96 * 0.5 / np.sqrt(500), rel=0.15)
    # the seed level counts: two seeds far apart give a much wider interval than their tasks alone
    assert np.subtract(*report.bootstrap_ci([[0.0] * 100, [1.0] * 100])[2:0:-1]) == pytest.approx(1.0)


def old_bootstrap(values, n_boot=2000, seed=0, level=0.95):
    """report.bootstrap_ci as it was before bases: a (S, T) input must still give exactly these numbers."""
    v = np.asarray(values, float)
    S, T = v.shape
    rng = np.random.default_rng(seed)
    s = rng.integers(0, S, (n_boot, S))
    t = rng.integers(0, T, (n_boot, S, T))
    means = v[s[..., None], t].mean((1, 2))
    lo, hi = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    return float(v.mean()), float(lo), float(hi)


def test_seeds_and_tasks_alone_give_exactly_the_old_numbers():
    rng = np.random.default_rng(3)
    for shape, n_boot, seed, level in [((3, 40), 2000, 0, 0.95), ((1, 500), 500, 7, 0.9), ((5, 12), 300, 1, 0.5)]:
        values = rng.random(shape)
        assert report.bootstrap_ci(values, n_boot, seed, level) == old_bootstrap(values, n_boot, seed, level)
        assert report.bootstrap_ci(values.tolist(), n_boot, seed, level) == old_bootstrap(values, n_boot, seed, level)
    # and so do the compare's consumers when the runs come from one base, named as ever or by --warmup_seeds
    a, b = {"1": [1.0, 0.0, 1.0], "2": [1.0, 1.0, 0.0]}, {"1": [0.0, 0.0, 1.0], "2": [1.0, 0.0, 0.0]}
    want = old_bootstrap([np.subtract(a[k], b[k]) for k in a])
    assert report.paired(a, b) == want
    assert report.paired({f"w7-s{k}": v for k, v in a.items()}, {f"w7-s{k}": v for k, v in b.items()}) == want
    evs = [[{"task_reward": a[k]}] for k in a]
    assert report.final_stats(evs)["reward"] == old_bootstrap(list(a.values()))


def slow_bases_bootstrap(values, n_boot=2000, seed=0, level=0.95):
    """The three-level bootstrap written as loops, with the same draws as report.bootstrap_ci: per replicate,
    W bases drawn; per drawn base, as many of its own seeds as it has; per drawn seed, T of its tasks."""
    bases = [np.asarray(b, float) for b in values]
    n = np.array([len(b) for b in bases])
    W, S, T = len(bases), n.max(), bases[0].shape[1]
    rng = np.random.default_rng(seed)
    drawn_bases = rng.integers(0, W, (n_boot, W))
    drawn_seeds = rng.integers(0, n[drawn_bases][..., None], (n_boot, W, S))
    drawn_tasks = rng.integers(0, T, (n_boot, W, S, T))
    means = []
    for b in range(n_boot):
        base_means = []
        for i in range(W):
            base = bases[drawn_bases[b, i]]
            seed_means = [sum(base[drawn_seeds[b, i, j], drawn_tasks[b, i, j, k]] for k in range(T)) / T
                          for j in range(len(base))]    # the base's own number of seeds, the rest of the draws unused
            base_means.append(sum(seed_means) / len(seed_means))
        means.append(sum(base_means) / W)
    return (np.mean([b.mean() for b in bases]), np.percentile(means, 100 * (1 - level) / 2),
            np.percentile(means, 100 * (1 + level) / 2))


def test_bases_bootstrap_against_a_slow_reference():
    rng = np.random.default_rng(2)
    values = rng.random((3, 2, 15)) < rng.random((3, 2, 1))                     # 3 bases, 2 seeds, 15 tasks, 0/1
    assert report.bootstrap_ci(values, n_boot=200, seed=4) == pytest.approx(slow_bases_bootstrap(values, n_boot=200, seed=4))
    ragged = [rng.random((3, 10)), rng.random((1, 10)), rng.random((2, 10))]    # a base lost two runs, another one
    assert report.bootstrap_ci(ragged, n_boot=200) == pytest.approx(slow_bases_bootstrap(ragged, n_boot=200))


def test_bases_bootstrap_by_hand():
    # two bases of one seed and one task, 0 and 1: a replicate draws both bases the same with probability 1/2
    # (mean 0 or 1, 1/4 each) and one of each with 1/2 (mean 0.5)
    assert report.bootstrap_ci([[[0.0]], [[1.0]]], n_boot=4000) == (0.5, 0.0, 1.0)
    assert report.bootstrap_ci([[[0.0]], [[1.0]]], n_boot=4000, level=0.4) == (0.5, 0.5, 0.5)  # 30% and 70%: both 0.5
    assert report.bootstrap_ci(np.full((2, 3, 4), 0.25)) == (0.25, 0.25, 0.25)                 # nothing varies
    # a base counts once, however many of its runs finished: (1 + 0) / 2, not 1/3
    assert report.bootstrap_ci([[[1.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]]])[0] == 0.5
    # three bases alike, each one seed at 0 and one at 1: a replicate draws 2 seeds in each of 3 drawn bases, its mean
    # is Binomial(6, 1/2) / 6, whose 2.5% and 97.5% points are 1/6 and 5/6 (P(0) = 1/64, P(<= 1/6) = 7/64)
    assert report.bootstrap_ci([[[0.0] * 50, [1.0] * 50]] * 3) == pytest.approx((0.5, 1 / 6, 5 / 6))
    # the exact bootstrap distribution of a tiny case (2 bases x 2 seeds x 2 tasks), every draw enumerated:
    # 2^2 base draws x 2^4 seed draws x 2^8 task draws, equally likely
    v = np.array([[[0.0, 1.0], [1.0, 1.0]], [[0.0, 0.0], [1.0, 0.0]]])
    exact = [np.mean([v[w[i], s[2 * i + j], t[4 * i + 2 * j + k]] for i in range(2) for j in range(2) for k in range(2)])
             for w in itertools.product(range(2), repeat=2) for s in itertools.product(range(2), repeat=4)
             for t in itertools.product(range(2), repeat=8)]
    for level in (0.5, 0.8):
        q = np.quantile(exact, [(1 - level) / 2, (1 + level) / 2], method="inverted_cdf")
        assert report.bootstrap_ci(v, n_boot=20000, level=level) == (0.5, *q)   # (0.375, 0.625) and (0.125, 0.875)


def test_summarize_and_reach_on_fake_runs(tmp_path):
    d = str(tmp_path)
    fake_run(f"{d}/g1", "grpo", 1, [0, 512, 1024], [0.5, 0.6, 0.7])
    fake_run(f"{d}/g2", "grpo", 2, [0, 512, 1024], [0.5, 0.5, 0.5])
    # lopd's eval points differ from grpo's (the bank filling comes first) and between its
    # two runs here: the seed curves meet on the union of their points
    fake_run(f"{d}/l1", "lopd", 1, [0, 256, 1024], [0.5, 0.7, 0.8], teacher=0.9, delta=0.2)
    fake_run(f"{d}/l2", "lopd", 2, [0, 512, 1024], [0.5, 0.6, 0.4], teacher=0.7, delta=0.4)
    fake_run(f"{d}/o1", "opsd", 1, [0, 512, 1024], [0.5, 0.2, 0.1], teacher=0.0)
    fake_run(f"{d}/x1", "opsd", 2, [0, 512], [0.5, 0.2])                   # short of the budget: left out
    res = {"grpo": report.summarize([f"{d}/g1", f"{d}/g2"], 1024),
           "lopd": report.summarize([f"{d}/l1", f"{d}/l2"], 1024),
           "opsd": report.summarize([f"{d}/o1", f"{d}/x1"], 1024),
           "sdpo": report.summarize([f"{d}/missing"], 1024)}
    g, lo, op = res["grpo"], res["lopd"], res["opsd"]
    assert g["final_mean"] == pytest.approx(0.6) and g["final_std"] == pytest.approx(np.std([0.7, 0.5], ddof=1))
    assert op["final"] == [0.1] and op["final_std"] == 0.0 and res["sdpo"] is None
    assert lo["best_mean"] == pytest.approx((0.8 + 0.6) / 2) and lo["base_mean"] == 0.5
    # AUC by hand: seed 1 (0.5+0.7)/2*256 + (0.7+0.8)/2*768 = 729.6; seed 2 (0.5+0.6)/2*512 + (0.6+0.4)/2*512 = 537.6
    assert lo["auc_mean"] == pytest.approx((729.6 + 537.6) / 2 / 1024)
    assert lo["curve"]["episodes"] == [0, 256, 512, 1024]
    assert lo["curve"]["mean"] == pytest.approx([0.5, (0.7 + 0.55) / 2, (0.7 + 0.1 / 3 + 0.6) / 2, 0.6])
    assert lo["diagnostics"]["delta_mean"] == pytest.approx(0.3) and lo["diagnostics"]["teacher_reward"] == 0.8
    assert lo["diagnostics"]["beta_final"] == pytest.approx(0.2) and "beta_final" not in op["diagnostics"]
    assert "delta_mean" not in g["diagnostics"]
    # every teacher without its context is θ0: the first evaluation's student on the same tasks
    assert lo["diagnostics"]["teacher_without_context"] == 0.5 == op["diagnostics"]["teacher_without_context"]
    assert "teacher_without_context" not in g["diagnostics"]
    assert [e["beta"] for e in lo["evals"][1]] == pytest.approx([0.0, 0.1, 0.2]) and len(lo["evals"]) == 2
    # GRPO's final mean is 0.6: lopd's mean curve reaches it at 256, grpo's own at 1024, opsd never
    assert report.add_reach(res) == pytest.approx(0.6)
    assert (lo["episodes_to_grpo_final"], g["episodes_to_grpo_final"], op["episodes_to_grpo_final"]) == (256, 1024, None)
    # the paper's accounting: lopd's 256 bank-filling episodes are not counted
    assert (lo["training_episodes_to_grpo_final"], g["training_episodes_to_grpo_final"]) == (0, 1024)
    # GRPO ending at or below the base makes the target meaningless: the table says so
    low = {"grpo": report.summarize([f"{d}/g2"], 1024), "opsd": res["opsd"]}
    assert report.add_reach(low) == 0.5 and low["opsd"]["episodes_to_grpo_final"] == 0
    meta = {"env": "tooluse", "seeds": [1], "episodes": 1024, "command": "c", "commit": "x", "code": "y",
            "forwarded": [], "tuned": False, "flags": {"grpo": [], "opsd": []}, "failed": []}
    report.write_results(d, low, meta, 0.5)
    assert "| 0 (GRPO ends ≤ base) / 0 (GRPO ends ≤ base) |" in open(f"{d}/results.md").read()


def test_finished_runs_are_reused_and_unfinished_resumed(tmp_path, monkeypatch):
    out = str(tmp_path)
    calls = []

    def launch(cmd, log_path, env, signals=()):  # instead of a train.py process: a fake finished run
        calls.append(cmd)
        name = os.path.basename(cmd[cmd.index("--resume") + 1]) if "--resume" in cmd else cmd[cmd.index("--name") + 1]
        fake_run(f"{out}/{name}", name.split("-")[1], int(name[-1]), [0, 32, 64], [0.5, 0.5, 0.6])
        for _, event in signals:
            if event:
                event.set()
        return 0

    monkeypatch.setattr(bench, "launch", launch)
    for m in ["lopd", "grpo"]:
        for s in [1, 2]:
            fake_run(f"{out}/cmp-{m}-tooluse-e64-s{s}", m, s, [0, 32, 64], [0.5, 0.6, 0.7 if m == "grpo" else 0.4])
    argv = ["--methods", "lopd,grpo", "--seeds", "1,2", "--out_dir", out, "--episodes", "64"]
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 0 and calls == []
    table = open(f"{out}/compare-tooluse/results.md").read()
    assert "| lopd | `--method lopd` | 2 | 0.400 ± 0.000 |" in table and "| grpo |" in table and "not reached" in table
    res = json.load(open(f"{out}/compare-tooluse/results.json"))
    assert res["grpo_final_mean"] == pytest.approx(0.7) and res["entries"]["grpo"]["episodes_to_grpo_final"] == 64
    # one run interrupted (a checkpoint, no summary), one never started: only those two run
    for name in ["cmp-lopd-tooluse-e64-s2", "cmp-grpo-tooluse-e64-s2"]:
        os.remove(f"{out}/{name}/summary.json")
    fake_run(f"{out}/cmp-lopd-tooluse-e64-s2", "lopd", 2, [0, 32], [0.5, 0.6], summary=False, ckpt=True)
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert len(calls) == 2
    assert calls[0][-4:] == ["--resume", f"{out}/cmp-lopd-tooluse-e64-s2", "--episodes", "64"]
    assert "--resume" not in calls[1] and calls[1][calls[1].index("--seed") + 1] == "2"


def test_tune_picks_the_best_setting_and_the_compare_uses_it(tmp_path, monkeypatch):
    """Every method: lr ×1/3, ×1, ×3 and its knob on seed 0. lopd: lr 9e-4 beats the default on every task,
    on seed 0 and again on the confirmation seed (chosen); grpo: its knob (--batch 32) is 3 points better on
    average but task by task within the noise, and lr 3e-5 beats the default on seed 0 but loses as much on
    the confirmation seed, so the default is kept."""
    out, calls = str(tmp_path), []
    assert bench.TUNE["lopd"] == [[], ["--lr", "1e-4"], ["--lr", "9e-4"], ["--cold_start_steps", "300"]]
    assert bench.TUNE["grpo"] == [[], ["--lr", "3e-5"], ["--lr", "3e-4"], ["--batch", "32"]]
    assert all(len(g) == 4 and g[0] == [] for g in bench.TUNE.values())  # the same grid for every method

    def launch(cmd, log_path, env, signals=()):
        calls.append(cmd)
        name = cmd[cmd.index("--name") + 1]
        tasks = [0.0, 1.0] * 50                                       # the default: 0.5
        if "lopd" in name and "lr9e-4" in name:
            tasks = [0.2, 1.0] * 50                                   # +0.2 on half the tasks, never worse
        if "grpo" in name and "lr3e-5" in name:
            tasks = [0.1, 1.0] * 50 if name.endswith("-s0") else [0.0, 0.9] * 50  # +0.05 on seed 0, -0.05 on 100
        if "grpo" in name and "batch32" in name:
            tasks = [1.0, 0.0] * 50                                   # as often better as worse ...
            tasks[:6] = [1.0] * 6                                     # ... and 0.03 better on average
        fake_run(f"{out}/{name}", "x", int(name.rsplit("-s", 1)[1]), [0, 32, 64], [0.5, 0.6, float(np.mean(tasks))], tasks=tasks)
        return 0

    monkeypatch.setattr(bench, "launch", launch)
    with pytest.raises(SystemExit):
        bench.main(["--tune", "--methods", "lopd,grpo,lopd-m0", "--out_dir", out, "--episodes", "64"])
    seeds = [c[c.index("--seed") + 1] for c in calls]
    assert len(calls) == 12 and seeds[:8] == ["0"] * 8 and seeds[8:] == ["100"] * 4  # 4 settings each; 2 winners × 2
    names = [c[c.index("--name") + 1] for c in calls]
    assert {"tune-lopd-tooluse-e64-lr9e-4-s100", "tune-lopd-tooluse-e64-default-s100", "tune-grpo-tooluse-e64-lr3e-5-s100"} <= set(names)
    tuning = json.load(open(f"{out}/compare-tooluse/tuning.json"))
    assert tuning["lopd"]["flags"] == ["--lr", "9e-4"] and tuning["lopd"]["final_reward"] == pytest.approx(0.6)
    assert tuning["lopd"]["both_seeds"][1] > 0 and tuning["grpo"]["both_seeds"][1] < 0 < tuning["grpo"]["both_seeds"][2]
    assert tuning["grpo"]["flags"] == [] and [s["final_reward"] for s in tuning["grpo"]["grid"]] == pytest.approx([0.5, 0.55, 0.5, 0.53])
    assert tuning["grpo"]["grid"][1]["confirm"]["final_reward"] == pytest.approx(0.45)
    md = open(f"{out}/compare-tooluse/tuning.md").read()
    assert md.count("✓") == 2 and "| +0.100 [+0.0" in md and "| +0.030 [-0." in md and "| +0.000 [-0.0" in md
    calls.clear()
    with pytest.raises(SystemExit):
        bench.main(["--methods", "lopd,lopd-m0", "--seeds", "1", "--out_dir", out, "--episodes", "64"])
    lo, m0 = sorted(calls, key=lambda c: "lopd-m0" in c[c.index("--name") + 1])  # launched longest first
    assert lo[lo.index("--lr") + 1] == "9e-4" and "-e64-" in lo[lo.index("--name") + 1]
    assert m0[m0.index("--lr") + 1] == "9e-4"  # an ablation takes its method's tuned flags
    assert m0[len(m0) - 1 - m0[::-1].index("--margin") + 1] == "0"  # the ablation's own flag comes last, so it holds
    assert lo[lo.index("--name") + 1] != "cmp-lopd-tooluse-e64-s1"  # tuned runs are not the untuned ones


@pytest.mark.parametrize("argv,words", [
    (["--methods", "lopd,nope"], ["--methods", "nope"]),
    (["--teacher_gap", "--methods", "nope"], ["--methods", "nope", "lopd-copy", "trajtext-expert"]),  # its extra rows listed
    (["--seeds", "0,1"], ["--seeds", "seeds 0 and 100"]),
    (["--seeds", "1,100"], ["--seeds", "validation"]),   # the confirmation seed of --tune is not reported either
    (["--seed", "3"], ["--seed"]),
    (["--set", "lr"], ["--set", "lr"]),
    (["--methods", "grpo", "--batch", "6"], ["--batch", "6"]),   # train.py's own check, before any run
    (["--methods", "lopd", "--margin", "-1"], ["--margin", "-1"]),
    (["--warmup_seeds", "7,x"], ["--warmup_seeds", "'7,x'", "integers"]),
    (["--warmup_seeds", "7,,8"], ["--warmup_seeds", "integers"]),
    (["--warmup_seeds", "7,7"], ["--warmup_seeds", "each base once"]),
    (["--warmup_seeds=-1"], ["--warmup_seeds", ">= 0"]),
    (["--tune", "--warmup_seeds", "7"], ["--warmup_seeds", "--tune"]),           # tuning stays on the default base
    (["--warmup_seeds", "7,8", "--set", "warmup_seed=9"], ["--warmup_seed ", "--warmup_seeds"]),
])
def test_bad_argument_exits_2_with_one_line(argv, words, tmp_path, capsys, monkeypatch):
    """In-process (no 4 s interpreter start each): one line, exit status 2, nothing started."""
    monkeypatch.setattr(bench, "launch", lambda *a, **kw: pytest.fail("a run was launched"))
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, "--out_dir", str(tmp_path)])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert e.value.code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("bench: error:") and all(w in lines[0] for w in words), lines[0]
    assert not os.listdir(tmp_path)  # nothing was started


def test_warmup_seeds_parse():
    assert bench.parse([]).warmup_seeds == [] and bench.parse(["--warmup_seeds", ""]).warmup_seeds == []
    assert bench.parse(["--warmup_seeds", "1234,7,0"]).warmup_seeds == [1234, 7, 0]
    # without --warmup_seeds a forwarded --warmup_seed is any forwarded flag: every run on that one base
    assert bench.parse(["--warmup_seed", "7"]).extras == ["--warmup_seed", "7"]


def test_two_bases_plan_their_own_runs_and_the_report_resamples_them(tmp_path, monkeypatch):
    """--warmup_seeds 7,8: every entry and seed on each base, named -w<W>-s<seed>, each with its --warmup_seed;
    LOPD's setups are never shared across bases; the first run of each base builds its warm-up; the report keys
    each run's per-task rewards by base and seed and resamples the bases too."""
    out, calls, lock = str(tmp_path), [], threading.Lock()
    tasks = {(7, 1): [1.0, 0.0, 1.0, 1.0], (7, 2): [1.0, 1.0, 1.0, 0.0], (8, 1): [0.0, 0.0, 1.0, 0.0], (8, 2): [0.0, 1.0, 0.0, 0.0]}

    def launch(cmd, log_path, env, signals=()):
        name, base = cmd[cmd.index("--name") + 1], int(cmd[cmd.index("--warmup_seed") + 1])
        with lock:
            calls.append((name, base, cmd, dict(signals)["warm-up"] is not None))
        seed = int(cmd[cmd.index("--seed") + 1])
        fake_run(f"{out}/{name}", name.split("-")[1], seed, [0, 64], [0.5, float(np.mean(tasks[base, seed]))],
                 tasks=tasks[base, seed], base=base)
        for _, event in signals:
            if event:
                event.set()
        return 0
    monkeypatch.setattr(bench, "launch", launch)
    with pytest.raises(SystemExit) as e:
        bench.main(["--methods", "lopd,grpo", "--seeds", "1,2", "--warmup_seeds", "7,8", "--out_dir", out, "--episodes", "64"])
    assert e.value.code == 0
    assert {n for n, *_ in calls} == {f"cmp-{m}-tooluse-e64-w{w}-s{s}" for m in ("lopd", "grpo") for w in (7, 8) for s in (1, 2)}
    for name, base, cmd, _ in calls:
        assert cmd[cmd.index("--warmup_seed") + 1] == name.split("-w")[1].split("-")[0] == str(base)
        assert cmd.count("--warmup_seed") == 1 and cmd[cmd.index("--method") + 1] == name.split("-")[1]
    assert sorted(base for _, base, _, builds in calls if builds) == [7, 8]  # one warm-up builder per base
    plan = lambda w, s=1: bench.plan("cmp", "lopd", bench.ENTRIES["lopd"], bench.ENTRIES["lopd"], "tooluse", s, base=w)
    assert plan(7)["setup"] != plan(8)["setup"] and plan(7)["setup"] == plan(7)["setup"] and plan(7)["setup"] != plan(7, 2)["setup"]
    assert plan(4)["setup"] == plan(None)["setup"] and plan(4)["name"].endswith("-e3072-w4-s1")  # train.py's base, named
    assert plan(None)["name"] == "cmp-lopd-tooluse-e3072-s1" and "--warmup_seed" not in plan(None)["flags"]  # as ever
    res = json.load(open(f"{out}/compare-tooluse/results.json"))
    assert res["warmup_seeds"] == [7, 8] and res["cpu_kernels"] == warmup.cpu_kernels() and res["torch"] == torch.__version__
    lo = res["entries"]["lopd"]
    assert sorted(lo["task_reward"]) == ["w7-s1", "w7-s2", "w8-s1", "w8-s2"] and sorted(lo["warmup_seeds"]) == [7, 7, 8, 8]
    by_base = [[tasks[w, s] for s in (1, 2)] for w in (7, 8)]
    assert lo["ci"]["reward"] == pytest.approx(report.bootstrap_ci(by_base)) and lo["ci"]["reward"][0] == pytest.approx(0.5)
    md = open(f"{out}/compare-tooluse/results.md").read()
    assert "bases: warm-up seeds 7, 8" in md and f"on {warmup.cpu_kernels()} CPU kernels" in md
    assert "three-level bootstrap: bases, seeds, tasks" in md and "| entry | flags | runs |" in md


def test_end_to_end_tiny_bench(tmp_path, capsys, base_in):
    """Two real tiny runs (lopd, grpo on seed 1) as train.py processes, two at a time, on the
    shared tiny base; the bench itself runs in this process. Forwarded flags that grpo does not
    read are dropped for it. (Waiting for a warm-up being built: the fake-launch tests below.)"""
    base_in(tmp_path)
    with pytest.raises(SystemExit) as e:
        bench.main(["--methods", "lopd,grpo", "--seeds", "1", "--out_dir", str(tmp_path), *TINY])
    out, err = capsys.readouterr()
    assert e.value.code == 0, out + err[-3000:]
    cmp = tmp_path / "compare-tooluse"
    for f in ["results.md", "results.json", "curves.png", "actions.png"]:
        assert (cmp / f).is_file(), f
    rows = [line.split("|")[1].strip() for line in (cmp / "results.md").read_text().splitlines() if line.startswith("| ")]
    assert rows[1:3] == ["lopd", "grpo"]  # after the header row
    res = json.loads((cmp / "results.json").read_text())
    lo = res["entries"]["lopd"]
    assert res["episodes"] == 48 and lo["seeds"] == [1] and 0 <= lo["auc_mean"] <= 1
    assert "teacher_reward" in lo["diagnostics"] and "beta_final" in lo["diagnostics"]
    assert len(lo["curve"]["episodes"]) == len(lo["curve"]["mean"]) >= 2
    assert (cmp / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # what success hides: the action types of the first and last evaluation, the entropy once trained
    acts = lo["actions"]
    assert set(acts["base"]) >= {"repeated", "actions_per_episode", "chars_per_action"} and acts["entropy"]["mean"][-1] > 0
    assert "What success hides" in (cmp / "results.md").read_text()
    logs = sorted(os.listdir(cmp / "logs"))
    assert len(logs) == 2 and all(n.startswith("cmp-") and n.endswith("-s1.log") for n in logs)
    last = out.strip().splitlines()[-1]
    assert last.startswith("bench: 2 runs (2 launched, 0 failed)") and "results.md" in last


def test_a_run_made_by_other_code_is_stale_and_run_again(tmp_path, monkeypatch):
    out, calls = str(tmp_path), []
    fake_run(f"{out}/cmp-grpo-tooluse-e64-s1", "grpo", 1, [0, 64], [0.5, 0.6], code="0ldc0de000")
    assert bench.status(f"{out}/cmp-grpo-tooluse-e64-s1", 64) == "stale"
    fake_run(f"{out}/cmp-grpo-tooluse-e64-s2", "grpo", 2, [0, 64], [0.5, 0.6])
    assert bench.status(f"{out}/cmp-grpo-tooluse-e64-s2", 64) == "done"

    def launch(cmd, log_path, env, signals=()):
        calls.append(cmd)
        assert not os.path.exists(f"{out}/cmp-grpo-tooluse-e64-s1")  # the stale folder is gone first
        fake_run(f"{out}/cmp-grpo-tooluse-e64-s1", "grpo", 1, [0, 64], [0.5, 0.7])
        return 0
    monkeypatch.setattr(bench, "launch", launch)
    with pytest.raises(SystemExit):
        bench.main(["--methods", "grpo", "--seeds", "1,2", "--out_dir", out, "--episodes", "64"])
    assert len(calls) == 1 and "--resume" not in calls[0]


def test_longest_runs_go_first_and_a_shared_cold_start_is_built_once(tmp_path, monkeypatch):
    """lopd-m0 and lopd-frozen of one seed share LOPD's cold start: the first launched builds
    it, the other starts only once it is cached; GRPO (short) goes last, not waiting."""
    out, log, lock = str(tmp_path), [], threading.Lock()

    def launch(cmd, log_path, env, signals=()):
        name = cmd[cmd.index("--name") + 1]
        with lock:
            log.append(("start", name))
        events = dict(signals)
        if events["warm-up"]:
            events["warm-up"].set()  # the warm-up at once, the cold start later
        time.sleep(0.3)
        with lock:
            log.append(("cached", name))
        if events["setup"]:
            events["setup"].set()
        time.sleep(0.3)
        fake_run(f"{out}/{name}", "lopd" if "lopd" in name else "grpo", 1, [0, 64], [0.5, 0.6])
        return 0
    monkeypatch.setattr(bench, "launch", launch)
    with pytest.raises(SystemExit):
        bench.main(["--methods", "grpo,lopd-frozen,lopd-m0", "--seeds", "1", "--out_dir", out, "--episodes", "64"])
    starts = [name for what, name in log if what == "start"]
    assert [n.split("-tooluse")[0] for n in starts] == ["cmp-lopd-m0", "cmp-lopd-frozen", "cmp-grpo"]
    assert log.index(("start", starts[1])) > log.index(("cached", starts[0]))  # waited for the cache
    runs = bench.plan("cmp", "lopd-m0", bench.ENTRIES["lopd-m0"], bench.ENTRIES["lopd-m0"], "tooluse", 1), \
        bench.plan("cmp", "lopd-frozen", bench.ENTRIES["lopd-frozen"], bench.ENTRIES["lopd-frozen"], "tooluse", 1), \
        bench.plan("cmp", "lopd", bench.ENTRIES["lopd"], bench.ENTRIES["lopd"], "tooluse", 2), \
        bench.plan("cmp", "lopd", bench.ENTRIES["lopd"], ["--lr", "3e-4"] + bench.ENTRIES["lopd"], "tooluse", 1)
    assert runs[0]["setup"] == runs[1]["setup"]  # same seed, differ only after the cold start
    assert runs[2]["setup"] != runs[0]["setup"]  # another seed
    assert runs[3]["setup"] != runs[0]["setup"]  # another composer lr


def test_entries_tuning_and_costs_come_from_the_registry(monkeypatch):
    """Registering a method (here a copy of GRPO with an ablation) is the only edit: it gets a
    bench entry, its ablation, its grid and its cost, and forwarded flags it does not read are dropped."""
    monkeypatch.setitem(registry.METHODS, "grpo2", registry.Method(
        baselines.grpo_loss, teacher="none", group=4,
        bench={"grpo2": dict(cost=1, knob=["--batch", "8"]), "grpo2-slow": dict(flags=["--lr", "1e-5"])}))
    entries.read_registry()  # in place: a reload would leave bench.compare holding the old tables (and later tests with them)
    b = entries
    try:
        assert b.ENTRIES["grpo2"] == ["--method", "grpo2"] and b.ENTRIES["grpo2-slow"] == ["--method", "grpo2", "--lr", "1e-5"]
        assert b.TUNE["grpo2"] == [[], ["--lr", "3e-4"], ["--lr", "3e-3"], ["--batch", "8"]] and b.COST["grpo2"] == 1
        assert list(b.ENTRIES).index("grpo2") < list(b.ENTRIES).index("lopd-frozen")  # methods first, then ablations
        assert b.for_method(["--cold_start_steps", "3", "--freeze_composer", "--lr", "1e-3"], "grpo2") == ["--lr", "1e-3"]
        assert b.for_method(["--cold_start_steps=3", "--freeze_composer"], "lopd") == ["--cold_start_steps=3", "--freeze_composer"]
        assert bench.ENTRIES is entries.ENTRIES and "grpo2" in bench.ENTRIES
    finally:
        monkeypatch.undo()
        entries.read_registry()


def test_the_warm_up_is_done_only_at_train_py_line_not_at_its_progress_bar():
    assert not bench.cached("warm-up:   0%|          | 0/250 [00:00<?, ?it/s]", "warm-up")
    assert bench.cached("warm-up:  12%| 30/250\nwarm-up: runs/warmup-tooluse-0123456789.pt\n", "warm-up")
    assert bench.cached("warm-up: cached /tmp/x y/warmup-codegen-0123456789.pt", "warm-up")
    assert not bench.cached("setup:  10%| 30/300 [00:30<05:00, nll=0.02]", "setup")
    assert bench.cached("setup: runs/setup-lopd-tooluse-s1-0123456789.pt", "setup")
    assert not bench.cached("setup: runs/setup-lopd-tooluse-s1-0123456789.pt", "warm-up")


def test_teacher_gap_report_on_the_tiny_base(tmp_path, capsys, base_in):
    """--teacher_gap builds each run in-process (warm-up cached, LOPD's cold start) and writes
    one row per teacher and its controls (another family's context, an empty one; LOPD's
    other-family experiences); the student's column is the
    base's greedy success on the same tasks, recomputed here."""
    import numpy as np
    base_in(tmp_path)
    cut = TINY.index("--eval_tasks")
    tiny = TINY[:cut] + TINY[cut + 4:]  # without --eval_tasks 16 --teacher_eval 8: the report sets its own
    bench.main(["--teacher_gap", "--methods", "opsd,lopd,lopd-expert", "--gap_tasks", "12", "--out_dir", str(tmp_path), *tiny])
    out = capsys.readouterr().out
    table = json.loads((tmp_path / "compare-tooluse" / "teacher_gap.json").read_text())
    assert set(table) == {"student", "lopd-control", "lopd-expert-control",
                          *(e + c for e in ["opsd", "lopd", "lopd-expert"] for c in ["", "-donor", "-empty"])}
    for name, row in table.items():
        assert 0 <= row["success"] <= 1 and (row["opaque"] is None or 0 <= row["opaque"] <= 1), name
    args = train.parse_args([*tiny, "--method", "lopd", "--out_dir", str(tmp_path), "--name", "check"])
    env = train.envs.make_env("tooluse")
    tok, model = warmup.load_model(args, env)
    warmup.warmup(args, tok, model, env, "cpu")
    tasks = env.eval_tasks[:12]
    want = np.mean([e.reward for e in train.rollout(model.eval(), tok, env, tasks, greedy=True)[0]])
    assert table["student"]["success"] == pytest.approx(want)
    md = (tmp_path / "compare-tooluse" / "teacher_gap.md").read_text()
    assert "| lopd-control |" in md and "teacher_gap.md" in out.strip().splitlines()[-1]
    for name in ["opsd", "lopd"]:  # the utility statistics: a mean KL ≥ 0 where such rollouts got a context
        assert all(v is None or v >= 0 for v in (table[name]["kl_success"], table[name]["kl_failure"]))
    assert table["opsd"]["kl_failure"] > 0  # every rollout has a context; the tiny base fails most tasks
    assert "Spearman" not in md  # no quick compare in this folder: nothing to correlate


def test_spearman_against_hand_values():
    assert gap.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert gap.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties get their mean rank: x ranks [0, 1.5, 1.5, 3], y ranks [0, 1, 2, 3] -> Pearson of the ranks
    x, y = np.array([0, 1.5, 1.5, 3]), np.array([0, 1, 2, 3])
    assert gap.spearman([1, 5, 5, 9], [1, 2, 3, 4]) == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert gap.spearman([1, 1, 1], [1, 2, 3]) is None and gap.spearman([1, 2], [2, 1]) is None


def test_utility_correlation_pairs_each_run_with_its_methods_row(tmp_path):
    """Each (entry, seed) of results.json is a pair (its method's statistic, final − base); an
    ablation takes its method's row; entries without a row (no teacher) are left out."""
    results = {"entries": {"lopd": {"final": [0.6, 0.7], "base_mean": 0.5}, "lopd-frozen": {"final": [0.4], "base_mean": 0.5},
                           "opsd": {"final": [0.3, 0.2], "base_mean": 0.5}, "grpo": {"final": [0.9], "base_mean": 0.5},
                           "sdpo": None}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    table = {"student": {"success": 0.5}, "lopd": {"success": 0.8, "kl_success": 0.1, "kl_failure": 0.3},
             "opsd": {"success": 0.6, "kl_success": 0.2, "kl_failure": None}}
    corr = gap.utility_correlation(str(tmp_path), table)
    gains = [0.1, 0.2, -0.1, -0.2, -0.3]  # lopd ×2, lopd-frozen (lopd's row), opsd ×2
    assert corr["teacher gap"] == (pytest.approx(gap.spearman([0.3, 0.3, 0.3, 0.1, 0.1], gains)), 5)
    assert corr["KL, failures"] == (None, 3)   # opsd has no failed rollout: 3 pairs, all of one value
    assert corr["KL, failures − successes"][1] == 3
    assert gap.utility_correlation(str(tmp_path / "nowhere"), table) is None


def test_a_compare_entry_takes_the_row_of_its_own_teacher():
    """Controls take the report's control rows; an ablation whose flags change the step-0 teacher (K, the
    cold start, the context) needs a row of its own and is otherwise left out of the law; one that acts
    only during training (the composer phase, the margin, the divergence) takes its method's."""
    table = {k: {"success": 0.5} for k in ["lopd", "opsd", "opsd-donor", "opsd-empty", "lopd-control", "lopd-j3"]}
    assert [gap.gap_row(e, table) for e in ["opsd-other", "opsd-none", "lopd-other", "lopd-m0", "opsd-rkl", "lopd-offline"]] == \
        ["opsd-donor", "opsd-empty", "lopd-control", "lopd", "opsd", "lopd"]
    assert [gap.gap_row(e, table) for e in ["lopd-j3", "lopd-k16", "lopd-textcs", "lopd-self", "opsd-family", "grpo"]] == \
        ["lopd-j3", None, None, None, None, None]
    assert set(gap.GAP_EXTRA) >= {e for e in bench.ENTRIES if e not in registry.METHODS and gap.STEP0_FLAGS & set(bench.ENTRIES[e])
                                  and e not in gap.CONTROL_ROWS}  # every such ablation of the compare gets its row


def test_ols_against_a_slow_reference():
    """Slope and intercept against the normal equations solved by numpy, R² against 1 − SSE/SST by hand;
    points on a line fit exactly."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=12), rng.normal(size=12)
    b, a, r2 = gap.ols(x, y)
    (a_ref, b_ref), *_ = np.linalg.lstsq(np.stack([np.ones(12), x], 1), y, rcond=None)
    assert (b, a) == (pytest.approx(b_ref), pytest.approx(a_ref))
    assert r2 == pytest.approx(1 - sum((yi - a_ref - b_ref * xi) ** 2 for xi, yi in zip(x, y)) / sum((yi - y.mean()) ** 2 for yi in y))
    assert gap.ols([0, 1, 2], [1, 3, 5]) == (pytest.approx(2.0), pytest.approx(1.0), pytest.approx(1.0))
    assert gap.ols([0, 1, 2], [4, 4, 4])[2] is None


def test_predictive_law_fits_the_pairs_and_resamples_whole_entries(tmp_path):
    """The law's point estimate is the OLS over every (entry, seed) pair, ablations on their method's
    gap; gains exactly linear in the gap give slope, intercept and R² with zero-width intervals;
    fewer than three distinct gaps, or no results.json, give no law."""
    table = {"student": {"success": 0.5}, "lopd": {"success": 0.8}, "opsd": {"success": 0.6}, "sdpo": {"success": 0.55}}
    line = lambda g: 0.01 + 0.5 * g   # gain = 0.01 + 0.5 · gap
    results = {"entries": {"lopd": {"final": [0.5 + line(0.3)] * 2, "base_mean": 0.5},
                           "lopd-frozen": {"final": [0.5 + line(0.3)], "base_mean": 0.5},
                           "opsd": {"final": [0.5 + line(0.1)] * 3, "base_mean": 0.5},
                           "sdpo": {"final": [0.5 + line(0.05)], "base_mean": 0.5}, "grpo": {"final": [0.9], "base_mean": 0.5}}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    law = gap.predictive_law(str(tmp_path), table, n_boot=200)
    assert (law["pairs"], law["entries"]) == (7, 4)
    for k, v in [("slope", 0.5), ("intercept", 0.01), ("r2", 1.0)]:
        assert law[k][0] == pytest.approx(v) and law[k][1] == pytest.approx(v) and law[k][2] == pytest.approx(v), k
    noisy = {**results["entries"], "opsd": {"final": [0.4, 0.7, 0.55], "base_mean": 0.5}}
    (tmp_path / "results.json").write_text(json.dumps({"entries": noisy}))
    law = gap.predictive_law(str(tmp_path), table, n_boot=200)
    x = [0.3, 0.3, 0.3, 0.1, 0.1, 0.1, 0.05]
    y = [line(0.3)] * 3 + [-0.1, 0.2, 0.05] + [line(0.05)]
    assert law["slope"][0] == pytest.approx(gap.ols(x, y)[0]) and law["slope"][1] < law["slope"][0] < law["slope"][2]
    del table["sdpo"]
    assert gap.predictive_law(str(tmp_path), table) is None            # two distinct gaps
    assert gap.predictive_law(str(tmp_path / "nowhere"), table) is None


def test_the_donor_of_a_task_is_the_next_task_of_another_family():
    """OP²SD's shuffled-donor control: each task is shown the context of the next task (cyclically)
    whose family differs from its own; with one family there is no donor."""
    T = lambda f: types.SimpleNamespace(family=f)
    assert gap.donors([T("a"), T("a"), T("b"), T("a"), T("c")]) == [2, 2, 3, 4, 0]
    assert gap.donors([T("a"), T("a")]) == [None, None]


def test_action_summary_and_table_on_fake_runs(tmp_path):
    """Seed means of the first and last evaluation's action types, and the entropy curve on the union
    of eval points (the first evaluation has no entropy: nothing was trained yet)."""
    d = str(tmp_path)
    for seed, (lookups, ent) in enumerate([(0.6, 1.0), (0.8, 3.0)], 1):
        fake_run(f"{d}/l{seed}", "lopd", seed, [0, 1024], [0.5, 0.6])
        rows = [json.loads(line) for line in open(f"{d}/l{seed}/metrics.jsonl")]
        rows[0]["actions"] = {"lookup": 0.5, "mark": 0.5, "repeated": 0.0, "actions_per_episode": 2.0, "chars_per_action": 7.0}
        rows[1].update(entropy=ent, actions={"lookup": lookups, "mark": 1 - lookups, "repeated": 0.1,
                                             "actions_per_episode": 3.0, "chars_per_action": 8.0})
        with open(f"{d}/l{seed}/metrics.jsonl", "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    r = report.summarize([f"{d}/l1", f"{d}/l2"], 1024)
    a = r["actions"]
    assert a["base"]["lookup"] == 0.5 and a["final"]["lookup"] == pytest.approx(0.7) and a["final"]["mark"] == pytest.approx(0.3)
    assert a["entropy"] == {"episodes": [1024], "mean": pytest.approx([2.0])}  # not before any training step
    assert a["chars_per_action"] == {"episodes": [0, 1024], "mean": pytest.approx([7.0, 8.0])}
    table = report.actions_table({"lopd": r})
    assert table[3].startswith("| entry | lookup | mark | repeated |")
    assert table[5] == "| base | 0.500 | 0.500 | 0.000 | 2.00 | 7.0 | — |"
    assert table[6] == "| lopd | 0.700 | 0.300 | 0.100 | 3.00 | 8.0 | 2.000 |"
    assert report.plot_actions(f"{d}/a.png", {"lopd": r}) and open(f"{d}/a.png", "rb").read(4) == b"\x89PNG"
    fake_run(f"{d}/g1", "grpo", 1, [0, 1024], [0.5, 0.6])  # a run that logged no action types: no summary
    assert report.summarize([f"{d}/g1"], 1024)["actions"] is None and not report.plot_actions(f"{d}/b.png", {"grpo": None})


def test_the_curves_plot_puts_variants_beside_their_methods(tmp_path):
    """26 entries in one plot: the methods in one panel, the ablations and controls in a second, next to the
    methods they vary; one colour and line style per entry, none reused."""
    assert report.curve_panels(["lopd", "grpo", "opsd"]) == [["lopd", "grpo", "opsd"]]
    assert report.curve_panels(["lopd", "grpo", "opsd", "lopd-m0", "opsd-none", "lopd-k16"]) == \
        [["lopd", "grpo", "opsd"], ["lopd", "opsd", "lopd-m0", "opsd-none", "lopd-k16"]]
    entries = list(bench.ENTRIES)
    assert len(set(report.styles(entries).values())) == len(entries)
    curve = {"episodes": [0, 3072], "mean": [0.3, 0.4], "min": [0.3, 0.35], "max": [0.3, 0.45]}
    report.plot_curves(tmp_path / "c.png", {e: {"curve": curve, "final": [0.4]} for e in entries} | {"sdpo": None}, 0.4)
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_law_section_fits_without_lopd_and_lists_every_entry(tmp_path):
    """The law's section of the teacher-gap report: the fit over every entry, the same fit without
    LOPD's entries (over the other entries' pairs only), one row per entry with its row, gap and mean
    gain, and the plot."""
    table = {"student": {"success": 0.5}, "lopd": {"success": 0.8}, "opsd": {"success": 0.6},
             "sdpo": {"success": 0.55}, "sdft": {"success": 0.7}, "opsd-donor": {"success": 0.52}}
    results = {"entries": {"lopd": {"final": [0.9, 0.95], "base_mean": 0.5},    # far above the others' line
                           "lopd-frozen": {"final": [0.9], "base_mean": 0.5},
                           "opsd": {"final": [0.55, 0.56], "base_mean": 0.5}, "sdpo": {"final": [0.525], "base_mean": 0.5},
                           "sdft": {"final": [0.6], "base_mean": 0.5}, "opsd-other": {"final": [0.51], "base_mean": 0.5},
                           "grpo": {"final": [0.6], "base_mean": 0.5}}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    md = "\n".join(gap.law_section(str(tmp_path), table))
    assert (tmp_path / "law.png").stat().st_size > 0
    assert table["predictive_law"]["pairs"] == 8 and table["predictive_law_without_lopd"]["pairs"] == 5
    rest = [(0.1, 0.05), (0.1, 0.06), (0.05, 0.025), (0.2, 0.1), (0.02, 0.01)]   # (gap, gain) of the non-LOPD runs
    assert table["predictive_law_without_lopd"]["slope"][0] == pytest.approx(gap.ols(*zip(*rest))[0])
    assert "| opsd-other | opsd-donor | +0.020 | +0.010 | 1 |" in md and "| lopd-frozen | lopd | +0.300 | +0.400 | 1 |" in md
    assert "| lopd | lopd | +0.300 | +0.425 | 2 |" in md and "grpo" not in md.split("| entry |")[1]
    assert gap.law_section(str(tmp_path / "nowhere"), table) == []


def test_teacher_gap_builds_its_teachers_at_gap_seed_with_the_forwarded_setup_flags(tmp_path, monkeypatch):
    """--gap_seed S builds every teacher at seed S, and a forwarded --eval_tasks / --teacher_eval
    wins over the report's own (both are part of a setup's cache key: a compare's values reuse
    its cached setups); without them the report evaluates --gap_tasks tasks and no teacher."""
    seen = []

    class Built(Exception):
        pass

    def build(args):
        seen.append((args.seed, args.eval_tasks, args.teacher_eval))
        raise Built
    monkeypatch.setattr(train, "build", build)
    for extra, want in [([], (0, 12, 0)), (["--gap_seed", "2", "--eval_tasks", "40", "--teacher_eval", "20"], (2, 40, 20))]:
        with pytest.raises(Built):
            bench.main(["--teacher_gap", "--methods", "opsd", "--gap_tasks", "12", "--out_dir", str(tmp_path), *extra])
        assert seen.pop() == want


def test_paired_table_differences_on_common_seeds_and_tasks():
    """The paired table subtracts per task within a seed, over the seeds both entries have: by hand,
    lopd gains (2 + 1) / 8 over its base, and lopd − grpo is 1/4 on seed 1, the only common seed."""
    assert report.paired({"1": [1, 1]}, {"1": [0, 0]}) == (1.0, 1.0, 1.0)  # a constant difference: no spread
    assert report.paired({"1": [1, 1]}, {"2": [0, 0]}) is None
    res = {"lopd": {"task_reward": {"1": {"base": [0, 0, 1, 1], "final": [1, 1, 1, 1]},
                                    "2": {"base": [0, 0, 1, 1], "final": [1, 0, 1, 1]}}},
           "grpo": {"task_reward": {"1": {"base": [0, 0, 1, 1], "final": [0, 1, 1, 1]},
                                    "3": {"base": [0, 0, 1, 1], "final": [0, 0, 0, 0]}}},
           "sdpo": None}
    md = "\n".join(report.paired_table(res))
    assert "| lopd | +0.375 [" in md and "| grpo | -0.125 [" in md and "+0.250 [+0.000, +0.750] |" in md
    assert report.paired({"1": [1, 1, 1, 1], "2": [1, 0, 1, 1]}, {"1": [0, 0, 1, 1], "2": [0, 0, 1, 1]})[0] == 0.375


def test_the_regime_table_pairs_each_arm_with_its_own_frozen_composer(tmp_path):
    """bench/regime.py: an arm is paired with the frozen arm named for it, on the same seeds and tasks (+25 points on
    every task: the interval is that point), the teacher's rise is last − first on its own tasks, and a base prefix
    (w4-) groups runs by base."""
    from bench import regime
    def run(name, final, teacher):
        d = tmp_path / name
        d.mkdir()
        (d / "summary.json").write_text("{}")
        lines = [{"task_reward": [0.5] * 4, "task_teacher_reward": [0.5] * 2, "teacher_reward": 0.5},
                 {"task_reward": [final] * 4, "task_teacher_reward": [teacher] * 2, "teacher_reward": teacher, "beta": 1.0}]
        (d / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in lines))
    for s in (100, 101):
        run(f"w4-frozen-s{s}", 0.5, 0.5)
        run(f"w4-phase-s{s}", 0.75, 0.25)
    md = regime.table(str(tmp_path), [("frozen", ["phase"])])
    frozen, phase = md[2].split(" | "), md[3].split(" | ")
    assert frozen[0] == "| frozen" and frozen[1] == "2" and frozen[3] == "—"
    assert phase[0] == "| phase" and phase[3] == "+25.0 [+25.0, +25.0]" and "(−25.0 [−25.0, −25.0])" in phase[4]
    assert set(regime.runs(str(tmp_path))["phase"]) == {"w4-s100", "w4-s101"}
