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
Before step 1, once (warmup.py): the warm-up (cached under runs/, shared by every method) and
LOPD's cold start (fill the bank, counted toward the episode budget; pre-train φ).

The math is lopd.py, the bank and the composer's reading retrieval.py, the model's scoring
model.py. The baselines (plugins/) take `train_step`, a generic step of the same shape:
rollout -> their teacher's context -> teacher phase -> student phase on their loss. Building a run,
checkpoints, caches, devices and the command line are plumbing/.
"""
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

import envs
import lopd
import model as M
import retrieval
import warmup
from plumbing import bookkeeping as bk
from plumbing import assemble, config, parallel
from plumbing.bookkeeping import arg
from plumbing.registry import DISTILL_FLAGS, METHODS, Batch, Method, Teacher, distill, embed_context, register, with_default

CODE = bk.CODE
RUN, MODEL = 'the run', 'the model and the warm-up'


@dataclass
class Args:
    """The run, the model and the warm-up. LOPD's own flags are LOPD_FLAGS below; a baseline's are in its block in plugins/."""
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
    model: str = arg('', "a transformers causal LM: hub name, folder, or .gguf file (its quantized weights are dequantized "
                     "to --dtype and LoRA trains on top of them); a chat model is told the task in its system turn "
                     "('' = the offline tiny Llama)", group=MODEL)
    lora_r: int = arg(-1, 'rank of the LoRA adapter that trains (0 = every weight trains; -1 = 16 with --model, '
                      '0 for the tiny model)', lo=-1, group=MODEL)
    score_chunk: int = arg(-1, 'positions per chunk through the LM head when scoring (0 = the whole batch at once; '
                           '-1 = 256 with --model, 0 for the tiny model)', lo=-1, group=MODEL)
    micro_batch: int = arg(-1, 'rows per forward, and per backward, in every scoring and training phase (teacher, student, '
                           'composer, warm-up, cold start), and decoded at once off CUDA (--decode_rows): memory grows with '
                           'it, not with --batch or --warmup_batch (0 = a phase\'s whole batch; the warm-up 16, the cold start '
                           '32 rows; -1 = 4 with --model, 0 for the tiny model)', lo=-1, group=MODEL)
    decode_rows: int = arg(-1, 'rows decoded at once in rollouts, evaluation and a bank\'s or pool\'s fill (the KV cache '
                           'grows with it; --micro_batch bounds the rest): -1 = on CUDA all that fit half the free memory, '
                           'elsewhere --micro_batch\'s (evaluation 128, a fill 64); 0 = a whole batch', lo=-1, group=MODEL)
    grad_ckpt: bool = arg(False, "gradient checkpointing: recompute the model's activations in the backward pass, layer by layer "
                          "(θ's, and the frozen teacher's where it holds φ's graph)",
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
    warmup_gate: float = arg(0.15, "after the cosine, more steps at 30%% of --warmup_lr while the base plays fewer than "
                             "this fraction more of 1,024 demos with a past experience's plan shown than without (a base "
                             "that does not read yet: its teacher would know nothing more; 0 = never, 1 = always)",
                             lo=0, hi=1, group=MODEL)
    warmup_tail: float = arg(0.5, "the most steps --warmup_gate adds, as a fraction of --warmup_steps", lo=0, group=MODEL)
    warmup_seed: int = arg(1234, "the base's draw: the tiny model's init and the warm-up's demos and their order", group=MODEL)
    warmup_ctx: float = arg(0.6, 'fraction of warm-up demos that teach the base to read a privileged context '
                            '(0 = the base that never saw one, an ablation)', lo=0, hi=1,
                            group=MODEL)


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



def logits_of(run, model, prefixes, ids, attn):
    """Steps 4-5's scoring: every prefix of the batch, behind each row's context (model.logits_on), the
    LM head in the run's --score_chunk positions and the body in its --micro_batch rows at a time."""
    return M.logits_on(model, prefixes, ids, attn, run.args.score_chunk, run.args.micro_batch)


