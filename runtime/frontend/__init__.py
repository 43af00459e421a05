"""What users touch: the Python API, JSONL jobs, tokenization, and drain on signals."""
