"""flash_attn.layers: model building blocks with Dao-AILab's module paths (rotary embeddings)."""