# ----------------------------------------------------------------------------- LOPD (Algorithm 1)

def play(run, tasks):
    """Step 1 for a training batch: rollout at the run's sampling flags, --decode_rows at a time (under
    torchrun each rank plays its share, and every rank gets the whole batch)."""
    a = run.args
    return parallel.shared(run, lambda ts: rollout(run.model, run.tok, run.env, ts, temperature=a.temperature, top_k=a.top_k,
                                                   top_p=a.top_p, rows=parallel.decode_rows(run, a.micro_batch)), tasks)


def update(run, opt, loss, params):
    """One update of θ or φ, spelled out: zero_grad, backward, clip the gradient's norm to 1, step; a loss or a
    gradient that is not finite never reaches the weights (bk.skip, the NaN guard)."""
    opt.zero_grad(set_to_none=True)
    if not loss.requires_grad:                                                  # nothing depends on them (nothing retrieved)
        return
    if torch.isfinite(loss):
        loss.backward()
        if torch.isfinite(torch.nn.utils.clip_grad_norm_(params, 1.0)):
            run.skips_in_a_row = 0
            return opt.step()
    bk.skip(run, opt, loss)


def lopd_step(run):
    """One step of LOPD (Algorithm 1 of Zhang et al. 2026), top to bottom: eqs. (1)-(3) and the dual step as the
    README writes them, w = 2r − 1. Where it departs from the authors' code (bingreeky/LOPD), and why: the
    README's table of departures. Lines tagged (bookkeeping) time the phases; they are not the algorithm."""
    a, s, tok = run.args, run.state, run.tok
    tasks = run.rng.sample(run.env.train_tasks, a.batch)
    train_phi = not a.freeze_composer                                           # step 6 on (the ablation: off)
    # 1. rollout: the student π_θ samples one episode per task; A marks the tokens it generated
    eps, bodies, masks = play(run, tasks)
    ids, A, attn = M.pad_batch(bodies, masks, tok.pad, run.device)              # (B, T) each
    r = torch.tensor([e.reward for e in eps], device=run.device)                # (B,) graded, in [0, 1]
    run.episodes += len(eps)
    run.lap('rollout')                                                          # (bookkeeping)
    # 2. retrieve: the top-J successful past trajectories of similar tasks (never this task itself)
    found = retrieval.retrieve(run, tasks, other_family=a.retrieval == 'other')   # B lists of ≤ J experiences
    # 3. compose: φ maps the frozen base's reading of each experience to K latents z (φ0, the cold start's, to z0)
    z, z0 = retrieval.compose(run, tasks, found, grad=train_phi)                # (ΣN·K, d) each
    prefixes = retrieval.latent_prefixes(run, z, found)                         # B × <|bos|><|ctx|>past: z_1 \n … z_J \n
    has_z = torch.tensor([p is not None for p in prefixes], device=run.device)  # (B,) no latents: no teacher
    # 4. teacher phase: the frozen teacher π_θ0(·|z, x, y<t) scores every agent token in one forward, φ's graph kept
    teacher_scores = lambda: logits_of(run, run.teacher, with_default(run, prefixes), ids, attn)
    with torch.set_grad_enabled(train_phi and not M.is_lora(run.model)):       # (LoRA: step 6 scores again)
        logits_t = teacher_scores()                                             # (B, T, V)
    run.lap('teacher')                                                          # (bookkeeping)
    # 5. student phase, eq. (1): L_distill = mean_{t∈A} KL(π_θ(·|x, y<t) ‖ sg π_T(·|z, x, y<t)), one step of θ
    with M.train_mode(run.model):
        student_scores = lambda: logits_of(run, run.model, M.bos_prefix(run.model, tok, len(eps)), ids, attn)
        L_distill = lambda logits_s: lopd.distill_loss(logits_s, logits_t, A * has_z[:, None], a.divergence or 'rkl', a.topk)
        logits_s = student_scores()                                             # (B, T, V)
        loss_distill = L_distill(logits_s)
        update(run, run.opt, loss_distill, run.model.parameters())
        for _ in range(a.epochs - 1):                                           # --epochs: more steps toward the same π_T
            update(run, run.opt, L_distill(student_scores()), run.model.parameters())
    logits_s, logs = logits_s.detach(), {}                                      # θ's scores before its step, for step 6
    run.lap('student')                                                          # (bookkeeping)
    # 6. composer phase, eq. (3): one step of φ on KL(sg π_θ ‖ π_T^φ) + β(m − Δ) + λ‖z − sg z0‖², Δ the margin (2)
    if train_phi:
        logits_t = teacher_scores() if M.is_lora(run.model) else logits_t      # (LoRA: θ's step changed what it held)
        s_, t_, y, mask, w = logits_s[has_z], logits_t[has_z], ids[has_z], A[has_z], lopd.margin_weight(r[has_z], a.advantage)
        logp_t, logp_s = lopd.token_logp(t_, y, mask), lopd.token_logp(s_, y, mask)   # log π_T^φ(y_t), log π_θ(y_t)
        kl_term = a.kl_weight * lopd.composer_kl(s_, t_, mask)                  # KL(sg π_θ ‖ π_T^φ)
        margin_term = s['beta'] * (a.margin - lopd.privileged_margin(logp_t, logp_s, mask, w))   # β(m − Δ)
        anchor_term = a.lam * (dist := lopd.anchor(z, z0, relative=a.anchor == 'relative'))   # λ‖z − sg z0‖²
        delta = lopd.privileged_margin(logp_t.detach(), logp_s, mask, w, by_tokens=True)   # Δ for β, weighted by tokens
        bk.set_lr(s['opt_phi'], lr_phi(run))                                    # (bookkeeping) --lr_composer after a setup
        update(run, s['opt_phi'], kl_term + margin_term + anchor_term, retrieval.phi_params(s['composer'], s['reader']))
        s['beta'] = lopd.dual_update(s['beta'], a.margin, delta, a.eta_beta)    # β ← max(0, β + η_β(m − Δ))
        logs = dict(delta=float(delta), anchor=float(dist), drift=float(lopd.drift(z, z0)))
        run.lap('composer')                                                     # (bookkeeping)
    # 7. write back: the successful rollouts join the bank
    retrieval.write_back(run, eps)
    run.record(loss=loss_distill.item(), reward=float(np.mean([e.reward for e in eps])), entropy=lopd.mean_entropy(logits_s, A).item(),
               family_hit=retrieval.family_hit(run, eps, found), **logs)
    run.step += 1


