"""The warm-up: the base every method starts from, built once and cached under runs/.

The tiny model starts from nothing, so before any method runs it is trained, supervised, on
noisy-expert demos (envs.*.demo), and taught to read a privileged context as an
instruction-tuned LLM can: 60% of its demos (--warmup_ctx) come with a context in one of the
forms the methods' teachers are shown, followed by a demo that uses it (warmup_demo). Its
tokenizer is learned offline from the same kind of text (tokenizer_texts, tokenizer.bpe_ranks).
"""
import hashlib
import json
import math
import os
import random

import torch
from tqdm import tqdm

import bookkeeping as bk
import envs
import lopd
import methods  # before lopd_method: methods imports it, so that LOPD is registered first
import lopd_method
import model as M
import tokenizer

WARMUP_THREADS = 2


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
    kw = env.reading_plan(task, rng)
    follow = lambda t: envs.play(env, t, env.demo(t, rng, **kw))               # the plan this demo teaches
    pair = lambda ep: (ep.task.prompt, env.trajectory_text(ep))
    others = lambda n: [envs.play(env, t, env.demo(t, rng, **env.reading_plan(t, rng))) for t in
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
    failed = next((f for f in (envs.play(env, task, env.demo(task, rng, noisy=True)) for _ in range(4)) if not f.success), None)
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
    """What the tiny model will read, for its BPE merges (tokenizer.bpe_ranks): warm-up demos, half
    of them with a privileged context, and LOPD's reading frame. Deterministic, and the same for
    every instance of an environment, so it is made once per process."""
    if (env.name, n) not in _TEXTS:
        _TEXTS[env.name, n] = _tokenizer_texts(env, n)
    return _TEXTS[env.name, n]


_TEXTS = {}


def _tokenizer_texts(env, n):
    rng, (pool, by_family) = random.Random(4321), warmup_pool(env)
    texts = [lopd_method.READING_FRAME]
    for t in rng.sample(pool, n):
        ep, ctx = warmup_demo(env, t, by_family, rng, 0.5)
        texts += [t.prompt, ctx or '', *(x for turn in ep.turns for x in turn)]
    return texts


def warmup_loss(model, tok, demos, contexts, device, rows_per_forward=16, chunk=0):
    """NLL of the demos' agent tokens. Rows are sorted by length (context + body) and scored
    rows_per_forward at a time, so that short rows do not pay for the long ones' padding (the
    forwards are compute-bound on a CPU: padding is time)."""
    seqs, masks = zip(*[M.encode_episode(tok, d) for d in demos])
    length = [len(tok.encode(c)) if c else -1 for c in contexts]
    order = sorted(range(len(demos)), key=lambda i: (length[i], len(seqs[i])))
    total, n = 0.0, 0
    for k in range(0, len(order), rows_per_forward):
        rows = order[k:k + rows_per_forward]
        ids, amask, attn = M.pad_batch([seqs[i] for i in rows], [masks[i] for i in rows], tok.pad, device)
        prefixes = [M.text_prefix(model, tok, [contexts[i]])[0] if contexts[i] else M.bos_prefix(model, tok, 1)[0]
                    for i in rows]
        nll = -lopd.token_logp(M.logits_on(model, prefixes, ids, attn, chunk), ids)     # (b, T)
        total, n = total + (nll * amask).sum(), n + amask.sum()
    return total / n


def warmup(args, tok, model, env, device):
    """Supervised warm-up on noisy-expert demos, cached under out_dir, shared by every method.
    -> (cache path, whether it came from the cache)."""
    key = json.dumps(['v8', env.name, env.families, args.model, args.d_model, args.n_layer, args.warmup_steps,
                      args.warmup_batch, args.warmup_ctx, args.warmup_lr, tok.digest(), CONTEXT_FORMS, tokenizer.SPECIALS,
                      tokenizer.MAX_OBS_CHARS] + ([args.lora_r, str(next(model.parameters()).dtype)] if args.model else []))
    path = os.path.join(args.out_dir, f'warmup-{env.name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}.pt')

    def build():
        # the base is the same for every run seed (one base, many methods) and wherever it is built
        # with this torch: a fixed thread count, since sums split over threads round differently
        # (1 and 2 threads gave two different bases); 2, so that a 2-core machine builds it at full speed
        rng, threads = random.Random(1234), torch.get_num_threads()
        torch.manual_seed(1234)
        torch.set_num_threads(WARMUP_THREADS)
        pool, by_family = warmup_pool(env) if args.warmup_steps else ([], {})   # 20,000 tasks: seconds to draw
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.warmup_lr, weight_decay=0.0)
        for step in (bar := tqdm(range(args.warmup_steps), desc='warm-up', dynamic_ncols=True)):
            for g in opt.param_groups:  # cosine decay to 10%
                g['lr'] = args.warmup_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.warmup_steps)))
            demos, contexts = zip(*[warmup_demo(env, t, by_family, rng, args.warmup_ctx)
                                    for t in rng.sample(pool, args.warmup_batch)])
            loss = warmup_loss(model, tok, demos, contexts, device, chunk=args.score_chunk)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            bar.set_postfix(loss=f'{loss.item():.3f}')
        torch.set_num_threads(threads)
        return {'model': M.trainable_state(model), 'key': key}  # with LoRA, only the adapter

    def apply(saved):
        if saved['key'] != key:
            raise ValueError('the key inside differs')
        (M.load_trainable if M.is_lora(model) else bk.load_module)(model, saved['model'])

    return path, bk.cached(path, 'warm-up', build, apply, device)


def load_model(args, env, dtype=torch.float32):
    """The tokenizer and the model before the warm-up, as every run (and test, and notebook) builds
    them: the BPE tokenizer learned from this environment's text (or bytes, or --model's own), and
    the tiny model's init from torch's seed 1234, so that a warm-up built anywhere is the same base."""
    torch.manual_seed(1234)
    ranks = merges(args, env) if args.bpe_merges and not args.model else None
    return M.load(args.model or None, args.d_model, args.n_layer, ranks, dtype,
                  system=env.instructions if args.model else None)


def merges(args, env):
    """The tiny tokenizer's BPE merges (tokenizer.bpe_ranks of tokenizer_texts), cached under out_dir
    beside the warm-up: the text is drawn from 20,000 warm-up tasks, seconds of Python that every
    process would pay again. Keyed by the code's fingerprint (bk.CODE), so that a change to any
    code that writes the text learns them anew; a bad file is learned anew too."""
    key = json.dumps(['bpe', env.name, args.bpe_merges, bk.CODE])
    path = os.path.join(args.out_dir, f'bpe-{env.name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}.json')
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved['key'] == key:
            return {bytes.fromhex(b): rank for b, rank in saved['ranks']}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ranks = tokenizer.bpe_ranks(tokenizer_texts(env), args.bpe_merges)
    try:  # a read-only out_dir only costs the seconds
        os.makedirs(args.out_dir, exist_ok=True)
        bk.atomic_json({'key': key, 'ranks': [[b.hex(), rank] for b, rank in ranks.items()]}, path)
    except OSError:
        pass
    return ranks
