"""Loading a policy (a Hugging Face id or folder, the packaged SmolLM2, tiny test models) and its LoRA adapters."""
