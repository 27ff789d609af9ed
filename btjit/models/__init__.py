"""Models written against btjit's public tracer API: the paper's GPT (E6) and makemore MLP (E5), and makemore.py's
six models (makemore.py: bigram, mlp, rnn, gru, bow, transformer)."""
