"""The layout is the table of contents: at the top level only the files a student reads to follow
LOPD (at most seven), the rest in at most three folders named by role, and no import circle. The
module graph is built from the source (every `import` and `from ... import`, at any depth), so
an import hidden inside a function counts too."""
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOP = ["train.py", "lopd.py", "retrieval.py", "envs.py", "model.py", "tokenizer.py", "warmup.py"]
FOLDERS = ["plumbing", "plugins", "bench"]  # below the core; the methods and environments it lists; above it


def modules():
    """module name -> its file, for every .py of the repo outside tests/."""
    out = {}
    for folder in ["", *FOLDERS]:
        for f in sorted(os.listdir(os.path.join(ROOT, folder))):
            if f.endswith(".py"):
                name = f[:-3] if not folder else f"{folder}.{f[:-3]}".removesuffix(".__init__")
                out[name] = os.path.join(ROOT, folder, f)
    return out


def imports(path, known):
    """The repo modules a file imports (`from bench import gap` -> bench.gap, `from retrieval import X` -> retrieval)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n:
                found.add(n)
    return found


def graph():
    mods = modules()
    return {m: imports(p, mods) - {m} for m, p in mods.items()}


def cycle(g):
    """One import circle as a list of modules, or None (depth-first search, white/grey/black)."""
    state, stack = {}, []

    def visit(m):
        state[m] = "grey"
        stack.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == "grey":
                return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        state[m] = "black"
        stack.pop()
        return None
    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_no_import_circle():
    assert cycle(graph()) is None, " -> ".join(cycle(graph()))


def test_the_cycle_finder_finds_a_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_top_level_is_the_core_and_the_rest_is_in_three_folders():
    top = sorted(f for f in os.listdir(ROOT) if f.endswith(".py"))
    assert top == sorted(TOP)
    with_code = sorted(d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d)) and d not in ("tests", "notebooks", "runs", ".git", ".venv")
                       and any(f.endswith(".py") for f in os.listdir(os.path.join(ROOT, d))))
    assert with_code == sorted(FOLDERS)


def test_arrows_point_into_the_core():
    """Nothing imports the bench but the bench; only train.py (its list of plugins) imports plugins/ from the
    core; plumbing/ imports neither."""
    g = graph()
    for m, deps in g.items():
        if not m.startswith("bench"):
            assert not {d for d in deps if d.startswith("bench")}, m
        if m.startswith("plumbing") or (m + ".py" in TOP and m != "train"):
            assert not {d for d in deps if d.startswith("plugins")}, m


# what plumbing/ may import from the core: what sits under the algorithm (the model, its math, the environments);
# assemble, which builds a run, also the warm-up that builds its base
UNDER_THE_ALGORITHM = {"model", "lopd", "tokenizer", "envs"}
BUILDS_A_RUN = {"plumbing.assemble": {"warmup"}}


def test_plumbing_sits_below_the_algorithm():
    """plumbing/ imports nothing above the model: not train.py, not the bank and the composer (retrieval.py),
    not the warm-up or the cold start (warmup.py), which are algorithm, except where a run is assembled."""
    for m, deps in graph().items():
        if m.startswith("plumbing"):
            core = {d for d in deps if not d.startswith("plumbing")}
            assert core <= UNDER_THE_ALGORITHM | BUILDS_A_RUN.get(m, set()), (m, core)
