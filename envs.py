"""Text environments with verifiable 0/1 reward.

Every environment speaks the same small interface, which is all the algorithm sees:

    env.make_tasks(n, seed, families)   -> list[Task]       (fixed by the seed)
    env.train_tasks, env.eval_tasks     -> the training pool and the held-out set
    env.reset(task)                     -> Episode
    env.step(episode, action_text)      -> Step(obs, reward, done, feedback)
    env.demo(task, rng, noisy)          -> list of actions   (scripted / noisy expert)
    env.trajectory_text(episode)        -> compact "action -> result" text (the bank's form)

An `Episode` holds the turns so far; the model-side code (model.encode_episode) turns it into
tokens. Model output is untrusted: malformed or hostile text gets an error
observation and reward 0, never an exception, and every episode ends within
`max_turns` agent turns.

Tool use (multi-turn). Each task draws a small random world: 12 people, each with a
city of their own, a team and a manager; each of 4 teams has a lead. The agent calls one
tool per turn, `manager(x)`, `city(x)`, `team(x)` or `lead(t)`, reads the result, and finally
writes `answer y`. A task family is a fixed tool plan. Transparent families say their plan
("city of manager of bo"); opaque ones do not ("quandle bo" = city of lead of team of bo),
so their plan can only be learned from experience, and one opaque family ("snarfle")
never appears in the warm-up data. Answers are copied from observations, never computed, so
they can only be known by calling the tools; and each world is redrawn until no other plan
an episode can run reaches its answer, so a success always means the family's plan (a lucky
answer from a wrong plan would be an experience that teaches the wrong plan).

Code generation (multi-turn, up to two attempts). The task shows input/output examples
of a small list or string function; the agent writes `lambda x: ...` in a restricted
Python-expression subset, run against hidden tests by `safe_eval`, a small AST
interpreter with size and step budgets (the security boundary: its rules are in its
docstring). A failed first attempt gets the first failing test as feedback.

Left out: tools with several arguments, partial credit, distractor tools, statements.
"""
import ast
import functools
import random
import re
import time
from dataclasses import dataclass, field


@dataclass
class Task:
    prompt: str            # what the agent (and the student) sees
    family: str            # task family name
    task_id: str           # identity of this task instance
    answer: str            # the verifiable reference answer
    solution: str          # reference solution as text (what OPSD's teacher is shown)
    world: dict = field(default_factory=dict, repr=False)  # hidden state, never shown to the agent


@dataclass
class Episode:
    task: Task
    turns: list = field(default_factory=list)  # [(action, observation)], observation '' on the last turn
    reward: float = 0.0
    done: bool = False
    feedback: str = ''     # the environment's verdict on a finished attempt (SDPO's teacher reads it)


@dataclass
class Step:
    obs: str
    reward: float
    done: bool
    feedback: str


# ----------------------------------------------------------------------------- tool use

NAMES = ['ada', 'bo', 'cy', 'di', 'ed', 'flo', 'gus', 'hal', 'ivy', 'jo', 'kai', 'lu',
         'max', 'ned', 'oz', 'pia', 'quin', 'ray', 'sue', 'ted', 'uma', 'vic', 'wes', 'zoe']
CITIES = ['oslo', 'rome', 'lima', 'kyiv', 'baku', 'doha', 'riga', 'nice', 'bern', 'faro', 'pisa', 'york',
          'bonn', 'cork', 'graz', 'kiel', 'lyon', 'metz', 'oulu', 'turin', 'varna', 'nara', 'vigo', 'sofia']
TEAMS = ['red', 'blue', 'green', 'gold', 'gray', 'pink']
TOOLS = {'manager': 'person', 'city': 'person', 'team': 'person', 'lead': 'team'}  # tool -> argument type

# family -> tool plan, applied left to right to the person in the prompt.
FAMILIES = {
    'city of X': ['city'],
    'manager of X': ['manager'],
    'city of manager of X': ['manager', 'city'],
    'lead of team of X': ['team', 'lead'],
    'manager of manager of X': ['manager', 'manager'],
    # opaque: the name says nothing about the plan (made-up words, long enough that a
    # character n-gram retriever can tell them apart from the person's name)
    'zorbify X': ['team', 'lead', 'manager'],
    'quandle X': ['team', 'lead', 'city'],
    'mirthen X': ['manager', 'team', 'lead'],
    'plovish X': ['manager', 'manager', 'city'],
    'snarfle X': ['manager', 'team', 'lead', 'city'],
}
OPAQUE = [f for f in FAMILIES if ' of ' not in f]
UNSEEN = 'snarfle X'  # absent from the warm-up data
WARMUP_FAMILIES = [f for f in FAMILIES if f != UNSEEN]

