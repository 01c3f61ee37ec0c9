"""``ngrpo diagnose``: the semantic-drift pilot and the side-by-side exploration report.

* :mod:`.drift`: token selection, Gaussian and neighbor-mixing perturbations of input
  embeddings, nearest-token decoding and the drift metrics (pure torch; testable on a
  constructed embedding matrix).
* :mod:`.rollouts`: the same prompts rolled out with several explorers, and the
  exploration metrics of each (accuracy, pass@G, distinct answers and n-grams, edit distance).
* :mod:`.report`: markdown tables and PNG figures of both.
* :mod:`.command`: the command itself (config, model, files, MLflow).
"""
