"""LOPD (Zhang et al. 2026, arXiv 2608.13040; bingreeky/LOPD) as one method, in the paper's step order.

One step: retrieve -> compose -> teacher phase -> student phase -> composer phase -> write back.
Steps 2-3 (retrieve, compose) make the teacher's context (lopd_context); 4-5 are
train.teacher_phase and train.student_phase on it, as for every method; 6-7 (the composer phase,
the write-back) are the after-step hook. Step 6 runs with --composer_phase only: in this
miniature it lowers the teacher, and φ is best left at its cold start (the README's results).
Before training, once: the cold start (fill the bank, pre-train the composer φ). The math (the
composer, the margin, the losses) is in lopd.py. Traj-text, the ablation that shows the same
retrieved experiences as text, is at the end. methods.py imports this file (import methods, not
this file, first: LOPD is then registered first, and listed first in -h).
"""
import copy
import random

import torch
from tqdm import tqdm

import envs
import lopd
import model as M
import retrieval
from bookkeeping import arg, optimizer_step
from methods import (DISTILL_FLAGS, TEACHER_FLAGS, Method, Prefixes, bank_text, distill, experience_line,
                     register, with_default)

BANK_FLAGS = {  # an experience bank, filled with base rollouts before training, written back as we go
    'J': arg(1, 'experiences retrieved per task (the paper: 3; here one same-family success teaches most)', lo=1),
    'bank_capacity': arg(4000, 'experience bank size (FIFO)', lo=1),
    'allow_same_task': arg(False, 'let retrieval return this very task instance (the paper allows it)'),
    'retrieval': arg('similar', "what the teacher is shown during training: similar = the top-J experiences of similar "
                     "tasks (the method); other = of other families only (a control: OP²SD's shuffled donor)",
                     choices=['similar', 'other'], after_setup=True),
    'init_episodes': arg(512, 'base rollouts that fill the bank before training (they count toward --episodes)', lo=0),
    'embedder': arg('', "the retriever's embedder ('' = the environment's: char n-grams for tool use, the tests of "
                    "each example's input->output relation for code generation)", choices=['', *retrieval.EMBEDDERS]),
    'rerank': arg('', "re-sort the embedder's top 32 ('' = the environment's: none for tool use; for code generation, "
                  "by how many of the task's examples each stored program reproduces)", choices=['', *retrieval.RERANKERS]),
    'bank_source': arg('pool', "what fills the bank before training: the base's rollouts; pool = the shared pool OPSD "
                       "is shown (the base's successes, the scripted expert's demo of each task it failed: the paper's "
                       "'stronger models where coverage is lacking'); expert = the expert's demos only",
                       choices=['rollouts', 'pool', 'expert']),
}

READING_FRAME = 'task to solve: {task}\nreference past trajectory: '  # how the composer's reader sees one experience


def lopd_state(run):
    """φ (the composer, and with --reader trained the reader too), its cold-start copy φ0 (for the
    anchor), φ's optimizer, the multiplier β, the bank."""
    emb = run.model.get_input_embeddings().weight
    composer = lopd.COMPOSERS[run.args.composer](emb.shape[1], run.args.K, scale=emb.std().item()).to(run.device)
    # the paper's code trains a LoRA on the encoder that reads the experiences; our reader is a
    # trainable copy of θ0 (the tiny model is small enough to copy whole)
    reader = copy.deepcopy(run.model).train().requires_grad_(True) if run.args.reader == 'trained' else None
    frozen = lambda m: copy.deepcopy(m).requires_grad_(False) if m is not None else None
    return {'bank': new_bank(run), 'composer': composer, 'composer0': frozen(composer), 'reader': reader,
            'reader0': frozen(reader), 'opt_phi': torch.optim.AdamW(phi_params(composer, reader), lr=lr_phi(run),
                                                                  weight_decay=0.0), 'beta': 0.0}


def phi_params(composer, reader):
    """φ: the composer's parameters, and the reader's when it trains."""
    return list(composer.parameters()) + (list(reader.parameters()) if reader is not None else [])


def lr_phi(run):
    return run.args.lr_composer or run.args.lr or run.method.lr


def retrieve(run, tasks, other_family=False):
    """Step 2: top-J successful experiences of similar tasks (never this task, by default).
    other_family=True: only experiences of other families (the teacher-gap report's control)."""
    return run.state['bank'].retrieve([t.prompt for t in tasks], [t.task_id for t in tasks], run.args.J,
                                      exclude_families=[t.family for t in tasks] if other_family else None)