CALL = re.compile(r'^([a-z]+)\(([a-z]+)\)$')
MAX_ACTION_CHARS = 64


def random_world(rng):
    people = rng.sample(NAMES, 12)
    teams = rng.sample(TEAMS, 4)
    world = {'people': people, 'teams': teams, 'lead': {t: rng.choice(people) for t in teams}}
    for p, city in zip(people, rng.sample(CITIES, len(people))):  # one city per person
        world[p] = {'city': city, 'team': rng.choice(teams),
                    'manager': rng.choice([q for q in people if q != p])}
    return world


def call_tool(world, tool, arg):
    """One tool call on the world -> (result, error). Never raises."""
    if tool not in TOOLS:
        return None, f"error: unknown tool '{tool}'"
    if TOOLS[tool] == 'team':
        if arg not in world['teams']:
            return None, f"error: no team '{arg}'"
        return world['lead'][arg], None
    if arg not in world['people']:
        return None, f"error: no person '{arg}'"
    return world[arg][tool], None


def type_correct_plans(max_calls):
    """Every tool plan of 1..max_calls calls whose calls type-check and whose result is a person or a city."""
    plans = []

    def grow(plan, kind):
        if plan and kind != 'team':
            plans.append(plan)
        if kind == 'city' or len(plan) == max_calls:
            return
        for tool in (['lead'] if kind == 'team' else ['manager', 'city', 'team']):
            grow(plan + [tool], {'manager': 'person', 'lead': 'person'}.get(tool, tool))
    grow([], 'person')
    return plans


MAX_CALLS = 5                     # max_turns 6 = 5 calls + the answer
ALL_PLANS = type_correct_plans(MAX_CALLS)   # everything an agent can run in one episode (31 plans)
GUESSES = type_correct_plans(4)   # the noisy expert's guesses (18 plans, every opaque plan among them)


def random_plan(rng, avoid=None):
    """The noisy expert's guess: one of the 18 plans of 1-4 calls, uniformly; redrawn while it equals `avoid`."""
    plan = rng.choice(GUESSES)
    while plan == avoid:
        plan = rng.choice(GUESSES)
    return list(plan)


def run_plan(world, plan, x):
    for tool in plan:
        x, _ = call_tool(world, tool, x)
    return x


@functools.lru_cache(maxsize=16)  # the redraws cost ~3.5 s per env; tasks are never mutated, so a process shares them
def _tool_tasks(n, seed, families, split):
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        family = families[i % len(families)]
        plan = FAMILIES[family]
        while True:  # redraw the world until the answer is reached by this family's plan only:
            world = random_world(rng)  # then a right answer means the right plan (no lucky
            x = rng.choice(world['people'])  # wins to learn a wrong plan from), and echoing the
            answer = run_plan(world, plan, x)  # name asked about is never a solution
            if answer != x and all(run_plan(world, p, x) != answer for p in ALL_PLANS if p != plan):
                break
        steps, value = [], x
        for tool in plan:
            result, _ = call_tool(world, tool, value)
            steps.append(f'{tool}({value}) -> {result}')
            value = result
        solution = '; '.join(steps + [f'answer {answer}'])
        tasks.append(Task(prompt=family.replace('X', x), family=family, task_id=f'{split}{seed}-{i}',
                          answer=answer, solution=solution, world=world))
    return tasks


