"""Train a small agent with on-policy self-distillation: LOPD, and the baselines it is compared against.

LOPD's training step is `lopd_step` below: Algorithm 1 of Zhang et al. 2026 (arXiv 2608.13040),
seven numbered blocks, one rollout per task (G = 1):
  1. rollout         the student samples one multi-turn episode per task (KV cache)
  2. retrieve        top-J successful past trajectories of similar tasks from the bank
  3. compose         the frozen base reads each; the composer φ maps it to K latent tokens z
  4. teacher phase   the frozen teacher π_θ0(·|z, x, y<t) scores every agent token
  5. student phase   one step of θ on eq. (1), L_distill = mean_{t∈A} KL(π_θ ‖ sg π_T)
  6. composer phase  one step of φ on eq. (3) with the margin (2); β ← max(0, β + η_β(m − Δ))
  7. write back      new successful rollouts go into the bank
Before step 1, once: the base (warmup.py: the shipped one, base/tooluse/, or one built here) and LOPD's
cold start (retrieval.py: fill the bank, counted toward the episode budget; pre-train φ).

The math is lopd.py, the bank, the composer's reading and the cold start retrieval.py, the model's scoring
model.py. The baselines (plugins/) take `train_step`, a generic step of the same shape:
rollout -> their teacher's context -> teacher phase -> student phase on their loss. A step returns the
episodes it played; the loop (`take_step`, `main`) counts them and the steps. Building a run, checkpoints,
caches, devices and the command line are plumbing/.
"""
import copy
import dataclasses
import functools
import json
import os
import random
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

import envs
import lopd
import model as M
import retrieval
from plumbing import bookkeeping as bk
from plumbing import assemble, config, evaluation, parallel
from plumbing.bookkeeping import arg
from plumbing.registry import METHODS, Batch, Method, Teacher, distill, embed_context, register, with_default

CODE = bk.CODE
RUN = config.RUN


@dataclass
class Args(config.ModelArgs):
    """The run; the model's and the warm-up's flags are config.ModelArgs', LOPD's own retrieval.LOPD_FLAGS, a
    baseline's in its block in plugins/."""
    plugin: str = arg('', "a fork's own .py file (comma-separated: several), imported before the flags are read, so that "
                      "the methods it registers run here and in the bench; saved, so --resume imports it again", after_setup=True,
                      group=RUN)
    method: str = arg('lopd', 'the method: lopd (lopd_step below), or a baseline or variant (plugins/)', choices=lambda: list(METHODS),
                      group=RUN)
    env: str = arg('tooluse', 'environment', choices=lambda: list(envs.ENVS), group=RUN)
    seed: int = arg(0, 'seed of this run (task order, sampling, init of φ)', group=RUN)
    episodes: int = arg(3072, 'rollout budget: episodes sampled in total (a bank\'s filling included, unless --setup_free)',
                        lo=0, open_lo=True, after_setup=True, group=RUN)
    setup_free: bool = arg(False, "the paper's accounting: the episodes a method's setup samples (LOPD's bank, the pool, "
                           "ACSD's first vector) do not count toward --episodes", after_setup=True, group=RUN)
    batch: int = arg(16, "episodes per training step (tasks × the method's group size)", lo=1, group=RUN)
    temperature: float = arg(1.0, 'sampling temperature of the training rollouts (the paper samples at 0.7)', lo=0,
                             open_lo=True, after_setup=True, group=RUN)
    top_k: int = arg(0, "sample the training rollouts from the top k tokens only (0 = all; the authors' code: 20)", lo=0,
                     after_setup=True, group=RUN)
    top_p: float = arg(1.0, "... and from the top-p nucleus (1 = all; the authors' code: 0.95); a bank's or pool's "
                       "fill samples at temperature 1 from every token", lo=0, hi=1, open_lo=True, after_setup=True, group=RUN)
    lr: float = arg(0.0, 'student learning rate (0 = the method default)', lo=0, group=RUN)
    eval_every: int = arg(64, 'steps between held-out evaluations', lo=1, after_setup=True, group=RUN)
    eval_tasks: int = arg(500, 'held-out tasks per evaluation (the first N of the fixed set)', lo=1, after_setup=True, group=RUN)
    eval_samples: int = arg(1, 'samples per held-out task at temperature 0.7, besides the greedy one (0 = greedy only)', lo=0,
                            after_setup=True, group=RUN)
    teacher_eval: int = arg(100, 'held-out tasks on which the teacher decodes with its context (0 = off)', lo=0, after_setup=True,
                            group=RUN)
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


