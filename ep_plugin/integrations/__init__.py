"""Framework adapters: Megatron-core and DeepSpeed."""
