"""Llama-family decoder, configs, loaders and tokenizer."""
