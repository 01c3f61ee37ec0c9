"""``ngrpo diagnose``: the semantic-drift pilot and the side-by-side exploration report.

* :mod:`.drift`: Gaussian and neighbor-mixing perturbations of input embeddings, nearest-token
  decoding and the drift metrics (pure torch).
* :mod:`.rollouts`: the same prompts rolled out with several explorers, and their exploration metrics.
* :mod:`.report`: markdown tables and PNG figures of both.
* :mod:`.command`: the command itself (config, model, files, MLflow)."""