def config_class():
    """Args plus every registered method's own flags: the one config a run saves."""
    return config.config_class(Args)


def parse_args(argv=None):
    """--flags -> the config (the saved one, when resuming); -h shows the flags in groups."""
    return config.parse_args(Args, argv, description=__doc__.split('\n')[0])


# ----------------------------------------------------------------------------- rollout (step 1)

@torch.no_grad()
def rollout(model, tok, env, tasks, greedy=False, prefixes=None, temperature=1.0, rows=0, top_k=0, top_p=1.0):
    """Step 1. Play one episode per task, all rows in one batch (rows > 0, --micro_batch: `rows` at a
    time), turn by turn.

    One KV cache for the whole episode: a turn reads only the env's observation (and the
    <|eot|> that closes a cut turn), not the system prompt and the earlier turns again.
    -> episodes, bodies (token lists without <|bos|>), agent masks (1 = agent-generated)."""
    prefixes = prefixes or M.bos_prefix(model, tok, len(tasks))
    if 0 < rows < len(tasks):
        parts = [rollout(model, tok, env, tasks[i:i + rows], greedy, prefixes[i:i + rows], temperature, top_k=top_k, top_p=top_p)
                 for i in range(0, len(tasks), rows)]
        return tuple([x for part in parts for x in part[k]] for k in range(3))
    eps = [env.reset(t) for t in tasks]
    bodies = [M.obs_ids(tok, t.prompt, first=True) for t in tasks]
    masks = [[0] * len(b) for b in bodies]
    turns = M.Turns()                                                           # the KV cache across turns
    for _ in range(env.max_turns):
        live = [i for i, e in enumerate(eps) if not e.done]
        if not live:
            break
        outs = M.generate(model, tok, [prefixes[i] for i in live], [bodies[i] for i in live],
                          env.max_action_tokens, greedy, temperature, turns=turns, rows=live, top_k=top_k, top_p=top_p)
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


def teacher_logits(run, prefixes, b):
    """Step 4's scoring: the teacher reads each rollout behind its context (None: the bare <|bos|>) -> (B, T, V);
    with the graph of whatever the contexts carry (LOPD's latents: φ's) where grad is on. The LM head runs in
    --score_chunk positions and the body in --micro_batch rows at a time (model.logits_on)."""
    return M.logits_on(run.teacher, with_default(run, prefixes), b.ids, b.attn, run.args.score_chunk, run.args.micro_batch)


def student_logits(run, b):
    """Step 5's scoring: the student π_θ(·|x, y<t) at every position of every rollout, no context -> (B, T, V)."""
    return M.logits_on(run.model, M.bos_prefix(run.model, run.tok, b.ids.shape[0]), b.ids, b.attn, run.args.score_chunk,
                       run.args.micro_batch)


# ----------------------------------------------------------------------------- LOPD (Algorithm 1)

def sample_batch(run, tasks):
    """Step 1 for a training batch: the method's sampler (Method.sample), or θ's rollout at the run's sampling
    flags, --decode_rows at a time; under torchrun each rank plays its share, and every rank gets the whole batch."""
    a = run.args
    roll = functools.partial(rollout, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                             rows=parallel.decode_rows(run, a.micro_batch))
    sample = run.method.sample or (lambda run, ts, roll: roll(run.model, run.tok, run.env, ts))
    with M.lora_merged(run.model, a.merge_lora):                                # --merge_lora: fewer ops a token
        eps, bodies, masks = parallel.shared(run, lambda ts: sample(run, ts, roll), tasks)
    reward = torch.tensor([e.reward for e in eps], device=run.device)          # (B,) graded, in [0, 1]
    return Batch(eps, *M.pad_batch(bodies, masks, run.tok.pad, run.device), reward)


