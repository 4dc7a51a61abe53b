"""Train a small agent with on-policy self-distillation: LOPD and its baselines.

One LOPD training step (Zhang et al. 2026, arXiv 2608.13040; one rollout per task, G = 1):
  1. rollout         the student samples one multi-turn episode per task (KV cache)
  2. retrieve        top-J successful past trajectories of similar tasks from the bank
  3. compose         the frozen base reads each; the composer φ maps it to K latent tokens
  4. teacher_phase   the frozen teacher π_θ0(·|z, x, y<t) scores every agent token
  5. student_phase   one optimizer step of θ on L_distill = Σ_{t∈A} KL(π_θ ‖ sg π_T) / |A|
  6. composer_phase  one step of φ on KL(sg π_θ ‖ π_T^φ) + β(m − Δ) + λ‖z − sg z0‖²; β ← max(0, β + η_β(m − Δ))
  7. write_back      new successful rollouts go into the bank
Before step 1, once: the warm-up (warmup.py, cached under runs/, shared by every method) and
the method's setup (LOPD's: fill the bank, counted toward the episode budget;
then pre-train φ, 150 steps of the paper's NLL cold start).

Every method goes through the same train_step: rollout -> teacher_phase (the method's context
builder, steps 2-3 for LOPD) -> student_phase (its loss) -> its after-step hook (steps 6-7 for
LOPD). The methods, one block each, are in methods.py; a new variant is one more block there.
The plumbing (checkpoints, caches, signals, logs, plots) is in bookkeeping.py, the warm-up in warmup.py.

Simplifications, said plainly: one PPO epoch per batch, so GRPO's ratio is 1 and its clip
never binds (the loss is the clipped objective all the same); LOPD's teacher forward is run
once with φ's graph kept and reused by the student phase (detached) and the composer phase,
which gives the same numbers as two separate forwards; the latents sit in the text context's
slot, framed as the text is (lopd_method.latent_frame); a tiny Llama with a small BPE vocabulary
learned offline and toy environments stand in for a 4B model and EnvScaler.
"""
import argparse
import copy
import dataclasses
import functools
import json
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
import parallel
import warmup
from bookkeeping import arg, die

CODE = bk.CODE
RUN, MODEL = 'the run', 'the model and the warm-up'