def lopd_state(run):
    """φ (the composer, and with --reader trained the reader too), its cold-start copy φ0 (for the
    anchor), φ's optimizer, the multiplier β, the bank."""
    emb = run.model.get_input_embeddings().weight
    composer = lopd.COMPOSERS[run.args.composer](emb.shape[1], run.args.K, scale=emb.std().item()).to(run.device)
    # the paper's code trains a LoRA on the encoder that reads the experiences; our reader is a
    # trainable copy of θ0 (the tiny model is small enough to copy whole)
    reader = copy.deepcopy(run.model).train().requires_grad_(True) if run.args.reader == 'trained' else None
    frozen = lambda m: copy.deepcopy(m).requires_grad_(False) if m is not None else None
    return {'bank': retrieval.new_bank(run), 'composer': composer, 'composer0': frozen(composer), 'reader': reader,
            'reader0': frozen(reader), 'opt_phi': torch.optim.AdamW(retrieval.phi_params(composer, reader), lr=lr_phi(run),
                                                                  weight_decay=0.0), 'beta': 0.0}


def lr_phi(run):
    return run.args.lr_composer or run.args.lr or run.method.lr


def lopd_context(run, eps):
    """Steps 2-3 for evaluation and the reports: the teacher's latent context for each episode's task."""
    found = retrieval.retrieve(run, [e.task for e in eps], other_family=run.args.retrieval == 'other')
    return retrieval.latents(run, eps, grad=False, found=found)