def lopd_step(run):
    """One step of LOPD (Algorithm 1 of Zhang et al. 2026), top to bottom: eqs. (1)-(3) and the dual step as
    the README writes them, w = 2r − 1. -> the episodes it played (the loop counts them, and the step). Where
    it departs from the authors' code (bingreeky/LOPD), and why: the README's table. run.lap times a phase."""
    a, s = run.args, run.state
    tasks = run.rng.sample(run.env.train_tasks, a.batch)
    train_phi = not a.freeze_composer                               # step 6 on (the ablation: off)
    # 1. rollout: the student π_θ samples one episode per task; A marks the tokens it generated
    b = sample_batch(run, tasks)                                    # b.ids, b.amask = A (B, T); b.reward (B,)
    run.lap('rollout')
    # 2. retrieve: the top-J successful past trajectories of similar tasks (never this task itself)
    found = retrieval.retrieve(run, tasks, other_family=a.retrieval == 'other')  # B lists of ≤ J
    # 3. compose: φ maps the frozen base's reading of each experience to K latents z (φ0's: z0)
    z, z0 = retrieval.compose(run, tasks, found, grad=train_phi)    # (ΣN·K, d) each
    prefixes = retrieval.latent_prefixes(run, z, found)             # B × <|bos|><|ctx|>past: z_1 \n … z_J \n
    has_z = torch.tensor([p is not None for p in prefixes], device=run.device)  # no latents: no teacher
    # 4. teacher phase: the frozen teacher π_θ0(·|z, x, y<t) scores every agent token in one forward
    with torch.no_grad():                                           # eq. (1)'s sg: step 5 needs no graph
        logits_t = teacher_logits(run, prefixes, b)                 # (B, T, V)
    run.lap('teacher')
    # 5. student phase, eq. (1): L_distill = mean_{t∈A} KL(π_θ(·|x, y<t) ‖ sg π_T(·|z, x, y<t)), a step of θ
    A, D = b.amask * has_z[:, None], a.divergence or run.method.divergence   # D: reverse KL by default
    with M.train_mode(run.model):
        logits_s = student_logits(run, b)                           # (B, T, V)
        loss_distill = lopd.distill_loss(logits_s, logits_t, A, D, a.topk)
        bk.optimizer_step(run, run.opt, loss_distill, run.model)
        for _ in range(a.epochs - 1):                               # --epochs: more steps toward one π_T
            loss = lopd.distill_loss(student_logits(run, b), logits_t, A, D, a.topk)
            bk.optimizer_step(run, run.opt, loss, run.model)
    logits_s, logs = logits_s.detach(), {}                          # π_θ before its step, for step 6
    run.lap('student')
    # 6. composer phase, eq. (3): a step of φ on KL(sg π_θ ‖ π_T^φ) + β(m − Δ) + λ‖z − sg z0‖², Δ eq. (2)
    if train_phi:
        t_, s_ = teacher_logits(run, prefixes, b)[has_z], logits_s[has_z]   # π_T^φ again, with φ's graph
        y, mask, w = b.ids[has_z], b.amask[has_z], lopd.margin_weight(b.reward[has_z], a.advantage)
        logp_t, logp_s = lopd.token_logp(t_, y, mask), lopd.token_logp(s_, y, mask)  # log π_T^φ, log π_θ
        kl_term = a.kl_weight * lopd.composer_kl(s_, t_, mask)      # KL(sg π_θ ‖ π_T^φ)
        margin_term = s['beta'] * (a.margin - lopd.privileged_margin(logp_t, logp_s, mask, w))  # β(m − Δ)
        dist = lopd.anchor(z, z0, relative=a.anchor == 'relative')  # ‖z − sg z0‖²
        anchor_term = a.lam * dist
        loss_phi = kl_term + margin_term + anchor_term + retrieval.replay_loss(run)  # --replay: a departure
        bk.optimizer_step(run, s['opt_phi'], loss_phi, retrieval.phi(run))
        delta = lopd.privileged_margin(logp_t.detach(), logp_s, mask, w, by_tokens=True)  # Δ, by tokens
        s['beta'] = lopd.dual_update(s['beta'], a.margin, delta, a.eta_beta)   # β ← max(0, β + η_β(m − Δ))
        logs = dict(delta=delta.item(), anchor=dist.item(), drift=lopd.drift(z, z0).item())
        run.lap('composer')
    # 7. write back: the successful rollouts join the bank
    retrieval.write_back(run, b.eps)
    entropy = lopd.mean_entropy(logits_s, b.amask).item()
    run.record(loss=loss_distill.item(), reward=b.reward.mean().item(), entropy=entropy,
               family_hit=retrieval.family_hit(run, b.eps, found), **logs)
    return b.eps