@dataclass
class Args:
    """The run, the model and the warm-up. Each method's own flags are in its block in methods.py."""
    method: str = arg('lopd', 'the method (one block each in methods.py)', group=RUN)
    env: str = arg('tooluse', 'environment', choices=list(envs.ENVS), group=RUN)
    seed: int = arg(0, 'seed of this run (task order, sampling, init of φ)', group=RUN)
    episodes: int = arg(3072, 'rollout budget: episodes sampled in total (a bank\'s filling included, unless --setup_free)',
                        lo=0, open_lo=True, after_setup=True, group=RUN)
    setup_free: bool = arg(False, "the paper's accounting: the episodes a method's setup samples (LOPD's bank, the pool, "
                           "ACSD's first vector) do not count toward --episodes", after_setup=True, group=RUN)
    batch: int = arg(16, "episodes per training step (tasks × the method's group size)", lo=1, group=RUN)
    temperature: float = arg(1.0, 'sampling temperature of the training rollouts (the paper samples at 0.7)', lo=0,
                             open_lo=True, after_setup=True, group=RUN)
    lr: float = arg(0.0, 'student learning rate (0 = the method default)', lo=0, group=RUN)
    eval_every: int = arg(64, 'steps between held-out evaluations', lo=1, after_setup=True, group=RUN)
    eval_tasks: int = arg(500, 'held-out tasks per evaluation (the first N of the fixed set)', lo=1, group=RUN)
    eval_samples: int = arg(1, 'samples per held-out task at temperature 0.7, besides the greedy one (0 = greedy only)', lo=0,
                            group=RUN)
    teacher_eval: int = arg(100, 'held-out tasks on which the teacher decodes with its context (0 = off)', lo=0, group=RUN)
    name: str = arg('', "run name ('' = <method>-<env>-s<seed>)", after_setup=True, group=RUN)
    out_dir: str = arg('runs', 'where runs/<name>/ and the caches go', after_setup=True, group=RUN)
    resume: str = arg('', 'resume from a run folder or its ckpt.pt', after_setup=True, group=RUN)
    overwrite: bool = arg(False, 'replace a finished or resumable run of the same name', after_setup=True, group=RUN)
    device: str = arg('auto', 'auto = cuda, then mps, then cpu', choices=['auto', 'cpu', 'cuda', 'mps'], group=RUN)
    dtype: str = arg('auto', 'fp32, bf16 (autocast), or auto = bf16 on a CUDA device that supports it (no fp16: '
                     'it needs loss scaling)', choices=['auto', 'fp32', 'bf16'], group=RUN)
    tensorboard: bool = arg(False, 'also write the logged metrics for TensorBoard, to <run>/tensorboard/', after_setup=True,
                            group=RUN)
    max_skips: int = arg(5, 'stop after this many updates in a row with a non-finite loss or gradient', lo=1,
                         after_setup=True, group=RUN)
    model: str = arg('', "a transformers causal LM: hub name, folder, or .gguf file (its quantized weights are dequantized "
                     "to --dtype and LoRA trains on top of them); a chat model is told the task in its system turn "
                     "('' = the offline tiny Llama)", group=MODEL)
    lora_r: int = arg(-1, 'rank of the LoRA adapter that trains (0 = every weight trains; -1 = 16 with --model, '
                      '0 for the tiny model)', lo=-1, group=MODEL)
    score_chunk: int = arg(-1, 'positions per chunk through the LM head when scoring (0 = the whole batch at once; '
                           '-1 = 256 with --model, 0 for the tiny model)', lo=-1, group=MODEL)
    grad_ckpt: bool = arg(False, "gradient checkpointing: recompute the model's activations in the backward pass",
                          after_setup=True, group=MODEL)
    export: str = arg('', 'write a run folder\'s student as a transformers model (LoRA merged) to <run>/export, then exit',
                      after_setup=True, group=MODEL)
    d_model: int = arg(128, 'tiny Llama width', lo=1, group=MODEL)
    n_layer: int = arg(4, 'tiny Llama depth', lo=1, group=MODEL)
    bpe_merges: int = arg(256, 'BPE merges of the tiny model\'s tokenizer, learned offline from the environment\'s text '
                          '(0 = plain bytes)', lo=0, group=MODEL)
    warmup_steps: int = arg(800, 'supervised warm-up steps on noisy-expert demos (tool use: reading a context forms after ~500; codegen: 500)', lo=0, group=MODEL)
    warmup_batch: int = arg(32, 'demos per warm-up step (codegen and tooluse-v1: 64, as when their numbers were '
                             'measured)', lo=1, group=MODEL)
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
    given = {t[2:].split('=')[0] for t in argv if t.startswith('--')}
    for k, v in envs.ENVS[a.env].defaults.items():  # the environment's own defaults, where a flag is not given
        if k not in given:
            setattr(a, k, v)
    if a.lora_r < 0:
        a.lora_r = 16 if a.model else 0
    if a.score_chunk < 0:
        a.score_chunk = 256 if a.model else 0
    if a.export:
        a.resume = a.resume or a.export
    check_args(a, given)
    return bk.resume_config(a, argv, Config) if a.resume else a


def check_args(a, given):
    """What argparse's choices and the fields' ranges do not cover (given: the flags on the command
    line): one line each, exit status 2."""
    bk.check_ranges(a)
    m = methods.METHODS[a.method]
    for k in sorted(given - set(m.flags)):
        if methods.readers(k):
            die(f'--{k} applies to {", ".join(methods.readers(k))} only, not {a.method}')
    for f in dataclasses.fields(a):  # e.g. --margin without --composer_phase would be read by nothing
        if f.name in given and f.metadata.get('needs') and not getattr(a, f.metadata['needs']):
            die(f'--{f.name} acts only with --{f.metadata["needs"]}')
    if a.batch % m.group:
        die(f'--batch {a.batch} must be a multiple of the group size {m.group} of {a.method}')
    ranks = int(os.environ.get('WORLD_SIZE', 1))
    if a.batch % (m.group * ranks):
        die(f'--batch {a.batch} must be a multiple of the group size {m.group} × {ranks} ranks, so every rank rolls out whole groups')
    if a.resume and not os.path.exists(a.resume):
        die(f'--resume path does not exist: {a.resume}')
    if a.device == 'cuda' and not torch.cuda.is_available():
        die('--device cuda asked for, but torch sees no CUDA device')
    kind = parallel.pick_device(a.device).type
    if a.dtype == 'bf16' and (kind == 'mps' or kind == 'cuda' and not torch.cuda.is_bf16_supported()):
        die(f'--dtype bf16 is not supported on this {kind} device; use --dtype fp32')
    local = os.path.expanduser(a.model)
    if a.model.startswith(('.', '/', '~')) and not (os.path.isdir(local) or local.endswith('.gguf') and os.path.isfile(local)):
        die(f'--model {a.model}: no such folder' + (' or file' if local.endswith('.gguf') else ''))
    if os.path.exists(a.out_dir) and not os.path.isdir(a.out_dir):
        die(f'--out_dir {a.out_dir} is a file, not a folder')


