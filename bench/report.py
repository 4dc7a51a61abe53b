"""What bench writes: finished run folders -> one row per entry (final reward and success with
95% bootstrap intervals over tasks and seeds, and bases where the runs come from several, the curve,
the diagnostics, the families the base solves), then results.json / results.md / curves.png and
tuning.json / tuning.md."""
import contextlib
import json
import os

import numpy as np

REFERENCE = 'grpo'  # the paper's sample-efficiency claim: episodes to reach RLVR's (GRPO's) final success


# ----------------------------------------------------------------------------- aggregation

def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_run(run_dir):
    """-> (summary or None, config or {}, eval points sorted by episodes). A resumed run may
    have logged a step twice; the last line for a step wins. A torn last line is skipped."""
    evals = {}
    with contextlib.suppress(OSError), open(os.path.join(run_dir, 'metrics.jsonl')) as f:
        for line in f:
            with contextlib.suppress(ValueError):
                m = json.loads(line)
                evals[m.get('step')] = m
    return (read_json(os.path.join(run_dir, 'summary.json')), read_json(os.path.join(run_dir, 'config.json')) or {},
            sorted(evals.values(), key=lambda m: m['episodes']))


def auc(x, y, budget):
    """Area under success vs episodes (trapezoid over the eval points) / budget, in [0, 1].
    e.g. x = [0, 512, 1024], y = [0.5, 0.5, 1.0], budget 1024 -> (256 + 384) / 1024 = 0.625."""
    return float(np.trapezoid(y, np.minimum(np.asarray(x, float), budget)) / budget)


def episodes_to_reach(x, y, target):
    """The first eval point whose success is >= target, or None (not reached)."""
    hit = np.nonzero(np.asarray(y) >= target - 1e-9)[0]
    return int(x[hit[0]]) if len(hit) else None


def mean_of(values):
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else None


def bootstrap_ci(values, n_boot=2000, seed=0, level=0.95):
    """The mean of per-task values over seeds and tasks, with a two-level bootstrap interval: resample
    the seeds, then each drawn seed's tasks, with replacement. values (S, T) -> (mean, lo, hi).
    e.g. one seed, tasks [0, 1]: the mean is 0.5 and the interval is about (0, 1).
    Runs from several bases (warm-up seeds): values (W, S, T), or W arrays (S_w, T) where a base lost a run
    -> three levels, so that the interval sees the noise between bases too (bases_ci)."""
    if np.ndim(values[0]) == 2:
        return bases_ci(values, n_boot, seed, level)
    v = np.asarray(values, float)
    S, T = v.shape
    rng = np.random.default_rng(seed)
    s = rng.integers(0, S, (n_boot, S))                                          # (n_boot, S) seeds drawn
    t = rng.integers(0, T, (n_boot, S, T))                                       # (n_boot, S, T) tasks drawn per seed
    means = v[s[..., None], t].mean((1, 2))                                      # (n_boot,)
    lo, hi = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    return float(v.mean()), float(lo), float(hi)


def bases_ci(values, n_boot=2000, seed=0, level=0.95):
    """bootstrap_ci's three levels: resample the bases, then within each drawn base its seeds, then within
    each drawn seed its tasks, with replacement. values: W bases of (S_w, T) (the same T tasks everywhere).
    The mean is over bases of their seed means: a base counts once, however many of its runs finished.
    e.g. bases [[0]] and [[1]]: the mean is 0.5 and the interval (0, 1) (both draws the same base: 1/2)."""
    bases = [np.asarray(b, float) for b in values]
    n = np.array([len(b) for b in bases])                                        # (W,) seeds per base
    W, S, T = len(bases), n.max(), bases[0].shape[1]
    v = np.stack([np.pad(b, ((0, S - len(b)), (0, 0))) for b in bases])          # (W, S, T); padded seeds are never drawn
    rng = np.random.default_rng(seed)
    w = rng.integers(0, W, (n_boot, W))                                          # (n_boot, W) bases drawn
    s = rng.integers(0, n[w][..., None], (n_boot, W, S))                         # (n_boot, W, S) seeds drawn in each
    t = rng.integers(0, T, (n_boot, W, S, T))                                    # (n_boot, W, S, T) tasks drawn per seed
    seed_means = v[w[..., None, None], s[..., None], t].mean(-1)                 # (n_boot, W, S)
    drawn = np.arange(S) < n[w][..., None]                                        # a base of n_w seeds draws n_w of them
    means = ((seed_means * drawn).sum(-1) / n[w]).mean(-1)                       # (n_boot,)
    lo, hi = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    return float(np.mean([b.mean() for b in bases])), float(lo), float(hi)