def lopd_state(run):
    """φ (the composer, and with --reader trained the reader too), its cold-start copy φ0 (for the
    anchor), φ's optimizer at lr_φ, the multiplier β, the bank."""
    emb = run.model.get_input_embeddings().weight
    composer = lopd.COMPOSERS[run.args.composer](emb.shape[1], run.args.K, scale=emb.std().item()).to(run.device)
    # the paper's code trains a LoRA on the encoder that reads the experiences; our reader is a trainable copy of θ0
    # (the tiny model is small enough to copy whole), in float32: a bf16 --model's copy would have no master weights
    reader = copy.deepcopy(run.model).float().train().requires_grad_(True) if run.args.reader == 'trained' else None
    frozen = lambda m: copy.deepcopy(m).requires_grad_(False) if m is not None else None
    lr_phi = run.args.lr_composer or run.args.lr or run.method.lr
    return {'bank': retrieval.new_bank(run), 'composer': composer, 'composer0': frozen(composer), 'reader': reader,
            'reader0': frozen(reader), 'wins': [], 'opt_phi': torch.optim.AdamW(retrieval.phi_params(composer, reader), lr=lr_phi,
                                                                  weight_decay=0.0), 'beta': 0.0}


def lopd_context(run, eps):
    """Steps 2-3 for evaluation and the reports: the teacher's latent context for each episode's task."""
    found = retrieval.retrieve(run, [e.task for e in eps], other_family=run.args.retrieval == 'other')
    return retrieval.latents(run, eps, grad=False, found=found)


register('lopd', Method(
    distill, context=lopd_context, teacher='frozen', group=1, lr=3e-4,  # 1e-3's first Adam step costs the student 25 points
    state=lopd_state, setup=retrieval.cold_start, step=lopd_step, flags=retrieval.LOPD_FLAGS), first=True)  # its bench entries: bench/entries.py


# ----------------------------------------------------------------------------- the baselines' step

def teacher_phase(run, b):
    """Step 4: the teacher scores every agent token of every rollout, given its privileged context
    (the method's context builder; LOPD's is steps 2-3). A frozen or EMA teacher has no graph of its
    own, so only a context that carries one (LOPD's latents) is differentiable; a live teacher is θ
    itself and runs without gradients. -> Teacher, or None for a method without a teacher."""
    if run.method.context is None:  # a method without a teacher
        return None
    with torch.set_grad_enabled(run.teacher is not run.model):
        ctx = embed_context(run, run.method.context(run, b.eps))
    keep = torch.tensor([p is not None for p in ctx], device=run.device)        # (B,) no context: no teacher
    with torch.set_grad_enabled(any(p is not None and p.requires_grad for p in ctx)):   # else no graph to keep
        return Teacher(teacher_logits(run, ctx, b), keep, ctx)


def student_phase(run, b, teacher):
    """Step 5: one step of θ on the method's loss (--epochs steps for a distillation method, on the
    same rollouts and teacher scores); the student scores every prefix in one forward.
    -> the student's logits before the first step (detached, for an after-step hook) and its loss."""
    logits_s = student_logits(run, b)                                           # (B, T, V)
    loss = run.method.loss(run, b, logits_s, teacher)
    logits_s = logits_s.detach()                                                # before the step: θ's head as it scored
    bk.optimizer_step(run, run.opt, loss, run.model)
    for _ in range(run.args.epochs - 1):
        bk.optimizer_step(run, run.opt, run.method.loss(run, b, student_logits(run, b), teacher), run.model)
    if run.teacher_kind == 'ema':
        lopd.ema_update(run.teacher, M.trained(run.model), run.args.ema_rate or run.method.ema_rate)
    return logits_s, loss.item()