class ToolUse:
    name = 'tooluse'
    max_turns = 6           # 4 calls at most + answer + one slack turn for a mistake
    max_action_tokens = 24  # bytes per agent turn; 'manager(quin)' is 13
    families = list(FAMILIES)
    warmup_families = WARMUP_FAMILIES
    opaque = OPAQUE
    embedder = 'ngram'      # the retriever's (retrieval.EMBEDDERS): the prompt's words tell a family
    rerank = 'none'         # and its reranker (retrieval.RERANKERS)
    defaults = {}           # train.py flags whose default differs in this environment

    def __init__(self, n_train=4000, n_eval=250, seed=0):
        # fixed pools: the training tasks repeat (so same-task retrieval can happen), the
        # held-out tasks use their own seed and fresh worlds, and are balanced by family
        self.train_tasks = self.make_tasks(n_train, seed=10_000 + seed, split='train')
        self.eval_tasks = self.make_tasks(n_eval, seed=20_000 + seed, split='eval')

    def make_tasks(self, n, seed, families=None, split='t'):
        return list(_tool_tasks(n, seed, tuple(families or self.families), split))

    def reset(self, task):
        return Episode(task=task)

    def step(self, ep, action):
        """Apply one agent action. Malformed text is an error observation, never an exception."""
        if ep.done:
            return Step('', ep.reward, True, ep.feedback)
        action = action.strip() if isinstance(action, str) else ''
        world = ep.task.world
        obs, reward, done = '', 0.0, False
        if action.startswith('answer '):
            given = action[len('answer '):].strip()
            reward, done = float(given == ep.task.answer), True
            ep.feedback = 'correct' if reward else f"the answer '{given[:MAX_ACTION_CHARS]}' is wrong"
        else:
            m = CALL.match(action) if len(action) <= MAX_ACTION_CHARS else None
            if m is None:
                obs = 'error: write tool(arg) or answer X'
            else:
                result, err = call_tool(world, m.group(1), m.group(2))
                obs = err or result
        ep.turns.append((action[:MAX_ACTION_CHARS * 2], obs))
        if not done and len(ep.turns) >= self.max_turns:
            done, ep.feedback = True, f'no answer after {self.max_turns} turns'
            ep.turns[-1] = (ep.turns[-1][0], '')
        ep.reward, ep.done = reward, done
        return Step(obs if not done else '', reward, done, ep.feedback if done else '')

    def demo(self, task, rng, noisy=False, plan=None):
        """Scripted expert (always right) or noisy expert (the warm-up data).

        The noisy expert follows the right plan on transparent families 85% of the time;
        on opaque families it knows nothing and guesses one of 18 plans uniformly (the true
        one among them: the base can find it by exploring, but prefers no plan), so the
        base model has to learn those plans from experience. `plan` forces a tool plan (the warm-up's
        context-reading demos use random plans, so that they never reveal an opaque one)."""
        plan = plan or FAMILIES[task.family]
        if noisy and (task.family in OPAQUE or rng.random() < 0.15):
            plan = random_plan(rng)
        x = task.prompt.split()[-1]
        actions, value = [], x
        for tool in plan:
            actions.append(f'{tool}({value})')
            value, _ = call_tool(task.world, tool, value)
        return actions + [f'answer {value}']

    def trajectory_text(self, ep):
        parts = [f'{a} -> {o}' if o else a for a, o in ep.turns]
        return '; '.join(parts)


# ----------------------------------------------------------------------------- code generation
#
# A task shows 2-3 input/output examples of a small list or string function, e.g.
#     [3,1,2]->[5,3,4]; [0,7]->[2,9]; [4,4,1]->[6,6,3]
# and the agent writes one program, e.g. `lambda x: [v+2 for v in x]`. The program runs
# on 8 tests (the shown examples, 4 random hidden ones and a probe that tells k from its
# neighbours); reward 1 if all pass. A failed first attempt gets one line of feedback on
# the first failing test and a second try. Families are program templates with a random
# constant k; the examples often pin k down only loosely ('take' on short lists,
# 'keep_gt' without values near k) while the hidden probe does not, which is what the
# feedback turn is for. 'mirror' never appears in the warm-up data.
#
# The programs are model output, i.e. hostile input: they are checked against an AST
# whitelist and run by a small interpreter (safe_eval) with size and step budgets,
# never by Python's eval. Left out: statements, dicts and sets (set order of strings
# varies between processes, which would make rewards irreproducible), partial credit.

