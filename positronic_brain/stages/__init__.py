"""The loop's stages: one module or package each, a piece's part of a stage (merge, fold,
recall, turns) a module of that stage's package, named for the piece.

- ``apply``    stage 0/4: prime, extend and patch the cache (the only mutation)
- ``generate`` stage 1: read-only forward of the pending token + sampler
- ``score``    stage 2: a score per live slot (``positronic_brain.scorers``)
- ``decide``   stage 3: culls, merges, folds, recalls and the re-index, from the scores
"""
