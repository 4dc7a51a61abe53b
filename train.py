"""Train a small agent with on-policy self-distillation: LOPD and its baselines.

One LOPD training step (Zhang et al. 2026, arXiv 2608.13040; one rollout per task, G = 1):
  1. rollout         the student samples one multi-turn episode per task (KV cache)
  2. retrieve        top-J successful past trajectories of similar tasks from the bank
  3. compose         the frozen base reads each; the composer φ maps it to K latent tokens
  4. teacher_phase   the frozen teacher π_θ0(·|z, x, y<t) scores every agent token
  5. student_phase   one optimizer step of θ on L_distill = Σ_{t∈A} KL(π_θ ‖ sg π_T) / |A|
  6. composer_phase  one step of φ on KL(sg π_θ ‖ π_T^φ) + β(m − Δ) + λ‖z − sg z0‖²; β ← max(0, β + η_β(m − Δ))
  7. write_back      new successful rollouts go into the bank
Before step 1, once: the warm-up (supervised on noisy-expert demos, 60% of them with a
privileged context to read, cached under runs/ and shared by every method) and the method's
setup (LOPD's cold start: fill the bank with base rollouts, which count toward the episode
budget, then pre-train φ by the frozen teacher's NLL of successful trajectories given the
latents of their retrieved experiences; `--cold_start text` instead makes the teacher reading
the latents act as it does reading the same experiences as text).

Every method goes through the same train_step: rollout -> teacher_phase (the method's context
builder, steps 2-3 for LOPD) -> student_phase (its loss) -> its after-step hook (steps 6-7 for
LOPD). The methods, one block each, are in methods.py; a new variant is one more block there.
The plumbing (checkpoints, caches, signals, logs, plots) is in bookkeeping.py.

Simplifications, said plainly: one PPO epoch per batch, so GRPO's ratio is 1 and its clip
never binds (the loss is the clipped objective all the same); LOPD's teacher forward is run
once with φ's graph kept and reused by the student phase (detached) and the composer phase,
which gives the same numbers as two separate forwards; the latents sit in the text context's
slot, framed as the text is (methods.latent_frame); a tiny Llama with a small BPE vocabulary
learned offline and toy environments stand in for a 4B model and EnvScaler.
"""
import argparse
import copy
import dataclasses
import hashlib
import json
import math
import os
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

import bookkeeping as bk
import envs
import lopd
import methods
import model as M
from bookkeeping import arg, die

CODE = bk.CODE
WARMUP_THREADS = 2
RUN, MODEL = 'the run', 'the model and the warm-up'


@dataclass
class Args:
    """The run, the model and the warm-up. Each method's own flags are in its block in methods.py."""
    method: str = arg('lopd', 'the method (one block each in methods.py)', group=RUN)
    env: str = arg('tooluse', 'environment', choices=list(envs.ENVS), group=RUN)
    seed: int = arg(0, 'seed of this run (task order, sampling, init of φ)', group=RUN)
    episodes: int = arg(3072, 'rollout budget: episodes sampled in total (a bank\'s filling included)',
                        lo=0, open_lo=True, after_setup=True, group=RUN)
    batch: int = arg(64, "episodes per training step (tasks × the method's group size)", lo=1, group=RUN)
    lr: float = arg(0.0, 'student learning rate (0 = the method default)', lo=0, group=RUN)
    eval_every: int = arg(8, 'steps between held-out evaluations', lo=1, after_setup=True, group=RUN)
    eval_tasks: int = arg(250, 'held-out tasks per evaluation (the first N of the fixed set)', lo=1, group=RUN)
    teacher_eval: int = arg(100, 'held-out tasks on which the teacher decodes with its context (0 = off)', lo=0, group=RUN)
    name: str = arg('', "run name ('' = <method>-<env>-s<seed>)", after_setup=True, group=RUN)
    out_dir: str = arg('runs', 'where runs/<name>/ and the caches go', after_setup=True, group=RUN)
    resume: str = arg('', 'resume from a run folder or its ckpt.pt', after_setup=True, group=RUN)
    overwrite: bool = arg(False, 'replace a finished or resumable run of the same name', after_setup=True, group=RUN)
    device: str = arg('auto', 'auto = cuda, then mps, then cpu', choices=['auto', 'cpu', 'cuda', 'mps'], group=RUN)
    dtype: str = arg('auto', 'fp32, bf16 (autocast), or auto = bf16 on a CUDA device that supports it (no fp16: '
                     'it needs loss scaling)', choices=['auto', 'fp32', 'bf16'], group=RUN)
    max_skips: int = arg(5, 'stop after this many updates in a row with a non-finite loss or gradient', lo=1,
                         after_setup=True, group=RUN)
    model: str = arg('', "a transformers causal LM, name or path ('' = the offline tiny Llama)", group=MODEL)
    d_model: int = arg(128, 'tiny Llama width', lo=1, group=MODEL)
    n_layer: int = arg(4, 'tiny Llama depth', lo=1, group=MODEL)
    bpe_merges: int = arg(256, 'BPE merges of the tiny model\'s tokenizer, learned offline from the environment\'s text '
                          '(0 = plain bytes)', lo=0, group=MODEL)
    warmup_steps: int = arg(500, 'supervised warm-up steps on noisy-expert demos', lo=0, group=MODEL)
    warmup_batch: int = arg(64, 'demos per warm-up step', lo=1, group=MODEL)
    warmup_lr: float = arg(3e-3, 'warm-up learning rate', lo=0, group=MODEL)
    warmup_ctx: float = arg(0.6, 'fraction of warm-up demos that teach the base to read a privileged context '
                            '(0 = the base that never saw one, an ablation)', lo=0, hi=1,
                            group=MODEL)


