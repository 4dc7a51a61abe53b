"""Code generation environment: the experts, the multi-turn protocol, and the safe
evaluator (sandbox.py) against Python's own eval (benign programs) and a corpus of hostile ones."""
import os
import random
import threading
import time
from collections import defaultdict

import pytest
from hypothesis import given, settings, strategies as st

from plugins import sandbox
from envs import play
from plugins.codegen import CodeGen
from plugins.sandbox import check_program, code_repr, run_tests, safe_eval

ENV = CodeGen(n_train=1200, n_eval=240)


# ----------------------------------------------------------------------------- tasks and experts

def test_families_and_splits():
    fams = [t.family for t in ENV.eval_tasks]
    assert {fams.count(f) for f in ENV.families} == {240 // len(ENV.families)}  # balanced
    assert 'mirror' in ENV.families and 'mirror' not in ENV.warmup_families
    assert len(ENV.families) >= 10 and ENV.max_turns == 2
    assert {t.prompt for t in ENV.eval_tasks[:50]} != {t.prompt for t in ENV.train_tasks[:50]}
    again = CodeGen(n_train=20, n_eval=12)  # pools are fixed by the seed
    assert [t.prompt for t in again.eval_tasks] == [t.prompt for t in ENV.eval_tasks[:12]]


def test_prompts_and_programs_are_short():
    for t in ENV.train_tasks + ENV.eval_tasks:
        assert len(t.prompt) + len(t.solution) <= 120, t
        assert t.answer == t.solution and check_program(t.solution) is None
        assert 2 <= t.prompt.count('->') <= 3 and len(t.world['tests']) == 8


def test_expert_solves_every_task():
    rng = random.Random(0)
    for t in ENV.eval_tasks + ENV.train_tasks[:300]:
        ep = play(ENV, t, ENV.demo(t, rng))
        assert ep.reward == 1.0 and ep.done and len(ep.turns) == 1 and ep.feedback == 'correct', t


def test_noisy_expert_is_modest_on_warmup_families():
    rng, wins = random.Random(1), defaultdict(list)
    for t in ENV.train_tasks:
        if t.family in ENV.warmup_families:
            wins[t.family].append(play(ENV, t, ENV.demo(t, rng, noisy=True)).reward)
    rates = {f: sum(w) / len(w) for f, w in wins.items()}
    print('noisy expert success:', {f: round(r, 2) for f, r in rates.items()})
    assert all(0.3 <= r <= 0.95 for r in rates.values()), rates
    assert 0.6 <= sum(rates.values()) / len(rates) <= 0.9


# ----------------------------------------------------------------------------- multi-turn protocol

def test_two_attempts_with_feedback():
    t = next(t for t in ENV.eval_tasks if t.family == 'add')
    k = t.world['k']
    ep = ENV.reset(t)
    s = ENV.step(ep, f'lambda x: [v+{k + 1} for v in x]')
    x, want = t.world['tests'][0]
    assert (s.reward, s.done, s.feedback) == (0.0, False, '')
    assert s.obs.startswith(f'failed f({code_repr(x)}): got ') and s.obs.endswith(
        f'expected {code_repr(want)}') and '\n' not in s.obs
    s = ENV.step(ep, t.solution)
    assert (s.obs, s.reward, s.done, s.feedback) == ('', 1.0, True, 'correct')
    assert ENV.trajectory_text(ep) == t.solution  # a success is stored as its passing program
    # two failures: done, the verdict on the second attempt is the feedback, last obs is ''
    ep = play(ENV, t, ['lambda x: x', 'lambda x: x[0]'])
    assert ep.done and ep.reward == 0.0 and ep.turns[-1][1] == ''
    assert ep.feedback.startswith('error f(') or ep.feedback.startswith('failed f(')
    assert ENV.trajectory_text(ep).startswith('lambda x: x -> ') and ENV.trajectory_text(ep).endswith('; lambda x: x[0]')
    assert ENV.step(ep, t.solution).reward == 0.0  # nothing happens after the end
    # action types read each program's verdict (the last one's is the feedback)
    kinds = lambda acts: [ENV.action_kind(e, i) for e in [play(ENV, t, acts)] for i in range(len(e.turns))]
    assert kinds(['lambda x: x', t.solution]) == ['wrong', 'passed']
    assert kinds(['import os', 'lambda x: x[99]']) == ['rejected', 'runtime error']


# ----------------------------------------------------------------------------- evaluator semantics

BENIGN = [
    'lambda x: [v+1 for v in x]', 'lambda x: [v*v-1 for v in x if v%2]', 'lambda x: x[1:3]',
    'lambda x: x[::-2]', 'lambda x: x[-1] if x else -1', 'lambda x: sum(x)//max(len(x),1)',
    'lambda x: sorted(x)[::-1][:2]', 'lambda x: [a*b for a in x for b in x if a<b]',
    'lambda x: len(x)>2 and x[0] or 7', 'lambda x: not x', 'lambda x: 1 < len(x) <= 3',
    'lambda x: 3 in x', 'lambda x: 4 not in x', 'lambda x: x+x[:1]*2', 'lambda x: 2**len(x)',
    'lambda x: -sum(x)%7', 'lambda x: list(reversed(x))', 'lambda x: [str(v)*2 for v in x]',
    "lambda x: [int(str(v)+'1') for v in x]", 'lambda x: abs(3-sum(x))', 'lambda x: (min(x), max(x))',
    'lambda x: any(v>5 for v in x)', 'lambda x: all([v<9 for v in x])', 'lambda x: list(range(len(x)))',
    'lambda x: list(range(1, 9, 3))', 'lambda x: x[0]', 'lambda x: [(v, v) for v in x]', 'lambda x: str(x)',
    'lambda x: list(str(x))[:3]', 'lambda x: sum([[v] for v in x], [])', 'lambda x: 10//len(x)',
    'lambda x: [v for v in x if v>2 if v<8]', 'lambda x: True + 1', 'lambda x: min(list(x) + [5])',
    'lambda x: x[::0]', 'lambda x: sorted(x) == list(x)', 'lambda x: x*0', 'lambda x: (x,)',
    'lambda y: [w for w in y][-2:]', 'lambda x: x and x[:1] or None', 'lambda x: len([1 for c in x])',
]
INPUTS = [[], [3], [1, 5, 2], [9, 0, 9, 4], [7, 7, 7, 7, 7], '', 'a', 'abc', 'hello']


def test_evaluator_agrees_with_python_on_benign_programs():
    for src in BENIGN:
        assert check_program(src) is None, src
        for x in INPUTS:
            try:
                want, ok = eval(src)(x), True  # our own trusted test strings
            except Exception:
                ok = False
            got, err = safe_eval(src, x)
            if ok:
                assert err is None and code_repr(got) == code_repr(want), (src, x, err)
            else:
                assert got is None and err, (src, x)


# hand-written programs per family: other ways to be right, and near misses ({k} = the task's constant)
RIGHT = {'add': ['lambda y: [w+{k} for w in y]', 'lambda x: list(v+{k} for v in x)'],
         'mul': ['lambda x: [sum([v]*{k}) for v in x]'],
         'keep_gt': ['lambda x: [v for v in x if not v<={k}]'],
         'count': ['lambda x: len([v for v in x if v=={k}])'],
         'take': ['lambda x: [v for v in x][:{k}]'],
         'reverse': ['lambda x: list(reversed(x))', 'lambda x: [x[-i] for i in range(1, len(x)+1)]'],
         'sort': ['lambda x: sorted(x)[::-1][::-1]'],
         'sum': ['lambda x: sum(v for v in x)'],
         'every2': ['lambda x: [x[i] for i in range(0, len(x), 2)]'],
         'repeat': ['lambda x: x*({k}-1)+x'],
         'rotate': ['lambda x: x[{k}:]+x[0:{k}]'],
         'mirror': ['lambda x: x+x[len(x)::-1]']}
WRONG = {'add': ['lambda x: [v+{k}+1 for v in x]', 'lambda x: x+[{k}]'],
         'keep_gt': ['lambda x: [v for v in x if v>{k}-1]'], 'count': ['lambda x: sum(x)'],
         'reverse': ['lambda x: x'], 'sort': ['lambda x: sorted(x)[::-1]'], 'sum': ['lambda x: str(sum(x))'],
         'every2': ['lambda x: (x[::2],)'], 'repeat': ['lambda x: x*9'], 'mirror': ['lambda x: x+x']}


@pytest.mark.parametrize('family', sorted(RIGHT))
def test_handwritten_programs(family):
    for t in [t for t in ENV.eval_tasks if t.family == family]:
        for p in RIGHT[family]:
            assert run_tests(p.format(k=t.world['k']), t.world['tests']) == (True, 'correct'), (p, t)
        for p in WRONG.get(family, []):
            ok, verdict = run_tests(p.format(k=t.world['k']), t.world['tests'])
            assert not ok and verdict.startswith(('failed', 'error')), (p, t)


# ----------------------------------------------------------------------------- hostile programs

HOSTILE = [
    # escapes towards the interpreter's internals
    'lambda x: ().__class__.__bases__[0].__subclasses__()', 'lambda x: x.__class__',
    'lambda x: [].__class__.__mro__[1].__subclasses__()', "lambda x: __import__('os').system('id')",
    'lambda x: __builtins__', 'lambda x: globals()', 'lambda x: locals()', 'lambda x: vars()',
    "lambda x: getattr(x, '__class__')", "lambda x: eval('1+1')", "lambda x: exec('import os')",
    "lambda x: open('/etc/passwd').read()", "lambda x: open('/tmp/lopd_codegen_pwned', 'w')",
    "lambda x: compile('1', 'f', 'eval')", 'lambda x: type(x)', 'lambda x: breakpoint()', 'lambda x: input()',
    'lambda x: print(x)', 'lambda x: x.count(1)', "lambda x: str.join('', x)", 'lambda x: sorted(x, key=len)',
    'lambda x: [f for f in [len]]', 'lambda x: [len][0](x)', 'lambda x: sum', 'lambda __class__: 1',
    'lambda x: [_ for _ in x]', 'lambda len: len(len)', 'lambda x: [len for len in x]', 'lambda x: x._x',
    'lambda x: [c for c in ().__class__.__base__.__subclasses__()]',
    # unicode look-alikes that Python NFKC-normalises into real names, invisible characters
    "lambda x: ｅｖａｌ('1')", 'lambda x: x.__ｃｌａｓｓ__', "lambda x: ＿＿import＿＿('os')", 'lambda ｘ: ｘ',
    'lambda x: x\u200b', 'lambda x: ℌ',
    # huge numbers and sizes
    'lambda x: 9**9**9', 'lambda x: 2**10**8', 'lambda x: (10**18)**(10**18)', "lambda x: 'a'*10**9",
    'lambda x: [0]*10**9', 'lambda x: 10**9*[0]', 'lambda x: range(10**12)', 'lambda x: list(range(10**6))',
    'lambda x: [[0]*999]*999', 'lambda x: [0 for a in range(500) for b in range(500)]',
    'lambda x: [0 for a in range(99) for b in range(99)]', 'lambda x: [[a for a in range(500)] for b in range(500)]',
    'lambda x: str([[0]*30]*30)', 'lambda x: sum([[0]*30 for v in range(30)], [])', "lambda x: '%999999999d' % 1",
    "lambda x: '{:>999999999}'.format(1)", "lambda x: f'{1:>999999999}'", "lambda x: int('9'*99)",
    'lambda x: 12345678901234567890123456789', 'lambda x: [str(v)*90 for v in range(99) for w in range(9)]',
    'lambda x: ' + "'a'*99+" * 20 + "''", 'lambda x: ' + 'x' * 10 ** 6, "lambda x: '" + 'a' * 10 ** 5 + "'",
    'lambda x: [x]*9*9*9*9', 'lambda x: [[[[[x]*9]*9]*9]*9]*9', "lambda x: max('a'*900, 'b'*900)*9",
    # recursion: needs a second lambda
    'lambda x: (lambda f: f(f))(lambda f: f(f))',
    'lambda x: (lambda f: (lambda g: g(g))(lambda g: f(lambda v: g(g)(v))))(lambda r: lambda n: n and r(n-1))(9)',
    # deep nesting (also within the length limit)
    'lambda x: ' + '(' * 10000 + 'x' + ')' * 10000, 'lambda x: ' + '[' * 10000 + ']' * 10000,
    'lambda x: ' + '-' * 140 + 'x', 'lambda x: ' + '[' * 70 + ']' * 70 + '[1]', 'lambda x: ' + 'not ' * 35 + 'x*0.5',
    # syntax errors, statements and other forbidden syntax
    'import os', 'lambda x: x; import os', 'x = 1', 'def f(x): return x', 'lambda x: (y := 1)',
    'lambda x: [y := v for v in x]', 'lambda x: (yield x)', 'lambda x: await x', 'lambda x: [*x, *x]',
    'lambda x: print(*x)', 'lambda *x: x', 'lambda x, y=1: x', 'lambda: 1', 'lambda x: {1: 2}', 'lambda x: {v for v in x}',
    'lambda x: x if x else', 'lambda x: 1.5', 'lambda x: 1j', "lambda x: b'abc'", 'lambda x: ...', 'lambda x: x\x00',
    '\x00', "lambda x: x\n__import__('os')", "lambda x: 'a\\x00'", "lambda x: '\\N{BULLET}'", 'lambda x: x is x',
    'lambda x: x << 99999', 'lambda x: ~x', 'lambda x: [v async for v in x]', 'lambda x: x[1:2, 3]', 'lambda x: 1/2',
    '', '   ', 'lambda', 'lambda x:', 'x', '1+1', '[v+1 for v in x]', 'lambda x: undefined_name',
    # run-time errors
    'lambda x: x[::0]', 'lambda x: 1//0', 'lambda x: x[99]', "lambda x: -'a'", 'lambda x: x + 1', "lambda x: sum(['a'])",
    'lambda x: min()', 'lambda x: 2**-1', "lambda x: int('z')", "lambda x: x['a']", 'lambda x: [v for v in 5]',
]


def test_hostile_corpus_gets_zero_reward_and_a_reason():
    assert len(HOSTILE) >= 50
    t = next(t for t in ENV.eval_tasks if t.family == 'sort')
    for src in HOSTILE:
        ep = ENV.reset(t)
        t0 = time.monotonic()
        s1, s2 = ENV.step(ep, src), ENV.step(ep, src)
        assert time.monotonic() - t0 < 2.0, src[:80]
        assert s1.reward == 0.0 and s1.obs and not s1.done, src[:80]
        assert s2.reward == 0.0 and s2.done and s2.feedback and ep.feedback == s2.feedback, src[:80]
        assert '\n' not in s1.obs and len(s1.obs) <= 100
    assert not os.path.exists('/tmp/lopd_codegen_pwned')


def test_hostile_reasons_are_specific():
    assert safe_eval('lambda x: 9**9**9', 1) == (None, 'number too large')
    assert safe_eval("lambda x: 'a'*10**9", 1) == (None, 'repetition too large')
    assert safe_eval('lambda x: range(10**12)', 1) == (None, 'range too large')
    assert safe_eval('lambda x: [0 for a in range(99) for b in range(99)]', 1) == (None, 'step budget exceeded')
    assert safe_eval('lambda x: [[0]*99]*99', 1) == (None, 'value too large')
    assert safe_eval("lambda x: '%99d' % 1", 1)[1].startswith('unsupported operands')
    assert safe_eval('lambda x: x.__class__', 1) == (None, 'rejected: Attribute not allowed')
    assert safe_eval('lambda x: (lambda f: f(f))(0)', 1) == (None, 'rejected: Lambda not allowed')
    assert safe_eval('lambda x: ｅｖａｌ(x)', 1)[1] == 'rejected: only printable ASCII, no backslashes'


def test_parser_failures_are_caught(monkeypatch):
    # with the length limit lifted, ast.parse itself fails on deep nesting (SyntaxError,
    # RecursionError or MemoryError, by Python version): it must still be a reason, not a crash
    monkeypatch.setattr(sandbox, 'MAX_PROGRAM_CHARS', 10 ** 7)
    for src in ['lambda x: ' + '(' * 10 ** 5 + ')' * 10 ** 5, 'lambda x: ' + '-' * 10 ** 6 + 'x',
                'lambda x: ' + '[' * 10 ** 5 + ']' * 10 ** 5, 'lambda x: ' + 'not ' * 10 ** 5 + 'x']:
        assert check_program(src)


def test_evaluator_works_from_threads():
    results = {}

    def work(i):
        results[i] = (safe_eval('lambda x: sorted(x)[::-1]', [i, 5, 1]), safe_eval('lambda x: 9**9**9', i))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(5)
    assert results == {i: ((sorted([i, 5, 1])[::-1], None), (None, 'number too large')) for i in range(8)}


# ----------------------------------------------------------------------------- fuzzing

FUZZ_ENV_TASK = ENV.eval_tasks[0]
TOKENS = ['x', 'v', 'for', 'in', 'if', 'else', '[', ']', '(', ')', '+', '-', '*', '**', '//', '%', '9', '99',
          '0', ':', ',', 'range(', 'sum(', 'len(', 'sorted(', 'str(', "'a'", '<', '==', 'not', 'and', 'or', '::']


def _step_quickly(text):
    ep = ENV.reset(FUZZ_ENV_TASK)
    t0 = time.monotonic()
    s = ENV.step(ep, text)
    assert time.monotonic() - t0 < 2.0
    assert s.reward in (0.0, 1.0) and (s.reward == 1.0 or s.obs)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_fuzz_arbitrary_text(text):
    _step_quickly(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), max_size=30).map(lambda ts: 'lambda x: ' + ' '.join(ts)))
