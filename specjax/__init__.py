"""specjax: loose speculative decoding for Llama-family models in JAX."""
