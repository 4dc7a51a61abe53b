"""Before training: the base every method starts from. The default one ships with the repo (base/tooluse: its
weights, its tokenizer, and a manifest of how it was built and what it measured), so that `python train.py` starts
from the same base on every machine; any other recipe (--warmup_seed, --build_base, another model shape) is built
here by the warm-up and cached under runs/.

The tiny model starts from nothing, so before any method runs it is trained, supervised, on
noisy-expert demos (envs.*.demo), and taught to read a privileged context as an
instruction-tuned LLM can: 60% of its demos (--warmup_ctx) come with a context in one of the
forms the methods' teachers are shown, followed by a demo that uses it (warmup_demo). Its
tokenizer is learned offline from the same kind of text (tokenizer_texts, tokenizer.bpe_ranks).

LOPD's cold start (cold_start, at the end): base rollouts fill the experience bank (counted toward
the episode budget), then φ is pre-trained on the paper's objective, the frozen teacher's NLL of the
bank's successes given the latents composed from their retrieved experiences.
"""
import hashlib
import json
import math
import os
import random

import numpy as np
import torch
from tqdm import tqdm

import envs
import lopd
import model as M
import retrieval
import tokenizer
from plumbing import bookkeeping as bk
from retrieval import experiences_text

# the forms of privileged context the warm-up teaches the base to read, with their share of the context demos
CONTEXT_FORMS = {'solution': 0.2, 'this_task': 0.15, 'past': 0.3, 'unhelpful': 0.1, 'skill': 0.1, 'feedback': 0.15}


def solution_text(task):
    """This task's reference solution as a context (OPSD's 'answer' form)."""
    return f'reference solution: {task.solution}\n'


def skill_text(records):
    """Skill-SD's summariser, as a deterministic template over a family's stored trajectories
    [(text, reward, feedback)]: a success pattern, the commonest mistake, the workflow.
    e.g. 'skill: success pattern: city(bo) -> oslo; answer oslo; mistakes: none seen;
    workflow: 2 turns, the last one answers'."""
    wins = [r for r in records if r[1] >= 1]
    fails = [r[2] for r in records if r[1] < 1 and r[2]]
    pattern = wins[-1][0] if wins else 'none yet'
    mistake = max(fails, key=fails.count) if fails else 'none seen'   # a tie: the earliest (set order is hash-seeded)
    turns = round(float(np.mean([r[0].count(';') + 1 for r in wins]))) if wins else '?'
    return f'skill: success pattern: {pattern}; mistakes: {mistake}; workflow: {turns} turns, the last one answers\n'


