# btjit/data.py -- character-level data for `btjit train`: reading a corpus (a UTF-8 file, one of the
# corpora bundled in btjit/corpora -- Tiny Shakespeare and names.txt, gzip-compressed and sha256-checked --
# or CPython's pydoc topics), the vocabulary, encode/decode, the train/val split and seeded batch sampling.
# Three formats: "text" (one stream of characters, GPT-style (B,T) -> (B,T) batches), "lines" (one word per
# line, makemore-style (B,context) -> (B,) samples with '.' as index 0) and "words" (one word per line,
# makemore.py's (B,T) -> (B,T) batches: x is 0 then the word, y the word, 0, then -1 = ignored).
# It knows nothing about models or the compiler; errors are DataError with one readable message.
from __future__ import annotations

import gzip
import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from btjit.train import files

BUILTIN_NAME = "<built-in corpus: CPython pydoc_data topics>"
PAD = "."   # "lines" format: start/end token, index 0


class DataError(Exception):
    """Missing, empty, binary or too-short data; str(e) is one readable line naming the file."""


@dataclass(frozen=True)
class Corpus:
    file: str           # in the btjit.corpora package directory
    sha256: str         # of the decompressed UTF-8 bytes
    title: str


# The bundled corpora (MIT, (c) 2022 Andrej Karpathy; btjit/corpora/LICENSE and README.txt).
CORPORA = {
    "tinyshakespeare": Corpus("tinyshakespeare.txt.gz",
                              "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed", "Tiny Shakespeare"),
    "names": Corpus("names.txt.gz", "0a30b5557f192f32ab962680889aac5f6fda0f4cecf40a6d0b5694f58ea8cc4d", "names.txt"),
}
CORPUS_NAMES = (*CORPORA, "pydoc", "digits")            # the values of [data] corpus (digits: train/arrays.py)
DEFAULT_CORPUS = {"text": "tinyshakespeare", "lines": "names", "words": "names", "arrays": "digits"}  # corpus left out
IGNORE = -1         # "words" format: the target after a word's end (cross_entropy(..., ignore_index=-1))


def builtin_text() -> str:
    """~465k characters of English and Python from the standard library (`[data] corpus = "pydoc"`)."""
    from pydoc_data.topics import topics
    return "".join(topics[k] for k in sorted(topics))


def corpus_text(name: str) -> str:
    """The text of a bundled corpus (CORPORA) or "pydoc"; DataError if the file is missing or damaged."""
    if name == "pydoc":
        return builtin_text()
    if name not in CORPORA:
        raise DataError(f"data.corpus = {name!r} is not one of: {', '.join(CORPUS_NAMES)}")
    return bundled(CORPORA[name], name, "--data FILE").decode("utf-8")


def bundled(c: Corpus, name: str, instead: str) -> bytes:
    """The bytes of bundled corpus `name` (btjit/corpora/c.file, gunzipped, sha256-checked); DataError if the file
    is missing or damaged, suggesting `instead` (e.g. "--data FILE")."""
    try:
        raw = gzip.decompress(resources.files("btjit").joinpath("corpora", c.file).read_bytes())
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"bundled corpus {name} (btjit/corpora/{c.file}) is missing or damaged: {e}; "
                        f"reinstall btjit or pass {instead}") from None
    if hashlib.sha256(raw).hexdigest() != c.sha256:
        raise DataError(f"bundled corpus {name} (btjit/corpora/{c.file}) fails its sha256 check; "
                        f"reinstall btjit or pass {instead}")
    return raw


def corpus_label(name: str) -> str:
    return BUILTIN_NAME if name == "pydoc" else f"<bundled corpus: {CORPORA[name].title}>"


def read_text(path, corpus: str = "tinyshakespeare") -> tuple[str, str]:
    """Return (text, name) of a UTF-8 file; path None -> the corpus named `corpus`."""
    if path is None:
        return corpus_text(corpus), corpus_label(corpus)
    p = Path(path)
    raw = files.read_bytes(p, DataError, f"data file not found: {p}", f"data path is a directory, not a file: {p}",
                           f"cannot read data file {p}")
    if not raw:
        raise DataError(f"data file is empty: {p}")
    if b"\x00" in raw[:65536]:
        raise DataError(f"data file looks binary (contains NUL bytes), expected UTF-8 text: {p}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file is not valid UTF-8 text (bad byte at offset {e.start}): {p}") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if not text.strip():
        raise DataError(f"data file has no text (only whitespace): {p}")
    return text, str(p)


