"""Drafter training for DFlash: self-distillation data (:mod:`.data`)."""
