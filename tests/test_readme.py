"""The README stays true to the repo: its test line is what CI runs, its links and figure exist, and every
command it, the docs and the notebooks give parses. (Its fork example is tests/fork_variant.py's: tests/test_fork.py.)"""
import os
import re

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
read = lambda *p: open(os.path.join(ROOT, *p)).read()


def test_the_readme_test_line_is_what_ci_runs():
    """Quick start, second line: the install and test commands that .ci/run runs, in the same order."""
    line = next(l for l in read("README.md").splitlines() if "pytest" in l and l.startswith("pip install"))
    steps = [s.strip() for s in line.split("#")[0].split("&&")]
    ci = [l.split("#")[0].strip() for l in read(".ci", "run").splitlines()]
    ci = [l.replace(" -q ", " ") for l in ci if l.startswith(("pip install", "python -m pytest"))]
    assert [s for s in steps if "pytest" in s] == [l for l in ci if "pytest" in l]
    for s in steps[:-1]:
        assert s.replace(" -q ", " ") in ci, s


def test_every_relative_link_of_the_readme_and_docs_exists():
    docs = [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "docs")) for f in fs]
    for doc in ["README.md", *docs]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", read(doc)):
            if not target.startswith(("http://", "https://")):
                path = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), target))
                assert os.path.exists(path), f"{doc} links to {target}, which does not exist"


NOTEBOOKS = sorted(f for f in os.listdir(os.path.join(ROOT, "notebooks")) if f.endswith(".ipynb"))
COMMAND = r"python (train\.py|-m bench(?![.\w]))([^`\n'\"]*)"                # train.py, the bench (not bench.ship_base)
SCRIPT = r"python (train\.py|-m bench(?![.\w])|[\w/]+\.py)([^`\n'\"]*)"         # the notebooks': any python command


def cells(notebook):
    """A notebook's cells' text, markdown and code alike."""
    import json
    return ["".join(c["source"]) for c in json.load(open(os.path.join(ROOT, "notebooks", notebook)))["cells"]]


def commands():
    """Every `python train.py …`, `python -m bench …` and `python FORK.py …` of the README, docs/'s current pages (not
    docs/history/) and the notebooks' markdown and code cells."""
    pages = ["README.md", *(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))]
    texts = [(page, read(page)) for page in pages] + [(nb, text) for nb in NOTEBOOKS for text in cells(nb)]
    found = set()
    for page, text in texts:
        parts = text.split("```")
        code = [line for block in parts[1::2] for line in block.replace("\\\n", " ").splitlines()]   # fenced, joined at \\
        spans = [span.replace("\n", " ") for prose in parts[::2] for span in re.findall(r"`([^`]+)`", prose)]
        for line in code + spans + (text.splitlines() if page.endswith(".ipynb") else []):
            for prog, rest in re.findall(SCRIPT if page.endswith(".ipynb") else COMMAND, line):
                found.add((page, prog, rest.split(" #")[0].strip()))
    return sorted(found)


def written_files():
    """What the notebooks' `%%writefile {RUNS}/NAME` cells write: NAME -> the cell's text (a fork's own file)."""
    return {m.group(1): text.split("\n", 1)[1] for nb in NOTEBOOKS for text in cells(nb)
            for m in [re.match(r"%%writefile \S*?([\w.]+\.py)\n", text)] if m}


def concrete(rest, files=None):
    """A documented command's flags as a user types them: placeholders filled (S, W: 0; M, METHOD: lopd), the first of {a,b}
    and of [x | y], optional [--flag value] kept, $SMOL a file name, other `$VAR`, `...`, `[flags]` and a flag whose value
    is elided (…) dropped; a --plugin file as the repo holds it, a notebook writes it (files: name -> path), or the
    README's my_variant.py (tests/fork_variant.py)."""
    rest = re.sub(r"\{([^,}]+)[^}]*\}", r"\1", rest)
    rest = re.sub(r"\[flags\]|--\w+ …|\$(?!SMOL)\w+|\.\.\.", "", rest.replace("$SMOL", "smollm2.gguf"))
    rest = re.sub(r"\[([^\]|]+?)(?:\s*\|[^\]]*)?\]", r"\1", rest)
    argv = [{"S": "0", "W": "0", "M": "lopd", "METHOD": "lopd", "PATH_OR_NAME": "some/model"}.get(t, t) for t in rest.split()]
    return [plugin_path(t, files or {}) if i and argv[i - 1] == "--plugin" else t for i, t in enumerate(argv)]


