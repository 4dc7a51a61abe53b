"""Text environments with verifiable rewards: graded (tool use) or 0/1 (code generation).

Every environment speaks the same small interface, which is all the algorithm sees:

    env.make_tasks(n, seed, families)   -> list[Task]       (fixed by the seed)
    env.train_tasks, env.eval_tasks     -> the training pool and the held-out set
    env.reset(task)                     -> Episode
    env.step(episode, action_text)      -> Step(obs, reward, done, feedback)
    env.demo(task, rng, noisy)          -> list of actions   (scripted / noisy expert)
    env.reading_plan(task, rng)         -> what a warm-up reading demo follows (never an opaque plan)
    env.trajectory_text(episode)        -> compact "action -> result" text (the bank's form)

An `Episode` holds the turns so far and its reward in [0, 1]; `episode.success` is reward 1
(every check passed). The model-side code (model.encode_episode) turns it into tokens. Model
output is untrusted: malformed or hostile text gets an error observation, never an exception,
and every episode ends within `max_turns` agent turns.

Tool use (`tooluse`, the default; multi-turn, graded). Modelled on the properties of EnvScaler
that the LOPD paper's results depend on; the reasons are in the block comment above ToolUse.
A task names one or two words ("zorb and mentor of bo"); each word is a sub-goal, a chain of
lookups from the person in the prompt to a person the agent must `mark`; the reward is the
fraction of the task's checks (one per word: "its person is marked") that pass on the final
state. Sub-goals may be done in any order. 3 words spell their chain; 8 opaque words do not, so
40 of the 46 families can only be learned from experience, and they share words.

Tool use, first version (`tooluse-v1`, kept so that old numbers stay reproducible): one tool
plan per family, 5 transparent and 5 opaque families, 0/1 reward for `answer y`. Each task
draws 12 people with a city, team and manager; the agent calls `manager(x)`, `city(x)`,
`team(x)`, `lead(t)`, then answers; one opaque family ("snarfle") never appears in the warm-up.

In both, each world is redrawn until no other plan an episode can run reaches a target, so a
passed check always means the right plan (a lucky hit from a wrong plan would be an experience
that teaches the wrong plan), and answers can only be known by calling the tools.

Code generation (multi-turn, up to two attempts). The task shows input/output examples
of a small list or string function; the agent writes `lambda x: ...` in a restricted
Python-expression subset, run against hidden tests by `sandbox.safe_eval`, a small AST
interpreter with size and step budgets (the security boundary: its rules are in
sandbox.py). A failed first attempt gets the first failing test as feedback.

Left out: tools with several arguments, undoing a write, statements in programs.
"""
import functools
import random
import re
from dataclasses import dataclass, field

from sandbox import MAX_PROGRAM_CHARS, _line, code_repr, run_tests


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
    state: dict = field(default_factory=dict)  # what the agent's writes changed (tool use: who is marked)

    @property
    def success(self):
        """Every check passed (the reward is graded: the fraction of checks passed)."""
        return self.reward >= 1.0


@dataclass
class Step:
    obs: str
    reward: float
    done: bool
    feedback: str


# ----------------------------------------------------------------------------- tool use (the default)
#
# Modelled on the properties of EnvScaler (the LOPD paper's tool-use environment) that its
# results depend on, each for a reason:
#   - a task has several sub-goals and a graded reward, the fraction of its checks that pass on
#     the final state (EnvScaler grades a checklist; the paper's margin advantage A = 2r − 1 is
#     made for it); success (every check) stays a reported metric;
#   - the agent reads the state (lookups) and changes it (`mark`), and the checks read the state;
#   - a task of two sub-goals can be solved in either order (and interleaved), so an oracle
#     trajectory of the same task can disagree with the student's own prefix: the paper's
#     reason for OPSD's weakness on agents;
#   - 40 of its 46 families can only be learned from experience, and they share parts: a family
#     names one or two *words*, each word is one sub-goal (a lookup chain, then a mark), and a
#     word recurs in about six families; so held-out reward moves in small steps, one lucky
#     family moves it by about two points, and experience of one family transfers partly to its
#     relatives (and a retriever finds them by the shared word);
#   - the base keeps lucky successes: the warm-up's noisy expert guesses an opaque word's chain
#     among the 11 chains the words use (the true one among them), so the base finds it about
#     one time in eleven per sub-goal.
#
# The world: 24 people, each with a manager, a mentor and a team; 4 teams, each with a lead.
# Lookups `manager(p)`, `mentor(p)`, `team(p)`, `lead(t)`; the write `mark(p)` (at most one
# mark per word of the task; the episode ends at the last one, or after max_turns turns).
# "zorb and mentor of bo" = mark the manager of bo's manager, and mark bo's mentor, in any order.

