# tests/test_data.py -- character data (btjit/data.py): vocabulary, encode/decode, the 90/10 split,
# seeded batches (text: (B,T) shifted by one; lines: makemore samples; words: makemore.py's (B,T) rows with -1
# after a word's end), the bundled corpora (checksums,
# contents, defaults by format), the pydoc corpus, and the errors for missing, empty, binary, non-UTF-8 and
# too-short files. Tests make their own small files.
import gzip
import hashlib
from pathlib import Path

import numpy as np
import pytest

from btjit.train import config as C
from btjit.train import config_rules
from btjit.train import data as D
from btjit.train.data import DataError

TEXT = "".join(f"line {i}: the cat sat on the mat; {i * i}\n" for i in range(200))


def write(tmp_path, text, name="d.txt"):
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


def test_vocab_sorted_and_round_trip():
    v = D.Vocab.from_text("hello world")
    assert v.chars == sorted(set("hello world")) == [" ", "d", "e", "h", "l", "o", "r", "w"]
    ids = v.encode("hello")
    assert ids.dtype == np.int32 and ids.tolist() == [3, 2, 4, 4, 5]
    assert v.decode(ids) == "hello"
    with pytest.raises(DataError, match="'z' is not in the vocabulary"):
        v.encode("zz")


def test_text_split_and_batches(tmp_path):
    p = write(tmp_path, TEXT)
    ds = D.load_text(p, block_size=8, val_fraction=0.1)
    assert len(ds.train) + len(ds.val) == len(TEXT)
    assert len(ds.val) == round(0.1 * len(TEXT))
    assert ds.vocab.decode(ds.train.x) + ds.vocab.decode(ds.val.x) == TEXT   # val is the tail
    x, y = ds.batch("train", 5, np.random.default_rng(3))
    assert x.shape == y.shape == (5, 8) and x.dtype == y.dtype == np.int32
    assert x.flags.c_contiguous and y.flags.c_contiguous
    train_text = ds.vocab.decode(ds.train.x)
    for row_x, row_y in zip(x, y):
        sx, sy = ds.vocab.decode(row_x), ds.vocab.decode(row_y)
        assert sx[1:] == sy[:-1] and (sx + sy[-1]) in train_text
    x2, y2 = ds.batch("train", 5, np.random.default_rng(3))
    assert np.array_equal(x, x2) and np.array_equal(y, y2)            # seeded
    xv, _ = ds.batch("val", 64, np.random.default_rng(0))
    assert all(ds.vocab.decode(r) in ds.vocab.decode(ds.val.x) for r in xv)


def test_batches_follow_rng_state(tmp_path):
    ds = D.load_text(write(tmp_path, TEXT), block_size=4)
    rng = np.random.default_rng(7)
    ds.batch("train", 3, rng)
    state = rng.bit_generator.state
    a = ds.batch("train", 3, rng)
    rng2 = np.random.default_rng()
    rng2.bit_generator.state = state
    b = ds.batch("train", 3, rng2)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_builtin_pydoc_corpus():
    text = D.builtin_text()
    assert len(text) > 300_000 and text == D.builtin_text()
    ds = D.load(C.loads('[data]\ncorpus = "pydoc"\n'))
    assert ds.name == D.BUILTIN_NAME and len(ds.vocab) == len(set(text))
    assert len(ds.train) + len(ds.val) == len(text)


# ---- the bundled corpora (btjit/corpora) ----------------------------------------------------------------
CORPORA_DIR = Path(D.__file__).resolve().parents[1] / "corpora"     # btjit/corpora


@pytest.mark.parametrize("name", list(D.CORPORA))
def test_bundled_corpus_hashes_to_its_shipped_checksum(name):
    c = D.CORPORA[name]
    raw = gzip.decompress((CORPORA_DIR / c.file).read_bytes())
    assert hashlib.sha256(raw).hexdigest() == c.sha256
    assert D.corpus_text(name) == raw.decode("utf-8")


def test_bundled_corpora_are_the_papers_data():
    shakespeare, names = D.corpus_text("tinyshakespeare"), D.corpus_text("names")
    assert len(shakespeare) == 1_115_394 and len(set(shakespeare)) == 65
    assert shakespeare.startswith("First Citizen:\nBefore we proceed any further, hear me speak.")
    words = names.split()
    assert len(words) == 32_033 and words[:3] == ["emma", "olivia", "ava"] and set("".join(words)) == set(
        "abcdefghijklmnopqrstuvwxyz")
    lic = (CORPORA_DIR / "LICENSE").read_text()
    assert "MIT License" in lic and "Andrej Karpathy" in lic
    size = sum(f.stat().st_size for f in CORPORA_DIR.iterdir())
    assert size < 600_000, size                   # the installed package grows well under 1 MB


