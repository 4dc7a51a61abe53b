"""bench's two reports that train nothing: --teacher_gap (every teacher's success with its context
before training, beside its student's, and the privileged-information utility statistics) and
--memory (one distillation step's peak memory at a real vocabulary, chunked and not; LoRA's)."""
import json
import os
import subprocess
import sys
import time

import numpy as np

import retrieval
import train
from bench.entries import ENTRIES, ROOT, die, for_method, method_of, train_args
from bench.report import fmt, read_json
from plumbing.registry import METHODS, embed_context, with_default


# ----------------------------------------------------------------------------- the teacher-gap report

def gap_rows(run, rollout, tasks):
    """Before any student update: the student's and its teacher's held-out success on the same tasks
    (greedy), overall and on opaque families, and the privileged-information utility statistics
    (pi_utility) on the student's own sampled rollouts. The teacher's context is the method's own,
    built on the student's sampled rollouts of each task (G per task: SDPO's sibling), the first of
    each group taken. Every teacher also gets two controls: the context of another family's task
    (`donors`) and an empty one; LOPD and Traj-text a third: other-family experiences only (as latents, as text).
    -> {row name: (teacher success per task, rows that got a context, utility statistics)}. Under the run's autocast,
    as train.py's loop runs (a bf16 --model's teacher reads float32 latents)."""
    with run.autocast():
        return _gap_rows(run, rollout, tasks)


def _gap_rows(run, rollout, tasks):
    import torch
    G = run.method.group
    eps, bodies, masks = rollout(run.model, run.tok, run.env, [t for t in tasks for _ in range(G)])
    m = run.args.method
    ctx = list(embed_context(run, run.method.context(run, eps)))[::G]
    contexts = {m: ctx,  # and two controls (OP²SD's): another family's task's context, and the frame left empty
                f'{m}-donor': [ctx[j] if j is not None else None for j in donors(tasks)],
                f'{m}-empty': embed_context(run, [''] * len(tasks))}
    others = lambda: retrieval.retrieve(run, [e.task for e in eps[::G]], other_family=True)
    if m == 'lopd':
        contexts['lopd-control'] = retrieval.latents(run, eps[::G], grad=False, found=others())
    if m == 'trajtext':  # the same control as text: what other families' experiences tell
        contexts['trajtext-control'] = embed_context(run, [retrieval.bank_text(f) for f in others()])
    out = {}
    with torch.no_grad():
        for name, ctx in contexts.items():
            teps = rollout(run.teacher, run.tok, run.env, tasks, greedy=True, prefixes=with_default(run, ctx))[0]
            out[name] = ([e.reward for e in teps], float(np.mean([p is not None for p in ctx])),
                         pi_utility(run, eps[::G], bodies[::G], masks[::G], ctx))
    return out


def donors(tasks):
    """For each task, the next one (cyclically) of another family, whose context it is shown as a control
    (OP²SD's shuffled donor); None where every task is of one family."""
    n = len(tasks)
    return [next(((i + k) % n for k in range(1, n) if tasks[(i + k) % n].family != tasks[i].family), None) for i in range(n)]


def pi_utility(run, eps, bodies, masks, ctx, rows=50):
    """KL-based statistics of a context, before training (after the study of 16 privileged-information
    setups, arXiv 2608.04794): on the student's own sampled rollouts, each rollout's mean over its agent
    tokens of D(π_θ(·|x,y<t) ‖ π_T(·|c,x,y<t)) (reverse KL, what the distillation loss minimises), then
    the mean over the rollouts that succeeded and over those that failed. Rollouts without a context are left out."""
    import lopd
    import model as M
    per = []
    for i in range(0, len(eps), rows):
        ids, amask, attn = M.pad_batch(bodies[i:i + rows], masks[i:i + rows], run.tok.pad, run.device)
        logits_t = M.logits_on(run.teacher, with_default(run, ctx[i:i + rows]), ids, attn, run.args.score_chunk)
        logits_s = M.logits_on(run.model, M.bos_prefix(run.model, run.tok, ids.shape[0]), ids, attn, run.args.score_chunk)
        d = lopd.divergence(logits_s, logits_t, 'rkl')
        per += ((d * amask).sum(1) / amask.sum(1).clamp(min=1)).tolist()
    kept = [(k, e.success) for k, e, p in zip(per, eps, ctx) if p is not None]
    mean = lambda won: float(np.mean([k for k, w in kept if w == won])) if any(w == won for _, w in kept) else None
    return {'kl_success': mean(True), 'kl_failure': mean(False)}