def config_class():
    """Args plus every registered method's own flags: the one config a run saves."""
    own = {}
    for m in methods.METHODS.values():
        for k, f in m.flags.items():
            own.setdefault(k, f)
    return dataclasses.make_dataclass('Config', [(k, type(f.default), dataclasses.field(default=f.default, metadata=f.metadata))
                                                 for k, f in own.items()], bases=(Args,))


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        die(message)


def parse_args(argv=None):
    """--flags -> the config (the saved one, when resuming). -h shows the flags in groups: the run,
    the model and warm-up, then each set of methods' own flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    Config = config_class()
    p = Parser(description=__doc__.split('\n')[0], allow_abbrev=False,
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    groups = {}
    for f in dataclasses.fields(Config):
        title = f.metadata['group'] or 'only for ' + ', '.join(methods.readers(f.name))
        g = groups.get(title) or groups.setdefault(title, p.add_argument_group(title))
        choices = list(methods.METHODS) if f.name == 'method' else f.metadata['choices']
        kw = dict(action='store_true') if f.type is bool else dict(type=f.type, default=f.default, choices=choices)
        g.add_argument(f'--{f.name}', help=f.metadata['help'], **kw)
    a = Config(**vars(p.parse_args(argv)))
    check_args(a, argv)
    return bk.resume_config(a, argv, Config) if a.resume else a


def check_args(a, argv):
    """What argparse's choices and the fields' ranges do not cover: one line each, exit status 2."""
    bk.check_ranges(a)
    m = methods.METHODS[a.method]
    given = {t[2:].split('=')[0] for t in argv if t.startswith('--')}
    for k in sorted(given - set(m.flags)):
        if methods.readers(k):
            die(f'--{k} applies to {", ".join(methods.readers(k))} only, not {a.method}')
    if a.batch % m.group:
        die(f'--batch {a.batch} must be a multiple of the group size {m.group} of {a.method}')
    if a.resume and not os.path.exists(a.resume):
        die(f'--resume path does not exist: {a.resume}')
    if a.device == 'cuda' and not torch.cuda.is_available():
        die('--device cuda asked for, but torch sees no CUDA device')
    if a.dtype == 'bf16' and bk.pick_device(a.device).type == 'cuda' and not torch.cuda.is_bf16_supported():
        die('--dtype bf16: this CUDA device does not support bfloat16; use --dtype fp32')
    if a.dtype == 'bf16' and bk.pick_device(a.device).type == 'mps':
        die('--dtype bf16 is not supported on mps here; use --dtype fp32')
    if a.model and a.model.startswith(('.', '/', '~')) and not os.path.isdir(os.path.expanduser(a.model)):
        die(f'--model {a.model}: no such folder')
    if os.path.exists(a.out_dir) and not os.path.isdir(a.out_dir):
        die(f'--out_dir {a.out_dir} is a file, not a folder')


# ----------------------------------------------------------------------------- rollout (step 1)

@torch.no_grad()
def rollout(model, tok, env, tasks, greedy=False, prefixes=None):
    """Step 1. Play one episode per task, all rows in one batch, turn by turn.

    Within a turn the agent's tokens come from the KV cache; between turns the env's
    observation is appended and the prefix is re-read once (cheap next to decoding).
    -> episodes, bodies (token lists without <|bos|>), agent masks (1 = agent-generated)."""
    prefixes = prefixes or M.bos_prefix(model, tok, len(tasks))
    eps = [env.reset(t) for t in tasks]
    bodies = [M.obs_ids(tok, t.prompt) for t in tasks]
    masks = [[0] * len(b) for b in bodies]
    for _ in range(env.max_turns):
        live = [i for i, e in enumerate(eps) if not e.done]
        if not live:
            break
        outs = M.generate(model, tok, [prefixes[i] for i in live], [bodies[i] for i in live],
                          env.max_action_tokens, greedy)
        for i, out in zip(live, outs):
            bodies[i] += out
            masks[i] += [1] * len(out)                                          # only what the agent generated
            step = env.step(eps[i], tok.decode([t for t in out if t != tok.eot]))
            if not step.done:
                o = M.obs_ids(tok, step.obs)
                bodies[i] += o
                masks[i] += [0] * len(o)                                        # observations get no loss
    return eps, bodies, masks


# ----------------------------------------------------------------------------- warm-up

# the forms of privileged context the warm-up teaches the base to read, with their share of the context demos
CONTEXT_FORMS = {'solution': 0.2, 'this_task': 0.15, 'past': 0.3, 'unhelpful': 0.1, 'skill': 0.1, 'feedback': 0.15}


def warmup_demo(env, task, by_family, rng, p_ctx=0.0):
    """One warm-up demo -> (episode, privileged context text or None).

    Without a context (probability 1 − p_ctx): the noisy expert. With one, the demo teaches
    the base to *read* a privileged context, as an instruction-tuned LLM can (our tiny model
    starts from nothing), in each form the methods' teachers are shown (CONTEXT_FORMS): this
    task's reference solution (OPSD), a demonstration of this task (SDFT, SDPO's sibling), one
    to three past trajectories of which at least one is of this family and the rest of others
    (LOPD's Traj-text), a skill text (Skill-SD), feedback on a failed attempt (SDPO) — each
    followed by a demo that uses it — or only other families' trajectories, followed by the
    noisy expert (an unhelpful context is to be ignored). On opaque families the plan shown
    and followed is one random plan per demo, never the family's true plan, so that reading
    is learned but no opaque plan is: those stay learnable only from experience."""
    u = rng.random()
    if u >= p_ctx:
        return envs.play(env, task, env.demo(task, rng, noisy=True)), None
    form = rng.choices(list(CONTEXT_FORMS), weights=list(CONTEXT_FORMS.values()))[0]
    opaque = getattr(env, 'opaque', ())
    plan_of = lambda f: {'plan': envs.random_plan(rng, avoid=envs.FAMILIES[f])} if f in opaque else {}
    kw = plan_of(task.family)
    follow = lambda t: envs.play(env, t, env.demo(t, rng, **kw))               # the plan this demo teaches
    pair = lambda ep: (ep.task.prompt, env.trajectory_text(ep))
    others = lambda n: [envs.play(env, t, env.demo(t, rng, **plan_of(t.family))) for t in
                        (rng.choice(by_family[rng.choice([f for f in by_family if f != task.family])]) for _ in range(n))]
    if form == 'unhelpful':
        return envs.play(env, task, env.demo(task, rng, noisy=True)), methods.experiences_text(map(pair, others(rng.randint(1, 3))))
    ep = follow(task)
    if form == 'solution':
        return ep, f'reference solution: {env.trajectory_text(ep)}\n'
    if form == 'this_task':
        return ep, methods.experiences_text([pair(follow(task))])
    if form == 'past':
        n = rng.randint(1, 3)
        same = [follow(t) for t in rng.sample(by_family[task.family], rng.randint(1, n))]
        shown = same + others(n - len(same))
        rng.shuffle(shown)
        return ep, methods.experiences_text(map(pair, shown))
    failed = next((f for f in (envs.play(env, task, env.demo(task, rng, noisy=True)) for _ in range(4)) if f.reward == 0), None)
    if form == 'skill':
        wins = [follow(t) for t in rng.sample(by_family[task.family], rng.randint(1, 2))]
        records = [(env.trajectory_text(w), 1.0, w.feedback) for w in wins]
        records.insert(0, (env.trajectory_text(failed), 0.0, failed.feedback)) if failed else None
        return ep, methods.skill_text(records)
    return ep, f'feedback: {failed.feedback}\n' if failed else f'reference solution: {env.trajectory_text(ep)}\n'


def warmup_pool(env):
    """The warm-up's own tasks (no held-out or training task among them), and the same by family."""
    pool = env.make_tasks(20_000, seed=30_000, families=env.warmup_families, split='warm')
    by_family = {}
    for t in pool:
        by_family.setdefault(t.family, []).append(t)
    return pool, by_family


def tokenizer_texts(env, n=2000):
    """What the tiny model will read, for its BPE merges (model.bpe_ranks): warm-up demos, half
    of them with a privileged context, and LOPD's reading frame. Deterministic, and the same for
    every instance of an environment, so it is made once per process."""
    if (env.name, n) not in _TEXTS:
        _TEXTS[env.name, n] = _tokenizer_texts(env, n)
    return _TEXTS[env.name, n]


_TEXTS = {}


def _tokenizer_texts(env, n):
    rng, (pool, by_family) = random.Random(4321), warmup_pool(env)
    texts = [methods.READING_FRAME]
    for t in rng.sample(pool, n):
        ep, ctx = warmup_demo(env, t, by_family, rng, 0.5)
        texts += [t.prompt, ctx or '', *(x for turn in ep.turns for x in turn)]
    return texts


def warmup_loss(model, tok, demos, contexts, device, rows_per_forward=16):
    """NLL of the demos' agent tokens. Rows are sorted by length (context + body) and scored
    rows_per_forward at a time, so that short rows do not pay for the long ones' padding (the
    forwards are compute-bound on a CPU: padding is time)."""
    seqs, masks = zip(*[M.encode_episode(tok, d) for d in demos])
    ctx = [tok.encode(c) if c else None for c in contexts]
    order = sorted(range(len(demos)), key=lambda i: (len(ctx[i]) if ctx[i] is not None else -1, len(seqs[i])))
    total, n = 0.0, 0
    for k in range(0, len(order), rows_per_forward):
        rows = order[k:k + rows_per_forward]
        ids, amask, attn = M.pad_batch([seqs[i] for i in rows], [masks[i] for i in rows], tok.pad, device)
        prefixes = [M.embed(model, torch.tensor([tok.bos, tok.ctx] + ctx[i] if ctx[i] is not None else [tok.bos],
                                                device=device)) for i in rows]
        nll = -lopd.token_logp(M.logits_on(model, prefixes, ids, attn), ids)     # (b, T)
        total, n = total + (nll * amask).sum(), n + amask.sum()
    return total / n


def warmup(args, tok, model, env, device):
    """Supervised warm-up on noisy-expert demos, cached under out_dir, shared by every method.
    -> (cache path, whether it came from the cache)."""
    key = json.dumps(['v7', env.name, env.families, args.model, args.d_model, args.n_layer, args.warmup_steps,
                      args.warmup_batch, args.warmup_ctx, args.warmup_lr, tok.digest(), CONTEXT_FORMS, M.SPECIALS,
                      M.MAX_OBS_CHARS])
    path = os.path.join(args.out_dir, f'warmup-{env.name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}.pt')

    def build():
        # the base is the same for every run seed (one base, many methods) and wherever it is built
        # with this torch: a fixed thread count, since sums split over threads round differently
        # (1 and 2 threads gave two different bases); 2, so that a 2-core machine builds it at full speed
        rng, threads = random.Random(1234), torch.get_num_threads()
        torch.manual_seed(1234)
        torch.set_num_threads(WARMUP_THREADS)
        pool, by_family = warmup_pool(env)
        opt = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr, weight_decay=0.0)
        for step in (bar := tqdm(range(args.warmup_steps), desc='warm-up', dynamic_ncols=True)):
            for g in opt.param_groups:  # cosine decay to 10%
                g['lr'] = args.warmup_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.warmup_steps)))
            demos, contexts = zip(*[warmup_demo(env, t, by_family, rng, args.warmup_ctx)
                                    for t in rng.sample(pool, args.warmup_batch)])
            loss = warmup_loss(model, tok, demos, contexts, device)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            bar.set_postfix(loss=f'{loss.item():.3f}')
        torch.set_num_threads(threads)
        return {'model': model.state_dict(), 'key': key}

    def apply(saved):
        if saved['key'] != key:
            raise ValueError('the key inside differs')
        bk.load_module(model, saved['model'])

    return path, bk.cached(path, 'warm-up', build, apply, device)