# family -> (input kind, range of k or None, reference f(x, k), program, plausible wrong
# programs). In templates {k} is the task's constant and {j} its off-by-one neighbour.
PROGRAM_FAMILIES = {
    'add': ('list', (1, 4), lambda x, k: [v + k for v in x], 'lambda x: [v+{k} for v in x]',
            ['lambda x: [v+{j} for v in x]', 'lambda x: [v-{k} for v in x]', 'lambda x: [v*{k} for v in x]']),
    'mul': ('list', (2, 3), lambda x, k: [v * k for v in x], 'lambda x: [v*{k} for v in x]',
            ['lambda x: [v+{k} for v in x]', 'lambda x: [v*{j} for v in x]', 'lambda x: x*{k}']),
    'keep_gt': ('list', (2, 6), lambda x, k: [v for v in x if v > k], 'lambda x: [v for v in x if v>{k}]',
                ['lambda x: [v for v in x if v>{j}]', 'lambda x: [v for v in x if v<{k}]',
                 'lambda x: [v for v in x if v>={k}]']),
    'count': ('digits', (0, 3), lambda x, k: x.count(k), 'lambda x: sum(v=={k} for v in x)',
              ['lambda x: sum(v=={j} for v in x)', 'lambda x: sum(v>{k} for v in x)', 'lambda x: len(x)']),
    'take': ('list', (1, 3), lambda x, k: x[:k], 'lambda x: x[:{k}]',
             ['lambda x: x[:{j}]', 'lambda x: x[{k}:]', 'lambda x: x[-{k}:]']),
    'reverse': ('list', None, lambda x, k: x[::-1], 'lambda x: x[::-1]',
                ['lambda x: sorted(x)', 'lambda x: x[:0:-1]', 'lambda x: sorted(x)[::-1]']),
    'sort': ('list', None, lambda x, k: sorted(x), 'lambda x: sorted(x)',
             ['lambda x: sorted(x)[::-1]', 'lambda x: x[::-1]', 'lambda x: sorted(x)[1:]']),
    'sum': ('list', None, lambda x, k: sum(x), 'lambda x: sum(x)',
            ['lambda x: len(x)', 'lambda x: max(x)', 'lambda x: sum(x[1:])']),
    'every2': ('list', None, lambda x, k: x[::2], 'lambda x: x[::2]',
               ['lambda x: x[1::2]', 'lambda x: x[::3]', 'lambda x: x[:2]']),
    'repeat': ('str', (2, 3), lambda x, k: x * k, 'lambda x: x*{k}',
               ['lambda x: x*{j}', 'lambda x: x+x[::-1]', 'lambda x: x[::-1]*{k}']),
    'rotate': ('str', (1, 2), lambda x, k: x[k:] + x[:k], 'lambda x: x[{k}:]+x[:{k}]',
               ['lambda x: x[{j}:]+x[:{j}]', 'lambda x: x[-{k}:]+x[:-{k}]', 'lambda x: x[{k}:]']),
    'mirror': ('str', None, lambda x, k: x + x[::-1], 'lambda x: x+x[::-1]',  # absent from warm-up
               ['lambda x: x*2', 'lambda x: x[::-1]', 'lambda x: x[::-1]+x']),
}
PROGRAM_WARMUP_FAMILIES = [f for f in PROGRAM_FAMILIES if f != 'mirror']
NOISY_RIGHT, NOISY_FIX = 0.6, 0.5  # noisy expert: P(first program right), P(second right after a miss)

# Evaluator limits. A correct program is < 40 chars, ~15 nodes and < 200 steps per test,
# so every limit sits far above honest use and far below anything slow.
MAX_PROGRAM_CHARS = 160
MAX_NODES = 100
MAX_CELLS = 1000       # size of any value: 1 per object + 1 per char, through nesting
MAX_INT_BITS = 64
MAX_STEPS = 10_000     # per test: node visits + cells created, copied or compared
MAX_SECONDS = 0.5      # per test, a backstop only: the step budget binds first


def _range(*args):
    r = range(*args)
    if len(r) > MAX_CELLS:  # len() of a range is O(1); refuse before building the list
        raise _Reject('range too large')
    return list(r)


# The only callables a program can reach, and only by a direct call: names of builtins
# are never values, so nothing can be passed around, called back or inspected.
# reversed and range return lists (not iterators) so every value is plain data.
SAFE_BUILTINS = {'abs': abs, 'all': all, 'any': any, 'int': int, 'len': len, 'list': list,
                 'max': max, 'min': min, 'range': _range, 'reversed': lambda s: list(reversed(s)),
                 'sorted': sorted, 'str': str, 'sum': sum}
_ARITH = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
          ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b, ast.Pow: lambda a, b: a ** b}
_CMP = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
        ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
        ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_ALLOWED = {ast.Name, ast.Load, ast.Store, ast.Constant, ast.List, ast.Tuple, ast.ListComp,
            ast.GeneratorExp, ast.comprehension, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare,
            ast.IfExp, ast.Call, ast.Subscript, ast.Slice, ast.USub, ast.UAdd, ast.Not, ast.And,
            ast.Or, *_ARITH, *_CMP}  # note: no Lambda below the top, no Attribute, no Starred
