"""Llama-family decoders and their loading from Hugging Face folders."""