# ----------------------------------------------------------------------------- the phases (steps 4-5)

def teacher_phase(run, b):
    """Step 4: the teacher scores every agent token of every rollout, given its privileged context
    (the method's context builder; LOPD's is steps 2-3). A frozen or EMA teacher has no graph of its
    own, so only a context that carries one (LOPD's latents) is differentiable; a live teacher is θ
    itself and runs without gradients. -> methods.Teacher, or None for a method without a teacher."""
    if run.method.context is None:  # a method without a teacher
        return None
    with torch.set_grad_enabled(run.teacher is not run.model):
        ctx = run.method.context(run, b.eps)
        keep = torch.tensor([p is not None for p in ctx])                        # (B,) no context: no teacher
        return methods.Teacher(M.logits_on(run.teacher, methods.with_default(run, ctx), b.ids, b.attn), keep, ctx)


def student_phase(run, b, teacher):
    """Step 5: one step of θ on the method's loss; the student scores every prefix in one forward.
    -> the student's logits (detached, for an after-step hook) and the loss."""
    logits_s = M.logits_on(run.model, M.bos_prefix(run.model, run.tok, b.ids.shape[0]), b.ids, b.attn)   # (B, T, V)
    loss = run.method.loss(run, b, logits_s, teacher)
    bk.optimizer_step(run, run.opt, loss, run.model)
    if run.teacher_kind == 'ema':
        lopd.ema_update(run.teacher, run.model, run.args.ema_rate)
    return logits_s.detach(), loss.item()


