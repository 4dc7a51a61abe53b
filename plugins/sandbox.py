"""The safe evaluator for generated programs: model output is hostile input.

A program must be one `lambda x: <expression>` in a small Python subset. It is parsed with
`ast`, checked against a whitelist (compile_program: no attributes, no imports, no names
starting with `_`, no nested lambdas, starred, walrus or f-strings; printable ASCII only,
≤ MAX_PROGRAM_CHARS characters, ≤ MAX_NODES nodes) and run by a small interpreter of its own
(run_program), never by Python's eval/exec/compile. Every value is size-bounded (MAX_CELLS,
MAX_INT_BITS; `**`, repetition and `range` are refused before they would exceed that), each
test has a step budget (MAX_STEPS) and a wall-clock backstop (MAX_SECONDS).

Guaranteed: a program cannot reach Python objects, builtins beyond SAFE_BUILTINS, the file
system, the network or the process, and a call returns within about a second with a value or a
one-line reason. Not guaranteed: this is not an OS-level sandbox (no separate process, no memory
limit beyond the size bounds), and bugs in the interpreter itself are not excluded.

    safe_eval(src, x)     -> (value, None) or (None, reason)
    run_tests(src, tests) -> (passed, feedback line)
"""
import ast
import time

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
