"""What runs the model: the KV cache, generate(), sampling, text in and out."""