FROZEN = 'freeze_composer'  # the flags of step 6 act only without it
LOPD_FLAGS = {**DISTILL_FLAGS, **retrieval.BANK_FLAGS,
    'K': arg(64, 'latent tokens per retrieved experience (64: more than a tool-use experience has tokens; the paper: 32)',
             lo=1),
    'composer': arg('qformer-copy', "φ: mlp = an MLP on the means of K segments of the reader's states; qformer = K learned "
                    "queries attending over them (the paper's); qformer-copy = the same, query k starting on the experience's "
                    "k-th token (its latents start as the experience's embeddings)", choices=list(lopd.COMPOSERS)),
    'margin': arg(0.05, 'privileged margin m (0 = ablation)', lo=0, after_setup=True, unless=FROZEN),
    'lam': arg(0.2, 'anchor weight λ on ‖z − z0‖²', lo=0, after_setup=True, unless=FROZEN),
    'anchor': arg('absolute', "‖z − z0‖² as the paper's (absolute), or relative to ‖z0‖²", choices=['absolute', 'relative'],
                  after_setup=True, unless=FROZEN),
    'eta_beta': arg(0.5, 'dual step size η_β for the margin multiplier β', lo=0, after_setup=True, unless=FROZEN),
    'lr_composer': arg(1e-5, "composer-phase learning rate (the paper's lr_φ; 0 = the student's, "
                       "measured worse on one base)", lo=0, after_setup=True,
                       unless=FROZEN),
    'lr_cold_start': arg(0.0, "cold-start learning rate (0 = the student's)", lo=0),
    'cold_start_steps': arg(150, 'composer pre-training steps (the paper: 1,000; 0: the copy-started composer, '
                            'whose latents start as the experience\'s embeddings)', lo=0),
    'cold_start': arg('nll', "cold start objective: nll = the paper's, the teacher's NLL of the bank's successes "
                      "given their latents; text = the teacher reading the latents matches it reading the same "
                      "experiences as text", choices=list(warmup.COLD_STARTS)),
    'cold_start_sample': arg('balanced', "cold start: draw the bank's rollouts family-balanced, or as stored",
                             choices=['balanced', 'stored']),
    'reader': arg('frozen', 'who reads the experiences for the composer: the frozen base, or a trainable copy',
                  choices=['frozen', 'trained']),
    'advantage': arg('paper', "the margin's A(τ): paper = 2r − 1, centered = r − mean r over the batch, successes = "
                     "max(0, 2r − 1) (a departure: a margin on successes only)", choices=['paper', 'centered', 'successes'],
                     after_setup=True, unless=FROZEN),
    'kl_weight': arg(1.0, "weight of eq. (3)'s KL term (1 = the paper's; 0 = a diagnostic: is it the KL or the drift "
                     "that costs a fast-moving φ its points?)", lo=0, after_setup=True, unless=FROZEN),
    'freeze_composer': arg(False, "the paper's frozen-composer ablation: skip step 6, so φ stays at its cold start "
                           "(no margin, no β)", after_setup=True)
}

register('lopd', Method(
    distill, context=lopd_context, teacher='frozen', group=1, lr=3e-4,  # 1e-3's first Adam step costs the student 25 points
    state=lopd_state, setup=warmup.cold_start, step=lopd_step, flags=LOPD_FLAGS,
    bench={'lopd': dict(knob=['--cold_start_steps', '300'], cost=350, quick=True),
           'lopd-frozen': dict(flags=['--freeze_composer'], cost=280, quick=True),
           'lopd-m0': dict(flags=['--margin', '0'], cost=350, quick=True),
           # the ablation grid (one alternative per knob: the margin sweep is m = 0, 0.05, 0.2) and the control
           'lopd-m0.2': dict(flags=['--margin', '0.2'], cost=350),
           'lopd-centered': dict(flags=['--advantage', 'centered'], cost=350),
           'lopd-k16': dict(flags=['--K', '16'], cost=280),
           'lopd-j3': dict(flags=['--J', '3'], cost=300),
           'lopd-textcs': dict(flags=['--cold_start', 'text'], cost=300),
           'lopd-self': dict(flags=['--allow_same_task'], cost=280),
           'lopd-offline': dict(flags=['--setup_free'], cost=300),
           'lopd-other': dict(flags=['--retrieval', 'other'], cost=280)}), first=True)


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
        return Teacher(logits_of(run, run.teacher, with_default(run, ctx), b.ids, b.attn), keep, ctx)


