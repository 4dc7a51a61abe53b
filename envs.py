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

Tool use, first version (`tooluse-v1`, plugins/tooluse_v1.py, kept so that old numbers stay reproducible): one tool
plan per family, 5 transparent and 5 opaque families, 0/1 reward for `answer y`. Each task
draws 12 people with a city, team and manager; the agent calls `manager(x)`, `city(x)`,
`team(x)`, `lead(t)`, then answers; one opaque family ("snarfle") never appears in the warm-up.

In both, each world is redrawn until no other plan an episode can run reaches a target, so a
passed check always means the right plan (a lucky hit from a wrong plan would be an experience
that teaches the wrong plan), and answers can only be known by calling the tools.

Code generation (`codegen`, plugins/codegen.py; multi-turn, up to two attempts). The task shows input/output examples
of a small list or string function; the agent writes `lambda x: ...` in a restricted
Python-expression subset, run against hidden tests by `sandbox.safe_eval`, a small AST
interpreter with size and step budgets (the security boundary: its rules are in
plugins/sandbox.py). A failed first attempt gets the first failing test as feedback.

Left out: tools with several arguments, undoing a write, statements in programs.
"""
import functools
import random
import re
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


# ----------------------------------------------------------------------------- shared by the tool uses

NAMES = ['ada', 'bo', 'cy', 'di', 'ed', 'flo', 'gus', 'hal', 'ivy', 'jo', 'kai', 'lu',
         'max', 'ned', 'oz', 'pia', 'quin', 'ray', 'sue', 'ted', 'uma', 'vic', 'wes', 'zoe']
TEAMS = ['red', 'blue', 'green', 'gold', 'gray', 'pink']
_OTHERS = {p: [q for q in NAMES if q != p] for p in NAMES}  # whom p's manager or mentor may be

CALL = re.compile(r'^([a-z]+)\(([a-z]+)\)$')  # a tool call: tool(arg)
MAX_ACTION_CHARS = 64


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
        world[p] = {'manager': rng.choice(_OTHERS[p]), 'mentor': rng.choice(_OTHERS[p]), 'team': rng.choice(teams)}
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
    ends = chain_ends(world, x)
    if any(ends.count(t) > 1 for t in targets):  # its word's chain is one of the 19: a second one reaches it too
        return None
    return targets


def chain_walk(chains):
    """The chains as one walk, each shared prefix once: -> (steps, ends), step k = (the index of the
    value it starts from, tool) makes value k + 1 (value 0 is x), and chain i ends at value ends[i]."""
    at, steps = {(): 0}, []
    for c in chains:
        for k in range(1, len(c) + 1):
            if tuple(c[:k]) not in at:
                steps.append((at[tuple(c[:k - 1])], c[k - 1]))
                at[tuple(c[:k])] = len(steps)
    return steps, [at[tuple(c)] for c in chains]


CHAIN_STEPS, CHAIN_ENDS = chain_walk(CHAINS)


def chain_ends(world, x):
    """run_chain(world, c, x) for each c of CHAINS, each lookup made once (the tasks' generation asks
    this of every candidate person; CHAINS type-check, so no lookup fails)."""
    values = [x]
    for i, tool in CHAIN_STEPS:
        values.append(world['lead'][values[i]] if tool == 'lead' else world[values[i]][tool])
    return [values[i] for i in CHAIN_ENDS]


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

    @staticmethod
    def action_kind(ep, i):
        """Turn i's action: a lookup, a mark of a person an earlier lookup returned, a blind mark (a
        person no lookup returned: a guess), or malformed (not tool(arg))."""
        m = CALL.match(ep.turns[i][0])
        if m is None:
            return 'malformed'
        if m.group(1) != 'mark':
            return 'lookup'
        return 'mark' if any(o == m.group(2) for _, o in ep.turns[:i]) else 'blind mark'


def by_family(eps):
    """Mean graded reward per task family."""
    fam = {}
    for e in eps:
        fam.setdefault(e.task.family, []).append(e.reward)
    return {f: sum(v) / len(v) for f, v in fam.items()}


def action_stats(env, eps):
    """What success hides (self-distillation can erase an agent's action types while its success rate
    looks fine, arXiv 2606.12634): each action type's share of all actions, the share that repeat an
    earlier action of the same episode, actions per episode, and characters per action.
    e.g. one episode [lookup, the same lookup, mark] -> lookup 2/3, mark 1/3, repeated 1/3, 3 per episode."""
    kinds, repeated, chars, n = {}, 0, 0, 0
    for e in eps:
        seen = set()
        for i, (a, _) in enumerate(e.turns):
            k = env.action_kind(e, i)
            kinds[k] = kinds.get(k, 0) + 1
            repeated += a in seen
            seen.add(a)
            chars += len(a)
            n += 1
    n_ = max(n, 1)
    return {**{k: c / n_ for k, c in sorted(kinds.items())}, 'repeated': repeated / n_,
            'actions_per_episode': n / max(len(eps), 1), 'chars_per_action': chars / n_}


# name -> environment class; the others (plugins/codegen.py, plugins/tooluse_v1.py) add theirs when imported
ENVS = {'tooluse': ToolUse}


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