def base_of(key):
    """The base of a run key: 'w7-s1' (summarize(by_base=True)) -> 'w7'; '1' (one base, as ever) -> ''."""
    return key.rpartition('-s')[0] if key.startswith('w') else ''


def nest(keyed):
    """{run key: per-task values} -> bootstrap_ci's values: [seed][task] from one base (as ever), [base][seed][task]
    from several, the runs grouped by their warm-up seed."""
    groups = {}
    for k, v in keyed.items():
        groups.setdefault(base_of(k), []).append(v)
    return next(iter(groups.values())) if len(groups) == 1 else list(groups.values())


def final_stats(evs, keys=None):
    """Per seed, the last evaluation's per-task values -> {metric: (mean, lo, hi)} over tasks and seeds
    (and bases, where keys, one per run as summarize makes them, name several)."""
    out, keys = {}, keys or [str(i) for i in range(len(evs))]
    for name, key, f in [('reward', 'task_reward', float), ('success', 'task_reward', lambda r: float(r >= 1)),
                         ('reward_sampled', 'task_reward_sampled', float)]:
        rows = {k: [f(r) for r in ev[-1][key]] for k, ev in zip(keys, evs) if ev[-1].get(key)}
        if rows and len({len(r) for r in rows.values()}) == 1:
            out[name] = bootstrap_ci(nest(rows))
    return out


def summarize(run_dirs, budget, by_base=False):
    """Finished runs of one entry -> its row of results.json (None if no run finished). by_base: the runs
    come from several bases (warm-up seeds): each run's per-task rewards are keyed 'w<warm-up seed>-s<seed>',
    and the intervals resample the bases too."""
    runs = [(s, c, ev) for s, c, ev in map(load_run, run_dirs) if s and ev and s.get('episodes', 0) >= budget]
    if not runs:
        return None
    keys = [f"w{c.get('warmup_seed')}-s{s.get('seed')}" if by_base else str(s.get('seed')) for s, c, _ in runs]
    # seed curves of the graded reward on the union of their eval points (linear in between)
    x = np.unique(np.concatenate([[m['episodes'] for m in ev] for _, _, ev in runs]))
    Y = np.stack([np.interp(x, [m['episodes'] for m in ev], [m.get('reward', m['success']) for m in ev]) for _, _, ev in runs])
    final = [ev[-1].get('reward', ev[-1]['success']) for _, _, ev in runs]
    aucs = [auc(x, y, budget) for y in Y]
    setup = [s.get('setup_episodes', 0) for s, _, _ in runs]
    row = {'seeds': [s.get('seed') for s, _, _ in runs], 'warmup_seeds': [c.get('warmup_seed') for _, c, _ in runs],
           'final': final, 'final_mean': float(np.mean(final)),
           'final_std': float(np.std(final, ddof=1)) if len(final) > 1 else 0.0, 'ci': final_stats([ev for _, _, ev in runs], keys),
           'best_mean': mean_of([max(m.get('reward', m['success']) for m in ev) for _, _, ev in runs]),
           'auc_mean': float(np.mean(aucs)), 'auc_std': float(np.std(aucs, ddof=1)) if len(aucs) > 1 else 0.0,
           'base_mean': mean_of([ev[0].get('reward', ev[0]['success']) for _, _, ev in runs]),
           'success_mean': mean_of([ev[-1]['success'] for _, _, ev in runs]),
           'base_success_mean': mean_of([ev[0]['success'] for _, _, ev in runs]),
           'setup_episodes': float(np.mean(setup)),
           'teacher_reward': mean_of([s.get('teacher_reward', s.get('teacher_success')) for s, _, _ in runs]),
           'wall_seconds': mean_of([s.get('wall_seconds') for s, _, _ in runs]),
           'family_base': family_means([ev[0] for _, _, ev in runs]), 'family_final': family_means([ev[-1] for _, _, ev in runs]),
           'curve': {'episodes': x.tolist(), 'mean': Y.mean(0).tolist(), 'std': Y.std(0).tolist(),
                     'min': Y.min(0).tolist(), 'max': Y.max(0).tolist(), 'seeds': Y.tolist()}}
    last = lambda k: mean_of([ev[-1].get(k) for _, _, ev in runs])
    avg = lambda k: mean_of([mean_of([m.get(k) for m in ev]) for _, _, ev in runs])
    diag = {'teacher_reward': last('teacher_reward'), 'student_reward_same_tasks': last('student_reward_same_tasks'),
            'delta_mean': avg('delta'), 'anchor_mean': avg('anchor'), 'family_hit_mean': avg('family_hit'),
            'beta_final': last('beta'),
            # before any update every teacher's weights are θ0, so θ0 without its context is the
            # student of the first evaluation, on the same tasks
            'teacher_without_context': mean_of([ev[0].get('student_reward_same_tasks') for _, _, ev in runs])}
    row['diagnostics'] = {k: v for k, v in diag.items() if v is not None}
    # per seed (and base), the base's and the last evaluation's per-task rewards: entries are compared on the same tasks
    row['task_reward'] = {k: {'base': ev[0].get('task_reward'), 'final': ev[-1].get('task_reward')}
                          for k, (_, _, ev) in zip(keys, runs)}
    # per seed, every evaluation's diagnostics: β, Δ, anchor, family hit over time (for a notebook)
    keys = ['episodes', 'training_episodes', 'reward', 'success', 'teacher_reward', 'student_reward_same_tasks', 'beta', 'delta',
            'anchor', 'family_hit', 'phi_grad_kl', 'phi_grad_margin', 'phi_grad_anchor']
    row['evals'] = [[{k: m.get(k) for k in keys} for m in ev] for _, _, ev in runs]
    row['actions'] = action_summary([ev for _, _, ev in runs], x)
    return row


