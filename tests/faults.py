"""Test-only faults, installed from outside the product (train.py has no test hooks):

    python tests/faults.py [--signal STEP:KILL|TERM] [--nan STEPS] [--plugin MODULE] -- TRAIN.PY ARGS

--signal  sends this process the signal right after training step STEP, i.e. between two
          checkpoints, at a step that does not depend on the machine's speed;
--nan     makes the student loss of those steps (1-based, e.g. 2,5) NaN: they must be skipped;
--plugin  imports a module first, as a forker's file that registers a method would be.
In-process tests use the same functions with pytest's monkeypatch."""
import argparse
import functools
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import train  # noqa: E402
from plumbing import registry  # noqa: E402


def signal_after(step, sig, real):
    """A training step (train.lopd_step, or train.train_step), then this process gets `sig` once `step` steps are done
    (the loop counts this one after it returns). functools.wraps keeps the step's module, so the run's code fingerprint
    (and its cached setup) is the product's."""
    @functools.wraps(real)
    def step_then_signal(run):
        eps = real(run)
        if run.step + 1 == step:
            os.kill(os.getpid(), sig)
        return eps
    return step_then_signal


def nan_loss(loss, steps):
    """A method's loss, made NaN in the given training steps (1-based)."""
    return lambda run, *a: loss(run, *a) * float('nan') if run.step + 1 in steps else loss(run, *a)


if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('--signal', default='')
    p.add_argument('--nan', default='')
    p.add_argument('--plugin', default='')
    o, rest = p.parse_known_args()
    if o.plugin:
        __import__(o.plugin)
    if o.signal:
        step, name = o.signal.split(':')
        for m in registry.METHODS.values():  # each method's own step (LOPD's), or the generic one
            m.step = signal_after(int(step), getattr(signal, 'SIG' + name), m.step or train.train_step)
    if o.nan:
        for m in registry.METHODS.values():
            m.loss = nan_loss(m.loss, {int(s) for s in o.nan.split(',')})
    train.main([a for a in rest if a != '--'])
