"""Fine-tuning: LoRA adapters (PEFT format), layer freezing, merging, and importing pretrained models."""
