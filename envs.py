"""Text environments with verifiable 0/1 reward (DESIGN §4).

Every environment speaks the same small interface, which is all the algorithm sees:

    env.make_tasks(n, seed, families)   -> list[Task]       (fixed by the seed)
    env.train_tasks, env.eval_tasks     -> the training pool and the held-out set
    env.reset(task)                     -> Episode
    env.step(episode, action_text)      -> Step(obs, reward, done, feedback)
    env.demo(task, rng, noisy)          -> list of actions   (scripted / noisy expert)
    env.trajectory_text(episode)        -> compact "action -> result" text (the bank's form)

An `Episode` holds the turns so far; the model-side code (train.py) turns it into
tokens. Model output is untrusted: malformed or hostile text gets an error
observation and reward 0, never an exception, and every episode ends within
`max_turns` agent turns.

Tool use (multi-turn). Each task draws a small random world: 6 people, each with a
city, a team and a manager; each team has a lead. The agent calls one tool per turn,
`manager(x)`, `city(x)`, `team(x)` or `lead(t)`, reads the result, and finally writes
`answer y`. A task family is a fixed tool plan. Transparent families say their plan
("city of manager of bo"); opaque ones do not ("q2 bo" = city of lead of team of bo),
so their plan can only be learned from experience, and one opaque family ("q5") never
appears in the warm-up data. Answers are copied from observations, never computed, so
they can only be known by calling the tools.

Left out: tools with several arguments, partial credit, distractor tools. The code
generation environment arrives with its safe evaluator in the next section.
"""
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


@dataclass
class Step:
    obs: str
    reward: float
    done: bool
    feedback: str


# ----------------------------------------------------------------------------- tool use

NAMES = ['ada', 'bo', 'cy', 'di', 'ed', 'flo', 'gus', 'hal', 'ivy', 'jo', 'kai', 'lu',
         'max', 'ned', 'oz', 'pia', 'quin', 'ray', 'sue', 'ted', 'uma', 'vic', 'wes', 'zoe']
CITIES = ['oslo', 'rome', 'lima', 'kyiv', 'baku', 'doha', 'riga', 'nice', 'bern', 'faro']
TEAMS = ['red', 'blue', 'green', 'gold', 'gray', 'pink']
TOOLS = {'manager': 'person', 'city': 'person', 'team': 'person', 'lead': 'team'}  # tool -> argument type

# family -> tool plan, applied left to right to the person in the prompt.
FAMILIES = {
    'city of X': ['city'],
    'manager of X': ['manager'],
    'city of manager of X': ['manager', 'city'],
    'lead of team of X': ['team', 'lead'],
    'manager of manager of X': ['manager', 'manager'],
    # opaque: the name says nothing about the plan
    'q1 X': ['team', 'lead', 'manager'],
    'q2 X': ['team', 'lead', 'city'],
    'q3 X': ['manager', 'team', 'lead'],
    'q4 X': ['manager', 'manager', 'city'],
    'q5 X': ['manager', 'team', 'lead', 'city'],  # absent from the warm-up data
}
OPAQUE = [f for f in FAMILIES if f.startswith('q')]
WARMUP_FAMILIES = [f for f in FAMILIES if f != 'q5 X']

CALL = re.compile(r'^([a-z]+)\(([a-z]+)\)$')
MAX_ACTION_CHARS = 64


def random_world(rng):
    people = rng.sample(NAMES, 6)
    teams = rng.sample(TEAMS, 3)
    world = {'people': people, 'teams': teams, 'lead': {t: rng.choice(people) for t in teams}}
    for p in people:
        world[p] = {'city': rng.choice(CITIES), 'team': rng.choice(teams),
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


def random_plan(rng):
    """A type-correct random tool plan of 1-4 calls (the noisy expert's guess)."""
    plan, kind = [], 'person'
    for _ in range(rng.randint(1, 4)):
        tool = rng.choice(['lead'] if kind == 'team' else ['manager', 'city', 'team'])
        plan.append(tool)
        if tool == 'city':
            break
        kind = 'team' if tool == 'team' else 'person'
    if kind == 'team' and plan[-1] == 'team':  # the answer must be a person or a city
        plan.append('lead')
    return plan


class ToolUse:
    name = 'tooluse'
    max_turns = 6           # 4 calls at most + answer + one slack turn for a mistake
    max_action_tokens = 24  # bytes per agent turn; 'manager(quin)' is 13
    families = list(FAMILIES)
    warmup_families = WARMUP_FAMILIES

    def __init__(self, n_train=4000, n_eval=250, seed=0):
        # fixed pools: the training tasks repeat (so same-task retrieval can happen), the
        # held-out tasks use their own seed and fresh worlds, and are balanced by family
        self.train_tasks = self.make_tasks(n_train, seed=10_000 + seed, split='train')
        self.eval_tasks = self.make_tasks(n_eval, seed=20_000 + seed, split='eval')

    def make_tasks(self, n, seed, families=None, split='t'):
        rng = random.Random(seed)
        families = families or self.families
        tasks = []
        for i in range(n):
            family = families[i % len(families)]
            world = random_world(rng)
            x = rng.choice(world['people'])
            answer, steps = x, []
            for tool in FAMILIES[family]:
                result, _ = call_tool(world, tool, answer)
                steps.append(f'{tool}({answer}) -> {result}')
                answer = result
            solution = '; '.join(steps + [f'answer {answer}'])
            tasks.append(Task(prompt=family.replace('X', x), family=family, task_id=f'{split}{seed}-{i}',
                              answer=answer, solution=solution, world=world))
        return tasks

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

    def demo(self, task, rng, noisy=False):
        """Scripted expert (always right) or noisy expert (the warm-up data).

        The noisy expert follows the right plan on transparent families 85% of the time;
        on opaque families it knows nothing and guesses a random plan, so the base model
        has to learn those plans from experience."""
        plan = FAMILIES[task.family]
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
