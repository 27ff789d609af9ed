"""Small generated training text shared by the CLI, fault and distributed tests (tests make their own data)."""
import numpy as np


def corpus(n_sentences=400, seed=0):
    rng = np.random.default_rng(seed)
    subj, verb, obj = ["the cat", "a dog", "my bird"], ["sees", "eats", "likes"], ["fish.", "seeds.", "the sun."]
    return "\n".join(f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)}" for _ in range(n_sentences)) + "\n"
