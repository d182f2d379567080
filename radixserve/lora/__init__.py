"""LoRA adapters: reading peft folders, the slot pool, and the per-batch products."""
