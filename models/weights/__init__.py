"""Where weights come from: safetensors checkpoints (sliced per rank), random benchmark weights, the embedded default model."""
