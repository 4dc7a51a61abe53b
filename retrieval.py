"""The experience bank and retriever of LOPD (step 2 of train.py).

The bank stores *successful* trajectories as "action -> result" text, each with a document
embedding (of its task by default; of "task \\n trajectory" with doc_trajectory=True, as in
the paper). A new task is embedded alone as the query; we return the J stored experiences
most cosine-similar to it, for the composer (lopd.py).

    bank = ExperienceBank(hashing_embedder())
    bank.add([Experience("t1", "q3", "q3 bob", "lookup(team, bob) -> red ...", 1.0)])
    bank.retrieve(["q3 alice"], ["t2"], J=3)   # -> [[Experience(task_id="t1", ...)]]

What it leaves out:
- An index. The paper embeds with an outside embedding model and searches a flat FAISS
  index; our bank holds a few thousand entries, so one normalised matrix product
  (cosine_topk) is exact, fast enough and needs no extra dependency.
- A learned embedder. The default is a stateless char n-gram hash that needs no fitting,
  so stored embeddings never go stale as the bank grows. Any callable
  list[str] -> (N, D) array works (e.g. pooled hidden states of the frozen base model).
- Deduplication and priorities: eviction is plain FIFO (oldest out first).

References: Zhang et al. 2026, "Latent On-Policy Self-Distillation" (arXiv 2608.13040);
Johnson et al. 2017, "Billion-scale similarity search with GPUs" (FAISS).
"""
import ast
import json
import os
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

import sandbox

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


def parse_examples(prompt: str, max_chars: int = 400) -> list[tuple]:
    """A code-generation prompt "[3,1]->[4,2]; [0]->[1]" -> [([3, 1], [4, 2]), ([0], [1])].

    Each side is read by ast.literal_eval (data only, never code) on a bounded prefix of the
    text; a part that is not "literal->literal" is skipped, so any text gives a list."""
    out = []
    for part in str(prompt)[:max_chars].split("; "):
        a, arrow, b = part.partition("->")
        try:
            out.append((ast.literal_eval(a.strip()), ast.literal_eval(b.strip()))) if arrow else None
        except Exception:  # SyntaxError, ValueError, MemoryError, RecursionError on odd text
            continue
    return out


def _subsequence(y, x) -> bool:
    it = iter(x)
    return all(any(v == u for u in it) for v in y)


def _ints(v) -> bool:
    return type(v) is list and all(type(e) is int for e in v)


def relation_tests(x, y) -> list[bool]:
    """Yes/no tests of how one output y relates to its input x: types, lengths, order,
    membership, element-wise differences and ratios, what an int output counts. None names a
    task family; together they tell the families' relations apart."""
    seq = type(x) in (list, str) and type(y) is type(x)                      # a list -> list or str -> str function
    n, m = (len(x), len(y)) if seq else (0, 0)
    same_len = seq and m == n
    el = _ints(x) and _ints(y) and same_len and n > 0                         # element-wise, on int lists
    diffs = {b - a for a, b in zip(x, y)} if el else set()
    ratios = {b // a for a, b in zip(x, y) if a} if el and all(a == 0 or b % a == 0 for a, b in zip(x, y)) else set()
    count = type(y) is int and type(x) in (list, str)                          # an int computed from a sequence
    return [type(x) is list, type(x) is str, type(y) is list, type(y) is str, type(y) is int,
            seq and m > n, same_len, seq and m < n, seq and n > 0 and m == 2 * n, seq and n > 0 and m == 3 * n,
            seq and sorted(x) == sorted(y), seq and list(y) == sorted(x), seq and list(y) == sorted(x, reverse=True),
            seq and y == x[::-1], seq and y == x[:m], seq and m <= n and y == x[n - m:],
            seq and _subsequence(y, x), seq and all(v in x for v in y),
            same_len and any(y == x[i:] + x[:i] for i in range(1, n)),   # a rotation by 1..n-1
            seq and n > 0 and m % n == 0 and y == x * (m // n), seq and y == x + x[::-1], seq and m > n and y[:n] == x,
            seq and n > 1 and y == x[::2], seq and n > 2 and y == x[::3],
            el and len(diffs) == 1, el and len(diffs) == 1 and min(diffs) > 0, el and len(ratios) == 1 and min(ratios) > 1,
            count and _ints(x) and y == sum(x), count and y == len(x), count and 0 <= y < len(x), count and y in x,
            count and _ints(x) and len(x) > 0 and y == max(x)]


RELATION_DIM = len(relation_tests([0], [0]))


def relation_embedder() -> Callable[[list[str]], np.ndarray]:
    """Code generation's embedder: a prompt of input->output examples -> the mean over its examples
    of relation_tests (float32 (N, RELATION_DIM)); a text with no example is the zero vector.

    The prompt is numbers and brackets, so char n-grams mostly match tasks that share digits, not
    functions: on 250 held-out queries against 600 stored tasks (J = 3) they find the query's
    family 0.54 of the time, these tests 0.98."""
    def embed(texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), RELATION_DIM), dtype=np.float32)
        for i, t in enumerate(texts):
            examples = parse_examples(t)
            if examples:
                out[i] = np.mean([relation_tests(x, y) for x, y in examples], axis=0)
        return out

    return embed


def execution_rerank(task: str, candidates: list[Experience]) -> list[float]:
    """Code generation's reranker: the fraction of the task's shown examples that each candidate's
    program (its trajectory: a stored success is its passing program) reproduces. Same family and
    same constant = the same function, so the relation embedder's shortlist is sorted by what
    solves *this* task. The programs are model output: they run only through sandbox.safe_eval's
    checks and interpreter, each program compiled once; the cost per query is at most
    rerank_pool × 3 runs, each within the evaluator's step budget."""
    examples = parse_examples(task)
    if not examples:
        return [0.0] * len(candidates)

    def reproduced(program):
        lam, reason = sandbox.compile_program(program)
        if reason:
            return 0.0
        runs = [sandbox.run_program(lam, x) for x, _ in examples]  # (value, error) each, never raises
        return sum(err is None and sandbox.code_repr(got) == sandbox.code_repr(y)
                   for (got, err), (_, y) in zip(runs, examples)) / len(examples)

    score = {}  # the same program is run once, however many experiences hold it
    for e in candidates:
        if e.text not in score:
            score[e.text] = reproduced(e.text)
    return [score[e.text] for e in candidates]


EMBEDDERS = {"ngram": hashing_embedder, "relation": relation_embedder}  # name -> maker of an embedder
RERANKERS = {"none": None, "execution": execution_rerank}


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
    doc_trajectory=True embeds "task \n trajectory" as the document (the paper, with a
    trained query/document embedding model); our default embeds the task alone, like the
    query: a bag of char n-grams has no query/document asymmetry, and the trajectory's
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