_INT, _SEQ = (int, bool), (list, tuple, str)


class _Reject(Exception):
    """A rule of the evaluator was broken; the message is the one-line reason."""


class _Budget:
    """Deterministic work budget for one test, plus a wall-clock backstop (no signals,
    no threads, so it is safe to call from any thread and leaves nothing behind)."""

    def __init__(self):
        self.left, self.deadline = MAX_STEPS, time.monotonic() + MAX_SECONDS

    def charge(self, n=1):
        self.left -= n
        if self.left < 0:
            raise _Reject('step budget exceeded')
        if time.monotonic() > self.deadline:
            raise _Reject('time limit exceeded')


def _line(s, n=100):
    return ' '.join(str(s).split())[:n]  # one line, bounded


def code_repr(v, n=None):
    """Compact repr used in prompts and feedback: [3, 1] -> '[3,1]', 'ab' -> "'ab'"."""
    if type(v) in (list, tuple):
        s = ','.join(code_repr(e) for e in v)
        s = f'[{s}]' if type(v) is list else f'({s}{"," if len(v) == 1 else ""})'
    else:
        s = repr(v)
    return s if n is None or len(s) <= n else s[:n] + '...'


def compile_program(src):
    """Parse and verify a program -> (ast.Lambda, None) or (None, reason). Never raises.

    Rules: printable ASCII only (so no NUL bytes and no unicode names that Python would
    NFKC-normalise into `eval` or `__class__`), no backslashes, <= MAX_PROGRAM_CHARS,
    exactly `lambda NAME: expr`, <= MAX_NODES nodes, every node in _ALLOWED, constants
    are int (<= 64 bits) / str / bool / None, names never start with '_', a name is the
    lambda's argument, a comprehension variable, or a SAFE_BUILTINS entry used directly
    as the callee of a call with <= 3 positional arguments."""
    if not isinstance(src, str):
        return None, 'not text'
    if len(src) > MAX_PROGRAM_CHARS:
        return None, f'longer than {MAX_PROGRAM_CHARS} chars'
    if not all(' ' <= c <= '~' for c in src) or '\\' in src:
        return None, 'only printable ASCII, no backslashes'
    try:  # short input, but catch everything: SyntaxError, ValueError, RecursionError, MemoryError
        tree = ast.parse(src, mode='eval')
    except Exception as e:
        return None, _line(f'syntax error: {getattr(e, "msg", type(e).__name__)}', 60)
    lam = tree.body
    if type(lam) is not ast.Lambda:
        return None, 'write lambda x: <expression>'
    a = lam.args
    if a.posonlyargs or a.kwonlyargs or a.vararg or a.kwarg or a.defaults or len(a.args) != 1:
        return None, 'the lambda takes exactly one plain argument'
    nodes = list(ast.walk(lam.body))  # the top Lambda itself is not in here, so a nested one is rejected
    if len(nodes) > MAX_NODES:
        return None, f'more than {MAX_NODES} syntax nodes'
    bad = next((n for n in nodes if type(n) not in _ALLOWED), None)  # node types first: clearest reason
    if bad is not None:
        return None, f'{type(bad).__name__} not allowed'
    bound, callees = {a.args[0].arg}, set()
    for n in nodes:
        if type(n) is ast.comprehension:
            if type(n.target) is not ast.Name or n.is_async:
                return None, 'a comprehension variable must be one name'
            bound.add(n.target.id)
        elif type(n) is ast.Call:
            if type(n.func) is not ast.Name or n.func.id not in SAFE_BUILTINS:
                return None, 'only calls to ' + ','.join(SAFE_BUILTINS)
            if n.keywords or len(n.args) > 3:
                return None, 'calls take at most 3 positional arguments'
            callees.add(id(n.func))
        elif type(n) is ast.Constant:
            v = n.value
            if type(v) not in (int, bool, str, type(None)) or (type(v) is int and v.bit_length() > MAX_INT_BITS):
                return None, f'constant {_line(repr(v), 20)} not allowed'
    for name in bound:
        if name.startswith('_') or name in SAFE_BUILTINS:
            return None, f"'{name}' cannot be a variable name"
    for n in nodes:
        if type(n) is ast.Name:
            if n.id.startswith('_'):
                return None, f"name '{n.id[:20]}' not allowed"
            if (n.id in SAFE_BUILTINS) != (id(n) in callees) or n.id not in bound | set(SAFE_BUILTINS):
                return None, f"name '{n.id[:20]}' not allowed here"
    return lam, None


