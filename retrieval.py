"""LOPD's memory: the experience bank, the retriever, and how a retrieved experience becomes
latent tokens in the teacher's context (steps 2, 3 and 7 of train.lopd_step).

The bank stores *successful* trajectories as "action -> result" text, each with a document
embedding of its task. A new task is embedded alone as the query; we return the J stored
experiences most cosine-similar to it (step 2). The frozen base reads each one ("task to solve:
x / reference past trajectory: m_j"); the composer φ (lopd.QFormer) maps that reading to K latent
tokens, which go where a text context would go in the teacher's prompt (step 3). New successes
are written back (step 7).

    bank = ExperienceBank(hashing_embedder())
    bank.add([Experience("t1", "zorb of X", "zorb of bo", "manager(bo) -> gus; manager(gus) -> wes; mark(wes)", 1.0)])
    bank.retrieve(["zorb of ada"], ["t2"], J=1)   # -> [[Experience(task_id="t1", ...)]]

What it leaves out:
- An index. The paper embeds with an outside embedding model and searches a flat FAISS
  index; our bank holds a few thousand entries, so one normalised matrix product
  (cosine_topk) is exact, fast enough and needs no extra dependency.
- A learned embedder. The default is a stateless char n-gram hash that needs no fitting,
  so stored embeddings never go stale as the bank grows. Any callable
  list[str] -> (N, D) array works, registered by name in EMBEDDERS (code generation's, which
  embeds the input->output relation of the task's examples, is registered by plugins/codegen.py).
- Deduplication and priorities: eviction is plain FIFO (oldest out first).

References: Zhang et al. 2026, "Latent On-Policy Self-Distillation" (arXiv 2608.13040);
Johnson et al. 2017, "Billion-scale similarity search with GPUs" (FAISS).
"""
import functools
import json
import os
import random
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

import envs
import lopd
import model as M
from plumbing import bookkeeping as bk
from plumbing import parallel
from plumbing.bookkeeping import arg
from plumbing.registry import DISTILL_FLAGS, Prefixes, with_default


FORMAT_VERSION = 1  # bumped if the saved layout changes, so old files fail loudly


@dataclass
class Experience:
    task_id: str  # identity of the task instance (same id = same task)
    family: str  # task family name
    task: str  # the task prompt text
    text: str  # the trajectory in compact "action -> result" text form
    reward: float  # graded, in [0, 1]; 1 = every check passed


def hashing_embedder(n_features: int = 4096) -> Callable[[list[str]], np.ndarray]:
    """Stateless char n-gram embedder: N strings -> float32 (N, n_features), rows L2-normalised.

    Char 2- to 4-grams within words make "manager of bob" and "manager of alice" share most
    features; hashing (no vocabulary) keeps it deterministic and fit-free.
    """
    from sklearn.feature_extraction.text import HashingVectorizer  # here: a second of import for runs that retrieve nothing
    vec = HashingVectorizer(n_features=n_features, analyzer="char_wb", ngram_range=(2, 4),
                            alternate_sign=False, norm="l2", dtype=np.float32)

    def embed(texts: list[str]) -> np.ndarray:
        if len(texts) == 0:  # sklearn refuses an empty batch; an empty matrix is the honest answer
            return np.zeros((0, n_features), dtype=np.float32)
        return vec.transform(list(texts)).toarray().astype(np.float32)  # (N, n_features)

    return embed


# name -> maker of an embedder (plugins may add theirs), and name -> reranker of a shortlist (None: none)
EMBEDDERS = {"ngram": hashing_embedder}
RERANKERS = {"none": None}