# ----------------------------------------------------------------------------- rollout (step 1)

@torch.no_grad()
def rollout(model, tok, env, tasks, greedy=False, prefixes=None, temperature=1.0):
    """Step 1. Play one episode per task, all rows in one batch, turn by turn.

    Within a turn the agent's tokens come from the KV cache; between turns the env's
    observation is appended and the prefix is re-read once (cheap next to decoding).
    -> episodes, bodies (token lists without <|bos|>), agent masks (1 = agent-generated)."""
    prefixes = prefixes or M.bos_prefix(model, tok, len(tasks))
    eps = [env.reset(t) for t in tasks]
    bodies = [M.obs_ids(tok, t.prompt, first=True) for t in tasks]
    masks = [[0] * len(b) for b in bodies]
    for _ in range(env.max_turns):
        live = [i for i, e in enumerate(eps) if not e.done]
        if not live:
            break
        outs = M.generate(model, tok, [prefixes[i] for i in live], [bodies[i] for i in live],
                          env.max_action_tokens, greedy, temperature)
        for i, out in zip(live, outs):
            bodies[i] += out
            masks[i] += [1] * len(out)                                          # only what the agent generated
            if out[-1:] != [tok.eot]:  # cut at max_action_tokens: closed as the template closes a turn, outside
                bodies[i] += [tok.eot]  # the mask (the policy never sampled it, so no loss may score it)
                masks[i] += [0]
            step = env.step(eps[i], tok.decode([t for t in out if t != tok.eot]))
            if not step.done:
                o = M.obs_ids(tok, step.obs)
                bodies[i] += o
                masks[i] += [0] * len(o)                                        # observations get no loss
    return eps, bodies, masks


# ----------------------------------------------------------------------------- the phases (steps 4-5)

def teacher_phase(run, b):
    """Step 4: the teacher scores every agent token of every rollout, given its privileged context
    (the method's context builder; LOPD's is steps 2-3). A frozen or EMA teacher has no graph of its
    own, so only a context that carries one (LOPD's latents) is differentiable; a live teacher is θ
    itself and runs without gradients. -> methods.Teacher, or None for a method without a teacher."""
    if run.method.context is None:  # a method without a teacher
        return None
    with torch.set_grad_enabled(run.teacher is not run.model):
        ctx = methods.embed_context(run, run.method.context(run, b.eps))
        keep = torch.tensor([p is not None for p in ctx])                        # (B,) no context: no teacher
        return methods.Teacher(M.logits_on(run.teacher, methods.with_default(run, ctx), b.ids, b.attn, run.args.score_chunk), keep, ctx)


def student_phase(run, b, teacher):
    """Step 5: one step of θ on the method's loss (--epochs steps for a distillation method, on the
    same rollouts and teacher scores); the student scores every prefix in one forward.
    -> the student's logits before the first step (detached, for an after-step hook) and its loss."""
    score = lambda: M.logits_on(run.model, M.bos_prefix(run.model, run.tok, b.ids.shape[0]), b.ids, b.attn, run.args.score_chunk)
    logits_s = score()                                                          # (B, T, V)
    loss = run.method.loss(run, b, logits_s, teacher)
    logits_s = logits_s.detach()                                                # before the step: θ's head as it scored
    bk.optimizer_step(run, run.opt, loss, run.model)
    for _ in range(run.args.epochs - 1):
        bk.optimizer_step(run, run.opt, run.method.loss(run, b, score(), teacher), run.model)
    if run.teacher_kind == 'ema':
        lopd.ema_update(run.teacher, M.trained(run.model), run.args.ema_rate or run.method.ema_rate)
    return logits_s, loss.item()


