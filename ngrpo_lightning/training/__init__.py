"""The training step: the LightningModule, log-probs on rebuilt inputs, update planning, FSDP2, settings."""
