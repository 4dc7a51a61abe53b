"""Code generation (`--env codegen`): write a Python lambda from input/output examples, run by the
safe evaluator (sandbox.py) against hidden tests (envs.py has the interface every environment speaks)."""
import random

from envs import Episode, Step, Task
from sandbox import MAX_PROGRAM_CHARS, _line, code_repr, run_tests


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
    defaults = {'cold_start': 'text', 'cold_start_steps': 300, 'warmup_steps': 500, 'warmup_batch': 64}
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

    @staticmethod
    def action_kind(ep, i):
        """Turn i's program, by its verdict: passed, wrong (ran, a test failed), runtime error, or
        rejected by the safe evaluator (not a whitelisted lambda). A last turn's verdict is the feedback."""
        verdict = ep.turns[i][1] or (ep.feedback if i == len(ep.turns) - 1 else '')
        return ('passed' if verdict == 'correct' else 'rejected' if verdict.startswith('rejected') else
                'runtime error' if verdict.startswith('error') else 'wrong')

    def trajectory_text(self, ep):
        """Every attempt with its verdict; a solved episode as its passing program alone, because that
        is what another task can reuse, and the only form in which the warm-up shows a past success
        (a bank line that began with the miss had the teacher copy the miss)."""
        if ep.reward > 0:
            return ep.turns[-1][0]
        return '; '.join(f'{a} -> {o}' if o else a for a, o in ep.turns)
