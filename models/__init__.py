"""Llama-family models built from tensor-parallel layers, and their weight loading."""