def test_fuzz_token_soup(text):
    _step_quickly(text)  # reaches the checker and the interpreter much more often than text()
    if check_program(text) is None:  # accepted programs give plain data or a reason, never raise
        value, err = safe_eval(text, [1, 2])
        assert (err is None and type(value) in (int, bool, str, list, tuple, type(None))) or (value is None and err)


def _grammar():
    """Random well-formed programs from the allowed subset (no range/reversed at the top:
    ours return lists, Python's return lazy objects)."""
    leaves = st.sampled_from(['x', 'v', '0', '1', '2', '9', "'ab'", '[]', '[3,1]', 'True'])

    def grow(e):
        return st.one_of(
            st.tuples(e, st.sampled_from(['+', '-', '*', '**', '//', '%', '<', '==', ' in ', ' and ', ' or ']), e)
            .map(lambda t: f'({t[0]}{t[1]}{t[2]})'),
            st.tuples(st.sampled_from(['len', 'sum', 'sorted', 'str', 'max', 'list', 'int', 'abs', 'any']), e)
            .map(lambda t: f'{t[0]}({t[1]})'),
            e.map(lambda a: f'list(range({a}))'), e.map(lambda a: f'list(reversed({a}))'), e.map(lambda a: f'(not {a})'),
            st.tuples(e, e).map(lambda t: f'{t[0]}[{t[1]}]'),
            st.tuples(e, e, e).map(lambda t: f'{t[0]}[{t[1]}:{t[2]}]'),
            st.tuples(e, e).map(lambda t: f'[{t[0]} for v in {t[1]}]'),
            st.tuples(e, e, e).map(lambda t: f'[{t[0]} for v in {t[1]} if {t[2]}]'),
            st.tuples(e, e, e).map(lambda t: f'({t[0]} if {t[1]} else {t[2]})'),
            st.lists(e, max_size=3).map(lambda xs: '[' + ','.join(xs) + ']'))
    return st.recursive(leaves, grow, max_leaves=10).map(lambda body: 'lambda x: ' + body)


@pytest.mark.filterwarnings('ignore::SyntaxWarning')  # from Python's compile in eval(), e.g. on 9[0]
@settings(max_examples=200, deadline=None)
@given(_grammar(), st.sampled_from(INPUTS))
def test_fuzz_differential_against_python(src, x):
    """Where our evaluator returns a value, it is Python's value (so Python's eval is safe to
    run here: every operation was already done, bounded, by ours). Ours may refuse more
    (size and step limits, eager generators)."""
    if len(src) > sandbox.MAX_PROGRAM_CHARS:
        return
    reason = check_program(src)
    if reason:  # the grammar can use v outside a comprehension
        assert reason == "name 'v' not allowed here", (src, reason)
        return
    got, err = safe_eval(src, x)
    if err is None:
        assert code_repr(got) == code_repr(eval(src)(x)), (src, x)
