"""What is trained: model presets and builds, the method (full or LoRA), tokenizer, data formats,
the hub, and the micro-batches."""