def warmup_demo(env, task, by_family, rng, p_ctx=0.0, form=None, forms=CONTEXT_FORMS):
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
    is learned but no opaque plan is: those stay learnable only from experience. form: this one
    (the reading probe's), not a draw from `forms` (the tail's: TAIL_FORMS)."""
    u = rng.random()
    if u >= p_ctx:
        return envs.play(env, task, env.demo(task, rng, noisy=True)), None
    form = form or rng.choices(list(forms), weights=list(forms.values()))[0]
    kw = env.reading_plan(task, rng)
    follow = lambda t: envs.play(env, t, env.demo(t, rng, **kw))               # the plan this demo teaches
    pair = lambda ep: (ep.task.prompt, env.trajectory_text(ep))
    others = lambda n: [envs.play(env, t, env.demo(t, rng, **env.reading_plan(t, rng))) for t in
                        (rng.choice(by_family[rng.choice([f for f in by_family if f != task.family])]) for _ in range(n))]
    if form == 'unhelpful':
        return envs.play(env, task, env.demo(task, rng, noisy=True)), experiences_text(map(pair, others(rng.randint(1, 3))))
    ep = follow(task)
    if form == 'solution':
        return ep, f'reference solution: {env.trajectory_text(ep)}\n'
    if form == 'this_task':
        return ep, experiences_text([pair(follow(task))])
    if form == 'past':
        n = rng.randint(1, 3)
        same = [follow(t) for t in rng.sample(by_family[task.family], rng.randint(1, n))]
        shown = same + others(n - len(same))
        rng.shuffle(shown)
        return ep, experiences_text(map(pair, shown))
    failed = next((f for f in (envs.play(env, task, env.demo(task, rng, noisy=True)) for _ in range(4)) if not f.success), None)
    if form == 'skill':
        wins = [follow(t) for t in rng.sample(by_family[task.family], rng.randint(1, 2))]
        records = [(env.trajectory_text(w), 1.0, w.feedback) for w in wins]
        records.insert(0, (env.trajectory_text(failed), 0.0, failed.feedback)) if failed else None
        return ep, skill_text(records)
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
    texts = [retrieval.READING_FRAME]
    for t in rng.sample(pool, n):
        ep, ctx = warmup_demo(env, t, by_family, rng, 0.5)
        texts += [t.prompt, ctx or '', *(x for turn in ep.turns for x in turn)]
    return texts


def scored(model, tok, demos, contexts, device, rows_per_forward=16, chunk=0, encoded=None):
    """The demos scored behind their contexts, rows sorted by length (context + body) and scored rows_per_forward
    at a time, so that short rows do not pay for the long ones' padding (the forwards are compute-bound on a CPU:
    padding is time). encoded: the demos' M.encode_episode, if the caller has them.
    -> per group: (its rows' indices, logits (b, T, V), ids, agent mask)."""
    seqs, masks = zip(*(encoded or [M.encode_episode(tok, d) for d in demos]))
    length = [len(tok.encode(c)) if c else -1 for c in contexts]
    order = sorted(range(len(demos)), key=lambda i: (length[i], len(seqs[i])))
    for k in range(0, len(order), rows_per_forward):
        rows = order[k:k + rows_per_forward]
        ids, amask, attn = M.pad_batch([seqs[i] for i in rows], [masks[i] for i in rows], tok.pad, device)
        prefixes = [M.text_prefix(model, tok, [contexts[i]])[0] if contexts[i] else M.bos_prefix(model, tok, 1)[0]
                    for i in rows]
        yield rows, M.logits_on(model, prefixes, ids, attn, chunk), ids, amask


def warmup_loss(model, tok, demos, contexts, device, rows_per_forward=16, chunk=0, backward=False):
    """NLL of the demos' agent tokens (scored). backward (--micro_batch): each group's share of the loss is
    backpropagated at once, so that one group's activations are alive, not the batch's; -> the loss, detached."""
    encoded = [M.encode_episode(tok, d) for d in demos]
    total, n = 0.0, (sum(sum(mask) for _, mask in encoded) if backward else 0)
    for _, logits, ids, amask in scored(model, tok, demos, contexts, device, rows_per_forward, chunk, encoded):
        nll = -lopd.token_logp(logits, ids, amask)                                 # (b, T)
        if backward:  # this group's share of the mean over every agent token of the batch
            part = (nll * amask).sum() / max(n, 1)
            part.backward()
            total += part.detach()
        else:
            total, n = total + (nll * amask).sum(), n + amask.sum()
    return total if backward else total / n


PROBE_EVERY = 100   # warm-up steps between two readings of the probe (0 = none: the same base, untimed)
PROBE_FORMS = ('past', 'solution')   # LOPD's (its latents start as a past experience's embeddings) and OPSD's


def probe_demos(env, pool, by_family, n=32):
    """The reading probe's demos: n per form of PROBE_FORMS, each after its context, from the warm-up's tasks drawn
    by a generator of their own (the warm-up's draws are untouched). -> {form: (demos, contexts)}."""
    rng = random.Random(777)
    return {f: tuple(zip(*[warmup_demo(env, rng.choice(pool), by_family, rng, 1.0, form=f) for _ in range(n)]))
            for f in PROBE_FORMS}


def tail_steps(args):
    """--warmup_tail's steps (a fraction of --warmup_steps): the most the gate may add."""
    return round(args.warmup_tail * args.warmup_steps)


@torch.no_grad()
def reading(model, tok, probe, device):
    """Does the base read a context? Per form, the drop of the teacher-forced NLL of the probe's demos (nats per
    agent token) when their context is shown: 0 for a base that ignores it. Under fork_rng, so that probing
    leaves the base (and every draw after it) as it was."""
    with torch.random.fork_rng(devices=[]):
        return {f: round(float(warmup_loss(model, tok, demos, [None] * len(demos), device) -
                               warmup_loss(model, tok, demos, contexts, device)), 4) for f, (demos, contexts) in probe.items()}


def gate_demos(env, pool, by_family, n=1024):
    """The gate's demos: n warm-up tasks of the opaque families (the ones only a context tells), each after a 'past'
    context (LOPD's form: one to three past trajectories, one at least of its family, whose plan the demo follows,
    never an opaque word's true plan), drawn by a generator of their own. -> (demos, contexts), or None: no family
    of this environment is opaque."""
    rng, opaque = random.Random(778), [t for t in pool if t.family in getattr(env, 'opaque', ())]
    return tuple(zip(*[warmup_demo(env, rng.choice(opaque), by_family, rng, 1.0, form='past') for _ in range(n)])) \
        if opaque else None


@torch.no_grad()
def played(model, tok, demos, contexts, device):
    """Per demo: would greedy decoding play it token for token behind its context (every agent token the argmax)?"""
    out = [False] * len(demos)
    for rows, logits, ids, amask in scored(model, tok, demos, contexts, device):
        for i, ok in zip(rows, ((logits.argmax(-1) == ids) | (amask == 0)).all(-1).tolist()):
            out[i] = ok
    return out


def follows(model, tok, gate, device):
    """Does the base act on what it reads? The fraction of the gate's demos it plays (greedy, token for token) with
    their context shown, minus without it. Unlike the NLL probe it tells the bases apart: 0.006-0.122 on every base
    measured whose teacher was under +0.10 over its student at step 0, over 0.17 on all but one above
    (docs/bases.md). Under fork_rng, as the probe."""
    demos, contexts = gate
    with torch.random.fork_rng(devices=[]):
        return round((sum(played(model, tok, demos, contexts, device)) -
                      sum(played(model, tok, demos, [None] * len(demos), device))) / len(demos), 4)


TAIL_LR = 0.3  # where the reading tail's learning rate starts, as a fraction of --warmup_lr (a second cosine, to 0.1)
# the reading tail's demos: 90% with a context, every one of a form whose demo copies the plan shown (a base under the
# gate copies badly even the task's own solution, docs/bases.md), the plain solution the most (it teaches copying fastest)
TAIL_CTX, TAIL_FORMS = 0.9, {'solution': 0.5, 'this_task': 0.3, 'past': 0.2}


def lr_factor(step, steps, tail=0):
    """The warm-up's learning rate, as a fraction of --warmup_lr: a cosine from 1 to 0.1 over its `steps`, then, on a
    base that does not read (the gate, --warmup_gate), the reading tail's `tail` steps: a cosine from TAIL_LR to 0.1."""
    if step >= steps:
        return 0.1 + (TAIL_LR - 0.1) * 0.5 * (1 + math.cos(math.pi * (step - steps) / max(tail, 1)))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps))