OFFICE_TOOLS = {'manager': 'person', 'mentor': 'person', 'team': 'person', 'lead': 'team'}  # lookup -> argument type

# word -> the lookup chain from the person in the prompt to the person to mark
WORDS = {
    # transparent: the word spells its chain, and the warm-up shows it
    'manager': ['manager'], 'mentor': ['mentor'], 'team-lead': ['team', 'lead'],
    # opaque: made-up words; the warm-up pairs them only with wrong chains
    'zorb': ['manager', 'manager'], 'glim': ['manager', 'mentor'], 'plov': ['mentor', 'manager'],
    'snarf': ['mentor', 'mentor'], 'quan': ['team', 'lead', 'manager'], 'tref': ['team', 'lead', 'mentor'],
    'mirth': ['manager', 'team', 'lead'], 'vosk': ['mentor', 'team', 'lead'],
}
TRANSPARENT_WORDS = ['manager', 'mentor', 'team-lead']
OPAQUE_WORDS = [w for w in WORDS if w not in TRANSPARENT_WORDS]


def _office_families():
    """46 families, as tuples of words: 3 transparent singles and 3 pairs (the base solves them),
    8 opaque singles, 24 opaque-transparent pairs (each order half the time), 8 opaque pairs (a ring)."""
    T, O = TRANSPARENT_WORDS, OPAQUE_WORDS
    fams = [(t,) for t in T] + [(T[i], T[(i + 1) % 3]) for i in range(3)] + [(o,) for o in O]
    fams += [(o, t) if (i + j) % 2 == 0 else (t, o) for i, o in enumerate(O) for j, t in enumerate(T)]
    return fams + [(O[i], O[(i + 1) % len(O)]) for i in range(len(O))]


def family_name(words):
    return ' and '.join(words) + ' of X'


def family_words(family):
    """'zorb and mentor of X' -> ['zorb', 'mentor']"""
    return family[:-len(' of X')].split(' and ')


OFFICE_FAMILIES = [family_name(w) for w in _office_families()]


def person_chains(max_calls):
    """Every lookup chain of 1..max_calls calls that type-checks and ends at a person (19 for 3)."""
    chains = []

    def grow(chain, kind):
        if chain and kind == 'person':
            chains.append(chain)
        if len(chain) < max_calls:
            for tool in (['lead'] if kind == 'team' else ['manager', 'mentor', 'team']):
                grow(chain + [tool], 'team' if tool == 'team' else 'person')
    grow([], 'person')
    return chains


CHAINS = person_chains(3)                          # what uniqueness is checked against (19 chains)
WORD_CHAINS = [list(c) for c in dict.fromkeys(tuple(c) for c in WORDS.values())]  # the noisy expert's 11 guesses


def office_world(rng):
    teams = rng.sample(TEAMS, 4)
    world = {'people': list(NAMES), 'teams': teams, 'lead': {t: rng.choice(NAMES) for t in teams}}
    for p in NAMES:
        world[p] = {'manager': rng.choice([q for q in NAMES if q != p]), 'mentor': rng.choice([q for q in NAMES if q != p]),
                    'team': rng.choice(teams)}
    return world


def office_call(world, tool, arg):
    """One lookup -> (result, error). Never raises."""
    if tool not in OFFICE_TOOLS:
        return None, f"error: unknown tool '{tool}'"
    if OFFICE_TOOLS[tool] == 'team':
        return (world['lead'][arg], None) if arg in world['teams'] else (None, f"error: no team '{arg}'")
    return (world[arg][tool], None) if arg in world['people'] else (None, f"error: no person '{arg}'")


def run_chain(world, chain, x):
    for tool in chain:
        x, _ = office_call(world, tool, x)
    return x


def unique_targets(world, x, words):
    """The persons to mark, or None unless each is reached from x by its word's chain only (among
    the 19 chains of up to 3 calls), none is x, and they differ: then a passed check means the
    right chain (a lucky mark by a wrong chain would be an experience that teaches the wrong one)."""
    targets = [run_chain(world, WORDS[w], x) for w in words]
    if x in targets or len(set(targets)) < len(targets):
        return None
    for w, t in zip(words, targets):
        if any(c != WORDS[w] and run_chain(world, c, x) == t for c in CHAINS):
            return None
    return targets