def action_summary(evs, x):
    """What success hides: the action-type shares of the first and the last evaluation (seed means), and,
    on the eval points x, the seed-mean curves of the student's entropy on its training rollouts and of
    its held-out actions' length. None for runs that logged no action types."""
    if not any(m.get('actions') for ev in evs for m in ev):
        return None

    def means(ds):
        ds = [d for d in ds if d]
        return {k: float(np.mean([d.get(k, 0.0) for d in ds])) for k in sorted({k for d in ds for k in d})}

    def curve(get):  # each seed's points where the value exists, linear in between, on the span all seeds cover
        pts = [p for p in ([(m['episodes'], get(m)) for m in ev if get(m) is not None] for ev in evs) if p]
        if not pts:
            return None
        xs = x[(x >= max(p[0][0] for p in pts)) & (x <= min(p[-1][0] for p in pts))]
        return {'episodes': xs.tolist(), 'mean': np.mean([np.interp(xs, *zip(*p)) for p in pts], 0).tolist()}
    return {'base': means([ev[0].get('actions') for ev in evs]), 'final': means([ev[-1].get('actions') for ev in evs]),
            'entropy': curve(lambda m: m.get('entropy')),
            'chars_per_action': curve(lambda m: (m.get('actions') or {}).get('chars_per_action'))}


def family_means(evals):
    """Seed-mean reward per family, from evaluations that logged one."""
    fams = {}
    for m in evals:
        for f, v in m.get('family', {}).items():
            fams.setdefault(f, []).append(v)
    return {f: float(np.mean(v)) for f, v in fams.items()}


def add_reach(results):
    """Episodes each entry's seed-mean curve needs to reach GRPO's final mean reward, both ways of
    counting: every episode sampled (a setup's bank or pool included), and, as the paper counts,
    only the training episodes (the setup's are subtracted)."""
    target = results[REFERENCE]['final_mean'] if results.get(REFERENCE) else None
    for r in results.values():
        if r:
            n = episodes_to_reach(r['curve']['episodes'], r['curve']['mean'], target) if target is not None else None
            r['episodes_to_grpo_final'] = n
            r['training_episodes_to_grpo_final'] = None if n is None else max(0, int(n - r['setup_episodes']))
    return target


# ----------------------------------------------------------------------------- writing

def fmt(v, spec='.3f'):
    return '—' if v is None else format(v, spec)


def ci(r, k):
    """'0.512 [0.487, 0.538]' from a row's bootstrap interval, or '—'."""
    v = r.get('ci', {}).get(k)
    return '—' if not v else f'{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]'