def compose(run, tasks, found, grad, read0=None):
    """Step 3: the reader (the frozen base, or with --reader trained its trainable copy) reads
    'task to solve: x / reference past trajectory: m_j'; the composer maps its hidden states to K
    latents per experience. read0: the frozen reading of these experiences, already pooled
    (reading(); the cold start reuses it). -> z with φ's graph if grad, z0 from φ0 (ΣN·K, d)."""
    d = run.teacher.get_input_embeddings().weight.shape[1]
    if not any(found):
        empty = torch.zeros(0, d, device=run.device)
        return empty, empty
    s = run.state
    with torch.no_grad():
        read0 = reading(run, tasks, found, s['reader0'] or run.teacher) if read0 is None else read0  # composer.read's
        z0 = s['composer0'].from_reading(read0)                                 # (N, K, d) the anchor's target
    with torch.set_grad_enabled(torch.is_grad_enabled() and grad):
        read = reading(run, tasks, found, s['reader']) if s['reader'] is not None else read0
        z = s['composer'].from_reading(read)                                    # (N, K, d)
    return z.reshape(-1, d), z0.reshape(-1, d)


def reading(run, tasks, found, reader):
    """The reader's hidden states over each retrieved experience, pooled into K segments. We pool
    over the experience's own tokens only (read in the light of the task): pooled over the framing
    too, the first segments would describe the framing, not the plan. -> what composer.read keeps of
    it (the MLP: (N, K, d)), N = Σ_i |found_i|."""
    heads = [run.tok.encode(READING_FRAME.format(task=t.prompt)) for t, f in zip(tasks, found) for _ in f]
    bodies = [experience_tokens(run, m) for f in found for m in f]
    ids, pool, attn = M.pad_batch([h + b for h, b in zip(heads, bodies)],
                                  [[0] * len(h) + [1] * len(b) for h, b in zip(heads, bodies)], run.tok.pad, run.device)
    return run.state['composer'].read(M.hidden(reader, ids, attn), M.embed(reader, ids), pool)


def experience_tokens(run, m):
    """A retrieved experience's line as the reader reads it (cut at 200 tokens)."""
    return run.tok.encode(experience_line(m.task, m.text))[:200]


def latent_frame(run, zs):
    """<|bos|><|ctx|>past: z_1 \n z_2 \n … z_J \n — each experience's K latents exactly where
    experiences_text puts its text line, i.e. in the slot the base learned to read (the paper's
    code frames its latents the same way: "reference example … end of reference example").
    zs: J tensors (K, d) -> (P, d)."""
    E = lambda ids: M.embed(run.teacher, torch.tensor(ids, device=run.device))
    with torch.no_grad():  # constants: with LoRA, new token rows are θ's trainable rows, which φ's loss must not reach
        head, sep = E(run.tok.context_head() + run.tok.encode('past:')), E(run.tok.encode('\n'))
    return torch.cat([head] + [x for z in zs for x in (z, sep)])


def latents(run, eps, grad, found=None, read0=None):
    """Steps 2-3 -> Prefixes, latent_frame per rollout (None: nothing was retrieved)."""
    tasks, K = [e.task for e in eps], run.args.K
    found = retrieve(run, tasks) if found is None else found
    z, z0 = compose(run, tasks, found, grad, read0)
    prefixes, k, shown = [], 0, lambda m: run.state['composer'].shown(len(experience_tokens(run, m)))
    for f in found:  # experience j's K latents, of which the composer shows the first `shown`
        prefixes.append(latent_frame(run, [z[k + j * K:k + j * K + shown(m)] for j, m in enumerate(f)]) if f else None)
        k += len(f) * K
    return Prefixes(prefixes, z=z, z0=z0, found=found)


def lopd_context(run, eps):
    """LOPD's teacher context: latents composed from retrieved experiences (φ's graph kept for the composer phase)."""
    return latents(run, eps, grad=run.args.composer_phase, found=training_retrieval(run, eps))


def training_retrieval(run, eps):
    """Step 2 as training does it: --retrieval other (the control) keeps other families' experiences only."""
    return retrieve(run, [e.task for e in eps], other_family=run.args.retrieval == 'other')


