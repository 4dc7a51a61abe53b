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
    for doc in ["README.md", *(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", read(doc)):
            if not target.startswith(("http://", "https://")):
                path = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), target))
                assert os.path.exists(path), f"{doc} links to {target}, which does not exist"