def final(r):
    """The final reward with its interval, or mean ± std over seeds for runs that kept no per-task values."""
    return ci(r, 'reward') if r.get('ci', {}).get('reward') else f"{r['final_mean']:.3f} ± {r['final_std']:.3f}"


def reused_note(meta):
    """', N of M runs made by this command' where it reused finished runs (their seconds are not in its time)."""
    n, m = meta.get('launched'), meta.get('runs')
    return '' if n is None or n == m else f' ({n} of its {m} runs made by this command, the others reused)'


def base_note(bases):
    """Which base (warm-up seed: the tiny model's init and the warm-up's data order) the numbers are on."""
    return ('base: ?' if not bases else f'base: warm-up seed {bases[0]}' if len(bases) == 1 else
            f"bases: warm-up seeds {', '.join(map(str, bases))}")


def write_results(cmp_dir, results, meta, target):
    results_json = {**meta, 'grpo_final_mean': target, 'entries': results}
    with open(os.path.join(cmp_dir, 'results.json'), 'w') as f:
        json.dump(results_json, f, indent=1)

    def reach(r, k):
        n = r[k]
        return ('n/a (no grpo)' if target is None else 'not reached' if n is None else
                '0 (GRPO ends ≤ base)' if n == 0 else str(n))  # 0: the target says nothing about speed
    bases = meta.get('warmup_seeds') or []
    several = len(bases) > 1  # then every number is over bases too: a base is one draw of the model, not the model
    md = [f"# {meta['env']}: seeds {', '.join(map(str, meta['seeds']))}"
          f"{' on each of ' + str(len(bases)) + ' bases' if several else ''}, {meta['episodes']} episodes each", '',
          f"`{meta['command']}` at commit {meta['commit']} (train.CODE {meta['code']}), {meta.get('date', '?')}, "
          f"{meta.get('machine', '?')}, torch {meta.get('torch', '?')} on {meta.get('cpu_kernels', '?')} CPU kernels, "
          f"transformers {meta.get('transformers', '?')}, {base_note(bases)}, "
          f"{meta.get('wall_s', '?')} s in all{reused_note(meta)}; forwarded flags: `{' '.join(meta['forwarded']) or '—'}`; "
          f"tuned flags: {'tuning.json' if meta['tuned'] else 'none'}. Held-out graded reward (the fraction of checks "
          f"passed) and success (every check), greedy, and the reward sampled at temperature 0.7; [lo, hi] is a 95% "
          f"bootstrap interval over {'bases, then seeds, then tasks' if several else 'tasks and seeds'} (± the std over "
          f"{'runs' if several else 'seeds'}, for runs that kept no per-task values). GRPO's final mean reward (the target of \"episodes to GRPO\"): "
          f"{fmt(target)}, reached counting every episode sampled / only the training episodes (the paper's: a bank or "
          f"pool built before training is not counted). AUC = area under reward vs episodes / budget. wall s = each run's "
          f"own seconds; runs that share one seed's method setup (LOPD's cold start) share it: the first builds it.", '',
          f"| entry | flags | {'runs' if several else 'seeds'} | final reward | success | reward, sampled | AUC | episodes to GRPO final "
          '(all / training) | base reward | base success | teacher | wall s |',
          '|---|---|---|---|---|---|---|---|---|---|---|---|']
    for e, r in results.items():
        flags = f"`{' '.join(meta['flags'][e])}`"
        md.append(f'| {e} | {flags} | 0 |' + ' — |' * 9 if not r else
                  f"| {e} | {flags} | {len(r['final'])} | {final(r)} | "
                  f"{ci(r, 'success')} | {ci(r, 'reward_sampled')} | "
                  f"{r['auc_mean']:.3f} | {reach(r, 'episodes_to_grpo_final')} / {reach(r, 'training_episodes_to_grpo_final')} | "
                  f"{fmt(r['base_mean'])} | {fmt(r['base_success_mean'])} | {fmt(r['teacher_reward'])} | {fmt(r['wall_seconds'], '.0f')} |")
    md += ['', 'Diagnostics (final = last evaluation, mean = over evaluations; seed means; teacher and student '
           'on the same first `--teacher_eval` held-out tasks; teacher without context = θ0 alone, the first evaluation):', '',
           '| entry | teacher reward (final) | teacher without context | student, same tasks | mean Δ | final β | mean ‖z − z0‖² | mean family hit |',
           '|---|---|---|---|---|---|---|---|']
    keys = ['teacher_reward', 'teacher_without_context', 'student_reward_same_tasks', 'delta_mean', 'beta_final',
            'anchor_mean', 'family_hit_mean']
    md += [f"| {e} | " + ' | '.join(fmt(r['diagnostics'].get(k)) for k in keys) + ' |'
           for e, r in results.items() if r and r['diagnostics']]
    md += paired_table(results)
    md += forgetting_table(results)
    md += actions_table(results)
    if meta['failed']:
        md += ['', 'Failed runs (see logs/): ' + ', '.join(meta['failed'])]
    with open(os.path.join(cmp_dir, 'results.md'), 'w') as f:
        f.write('\n'.join(md) + '\n')