def composer_phase(run, b, logits_s, teacher):
    """Step 6: one step of φ on KL(sg π_θ ‖ π_T^φ) + β(m − Δ) + λ‖z − sg z0‖², then β ← max(0, β + η_β(m − Δ)).
    Rollouts without retrieved experiences carry no latents and are left out, as in the student phase."""
    a, s, keep = run.args, run.state, teacher.keep.to(run.device)
    logits_t = teacher.logits
    if M.is_lora(run.model):  # θ0 is θ's model with the adapter off: the student's step changed tensors its graph holds
        logits_t = M.logits_on(run.teacher, with_default(run, teacher.context), b.ids, b.attn, a.score_chunk)
    loss, delta, anchor = lopd.composer_loss(logits_s[keep], logits_t[keep], b.ids[keep], b.amask[keep],
                                             b.reward[keep], s['beta'], a.margin, a.lam, teacher.context.z, teacher.context.z0,
                                             centered=a.advantage == 'centered', relative=a.anchor == 'relative')
    for g in s['opt_phi'].param_groups:  # --lr_composer acts after the setup (a cached one holds the lr it was built with)
        g['lr'] = lr_phi(run)
    optimizer_step(run, s['opt_phi'], loss, phi_params(s['composer'], s['reader']))
    s['beta'] = lopd.dual_update(s['beta'], a.margin, delta, a.eta_beta)
    return {'delta': float(delta), 'anchor': float(anchor)}


def write_back(run, eps):
    """Step 7: successful rollouts join the bank (the bank keeps only successes)."""
    run.state['bank'].add([retrieval.Experience(e.task.task_id, e.task.family, e.task.prompt,
                                                run.env.trajectory_text(e), e.reward) for e in eps])


def lopd_after_step(run, b, logits_s, teacher):
    logs = {'family_hit': family_hit(run, b.eps, teacher.context.found)}
    if run.args.composer_phase:  # off by default: φ stays at its cold start
        with run.timer('composer'):
            logs.update(composer_phase(run, b, logits_s, teacher))
    write_back(run, b.eps)
    return logs


def new_bank(run):
    embed = retrieval.EMBEDDERS[run.args.embedder or run.env.embedder]()
    rerank = retrieval.RERANKERS[run.args.rerank or run.env.rerank]
    return retrieval.ExperienceBank(embed, run.args.bank_capacity, run.args.allow_same_task, rerank=rerank)


def fill_bank(run, rollout):
    """Before training: base rollouts fill the bank (they count toward the budget). -> all of them,
    and the expert's demos it added, as (episode, body, agent mask)."""
    a, rows = run.args, []
    n = max(a.batch, 64)  # no gradient here: a bigger batch only decodes faster
    for i in tqdm(range(0, a.init_episodes, n), desc='fill bank', dynamic_ncols=True):
        with run.timer('rollout'):
            tasks = run.rng.sample(run.env.train_tasks, min(n, a.init_episodes - i))
            if a.bank_source == 'expert':  # the scripted expert's demos, not the base's own
                eps, bodies, masks = expert_demos(run, tasks)
            else:
                eps, bodies, masks = rollout(run.model, run.tok, run.env, tasks)
                if a.bank_source == 'pool':  # the expert covers the tasks the base failed
                    d_eps, d_bodies, d_masks = expert_demos(run, [e.task for e in eps if not e.success])
                    eps, bodies, masks = [*eps, *d_eps], [*bodies, *d_bodies], [*masks, *d_masks]
        run.episodes += len(tasks)  # the pool's demos of failed tasks are free, as OPSD's pool's are
        write_back(run, eps)
        rows += list(zip(eps, bodies, masks))
    return rows


def expert_demos(run, tasks):
    """The scripted expert's demo of each task, played out: -> (episodes, bodies, agent masks)."""
    eps = [envs.play(run.env, t, run.env.demo(t, random.Random(0))) for t in tasks]
    encoded = [M.encode_episode(run.tok, e) for e in eps]
    return eps, [body for body, _ in encoded], [mask for _, mask in encoded]


def family_hit(run, eps, found):
    """Diagnostic: the fraction of retrieved experiences from the query's own family (training only)."""
    return run.state['bank'].family_hit_rate([e.task.family for e in eps], found)


def balanced_sample(rng, rows, n):
    """n rows drawn family first (uniform over the families present), then a row of that family:
    the base's successes are mostly families it already solves, and the rare ones must not drown."""
    by = {}
    for r in rows:
        by.setdefault(r[0].task.family, []).append(r)
    fams = sorted(by)
    return [rng.choice(by[rng.choice(fams)]) for _ in range(n)]