def cpu_kernels():
    """The CPU's kernel set torch runs (AVX2, AVX512, ...): a base built under another is another draw."""
    return torch.backends.cpu.get_cpu_capability()


def recipe_key(args, tok, env):
    """What a base is built from, wherever it is built: the recipe's flags, its tokenizer, what its demos teach."""
    return ['v10', env.name, env.families, args.model, args.d_model, args.n_layer, args.warmup_steps, args.warmup_batch,
            args.warmup_ctx, args.warmup_lr, args.warmup_seed, tail_steps(args), TAIL_LR, args.warmup_gate, TAIL_CTX,
            TAIL_FORMS, tok.digest(), CONTEXT_FORMS, tokenizer.SPECIALS, tokenizer.MAX_OBS_CHARS]


def warmup_key(args, tok, model, env):
    """What a base built here is built from: its recipe, and the torch and CPU kernels that round its sums (a cache of
    another key is another base)."""
    return json.dumps(recipe_key(args, tok, env) + [torch.__version__, cpu_kernels()] +
                      ([args.lora_r, str(next(model.parameters()).dtype)] if args.model else []))


def warmup(args, tok, model, env, device):
    """The base: the shipped one where the run's recipe is its own (load_shipped), else the supervised warm-up on
    noisy-expert demos, built here and cached under out_dir, shared by every method.
    -> (the weights' path: the shipped file or the cache, whether they were loaded rather than built)."""
    if shipped(args):
        return load_shipped(args, tok, model, env), True
    key = warmup_key(args, tok, model, env)
    path = os.path.join(args.out_dir, f'warmup-{env.name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}.pt')

    @bk.build_threads()
    def build():
        # the base is the same for every run seed (one base, many methods) and wherever the same torch builds it
        # with the same CPU kernels (other kernels round otherwise: another base, cpu_kernels in the key); a fixed
        # thread count (bk.BUILD_THREADS), since sums split over threads round differently
        rng = random.Random(args.warmup_seed)
        torch.manual_seed(args.warmup_seed)
        pool, by_family = warmup_pool(env) if args.warmup_steps else ([], {})   # 20,000 tasks: seconds to draw
        probe, curve = probe_demos(env, pool, by_family) if PROBE_EVERY and pool and not args.model else None, []
        gate, gates = gate_demos(env, pool, by_family) if args.warmup_gate and tail_steps(args) and pool and not args.model else None, []
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.warmup_lr, weight_decay=0.0)
        step, end = 0, args.warmup_steps
        bar = tqdm(total=end, desc='warm-up', dynamic_ncols=True)
        while step < end:
            if probe and step % PROBE_EVERY == 0:
                curve.append({'step': step, **reading(model, tok, probe, device)})
            for g in opt.param_groups:
                g['lr'] = args.warmup_lr * lr_factor(step, args.warmup_steps, tail_steps(args))
            tail = step >= args.warmup_steps   # the reading tail: more demos that copy a plan shown (TAIL_FORMS)
            demos, contexts = zip(*[warmup_demo(env, t, by_family, rng, TAIL_CTX if tail else args.warmup_ctx,
                                                forms=TAIL_FORMS if tail else CONTEXT_FORMS)
                                    for t in rng.sample(pool, args.warmup_batch)])
            opt.zero_grad(set_to_none=True)
            with M.train_mode(model):
                loss = warmup_loss(model, tok, demos, contexts, device, args.micro_batch or 16, args.score_chunk,
                                   backward=args.micro_batch > 0)
                if not args.micro_batch:
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            bar.update()
            bar.set_postfix(loss=f'{loss.item():.3f}', **({'read': curve[-1][PROBE_FORMS[0]]} if curve else {}))
            if step == end and gate:  # the gate at the cosine's end (and its reading again after the tail)
                gates.append({'step': step, 'follows': follows(model, tok, gate, device)})
                more = tail_steps(args) if step == args.warmup_steps and gates[-1]['follows'] < args.warmup_gate else 0
                end, bar.total = end + more, end + more
                tqdm.write(f'warm-up: at step {step} the base plays {gates[-1]["follows"]:+.3f} of the gate\'s demos more '
                           f'with their context than without (the gate: {args.warmup_gate}): ' +
                           (f'the reading tail, {more} steps of demos that copy a plan shown' if more else
                            'it reads' if step == args.warmup_steps else 'after the reading tail'))
        if probe:
            curve.append({'step': step, **reading(model, tok, probe, device)})
            print('warm-up: reading, the NLL drop per agent token when a context is shown: ' +
                  ', '.join(f'{f} {curve[-1][f]:+.3f}' for f in PROBE_FORMS))
        return {'model': M.trainable_state(model), 'key': key, 'reading': curve, 'gate': gates}  # with LoRA, only the adapter

    def apply(saved):
        if saved['key'] != key:
            raise ValueError('the key inside differs')
        (M.load_trainable if M.is_lora(model) else bk.load_module)(model, saved['model'])

    return path, bk.cached(path, 'warm-up', build, apply, device)