def spearman(x, y):
    """Spearman's rank correlation (ties get their mean rank); None if either side is constant."""
    rank = lambda v: np.array([np.mean([j for j, w in enumerate(sorted(v)) if w == u]) for u in v])
    rx, ry = rank(list(x)), rank(list(y))
    return None if len(x) < 3 or rx.std() == 0 or ry.std() == 0 else float(np.corrcoef(rx, ry)[0, 1])


# the compare's controls are the report's control rows (the same contexts, measured before training)
CONTROL_ROWS = {'opsd-other': 'opsd-donor', 'opsd-none': 'opsd-empty', 'lopd-other': 'lopd-control'}
# flags that change a teacher before training (its setup or its context): an ablation with one of them
# needs a row of its own (GAP_EXTRA), never its method's
STEP0_FLAGS = {'--K', '--J', '--cold_start', '--cold_start_steps', '--cold_start_sample', '--allow_same_task', '--composer',
                 '--reader', '--bank_source', '--embedder', '--rerank', '--opsd_context', '--retrieval', '--lr_cold_start'}


def gap_row(entry, table):
    """The teacher-gap row of a compare entry: its own, its control's, or else its method's if the
    entry's flags leave the step-0 teacher as the method's (lopd-frozen: lopd's; lopd-k16: none). -> name or None."""
    row = entry if entry in table else CONTROL_ROWS.get(entry)
    if row is None and entry in ENTRIES and not STEP0_FLAGS & set(ENTRIES[entry]):
        row = method_of(entry)
    return row if row in table else None


def gain_pairs(res, table, stat):
    """(entry, its row's statistic, final − base) for each (entry, seed) of a compare's results that
    has a row in the teacher-gap table (gap_row)."""
    return [(e, stat(table[row]), final - r['base_mean']) for e, r in res['entries'].items() if r
            for row in [gap_row(e, table)] if row and stat(table[row]) is not None for final in r['final']]


def step0_gap(table):
    """A row of the teacher-gap table -> its teacher's reward minus the student's, before training."""
    return lambda r: r['success'] - table['student']['success']


def utility_correlation(cmp_dir, table):
    """How well each before-training statistic predicts each quick-compare run's gain over the base:
    Spearman's ρ over the (entry, seed) pairs. -> {statistic: (ρ, pairs)}, or None without results.json."""
    res = read_json(os.path.join(cmp_dir, 'results.json'))
    if not res:
        return None
    stats = {'teacher gap': step0_gap(table), 'KL, successes': lambda r: r['kl_success'],
             'KL, failures': lambda r: r['kl_failure'],
             'KL, failures − successes': lambda r: None if None in (r['kl_failure'], r['kl_success']) else r['kl_failure'] - r['kl_success']}
    out = {}
    for name, f in stats.items():
        pairs = [(x, y) for _, x, y in gain_pairs(res, table, f)]
        out[name] = (spearman(*zip(*pairs)) if pairs else None, len(pairs))
    return out