def forgetting_table(results, solved=0.8):
    """Families the base solves (reward >= `solved`): base -> final reward per entry (seed means),
    so that a family the student loses shows up, whatever the mean does."""
    rows = [r for r in results.values() if r and r.get('family_base')]
    if not rows:
        return []
    base = {f: float(np.mean([r['family_base'][f] for r in rows if f in r['family_base']])) for f in rows[0]['family_base']}
    fams = [f for f, v in base.items() if v >= solved]
    if not fams:
        return []
    names = [e for e, r in results.items() if r and r.get('family_final')]
    md = ['', f'Families the base solves (base reward >= {solved}): final reward per entry (seed means):', '',
          '| family | base | ' + ' | '.join(names) + ' |', '|---|---|' + '---|' * len(names)]
    return md + [f'| {f} | {base[f]:.2f} | ' + ' | '.join(fmt(results[e]['family_final'].get(f), '.2f') for e in names) + ' |'
                 for f in fams]


def paired(a, b):
    """The mean of a − b over the seeds both have, on the same held-out tasks, with bootstrap_ci's
    interval; a and b are {seed: per-task rewards} (keys 'w7-s1' from several bases: grouped by base,
    three levels). -> (mean, lo, hi) or None (no common seed)."""
    seeds = [k for k in a if a[k] and b.get(k) and len(a[k]) == len(b[k])]
    return bootstrap_ci(nest({k: np.subtract(a[k], b[k]) for k in seeds})) if seeds else None


def paired_table(results, ref='lopd'):
    """Each entry's gain over its base and `ref` − the entry, paired on the same tasks and seeds: the
    seeds share most of their noise (the tasks, the base), so a paired interval decides what two
    unpaired ones do not."""
    rows = {e: r['task_reward'] for e, r in results.items() if r and r.get('task_reward')}
    if not rows:
        return []
    final = lambda e: {k: v['final'] for k, v in rows[e].items()}
    pm = lambda c: '—' if c is None else f'{c[0]:+.3f} [{c[1]:+.3f}, {c[2]:+.3f}]'
    levels = ('three-level bootstrap: bases, seeds, tasks' if len({base_of(k) for t in rows.values() for k in t}) > 1
              else 'two-level bootstrap')
    md = ['', f'Paired on the same held-out tasks and seeds (95% {levels} of the per-task differences; '
          f'an interval without 0 decides): each entry\'s final reward − its base\'s, and {ref} − the entry:', '',
          f'| entry | gain over the base | {ref} − entry |', '|---|---|---|']
    return md + [f"| {e} | {pm(paired(final(e), {k: v['base'] for k, v in t.items()}))} | "
                 f"{'' if e == ref or ref not in rows else pm(paired(final(ref), final(e)))} |" for e, t in rows.items()]


SHAPE = ('repeated', 'actions_per_episode', 'chars_per_action')  # action_stats' keys that are not an action type


def actions_table(results):
    """Held-out action types at the last evaluation (seed means; the base's from the first), with the
    student's entropy on its training rollouts: a method can keep its success and lose an action type."""
    rows = {e: r['actions'] for e, r in results.items() if r and r.get('actions')}
    if not rows:
        return []
    base = next(iter(rows.values()))['base']
    kinds = sorted({k for a in rows.values() for k in a['final']} - set(SHAPE))
    line = lambda name, d, h: (f'| {name} | ' + ' | '.join(fmt(d.get(k, 0.0)) for k in kinds) +
                               f" | {fmt(d.get('repeated'))} | {fmt(d.get('actions_per_episode'), '.2f')} | "
                               f"{fmt(d.get('chars_per_action'), '.1f')} | {fmt(h)} |")
    return (['', 'What success hides: each action type\'s share of the held-out actions (greedy), actions that repeat an '
             'earlier one of the episode, actions per episode, characters per action, and the student\'s mean entropy per '
             'agent token on its last training rollouts (seed means):', '',
             '| entry | ' + ' | '.join(kinds) + ' | repeated | actions / episode | chars / action | entropy |',
             '|---|' + '---|' * (len(kinds) + 4), line('base', base, None)] +
            [line(e, a['final'], a['entropy'] and a['entropy']['mean'][-1]) for e, a in rows.items()])


