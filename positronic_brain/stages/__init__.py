"""The loop's stages: one module each.

- ``apply``    stage 0/4: prime and patch the cache (the only mutation)
- ``generate`` stage 1: read-only forward of the pending token + sampler
"""
