"""Numbered lessons, one device -> ZeRO stage 0 -> 1 -> 2; each ends in checkpoints. See lessons/README.md."""