@functools.lru_cache(maxsize=16)  # tasks are never mutated, so a process shares them
def _office_tasks(n, seed, families, split):
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        family = families[i % len(families)]
        words = family_words(family)
        while True:  # a world, then the first person in it for whom every target is unique
            world = office_world(rng)
            x, targets = next(((x, t) for x in rng.sample(NAMES, len(NAMES))
                               if (t := unique_targets(world, x, words))), (None, None))
            if x:
                break
        world.update(x=x, words=words, targets=targets)
        task = Task(prompt=family.replace('X', x), family=family, task_id=f'{split}{seed}-{i}',
                    answer=', '.join(targets), solution='', world=world)
        task.solution = ToolUse.trajectory_text(play(ToolUse, task, ToolUse.demo(task, random.Random(i))))
        tasks.append(task)
    return tasks


class ToolUse:
    name = 'tooluse'
    max_turns = 9           # two sub-goals of up to 3 lookups and a mark each = 8 turns, + 1 slack
    max_action_tokens = 24  # bytes per agent turn; 'mentor(quin)' is 12
    families = OFFICE_FAMILIES
    warmup_families = OFFICE_FAMILIES
    opaque = [f for f in OFFICE_FAMILIES if any(w in OPAQUE_WORDS for w in family_words(f))]
    embedder = 'ngram'      # the retriever's (retrieval.EMBEDDERS): the prompt's words tell a family and its relatives
    rerank = 'none'
    defaults = {}
    # what a chat model is told in its system turn (--model only; the tiny model learns the format
    # from the warm-up's demos and keeps its compact first turn)
    instructions = (
        "You act in an office directory through tools. Reply with exactly one tool call and nothing else.\n"
        "Tools: manager(p), mentor(p), team(p) give a person's manager, mentor or team; lead(t) gives a "
        "team's lead; mark(p) marks a person.\n"
        "A task names one or two words and a person. For each word, look up the person it means, then mark "
        "them. Unexplained words (zorb, glim, plov, snarf, quan, tref, mirth, vosk) each mean a chain of "
        "lookups: find it by trying. Notes from past tasks may come first ('past: task: calls').\n"
        "Example, for the task 'mentor of bo', your replies are:\nmentor(bo)\nmark(al)\n(the first call returned al).")

    def __init__(self, n_train=4000, n_eval=500, seed=0):
        # as in tooluse-v1: a repeating training pool and a family-balanced held-out set, each its own seed
        self.train_tasks = self.make_tasks(n_train, seed=10_000 + seed, split='train')
        self.eval_tasks = self.make_tasks(n_eval, seed=20_000 + seed, split='eval')

    def make_tasks(self, n, seed, families=None, split='t'):
        return list(_office_tasks(n, seed, tuple(families or self.families), split))

    @staticmethod
    def reset(task):
        return Episode(task=task, state={'marked': []})

    @staticmethod
    def step(ep, action):
        """Apply one agent action. Malformed text is an error observation, never an exception."""
        if ep.done:
            return Step('', ep.reward, True, ep.feedback)
        action = action.strip() if isinstance(action, str) else ''
        world, marked = ep.task.world, ep.state.setdefault('marked', [])
        m = CALL.match(action) if len(action) <= MAX_ACTION_CHARS else None
        if m is None:
            obs = 'error: write tool(arg)'
        elif m.group(1) == 'mark':
            p = m.group(2)
            obs = f"error: no person '{p}'" if p not in world['people'] else \
                f'error: {p} is already marked' if p in marked else 'ok'
            if obs == 'ok':  # the state read back: which of the task's words still have no mark on their person
                marked.append(p)
                obs = 'ok, left: ' + ' '.join(w for w, t in zip(world['words'], world['targets']) if t not in marked)
        else:
            result, err = office_call(world, m.group(1), m.group(2))
            obs = err or result
        ep.turns.append((action[:MAX_ACTION_CHARS * 2], obs))
        n = len(world['targets'])
        done = len(marked) == n or len(ep.turns) >= ToolUse.max_turns
        if done:  # the checks read the final state: one per word, "its target is marked"
            passed = sum(t in marked for t in world['targets'])
            ep.reward = passed / n
            ep.feedback = 'correct' if passed == n else f'{passed} of {n} checks passed'
            ep.turns[-1] = (ep.turns[-1][0], '')
        ep.done = done
        return Step('' if done else obs, ep.reward, done, ep.feedback if done else '')

    @staticmethod
    def reading_plan(task, rng):
        """The chains a warm-up reading demo shows and follows: an opaque word's is a wrong one (and
        reaches a person no other word of the task marks), so that reading is learned but no opaque
        chain is. -> demo's keyword arguments."""
        w, plan = task.world, []
        for word in w['words']:
            taken = [run_chain(w, c, w['x']) for c in plan] + [t for v, t in zip(w['words'], w['targets']) if v != word]
            plan.append(WORDS[word] if word in TRANSPARENT_WORDS else rng.choice(
                [c for c in WORD_CHAINS if c != WORDS[word] and run_chain(w, c, w['x']) not in taken] or
                [c for c in WORD_CHAINS if c != WORDS[word]]))
        return {'plan': plan}

    @staticmethod
    def demo(task, rng, noisy=False, plan=None):
        """Scripted expert (always right) or noisy expert (the warm-up data), as actions.

        The scripted expert (our "stronger model") does the sub-goals in a random order: every
        order is valid, so its trajectory can take another path than the student's. The noisy
        expert does them in the prompt's order; it follows a transparent word's chain 85% of the
        time, else guesses one of the 11 word chains; an opaque word's chain it always guesses (the
        true one among them: the base can find it by exploring). `plan` forces the chains, one per
        word, in the prompt's order (the warm-up's reading demos)."""
        words, x = task.world['words'], task.world['x']
        chains = [list(c) for c in plan] if plan else [WORDS[w] for w in words]
        if noisy and not plan:
            chains = [rng.choice(WORD_CHAINS) if w in OPAQUE_WORDS or rng.random() < 0.15 else c
                      for w, c in zip(words, chains)]
        order = rng.sample(range(len(chains)), len(chains)) if not noisy and not plan else range(len(chains))
        actions, marked = [], []
        for k in order:
            while noisy and not plan and run_chain(task.world, chains[k], x) in marked:  # a guess never marks twice
                chains[k] = rng.choice(WORD_CHAINS)
            value = x
            for tool in chains[k]:
                actions.append(f'{tool}({value})')
                value, _ = office_call(task.world, tool, value)
            actions.append(f'mark({value})')
            marked.append(value)
        return actions

    @staticmethod
    def trajectory_text(ep):
        return '; '.join(f'{a} -> {o}' if o else a for a, o in ep.turns)


