"""Small generated training text shared by the CLI, fault and distributed tests (tests make their own data)."""
import numpy as np


def corpus(n_sentences=400, seed=0):
    rng = np.random.default_rng(seed)
    subj, verb, obj = ["the cat", "a dog", "my bird"], ["sees", "eats", "likes"], ["fish.", "seeds.", "the sun."]
    return "\n".join(f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)}" for _ in range(n_sentences)) + "\n"


def words(n=300, seed=0):
    """Name-like words of 2-6 letters (vowel + consonant pairs), one per line."""
    rng = np.random.default_rng(seed)
    return "\n".join("".join(rng.choice(list("aeiou")) + rng.choice(list("lmnrst")) for _ in range(rng.integers(1, 4)))
                     for _ in range(n)) + "\n"


def tiny_config(**train) -> str:
    """TOML of a 1-layer GPT small enough for CLI tests; keyword arguments override [train] keys."""
    t = {**dict(steps=30, batch_size=4, seed=7, eval_interval=10, eval_batches=8, sample_interval=0, log_interval=5,
                checkpoint_interval=10, keep_checkpoints=5), **train}
    lines = "\n".join(f"{k} = {v!r}" for k, v in t.items())
    return f"""
[model]
kind = "gpt"
n_layer = 1
n_head = 2
n_embd = 8
block_size = 4
[train]
{lines}
[optim]
name = "adamw"
lr = 0.02
weight_decay = 0.0
"""


def write_run_files(tmp_path, config_text, text):
    """tmp_path/tiny.toml and tmp_path/text.txt for a CLI test; returns (config, data, tmp_path)."""
    cfg, data = tmp_path / "tiny.toml", tmp_path / "text.txt"
    cfg.write_text(config_text)
    data.write_text(text)
    return cfg, data, tmp_path
