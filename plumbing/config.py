"""The command line: train.Args plus every registered method's own flags, as one config.

`-h` shows the flags in groups (the run, the model and warm-up, then each set of methods' own
flags); a bad flag or value is one line on stderr and exit status 2, never a traceback.
"""
import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
from dataclasses import dataclass

import torch

import envs
from plumbing import bookkeeping as bk
from plumbing import parallel
from plumbing.bookkeeping import arg, die
from plumbing.registry import METHODS, readers

RUN, MODEL = 'the run', 'the model and the warm-up'   # -h's first two groups, in this order


@dataclass
class ModelArgs:
    """The model and the warm-up that builds the base: what train.Args adds to them is the run."""
    model: str = arg('', "a transformers causal LM: hub name, folder, or .gguf file (its quantized weights are dequantized "
                     "to --dtype and LoRA trains on top of them); a chat model is told the task in its system turn "
                     "('' = the offline tiny Llama)", group=MODEL)
    lora_r: int = arg(-1, 'rank of the LoRA adapter that trains (0 = every weight trains; -1 = 16 with --model, '
                      '0 for the tiny model)', lo=-1, group=MODEL)
    score_chunk: int = arg(-1, 'positions per chunk through the LM head when scoring (0 = the whole batch at once; '
                           '-1 = 256 with --model, 0 for the tiny model)', lo=-1, group=MODEL)
    micro_batch: int = arg(-1, 'rows per forward, and per backward, in every scoring and training phase (teacher, student, '
                           'composer, warm-up, cold start), and decoded at once off CUDA (--decode_rows): memory grows with '
                           'it, not with --batch or --warmup_batch (0 = a phase\'s whole batch; the warm-up 16, the cold start '
                           '32 rows; -1 = 4 with --model, 0 for the tiny model)', lo=-1, group=MODEL)
    decode_rows: int = arg(-1, 'rows decoded at once in rollouts, evaluation and a bank\'s or pool\'s fill (the KV cache '
                           'grows with it; --micro_batch bounds the rest): -1 = on CUDA all that fit half the free memory, '
                           'elsewhere --micro_batch\'s (evaluation 128, a fill 64); 0 = a whole batch', lo=-1, group=MODEL)
    merge_lora: bool = arg(False, "decode θ's rollouts with its LoRA merged into the weights (fewer ops a token; in bf16 the "
                           "merged delta is rounded: a departure, off by default)", after_setup=True, group=MODEL)
    grad_ckpt: bool = arg(False, "gradient checkpointing: recompute the model's activations in the backward pass, layer by layer "
                          "(θ's, and the frozen teacher's where it holds φ's graph)",
                          after_setup=True, group=MODEL)
    export: str = arg('', 'write a run folder\'s student as a transformers model (LoRA merged) to <run>/export, then exit',
                      after_setup=True, group=MODEL)
    d_model: int = arg(128, 'tiny Llama width', lo=1, group=MODEL)
    n_layer: int = arg(4, 'tiny Llama depth', lo=1, group=MODEL)
    bpe_merges: int = arg(256, 'BPE merges of the tiny model\'s tokenizer, learned offline from the environment\'s text '
                          '(0 = plain bytes)', lo=0, group=MODEL)
    warmup_steps: int = arg(800, 'supervised warm-up steps on noisy-expert demos (tool use: reading a context forms after ~500; codegen: 500)', lo=0, group=MODEL)
    warmup_batch: int = arg(32, 'demos per warm-up step (codegen and tooluse-v1: 64, as when their numbers were '
                             'measured)', lo=1, group=MODEL)
    warmup_lr: float = arg(3e-3, 'warm-up learning rate', lo=0, group=MODEL)
    warmup_gate: float = arg(0.15, "after the cosine, the reading tail (demos that copy a plan shown) where the base plays "
                             "fewer than this fraction more of 1,024 demos with a past experience's plan shown than without "
                             "(a base that does not read: its teacher would know nothing more; 0 = never, 1 = always)",
                             lo=0, hi=1, group=MODEL)
    warmup_tail: float = arg(0.5, "the reading tail's steps, as a fraction of --warmup_steps", lo=0, group=MODEL)
    warmup_seed: int = arg(4, "the base's draw: the tiny model's init and the warm-up's demos and their order (the "
                           "default is the shipped base's, base/tooluse; another seed builds a base here)", group=MODEL)
    build_base: bool = arg(False, "build the base here from its recipe, even where it is the shipped one's (another draw: "
                           "this machine's float kernels round it their own way)", group=MODEL)
    warmup_ctx: float = arg(0.6, 'fraction of warm-up demos that teach the base to read a privileged context '
                            '(0 = the base that never saw one, an ablation)', lo=0, hi=1,
                            group=MODEL)


def config_class(Args):
    """Args plus every registered method's own flags: the one config a run saves."""
    own = {}
    for m in METHODS.values():
        for k, f in m.flags.items():
            own.setdefault(k, f)
    return dataclasses.make_dataclass('Config', [(k, type(f.default), dataclasses.field(default=f.default, metadata=f.metadata))
                                                 for k, f in own.items()], bases=(Args,))


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        die(message)