def base_info(path):
    """What summary.json and the bench record of a base: which it is (the shipped one, or a cache built here), the torch
    and CPU kernels that built it, and its reading curve (the probe's NLL drops over the warm-up) and gate."""
    if path == os.path.join(SHIPPED, WEIGHTS):
        man = manifest()
        return {'shipped': os.path.relpath(SHIPPED, ROOT), 'id': f"shipped-{man['files'][WEIGHTS][:12]}",
                'torch': man['built']['torch'], 'cpu_kernels': man['built']['cpu_kernels'],
                'reading': man['reading'], 'gate': man['gate']}
    saved = torch.load(path, map_location='cpu', weights_only=False)
    return {'id': os.path.basename(path), 'torch': torch.__version__, 'cpu_kernels': cpu_kernels(),
            'reading': saved.get('reading', []), 'gate': saved.get('gate', [])}


def load_model(args, env, dtype=torch.float32):
    """The tokenizer and the model before the warm-up, as every run (and test, and notebook) builds
    them: the BPE tokenizer learned from this environment's text (or bytes, or --model's own), and
    the tiny model's init from torch's seed --warmup_seed, so that a warm-up built by the same kernels is the same base."""
    torch.manual_seed(args.warmup_seed)
    ranks = (shipped_ranks() if shipped(args) else merges(args, env)) if args.bpe_merges and not args.model else None
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