def train_step(run):
    """One step of a registered method (every one but LOPD, whose step is lopd_step) on a fresh batch:
    sample_batch (θ's rollout, or the method's sampler) -> teacher_phase -> student_phase -> the method's
    after-step hook. -> the episodes it played."""
    a, m = run.args, run.method
    tasks = [t for t in run.rng.sample(run.env.train_tasks, a.batch // m.group) for _ in range(m.group)]
    b = sample_batch(run, tasks)
    run.lap('rollout')
    teacher = teacher_phase(run, b)
    run.lap('teacher')
    with M.train_mode(run.model):
        logits_s, loss = student_phase(run, b, teacher)
    run.lap('student')
    with torch.no_grad():  # what success hides: does the student's entropy collapse?
        entropy = lopd.mean_entropy(logits_s, b.amask).item()
    run.record(loss=loss, reward=b.reward.mean().item(), entropy=entropy, **m.after_step(run, b, logits_s, teacher))
    return b.eps


def take_step(run):
    """One training step as the loop takes it: the method's step (lopd_step for LOPD, else train_step) returns the
    episodes it played; the loop, not the step, counts them and the step (a step need not touch a counter)."""
    run.lap()                                                                   # a step's phases are timed from here
    eps = (run.method.step or train_step)(run)
    if eps is None:
        bk.die(f'the step of {run.args.method} returned None: a step returns the episodes it played')
    run.episodes += len(eps)
    run.step += 1


def evaluate(run):
    """Held-out reward and success, greedy and sampled, per family and per task; the teacher's own with its
    context beside its student's on the same tasks (plumbing/evaluation.py)."""
    return evaluation.evaluate(run, rollout)


# ----------------------------------------------------------------------------- main

def build(args):
    """The run: model, warm-up, teacher, optimizer, the method's state (plumbing/assemble.py); resumed, or
    set up and evaluated at the base (the first checkpoint)."""
    return assemble.build(args, rollout, evaluate)


def load_run(run_dir):
    """A run folder -> the live run at its last checkpoint, as `--resume` rebuilds it: model,
    teacher, optimizer, the method's state, every RNG. For notebooks and scripts: it writes
    nothing, and a `take_step(run)` on it is the step the run would take next."""
    return build(parse_args(['--resume', run_dir]))


def main(argv=None):
    args = parse_args(argv)
    config.check_budget(args)
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
                take_step(run)                                                     # lopd_step for LOPD
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


# ----------------------------------------------------------------------------- the plugins
# The other methods and environments register themselves when imported: this list is the one place
# they are named. A forker's file imports train, registers its own, and calls train.main().
import plugins.baselines  # noqa: E402,F401  GRPO, OPSD, SDPO, SDFT, Skill-SD; Traj-text, LOPD's ablation
import plugins.variants  # noqa: E402,F401  PSP, SOD, ACSD, VASPO
import plugins.tooluse_v1  # noqa: E402,F401  --env tooluse-v1
import plugins.codegen  # noqa: E402,F401  --env codegen



# ----------------------------------------------------------------------------- names that moved (CHANGELOG.md)

def play(run, tasks):
    """Moved: sample_batch(run, tasks), which returns a Batch. -> (episodes, bodies, agent masks), as before."""
    warnings.warn('train.play moved to train.sample_batch (it returns a Batch)', DeprecationWarning, stacklevel=2)
    a = run.args
    return parallel.shared(run, lambda ts: rollout(run.model, run.tok, run.env, ts, temperature=a.temperature, top_k=a.top_k,
                                                   top_p=a.top_p, rows=parallel.decode_rows(run, a.micro_batch)), tasks)


def update(run, opt, loss, params):
    """Moved: bookkeeping.optimizer_step(run, opt, loss, params), the one update of θ and φ."""
    warnings.warn('train.update moved to plumbing.bookkeeping.optimizer_step', DeprecationWarning, stacklevel=2)
    return bk.optimizer_step(run, opt, loss, list(params))


def logits_of(run, model, prefixes, ids, attn):
    """Moved: teacher_logits(run, prefixes, b) and student_logits(run, b)."""
    warnings.warn('train.logits_of moved to train.teacher_logits / train.student_logits', DeprecationWarning, stacklevel=2)
    return M.logits_on(model, prefixes, ids, attn, run.args.score_chunk, run.args.micro_batch)


if __name__ == '__main__':
    sys.modules.setdefault('train', sys.modules['__main__'])  # a --plugin's `import train` is this module, not a second one
    main()