def cosine_topk(queries: np.ndarray, docs: np.ndarray, J: int,
                forbid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact cosine top-J. queries (Q, D), docs (N, D) -> idx (Q, J') int64, sim (Q, J') float32.

    J' = min(J, N). Rows are sorted by descending similarity, ties go to the lower index.
    forbid (Q, N) bool marks docs a query may not get; a slot with no allowed doc left is
    idx -1, sim -inf. Example: queries [[1, 0]], docs [[0, 1], [2, 0], [1, 1]], J=2
    -> idx [[1, 2]], sim [[1.0, 0.7071]];
    with forbid [[F, T, F]] -> idx [[2, 0]], sim [[0.7071, 0.0]].
    """
    queries, docs = np.asarray(queries), np.asarray(docs)
    if queries.ndim != 2 or docs.ndim != 2 or queries.shape[1] != docs.shape[1]:
        raise ValueError(f"cosine_topk needs (Q, D), (N, D); got {queries.shape}, {docs.shape}")
    Q, N, Jp = queries.shape[0], docs.shape[0], max(0, min(J, docs.shape[0]))
    # float64 so near-ties are ordered as a float64 reference orders them; max(., 1e-12)
    # keeps zero rows at zero instead of NaN
    q, d = queries.astype(np.float64), docs.astype(np.float64)
    q = q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-12)  # (Q, D)
    d = d / np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-12)  # (N, D)
    sim = q @ d.T  # (Q, N) cosine similarity
    if forbid is not None:
        if np.shape(forbid) != (Q, N):  # np.where would broadcast a wrong shape silently
            raise ValueError(f"forbid must be {(Q, N)}, got {np.shape(forbid)}")
        sim = np.where(np.asarray(forbid, dtype=bool), -np.inf, sim)  # forbidden docs sort last
    # A full stable sort, not argpartition: N is a few thousand at most, and stability is
    # what gives "ties to the lower index" and so the same answer on every run.
    idx = np.argsort(-sim, axis=1, kind="stable")[:, :Jp]  # (Q, J')
    top = np.take_along_axis(sim, idx, axis=1)  # (Q, J')
    idx = np.where(np.isneginf(top), -1, idx)  # slots only a forbidden doc could fill
    return idx.astype(np.int64), top.astype(np.float32)


class ExperienceBank:
    """FIFO store of successful Experiences and their (N, D) float32 document embeddings.

    The matrix grows on add() and is never recomputed, so a search is one matrix product.
    allow_same_task=False (our default; the paper allows it) stops a query from getting its
    own task instance back, so a latent can never just carry this task's answer.
    Our default embeds the task alone, as the authors' code does (their bank indexes the
    instruction); doc_trajectory=True embeds "task \n trajectory" as the document, which we
    measured and do not use: a bag of char n-grams has no query/document asymmetry, and the trajectory's
    n-grams only dilute the task's. Measured on tool use (600 expert trajectories, 250
    held-out queries, J = 3): same-family retrieval 0.90 with the trajectory, 0.94 without,
    and "manager of X" got "manager of manager of X" in 80% of its retrievals with it (the
    LOPD teacher then taught that plan: the student's "manager of X" fell 1.00 -> 0.16).
    rerank (optional): (task, candidates) -> one score each, higher first; the top rerank_pool
    by cosine are re-sorted by it (stable: equal scores keep the cosine order), then cut to J.
    """

    def __init__(self, embed: Callable[[list[str]], np.ndarray], capacity: int = 2000,
                 allow_same_task: bool = False, doc_trajectory: bool = False,
                 rerank: Callable[[str, list[Experience]], list[float]] | None = None, rerank_pool: int = 32):
        self.embed, self.capacity, self.allow_same_task = embed, capacity, allow_same_task
        self.doc_trajectory, self.rerank, self.rerank_pool = doc_trajectory, rerank, rerank_pool
        self.exps: list[Experience] = []
        self.emb = np.zeros((0, 0), dtype=np.float32)  # (N, D); D is set by the first add

    def __len__(self) -> int:
        return len(self.exps)

    def _embed(self, texts: list[str]) -> np.ndarray:
        e = np.asarray(self.embed(texts), dtype=np.float32)
        if e.ndim != 2 or e.shape[0] != len(texts):
            raise ValueError(f"embed returned shape {e.shape} for {len(texts)} texts")
        return e

    def add(self, exps: list[Experience]) -> None:
        """Store the successes among exps (reward 1: every check passed); evict the oldest beyond capacity."""
        keep = [e for e in exps if e.reward >= 1.0]  # the bank holds only what worked (a partial plan is half wrong)
        if not keep:
            return
        new = self._embed([self.document(e) for e in keep])  # (n, D) document embeddings
        if len(self.exps) > 0 and new.shape[1] != self.emb.shape[1]:
            raise ValueError(f"embedding width changed from {self.emb.shape[1]} to {new.shape[1]}")
        self.emb = new if len(self.exps) == 0 else np.concatenate([self.emb, new])  # (N + n, D)
        self.exps = self.exps + keep
        if len(self.exps) > self.capacity:  # FIFO: drop from the front, keep the newest
            cut = len(self.exps) - self.capacity
            self.exps, self.emb = self.exps[cut:], self.emb[cut:]

    def document(self, e: Experience) -> str:
        """The text whose embedding represents e in the bank."""
        return f"{e.task}\n{e.text}" if self.doc_trajectory else e.task

    def retrieve(self, tasks: list[str], task_ids: list[str], J: int,
                 exclude_families: list[str] | None = None) -> list[list[Experience]]:
        """Top-J stored experiences per task, most similar first; may be fewer than J, even none.
        exclude_families (one per task): never return an experience of that family (a control)."""
        if len(tasks) != len(task_ids):
            raise ValueError(f"{len(tasks)} tasks but {len(task_ids)} task_ids")
        if len(self.exps) == 0 or len(tasks) == 0 or J <= 0:
            return [[] for _ in tasks]
        q = self._embed(list(tasks))  # (Q, D) query = the task alone
        forbid = None
        if not self.allow_same_task:  # (Q, N) True where the stored entry is this very task
            forbid = np.array([[e.task_id == t for e in self.exps] for t in task_ids], dtype=bool)
        if exclude_families is not None:
            other = np.array([[e.family == f for e in self.exps] for f in exclude_families], dtype=bool)
            forbid = other if forbid is None else forbid | other
        idx, _ = cosine_topk(q, self.emb, J if self.rerank is None else max(J, self.rerank_pool), forbid)  # (Q, J')
        rows = [[self.exps[i] for i in row if i >= 0] for row in idx]
        if self.rerank is not None:
            scores = [self.rerank(t, row) for t, row in zip(tasks, rows)]
            rows = [[row[k] for k in sorted(range(len(row)), key=lambda k: -s[k])] for row, s in zip(rows, scores)]
        return [row[:J] for row in rows]

    def family_hit_rate(self, families: list[str], retrieved: list[list[Experience]]) -> float:
        """Fraction of retrieved experiences of the query's own family (diagnostic); nan if none."""
        hits = [e.family == f for f, row in zip(families, retrieved, strict=True) for e in row]
        return float(np.mean(hits)) if hits else float("nan")

    def state_dict(self) -> dict:
        """Plain Python only, so torch.load(..., weights_only=True) accepts it inside a checkpoint.

        weights_only refuses numpy arrays, so the (N, D) matrix travels as raw little-endian
        float32 bytes plus its shape:
            emb = np.frombuffer(s["embeddings"], "<f4").reshape(s["shape"])
        """
        return {"version": FORMAT_VERSION, "capacity": int(self.capacity),
                "allow_same_task": bool(self.allow_same_task), "doc_trajectory": bool(self.doc_trajectory),
                "experiences": [asdict(e) for e in self.exps],
                "shape": [int(n) for n in self.emb.shape],
                "embeddings": self.emb.astype("<f4").tobytes()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != FORMAT_VERSION:
            raise ValueError(f"bank format {state.get('version')!r}, expected {FORMAT_VERSION}")
        shape = tuple(int(n) for n in state["shape"])
        emb = np.frombuffer(state["embeddings"], dtype="<f4").reshape(shape).astype(np.float32)
        exps = [Experience(**d) for d in state["experiences"]]
        if len(shape) != 2 or shape[0] != len(exps):
            raise ValueError(f"{len(exps)} experiences but an embedding matrix of shape {shape}")
        # New queries must be embedded like the stored docs, or similarities mean nothing.
        if len(exps) > 0 and self._embed([""]).shape[1] != shape[1]:
            raise ValueError(f"stored embeddings are {shape[1]}-d, but embed gives another width")
        self.capacity, self.allow_same_task = int(state["capacity"]), bool(state["allow_same_task"])
        self.doc_trajectory = bool(state.get("doc_trajectory", True))  # files from before the switch
        self.exps, self.emb = exps, emb

    def save(self, path: str) -> None:
        """Write an .npz: embeddings + the rest as JSON; atomic (path + ".tmp", os.replace)."""
        state = self.state_dict()
        del state["embeddings"]  # the matrix goes in as an array; everything else as JSON
        meta = json.dumps(state)  # stored as a 0-d unicode array, so no pickle is needed
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:  # a file object, else np.savez would append ".npz" to the name
            np.savez(f, embeddings=self.emb, meta=np.array(meta))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str, embed: Callable[[list[str]], np.ndarray]) -> "ExperienceBank":
        """Inverse of save(). A corrupt file, or one not made with embed, raises ValueError."""
        try:
            with np.load(path, allow_pickle=False) as z:
                state = json.loads(str(z["meta"][()]))
                emb = z["embeddings"]
                state["shape"] = list(emb.shape)  # trust the array, not the JSON, for its shape
                state["embeddings"] = np.ascontiguousarray(emb, dtype="<f4").tobytes()
            bank = cls(embed)
            bank.load_state_dict(state)
        except FileNotFoundError:
            raise
        except Exception as err:  # np.load, zipfile and json raise many types on damaged files
            msg = " ".join(str(err).split())  # one line, whatever the library wrote
            name = type(err).__name__
            raise ValueError(f"cannot load experience bank {path!r}: {name}: {msg}") from err
        return bank


# ----------------------------------------------------------------------------- LOPD's memory in the step

BANK_FLAGS = {  # an experience bank, filled with base rollouts before training, written back as we go
    'J': arg(1, 'experiences retrieved per task (the paper: 3; here one same-family success teaches most)', lo=1),
    'bank_capacity': arg(4000, 'experience bank size (FIFO)', lo=1),
    'allow_same_task': arg(False, 'let retrieval return this very task instance (the paper allows it)'),
    'retrieval': arg('similar', "what the teacher is shown during training: similar = the top-J experiences of similar "
                     "tasks (the method); other = of other families only (a control: OP²SD's shuffled donor)",
                     choices=['similar', 'other'], after_setup=True),
    'init_episodes': arg(512, 'base rollouts that fill the bank before training (they count toward --episodes)', lo=0),
    'embedder': arg('', "the retriever's embedder ('' = the environment's: char n-grams for tool use, the tests of "
                    "each example's input->output relation for code generation)", choices=lambda: ['', *EMBEDDERS]),
    'rerank': arg('', "re-sort the embedder's top 32 ('' = the environment's: none for tool use; for code generation, "
                  "by how many of the task's examples each stored program reproduces)", choices=lambda: ['', *RERANKERS]),
    'bank_source': arg('pool', "what fills the bank before training: the base's rollouts; pool = the shared pool OPSD "
                       "is shown (the base's successes, the scripted expert's demo of each task it failed: the paper's "
                       "'stronger models where coverage is lacking'); expert = the expert's demos only",
                       choices=['rollouts', 'pool', 'expert']),
}


READING_FRAME = 'task to solve: {task}\nreference past trajectory: '  # how the composer's reader sees one experience


def experiences_text(pairs):
    """Past experiences [(task prompt, trajectory text)] as one context: 'past: quandle bo: team(bo) -> red; …\n
    city of ed: city(ed) -> oslo; answer oslo\n' (each line starts with a space, so it tokenizes alone).
    Each trajectory carries its task, so that a reader can tell which of them is about this task's family."""
    return 'past:' + ''.join(experience_line(task, traj) + '\n' for task, traj in pairs)


def experience_line(task, traj):
    """One experience as a line of the context, without its newline (LOPD's reader reads the same line)."""
    return f' {task}: {traj}'


def bank_text(found):
    """Retrieved bank entries as one text context (Traj-text's, and LOPD's text-to-latent cold start's)."""
    return experiences_text([(m.task, m.text) for m in found])


def new_bank(run):
    embed = EMBEDDERS[run.args.embedder or run.env.embedder]()
    rerank = RERANKERS[run.args.rerank or run.env.rerank]
    return ExperienceBank(embed, run.args.bank_capacity, run.args.allow_same_task, rerank=rerank)


def retrieve(run, tasks, other_family=False):
    """Step 2: top-J successful experiences of similar tasks (never this task, by default).
    other_family=True: only experiences of other families (the teacher-gap report's control)."""
    return run.state['bank'].retrieve([t.prompt for t in tasks], [t.task_id for t in tasks], run.args.J,
                                      exclude_families=[t.family for t in tasks] if other_family else None)

def phi_params(composer, reader):
    """φ: the composer's parameters, and the reader's when it trains."""
    return list(composer.parameters()) + (list(reader.parameters()) if reader is not None else [])


def phi(run):
    """φ's parameters in a LOPD run's state (the composer's, and the reader's with --reader trained)."""
    return phi_params(run.state['composer'], run.state['reader'])


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
    # φ in float32, outside autocast: a step at lr_φ 1e-5 is under bf16's resolution, so latents made in bf16
    # would not move where the teacher reads them (only the reader's forward runs under autocast)
    f32 = lambda: torch.autocast(run.device.type, enabled=False)
    with torch.no_grad():
        read0 = reading(run, tasks, found, s['reader0'] or run.teacher) if read0 is None else read0  # composer.read's
        with f32():
            z0 = s['composer0'].from_reading(read0.float())                     # (N, K, d) the anchor's target
    with torch.set_grad_enabled(torch.is_grad_enabled() and grad):
        read = reading(run, tasks, found, s['reader']) if s['reader'] is not None else read0
        with f32():
            z = s['composer'].from_reading(read.float())                        # (N, K, d)
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
    return run.state['composer'].read(M.hidden(reader, ids, attn, run.args.micro_batch), M.embed(reader, ids), pool)


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


def latent_prefixes(run, z, found):
    """Each rollout's latents, framed (latent_frame): experience j's K latents, of which the composer
    shows the first `shown`. z (ΣN·K, d) from compose -> per rollout (P_i, d), or None (nothing retrieved)."""
    prefixes, k, K = [], 0, run.args.K
    shown = lambda m: run.state['composer'].shown(len(experience_tokens(run, m)))
    for f in found:
        prefixes.append(latent_frame(run, [z[k + j * K:k + j * K + shown(m)] for j, m in enumerate(f)]) if f else None)
        k += len(f) * K
    return prefixes


def latents(run, eps, grad, found=None, read0=None):
    """Steps 2-3 in one call (the cold start, evaluation, the reports) -> Prefixes: latent_prefixes per
    rollout, with z, z0 and what was retrieved as attributes."""
    tasks = [e.task for e in eps]
    found = retrieve(run, tasks) if found is None else found
    z, z0 = compose(run, tasks, found, grad, read0)
    return Prefixes(latent_prefixes(run, z, found), z=z, z0=z0, found=found)


def write_back(run, eps):
    """Step 7: successful rollouts join the bank (the bank keeps only successes), and with --replay the successes
    that step 6 replays."""
    run.state['bank'].add([Experience(e.task.task_id, e.task.family, e.task.prompt,
                                                run.env.trajectory_text(e), e.reward) for e in eps])
    if 'wins' in run.state and run.args.replay:  # LOPD's state; another method's bank keeps no wins
        keep_wins(run, eps)


def keep_wins(run, eps):
    """The successes among eps join those --replay draws from (the bank's capacity of them, the oldest go). The
    fill's are kept whatever --replay says: a setup is shared by the runs that differ only after it."""
    if run.state.get('wins') is not None:
        run.state['wins'] += [e for e in eps if e.success]
        del run.state['wins'][:-run.args.bank_capacity]


def replay_loss(run):
    """--replay R (a departure: competence replay): the cold start's loss on R successes drawn from those the run has
    played (the bank's fill, the run's own since), so that step 6 grades φ also on trajectories that worked, not only
    on the student's current rollouts (eq. (3) sees only those). -> a scalar with φ's graph (0 with --replay 0)."""
    wins = run.state.get('wins') or []
    if not run.args.replay or not wins:
        return 0.0
    eps = run.rng.sample(wins, min(run.args.replay, len(wins)))
    rows = [(e, *M.encode_episode(run.tok, e)) for e in eps]
    pick = [r + read for r, read in zip(rows, frozen_reading(run, rows))]
    return lopd.masked_mean(*cold_start_loss(run, pick))


def family_hit(run, eps, found):
    """Diagnostic: the fraction of retrieved experiences from the query's own family (training only)."""
    return run.state['bank'].family_hit_rate([e.task.family for e in eps], found)


# ----------------------------------------------------------------------------- LOPD's cold start

def fill_bank(run, rollout):
    """Before training: base rollouts fill the bank (they count toward the budget). -> all of them,
    and the expert's demos it added, as (episode, body, agent mask)."""
    a, rows = run.args, []
    n = max(a.batch, 64)  # no gradient here: a bigger batch only decodes faster
    for i in tqdm(range(0, a.init_episodes, n), desc='fill bank', dynamic_ncols=True):
        run.lap()
        tasks = run.rng.sample(run.env.train_tasks, min(n, a.init_episodes - i))
        if a.bank_source == 'expert':  # the scripted expert's demos, not the base's own
            eps, bodies, masks = expert_demos(run, tasks)
        else:
            eps, bodies, masks = rollout(run.model, run.tok, run.env, tasks, rows=parallel.decode_rows(run, 0))
            if a.bank_source == 'pool':  # the expert covers the tasks the base failed
                d_eps, d_bodies, d_masks = expert_demos(run, [e.task for e in eps if not e.success])
                eps, bodies, masks = [*eps, *d_eps], [*bodies, *d_bodies], [*masks, *d_masks]
        run.lap('fill')
        run.episodes += len(tasks)  # the pool's demos of failed tasks are free, as OPSD's pool's are
        write_back(run, eps)
        rows += list(zip(eps, bodies, masks))
    return rows


def expert_demos(run, tasks):
    """The scripted expert's demo of each task, played out: -> (episodes, bodies, agent masks)."""
    eps = [envs.play(run.env, t, run.env.demo(t, random.Random(0))) for t in tasks]
    encoded = [M.encode_episode(run.tok, e) for e in eps]
    return eps, [body for body, _ in encoded], [mask for _, mask in encoded]


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
    composed from their retrieved experiences. -> (B, T) per token, and the tokens it is averaged over."""
    keep = torch.tensor([p is not None for p in ctx], device=run.device)
    logits_t = M.logits_on(run.teacher, with_default(run, ctx), ids, attn, run.args.score_chunk)
    mask = amask * keep[:, None].to(amask)
    return -lopd.token_logp(logits_t, ids, mask), mask


def cold_start_text(run, ctx, ids, amask, attn):
    """Text-to-latent distillation: the latents must make the teacher act as the same retrieved
    experiences shown as text do, KL(π_θ0(·|experiences as text) ‖ π_θ0(·|latents)) on every
    agent token of any stored rollout, success or failure (the text teacher knows the right
    next call after a wrong one too). -> (B, T) per token, and the tokens it is averaged over."""
    keep = torch.tensor([p is not None for p in ctx], device=run.device)
    with torch.no_grad():
        text = M.text_prefix(run.teacher, run.tok, [bank_text(f) for f in ctx.found])
        logits_text = M.logits_on(run.teacher, text, ids, attn, run.args.score_chunk)
    logits_z = M.logits_on(run.teacher, with_default(run, ctx), ids, attn, run.args.score_chunk)
    mask = amask * keep[:, None].to(amask)
    return lopd.divergence(logits_z, logits_text, 'fkl', where=mask), mask


COLD_STARTS = {'nll': cold_start_nll, 'text': cold_start_text}


def cold_start(run, rollout):
    """Fill the bank with base rollouts, then pre-train φ (COLD_STARTS: the paper's NLL of the
    successes, or text-to-latent distillation on every rollout), family-balanced by default.
    The bank does not change during the cold start, so each row's retrieval and its frozen
    reading are made once, not at every step (the reading was half of a step's time)."""
    a, s = run.args, run.state
    rows = fill_bank(run, rollout)
    keep_wins(run, [r[0] for r in rows])
    rows = [r for r in rows if r[0].success] if a.cold_start == 'nll' else rows
    run.lap()
    rows = [r + read for i in range(0, len(rows), 32) for r, read in zip(rows[i:i + 32], frozen_reading(run, rows[i:i + 32]))]
    run.lap('cold_start')
    opt = torch.optim.AdamW(phi_params(s['composer'], s['reader']), lr=a.lr_cold_start or a.lr or run.method.lr)  # its own stage
    for _ in (bar := tqdm(range(a.cold_start_steps if rows else 0), desc='cold start', dynamic_ncols=True)):
        run.lap()
        pick = balanced_sample(run.rng, rows, 32) if a.cold_start_sample == 'balanced' else \
            run.rng.sample(rows, min(32, len(rows)))
        if a.micro_batch:  # --micro_batch: φ's gradient accumulated over groups of rows
            loss = functools.partial(cold_start_micro, run, pick, a.micro_batch)
        else:
            loss = lopd.masked_mean(*cold_start_loss(run, pick))
        loss = bk.optimizer_step(run, opt, loss, phi_params(s['composer'], s['reader']))
        run.lap('cold_start')
        if loss is not None:
            bar.set_postfix(loss=f'{float(loss.detach()):.3f}')
    s['composer0'].load_state_dict(s['composer'].state_dict())  # z0: the anchor from here on
    if s['reader'] is not None:
        s['reader0'].load_state_dict(s['reader'].state_dict())


def cold_start_loss(run, pick):
    """The cold start's per-token loss on picked rows (episode, body, mask, found, reading) -> (loss, mask), (B, T)."""
    eps, bodies, masks, found, read0 = zip(*pick)
    ctx = latents(run, eps, grad=True, found=list(found), read0=torch.cat(read0))
    return COLD_STARTS[run.args.cold_start](run, ctx, *M.pad_batch(bodies, masks, run.tok.pad, run.device))


def cold_start_micro(run, pick, rows):
    """The same mean, `rows` rows per forward and backward -> the loss, detached (None: nothing retrieved)."""
    n = sum(sum(r[2]) for r in pick if len(r[3]))                               # the agent tokens the mean is over
    total, grad = 0.0, False
    for i in range(0, len(pick), rows):
        loss, mask = cold_start_loss(run, pick[i:i + rows])
        part = (loss * mask).sum() / max(n, 1)
        if part.requires_grad:
            part.backward()
            grad = True
        total += part.detach()
    return total if grad else None


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


# ----------------------------------------------------------------------------- LOPD's flags (train.lopd_step reads them)

FROZEN = 'freeze_composer'  # the flags of step 6 act only without it
LOPD_FLAGS = {**DISTILL_FLAGS, **BANK_FLAGS,
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
                      "experiences as text", choices=list(COLD_STARTS)),
    'cold_start_sample': arg('balanced', "cold start: draw the bank's rollouts family-balanced, or as stored",
                             choices=['balanced', 'stored']),
    'reader': arg('frozen', 'who reads the experiences for the composer: the frozen base, or a trainable copy',
                  choices=['frozen', 'trained']),
    'advantage': arg('paper', "the margin's weight w(τ) (eq. 2): paper = 2r − 1, centered = r − mean r over the batch, successes = "
                     "max(0, 2r − 1) (a departure: a margin on successes only)", choices=['paper', 'centered', 'successes'],
                     after_setup=True, unless=FROZEN),
    'kl_weight': arg(1.0, "weight of eq. (3)'s KL term (1 = the paper's; 0 = a diagnostic: is it the KL or the drift "
                     "that costs a fast-moving φ its points?)", lo=0, after_setup=True, unless=FROZEN),
    'replay': arg(0, "a departure (competence replay): step 6 adds the cold start's loss on this many successes a step, "
                  "drawn from those the run has played (0 = the paper's eq. (3) alone)", lo=0, after_setup=True, unless=FROZEN),
    'freeze_composer': arg(False, "the paper's frozen-composer ablation: skip step 6, so φ stays at its cold start "
                           "(no margin, no β; when step 6 helps: docs/composer-phase.md)", after_setup=True)
}