def test_default_corpus_by_format():
    from btjit.train.sampling import model_for
    ds = D.load(C.Config())                       # [data] corpus left out, format "text"
    assert ds.name == "<bundled corpus: Tiny Shakespeare>" and len(ds.vocab) == 65
    assert ds.vocab.decode(ds.train.x[:14]) == "First Citizen:"
    model = model_for(C.Config().model, len(ds.vocab))
    assert sum(v.size for v in model.init_params(np.random.default_rng(0)).values()) == 46_337   # the paper's
    ds = D.load(C.loads('[model]\nkind = "mlp"\ncontext = 3\n[data]\nformat = "lines"\n'))
    assert ds.name == "<bundled corpus: names.txt>" and ds.vocab.chars == ["."] + list("abcdefghijklmnopqrstuvwxyz")
    assert int(np.sum(ds.train.y == 0)) + int(np.sum(ds.val.y == 0)) == 32_033        # one '.' per name
    ds = D.load(C.loads('[data]\ncorpus = "names"\n'))     # names as one stream of text also works
    assert ds.vocab.chars == ["\n"] + list("abcdefghijklmnopqrstuvwxyz")


def test_damaged_bundled_corpus_is_a_data_error(monkeypatch):
    monkeypatch.setitem(D.CORPORA, "names", D.Corpus("names.txt.gz", "0" * 64, "names.txt"))
    with pytest.raises(DataError, match=r"bundled corpus names \(btjit/corpora/names.txt.gz\) fails its sha256"):
        D.corpus_text("names")
    monkeypatch.setitem(D.CORPORA, "names", D.Corpus("nothere.txt.gz", "0" * 64, "names.txt"))
    with pytest.raises(DataError, match="missing or damaged.*reinstall btjit or pass --data FILE"):
        D.corpus_text("names")


def test_corpus_choices_agree_with_the_config():
    assert config_rules.CHOICES[("data", "corpus")] == D.CORPUS_NAMES
    with pytest.raises(DataError, match='corpus = "tinyshakespeare" is running text.*"names" or "pydoc"'):
        D.load(C.loads('[model]\nkind = "mlp"\n[data]\nformat = "lines"\ncorpus = "tinyshakespeare"\n'))


def test_data_path_option_overrides_config(tmp_path):
    p = write(tmp_path, TEXT)
    cfg = C.loads('[data]\npath = "/does/not/exist.txt"\n')
    assert D.load(cfg, data_path=p).n_chars == len(TEXT)
    with pytest.raises(DataError, match="exist.txt"):
        D.load(cfg)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"data file not found: .*nope\.txt"):
        D.load_text(tmp_path / "nope.txt", 8)


def test_directory(tmp_path):
    with pytest.raises(DataError, match="is a directory"):
        D.load_text(tmp_path, 8)


def test_empty_file(tmp_path):
    with pytest.raises(DataError, match=r"data file is empty: .*d\.txt"):
        D.load_text(write(tmp_path, ""), 8)
    with pytest.raises(DataError, match=r"only whitespace.*d\.txt"):
        D.load_text(write(tmp_path, " \n\n  \n"), 8)


def test_binary_file(tmp_path):
    blob = bytes(range(256)) * 50
    with pytest.raises(DataError, match=r"binary.*blob\.bin"):
        D.load_text(write(tmp_path, blob, "blob.bin"), 8)


def test_non_utf8_file(tmp_path):
    p = write(tmp_path, "caf\u00e9 ".encode("latin-1") * 100, "latin.txt")
    with pytest.raises(DataError, match=r"not valid UTF-8.*offset 3.*latin\.txt"):
        D.load_text(p, 8)


def test_utf8_with_bom_and_non_ascii(tmp_path):
    p = write(tmp_path, "\ufeff" + "grüße, 世界! " * 20)
    ds = D.load_text(p, 4)
    assert "\ufeff" not in ds.vocab.chars and "世" in ds.vocab.chars


def test_too_short(tmp_path):
    p = write(tmp_path, "abcdefghijklmnopqrst")          # 20 chars: train 18, val 2
    with pytest.raises(DataError, match=r"too short: the val split has 2 characters.*block_size \+ 1 = 9"):
        D.load_text(p, 8)
    ds = D.load_text(p, 1)                                # val 2 >= 1 + 1: fine
    assert len(ds.val) == 2
    with pytest.raises(DataError, match="train split has 18"):
        D.load_text(p, 20, val_fraction=0.1)


def test_vocab_from_checkpoint_must_cover_data(tmp_path):
    p = write(tmp_path, TEXT)
    with pytest.raises(DataError, match="not in the checkpoint's vocabulary"):
        D.load_text(p, 8, vocab=D.Vocab("line "))


# ---- "lines" format (makemore) ----------------------------------------------------------------------
NAMES = ["emma", "olivia", "ava", "isabella", "sophia", "mia", "amelia", "harper", "evelyn", "abigail"]


def test_lines_vocab_dot_is_zero():
    v = D.Vocab.from_words(NAMES)
    assert v.chars[0] == "." and v.chars[1:] == sorted(set("".join(NAMES)))


def test_makemore_samples():
    v = D.Vocab.from_words(["emma"])
    x, y = D.build_samples(["emma"], v, 3)
    assert x.shape == (5, 3) and y.shape == (5,)
    ctxs = ["".join(v.chars[i] for i in row) for row in x]
    assert ctxs == ["...", "..e", ".em", "emm", "mma"]
    assert v.decode(y) == "emma."


