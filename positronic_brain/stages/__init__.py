"""The loop's stages: one module each.

- ``apply``    stage 0/4: prime, extend and patch the cache (the only mutation)
- ``generate`` stage 1: read-only forward of the pending token + sampler
- ``score``    stage 2: a score per live slot (``positronic_brain.scorers``)
- ``decide``   stage 3: culls, merges, folds and the re-index, from the scores
"""
