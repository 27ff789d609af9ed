# tests/test_data.py -- character data (btjit/data.py): vocabulary, encode/decode, the 90/10 split,
# seeded batches (text: (B,T) shifted by one; lines: makemore samples), the built-in corpus, and the
# errors for missing, empty, binary, non-UTF-8 and too-short files. Tests make their own small files.
import numpy as np
import pytest

from btjit import config as C
from btjit import data as D
from btjit.data import DataError

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


def test_builtin_corpus():
    text = D.builtin_text()
    assert len(text) > 300_000 and text == D.builtin_text()
    ds = D.load(C.Config())
    assert ds.name == D.BUILTIN_NAME and len(ds.vocab) == len(set(text))
    assert len(ds.train) + len(ds.val) == len(text)


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
    cfg = C.loads('[model]\nkind = "mlp"\ncontext = 3\n[data]\nformat = "lines"\n')
    ds = D.load(cfg)
    assert ds.vocab.chars == ["."] + list("abcdefghijklmnopqrstuvwxyz")
    assert len(ds.train) > 10_000
