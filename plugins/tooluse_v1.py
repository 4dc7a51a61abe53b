"""Tool use, first version (`--env tooluse-v1`), kept so that old numbers stay reproducible: one tool
plan per family, 5 transparent and 5 opaque families, 0/1 reward for `answer y` (envs.py has the
interface every environment speaks)."""
import functools
import random

import envs
from envs import CALL, MAX_ACTION_CHARS, NAMES, TEAMS, Episode, Step, Task


# ----------------------------------------------------------------------------- tool use, first version (tooluse-v1)

CITIES = ['oslo', 'rome', 'lima', 'kyiv', 'baku', 'doha', 'riga', 'nice', 'bern', 'faro', 'pisa', 'york',
          'bonn', 'cork', 'graz', 'kiel', 'lyon', 'metz', 'oulu', 'turin', 'varna', 'nara', 'vigo', 'sofia']
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
    # train.py flags whose default differs here: as when its numbers were measured
    defaults = {'cold_start': 'text', 'cold_start_steps': 0, 'warmup_steps': 500, 'warmup_batch': 64}
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

    @staticmethod
    def action_kind(ep, i):
        """Turn i's action: a tool call, an answer after at least one call, a blind answer (no call
        before it: a guess), or malformed."""
        a = ep.turns[i][0]
        if a.startswith('answer '):
            return 'answer' if any(CALL.match(b) for b, _ in ep.turns[:i]) else 'blind answer'
        return 'call' if CALL.match(a) else 'malformed'


envs.ENVS['tooluse-v1'] = ToolUseV1