class Vocab:
    """Index <-> character tables. `chars` is the list itos; it is what checkpoints store."""

    def __init__(self, chars):
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        if len(self.stoi) != len(self.chars):
            raise DataError("vocabulary has duplicate characters")

    @classmethod
    def from_text(cls, text: str) -> "Vocab":
        return cls(sorted(set(text)))

    @classmethod
    def from_words(cls, words) -> "Vocab":
        return cls([PAD] + sorted(set("".join(words)) - {PAD}))

    def __len__(self):
        return len(self.chars)

    def __eq__(self, other):
        return isinstance(other, Vocab) and self.chars == other.chars

    def encode(self, s: str) -> np.ndarray:
        for c in s:
            if c not in self.stoi:
                raise DataError(f"character {c!r} is not in the vocabulary")
        return np.fromiter((self.stoi[c] for c in s), dtype=np.int32, count=len(s))

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


@dataclass
class Split:
    """One split. text: x = the token stream (N,); lines: x (N, context) contexts, y (N,) next chars;
    words: x, y (N, block_size), one row per word."""
    x: np.ndarray
    y: np.ndarray | None = None

    def __len__(self):
        return len(self.x)


class Dataset:
    """The encoded train/val splits plus everything needed to draw batches of a fixed shape."""

    def __init__(self, fmt, vocab, train, val, block, name, n_chars):
        self.format, self.vocab, self.train, self.val = fmt, vocab, train, val
        self.block = block            # T for "text" and "words", context for "lines"
        self.name, self.n_chars = name, n_chars

    def batch(self, split: str, batch_size: int, rng: np.random.Generator):
        """Draw a batch with `rng` (the only randomness). text: x, y int32 (B,T);
        lines: x int32 (B,context), y int32 (B,); words: x, y int32 (B,T), B words drawn with replacement."""
        s = self.train if split == "train" else self.val
        if self.format == "text":
            T = self.block
            ix = rng.integers(0, len(s.x) - T, size=batch_size)
            pos = ix[:, None] + np.arange(T)[None, :]          # (B,T)
            return (np.ascontiguousarray(s.x[pos], dtype=np.int32),
                    np.ascontiguousarray(s.x[pos + 1], dtype=np.int32))
        ix = rng.integers(0, len(s.y), size=batch_size)
        return (np.ascontiguousarray(s.x[ix], dtype=np.int32),
                np.ascontiguousarray(s.y[ix], dtype=np.int32))

    def describe(self) -> str:
        unit = {"text": "tokens", "lines": "samples", "words": "words"}[self.format]
        return (f"data: {self.name}: {self.n_chars:,} chars, vocab {len(self.vocab)}, "
                f"train {len(self.train):,} / val {len(self.val):,} {unit}")


def split_point(n: int, val_fraction: float) -> int:
    return int(round(n * (1.0 - val_fraction)))


def load_text(path, block_size: int, val_fraction: float = 0.1, vocab: Vocab | None = None,
              corpus: str = "tinyshakespeare") -> Dataset:
    """"text" format: the whole file (path None: the corpus) is one character stream; the last val_fraction
    is validation."""
    text, name = read_text(path, corpus)
    vocab = vocab or Vocab.from_text(text)
    missing = sorted(set(text) - set(vocab.chars))
    if missing:
        raise DataError(f"{name}: characters not in the checkpoint's vocabulary: "
                        f"{''.join(missing[:20])!r}")
    data = vocab.encode(text)
    n = split_point(len(data), val_fraction)
    train, val = data[:n], data[n:]
    for label, part in (("train", train), ("val", val)):
        if len(part) < block_size + 1:
            raise DataError(f"{name}: too short: the {label} split has {len(part)} characters, needs at "
                            f"least block_size + 1 = {block_size + 1} (file has {len(data)} characters, "
                            f"val_fraction {val_fraction})")
    return Dataset("text", vocab, Split(train), Split(val), block_size, name, len(text))


def builtin_words(text: str) -> list[str]:
    """A names.txt-like word list from the built-in corpus: unique lower-case words of 3+ letters."""
    return sorted(set(re.findall(r"[a-z]{3,}", text.lower())))


def build_samples(words, vocab: Vocab, context: int):
    """makemore: each word w gives len(w)+1 samples (context left-padded with '.', next char)."""
    xs, ys = [], []
    for w in words:
        ctx = [0] * context
        for c in w + PAD:
            ix = vocab.stoi[c]
            xs.append(ctx)
            ys.append(ix)
            ctx = ctx[1:] + [ix]
    return (np.array(xs, dtype=np.int32).reshape(-1, context), np.array(ys, dtype=np.int32))


def build_words(words, vocab: Vocab, block_size: int):
    """makemore.py's CharDataset: for each word, x = 0 then the word's ids then 0s, y = the word's ids, 0 (the
    end), then IGNORE; both (N, block_size) int32. Every word must be shorter than block_size."""
    x = np.zeros((len(words), block_size), np.int32)
    y = np.full((len(words), block_size), IGNORE, np.int32)
    for i, w in enumerate(words):
        ix = [vocab.stoi[c] for c in w]
        x[i, 1:1 + len(ix)] = ix
        y[i, :len(ix)] = ix
        y[i, len(ix)] = 0
    return x, y