def train_step(run):
    """One step of the chosen method on a fresh batch of episodes."""
    a, m = run.args, run.method
    tasks = [t for t in run.rng.sample(run.env.train_tasks, a.batch // m.group) for _ in range(m.group)]
    with run.timer('rollout'):  # under torchrun each rank rolls out its share, and every rank gets the whole batch
        play = functools.partial(rollout, temperature=a.temperature)
        eps, bodies, masks = parallel.shared(run, lambda ts: m.sample(run, ts, play) if m.sample else
                                       play(run.model, run.tok, run.env, ts), tasks)
        b = methods.Batch(eps, *M.pad_batch(bodies, masks, run.tok.pad, run.device),
                          torch.tensor([e.reward for e in eps], device=run.device))
    run.episodes += len(eps)
    with run.timer('teacher'):
        teacher = teacher_phase(run, b)
    with run.timer('student'):
        logits_s, loss = student_phase(run, b, teacher)
    with torch.no_grad():  # what success hides: does the student's entropy collapse?
        entropy = lopd.masked_mean(lopd.per_position(lopd.entropy, logits_s), b.amask).item()
    logs = {'loss': loss, 'reward': float(np.mean([e.reward for e in eps])), 'entropy': entropy,
            **m.after_step(run, b, logits_s, teacher)}
    for k, v in logs.items():
        run.log.setdefault(k, []).append(v)
    run.step += 1


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(run):
    """Held-out graded reward and success: greedy, and sampled at temperature 0.7 as the paper
    evaluates (--eval_samples per task), the student alone, no privileged context; per family, and
    per task (for intervals over tasks). Plus the teacher's own reward when it decodes with its
    context (does the context carry information?)."""
    a, tasks = run.args, run.env.eval_tasks[:run.args.eval_tasks]
    play = lambda ts, **kw: parallel.shared(run, lambda ts: [e for i in range(0, len(ts), 128)
                                                       for e in rollout(run.model, run.tok, run.env, ts[i:i + 128], **kw)[0]], ts)
    with run.timer('eval'):
        eps = play(tasks, greedy=True)
        out = {'reward': float(np.mean([e.reward for e in eps])), 'success': float(np.mean([e.success for e in eps]))}
        out['family'], out['actions'] = envs.by_family(eps), envs.action_stats(run.env, eps)
        out['task_reward'] = [round(e.reward, 4) for e in eps]
        if a.eval_samples:  # from a generator of its own: training never depends on how often or how much it evaluates
            with torch.random.fork_rng(devices=[run.device] if run.device.type == 'cuda' else []):
                torch.manual_seed(10_000 * a.seed + run.step)
                sampled = play([t for t in tasks for _ in range(a.eval_samples)], temperature=EVAL_TEMPERATURE)
            r = np.array([e.reward for e in sampled]).reshape(len(tasks), a.eval_samples)
            out.update(reward_sampled=float(r.mean()), success_sampled=float(np.mean([e.success for e in sampled])),
                       task_reward_sampled=[round(float(x), 4) for x in r.mean(1)])
        if run.method.context and a.teacher_eval:
            tasks = tasks[:a.teacher_eval]  # families cycle, so the first N are balanced
            out['student_reward_same_tasks'] = float(np.mean([e.reward for e in eps[:len(tasks)]]))
            out['student_success_same_tasks'] = float(np.mean([e.success for e in eps[:len(tasks)]]))
            prefixes = methods.with_default(run, methods.embed_context(run, run.method.context(run, [run.env.reset(t) for t in tasks])))
            teps = parallel.shared(run, lambda rows: rollout(run.teacher, run.tok, run.env, [tasks[i] for i in rows], greedy=True,
                                                       prefixes=[prefixes[i] for i in rows])[0], list(range(len(tasks))))
            out['teacher_reward'] = float(np.mean([e.reward for e in teps]))
            out['teacher_success'] = float(np.mean([e.success for e in teps]))
    return bk.log_eval(run, out)


EVAL_TEMPERATURE = 0.7  # the paper's evaluation temperature


# ----------------------------------------------------------------------------- main

def build(args):
    """The run: model, warm-up, teacher, optimizer, the method's state; resumed, or evaluated
    at the base and set up (the first checkpoint)."""
    method = methods.METHODS[args.method]
    run = bk.Run(args, method, bk.code_of(method))
    run.env = envs.make_env(args.env)
    try:
        run.tok, run.model = warmup.load_model(args, run.env, run.dtype)
    except ValueError as e:  # a chat template that is not one layout
        die(f'--model {args.model}: {e}')
    if args.model and args.lora_r:  # a real model's warm-up trains an adapter too, folded into θ0 below
        run.model = M.with_lora(run.model, run.tok, args.lora_r)
    run.model.to(run.device)
    with run.timer('warmup'), parallel.rank0_first():
        wpath, _ = warmup.warmup(args, run.tok, run.model, run.env, run.device)
    torch.manual_seed(args.seed)
    if args.lora_r:  # θ0 = the warmed-up base, frozen; θ = θ0 + a fresh adapter
        run.model = M.with_lora(M.merged(run.model), run.tok, args.lora_r).to(run.device)
    if args.grad_ckpt:
        M.checkpoint_activations(run.model)
    run.teacher = make_teacher(run.model, run.teacher_kind)
    run.opt = torch.optim.AdamW([p for p in run.model.parameters() if p.requires_grad], lr=args.lr or method.lr,
                                weight_decay=0.0)
    run.state = method.state(run)
    if args.resume:
        bk.load_checkpoint(run, args.resume)
        print(f'resumed at step {run.step}, {run.episodes} episodes')
        return run
    if parallel.writer():
        open(os.path.join(run.dir, 'metrics.jsonl'), 'w').close()
    bk.atomic_json({**dataclasses.asdict(args), 'code': run.code}, os.path.join(run.dir, 'config.json'))
    with run.autocast():
        m = evaluate(run)
        print(f"base model: held-out reward {m['reward']:.3f}, success {m['success']:.3f}" +
              (f"; teacher reward {m['teacher_reward']:.3f}" if 'teacher_reward' in m else ''))
        if method.setup:
            with parallel.rank0_first():
                bk.cached_setup(run, lambda run: method.setup(run, rollout), wpath)
        run.setup_episodes = run.episodes
    bk.save_checkpoint(run)  # a run killed from here on can be resumed
    return run


def load_run(run_dir):
    """A run folder -> the live run at its last checkpoint, as `--resume` rebuilds it: model,
    teacher, optimizer, the method's state, every RNG. For notebooks and scripts: it writes
    nothing, and a `train_step(run)` on it is the step the run would take next."""
    return build(parse_args(['--resume', run_dir]))


def make_teacher(model, kind):
    """The teacher's weights: θ0 frozen, an EMA of θ, θ itself (live), or none. With LoRA, θ0 is the
    same model with the adapter off and the EMA teacher a second adapter: no copy of the model."""
    if kind in ('live', 'none'):
        return model if kind == 'live' else None
    if M.is_lora(model):
        return M.Adapter(model) if kind == 'frozen' else M.add_ema(model)
    return frozen_copy(model)


def frozen_copy(model):
    return copy.deepcopy(model).eval().requires_grad_(False)                    # θ0


def main(argv=None):
    args = parse_args(argv)
    args.name = args.name or f'{args.method}-{args.env}-s{args.seed}'
    parallel.init_distributed(args.device)
    if not args.resume and parallel.writer():
        bk.claim_run_dir(os.path.join(args.out_dir, args.name), args.overwrite)
    print(json.dumps(dataclasses.asdict(args)))
    random.seed(args.seed)
    np.random.seed(args.seed)
    with bk.Guard(args) as guard:
        run = guard.run = build(args)
        if args.export:
            return print(f'exported {M.export(run.model, run.tok, os.path.join(run.dir, "export"))}')
        guard.training = True
        spent = lambda: run.episodes - (run.setup_episodes if args.setup_free else 0)   # the budget's accounting
        bar = tqdm(total=args.episodes, initial=min(spent(), args.episodes), desc=f'{args.method} episodes',
                   dynamic_ncols=True, disable=not parallel.writer())
        while spent() < args.episodes and not guard.stop(run.device):                # the loop
            before = run.episodes
            with run.autocast():
                train_step(run)
            bar.update(run.episodes - before)
            if run.step % args.eval_every == 0 or spent() >= args.episodes:
                with run.autocast():
                    m = evaluate(run)
                bar.set_postfix(reward=f"{m['reward']:.3f}", success=f"{m['success']:.3f}", **{k: f'{v:.2f}' for k, v in run.state.items()
                                                                   if isinstance(v, float)})
                parallel.check_in_sync(run)
                bk.save_checkpoint(run)
                bk.plot(run)
        bar.close()
        if not guard.now and run.metrics[-1]['step'] != run.step:
            with run.autocast():
                evaluate(run)
        bk.save_checkpoint(run)
        bk.plot(run)
    parallel.finish()
    if guard.now:
        print(f'interrupted at step {run.step}; checkpoint saved; continue with --resume {run.dir}')
        sys.exit(130)
    print(bk.summarize(run))


if __name__ == '__main__':
    main()