def train_step(run):
    """One step of the chosen method on a fresh batch of episodes."""
    a, m = run.args, run.method
    tasks = [t for t in run.rng.sample(run.env.train_tasks, a.batch // m.group) for _ in range(m.group)]
    with run.timer('rollout'):
        eps, bodies, masks = rollout(run.model, run.tok, run.env, tasks)
        b = methods.Batch(eps, *M.pad_batch(bodies, masks, run.tok.pad, run.device),
                          torch.tensor([e.reward for e in eps], device=run.device))
    run.episodes += len(eps)
    with run.timer('teacher'):
        teacher = teacher_phase(run, b)
    with run.timer('student'):
        logits_s, loss = student_phase(run, b, teacher)
    logs = {'loss': loss, 'reward': float(np.mean([e.reward for e in eps])), **m.after_step(run, b, logits_s, teacher)}
    for k, v in logs.items():
        run.log.setdefault(k, []).append(v)
    run.step += 1


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(run):
    """Held-out success: greedy, the student alone, no privileged context. Plus the teacher's
    own success when it decodes with its context (does the context carry information?)."""
    tasks = run.env.eval_tasks[:run.args.eval_tasks]
    with run.timer('eval'):
        eps = [e for i in range(0, len(tasks), 128) for e in rollout(run.model, run.tok, run.env, tasks[i:i + 128], greedy=True)[0]]
        out, fam = {'success': float(np.mean([e.reward for e in eps]))}, {}
        for e in eps:
            fam.setdefault(e.task.family, []).append(e.reward)
        out['family'] = {f: float(np.mean(v)) for f, v in fam.items()}
        if run.method.context and run.args.teacher_eval:
            tasks = tasks[:run.args.teacher_eval]  # families cycle, so the first N are balanced
            out['student_success_same_tasks'] = float(np.mean([e.reward for e in eps[:len(tasks)]]))
            prefixes = methods.with_default(run, run.method.context(run, [run.env.reset(t) for t in tasks]))
            teps = rollout(run.teacher, run.tok, run.env, tasks, greedy=True, prefixes=prefixes)[0]
            out['teacher_success'] = float(np.mean([e.reward for e in teps]))
    return bk.log_eval(run, out)


# ----------------------------------------------------------------------------- main

def build(args):
    """The run: model, warm-up, teacher, optimizer, the method's state; resumed, or evaluated
    at the base and set up (the first checkpoint)."""
    method = methods.METHODS[args.method]
    run = bk.Run(args, method, bk.code_of(method))
    run.env = envs.make_env(args.env)
    run.tok, run.model = load_model(args, run.env)
    run.model.to(run.device)
    with run.timer('warmup'):
        wpath, _ = warmup(args, run.tok, run.model, run.env, run.device)
    torch.manual_seed(args.seed)
    run.teacher = {'frozen': lambda: frozen_copy(run.model), 'ema': lambda: frozen_copy(run.model),
                   'live': lambda: run.model, 'none': lambda: None}[run.teacher_kind]()
    run.opt = torch.optim.AdamW(run.model.parameters(), lr=args.lr or method.lr, weight_decay=0.0)
    run.state = method.state(run)
    if args.resume:
        bk.load_checkpoint(run, args.resume)
        print(f'resumed at step {run.step}, {run.episodes} episodes')
        return run
    open(os.path.join(run.dir, 'metrics.jsonl'), 'w').close()
    bk.atomic_json({**dataclasses.asdict(args), 'code': run.code}, os.path.join(run.dir, 'config.json'))
    with run.autocast():
        m = evaluate(run)
        print(f"base model: held-out success {m['success']:.3f}" +
              (f", teacher {m['teacher_success']:.3f}" if 'teacher_success' in m else ''))
        if method.setup:
            bk.cached_setup(run, lambda run: method.setup(run, rollout), wpath)
    bk.save_checkpoint(run)  # a run killed from here on can be resumed
    return run


def load_model(args, env):
    """The tokenizer and the model before the warm-up, as every run (and test, and notebook) builds
    them: the BPE tokenizer learned from this environment's text (or bytes, or --model's own), and
    the tiny model's init from torch's seed 1234, so that a warm-up built anywhere is the same base."""
    torch.manual_seed(1234)
    texts = tokenizer_texts(env) if args.bpe_merges and not args.model else None
    return M.load(args.model or None, args.d_model, args.n_layer, texts, args.bpe_merges)


def frozen_copy(model):
    return copy.deepcopy(model).eval().requires_grad_(False)                    # θ0


def main(argv=None):
    args = parse_args(argv)
    args.name = args.name or f'{args.method}-{args.env}-s{args.seed}'
    if not args.resume:
        bk.claim_run_dir(os.path.join(args.out_dir, args.name), args.overwrite)
    print(json.dumps(dataclasses.asdict(args)))
    random.seed(args.seed)
    np.random.seed(args.seed)
    with bk.Guard(args) as guard:
        run = guard.run = build(args)
        guard.training = True
        bar = tqdm(total=args.episodes, initial=min(run.episodes, args.episodes), desc=f'{args.method} episodes',
                   dynamic_ncols=True)
        while run.episodes < args.episodes and not guard.now:                   # the loop
            before = run.episodes
            with run.autocast():
                train_step(run)
            bar.update(run.episodes - before)
            if run.step % args.eval_every == 0 or run.episodes >= args.episodes:
                with run.autocast():
                    m = evaluate(run)
                bar.set_postfix(success=f"{m['success']:.3f}", **{k: f'{v:.2f}' for k, v in run.state.items()
                                                                   if isinstance(v, float)})
                bk.save_checkpoint(run)
                bk.plot(run)
        bar.close()
        if not guard.now and run.metrics[-1]['step'] != run.step:
            with run.autocast():
                evaluate(run)
        bk.save_checkpoint(run)
        bk.plot(run)
    if guard.now:
        print(f'interrupted at step {run.step}; checkpoint saved; continue with --resume {run.dir}')
        sys.exit(130)
    print(bk.summarize(run))


if __name__ == '__main__':
    main()
