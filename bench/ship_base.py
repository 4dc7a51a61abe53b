"""Build the shipped base (base/tooluse) from its recipe, write it, and measure it.

    python -m bench.ship_base                       # train.py's default recipe, built on this machine
    python -m bench.ship_base --warmup_seed 4       # another draw (then make it train.py's default: plumbing/config.py)

writes base/tooluse/model.safetensors (the weights: no pickle), tokenizer.json (the BPE merges they were trained with)
and manifest.json: the recipe's flags, the files' sha256, the torch, CPU kernels and threads that built it, its
reading curve and gate, and its facts, each measured by a train.py run from the shipped files (their commands are in
the manifest): the held-out reward and success on 500 tasks, and the teacher's paired gap over its student at step 0
on 100 tasks, with LOPD's latents (after the cold start of run seed 0) and with OPSD's text.

A base built here is a draw of this machine's float kernels (docs/bases.md): ship one on purpose, by its facts."""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import envs  # noqa: E402
import train  # noqa: E402
import warmup  # noqa: E402
from plumbing import bookkeeping as bk  # noqa: E402

GAP_RUN = ['--setup_free', '--episodes', '16', '--eval_samples', '0', '--teacher_eval', '100', '--overwrite']


def cpu_name():
    try:
        with open('/proc/cpuinfo') as f:
            return next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def flags_of(recipe):
    """The recipe as train.py flags: the ones it differs from train.py's defaults in."""
    default = warmup.recipe(train.parse_args([]))
    return [t for k, v in recipe.items() if v != default[k] for t in (f'--{k}', str(v))]


def write(args, tok, model, saved, command):
    """The weights, the tokenizer and a manifest without facts yet (train.py needs a manifest to load the base)."""
    from safetensors.torch import save_model
    folder = warmup.SHIPPED
    os.makedirs(folder, exist_ok=True)
    save_model(model, os.path.join(folder, warmup.WEIGHTS))
    ranks = sorted(tok.enc._mergeable_ranks.items(), key=lambda kv: kv[1])
    with open(os.path.join(folder, warmup.TOKENIZER), 'w') as f:
        json.dump({'ranks': [[b.hex(), r] for b, r in ranks]}, f)
    return {'recipe': warmup.recipe(args), 'recipe_digest': warmup.recipe_digest(args, tok, envs.make_env(args.env)),
            'files': {n: warmup.sha256(os.path.join(folder, n)) for n in (warmup.WEIGHTS, warmup.TOKENIZER)},
            'built': {'torch': torch.__version__, 'cpu_kernels': warmup.cpu_kernels(), 'cpu': cpu_name(),
                      'threads': bk.BUILD_THREADS, 'date': datetime.date.today().isoformat(), 'command': command},
            'reading': saved['reading'], 'gate': saved['gate'], 'facts': None}


def gap_run(method, recipe, out_dir, eval_tasks):
    """A train.py run from the shipped base that evaluates it and its teacher at step 0 -> (command, its base line)."""
    name = f'ship-{method}'
    cmd = ['python', 'train.py', '--method', method, *flags_of(recipe), '--eval_tasks', str(eval_tasks), *GAP_RUN,
           '--out_dir', out_dir, '--name', name]
    subprocess.run([sys.executable, *cmd[1:]], cwd=warmup.ROOT, check=True)
    with open(os.path.join(out_dir, name, 'metrics.jsonl')) as f:
        return ' '.join(cmd), json.loads(f.readline())


def facts(recipe, out_dir):
    gap = lambda m: dict(zip(('mean', 'lo', 'hi'), (round(g, 4) for g in bk.paired_gap(m['task_teacher_reward'],
                                                                                       m['task_reward']))))
    lopd_cmd, lopd = gap_run('lopd', recipe, out_dir, 500)
    opsd_cmd, opsd = gap_run('opsd', recipe, out_dir, 100)
    return {'reward': lopd['reward'], 'success': lopd['success'], 'eval_tasks': 500, 'teacher_eval': 100,
            'gap_lopd': gap(lopd), 'gap_opsd': gap(opsd), 'commands': [lopd_cmd, opsd_cmd]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--out_dir', default='runs', help='where the warm-up is cached and the facts\' runs go')
    o, rest = p.parse_known_args(argv)
    args = train.parse_args([*rest, '--build_base', '--out_dir', o.out_dir])
    if args.model or args.env != 'tooluse':
        bk.die('the shipped base is the tiny model\'s on tool use (no --model, no other --env)')
    env = envs.make_env(args.env)
    tok, model = warmup.load_model(args, env)
    path, _ = warmup.warmup(args, tok, model, env, 'cpu')
    saved = torch.load(path, map_location='cpu', weights_only=False)   # the cache built here, never a shipped file
    man = write(args, tok, model, saved, ' '.join(['python -m bench.ship_base', *rest]))
    where = os.path.join(warmup.SHIPPED, 'manifest.json')
    bk.atomic_json(man, where)
    man['facts'] = facts(man['recipe'], o.out_dir)
    bk.atomic_json(man, where)
    print(warmup.describe(man))


if __name__ == '__main__':
    main()