def check_program(src):
    """None if the program passes the static rules, else the one-line reason."""
    return compile_program(src)[1]


def _size(v, b):
    """Check a new value (plain data, ints <= 64 bits, <= MAX_CELLS in all) and charge its
    size to the budget. Shared sub-lists count every time they appear, because that is
    what printing or comparing them costs. Returns v."""
    cells, stack = 0, [v]
    while stack:
        u = stack.pop()
        cells += 1
        t = type(u)
        if t in _INT:
            if u.bit_length() > MAX_INT_BITS:
                raise _Reject('number too large')
        elif t is str:
            cells += len(u)
        elif t not in (list, tuple) and u is not None:
            raise _Reject(f'values of type {t.__name__} not allowed')
        if cells + (len(u) if t in (list, tuple) else 0) > MAX_CELLS:  # before pushing: the walk stays bounded
            raise _Reject('value too large')
        if t in (list, tuple):
            stack.extend(u)
    b.charge(cells)
    return v


def _len(v):
    return len(v) if type(v) in _SEQ else 1


def _binop(op, x, y, b):
    t, ints = type(op), type(x) in _INT and type(y) in _INT
    if t is ast.Add and not ints and type(x) is type(y) and type(x) in _SEQ:
        b.charge(len(x) + len(y))
        return x + y
    if t is ast.Mult and not ints:
        seq, k = (x, y) if type(y) in _INT else (y, x)
        if type(seq) in _SEQ and type(k) in _INT:
            if len(seq) * max(k, 0) > MAX_CELLS:  # refuse before allocating ('a'*10**9)
                raise _Reject('repetition too large')
            b.charge(len(seq) * max(k, 0))
            return seq * k
    if ints:  # Mod on a str would be %-formatting ('%999999999d' % 1): ints only
        if t is ast.Pow:
            if y < 0:
                raise _Reject('negative exponent')
            if abs(x) > 1 and (x.bit_length() - 1) * y > MAX_INT_BITS:  # lower bound on result bits
                raise _Reject('number too large')
        return _ARITH[t](x, y)
    raise _Reject(f'unsupported operands for {t.__name__}: {type(x).__name__}, {type(y).__name__}')


def _ev(n, env, b):
    """Evaluate a verified expression node. Recursion depth <= the AST's, which the
    source length bounds; loops only come from comprehensions, which charge b."""
    b.charge()
    t = type(n)
    if t is ast.Constant:
        return n.value
    if t is ast.Name:
        if n.id not in env:
            raise _Reject(f"name '{n.id}' is not defined")
        return env[n.id]
    if t is ast.BinOp:
        return _size(_binop(n.op, _ev(n.left, env, b), _ev(n.right, env, b), b), b)
    if t is ast.UnaryOp:
        v = _ev(n.operand, env, b)
        if type(n.op) is ast.Not:
            return not v
        if type(v) not in _INT:
            raise _Reject('unary minus/plus needs an int')
        return -v if type(n.op) is ast.USub else +v
    if t is ast.BoolOp:  # short-circuit, returns the deciding value like Python
        for e in n.values:
            v = _ev(e, env, b)
            if bool(v) == (type(n.op) is ast.Or):
                return v
        return v
    if t is ast.Compare:  # chained: a < b < c
        left = _ev(n.left, env, b)
        for op, e in zip(n.ops, n.comparators):
            right = _ev(e, env, b)
            b.charge(_len(left) + _len(right))
            if not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    if t is ast.IfExp:
        return _ev(n.body if _ev(n.test, env, b) else n.orelse, env, b)
    if t in (ast.List, ast.Tuple):
        vals = [_ev(e, env, b) for e in n.elts]
        return _size(vals if t is ast.List else tuple(vals), b)
    if t in (ast.ListComp, ast.GeneratorExp):  # a generator is evaluated eagerly, into a list
        out = []
        _comp(n, 0, env, out, b)
        return _size(out, b)
    if t is ast.Subscript:
        v = _ev(n.value, env, b)
        if type(v) not in _SEQ:
            raise _Reject('only lists, tuples and strings can be indexed')
        s = n.slice
        parts = [s.lower, s.upper, s.step] if type(s) is ast.Slice else [s]
        parts = [None if e is None else _ev(e, env, b) for e in parts]
        if any(p is not None and type(p) not in _INT for p in parts):
            raise _Reject('indices must be ints')
        b.charge(len(v))
        return v[slice(*parts)] if type(s) is ast.Slice else v[parts[0]]
    if t is ast.Call:  # the callee is looked up here; it is never a value
        args = [_ev(e, env, b) for e in n.args]
        b.charge(sum(_len(a) for a in args))
        return _size(SAFE_BUILTINS[n.func.id](*args), b)
    raise _Reject(f'{t.__name__} not allowed here')  # e.g. a Slice inside a tuple index