def read_words(path, fmt: str, vocab: Vocab | None, corpus: str):
    """(words shuffled later, vocab, name, n_chars) of a one-word-per-line file or corpus, for `fmt`."""
    if path is None and corpus == "tinyshakespeare":
        raise DataError(f'data.corpus = "tinyshakespeare" is running text, not one word per line as '
                        f'data.format = "{fmt}" needs: use corpus "names" or "pydoc", or --data FILE')
    text, name = read_text(path, corpus)
    if path is None and corpus == "pydoc":
        words = builtin_words(text)
    else:
        words = [w.strip() for w in text.splitlines() if w.strip()]
    bad = [w for w in words if PAD in w]
    if bad:
        raise DataError(f"{name}: the '{fmt}' format reserves {PAD!r} as the word boundary, "
                        f"but the word {bad[0]!r} contains it")
    vocab = vocab or Vocab.from_words(words)
    missing = sorted(set("".join(words)) - set(vocab.chars))
    if missing:
        raise DataError(f"{name}: characters not in the checkpoint's vocabulary: "
                        f"{''.join(missing[:20])!r}")
    return words, vocab, name, len(text)


def split_words(words, seed: int, val_fraction: float, name: str):
    """Shuffle with `seed`; the last val_fraction of the words is the validation split."""
    order = np.random.default_rng(seed).permutation(len(words))
    words = [words[i] for i in order]
    n = split_point(len(words), val_fraction)
    tr, va = words[:n], words[n:]
    if not tr or not va:
        raise DataError(f"{name}: too short: {len(words)} word(s) cannot be split into train and val "
                        f"with val_fraction {val_fraction}")
    return tr, va


def load_lines(path, context: int, val_fraction: float = 0.1, seed: int = 0,
               vocab: Vocab | None = None, corpus: str = "names") -> Dataset:
    """"lines" format: one word per line (path None: the corpus; "pydoc" gives its words, builtin_words);
    words are shuffled with `seed`, split by val_fraction."""
    words, vocab, name, n_chars = read_words(path, "lines", vocab, corpus)
    tr, va = split_words(words, seed, val_fraction, name)
    train, val = Split(*build_samples(tr, vocab, context)), Split(*build_samples(va, vocab, context))
    return Dataset("lines", vocab, train, val, context, name, n_chars)


def load_words(path, block_size: int, val_fraction: float = 0.1, seed: int = 0,
               vocab: Vocab | None = None, corpus: str = "names") -> Dataset:
    """"words" format (makemore.py): one word per line, as for "lines"; one (block_size,) row per word, so the
    longest word must have at most block_size - 1 characters (names.txt: 15, makemore's block_size 16)."""
    words, vocab, name, n_chars = read_words(path, "words", vocab, corpus)
    longest = max(words, key=len)
    if len(longest) >= block_size:
        raise DataError(f"{name}: the word {longest[:40]!r} has {len(longest)} characters; data.format = \"words\" "
                        f"needs model.block_size >= the longest word + 1 = {len(longest) + 1}, got {block_size}")
    tr, va = split_words(words, seed, val_fraction, name)
    train, val = Split(*build_words(tr, vocab, block_size)), Split(*build_words(va, vocab, block_size))
    return Dataset("words", vocab, train, val, block_size, name, n_chars)


def load(cfg, data_path=None, vocab: Vocab | None = None) -> Dataset:
    """Dataset for a btjit.train.config.Config: the file `data_path` (the --data option), else cfg.data.path, else
    the corpus cfg.data.corpus (left out: DEFAULT_CORPUS of the format)."""
    path = data_path if data_path is not None else cfg.data.path
    corpus = cfg.data.corpus or DEFAULT_CORPUS[cfg.data.format]
    if cfg.data.format == "arrays":     # arrays.load reads them (btjit/train/arrays.py, which imports this module)
        raise DataError('data.format = "arrays" is read by btjit.train.arrays.load')
    if corpus == "digits":
        raise DataError(f'data.corpus = "digits" holds images: it needs data.format = "arrays", not '
                        f'"{cfg.data.format}"')
    if cfg.data.format == "lines":
        return load_lines(path, cfg.model.context, cfg.data.val_fraction, cfg.train.seed, vocab, corpus)
    if cfg.data.format == "words":
        return load_words(path, cfg.model.block_size, cfg.data.val_fraction, cfg.train.seed, vocab, corpus)
    return load_text(path, cfg.model.block_size, cfg.data.val_fraction, vocab, corpus)
