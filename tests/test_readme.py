"""The README stays true to the repo: its test line is what CI runs, its links and figure exist.
(Its fork example is tests/fork_variant.py's, checked in tests/test_fork.py.)"""
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


def commands():
    """Every `python train.py …` and `python -m bench …` of the README and docs/'s current pages (not docs/history/)."""
    pages = ["README.md", *(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))]
    found = set()
    for page in pages:
        parts = read(page).split("```")
        code = [line for block in parts[1::2] for line in block.replace("\\\n", " ").splitlines()]   # fenced, joined at \\
        spans = [span.replace("\n", " ") for prose in parts[::2] for span in re.findall(r"`([^`]+)`", prose)]
        for text in code + spans:
            for prog, rest in re.findall(r"python (train\.py|-m bench(?![.\w]))([^`\n]*)", text):   # not bench.ship_base
                found.add((page, prog, rest.split(" #")[0].strip()))
    return sorted(found)


def concrete(rest):
    """A documented command's flags as a user types them: placeholders filled (S, W: 0; M: lopd), the first of {a,b}
    and of [x | y], optional [--flag value] kept, $SMOL a file name, other `$VAR`, `...`, `[flags]` and a flag whose value is elided (…) dropped."""
    rest = re.sub(r"\{([^,}]+)[^}]*\}", r"\1", rest)
    rest = re.sub(r"\[flags\]|--\w+ …|\$(?!SMOL)\w+|\.\.\.", "", rest.replace("$SMOL", "smollm2.gguf"))
    rest = re.sub(r"\[([^\]|]+?)(?:\s*\|[^\]]*)?\]", r"\1", rest)
    return [{"S": "0", "W": "0", "M": "lopd", "PATH_OR_NAME": "some/model"}.get(t, t) for t in rest.split()]


def test_every_command_of_the_current_pages_parses():
    """The commands the README and docs/'s current pages give run today: train.py's parse with its own parser
    (a run folder to --resume or --export aside: their flags must exist), the bench's with its."""
    import contextlib
    import io
    import sys
    sys.path.insert(0, ROOT)
    import train
    from bench import compare
    known = {f.name for f in __import__("dataclasses").fields(train.config_class())}
    cmds = commands()
    assert len(cmds) > 20
    for page, prog, rest in cmds:
        argv = concrete(rest)
        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                if prog == "train.py" and not {"--resume", "--export", "-h"} & set(argv):
                    train.parse_args(argv)
                elif prog == "train.py":
                    assert {t[2:] for t in argv if t.startswith("--")} <= known | {"resume", "export"}, (page, rest)
                elif "-h" not in argv:
                    compare.parse(argv)
            except SystemExit:
                raise AssertionError(f"{page}: python {prog} {rest}: {err.getvalue().strip()}")