def plot_actions(path, results):
    """One figure per compare: the final action-type shares per entry (stacked; the base first), and the
    student's entropy and action length over training."""
    rows = {e: r['actions'] for e, r in results.items() if r and r.get('actions')}
    if not rows:
        return False
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    bars = {'base': next(iter(rows.values()))['base'], **{e: a['final'] for e, a in rows.items()}}
    kinds = sorted({k for d in bars.values() for k in d} - set(SHAPE))
    fig, ax = plt.subplots(1, 3, figsize=(16, max(4.8, 0.25 * len(bars) + 1.5)))
    left = np.zeros(len(bars))
    for k in kinds:
        w = np.array([d.get(k, 0.0) for d in bars.values()])
        ax[0].barh(list(bars), w, left=left, label=k)
        left += w
    ax[0].invert_yaxis()
    ax[0].set(xlabel='share of held-out actions (last evaluation)', xlim=(0, 1))
    ax[0].legend(fontsize=7, ncol=len(kinds), loc='lower center', bbox_to_anchor=(0.5, 1.0))
    style = styles(rows)  # more entries than tab10 has colours
    for e, a in rows.items():
        for j, k in ((1, 'entropy'), (2, 'chars_per_action')):
            if a[k]:
                ax[j].plot(a[k]['episodes'], a[k]['mean'], style[e][1], marker='.', color=style[e][0], label=e)
    ax[1].set(xlabel='episodes sampled', ylabel='entropy per agent token (training rollouts)')
    ax[2].set(xlabel='episodes sampled', ylabel='characters per held-out action')
    for a in ax[1:]:
        a.grid(alpha=0.3)
    ax[2].legend(fontsize=7, ncol=2 if len(rows) > 12 else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def styles(entries):
    """A colour and line style per entry, the same in every panel and plot (20 colours, then dashed)."""
    import matplotlib.pyplot as plt
    colors = plt.get_cmap('tab20').colors[0::2] + plt.get_cmap('tab20').colors[1::2]  # the 10 dark ones first
    return {e: (colors[i % 20], '-' if i < 20 else '--') for i, e in enumerate(entries)}


def curve_panels(entries):
    """[the methods] and, if any, [the varied methods + their variants] ('lopd-m0' varies 'lopd')."""
    own = [e for e in entries if '-' not in e]
    variants = [e for e in entries if '-' in e]
    return [own] + ([[e for e in own if any(v.split('-')[0] == e for v in variants)] + variants] if variants else [])


def plot_curves(path, results, target):
    """Held-out reward vs episodes: the methods in one panel; where the compare has variants ('lopd-m0'
    is a variant of 'lopd': ablations, controls), they get a second panel beside the methods they vary."""
    import matplotlib
    matplotlib.use('Agg')  # no display needed
    import matplotlib.pyplot as plt
    done = {e: r for e, r in results.items() if r}
    panels, style = curve_panels(list(done)), styles(done)
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 5.5), sharey=True, squeeze=False)
    for ax, entries in zip(axes[0], panels):
        for e in entries:
            c, n = done[e]['curve'], len(done[e]['final'])
            color, ls = style[e]
            ax.plot(c['episodes'], c['mean'], ls, marker='.', color=color, label=f"{e} ({n} seed{'s' * (n > 1)})")
            ax.fill_between(c['episodes'], c['min'], c['max'], color=color, alpha=0.08)
        if target is not None:
            ax.axhline(target, color='k', ls=':', lw=1, label="GRPO's final mean reward")
        ax.set(xlabel='episodes sampled')
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2 if len(entries) > 10 else 1)
    axes[0][0].set(ylabel='held-out graded reward (seed mean, min–max band)')
    if len(panels) > 1:
        axes[0][0].set_title('methods')
        axes[0][1].set_title('variants: ablations and controls (beside their methods)')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def choose_setting(settings):
    """The tuning rule, the same for every method: on seed 0, the setting whose final reward beats the
    default (settings[0]) by the most, on the same held-out tasks, with a 95% bootstrap interval of the
    paired gain above 0; it is chosen only if, run again beside the default on a second validation seed
    ('confirm'), its paired gain over both seeds (two-level bootstrap) still has its interval above 0:
    one seed's tasks do not see the noise between seeds. Before the second seed has run, or if it failed,
    the seed-0 winner is returned unconfirmed.
    -> (chosen setting or None if the default did not finish, {setting index: seed-0 (gain, lo, hi)},
        the winner's (gain, lo, hi) over both seeds or None)."""
    default = settings[0]
    if default['task_reward'] is None:
        return None, {}, None
    on = lambda *runs: {str(k): r['task_reward'] for k, r in enumerate(runs)}  # paired's {seed: per-task rewards}
    gains = {i: paired(on(s), on(default)) for i, s in enumerate(settings) if i and s['task_reward'] is not None}
    better = [i for i, (_, lo, _) in gains.items() if lo > 0]
    if not better:
        return default, gains, None
    best = settings[max(better, key=lambda i: gains[i][0])]
    c, d = best.get('confirm'), default.get('confirm')
    if not (c and d and c['task_reward'] and d['task_reward']):
        return best, gains, None
    both = paired(on(best, c), on(default, d))
    return (best if both[1] > 0 else default), gains, both