def student_phase(run, b, teacher):
    """Step 5: one step of θ on the method's loss (--epochs steps for a distillation method, on the
    same rollouts and teacher scores); the student scores every prefix in one forward.
    -> the student's logits before the first step (detached, for an after-step hook) and its loss."""
    score = lambda: logits_of(run, run.model, M.bos_prefix(run.model, run.tok, b.ids.shape[0]), b.ids, b.attn)
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
    """One step of a registered method (every one but LOPD, whose step is lopd_step) on a fresh batch:
    rollout (or the method's own sampler) -> teacher_phase -> student_phase -> the method's after-step hook."""
    a, m = run.args, run.method
    tasks = [t for t in run.rng.sample(run.env.train_tasks, a.batch // m.group) for _ in range(m.group)]
    with run.timer('rollout'):  # under torchrun each rank rolls out its share, and every rank gets the whole batch
        play = functools.partial(rollout, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                                 rows=parallel.decode_rows(run, a.micro_batch))
        eps, bodies, masks = parallel.shared(run, lambda ts: m.sample(run, ts, play) if m.sample else
                                             play(run.model, run.tok, run.env, ts), tasks)
        b = Batch(eps, *M.pad_batch(bodies, masks, run.tok.pad, run.device), torch.tensor([e.reward for e in eps], device=run.device))
    run.episodes += len(eps)
    with run.timer('teacher'):
        teacher = teacher_phase(run, b)
    with run.timer('student'), M.train_mode(run.model):
        logits_s, loss = student_phase(run, b, teacher)
    with torch.no_grad():  # what success hides: does the student's entropy collapse?
        entropy = lopd.mean_entropy(logits_s, b.amask).item()
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
    rows = parallel.decode_rows(run, a.micro_batch or 128)                      # decoded at once: the KV cache's rows
    play = lambda ts, **kw: parallel.shared(run, lambda ts: rollout(run.model, run.tok, run.env, ts, rows=rows, **kw)[0], ts)
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
            prefixes = with_default(run, embed_context(run, run.method.context(run, [run.env.reset(t) for t in tasks])))
            teps = parallel.shared(run, lambda ix: rollout(run.teacher, run.tok, run.env, [tasks[i] for i in ix], greedy=True,
                                                           prefixes=[prefixes[i] for i in ix], rows=rows)[0], list(range(len(tasks))))
            out['teacher_reward'] = float(np.mean([e.reward for e in teps]))
            out['task_teacher_reward'] = [round(e.reward, 4) for e in teps]
            out['teacher_success'] = float(np.mean([e.success for e in teps]))
    return bk.log_eval(run, out)


EVAL_TEMPERATURE = 0.7  # the paper's evaluation temperature



# ----------------------------------------------------------------------------- main

def build(args):
    """The run: model, warm-up, teacher, optimizer, the method's state (plumbing/assemble.py); resumed, or
    set up and evaluated at the base (the first checkpoint)."""
    return assemble.build(args, rollout, evaluate)


def load_run(run_dir):
    """A run folder -> the live run at its last checkpoint, as `--resume` rebuilds it: model,
    teacher, optimizer, the method's state, every RNG. For notebooks and scripts: it writes
    nothing, and a `train_step(run)` on it is the step the run would take next."""
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
                run.lap()                                                          # a step's phases are timed from here
                (run.method.step or train_step)(run)                               # lopd_step for LOPD
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

if __name__ == '__main__':
    main()
