"""Checkpoint export (ModelOpt format), its model card, and the checks it is held to."""