def cold_start_nll(run, ctx, ids, amask, attn):
    """The paper's cold start: the frozen teacher's NLL of successful trajectories given the latents
    composed from their retrieved experiences."""
    keep = torch.tensor([p is not None for p in ctx], device=run.device)
    logits_t = M.logits_on(run.teacher, with_default(run, ctx), ids, attn, run.args.score_chunk)
    return lopd.masked_mean(-lopd.token_logp(logits_t, ids), amask * keep[:, None].to(amask))


def cold_start_text(run, ctx, ids, amask, attn):
    """Text-to-latent distillation: the latents must make the teacher act as the same retrieved
    experiences shown as text do, KL(π_θ0(·|experiences as text) ‖ π_θ0(·|latents)) on every
    agent token of any stored rollout, success or failure (the text teacher knows the right
    next call after a wrong one too)."""
    keep = torch.tensor([p is not None for p in ctx], device=run.device)
    with torch.no_grad():
        text = M.text_prefix(run.teacher, run.tok, [bank_text(f) for f in ctx.found])
        logits_text = M.logits_on(run.teacher, text, ids, attn, run.args.score_chunk)
    logits_z = M.logits_on(run.teacher, with_default(run, ctx), ids, attn, run.args.score_chunk)
    return lopd.masked_mean(lopd.divergence(logits_z, logits_text, 'fkl'), amask * keep[:, None].to(amask))


COLD_STARTS = {'nll': cold_start_nll, 'text': cold_start_text}


def cold_start(run, rollout):
    """Fill the bank with base rollouts, then pre-train φ (COLD_STARTS: the paper's NLL of the
    successes, or text-to-latent distillation on every rollout), family-balanced by default.
    The bank does not change during the cold start, so each row's retrieval and its frozen
    reading are made once, not at every step (the reading was half of a step's time)."""
    a, s = run.args, run.state
    rows = fill_bank(run, rollout)
    rows = [r for r in rows if r[0].success] if a.cold_start == 'nll' else rows
    with run.timer('cold_start'):
        rows = [r + read for i in range(0, len(rows), 32) for r, read in zip(rows[i:i + 32], frozen_reading(run, rows[i:i + 32]))]
    opt = torch.optim.AdamW(phi_params(s['composer'], s['reader']), lr=a.lr_cold_start or a.lr or run.method.lr)  # its own stage
    for _ in (bar := tqdm(range(a.cold_start_steps if rows else 0), desc='cold start', dynamic_ncols=True)):
        with run.timer('cold_start'):
            pick = balanced_sample(run.rng, rows, 32) if a.cold_start_sample == 'balanced' else \
                run.rng.sample(rows, min(32, len(rows)))
            eps, bodies, masks, found, read0 = zip(*pick)
            ctx = latents(run, eps, grad=True, found=list(found), read0=torch.cat(read0))
            loss = COLD_STARTS[a.cold_start](run, ctx, *M.pad_batch(bodies, masks, run.tok.pad, run.device))
            optimizer_step(run, opt, loss, phi_params(s['composer'], s['reader']))
        bar.set_postfix(loss=f'{loss.item():.3f}')
    s['composer0'].load_state_dict(s['composer'].state_dict())  # z0: the anchor from here on
    if s['reader'] is not None:
        s['reader0'].load_state_dict(s['reader'].state_dict())


@torch.no_grad()
def frozen_reading(run, rows):
    """-> per row (what it retrieves, its frozen reading, as composer.read keeps it), as compose would make them."""
    tasks = [r[0].task for r in rows]
    found = retrieve(run, tasks)
    if not any(found):
        return [(f, torch.zeros(0, run.args.K, run.model.get_input_embeddings().weight.shape[1], device=run.device))
                for f in found]
    read0 = reading(run, tasks, found, run.state['reader0'] or run.teacher).split([len(f) for f in found])
    return list(zip(found, read0))


PHASE = 'composer_phase'  # the flags of step 6 act only with it