def write_tuning(cmp_dir, grid, meta):
    """Per entry, the setting choose_setting picks (seed 0, then the confirmation seed) -> tuning.json
    (merged with earlier tunings) + tuning.md."""
    path = os.path.join(cmp_dir, 'tuning.json')
    tuning = (read_json(path) or {}) | {'meta': meta}
    seed = meta.get('confirm_seed', 'the second validation seed')
    md = ['# Tuning on the validation seeds (never reported)', '',
          "On seed 0, every setting of the grid; the setting that beats the default by the most with a 95% paired "
          f"bootstrap interval above 0 is run again beside the default on seed {seed}, and chosen only if its gain "
          "over both seeds (two-level bootstrap: seeds, then tasks) keeps its interval above 0. Otherwise the default stays.",
          '', f"`{meta.get('command', '?')}` at commit {meta.get('commit', '?')} (train.CODE {meta.get('code', '?')}), "
          f"{meta.get('date', '?')}, {meta.get('machine', '?')}, torch {meta.get('torch', '?')} on {meta.get('cpu_kernels', '?')} "
          f"CPU kernels, transformers {meta.get('transformers', '?')}, {base_note(meta.get('warmup_seeds'))}, "
          f"{meta.get('wall_s', '?')} s in all{reused_note(meta)}.",
          '', f'| entry | setting | final reward, seed 0 | success, seed 0 | gain over the default, seed 0 | '
          f'final reward, seed {seed} | gain over the default, both seeds | chosen |', '|---|---|---|---|---|---|---|---|']
    iv = lambda g: '{:+.3f} [{:+.3f}, {:+.3f}]'.format(*g)
    for e, settings in grid.items():
        best, gains, both = choose_setting(settings)
        tuning[e] = {'flags': best['setting'] if best else [], 'final_reward': best and best['final_reward'],
                     'both_seeds': both,
                     'grid': [{k: v for k, v in s.items() if k != 'task_reward'} | (
                         {'confirm': {k: v for k, v in s['confirm'].items() if k != 'task_reward'}} if s.get('confirm') else {})
                         for s in settings]}
        md += [f"| {e} | `{' '.join(s['setting']) or 'default'}` | {fmt(s['final_reward'])} | {fmt(s['final_success'])} | "
               f"{iv(gains[i]) if i in gains else ''} | {fmt((s.get('confirm') or {}).get('final_reward')) if s.get('confirm') else ''} | "
               f"{iv(both) if both and i and s.get('confirm') else ''} | {'✓' if s is best else ''} |"
               for i, s in enumerate(settings)]
    with open(path, 'w') as f:
        json.dump(tuning, f, indent=1)
    with open(os.path.join(cmp_dir, 'tuning.md'), 'w') as f:
        f.write('\n'.join(md) + '\n')