# ----------------------------------------------------------------------------- tool use, first version (tooluse-v1)

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


class ToolUseV1:
    name = 'tooluse-v1'
    max_turns = 6           # 4 calls at most + answer + one slack turn for a mistake
    max_action_tokens = 24  # bytes per agent turn; 'manager(quin)' is 13
    families = list(FAMILIES)
    warmup_families = WARMUP_FAMILIES
    opaque = OPAQUE
    embedder = 'ngram'      # the retriever's (retrieval.EMBEDDERS): the prompt's words tell a family
    rerank = 'none'         # and its reranker (retrieval.RERANKERS)
    defaults = {'warmup_steps': 500}  # train.py flags whose default differs here: as when its numbers were measured
    instructions = (
        "You are an agent in an office directory. Tools, one call per reply: manager(p), city(p) and "
        "team(p) return that person's manager, city or team; lead(t) returns the lead of team t. A task "
        "asks for something about a person, e.g. 'city of manager of bo': find it with calls, then reply "
        "answer X. Some tasks use words that are not explained: find what they mean by trying. A message "
        "may begin with notes from past tasks ('past: task: calls -> results'). Reply with one call or the "
        "answer only, e.g. manager(bo) or answer oslo")

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

    def reading_plan(self, task, rng):
        """The plan a warm-up reading demo shows and follows: a random one on opaque families."""
        return {'plan': random_plan(rng, avoid=FAMILIES[task.family])} if task.family in OPAQUE else {}

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
# whitelist and run by a small interpreter (sandbox.py) with size and step budgets,
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
    defaults = {'cold_start_steps': 300, 'warmup_steps': 500}
    instructions = (
        "Each task shows input->output examples of one rule on a list of digits or a string, e.g. "
        "[4,6,2]->[8,10,6]. Write a Python lambda f such that f(input) == output for every example and "
        "for hidden tests of the same rule. Reply with the lambda only, e.g. lambda x: [v*2 for v in x]. "
        "If it fails, you see the first failing test and get one more try. A message may begin with notes "
        "from past tasks ('past: examples: lambda').")

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

    def reading_plan(self, task, rng):
        """Reading demos follow the right program: no family is opaque here."""
        return {}

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


ENVS = {'tooluse': ToolUse, 'tooluse-v1': ToolUseV1, 'codegen': CodeGen}


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