def parse_args(Args, argv=None, description=''):
    """--flags -> the config (the saved one, when resuming)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    for path in plugin_files(argv):  # before the parser: --method's choices and the flags include what they register
        load_plugin(path)
    Config = config_class(Args)
    p = Parser(description=description, allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    groups = {t: p.add_argument_group(t) for t in (RUN, MODEL)}
    for f in dataclasses.fields(Config):
        title = f.metadata['group'] or 'only for ' + ', '.join(readers(f.name))
        g = groups.get(title) or groups.setdefault(title, p.add_argument_group(title))
        choices = f.metadata['choices']
        choices = choices() if callable(choices) else choices  # a registry's names, read once the plugins are in
        kw = dict(action='store_true') if f.type is bool else dict(type=f.type, default=f.default, choices=choices)
        g.add_argument(f'--{f.name}', help=f.metadata['help'], **kw)
    a = Config(**vars(p.parse_args(argv)))
    given = {t[2:].split('=')[0] for t in argv if t.startswith('--')}
    for k, v in envs.ENVS[a.env].defaults.items():  # the environment's own defaults, where a flag is not given
        if k not in given:
            setattr(a, k, v)
    if a.lora_r < 0:
        a.lora_r = 16 if a.model else 0
    if a.score_chunk < 0:
        a.score_chunk = 256 if a.model else 0
    if a.micro_batch < 0:
        a.micro_batch = 4 if a.model else 0
    if a.export:
        a.resume = a.resume or a.export
    a.plugin = ','.join(os.path.abspath(os.path.expanduser(p)) for p in a.plugin.split(',') if p) or \
        ','.join(fork_files(METHODS[a.method]))  # a fork run as `python my_variant.py`: resumable by train.py too
    check_args(a, given)
    return bk.resume_config(a, argv, Config) if a.resume else a


def plugin_files(argv):
    """The files --plugin names (comma-separated, the flag repeatable); with --resume, those the run saved."""
    given = [v for i, t in enumerate(argv) for v in ([argv[i + 1]] if t == '--plugin' and i + 1 < len(argv) else
                                                      [t.split('=', 1)[1]] if t.startswith('--plugin=') else [])]
    resume = [v for i, t in enumerate(argv) for v in ([argv[i + 1]] if t in ('--resume', '--export') and i + 1 < len(argv) else
                                                       [t.split('=', 1)[1]] if t.startswith(('--resume=', '--export=')) else [])]
    for r in resume:  # a fork's run: its config.json names the files, which must be imported before the checkpoint is read
        saved = os.path.join(r if os.path.isdir(r) else os.path.dirname(r), 'config.json')
        with contextlib.suppress(OSError, ValueError):
            given.append(json.load(open(saved)).get('plugin', ''))
    return [p for v in given for p in v.split(',') if p]


def load_plugin(path):
    """Import a fork's file by its path, once (the script that was run, or a file already imported, is not imported
    again): its `register(...)` calls add its methods. Its folder goes on sys.path, for its own imports."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        die(f'--plugin {path}: no such file')
    if any(os.path.abspath(getattr(m, '__file__', None) or '') == path for m in list(sys.modules.values())):
        return
    name = os.path.splitext(os.path.basename(path))[0]
    name = name if name not in sys.modules else f'plugin_{name}'
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(path))
    spec.loader.exec_module(module)


def fork_files(method):
    """The files outside the repo's modules that a method's hooks come from (a fork's own file), for --plugin."""
    return list(dict.fromkeys(os.path.abspath(f) for f in bk.hook_files(method)
                              if os.path.relpath(os.path.abspath(f), bk.ROOT) not in bk.MODULES))


SETUP_BUDGETS = ('init_episodes', 'pool_episodes', 'steer_episodes')  # a method's setup rollouts, counted in --episodes


def check_budget(a):
    """A budget the method's setup would spend whole trains nothing: one line, exit 2 (train.main calls it;
    the bench plans runs of any budget through parse_args, and its runs meet this check when they start)."""
    m = METHODS[a.method]
    setup = {k: getattr(a, k) for k in SETUP_BUDGETS if k in m.flags and m.setup}
    if not a.setup_free and not a.resume and a.episodes < sum(setup.values()):
        die(f'--episodes {a.episodes} is below the {sum(setup.values())} episodes {a.method}\'s setup samples first '
            f'({", ".join(f"--{k} {v}" for k, v in setup.items())}): raise --episodes, lower them, or add --setup_free')


def check_args(a, given):
    """What argparse's choices and the fields' ranges do not cover (given: the flags on the command
    line): one line each, exit status 2."""
    bk.check_ranges(a)
    m = METHODS[a.method]
    for k in sorted(given - set(m.flags)):
        if readers(k):
            die(f'--{k} applies to {", ".join(readers(k))} only, not {a.method}')
    for f in dataclasses.fields(a):  # e.g. --margin with --freeze_composer would be read by nothing
        if f.name in given and f.metadata.get('unless') and getattr(a, f.metadata['unless']):
            die(f'--{f.name} acts only without --{f.metadata["unless"]}')
    if a.batch % m.group:
        die(f'--batch {a.batch} must be a multiple of the group size {m.group} of {a.method}')
    ranks = int(os.environ.get('WORLD_SIZE', 1))
    if a.batch % (m.group * ranks):
        die(f'--batch {a.batch} must be a multiple of the group size {m.group} × {ranks} ranks, so every rank rolls out whole groups')
    if a.resume and not os.path.exists(a.resume):
        die(f'--resume path does not exist: {a.resume}')
    if a.device == 'cuda' and not torch.cuda.is_available():
        die('--device cuda asked for, but torch sees no CUDA device')
    kind = parallel.pick_device(a.device).type
    if a.dtype == 'bf16' and (kind == 'mps' or kind == 'cuda' and not torch.cuda.is_bf16_supported()):
        die(f'--dtype bf16 is not supported on this {kind} device; use --dtype fp32')
    local = os.path.expanduser(a.model)
    if a.model.startswith(('.', '/', '~')) and not (os.path.isdir(local) or local.endswith('.gguf') and os.path.isfile(local)):
        die(f'--model {a.model}: no such folder' + (' or file' if local.endswith('.gguf') else ''))
    if os.path.exists(a.out_dir) and not os.path.isdir(a.out_dir):
        die(f'--out_dir {a.out_dir} is a file, not a folder')