# ----------------------------------------------------------------------------- the shipped base

ROOT = os.path.dirname(os.path.abspath(__file__))
SHIPPED, WEIGHTS, TOKENIZER = os.path.join(ROOT, 'base', 'tooluse'), 'model.safetensors', 'tokenizer.json'
# the flags a base is built from: a run whose flags are the shipped base's starts from it (no draw on the default path)
RECIPE = ('env', 'model', 'd_model', 'n_layer', 'bpe_merges', 'warmup_steps', 'warmup_batch', 'warmup_ctx', 'warmup_lr',
          'warmup_tail', 'warmup_gate', 'warmup_seed')


def manifest():
    """The shipped base's manifest.json: its recipe, its files' sha256, who built it, what it measured; None if none."""
    try:
        with open(os.path.join(SHIPPED, 'manifest.json')) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def recipe(args):
    return {k: getattr(args, k) for k in RECIPE}


def shipped(args):
    """Does this run start from the shipped base? Yes, unless --build_base or a flag of its recipe says otherwise."""
    man = manifest()
    return man is not None and not args.build_base and recipe(args) == man['recipe']


def sha256(path):
    h = hashlib.sha256()
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            h.update(block)
    return h.hexdigest()


def checked(name):
    """A shipped file's path, once its sha256 is the manifest's (a changed or missing file: one line, exit 2)."""
    path, want = os.path.join(SHIPPED, name), manifest()['files'][name]
    if not os.path.isfile(path) or sha256(path) != want:
        bk.die(f'{os.path.relpath(path, ROOT)} is not the file its manifest names (sha256 {want[:12]}...): restore it '
               f'(git checkout base/) or rebuild the shipped base (python -m bench.ship_base)')
    return path


def shipped_ranks():
    """The shipped base's tokenizer: the BPE merges it was trained with (tokenizer.bpe_ranks' {bytes: rank})."""
    with open(checked(TOKENIZER)) as f:
        return {bytes.fromhex(b): rank for b, rank in json.load(f)['ranks']}


def recipe_digest(args, tok, env):
    return hashlib.sha256(json.dumps(recipe_key(args, tok, env)).encode()).hexdigest()[:16]


def load_shipped(args, tok, model, env):
    """The shipped base's weights into `model` (safetensors: no pickle), once the files' hashes and this code's recipe
    are the manifest's; prints one line naming the base and its facts. -> the weights' path."""
    from safetensors.torch import load_model as load_weights
    man = manifest()
    if recipe_digest(args, tok, env) != man['recipe_digest']:
        bk.die('the shipped base (base/tooluse) was built by another recipe than this code\'s (its demos, tokenizer or '
               'model shape changed): rebuild it (python -m bench.ship_base), or build one here (--build_base)')
    path = checked(WEIGHTS)
    load_weights(model, path, device=str(next(model.parameters()).device))
    print(f'warm-up: shipped {os.path.relpath(path, ROOT)}')  # the bench waits for this line
    print(describe(man))
    return path


def describe(man):
    """The shipped base in one line: how it was built and what it measured."""
    f, b = man['facts'], man['built']
    gap = lambda g: f"{g['mean']:+.3f} [{g['lo']:+.3f}, {g['hi']:+.3f}]"
    head = (f"base: the shipped one, base/tooluse (warm-up seed {man['recipe']['warmup_seed']}, built by torch {b['torch']} "
            f"on {b['cpu_kernels']} kernels)")
    if not f:
        return f'{head}: not measured yet'
    return (f"{head}: held-out reward {f['reward']:.3f}, success {f['success']:.3f} "
            f"({f['eval_tasks']} tasks); its teacher over its student at step 0: LOPD {gap(f['gap_lopd'])}, "
            f"OPSD {gap(f['gap_opsd'])} ({f['teacher_eval']} tasks)")