def test_lines_dataset(tmp_path):
    p = write(tmp_path, "\n".join(NAMES) + "\n\n")
    ds = D.load_lines(p, context=4, val_fraction=0.2, seed=1)
    assert len(ds.train) + len(ds.val) == sum(len(w) + 1 for w in NAMES)
    x, y = ds.batch("train", 6, np.random.default_rng(0))
    assert x.shape == (6, 4) and y.shape == (6,) and x.dtype == y.dtype == np.int32
    ds2 = D.load_lines(p, context=4, val_fraction=0.2, seed=1)
    assert np.array_equal(ds.val.x, ds2.val.x)            # the word shuffle is seeded
    n_val_words = int(np.sum(ds.val.y == 0))
    assert n_val_words == 2


def test_lines_errors(tmp_path):
    with pytest.raises(DataError, match="too short"):
        D.load_lines(write(tmp_path, "solo\n"), 3)
    with pytest.raises(DataError, match="reserves '.'"):
        D.load_lines(write(tmp_path, "a.b\ncd\nef\n"), 3)


def test_builtin_words_for_lines_format():
    cfg = C.loads('[model]\nkind = "mlp"\ncontext = 3\n[data]\nformat = "lines"\ncorpus = "pydoc"\n')
    ds = D.load(cfg)
    assert ds.vocab.chars == ["."] + list("abcdefghijklmnopqrstuvwxyz")
    assert len(ds.train) > 10_000


# ---- "words" format (makemore.py's CharDataset) -----------------------------------------------------------
def test_words_rows_are_makemores():
    v = D.Vocab.from_words(["emma", "ava"])
    x, y = D.build_words(["emma", "ava"], v, 6)
    assert x.dtype == y.dtype == np.int32 and x.shape == y.shape == (2, 6)
    e, m, a, vv = (v.stoi[c] for c in "emav")
    assert x.tolist() == [[0, e, m, m, a, 0], [0, a, vv, a, 0, 0]]
    assert y.tolist() == [[e, m, m, a, 0, -1], [a, vv, a, 0, -1, -1]]
    assert D.IGNORE == -1
    x, y = D.build_words(["abcde"], D.Vocab.from_words(["abcde"]), 6)       # the longest word fits exactly
    assert x.tolist() == [[0, 1, 2, 3, 4, 5]] and y.tolist() == [[1, 2, 3, 4, 5, 0]]


def test_words_dataset_and_batches(tmp_path):
    p = write(tmp_path, "\n".join(NAMES) + "\n\n")
    ds = D.load_words(p, block_size=9, val_fraction=0.2, seed=1)
    assert (len(ds.train), len(ds.val)) == (8, 2) and ds.format == "words" and ds.block == 9
    words = sorted(ds.vocab.decode(r[1:][r[1:] != 0]) for r in np.concatenate([ds.train.x, ds.val.x]))
    assert words == sorted(NAMES)
    assert D.load_lines(p, 3, val_fraction=0.2, seed=1).val.y.size == sum(    # the same split as "lines"
        len(ds.vocab.decode(r[r > 0])) + 1 for r in ds.val.y)
    x, y = ds.batch("train", 5, np.random.default_rng(0))
    assert x.shape == y.shape == (5, 9) and x.dtype == y.dtype == np.int32 and x.flags.c_contiguous
    for rx, ry in zip(x, y):
        n = int(np.sum(ry > 0))                 # the word's length
        assert rx[0] == 0 and np.array_equal(rx[1:n + 1], ry[:n]) and ry[n] == 0 and (ry[n + 1:] == -1).all()
        assert (rx[n + 1:] == 0).all()
    x2, _ = ds.batch("train", 5, np.random.default_rng(0))
    assert np.array_equal(x, x2)
    assert "train 8 / val 2 words" in ds.describe()


def test_words_from_the_config_default_to_names():
    ds = D.load(C.loads('[model]\nkind = "transformer"\n'))     # makemore's block_size 16, format words
    assert ds.name == "<bundled corpus: names.txt>" and len(ds.vocab) == 27
    assert len(ds.train) + len(ds.val) == 32_033 and ds.train.x.shape[1] == 16
    assert int((ds.train.y == 0).sum()) == len(ds.train)            # one end token per word


def test_words_errors(tmp_path):
    p = write(tmp_path, "ab\nabcdefghij\ncd\n")
    with pytest.raises(DataError, match=r"the word 'abcdefghij' has 10 characters; data.format = \"words\" needs "
                                         r"model.block_size >= the longest word \+ 1 = 11, got 8"):
        D.load_words(p, 8)
    assert len(D.load_words(p, 11, val_fraction=0.3).train) == 2
    with pytest.raises(DataError, match="'words' format reserves '.'"):
        D.load_words(write(tmp_path, "a.b\ncd\nef\n"), 8)
    with pytest.raises(DataError, match='running text, not one word per line as data.format = "words" needs'):
        D.load(C.loads('[model]\nkind = "rnn"\n[data]\ncorpus = "tinyshakespeare"\n'))
    with pytest.raises(DataError, match="too short"):
        D.load_words(write(tmp_path, "solo\n"), 8)
