"""Using a trained model: loading it from a checkpoint of any layout, text generation with a KV
cache, and evaluation (perplexity, LAMBADA-style last-word accuracy)."""