def _comp(n, i, env, out, b):
    """Nested loops of a comprehension: generator i binds its variable in a copy of env."""
    if i == len(n.generators):
        out.append(_ev(n.elt, env, b))
        return
    g = n.generators[i]
    seq = _ev(g.iter, env, b)
    if type(seq) not in _SEQ:
        raise _Reject('can only loop over lists, tuples and strings')
    for v in seq:
        b.charge()
        inner = {**env, g.target.id: v}
        if all(_ev(c, inner, b) for c in g.ifs):
            _comp(n, i + 1, inner, out, b)


def run_program(lam, x):
    """Run a verified program (from compile_program) on one input -> (value, error)."""
    b = _Budget()
    try:
        return _size(_ev(lam.body, {lam.args.args[0].arg: x}, b), b), None
    except _Reject as e:
        return None, str(e)
    except Exception as e:  # ZeroDivisionError, IndexError, TypeError, RecursionError, MemoryError...
        return None, _line(f'{type(e).__name__}: {e}', 60)


def safe_eval(src, x):
    """Run the program text `src` on input x -> (value, None) or (None, reason). Never raises.

    The security boundary: src is hostile. It is parsed with ast, verified by
    compile_program (whitelist: one top `lambda x:`, comprehensions, slicing, + - * // % **,
    comparisons, and/or/not, conditional expressions, list/tuple displays, direct calls
    of SAFE_BUILTINS; no attributes, dunder names, imports, nested lambdas, starred, walrus
    or f-strings), and walked by our own interpreter (_ev); it is never compiled, so it
    cannot reach Python's builtins, frames or objects, and recursion cannot be written.
    At run time every value is plain data (int/bool/str/None/list/tuple) of <= MAX_CELLS
    cells with ints <= 64 bits; ** and repetition are refused before computing results
    over those limits, range before building them; str % is refused; each test has
    MAX_STEPS of work and MAX_SECONDS of wall clock. No file system, no process effects."""
    lam, reason = compile_program(src)
    return (None, f'rejected: {reason}') if reason else run_program(lam, x)


def run_tests(src, tests):
    """All tests [(input, expected)] -> (passed, one-line verdict on the first failure)."""
    lam, reason = compile_program(src)
    if reason:
        return False, f'rejected: {reason}'
    for x, want in tests:
        got, err = run_program(lam, x)
        if err:
            return False, _line(f'error f({code_repr(x)}): {err}')
        if code_repr(got) != code_repr(want):  # compares type too: True is not 1, (1,) is not [1]
            return False, _line(f'failed f({code_repr(x)}): got {code_repr(got, 24)}, expected {code_repr(want)}')
    return True, 'correct'


def _random_input(kind, rng, shown):
    """Shown examples are 2-4 long (informative); hidden tests 0-5 lists, 1-5 strings."""
    n = rng.randint(2, 4) if shown else rng.randint(1 if kind == 'str' else 0, 5)
    if kind == 'str':
        return ''.join(rng.choice('abcdefgh') for _ in range(n))
    return [rng.randint(0, 3 if kind == 'digits' else 9) for _ in range(n)]


def _probe(kind, k, rng):
    """One hidden input that separates k from k+-1 in every family: distinct values that
    include k and k+1, two copies of k among the digits, 5 letters for rotations."""
    if kind == 'str':
        return ''.join(rng.sample('abcdefgh', 5))
    v = [k, k] + [d for d in range(4) if d != k] if kind == 'digits' else \
        [k, k + 1] + rng.sample([d for d in range(10) if d not in (k, k + 1)], 3)
    rng.shuffle(v)
    return v


