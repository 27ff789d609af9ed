"""Models written against btjit's public tracer API: the paper's GPT (gpt.py, E6) and makemore MLP (mlp.py, E5),
makemore.py's six models (makemore.py); registry.py turns a [model] config section into a Model."""
