"""The method interface: what one on-policy method is, what its step sees, and the registry.

LOPD's step is written out in train.py (train.lopd_step, Algorithm 1). Every other method goes
through train.train_step, one generic step of the same shape:

    rollout -> teacher_phase -> student_phase -> after_step
    (method.sample) method.context  method.loss     method.after_step

A method is one `Method(...)` record, registered by name in METHODS. A step, train_step or a method's own,
takes the run and returns the episodes it played; the loop (train.take_step) counts them and the steps. Its block holds everything
that is its own: the context builder (pure: evaluation calls it too, so it may read but never
change state), its loss, its state (created by `state`, saved in ckpt.pt and restored whatever it
holds), a one-time `setup`, an `after_step` hook, the flags only it reads, and its bench entries.
A method is registered by importing the file that holds it: train.py lists the repo's own
(plugins/), and a forker's file imports train, registers, and calls train.main().
"""
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

import lopd
import model as M
from plumbing.bookkeeping import arg


@dataclass
class Batch:
    """One step's rollouts, as every hook receives them."""
    eps: list              # B envs.Episode
    ids: torch.Tensor      # (B, T) the trajectories' tokens, right-padded
    amask: torch.Tensor    # (B, T) 1 on tokens the agent generated
    attn: torch.Tensor     # (B, T) 1 on real tokens
    reward: torch.Tensor   # (B,) graded, in [0, 1] (1 = success: every check passed)


@dataclass
class Teacher:
    """What train.teacher_phase hands the loss and the after-step hook."""
    logits: torch.Tensor   # (B, T, V) π_T(· | c, x, y<t) at every position of every trajectory (a lopd.Logits
                           # with --score_chunk: read it, as logits_s, through lopd's functions or lopd.per_position)
    keep: torch.Tensor     # (B,) bool: False where the method gave the rollout no context (masked out)
    context: list          # what method.context returned (LOPD's also carries z, z0 and what was retrieved)


class Prefixes(list):
    """A context builder's answer: one teacher context (a text or an embedded (P_i, d)) per rollout, or None for a rollout
    that gets no teacher, plus, as attributes, whatever else the same pass made that a loss or
    hook needs (LOPD: the latents z with φ's graph, their cold-start z0, what was retrieved)."""

    def __init__(self, prefixes, **extra):
        super().__init__(prefixes)
        self.__dict__.update(extra)


@dataclass
class Method:
    """One on-policy method. Every field is a keyword; only `loss` is required."""
    loss: Callable                       # (run, batch, logits_s, teacher) -> scalar loss for θ
    context: Optional[Callable] = None   # (run, episodes) -> per rollout a text, an embedded prefix, or None (no teacher); pure
    sample: Optional[Callable] = None    # (run, tasks, rollout) -> the batch's (eps, bodies, masks) (None: rollout of θ, no context)
    teacher: str = 'frozen'              # the teacher's weights: 'frozen' θ0, 'ema' of θ, 'live' θ, or 'none'
    divergence: str = 'rkl'              # D of the distillation loss, unless --divergence says otherwise
    group: int = 1                       # rollouts per task in a batch
    lr: float = 1e-3                     # student learning rate, unless --lr says otherwise
    ema_rate: float = 0.05               # rate of an EMA teacher, unless --ema_rate says otherwise
    state: Callable = lambda run: {}     # (run) -> dict of the method's own state (anything with state_dict, or plain data)
    setup: Optional[Callable] = None     # (run, rollout) -> None, once before training; cached (bookkeeping.cached_setup)
    after_step: Callable = lambda run, b, logits_s, teacher: {}  # -> dict of numbers to log
    step: Optional[Callable] = None      # (run) -> the episodes it played, a whole step of its own (LOPD's: train.lopd_step;
    #                                      None = train.train_step); the loop counts them and the step (train.take_step)
    flags: dict = field(default_factory=dict)  # name -> arg(...): the flags only this method reads (its loss's and, through
    #                                            train_step with a teacher, TEACHER_FLAGS are added by register)
    bench: dict = field(default_factory=dict)  # the bench entry -> dict(flags=[...], cost=seconds, quick=bool, and on the
    #                                            method's own entry knob=[flags]: another setting of its key knob, which
    #                                            the bench --tune tries beside the learning rate ×1/3, ×1, ×3


