"""PEFT's adapter_config.json (the LoraConfig saved beside a LoRA adapter) -> the fp8dist `adapter` section."""