class CodeGen:
    name = 'codegen'
    max_turns = 2           # a program, then one more after feedback on the first failing test
    max_action_tokens = 72  # bytes per program; the longest reference program is 36
    families = list(PROGRAM_FAMILIES)
    warmup_families = PROGRAM_WARMUP_FAMILIES
    embedder = 'relation'   # the retriever's: what each example's output is of its input, not its digits
    rerank = 'execution'    # then the stored programs that reproduce this task's examples first
    # LOPD's teacher after 100 / 200 / 300 cold-start steps: +12.5 / +16 / +18.5 points above the
    # student (the same experiences as text: +19.5)
    defaults = {'cold_start_steps': 300}

    def __init__(self, n_train=4000, n_eval=250, seed=0):
        # as in ToolUse: a repeating training pool and a family-balanced held-out set,
        # each from its own seed
        self.train_tasks = self.make_tasks(n_train, seed=10_000 + seed, split='train')
        self.eval_tasks = self.make_tasks(n_eval, seed=20_000 + seed, split='eval')

    def make_tasks(self, n, seed, families=None, split='t'):
        rng = random.Random(seed)
        families = families or self.families
        tasks = []
        for i in range(n):
            family = families[i % len(families)]
            kind, ks, f, program, _ = PROGRAM_FAMILIES[family]
            k = rng.randint(*ks) if ks else 0
            shown = []
            while len(shown) < 3:
                x = _random_input(kind, rng, shown=True)
                if x not in shown:
                    shown.append(x)
            hidden = [_random_input(kind, rng, shown=False) for _ in range(4)] + [_probe(kind, k, rng)]
            tests = [(x, f(x, k)) for x in shown + hidden]
            examples = [f'{code_repr(x)}->{code_repr(y)}' for x, y in tests[:3]]
            prompt = '; '.join(examples) if len('; '.join(examples)) <= 80 else '; '.join(examples[:2])
            solution = program.format(k=k)
            tasks.append(Task(prompt=prompt, family=family, task_id=f'{split}{seed}-{i}', answer=solution,
                              solution=solution, world={'tests': tests, 'k': k}))
        return tasks

    def reset(self, task):
        return Episode(task=task)

    def step(self, ep, action):
        """Run one program on all tests. Hostile text is a verdict with reward 0, never an exception."""
        if ep.done:
            return Step('', ep.reward, True, ep.feedback)
        src = action.strip() if isinstance(action, str) else ''
        try:
            passed, verdict = run_tests(src, ep.task.world['tests'])
        except Exception as e:  # defence in depth: the evaluator is written never to raise
            passed, verdict = False, _line(f'error: internal {type(e).__name__}')
        done = passed or len(ep.turns) + 1 >= self.max_turns
        ep.turns.append((src[:MAX_PROGRAM_CHARS], '' if done else verdict))
        ep.reward, ep.done = float(passed), done
        ep.feedback = verdict if done else ''
        return Step('' if done else verdict, ep.reward, done, ep.feedback)

    def demo(self, task, rng, noisy=False):
        """Scripted expert (always right, one attempt) or noisy expert (the warm-up data):
        its first program is right with p=NOISY_RIGHT, else a plausible wrong one (wrong
        constant, operator or slice); after a miss it fixes it with p=NOISY_FIX."""
        if not noisy:
            return [task.solution]
        first = task.solution if rng.random() < NOISY_RIGHT else self._wrong(task, rng)
        if run_tests(first, task.world['tests'])[0]:  # a wrong program can pass by luck
            return [first]
        second = task.solution if rng.random() < NOISY_FIX else self._wrong(task, rng, avoid=first)
        return [first, second]

    def _wrong(self, task, rng, avoid=None):
        k = task.world['k']
        j = k + 1 if k <= 1 else k + rng.choice([-1, 1])
        options = [w.format(k=k, j=j) for w in PROGRAM_FAMILIES[task.family][4]]
        return rng.choice([o for o in options if o != avoid])

    def trajectory_text(self, ep):
        """Every attempt with its verdict; a solved episode as its passing program alone, because that
        is what another task can reuse, and the only form in which the warm-up shows a past success
        (a bank line that began with the miss had the teacher copy the miss)."""
        if ep.reward > 0:
            return ep.turns[-1][0]
        return '; '.join(f'{a} -> {o}' if o else a for a, o in ep.turns)


ENVS = {'tooluse': ToolUse, 'codegen': CodeGen}


def make_env(name, seed=0):
    return ENVS[name](seed=seed)


def play(env, task, actions):
    """Run a fixed list of actions through a fresh episode (expert demos, tests)."""
    ep = env.reset(task)
    for a in actions:
        if ep.done:
            break
        env.step(ep, a)
    return ep