METHODS: dict = {}


def register(name, method, first=False):
    """Add a method under a name (bench's entry of the same name is added unless it has one), with the flags it
    reads: its own, its loss's (`distill` reads DISTILL_FLAGS), and TEACHER_FLAGS where train_step builds its
    teacher. first=True lists it first (in -h and the bench), whichever file was imported first."""
    method.bench = method.bench or {name: {}}
    reads_teacher = method.step is None and method.context is not None and method.teacher != 'none'
    method.flags = {**getattr(method.loss, 'flags', {}), **(TEACHER_FLAGS if reads_teacher else {}), **method.flags}
    rest = {k: v for k, v in METHODS.items() if k != name and first}
    for k in rest:
        del METHODS[k]
    METHODS[name] = method
    METHODS.update(rest)
    return method


def readers(flag):
    """The methods that read a method flag, e.g. 'J' -> ['lopd', 'trajtext']."""
    return [n for n, m in METHODS.items() if flag in m.flags]


# ----------------------------------------------------------------------------- pieces the methods share

def embed_context(run, ctx):
    """A context builder's answer, ready for the teacher: text becomes <|bos|><|ctx|> text embedded by
    the teacher (M.text_prefix); an embedded prefix (P, d) and None (no teacher) pass through."""
    # text is a constant: detached, since --grad_ckpt's hook (transformers' enable_input_require_grads) marks every
    # embedding as requiring grad, even under no_grad, and the teacher would then keep a graph of its scoring
    with torch.no_grad():
        text = {i: M.text_prefix(run.teacher, run.tok, [c])[0].detach() for i, c in enumerate(ctx) if isinstance(c, str)}
    out = [text[i] if i in text else c for i, c in enumerate(ctx)]
    return Prefixes(out, **vars(ctx)) if isinstance(ctx, Prefixes) else out


def with_default(run, prefixes):
    """None (no context for this rollout) -> the context-free <|bos|> prefix."""
    return [p if p is not None else M.bos_prefix(run.teacher, run.tok, 1)[0] for p in prefixes]


DISTILL_FLAGS = {  # read by every method whose loss is the distillation loss
    'divergence': arg('', "distillation divergence D ('' = the method's)", choices=['rkl', 'fkl', 'jsd'], after_setup=True),
    'topk': arg(0, 'distil over the teacher top-k + one tail bucket (0 = full vocabulary)', lo=0, after_setup=True),
    'epochs': arg(1, 'student updates on each batch of rollouts, all toward the teacher scores computed once '
                  '(a fixed target: no ratio to correct, unlike a policy gradient)', lo=1, after_setup=True),
}
TEACHER_FLAGS = {  # the baselines' teacher may be swapped (LOPD's composer is trained against θ0 only)
    'teacher': arg('', "the teacher's weights ('' = the method's)", choices=['frozen', 'ema', 'live'], after_setup=True),
    'ema_rate': arg(0.0, "rate of an EMA teacher: θ_T ← (1 − rate) θ_T + rate θ (0 = the method's: SDPO 0.05, SDFT 0.01)",
                    lo=0, hi=1, after_setup=True),
}


def distill(run, b, logits_s, teacher):
    """L_distill = Σ_{t∈A} D(π_θ(·|x,y<t) ‖ sg π_T(·|c,x,y<t)) / |A| over the rollouts that got a teacher."""
    mask = b.amask * teacher.keep[:, None].to(b.amask)
    return lopd.distill_loss(logits_s, teacher.logits, mask, run.args.divergence or run.method.divergence, run.args.topk)


distill.flags = DISTILL_FLAGS  # the flags it reads: a method whose loss is distill accepts them (register)