register('lopd', Method(
    distill, context=lopd_context, teacher='frozen', group=1, lr=3e-4,  # 1e-3's first Adam step costs the student 25 points
    state=lopd_state, setup=cold_start, after_step=lopd_after_step,
    flags={**DISTILL_FLAGS, **BANK_FLAGS,
           'K': arg(64, 'latent tokens per retrieved experience (64: more than a tool-use experience has tokens; the paper: 32)',
                    lo=1),
           'composer': arg('qformer-copy', "φ: mlp = an MLP on the means of K segments of the reader's states; qformer = K learned "
                           "queries attending over them (the paper's); qformer-copy = the same, query k starting on the experience's "
                           "k-th token (its latents start as the experience's embeddings)", choices=list(lopd.COMPOSERS)),
           'margin': arg(0.05, 'privileged margin m (0 = ablation)', lo=0, after_setup=True, needs=PHASE),
           'lam': arg(0.2, 'anchor weight λ on ‖z − z0‖²', lo=0, after_setup=True, needs=PHASE),
           'anchor': arg('absolute', "‖z − z0‖² as the paper's (absolute), or relative to ‖z0‖²", choices=['absolute', 'relative'],
                         after_setup=True, needs=PHASE),
           'eta_beta': arg(0.5, 'dual step size η_β for the margin multiplier β', lo=0, after_setup=True, needs=PHASE),
           'lr_composer': arg(1e-5, "composer-phase learning rate (the paper's lr_φ; 0 = the student's, at which the "
                              "KL term pulls the teacher onto the student)", lo=0, after_setup=True,
                              needs=PHASE),
           'lr_cold_start': arg(0.0, "cold-start learning rate (0 = the student's)", lo=0),
           'cold_start_steps': arg(150, 'composer pre-training steps (the paper: 1,000; 0: the copy-started composer, '
                                   'whose latents start as the experience\'s embeddings)', lo=0),
           'cold_start': arg('nll', "cold start objective: nll = the paper's, the teacher's NLL of the bank's successes "
                             "given their latents; text = the teacher reading the latents matches it reading the same "
                             "experiences as text", choices=list(COLD_STARTS)),
           'cold_start_sample': arg('balanced', "cold start: draw the bank's rollouts family-balanced, or as stored",
                                    choices=['balanced', 'stored']),
           'reader': arg('frozen', 'who reads the experiences for the composer: the frozen base, or a trainable copy',
                         choices=['frozen', 'trained']),
           'advantage': arg('paper', "the margin's A(τ): paper = 2r − 1, centered = r − mean r over the batch",
                            choices=['paper', 'centered'], after_setup=True, needs=PHASE),
           'composer_phase': arg(False, "step 6, the paper's: train φ after each student step on the KL, the margin and "
                                 "the anchor (off by default: in the miniature it lowers the teacher and the student)",
                                 after_setup=True)},
    bench={'lopd': dict(knob=['--cold_start_steps', '300'], cost=280, quick=True),
           'lopd-phase': dict(flags=['--composer_phase'], cost=670, quick=True),
           'lopd-m0': dict(flags=['--composer_phase', '--margin', '0'], cost=350, quick=True),
           # the ablation grid (one alternative per knob: the margin sweep is m = 0, 0.05, 0.2) and the control
           'lopd-m0.2': dict(flags=['--composer_phase', '--margin', '0.2'], cost=350),
           'lopd-centered': dict(flags=['--composer_phase', '--advantage', 'centered'], cost=350),
           'lopd-k16': dict(flags=['--K', '16'], cost=280),
           'lopd-j3': dict(flags=['--J', '3'], cost=300),
           'lopd-textcs': dict(flags=['--cold_start', 'text'], cost=300),
           'lopd-self': dict(flags=['--allow_same_task'], cost=280),
           'lopd-offline': dict(flags=['--setup_free'], cost=300),
           'lopd-other': dict(flags=['--retrieval', 'other'], cost=280)}))


# ----------------------------------------------------------------------------- Traj-text (LOPD ablation)

def trajtext_context(run, eps):
    """Traj-text: LOPD's retrieved experiences, shown to the frozen base as text."""
    found = training_retrieval(run, eps)
    return Prefixes([bank_text(f) for f in found], found=found)


def trajtext_after_step(run, b, logits_s, teacher):
    logs = {'family_hit': family_hit(run, b.eps, teacher.context.found)}
    write_back(run, b.eps)
    return logs


register('trajtext', Method(distill, context=trajtext_context, teacher='frozen', group=1, lr=1e-3,
                            state=lambda run: {'bank': new_bank(run)}, setup=fill_bank, after_step=trajtext_after_step,
                            flags={**DISTILL_FLAGS, **TEACHER_FLAGS, **BANK_FLAGS},
                            bench={'trajtext': dict(knob=['--J', '3'], cost=430)}))
