"""Docs that cannot rot: the README's and docs/'s code blocks marked runnable run; the generated pages (docs/ops.md,
docs/train.md) equal what scripts/gen_docs.py makes from the op table and the config classes; every config key has
its comment, every op and public tensor function is documented; the README stays short and speaks of btjit only."""
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CHANGELOG.md"]


def gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def runnable_blocks(path: Path) -> list:
    """The ```python runnable blocks of a Markdown file, in order."""
    return re.findall(r"^```python runnable\n(.*?)^```", path.read_text(), flags=re.M | re.S)


@pytest.mark.parametrize("path", [p for p in DOCS if runnable_blocks(p)], ids=lambda p: p.name)
def test_runnable_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = {}                                   # the blocks of one file share a namespace, as in a notebook
    for i, block in enumerate(runnable_blocks(path)):
        exec(compile(block, f"{path.name} block {i + 1}", "exec"), ns)


def test_readme_has_runnable_blocks():
    assert len(runnable_blocks(ROOT / "README.md")) >= 2


@pytest.mark.parametrize("page", ["docs/ops.md", "docs/train.md"])
def test_generated_pages_match_their_source(page):
    text = gen_docs().PAGES[page]()
    assert (ROOT / page).read_text() == text, f"{page} is out of date: run python scripts/gen_docs.py"


def test_every_config_key_is_documented():
    undocumented = [f"[{sec}] {key}" for sec, key, _, _, note in gen_docs().config_keys() if not note]
    assert not undocumented, "config keys without a comment in btjit/train/config.py: " + ", ".join(undocumented)


def test_every_op_and_tensor_function_is_in_ops_md():
    import btjit
    from btjit.graph.ops import TABLE
    text = (ROOT / "docs" / "ops.md").read_text()
    missing = [op for op in TABLE if f"| `{op}` |" not in text]
    missing += [n for n in btjit.__all__ if n not in gen_docs().NOT_TENSOR_FUNCTIONS and f"| `{n}(" not in text]
    assert not missing, f"not in docs/ops.md: {missing}"


def test_readme_is_short_and_current():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for path in DOCS:
        words = re.findall(r"\b(sessions?|Ice Lake)\b", path.read_text(), flags=re.I)
        assert not words, f"{path.name} speaks of {set(words)}"


def test_doc_links_resolve():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"
