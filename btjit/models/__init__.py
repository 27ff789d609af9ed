"""Models written against btjit's public tracer API: the paper's GPT (E6) and makemore MLP (E5)."""
