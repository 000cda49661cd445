"""Drafter training for DFlash (paper arXiv:2602.06036 §4).

Data: :mod:`.dataset` (the training-data directory format), :mod:`.distill` (self-distillation:
the target answers prompts), :mod:`.text_data` (text written by others, labelled by the target),
:mod:`.word_problems` (synthetic prompts), :mod:`.draft_vocab`, :mod:`.feature_cache` (target
features on disk). Training: :mod:`.config` (TrainConfig), :mod:`.batching`, :mod:`.loss`,
:mod:`.trainer` (``Trainer``, ``train``), :mod:`.run_dir` (checkpoints and log), :mod:`.plots`.
Export: :mod:`.offline_pack`.
"""
