"""Evaluation through lm-evaluation-harness (``pip install 'waypoint[eval]'``) of any checkpoint the checkpointers
read, with or without a LoRA adapter merged in.

* ``waypoint.evaluation.harness_lm``: ``WaypointLM``, lm-eval's model class over our native model (registered as
  ``waypoint``): loglikelihood, rolling loglikelihood and ``generate_until`` with the KV cache, numbers equal to
  lm-eval's own ``hf`` backend on the same checkpoint.
* ``waypoint.evaluation.harness_tokens``: text to token ids as that backend tokenizes through transformers.
* ``waypoint.evaluation.tasks``: task names, YAML files and include paths checked before the model is read.
* ``waypoint.evaluation.results``: where the results JSON goes, never over an existing file.

Only ``harness_lm`` and ``tasks`` import lm_eval; recipes/eval.py turns its absence into one ``error:`` line.
"""