def ols(x, y):
    """Least squares y ≈ a + b·x -> (slope b, intercept a, R²); R² None where y is constant."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    b = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    a = y.mean() - b * x.mean()
    ss = ((y - y.mean()) ** 2).sum()
    return float(b), float(a), float(1 - ((y - a - b * x) ** 2).sum() / ss) if ss > 0 else None


def predictive_law(cmp_dir, table, n_boot=2000, seed=0, level=0.95, keep=lambda entry: True):
    """The predictive law of on-policy self-distillation (arXiv 2605.30070): a run's final gain over
    its base is linear in its teacher's step-0 gap over the student. OLS over the (entry, seed) pairs
    of the compare's results.json (the entries `keep` keeps), with bootstrap intervals that resample
    whole entries (an entry's seeds share one gap). -> {'slope'|'intercept'|'r2': (value, lo, hi),
    'pairs', 'entries'}, or None without results.json or with fewer than three distinct gaps."""
    res = read_json(os.path.join(cmp_dir, 'results.json'))
    pairs = [p for p in gain_pairs(res, table, step0_gap(table)) if keep(p[0])] if res else []
    if len({x for _, x, _ in pairs}) < 3:
        return None
    entries = sorted({e for e, _, _ in pairs})
    by_entry = {e: [(x, y) for f, x, y in pairs if f == e] for e in entries}
    rng, fits = np.random.default_rng(seed), []
    for _ in range(n_boot):
        drawn = [xy for i in rng.integers(0, len(entries), len(entries)) for xy in by_entry[entries[i]]]
        if len({x for x, _ in drawn}) > 1:
            fits.append(ols(*zip(*drawn)))
    point = ols([x for _, x, _ in pairs], [y for _, _, y in pairs])
    out = {'pairs': len(pairs), 'entries': len(entries)}
    for k, name in enumerate(['slope', 'intercept', 'r2']):
        v = [f[k] for f in fits if f[k] is not None]
        lo, hi = np.percentile(v, [50 * (1 - level), 50 * (1 + level)]) if v else (None, None)
        out[name] = (point[k], None if lo is None else float(lo), None if hi is None else float(hi))
    return out


def teacher_gap(o, out_dir, cmp_dir):
    """bench --teacher_gap: for every method with a teacher (and LOPD's variants in GAP_EXTRA), build
    its run (warm-up, base evaluation, setup: LOPD's cold start) and measure gap_rows on the first
    --gap_tasks held-out tasks. -> teacher_gap.md / .json in the compare folder."""
    import torch
    from plumbing import bookkeeping
    t0, rows, student = time.time(), {}, None
    entries = {m: ['--method', m] for m, x in METHODS.items() if x.context and (not o.methods or m in o.entries)}
    entries.update({k: v for k, v in GAP_EXTRA.items() if not o.methods or k in o.entries})
    for entry, own in entries.items():
        m = own[own.index('--method') + 1]
        # forwarded --eval_tasks / --teacher_eval win over the report's: they are part of a setup's cache key,
        # so a compare's own values (and its one thread per run) reuse its seed's cached setups
        flags = (['--eval_tasks', str(o.gap_tasks), '--teacher_eval', '0'] + for_method(o.extras, m) + own
                 + ['--env', o.env, '--out_dir', out_dir, '--name', f'gap-{entry}-{o.env}', '--overwrite', '--seed', str(o.gap_seed)])
        args = train_args(flags)
        bookkeeping.claim_run_dir(os.path.join(out_dir, args.name), True)
        run = train.build(args)
        tasks = run.env.eval_tasks[:o.gap_tasks]
        with torch.no_grad(), run.autocast():
            if student is None:
                student = [e.reward for e in train.rollout(run.model, run.tok, run.env, tasks, greedy=True)[0]]
            for name, r in gap_rows(run, train.rollout, tasks).items():
                rows[entry + name[len(m):]] = r  # e.g. lopd-balanced, lopd-balanced-control
        opaque = np.array([t.family in getattr(run.env, 'opaque', ()) for t in tasks])
        write_gap(cmp_dir, o, train.CODE, time.time() - t0, tasks, opaque, student, rows)  # so far: a long report can be read as it goes
        print(f'teacher gap: {entry} done ({time.time() - t0:.0f}s)', flush=True)
    print('\n'.join(write_gap(cmp_dir, o, train.CODE, time.time() - t0, tasks, opaque, student, rows)))
    return os.path.join(cmp_dir, 'teacher_gap.md')


def write_gap(cmp_dir, o, code, seconds, tasks, opaque, student, rows):
    """teacher_gap.md / .json from what is measured so far, with the utility statistics and, where the
    quick compare's results.json is in the same folder, how well each predicts the gains."""
    split = lambda r: (float(np.mean(r)), float(np.mean(np.array(r)[opaque])) if opaque.any() else None)
    gap = lambda a, b: f'{a - b:+.3f}' if a is not None and b is not None else '—'
    s_all, s_op = split(student)
    fams = sorted({t.family for t in tasks})
    by_family = lambda r: {f: float(np.mean([x for x, t in zip(r, tasks) if t.family == f])) for f in fams}
    table = {'student': {'success': s_all, 'opaque': s_op, 'by_family': by_family(student)}}
    md = [f'Held-out tasks: the first {len(tasks)} ({int(opaque.sum())} of opaque families), greedy, before any update; '
          'held-out graded reward (0/1 success where the reward is 0/1).',
          f"`python -m bench {' '.join(o.argv)}`, code {code}, {seconds:.0f} s.", GAP_LEGEND, '',
          '| teacher of | with context | teacher | student | gap | teacher, opaque | student, opaque | gap, opaque | '
          'KL, successes | KL, failures |',
          '|---|---|---|---|---|---|---|---|---|---|']
    for name, (r, cov, kl) in rows.items():
        t_all, t_op = split(r)
        table[name] = {'success': t_all, 'opaque': t_op, 'with_context': cov, 'by_family': by_family(r), **kl}
        md.append(f'| {name} | {cov:.2f} | {t_all:.3f} | {s_all:.3f} | {gap(t_all, s_all)} | {fmt(t_op)} | {fmt(s_op)} | '
                  f"{gap(t_op, s_op)} | {fmt(kl['kl_success'], '.4f')} | {fmt(kl['kl_failure'], '.4f')} |")
    corr = utility_correlation(cmp_dir, table)
    if corr:
        md += ['', "Privileged-information utility: Spearman's ρ between each statistic above (before training) and "
               "the gain over the base of each run of this folder's results.json (one pair per entry and seed; "
               "a control takes its control row, an ablation its own row or, if it leaves the teacher as it was before training, "
               "its method's):", '', '| statistic | ρ | pairs |', '|---|---|---|']
        md += [f'| {k} | {fmt(rho, "+.2f")} | {n} |' for k, (rho, n) in corr.items()]
        table['utility_correlation'] = {k: {'rho': rho, 'pairs': n} for k, (rho, n) in corr.items()}
    md += law_section(cmp_dir, table)
    os.makedirs(cmp_dir, exist_ok=True)
    with open(os.path.join(cmp_dir, 'teacher_gap.json'), 'w') as f:
        json.dump(table, f, indent=1)
    with open(os.path.join(cmp_dir, 'teacher_gap.md'), 'w') as f:
        f.write('\n'.join(md) + '\n')
    return md


def law_section(cmp_dir, table):
    """The predictive law's lines of teacher_gap.md (the fit, the fit without LOPD's entries, a row per
    entry) and its plot law.png, from a teacher-gap table and the compare's results.json in cmp_dir;
    the fits go into `table`. -> [markdown lines], none without results.json."""
    md = []
    law = predictive_law(cmp_dir, table)
    if law:
        iv = lambda law, k, f: f"{fmt(law[k][0], f)} [{fmt(law[k][1], f)}, {fmt(law[k][2], f)}]"
        fit = lambda law: (f"slope b = {iv(law, 'slope', '+.2f')}, intercept a = {iv(law, 'intercept', '+.3f')}, "
                           f"R² = {iv(law, 'r2', '.2f')}")
        md += ['', f"The predictive law (arXiv 2605.30070), final gain = a + b · teacher gap, OLS over the {law['pairs']} "
               f"(entry, seed) pairs of {law['entries']} entries, 95% intervals resampling entries: {fit(law)}."]
        table['predictive_law'] = law
        # does it rest on LOPD's entries (the largest gaps)? the same fit without them
        rest = predictive_law(cmp_dir, table, keep=lambda e: method_of(e) != 'lopd')
        if rest:
            md += [f"Without LOPD's entries ({rest['pairs']} pairs of {rest['entries']} entries): {fit(rest)}."]
            table['predictive_law_without_lopd'] = rest
        res = read_json(os.path.join(cmp_dir, 'results.json'))
        points = law_points(res, table)
        md += ['', "Per entry (plotted in law.png): its teacher's row, the step-0 gap, the gain over the base (seed mean).", '', '| entry | row | gap | gain | seeds |', '|---|---|---|---|---|']
        md += [f'| {e} | {row} | {x:+.3f} | {np.mean(ys):+.3f} | {len(ys)} |' for e, (row, x, ys) in points.items()]
        plot_law(os.path.join(cmp_dir, 'law.png'), points, law, res)
    return md


def law_points(res, table):
    """{entry: (its teacher-gap row, step-0 gap, [gain of each seed])}, by increasing gap."""
    out = {}
    for e, x, y in gain_pairs(res, table, step0_gap(table)):
        out.setdefault(e, (gap_row(e, table), x, []))[2].append(y)
    return dict(sorted(out.items(), key=lambda kv: kv[1][1]))


def plot_law(path, points, law, res):
    """Gain over the base vs the teacher's step-0 gap: one dot per (entry, seed), the seed mean labelled,
    the OLS line, and the gain of the entries without a teacher (GRPO, PSP) as horizontal lines."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 6))
    for i, (e, (_, x, ys)) in enumerate(points.items()):
        color = 'tab:red' if method_of(e) == 'lopd' else 'tab:blue'
        ax.scatter([x] * len(ys), ys, s=12, color=color, alpha=0.35)
        ax.scatter([x], [np.mean(ys)], s=30, color=color)
        right = i % 2 == 0  # labels alternate sides: entries that share a gap share an x
        ax.annotate(e, (x, np.mean(ys)), fontsize=7, xytext=(3 if right else -3, 2), textcoords='offset points',
                    ha='left' if right else 'right')
    gaps = [x for _, x, _ in points.values()]
    xs = np.array([min(0, min(gaps)), max(gaps)]) * 1.05  # every gap, negative ones too (a donor's context can hurt)
    (b, _, _), (a, _, _), (r2, _, _) = law['slope'], law['intercept'], law['r2']
    ax.plot(xs, a + b * xs, 'k-', lw=1, label=f'OLS: gain = {a:+.3f} + {b:.2f} · gap (R² {fmt(r2, ".2f")})')
    for e, r in res['entries'].items():
        if r and e in ENTRIES and METHODS[method_of(e)].teacher == 'none':
            gain = np.mean(r['final']) - r['base_mean']
            ax.axhline(gain, ls=':', lw=1, color='gray')
            ax.annotate(f'{e} (no teacher)', (xs[0], gain), fontsize=7, color='gray')
    ax.scatter([], [], color='tab:red', label="LOPD's entries")
    ax.scatter([], [], color='tab:blue', label='the other entries (controls on their control rows)')
    ax.set(xlabel="teacher's step-0 gap over its student (held-out reward, greedy)",
           ylabel='final gain over the base (held-out reward)')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc='lower right')
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# LOPD's choices that the teacher-gap report shows side by side (no cold start, an earlier composer, self-retrieval)
GAP_EXTRA = {'opsd-answer': ['--method', 'opsd', '--opsd_context', 'answer'],  # this task's plan and answer
             'opsd-family': ['--method', 'opsd', '--opsd_context', 'family'],    # another task of the family: OP²SD's donor
             'lopd-mlp': ['--method', 'lopd', '--composer', 'mlp', '--K', '4', '--cold_start', 'text', '--cold_start_steps', '100',
                          '--bank_source', 'rollouts'],                       # an earlier default: an MLP on the base's rollouts
             'lopd-copy': ['--method', 'lopd', '--cold_start_steps', '0'],    # no cold start: the copy-started composer (the earlier default)
             'lopd-self': ['--method', 'lopd', '--allow_same_task'],           # self-retrieval, as the paper's code allows
             'lopd-k16': ['--method', 'lopd', '--K', '16'],                    # the compare's ablations whose teacher is not LOPD's
             'lopd-j3': ['--method', 'lopd', '--J', '3'],
             'lopd-textcs': ['--method', 'lopd', '--cold_start', 'text'],
             'lopd-expert': ['--method', 'lopd', '--bank_source', 'expert'],    # upper bounds: a bank of expert demos
             'trajtext-expert': ['--method', 'trajtext', '--bank_source', 'expert']}
GAP_LEGEND = ('KL, successes / failures: the mean per-token KL(student ‖ teacher with its context) on the student\'s own sampled rollouts that succeeded / failed (one per task). '
              'Controls, for every teacher: -donor, the context built for another task of another family (OP²SD\'s shuffled donor); -empty, the context slot '
              'with nothing in it (<|bos|><|ctx|>, then the task); lopd-control: LOPD\'s latents composed from other-family experiences only; trajtext-control: the same shown as text. '
              'lopd-mlp: an earlier default (an MLP composer, K = 4, 100 text-to-latent cold-start steps, a bank of the base\'s rollouts); '
              'lopd-copy: the copy-started composer without a cold start (its latents start as the experience\'s embeddings); '
              'lopd-self: retrieval may return the task itself; opsd-answer: OPSD shown this task\'s plan and answer; opsd-family: OPSD shown the '
              'oracle trajectory of another training task of the same family (OP²SD\'s donor); -expert: the bank filled with the '
              'scripted expert\'s demos (an upper bound, not the method); lopd-k16, lopd-j3, lopd-textcs: the compare\'s '
              'ablations K = 16, J = 3 and the text-matching cold start.')


# ----------------------------------------------------------------------------- memory (--memory)

def step_memory(B, T, V, chunk, d=64):
    """Run in a fresh process: one distillation step (the student's forward with its graph, the frozen
    teacher's without, full-vocabulary reverse KL, backward, AdamW) of a 1-layer Llama of width d with
    a V-token vocabulary on (B, T) tokens -> (resident GiB before the step, peak GiB during it)."""
    import copy
    import resource
    import torch
    import lopd
    import model as M
    torch.manual_seed(0)
    student = M.tiny_llama(V, d_model=d, n_layer=1, n_head=2, max_len=T + 1)
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-4)
    ids, attn = torch.randint(0, V, (B, T)), torch.ones(B, T, dtype=torch.long)
    bos = lambda m: [M.embed(m, torch.tensor([0]))] * B
    gib = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20   # ru_maxrss is in KiB on Linux
    before = gib()
    with torch.no_grad():
        logits_t = M.logits_on(teacher, bos(teacher), ids, attn, chunk=chunk)
    loss = lopd.distill_loss(M.logits_on(student, bos(student), ids, attn, chunk=chunk), logits_t, attn.float())
    loss.backward()
    opt.step()
    return before, gib()


def lora_memory(r=16):
    """Parameter bytes of student + θ0 + EMA teacher for a Qwen2.5-0.5B-shaped model (built on the meta
    device: counts, no weights): three bf16 copies, vs one bf16 copy and two float32 LoRA adapters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device('meta'):
        model = get_peft_model(Qwen2ForCausalLM(cfg), LoraConfig(r=r, lora_alpha=2 * r, target_modules='all-linear'))
    base = sum(p.numel() for n, p in model.named_parameters() if 'lora_' not in n)
    adapter = sum(p.numel() for n, p in model.named_parameters() if 'lora_' in n)
    return base, adapter


def memory_report(o):
    """--memory: the two tables of the README's "Your own model on one GPU" section, printed."""
    B, T, V = 4, 2048, 151936
    rows = []
    for b, chunk in [(1, 0), (2, 0), (1, 1024), (2, 1024), (B, 1024), (B, 256)]:
        code = f'from bench import gap; print(*gap.step_memory({b}, {T}, {V}, {chunk}))'
        out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True)
        if out.returncode:
            die(f'--memory: the step with B={b}, chunk={chunk} failed: {out.stderr.strip().splitlines()[-1:]}')
        before, peak = map(float, out.stdout.split())
        rows.append((b, chunk, before, peak))
        print(f'B={b} T={T} V={V} chunk={chunk or "none"}: resident {before:.2f} GiB before the step, peak {peak:.2f} GiB '
              f'(+{peak - before:.2f})', flush=True)
    step = {(b, c): peak - before for b, c, before, peak in rows}
    # unchunked, B = 4 needs more memory than this machine has: the step's memory is linear in B, so
    # it is extrapolated from B = 1 and 2 (the chunked step's does not grow with B: it is one chunk's)
    unchunked = step[1, 0] + (B - 1) * (step[2, 0] - step[1, 0])
    print(f'B={B} unchunked, extrapolated from B=1 and 2: +{unchunked:.2f} GiB; chunked / unchunked: '
          f'{step[B, 1024] / unchunked:.3f} (chunk 1024), {step[B, 256] / unchunked:.3f} (chunk 256)')
    base, adapter = lora_memory()
    three, lora = 3 * base * 2, base * 2 + 2 * adapter * 4
    print(f'0.5B-shaped Qwen2 ({base / 1e6:.0f}M parameters; LoRA r=16 on every linear layer: {adapter / 1e6:.1f}M): '
          f'student + θ0 + EMA as three bf16 copies {three / 2 ** 30:.2f} GiB, as one bf16 copy + two fp32 adapters '
          f'{lora / 2 ** 30:.2f} GiB ({lora / three:.3f}x); AdamW state {base * 8 / 2 ** 30:.2f} GiB (full) vs '
          f'{adapter * 8 / 2 ** 30:.3f} GiB (adapter)')
