"""The compare's entries and flags, from the method registry: every method's own entry, its
ablations (Method.bench), the quick set, the tuning grid; and train.py's own parser, through which
every run's flags pass. bench/compare.py runs them, bench/gap.py reports on them."""
import argparse
import contextlib
import dataclasses
import io
import os
import sys

import train  # its import registers every method (LOPD, and plugins/)
from plumbing.registry import METHODS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo


# LOPD's entry and its ablation grid (one alternative per knob: the margin sweep is m = 0, 0.05, 0.2) and the control
METHODS['lopd'].bench = {
    'lopd': dict(knob=['--cold_start_steps', '300'], cost=350, quick=True),
    'lopd-frozen': dict(flags=['--freeze_composer'], cost=280, quick=True),
    'lopd-m0': dict(flags=['--margin', '0'], cost=350, quick=True),
    'lopd-m0.2': dict(flags=['--margin', '0.2'], cost=350),
    'lopd-centered': dict(flags=['--advantage', 'centered'], cost=350),
    'lopd-k16': dict(flags=['--K', '16'], cost=280),
    'lopd-j3': dict(flags=['--J', '3'], cost=300),
    'lopd-textcs': dict(flags=['--cold_start', 'text'], cost=300),
    'lopd-self': dict(flags=['--allow_same_task'], cost=280),
    'lopd-offline': dict(flags=['--setup_free'], cost=300),
    'lopd-other': dict(flags=['--retrieval', 'other'], cost=280)}
ENTRIES, QUICK_ENTRIES, TUNE, COST = {}, [], {}, {}


def read_registry():
    """The tables below from the method registry, in place (again after `--plugin` registers more methods):
    entry -> train.py flags, every method's own entry first, then the ablations (Method.bench of each method)."""
    bench = sorted(((e, name, b) for name, m in METHODS.items() for e, b in m.bench.items()), key=lambda x: x[0] not in METHODS)
    ENTRIES.clear()
    ENTRIES.update({e: ['--method', name] + b.get('flags', []) for e, name, b in bench})
    QUICK_ENTRIES[:] = [e for e, _, b in bench if b.get('quick')]
    TUNE.clear()
    TUNE.update({name: tuning_grid(name, m) for name, m in METHODS.items()})
    COST.clear()  # seconds per full run on one of 2 busy cores (README's compare): only the launch order uses them
    COST.update({e: b.get('cost', 300) for e, _, b in bench})


# --quick: the quick entries × 3 seeds, 1024 episodes, evaluated every 256 episodes (at the default batch of 16) on 500 tasks
QUICK_FLAGS = ['--episodes', '1024', '--eval_tasks', '500', '--eval_every', '16']
# --tune: the same grid for every method, its learning rate ×1/3, ×1, ×3 and one other setting of its key
# knob (its own entry's knob=[...]); the default first, kept unless another setting beats it beyond the
# noise on seed 0 and again on CONFIRM_SEED (report.choose_setting). Ablations take their method's choice (lopd-m0 keeps its margin 0: entry flags win).
def tuning_grid(name, m):
    """[default, lr / 3, lr × 3, the knob's other setting] (each a list of train.py flags)."""
    lr = lambda x: ['--lr', f'{x:.0e}'.replace('e-0', 'e-')]  # 1e-3 / 3 -> 3e-4
    knob = m.bench.get(name, {}).get('knob')
    return [[], lr(m.lr / 3), lr(m.lr * 3)] + ([knob] if knob else [])


read_registry()
CONFIRM_SEED = 100  # the second validation seed, where a setting that beat the default on seed 0 runs again beside it
OWN = ('--method', '--seed', '--name', '--resume')  # set by bench per run, never forwarded


def die(msg):
    print(f'bench: error: {msg}', file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        die(message)


def method_of(entry):
    f = ENTRIES[entry]
    return f[f.index('--method') + 1]


# ----------------------------------------------------------------------------- planning runs

def train_args(flags):
    """train.py's own parser on these flags -> its Args; a bad flag is bench's one-line error."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return train.parse_args(flags)
    except SystemExit:
        die(f"train.py rejects `{' '.join(flags)}`: {err.getvalue().strip().removeprefix('train.py: error: ')}")


def for_method(flags, method):
    """Drop the flags (and their values) that the method does not read: a compare forwards e.g.
    --cold_start_steps to every entry, and only the runs of methods that have it take it."""
    bools = {f.name for f in dataclasses.fields(train.config_class()) if f.type is bool}
    foreign = {k for m in METHODS.values() for k in m.flags} - set(METHODS[method].flags)
    out, i = [], 0
    while i < len(flags):
        name = flags[i][2:].split('=')[0] if flags[i].startswith('--') else None
        n = 1 if name is None or name in bools or '=' in flags[i] else 2
        out += [] if name in foreign else flags[i:i + n]
        i += n
    return out