def plugin_path(name, files):
    here, base = os.path.join(ROOT, name), os.path.basename(name)
    if os.path.isfile(here):
        return here
    return files.get(base) or (os.path.join(ROOT, "tests", "fork_variant.py") if base == "my_variant.py" else name)


def test_every_command_of_the_current_pages_and_the_notebooks_parses(tmp_path):
    """The commands the README, docs/'s current pages and the notebooks give run today: train.py's parse with its own
    parser (a run folder to --resume or --export aside: their flags must exist), the bench's with its, a fork's file
    imported as --plugin imports it, then train.py's parse of its flags. The methods they register are unregistered after."""
    import contextlib
    import io
    import sys
    sys.path.insert(0, ROOT)
    import train
    from bench import compare, entries
    from plumbing import config
    from plumbing.registry import METHODS
    files = {}
    for name, text in written_files().items():
        (tmp_path / name).write_text(text)
        files[name] = str(tmp_path / name)
    cmds = commands()
    assert len(cmds) > 20 and {page for page, _, _ in cmds} >= set(NOTEBOOKS) - {"01_environments_and_rollouts.ipynb"}
    before = dict(METHODS)
    try:
        for page, prog, rest in cmds:   # each on the repo's methods alone, its fork files imported afresh (a new process)
            METHODS.clear()
            METHODS.update(before)
            argv = concrete(rest, files)
            script = [plugin_path(prog, files)] if prog.endswith(".py") and prog != "train.py" else []
            forks = {os.path.abspath(t) for i, t in enumerate(argv) if i and argv[i - 1] == "--plugin"} | set(map(os.path.abspath, script))
            for k in [k for k, m in sys.modules.items() if os.path.abspath(getattr(m, "__file__", None) or "/") in forks]:
                del sys.modules[k]
            known = {f.name for f in __import__("dataclasses").fields(train.config_class())}
            with contextlib.redirect_stderr(io.StringIO()) as err:
                try:
                    if prog.endswith(".py") and prog != "train.py":   # a fork's own file: `python FILE.py [--compare RUN | flags]`
                        path = plugin_path(prog, files)
                        assert os.path.isfile(path), (page, prog)
                        if "train.main()" in open(path).read():
                            config.load_plugin(path)
                            if argv[:1] != ["--compare"]:
                                train.parse_args(argv)
                    elif prog == "train.py" and not {"--resume", "--export", "-h"} & set(argv):
                        train.parse_args(argv)
                    elif prog == "train.py":
                        assert {t[2:] for t in argv if t.startswith("--")} <= known | {"resume", "export"}, (page, rest)
                    elif "-h" not in argv:
                        compare.parse(argv)
                except SystemExit:
                    raise AssertionError(f"{page}: python {prog} {rest}: {err.getvalue().strip()}")
    finally:
        METHODS.clear()
        METHODS.update(before)
        entries.read_registry()


def test_the_regime_paragraph_quotes_its_numbers_from_composer_phase_md():
    """The README's one paragraph on when step 6 helps takes every interval it quotes (a mean and its 95% bounds,
    in points) from docs/composer-phase.md, which holds the tables they come from."""
    para = next(p for p in read("README.md").split("\n\n") if p.startswith("**When step 6 helps."))
    quoted = re.findall(r"[−+]?\d+\.\d \[[−+]?\d+\.\d, [−+]?\d+\.\d\]", para)
    doc = read("docs", "composer-phase.md")
    assert len(quoted) >= 3, para
    for q in quoted:
        assert q in doc, f"the README quotes {q}, which docs/composer-phase.md does not hold"
