"""Model loading (GGUF, safetensors), tokenizers and model families."""
